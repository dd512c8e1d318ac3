//! Active messages: send with a header and a payload; receive through a handler that sees the
//! header and takes eager data or pulls rendezvous data into a buffer it chooses.

use std::cell::RefCell;
use std::ffi::c_void;
use std::future::Future;
use std::pin::Pin;
use std::ptr;
use std::rc::Rc;
use std::task::{Context as TaskContext, Poll};

use ucx1_sys as sys;

use crate::buf::{IoBuf, IoBufMut};
use crate::endpoint::{Endpoint, EpInner};
use crate::ffi;
use crate::request::{self, guard, CbKind, InFlight, ParamExtra, Posted};
use crate::status::{self, check, Error, RawStatus, Result};
use crate::worker::{Worker, WorkerInner};

/// An active-message id (UCX's AM ids are 16 bits).
pub type AmIdRaw = u16;

/// How UCX should carry a message's payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AmProto {
    /// Let UCX choose by size and transport.
    #[default]
    Auto,
    /// Force eager: data is pushed with the header (`UCP_AM_SEND_FLAG_EAGER`).
    Eager,
    /// Force rendezvous: the receiver pulls the data into a buffer it picks
    /// (`UCP_AM_SEND_FLAG_RNDV`).
    Rendezvous,
}

/// A handler that takes what it keeps ([`Worker::set_am_handler`]).
type Handler = Box<dyn FnMut(&[u8], AmPayload)>;
/// A handler that reads eager data in place ([`Worker::set_am_handler_inline`]); `Fn`, so that
/// a send from inside it that UCX delivers at once (to the same worker) may call it again.
type InlineHandler = Box<dyn for<'a> Fn(&'a [u8], AmIncoming<'a>)>;

enum SlotHandler {
    Kept(RefCell<Handler>),
    Inline(InlineHandler),
}

/// A registered handler; boxed, so its address is UCX's `arg`.
pub(crate) struct AmSlot {
    id: AmIdRaw,
    flags: u32,
    handler: SlotHandler,
    worker: *const WorkerInner,
}

impl AmSlot {
    pub(crate) fn clear(&self, worker: sys::ucp_worker_h) {
        let param = handler_param(self.id, self.flags, None, ptr::null_mut());
        // SAFETY: ucp.h (`ucp_worker_set_am_recv_handler`): a NULL callback clears the handler.
        unsafe { ffi::ucp_worker_set_am_recv_handler(worker, &param) };
    }
}

/// The payload of a received active message.
pub enum AmPayload {
    /// Eager data, already here.
    Data(AmData),
    /// Rendezvous data, still at the sender: pull it with [`Worker::am_recv_data`] into a
    /// buffer of your choice, or drop it to decline (the sender's operation then completes).
    Rendezvous(AmRndv),
}

/// What an inline handler ([`Worker::set_am_handler_inline`]) receives.
pub enum AmIncoming<'a> {
    /// Eager data the transport delivered in place (a short message in a shared-memory FIFO
    /// element, a TCP receive buffer): valid during the handler call only, read with no copy
    /// and no UCX descriptor. [`AmIncoming::keep`] copies it.
    Bytes(&'a [u8]),
    /// Eager data in a UCX descriptor (larger eager messages), which may be kept as it is.
    Data(AmData),
    /// Rendezvous data, still at the sender (see [`AmPayload::Rendezvous`]).
    Rendezvous(AmRndv),
}

impl AmIncoming<'_> {
    /// Length of the data in bytes (for rendezvous data, at the sender).
    pub fn len(&self) -> usize {
        match self {
            AmIncoming::Bytes(b) => b.len(),
            AmIncoming::Data(d) => d.len(),
            AmIncoming::Rendezvous(r) => r.len(),
        }
    }

    /// Whether there is no data.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The payload, owned: bytes delivered in place are copied, descriptors and rendezvous
    /// data are moved.
    pub fn keep(self) -> AmPayload {
        match self {
            AmIncoming::Bytes(b) => AmPayload::Data(AmData {
                inner: DataInner::Owned(b.to_vec()),
            }),
            AmIncoming::Data(d) => AmPayload::Data(d),
            AmIncoming::Rendezvous(r) => AmPayload::Rendezvous(r),
        }
    }
}

