//! `Endpoint`: a connection to a remote worker, by socket address, worker address or accepted
//! connection request.

use std::cell::{Cell, RefCell};
use std::ffi::c_void;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::ptr;
use std::rc::Rc;
use std::task::{Context as TaskContext, Poll, Waker};

use ucx1_sys as sys;

use crate::ffi;
use crate::listener::ConnRequest;
use crate::request::{self, CbKind, InFlight, ParamExtra, Posted};
use crate::status::{check, Error, RawStatus, Result};
use crate::worker::{Flush, Worker, WorkerAddress, WorkerInner};

/// How an endpoint reacts to a failing peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ErrorMode {
    /// `UCP_ERR_HANDLING_MODE_PEER`: transports that can detect peer failure are used, failures
    /// are delivered to the endpoint's error handler and fail its operations. The default.
    ///
    /// In UCX 1.12 the shared-memory transports (`posix`, `sysv`) cannot detect peer failure, so
    /// an endpoint in this mode never uses them: with `UCX_TLS=sm` it is unreachable, and with
    /// `sm,tcp` its data goes over TCP. Use [`ErrorMode::None`] for shared memory and detect
    /// failures above UCX (heartbeats).
    #[default]
    Peer,
    /// `UCP_ERR_HANDLING_MODE_NONE`: faster transports may be chosen, but a failed peer can
    /// leave operations hanging.
    None,
}

/// How [`Endpoint::close`] ends an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseMode {
    /// Complete outstanding operations and tell the peer, then release.
    Flush,
    /// Release at once; outstanding operations complete with [`Error::Canceled`]. Needs
    /// [`ErrorMode::Peer`] on both sides.
    Force,
}

/// State the error callback writes; boxed so its address stays fixed for UCX.
pub(crate) struct EpShared {
    error: Cell<Option<RawStatus>>,
    /// Wakers of the live [`EpFailed`] futures, keyed by future: one entry per future, removed
    /// when it is dropped, so a task that polls `failed()` again and again (racing it against
    /// other events) does not pile up clones of its waker (glommio counts them in an `i16` and
    /// panics at 32767).
    wakers: RefCell<Vec<(u64, Waker)>>,
    next_waiter: Cell<u64>,
}

pub(crate) struct EpInner {
    pub(crate) handle: Cell<sys::ucp_ep_h>,
    shared: Cell<Option<Box<EpShared>>>,
    shared_ptr: *const EpShared,
    closed: Cell<bool>,
    mode: ErrorMode,
    pub(crate) worker: Rc<WorkerInner>,
}

/// A UCP endpoint (`ucp_ep_h`). `!Send`, `!Sync`: it belongs to its worker's thread.
///
/// Dropping an endpoint closes it in force mode when its error mode is [`ErrorMode::Peer`]
/// (operations still in flight are cancelled, their buffers released when UCX reports it) and
/// in flush mode otherwise (UCX forbids force mode there); the close completes in the
/// background as the worker progresses. For an orderly end, `close(CloseMode::Flush).await`.
pub struct Endpoint {
    pub(crate) inner: Rc<EpInner>,
}

/// Options for creating an endpoint.
#[derive(Debug, Clone, Copy, Default)]
pub struct EpOptions {
    /// Error handling mode; [`ErrorMode::Peer`] by default.
    pub error_mode: ErrorMode,
}

unsafe extern "C" fn ep_error(arg: *mut c_void, _ep: sys::ucp_ep_h, status: RawStatus) {
    crate::request::guard((), || {
        // SAFETY: `arg` is the boxed `EpShared` of this endpoint; it is kept alive until the
        // endpoint's close completes, after which UCX calls no handler of it.
        let shared = unsafe { &*arg.cast::<EpShared>() };
        if shared.error.get().is_none() {
            shared.error.set(Some(status));
        }
        let wakers = std::mem::take(&mut *shared.wakers.borrow_mut());
        for (_, w) in wakers {
            w.wake();
        }
    })
}

