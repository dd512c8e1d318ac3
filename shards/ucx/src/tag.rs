//! Tag-matched send and receive.

use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context as TaskContext, Poll};

use ucx1_sys as sys;

use crate::buf::{IoBuf, IoBufMut};
use crate::endpoint::{Endpoint, EpInner};
use crate::request::{self, CbKind, InFlight, ParamExtra, Posted};
use crate::status::Result;
use crate::worker::{Worker, WorkerInner};

/// What a completed tag receive got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TagRecvInfo {
    /// The tag the sender used (it matched `tag` under `mask`).
    pub sender_tag: u64,
    /// Bytes received.
    pub len: usize,
}

impl Endpoint {
    /// Send `buf` with `tag`. Resolves when the buffer may be reused, handing it back.
    pub fn tag_send<B: IoBuf>(&self, tag: u64, buf: B) -> TagSend<B> {
        TagSend {
            ep: self.inner.clone(),
            tag,
            buf: Some(buf),
            flight: None,
        }
    }
}

impl Worker {
    /// Receive into `buf` the first message whose tag `t` satisfies `t & mask == tag & mask`,
    /// from any endpoint of this worker. Messages that arrived earlier are matched at once.
    /// A message longer than `buf` fails with [`crate::Error::MessageTruncated`].
    pub fn tag_recv<B: IoBufMut>(&self, tag: u64, mask: u64, buf: B) -> TagRecv<B> {
        TagRecv {
            worker: self.inner.clone(),
            tag,
            mask,
            buf: Some(buf),
            flight: None,
        }
    }
}

/// Future of [`Endpoint::tag_send`].
pub struct TagSend<B: IoBuf> {
    ep: Rc<EpInner>,
    tag: u64,
    buf: Option<B>,
    flight: Option<InFlight>,
}

impl<B: IoBuf> Future for TagSend<B> {
    type Output = (Result<()>, B);

    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        if this.flight.is_none() {
            let Some(buf) = this.buf.as_ref() else {
                return Poll::Pending;
            };
            if let Err(e) = this.ep.usable() {
                let b = this
                    .buf
                    .take()
                    .expect("buffer present until the future resolves");
                return Poll::Ready((Err(e), b));
            }
            let (ptr, len) = (buf.stable_ptr(), buf.bytes_init());
            let extra = ParamExtra {
                memory_type: Some(buf.memory_type()),
                ..ParamExtra::default()
            };
            let (ep, tag) = (this.ep.handle.get(), this.tag);
            let posted = request::post(
                &this.ep.worker,
                CbKind::Send,
                extra,
                &[],
                &[],
                |param, _| {
                    // SAFETY: ucp.h (`ucp_tag_send_nbx`): live endpoint; `ptr` is `len` readable
                    // bytes owned by this future until completion (or parked if it is dropped).
                    unsafe { sys::ucp_tag_send_nbx(ep, ptr.cast(), len as sys::size_t, tag, param) }
                },
            );
            match posted {
                Posted::Now(c) => {
                    let b = this
                        .buf
                        .take()
                        .expect("buffer present until the future resolves");
                    return Poll::Ready((c.result(), b));
                }
                Posted::Later(f) => this.flight = Some(f),
            }
        }
        finish(&mut this.flight, &mut this.buf, cx, |c| c.result())
    }
}

impl<B: IoBuf> Drop for TagSend<B> {
    fn drop(&mut self) {
        park(&mut self.flight, &mut self.buf);
    }
}

/// Future of [`Worker::tag_recv`].
pub struct TagRecv<B: IoBufMut> {
    worker: Rc<WorkerInner>,
    tag: u64,
    mask: u64,
    buf: Option<B>,
    flight: Option<InFlight>,
}

impl<B: IoBufMut> Future for TagRecv<B> {
    type Output = (Result<TagRecvInfo>, B);

    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        if this.flight.is_none() {
            let Some(buf) = this.buf.as_mut() else {
                return Poll::Pending;
            };
            let (ptr, len) = (buf.stable_mut_ptr(), buf.bytes_total());
            let extra = ParamExtra {
                memory_type: Some(buf.memory_type()),
                ..ParamExtra::default()
            };
            let (worker, tag, mask) = (this.worker.handle, this.tag, this.mask);
            let posted = request::post(
                &this.worker,
                CbKind::TagRecv,
                extra,
                &[],
                &[],
                |param, _| {
                    // SAFETY: ucp.h (`ucp_tag_recv_nbx`): live worker; `ptr` is `len` writable
                    // bytes owned by this future until completion, or parked with the worker if
                    // the future is dropped (the request is then cancelled).
                    unsafe {
                        sys::ucp_tag_recv_nbx(
                            worker,
                            ptr.cast(),
                            len as sys::size_t,
                            tag,
                            mask,
                            param,
                        )
                    }
                },
            );
            match posted {
                Posted::Now(c) => {
                    let b = this
                        .buf
                        .take()
                        .expect("buffer present until the future resolves");
                    return Poll::Ready((recv_result(c), b));
                }
                Posted::Later(f) => this.flight = Some(f),
            }
        }
        finish(&mut this.flight, &mut this.buf, cx, recv_result)
    }
}

impl<B: IoBufMut> Drop for TagRecv<B> {
    fn drop(&mut self) {
        park(&mut self.flight, &mut self.buf);
    }
}

fn recv_result(c: request::Completion) -> Result<TagRecvInfo> {
    c.result().map(|_| TagRecvInfo {
        sender_tag: c.sender_tag,
        len: c.length,
    })
}

/// Common tail of an owned-buffer operation: wait for the request, then hand the buffer back.
pub(crate) fn finish<B, T>(
    flight: &mut Option<InFlight>,
    buf: &mut Option<B>,
    cx: &mut TaskContext<'_>,
    map: impl FnOnce(request::Completion) -> Result<T>,
) -> Poll<(Result<T>, B)> {
    let Some(f) = flight.as_mut() else {
        return Poll::Pending;
    };
    match f.poll(cx) {
        Poll::Ready(c) => {
            *flight = None;
            match buf.take() {
                Some(b) => Poll::Ready((map(c), b)),
                None => Poll::Pending,
            }
        }
        Poll::Pending => Poll::Pending,
    }
}

/// Common drop of an owned-buffer operation: park the buffer with an unfinished request.
pub(crate) fn park<B: 'static>(flight: &mut Option<InFlight>, buf: &mut Option<B>) {
    if let Some(mut f) = flight.take() {
        if let Some(b) = buf.take() {
            f.park(Box::new(b));
        }
    }
}