impl std::fmt::Debug for AmIncoming<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AmIncoming::Bytes(b) => write!(f, "AmIncoming::Bytes({} bytes)", b.len()),
            AmIncoming::Data(d) => d.fmt(f),
            AmIncoming::Rendezvous(r) => r.fmt(f),
        }
    }
}

/// Eager active-message data, kept past the handler (a UCX descriptor or an owned copy).
pub struct AmData {
    inner: DataInner,
}

enum DataInner {
    Desc {
        worker: Rc<WorkerInner>,
        ptr: *mut c_void,
        len: usize,
    },
    Owned(Vec<u8>),
}

/// Rendezvous active-message data waiting at the sender.
pub struct AmRndv {
    worker: Rc<WorkerInner>,
    desc: *mut c_void,
    len: usize,
}

fn handler_param(
    id: AmIdRaw,
    flags: u32,
    cb: Option<ffi::AmRecvCb>,
    arg: *mut c_void,
) -> sys::ucp_am_handler_param_t {
    sys::ucp_am_handler_param_t {
        field_mask: ffi::UCP_AM_HANDLER_PARAM_FIELD_ID
            | ffi::UCP_AM_HANDLER_PARAM_FIELD_FLAGS
            | ffi::UCP_AM_HANDLER_PARAM_FIELD_CB
            | ffi::UCP_AM_HANDLER_PARAM_FIELD_ARG,
        id: id as std::ffi::c_uint,
        flags,
        cb: cb.and_then(ffi::am_recv_cb),
        arg,
    }
}

unsafe extern "C" fn am_recv(
    arg: *mut c_void,
    header: *const c_void,
    header_length: sys::size_t,
    data: *mut c_void,
    length: sys::size_t,
    param: *const sys::ucp_am_recv_param_t,
) -> RawStatus {
    guard(status::UCS_OK, || {
        // SAFETY: `arg` is a boxed `AmSlot` owned by the worker; slots live as long as the
        // worker, and UCX calls handlers only inside `ucp_worker_progress` on it.
        let slot = unsafe { &*arg.cast::<AmSlot>() };
        // SAFETY: the slot's worker pointer is the `WorkerInner` that owns the slot, alive
        // while its progress runs.
        let worker_ref = unsafe { &*slot.worker };
        if worker_ref.dying.get() {
            // The worker is being torn down (its strong count is already zero): take nothing.
            return status::UCS_OK;
        }
        let attr = if param.is_null() {
            0
        } else {
            // SAFETY: ucp_def.h (`ucp_am_recv_callback_t`): `param` is valid during the
            // callback.
            unsafe { (*param).recv_attr }
        };
        let header = if header.is_null() || header_length == 0 {
            &[][..]
        } else {
            // SAFETY: ucp_def.h: `header` points to `header_length` bytes valid during the
            // callback; the slice does not outlive it.
            unsafe { std::slice::from_raw_parts(header.cast::<u8>(), header_length as usize) }
        };
        let rndv = attr & ffi::UCP_AM_RECV_ATTR_FLAG_RNDV != 0;
        let desc = attr & ffi::UCP_AM_RECV_ATTR_FLAG_DATA != 0;
        let kept = rndv || desc;
        let ran = match &slot.handler {
            // Bytes in place (the short messages of the hot path): nothing kept, nothing to
            // book-keep, and a panic is caught (and counted) by `guard` around this callback.
            SlotHandler::Inline(h) if !kept => {
                // SAFETY: as below; no descriptor (neither flag set).
                let incoming = unsafe { incoming(worker_ref, rndv, desc, data, length) };
                h(header, incoming);
                return status::UCS_OK;
            }
            SlotHandler::Inline(h) => {
                // SAFETY: inside UCX's AM callback with its `data` and `length`; the handler
                // gets it for this call only (`InlineHandler`'s lifetime is the call's).
                let incoming = unsafe { incoming(worker_ref, rndv, desc, data, length) };
                with_cb_desc(worker_ref, kept.then_some(data), || {
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h(header, incoming)))
                })
            }
            SlotHandler::Kept(h) => {
                // What the inline handler would get, kept: bytes in place are copied.
                // SAFETY: inside UCX's AM callback with its `data` and `length`; bytes in place
                // are copied at once by `keep`.
                let payload = unsafe { incoming(worker_ref, rndv, desc, data, length) }.keep();
                with_cb_desc(worker_ref, kept.then_some(data), || {
                    // A send from inside the handler that UCX delivers at once to this worker
                    // would call it again: that message is dropped and counted, not a second
                    // mutable borrow.
                    match h.try_borrow_mut() {
                        Ok(mut h) => std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            (h)(header, payload)
                        })),
                        Err(_) => Err(Box::new("re-entered") as Box<dyn std::any::Any + Send>),
                    }
                })
            }
        };
        if ran.0.is_err() {
            crate::request::count_panic();
        }
        if !kept || ran.1 {
            // Nothing kept, or the handler dropped the descriptor: UCX may release it (for
            // rendezvous data, this declines it and completes the sender).
            status::UCS_OK
        } else {
            // The handler kept it: it is released by `AmData`/`AmRndv` later.
            status::UCS_INPROGRESS
        }
    })
}