pub(crate) fn sockaddr_of(addr: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain data; all-zero is valid.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is large and aligned enough for any sockaddr.
            unsafe { ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: as above.
            unsafe { ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (storage, len as libc::socklen_t)
}

/// Read a `sockaddr_storage` filled by UCX.
pub(crate) fn socket_addr_from(storage: *const c_void) -> Option<SocketAddr> {
    // SAFETY: the caller passes a pointer to a `sockaddr_storage` written by UCX; the family
    // field tells which layout it holds, and storage is large enough for either.
    unsafe {
        let family = (*storage.cast::<libc::sockaddr_storage>()).ss_family as i32;
        match family {
            libc::AF_INET => {
                let sin = &*storage.cast::<libc::sockaddr_in>();
                let ip = std::net::Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
                Some(SocketAddr::from((ip, u16::from_be(sin.sin_port))))
            }
            libc::AF_INET6 => {
                let sin6 = &*storage.cast::<libc::sockaddr_in6>();
                let ip = std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr);
                Some(SocketAddr::from((ip, u16::from_be(sin6.sin6_port))))
            }
            _ => None,
        }
    }
}

pub(crate) enum Target<'a> {
    Sock(&'a SocketAddr),
    Worker(&'a WorkerAddress),
    Conn(sys::ucp_conn_request_h),
}

impl Endpoint {
    /// Connect to a listener at `addr` (UCX's connection manager; needs a transport that can
    /// carry it, `tcp` in UCX 1.12). Returns at once; operations queue until the connection is
    /// up, and a refused connection shows up as the endpoint's error.
    pub fn connect(worker: &Worker, addr: SocketAddr, opts: EpOptions) -> Result<Self> {
        Self::create(&worker.inner, Target::Sock(&addr), opts)
    }

    /// Connect to a worker by its address (exchanged out of band).
    pub fn connect_to_worker(
        worker: &Worker,
        addr: &WorkerAddress,
        opts: EpOptions,
    ) -> Result<Self> {
        Self::create(&worker.inner, Target::Worker(addr), opts)
    }

    /// Accept a connection request from a [`crate::Listener`].
    pub fn accept(worker: &Worker, request: ConnRequest, opts: EpOptions) -> Result<Self> {
        let raw = request.into_raw();
        Self::create(&worker.inner, Target::Conn(raw), opts)
    }

    pub(crate) fn create(
        worker: &Rc<WorkerInner>,
        target: Target<'_>,
        opts: EpOptions,
    ) -> Result<Self> {
        let shared = Box::new(EpShared {
            error: Cell::new(None),
            wakers: RefCell::new(Vec::new()),
            next_waiter: Cell::new(0),
        });
        let shared_ptr: *const EpShared = &*shared;
        let (storage, socklen) = match &target {
            Target::Sock(a) => sockaddr_of(a),
            // SAFETY: plain data, all-zero valid; unused for these targets.
            _ => (unsafe { std::mem::zeroed() }, 0),
        };
        let mut mask = ffi::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
        let err_mode = match opts.error_mode {
            ErrorMode::Peer => {
                mask |= ffi::UCP_EP_PARAM_FIELD_ERR_HANDLER;
                sys::ucp_err_handling_mode_t::UCP_ERR_HANDLING_MODE_PEER
            }
            ErrorMode::None => sys::ucp_err_handling_mode_t::UCP_ERR_HANDLING_MODE_NONE,
        };
        let mut address = ptr::null();
        let mut flags = 0;
        let mut conn_request = ptr::null_mut();
        match &target {
            Target::Sock(_) => {
                mask |= ffi::UCP_EP_PARAM_FIELD_SOCK_ADDR | ffi::UCP_EP_PARAM_FIELD_FLAGS;
                flags = ffi::UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
            }
            Target::Worker(a) => {
                mask |= ffi::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
                address = a.as_bytes().as_ptr().cast::<sys::ucp_address_t>();
            }
            Target::Conn(c) => {
                mask |= ffi::UCP_EP_PARAM_FIELD_CONN_REQUEST;
                conn_request = *c;
            }
        }
        // Every field written, enum fields with declared variants.
        let params = sys::ucp_ep_params_t {
            field_mask: mask,
            address,
            err_mode,
            err_handler: sys::ucp_err_handler_t {
                cb: ffi::err_cb(ep_error),
                arg: shared_ptr as *mut c_void,
            },
            user_data: ptr::null_mut(),
            flags,
            sockaddr: sys::ucs_sock_addr_t {
                addr: (&storage as *const libc::sockaddr_storage).cast::<sys::sockaddr>(),
                addrlen: socklen,
            },
            conn_request,
            name: ptr::null(),
        };
        let mut ep = ptr::null_mut();
        // SAFETY: ucp.h (`ucp_ep_create`): live worker; the parameters, the socket address and
        // the worker address bytes are valid for the call (UCX copies what it keeps); a
        // connection request is consumed by this call whether it succeeds or not. The error
        // handler's `arg` (the boxed `EpShared`) outlives the endpoint (see `Drop`).
        let st = unsafe { ffi::ucp_ep_create(worker.handle, &params, &mut ep) };
        crate::affinity::after_ucx_start();
        check(st)?;
        if ep.is_null() {
            return Err(Error::NoMemory);
        }
        Ok(Self {
            inner: Rc::new(EpInner {
                handle: Cell::new(ep),
                shared: Cell::new(Some(shared)),
                shared_ptr,
                closed: Cell::new(false),
                mode: opts.error_mode,
                worker: worker.clone(),
            }),
        })
    }

    /// The error UCX reported for this endpoint, if any (peer gone, connection refused...).
    pub fn error(&self) -> Option<Error> {
        self.inner.error()
    }

    /// Resolves with the endpoint's error when UCX reports one.
    pub fn failed(&self) -> EpFailed {
        EpFailed {
            ep: self.inner.clone(),
            key: None,
        }
    }

    /// Flush this endpoint: resolves when every operation posted on it completed remotely.
    pub fn flush(&self) -> Flush {
        Flush {
            worker: self.inner.worker.clone(),
            ep: Some(self.inner.clone()),
            flight: None,
            posted: false,
        }
    }

    /// Close the endpoint. Operations still in flight complete (flush) or are cancelled
    /// (force).
    pub fn close(self, mode: CloseMode) -> Close {
        Close {
            ep: self.inner.clone(),
            mode,
            flight: None,
            posted: false,
        }
    }
}

impl EpInner {
    pub(crate) fn error(&self) -> Option<Error> {
        self.shared().error.get().map(Error::from_raw)
    }

    fn shared(&self) -> &EpShared {
        // SAFETY: `shared_ptr` points to the boxed `EpShared`, alive as long as `self` (and
        // longer, until the close completes, after which UCX calls no error handler of it).
        unsafe { &*self.shared_ptr }
    }

    /// Whether operations may be posted: not closed, not failed.
    #[inline]
    pub(crate) fn usable(&self) -> Result<()> {
        if !self.closed.get() && self.shared().error.get().is_none() {
            return Ok(());
        }
        self.unusable()
    }

    /// Why the endpoint is not [`EpInner::usable`].
    #[cold]
    fn unusable(&self) -> Result<()> {
        if self.closed.get() {
            return Err(Error::EndpointClosed);
        }
        match self.error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Start closing; returns the close's in-flight request, if any.
    fn start_close(&self, mode: CloseMode) -> Option<Result<Option<InFlight>>> {
        if self.closed.replace(true) {
            return None;
        }
        let mode = if self.error().is_some() && self.mode == ErrorMode::Peer {
            CloseMode::Force
        } else {
            mode
        };
        let flags = match mode {
            CloseMode::Force if self.mode == ErrorMode::Peer => ffi::UCP_EP_CLOSE_FLAG_FORCE,
            _ => 0,
        };
        let ep = self.handle.replace(ptr::null_mut());
        let extra = ParamExtra {
            flags: Some(flags),
            ..ParamExtra::default()
        };
        let posted = request::post(&self.worker, CbKind::Send, extra, &[], &[], |param, _| {
            // SAFETY: ucp.h (`ucp_ep_close_nbx`): the endpoint is live and closed once (the
            // handle is swapped out above); force mode only with error mode PEER, as required.
            unsafe { sys::ucp_ep_close_nbx(ep, param) }
        });
        Some(match posted {
            Posted::Now(c) => c.result().map(|_| None),
            Posted::Later(f) => Ok(Some(f)),
        })
    }
}

impl Drop for EpInner {
    fn drop(&mut self) {
        // Dropping is abrupt where UCX allows it (error mode PEER): outstanding operations are
        // cancelled rather than waited for, so teardown never depends on the peer. Call
        // `Endpoint::close(CloseMode::Flush)` to deliver them first.
        let Some(res) = self.start_close(CloseMode::Force) else {
            return;
        };
        if let Ok(Some(mut flight)) = res {
            // The error handler's argument must outlive the close: park it with the request.
            if let Some(shared) = self.shared.take() {
                flight.park(Box::new(shared));
            }
            // Dropping the in-flight close orphans it; the worker completes it later.
            drop(flight);
        }
    }
}

/// Future of [`Endpoint::failed`].
pub struct EpFailed {
    ep: Rc<EpInner>,
    /// This future's entry in the endpoint's waker list, once polled.
    key: Option<u64>,
}

impl Future for EpFailed {
    type Output = Error;

    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Error> {
        if let Some(e) = self.ep.error() {
            return Poll::Ready(e);
        }
        let shared = self.ep.shared();
        let mut wakers = shared.wakers.borrow_mut();
        let entry = self
            .key
            .and_then(|k| wakers.iter_mut().find(|(key, _)| *key == k));
        match entry {
            Some((_, w)) => {
                if !w.will_wake(cx.waker()) {
                    *w = cx.waker().clone();
                }
            }
            None => {
                let k = shared.next_waiter.get();
                shared.next_waiter.set(k.wrapping_add(1));
                wakers.push((k, cx.waker().clone()));
                drop(wakers);
                self.key = Some(k);
            }
        }
        Poll::Pending
    }
}

impl Drop for EpFailed {
    fn drop(&mut self) {
        if let Some(k) = self.key {
            self.ep
                .shared()
                .wakers
                .borrow_mut()
                .retain(|(key, _)| *key != k);
        }
    }
}

/// Future of [`Endpoint::close`].
pub struct Close {
    ep: Rc<EpInner>,
    mode: CloseMode,
    flight: Option<InFlight>,
    posted: bool,
}

impl Future for Close {
    type Output = Result<()>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Result<()>> {
        let this = &mut *self;
        if !this.posted {
            this.posted = true;
            match this.ep.start_close(this.mode) {
                None => return Poll::Ready(Ok(())),
                Some(Err(e)) => return Poll::Ready(Err(e)),
                Some(Ok(None)) => return Poll::Ready(Ok(())),
                Some(Ok(Some(f))) => this.flight = Some(f),
            }
        }
        match this.flight.as_mut() {
            Some(f) => f.poll(cx).map(|c| match c.result() {
                // A force close reports its cancelled operations; the close itself succeeded.
                Err(Error::Canceled) => Ok(()),
                // Closing an endpoint whose peer is gone is not a failure of the close.
                Err(e) if e.is_connection_failure() => Ok(()),
                other => other,
            }),
            None => Poll::Ready(Ok(())),
        }
    }
}

impl Drop for Close {
    fn drop(&mut self) {
        if let Some(mut f) = self.flight.take() {
            if !f.is_done() {
                if let Some(shared) = self.ep.shared.take() {
                    f.park(Box::new(shared));
                }
            }
        }
    }
}