/// What UCX handed a handler, as [`AmIncoming`]: rendezvous data or a descriptor (each holding
/// the worker), or bytes in place.
///
/// # Safety
///
/// Called from inside UCX's AM callback with its `data` and `length`, on `worker`, and the
/// result is used during that call only (bytes in place are valid for it alone).
unsafe fn incoming<'a>(
    worker: &WorkerInner,
    rndv: bool,
    desc: bool,
    data: *mut c_void,
    length: sys::size_t,
) -> AmIncoming<'a> {
    if rndv {
        AmIncoming::Rendezvous(AmRndv {
            worker: rc_of(worker),
            desc: data,
            len: length as usize,
        })
    } else if desc {
        AmIncoming::Data(AmData {
            inner: DataInner::Desc {
                worker: rc_of(worker),
                ptr: data,
                len: length as usize,
            },
        })
    } else if data.is_null() || length == 0 {
        AmIncoming::Bytes(&[])
    } else {
        // SAFETY: ucp_def.h (`ucp_am_recv_callback_t`): without UCP_AM_RECV_ATTR_FLAG_DATA,
        // `data` points to `length` bytes valid during the callback; the caller uses the slice
        // during it only (see this function's contract).
        AmIncoming::Bytes(unsafe { std::slice::from_raw_parts(data.cast::<u8>(), length as usize) })
    }
}

/// Runs `f` with `desc` among the worker's descriptors of running handlers (see
/// [`release_desc`]), and returns `f`'s result with whether `desc` was released during it.
/// Handlers may run inside one another's calls (a send that UCX delivers at once to this
/// worker), and one may drop another's descriptor: each running one is known until its own
/// call returns, so none is handed back to UCX while UCX still expects an answer for it.
#[inline(always)]
fn with_cb_desc<R>(
    worker: &WorkerInner,
    desc: Option<*mut c_void>,
    f: impl FnOnce() -> R,
) -> (R, bool) {
    let Some(desc) = desc else {
        return (f(), false);
    };
    worker.am_cb_descs.borrow_mut().push((desc, false));
    let r = f();
    let mut running = worker.am_cb_descs.borrow_mut();
    // Calls nest strictly, so this one's descriptor is the last (innermost) one: the swap
    // removes it in place, and would keep the others found by address were it not.
    let released = match running.iter().rposition(|&(d, _)| d == desc) {
        Some(i) => running.swap_remove(i).1,
        None => false,
    };
    (r, released)
}

/// An `Rc` to the worker, from a reference to it obtained inside its own progress call.
fn rc_of(worker: &WorkerInner) -> Rc<WorkerInner> {
    // The slot stores a raw pointer (an `Rc` would make a cycle); the worker is alive because
    // we are inside its progress, and the only owners of `WorkerInner` are `Rc`s, so we can
    // recover one by incrementing the count.
    let raw: *const WorkerInner = worker;
    // SAFETY: `raw` came from `Rc::as_ptr` of a live `Rc<WorkerInner>` (see `set_am_handler`);
    // incrementing the strong count and rebuilding an `Rc` from the same pointer is the
    // documented way to mint a new owner.
    unsafe {
        Rc::increment_strong_count(raw);
        Rc::from_raw(raw)
    }
}

fn release_desc(worker: &WorkerInner, desc: *mut c_void) {
    let running = worker
        .am_cb_descs
        .borrow_mut()
        .iter_mut()
        .rev()
        .find(|(d, _)| *d == desc)
        .map(|(_, released)| *released = true)
        .is_some();
    if !running {
        // SAFETY: ucp.h (`ucp_am_data_release`): releases a descriptor kept by returning
        // UCS_INPROGRESS from the handler (data or rendezvous), exactly once: a descriptor
        // whose handler is still running is not released here but reported to its callback
        // wrapper, which then returns UCS_OK for it instead.
        unsafe { sys::ucp_am_data_release(worker.handle, desc) };
    }
}

impl AmData {
    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        match &self.inner {
            DataInner::Desc { ptr, len, .. } => {
                if ptr.is_null() || *len == 0 {
                    &[]
                } else {
                    // SAFETY: a kept UCX descriptor of `len` bytes, valid until released in
                    // `Drop`; UCX does not write it after delivering it.
                    unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), *len) }
                }
            }
            DataInner::Owned(v) => v,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// Whether the message had no payload.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes as a vector (copies unless they were already copied).
    pub fn into_vec(mut self) -> Vec<u8> {
        match &mut self.inner {
            DataInner::Owned(v) => std::mem::take(v),
            DataInner::Desc { .. } => self.as_slice().to_vec(),
        }
    }
}

impl Drop for AmData {
    fn drop(&mut self) {
        if let DataInner::Desc { worker, ptr, .. } = &self.inner {
            release_desc(worker, *ptr);
        }
    }
}

impl std::fmt::Debug for AmData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AmData({} bytes)", self.len())
    }
}

impl AmRndv {
    /// Length of the data waiting at the sender.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the data is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for AmRndv {
    fn drop(&mut self) {
        if !self.desc.is_null() {
            release_desc(&self.worker, self.desc);
        }
    }
}

impl std::fmt::Debug for AmRndv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AmRndv({} bytes)", self.len)
    }
}

impl std::fmt::Debug for AmPayload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AmPayload::Data(d) => d.fmt(f),
            AmPayload::Rendezvous(r) => r.fmt(f),
        }
    }
}

impl Worker {
    /// Install the handler for active-message `id`, replacing any previous one.
    ///
    /// The handler runs inside [`Worker::progress`] with the message header (valid during the
    /// call only) and the payload, which it may keep: eager data as [`AmData`], rendezvous data
    /// as [`AmRndv`] to pull later with [`Worker::am_recv_data`]. It must not block; a panic in
    /// it is caught and counted ([`crate::callback_panics`]), and the message is dropped.
    pub fn set_am_handler<F>(&self, id: AmIdRaw, handler: F) -> Result<()>
    where
        F: FnMut(&[u8], AmPayload) + 'static,
    {
        self.install_am_handler(
            id,
            ffi::UCP_AM_FLAG_WHOLE_MSG,
            SlotHandler::Kept(RefCell::new(Box::new(handler))),
        )
    }

    /// [`Worker::set_am_handler`] with UCX's `UCP_AM_FLAG_PERSISTENT_DATA`: eager data always
    /// reaches the handler as a UCX descriptor ([`AmData`] backed by UCX's memory), which the
    /// handler may keep past the call and read with no copy by this crate. Where the transport
    /// delivered the bytes inline (a short message in a shared-memory FIFO slot), UCX copies
    /// them into a descriptor from its own memory pool first; where it delivered a descriptor
    /// (larger eager messages), the bytes are not copied at all. The data pointer is aligned to
    /// [`crate::AM_ALIGNMENT`].
    ///
    /// This is the receive side of a hot path that records messages inside `progress` and
    /// handles them right after it returns: keep each [`AmData`] until handled, drop it to
    /// release the descriptor (`ucp_am_data_release`).
    pub fn set_am_handler_persistent<F>(&self, id: AmIdRaw, handler: F) -> Result<()>
    where
        F: FnMut(&[u8], AmPayload) + 'static,
    {
        self.install_am_handler(
            id,
            ffi::UCP_AM_FLAG_WHOLE_MSG | ffi::UCP_AM_FLAG_PERSISTENT_DATA,
            SlotHandler::Kept(RefCell::new(Box::new(handler))),
        )
    }

    /// Install an *inline* handler for active-message `id`, replacing any previous one: the
    /// handler runs inside [`Worker::progress`] and reads eager data where the transport put
    /// it ([`AmIncoming::Bytes`], valid during the call; no UCX descriptor is allocated and
    /// nothing is copied), as `ucx_perftest` does. Larger eager messages that UCX delivers in a
    /// descriptor come as [`AmIncoming::Data`], rendezvous data as [`AmIncoming::Rendezvous`];
    /// both may be kept. The handler may send (ucp.h allows every communication routine but
    /// progress in a callback), must not block, and may be called again from inside itself
    /// when it sends to its own worker; a panic in it is caught and counted.
    pub fn set_am_handler_inline<F>(&self, id: AmIdRaw, handler: F) -> Result<()>
    where
        F: for<'a> Fn(&'a [u8], AmIncoming<'a>) + 'static,
    {
        self.install_am_handler(
            id,
            ffi::UCP_AM_FLAG_WHOLE_MSG,
            SlotHandler::Inline(Box::new(handler)),
        )
    }

    fn install_am_handler(&self, id: AmIdRaw, flags: u32, handler: SlotHandler) -> Result<()> {
        let slot = Box::new(AmSlot {
            id,
            flags,
            handler,
            worker: Rc::as_ptr(&self.inner),
        });
        let arg = (&*slot as *const AmSlot) as *mut c_void;
        let param = handler_param(id, flags, Some(am_recv), arg);
        // SAFETY: ucp.h (`ucp_worker_set_am_recv_handler`): live worker created with
        // UCP_FEATURE_AM (else UCX returns an error); `arg` is a boxed slot that the worker
        // keeps until it is destroyed, so it outlives every call of the handler. Old slots are
        // kept too, since a replaced handler's `arg` is never used again but costs little.
        check(unsafe { ffi::ucp_worker_set_am_recv_handler(self.inner.handle, &param) })?;
        self.inner.am_slots.borrow_mut().push(slot);
        Ok(())
    }

    /// Pull rendezvous data into `buf` (at least `rndv.len()` bytes). Resolves with the
    /// number of bytes received and the buffer.
    pub fn am_recv_data<B: IoBufMut>(&self, rndv: AmRndv, buf: B) -> AmRecvData<B> {
        AmRecvData {
            worker: self.inner.clone(),
            rndv: Some(rndv),
            buf: Some(buf),
            flight: None,
        }
    }
}

/// Future of [`Worker::am_recv_data`].
pub struct AmRecvData<B: IoBufMut> {
    worker: Rc<WorkerInner>,
    rndv: Option<AmRndv>,
    buf: Option<B>,
    flight: Option<InFlight>,
}

impl<B: IoBufMut> Future for AmRecvData<B> {
    type Output = (Result<usize>, B);

    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        if let Some(mut rndv) = this.rndv.take() {
            let Some(buf) = this.buf.as_mut() else {
                return Poll::Pending;
            };
            if buf.bytes_total() < rndv.len {
                let b = this
                    .buf
                    .take()
                    .expect("buffer present until the future resolves");
                // `rndv` drops here, declining the data.
                return Poll::Ready((Err(Error::MessageTruncated), b));
            }
            let desc = std::mem::replace(&mut rndv.desc, ptr::null_mut());
            let len = rndv.len;
            let ptr = buf.stable_mut_ptr();
            let extra = ParamExtra {
                memory_type: Some(buf.memory_type()),
                ..ParamExtra::default()
            };
            let worker = this.worker.handle;
            let posted = request::post(
                &this.worker,
                CbKind::AmRecvData,
                extra,
                &[],
                &[],
                |param, _| {
                    // SAFETY: ucp.h (`ucp_am_recv_data_nbx`): `desc` is a rendezvous descriptor
                    // kept from a handler (UCX takes ownership of it here, even on failure);
                    // `ptr` addresses `len` writable bytes owned by this future until the request
                    // completes (or parked with the worker if the future is dropped).
                    unsafe {
                        sys::ucp_am_recv_data_nbx(
                            worker,
                            desc,
                            ptr.cast(),
                            len as sys::size_t,
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
                    return Poll::Ready((c.result().map(|_| len), b));
                }
                Posted::Later(f) => this.flight = Some(f),
            }
        }
        let Some(f) = this.flight.as_mut() else {
            return Poll::Pending;
        };
        match f.poll(cx) {
            Poll::Ready(c) => {
                this.flight = None;
                let b = this
                    .buf
                    .take()
                    .expect("buffer present until the future resolves");
                Poll::Ready((c.result().map(|_| c.length), b))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<B: IoBufMut> Drop for AmRecvData<B> {
    fn drop(&mut self) {
        if let Some(mut f) = self.flight.take() {
            if let Some(b) = self.buf.take() {
                f.park(Box::new(b));
            }
        }
    }
}

impl Endpoint {
    /// Send active message `id` with `header` (copied; at most the worker's maximum AM header
    /// size) and `payload`. Resolves when UCX no longer needs the payload, handing it back.
    pub fn am_send<B: IoBuf>(
        &self,
        id: AmIdRaw,
        header: &[u8],
        payload: B,
        proto: AmProto,
    ) -> AmSend<B> {
        AmSend {
            ep: self.inner.clone(),
            id,
            header: HeaderBuf::new(header),
            proto,
            bufs: Some(payload),
            flight: None,
        }
    }

    /// Sends active message `id` with `header` and `payload` at once, if UCX can complete the
    /// send in place (`UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL`): on `Ok` UCX has copied both and
    /// needs neither any more, so they may be borrowed (stack, a received descriptor). When
    /// UCX cannot (the message is longer than the transport's short-message limit, or its send
    /// queue is full) it sends nothing and this returns [`Error::NoResource`]: send the bytes
    /// with [`Endpoint::am_send`] instead, from a buffer that lives until completion.
    ///
    /// Nothing is allocated and no completion callback runs: this is the path of an inline
    /// answer from a message handler, also inside a UCX callback (an inline handler,
    /// [`Worker::set_am_handler_inline`]), where the bytes are sent from where they are (an
    /// echo's from UCX's own receive buffer). UCX never answers a forced immediate send with a
    /// request (`ucp_am_send_nbx` checks the flag before it allocates one, in 1.12 as in the
    /// releases since); should one ever do, outside a callback the worker is progressed here
    /// until UCX is done with the bytes, and inside one, where it cannot be, the process is
    /// stopped rather than let UCX read borrowed bytes after this returns.
    #[inline]
    pub fn am_send_now(&self, id: AmIdRaw, header: &[u8], payload: &[u8]) -> Result<()> {
        self.inner.usable()?;
        match status::status_ptr(self.send_imm(id, header, payload)) {
            status::StatusPtr::Done => Ok(()),
            status::StatusPtr::Failed(e) => Err(e),
            status::StatusPtr::Request(req) => {
                let worker = &self.inner.worker;
                if worker.in_progress.get() {
                    // ucp.h (`UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL`): "fail if the operation cannot
                    // be completed immediately", and `ucp_am_send_nbx` returns
                    // UCS_ERR_NO_RESOURCE before allocating a request (ucp_am.c, 1.12 and
                    // later). A UCX that broke this would read `header` and `payload`
                    // (borrowed, maybe UCX's own receive buffer) after this returns, and a
                    // callback cannot progress the worker to finish the request first: stop
                    // here instead. (Until 2026-12-03 a send from inside a callback copied its
                    // bytes into a scratch buffer of the worker's first, kept with such a
                    // request: about 50 instructions per inline answer.)
                    eprintln!(
                        "shardcx-ucx: UCX returned a request for a forced immediate send inside \
                         a callback, against ucp.h; stopping the process"
                    );
                    std::process::abort()
                }
                // Outside a callback the borrowed bytes must not be left with it either:
                // progress here until UCX is done, then free it.
                finish_in_place(worker, req);
                Ok(())
            }
        }
    }

    /// `ucp_am_send_nbx` with forced immediate completion (see [`Endpoint::am_send_now`]).
    #[inline]
    fn send_imm(&self, id: AmIdRaw, header: &[u8], payload: &[u8]) -> sys::ucs_status_ptr_t {
        // Every field is written, with declared enum variants only; the mask names only the
        // force-immediate flag, which keeps UCX on its short-message path (no request, no
        // callback, no datatype other than contiguous bytes).
        let param = sys::ucp_request_param_t {
            op_attr_mask: ffi::UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL,
            flags: 0,
            request: ptr::null_mut(),
            cb: sys::ucp_request_param_t__bindgen_ty_1 { send: None },
            datatype: ffi::UCP_DATATYPE_CONTIG_BYTES,
            user_data: ptr::null_mut(),
            reply_buffer: ptr::null_mut(),
            memory_type: sys::ucs_memory_type::UCS_MEMORY_TYPE_HOST,
            recv_info: sys::ucp_request_param_t__bindgen_ty_2 {
                length: ptr::null_mut(),
            },
        };
        let hdr = if header.is_empty() {
            ptr::null()
        } else {
            header.as_ptr()
        };
        // SAFETY: ucp.h (`ucp_am_send_nbx`, `UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL`: "force immediate
        // complete operation, fail if the operation cannot be completed immediately"): live
        // endpoint (held by `self`); `header` and `payload` are readable for the call. With
        // forced immediate completion UCX either has copied them when it returns (NULL) or has
        // not started (an error status); should it ever return a request, the callers keep
        // the bytes readable until it completes (`am_send_now` progresses the worker until
        // then, or inside a callback never returns).
        unsafe {
            sys::ucp_am_send_nbx(
                self.inner.handle.get(),
                id as std::ffi::c_uint,
                hdr.cast(),
                header.len() as sys::size_t,
                payload.as_ptr().cast(),
                payload.len() as sys::size_t,
                &param,
            )
        }
    }

    /// Send active message `id` whose payload is gathered from several buffers (an iovec).
    pub fn am_send_iov<B: IoBuf>(
        &self,
        id: AmIdRaw,
        header: &[u8],
        payload: Vec<B>,
        proto: AmProto,
    ) -> AmSend<Vec<B>> {
        AmSend {
            ep: self.inner.clone(),
            id,
            header: HeaderBuf::new(header),
            proto,
            bufs: Some(payload),
            flight: None,
        }
    }
}

/// Progresses `worker` until `req` (a request UCX returned for an operation on borrowed bytes)
/// completes, then frees it.
fn finish_in_place(worker: &WorkerInner, req: *mut c_void) {
    loop {
        // SAFETY: ucp.h (`ucp_request_check_status`): `req` is a live request of this worker,
        // not yet freed.
        let st = unsafe { ffi::ucp_request_check_status(req) };
        if st != status::UCS_INPROGRESS {
            break;
        }
        worker.progress();
    }
    // SAFETY: ucp.h (`ucp_request_free`): the request has completed; it is freed once and not
    // used again.
    unsafe { sys::ucp_request_free(req) };
}

/// What an [`AmSend`] sends: one buffer, or several gathered.
pub trait AmPayloadBufs: Unpin + 'static {
    #[doc(hidden)]
    fn describe(
        &self,
    ) -> (
        Vec<sys::ucp_dt_iov_t>,
        Option<(*const u8, usize)>,
        crate::MemoryType,
    );
}

impl<B: IoBuf> AmPayloadBufs for B {
    fn describe(
        &self,
    ) -> (
        Vec<sys::ucp_dt_iov_t>,
        Option<(*const u8, usize)>,
        crate::MemoryType,
    ) {
        (
            Vec::new(),
            Some((self.stable_ptr(), self.bytes_init())),
            self.memory_type(),
        )
    }
}

impl<B: IoBuf> AmPayloadBufs for Vec<B> {
    fn describe(
        &self,
    ) -> (
        Vec<sys::ucp_dt_iov_t>,
        Option<(*const u8, usize)>,
        crate::MemoryType,
    ) {
        let iov = self
            .iter()
            .map(|b| sys::ucp_dt_iov_t {
                buffer: b.stable_ptr() as *mut c_void,
                length: b.bytes_init() as sys::size_t,
            })
            .collect();
        let mt = self
            .first()
            .map(|b| b.memory_type())
            .unwrap_or(crate::MemoryType::Host);
        (iov, None, mt)
    }
}

/// An active-message header held by a send future until it is posted: inline when small, so
/// that sending allocates nothing.
enum HeaderBuf {
    Inline([u8; INLINE_HEADER], u8),
    Heap(Vec<u8>),
}

/// Headers up to this size are kept inline.
const INLINE_HEADER: usize = 64;

impl HeaderBuf {
    fn new(bytes: &[u8]) -> Self {
        if bytes.len() <= INLINE_HEADER {
            let mut a = [0u8; INLINE_HEADER];
            a[..bytes.len()].copy_from_slice(bytes);
            HeaderBuf::Inline(a, bytes.len() as u8)
        } else {
            HeaderBuf::Heap(bytes.to_vec())
        }
    }

    fn as_slice(&self) -> &[u8] {
        match self {
            HeaderBuf::Inline(a, n) => &a[..*n as usize],
            HeaderBuf::Heap(v) => v,
        }
    }

    fn len(&self) -> usize {
        self.as_slice().len()
    }
}

/// Future of [`Endpoint::am_send`] and [`Endpoint::am_send_iov`].
pub struct AmSend<B: AmPayloadBufs> {
    ep: Rc<EpInner>,
    id: AmIdRaw,
    header: HeaderBuf,
    proto: AmProto,
    bufs: Option<B>,
    flight: Option<InFlight>,
}

impl<B: AmPayloadBufs> Future for AmSend<B> {
    type Output = (Result<()>, B);

    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        if this.flight.is_none() {
            let Some(bufs) = this.bufs.as_ref() else {
                return Poll::Pending;
            };
            if let Err(e) = this.ep.usable() {
                let b = this
                    .bufs
                    .take()
                    .expect("buffers present until the future resolves");
                return Poll::Ready((Err(e), b));
            }
            let (iov, contig, mt) = bufs.describe();
            let flags = match this.proto {
                AmProto::Auto => 0,
                AmProto::Eager => ffi::UCP_AM_SEND_FLAG_EAGER,
                AmProto::Rendezvous => ffi::UCP_AM_SEND_FLAG_RNDV,
            };
            let (datatype, count) = match contig {
                Some((_, len)) => (ffi::UCP_DATATYPE_CONTIG_BYTES, len),
                None => (ffi::UCP_DATATYPE_IOV, iov.len()),
            };
            let extra = ParamExtra {
                flags: Some(flags),
                datatype: Some(datatype),
                memory_type: Some(mt),
            };
            // The header and the iovec array are copied into the request state, which lives
            // until completion.
            let hdr_len = this.header.len();
            let ep = this.ep.handle.get();
            let id = this.id as std::ffi::c_uint;
            let posted = request::post(
                &this.ep.worker,
                CbKind::Send,
                extra,
                this.header.as_slice(),
                &iov,
                |param, keep| {
                    let hdr = if hdr_len == 0 {
                        ptr::null()
                    } else {
                        keep.header.as_ptr()
                    };
                    let buffer = match contig {
                        Some((p, _)) => p.cast::<c_void>(),
                        None => keep.iov.as_ptr().cast::<c_void>(),
                    };
                    // SAFETY: ucp.h (`ucp_am_send_nbx`): live endpoint (held by `this.ep`);
                    // `hdr` is `hdr_len` bytes and `buffer` the payload (contiguous bytes or an
                    // iovec array), all owned by the request state or this future until the
                    // request completes, or parked with the worker if the future is dropped.
                    unsafe {
                        sys::ucp_am_send_nbx(
                            ep,
                            id,
                            hdr.cast(),
                            hdr_len as sys::size_t,
                            buffer,
                            count as sys::size_t,
                            param,
                        )
                    }
                },
            );
            match posted {
                Posted::Now(c) => {
                    let b = this
                        .bufs
                        .take()
                        .expect("buffers present until the future resolves");
                    return Poll::Ready((c.result(), b));
                }
                Posted::Later(f) => this.flight = Some(f),
            }
        }
        let Some(f) = this.flight.as_mut() else {
            return Poll::Pending;
        };
        match f.poll(cx) {
            Poll::Ready(c) => {
                this.flight = None;
                let b = this
                    .bufs
                    .take()
                    .expect("buffers present until the future resolves");
                Poll::Ready((c.result(), b))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<B: AmPayloadBufs> Drop for AmSend<B> {
    fn drop(&mut self) {
        if let Some(mut f) = self.flight.take() {
            if let Some(b) = self.bufs.take() {
                f.park(Box::new(b));
            }
        }
    }
}
