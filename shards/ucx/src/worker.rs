//! `Worker`: the UCP worker, its progress engine and its event file descriptor.

use std::cell::{Cell, RefCell};
use std::ffi::{c_char, c_void};
use std::future::Future;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::ptr;
use std::rc::Rc;
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, Instant};

use ucx1_sys as sys;

use crate::am::AmSlot;
use crate::context::{Context, ContextInner};
use crate::ffi;
use crate::request::{self, CbKind, InFlight, Orphans, ParamExtra, Posted};
use crate::status::{self, check, Error, Result};

/// How long a dropped worker keeps progressing to let cancelled or in-flight orphaned requests
/// complete before it leaks their buffers and destroys itself.
const TEARDOWN_BUDGET: Duration = Duration::from_secs(2);

pub(crate) struct WorkerInner {
    pub(crate) handle: sys::ucp_worker_h,
    pub(crate) orphans: Rc<Orphans>,
    /// Finished operation states kept for reuse (see `request::post`).
    #[allow(clippy::vec_box)] // states are handed to UCX by address: they must stay boxed
    pub(crate) spare_ops: RefCell<Vec<Box<request::OpState>>>,
    /// Active-message handler slots; boxed so their addresses (UCX's `arg`) never move when
    /// the vector grows.
    #[allow(clippy::vec_box)] // the box is the point: a stable address per slot
    pub(crate) am_slots: RefCell<Vec<Box<AmSlot>>>,
    /// The AM descriptors whose handlers are running now (innermost last: a handler may run
    /// inside another's call), each with whether it was released during its call.
    #[allow(clippy::type_complexity)]
    pub(crate) am_cb_descs: RefCell<Vec<(*mut c_void, bool)>>,
    /// Set while a UCX callback runs, so that a re-entrant `progress` is refused.
    pub(crate) in_progress: Cell<bool>,
    /// Set when the last owner is gone and teardown has begun.
    pub(crate) dying: Cell<bool>,
    pub(crate) wakeup: bool,
    /// `UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER`, queried once.
    pub(crate) max_am_header: usize,
    /// Keeps the context alive until after the worker is destroyed (declared last, dropped
    /// last).
    _context: Rc<ContextInner>,
}

/// A UCP worker (`ucp_worker_h`): the progress engine, with its endpoints, listeners and
/// active-message handlers.
///
/// A worker is created with `UCS_THREAD_MODE_SINGLE` and must only be used on its own thread:
/// it is neither `Send` nor `Sync`. Nothing happens on it unless [`Worker::progress`] is
/// called; callbacks (completions, active messages, errors) run inside `progress`.
#[derive(Clone)]
pub struct Worker {
    pub(crate) inner: Rc<WorkerInner>,
}

/// A worker's address (`ucp_address_t`), as bytes: send it to a peer out of band, which can
/// then connect with [`crate::Endpoint::connect_to_worker`]. Plain bytes: `Send`, `Sync`.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct WorkerAddress {
    bytes: Vec<u8>,
}

/// A duplicate of a worker's event file descriptor ([`Worker::wakeup_fd`]). Unlike the worker
/// it is `Send`: a helper thread can block on it and tell the worker's thread that events
/// arrived. It refers to the same kernel object as the worker's fd, so it becomes readable
/// exactly when the armed worker has events; it stays valid (but never readable again) after
/// the worker is gone.
#[derive(Debug)]
pub struct WakeupFd {
    fd: OwnedFd,
}

impl WakeupFd {
    /// Block until the fd is readable or `timeout` passes (`None`: no limit). Returns whether
    /// it became readable.
    pub fn wait(&self, timeout: Option<Duration>) -> bool {
        poll_fds(
            &[self.fd.as_raw_fd()],
            timeout.unwrap_or(Duration::from_millis(i32::MAX as u64)),
        )
    }
}

impl AsFd for WakeupFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Result of [`Worker::arm`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Armed {
    /// The event fd will become readable on the next event: it is safe to sleep on it.
    Armed,
    /// Events are pending: call `progress` again before sleeping.
    Busy,
}

impl Worker {
    /// A single-threaded worker on `context`.
    pub fn new(context: &Context) -> Result<Self> {
        let name = b"shardcx\0";
        // SAFETY: `ucp_worker_params_t` holds integers, pointers, a CPU bit set and the
        // `ucs_thread_mode_t` enum, whose zero value is the declared `UCS_THREAD_MODE_SINGLE`;
        // all-zero is a valid value for every field, and the fields we use are then set.
        let mut params: sys::ucp_worker_params_t = unsafe { std::mem::zeroed() };
        params.field_mask = ffi::UCP_WORKER_PARAM_FIELD_THREAD_MODE
            | ffi::UCP_WORKER_PARAM_FIELD_NAME
            | ffi::UCP_WORKER_PARAM_FIELD_AM_ALIGNMENT;
        params.thread_mode = sys::ucs_thread_mode_t::UCS_THREAD_MODE_SINGLE;
        params.name = name.as_ptr().cast::<c_char>();
        params.am_alignment = AM_ALIGNMENT as sys::size_t;
        let mut handle = ptr::null_mut();
        // SAFETY: ucp.h (`ucp_worker_create`): a live context, parameters whose mask names only
        // set fields; on success a worker to destroy with `ucp_worker_destroy`.
        check(unsafe { ffi::ucp_worker_create(context.inner.handle, &params, &mut handle) })?;
        crate::affinity::after_ucx_start();
        if handle.is_null() {
            return Err(Error::NoMemory);
        }
        Ok(Self {
            inner: Rc::new(WorkerInner {
                handle,
                orphans: Rc::new(Orphans::default()),
                spare_ops: RefCell::new(Vec::new()),
                am_slots: RefCell::new(Vec::new()),
                am_cb_descs: RefCell::new(Vec::new()),
                in_progress: Cell::new(false),
                dying: Cell::new(false),
                wakeup: context.inner.features.wakeup,
                max_am_header: query_max_am_header(handle),
                _context: context.inner.clone(),
            }),
        })
    }

    /// The largest active-message header this worker's endpoints can send
    /// (`UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER`), as UCX reported it when the worker was created.
    pub fn max_am_header(&self) -> usize {
        self.inner.max_am_header
    }

    /// Make progress: run pending communication and callbacks. Returns the number of events
    /// processed (0 when idle). Calling it from inside a callback returns 0 and does nothing.
    pub fn progress(&self) -> u32 {
        self.inner.progress()
    }

    /// Whether [`Worker::progress`] is running on this worker now: true inside the callbacks
    /// it runs. A callback that UCX runs from inside another call (a send that a transport
    /// delivers at once, to this same worker) sees `false` unless that call was itself made
    /// inside `progress`.
    pub fn in_progress(&self) -> bool {
        self.inner.in_progress.get()
    }

    /// Arm the worker's event fd for sleeping (needs `Features::wakeup`).
    pub fn arm(&self) -> Result<Armed> {
        // SAFETY: ucp.h (`ucp_worker_arm`): live worker created with UCP_FEATURE_WAKEUP (else
        // UCX returns an error status); returns UCS_ERR_BUSY when events are pending.
        let st = unsafe { ffi::ucp_worker_arm(self.inner.handle) };
        match st {
            status::UCS_OK => Ok(Armed::Armed),
            status::UCS_ERR_BUSY => Ok(Armed::Busy),
            other => Err(Error::from_raw(other)),
        }
    }

    /// The worker's event file descriptor (needs `Features::wakeup`). It stays owned by UCX:
    /// poll it, never close it.
    pub fn event_fd(&self) -> Result<RawFd> {
        let mut fd = -1;
        // SAFETY: ucp.h (`ucp_worker_get_efd`): live worker; writes the fd through a valid
        // pointer. The fd is owned by the worker.
        check(unsafe { ffi::ucp_worker_get_efd(self.inner.handle, &mut fd) })?;
        Ok(fd)
    }

    /// A duplicate of this worker's event fd that another thread may wait on (a waker thread
    /// that tells an executor the worker has events). Arm the worker before waiting.
    pub fn wakeup_fd(&self) -> Result<WakeupFd> {
        let fd = self.event_fd()?;
        // SAFETY: `fd` is the worker's open event fd (owned by UCX, alive while the worker
        // lives); `BorrowedFd` only lives for this statement, during which the worker is alive.
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        let owned = borrowed
            .try_clone_to_owned()
            .map_err(|_| Error::InvalidArgument("cannot duplicate the worker's event fd"))?;
        Ok(WakeupFd { fd: owned })
    }

    /// Wake a thread sleeping on this worker's event fd (`ucp_worker_signal`).
    pub fn signal(&self) -> Result<()> {
        // SAFETY: ucp.h (`ucp_worker_signal`): live worker; safe to call at any time on the
        // owning thread.
        check(unsafe { ffi::ucp_worker_signal(self.inner.handle) })
    }

    /// Progress until idle, then arm and sleep on the event fd for at most `timeout`.
    /// Returns whether an event arrived. Without `Features::wakeup`, it sleeps for a short,
    /// bounded interval instead.
    pub fn wait(&self, timeout: Duration) -> Result<bool> {
        if self.progress() > 0 {
            return Ok(true);
        }
        if !self.inner.wakeup {
            std::thread::sleep(timeout.min(Duration::from_micros(50)));
            return Ok(false);
        }
        match self.arm()? {
            Armed::Busy => Ok(true),
            Armed::Armed => {
                let fd = self.event_fd()?;
                Ok(poll_fds(&[fd], timeout))
            }
        }
    }

    /// This worker's address, for connecting by worker address.
    pub fn address(&self) -> Result<WorkerAddress> {
        let mut addr = ptr::null_mut();
        let mut len: sys::size_t = 0;
        // SAFETY: ucp.h (`ucp_worker_get_address`): live worker; on success `addr` points to
        // `len` bytes that must be released with `ucp_worker_release_address`, which we do
        // after copying them.
        check(unsafe { ffi::ucp_worker_get_address(self.inner.handle, &mut addr, &mut len) })?;
        if addr.is_null() {
            return Err(Error::NoMemory);
        }
        // SAFETY: `addr` points to `len` readable bytes (see above).
        let bytes = unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), len as usize) }.to_vec();
        // SAFETY: releases the address obtained above, once.
        unsafe { sys::ucp_worker_release_address(self.inner.handle, addr) };
        Ok(WorkerAddress { bytes })
    }

    /// UCX's description of this worker: the transports and devices it selected.
    pub fn info(&self) -> String {
        crate::version::capture(|file| {
            // SAFETY: ucp.h (`ucp_worker_print_info`): live worker, valid `FILE*`.
            unsafe { sys::ucp_worker_print_info(self.inner.handle, file) }
        })
    }

    /// Flush every endpoint of this worker: resolves when all outstanding operations have
    /// completed remotely.
    pub fn flush(&self) -> Flush {
        Flush {
            worker: self.inner.clone(),
            ep: None,
            flight: None,
            posted: false,
        }
    }

    /// How many requests of dropped futures UCX has not completed yet.
    pub fn orphaned_requests(&self) -> usize {
        self.inner.orphans.count()
    }

    /// Run `fut` to completion on this thread, progressing this worker (see [`crate::block_on`]).
    pub fn block_on<F: Future>(&self, fut: F) -> F::Output {
        crate::driver::block_on(&[self], fut)
    }
}

impl WorkerInner {
    pub(crate) fn progress(&self) -> u32 {
        if self.in_progress.replace(true) {
            return 0;
        }
        // SAFETY: ucp.h (`ucp_worker_progress`): live worker on its own thread (the worker is
        // `!Send`); not called re-entrantly (guarded above).
        let n = unsafe { sys::ucp_worker_progress(self.handle) };
        self.in_progress.set(false);
        n
    }
}

impl Drop for WorkerInner {
    fn drop(&mut self) {
        // Endpoints, listeners, live futures and AM descriptors hold an `Rc` to us, so they are
        // gone. What may remain: requests of dropped futures (and endpoint closes). Cancel them
        // and progress until they complete, within a bound. No handler may mint new owners of
        // this worker from here on.
        self.dying.set(true);
        for slot in self.am_slots.borrow().iter() {
            slot.clear(self.handle);
        }
        let deadline = Instant::now() + TEARDOWN_BUDGET;
        loop {
            let outstanding = self.orphans.snapshot();
            if outstanding.is_empty() {
                break;
            }
            for r in outstanding {
                if self.orphans.contains(r) {
                    // SAFETY: ucp.h (`ucp_request_cancel`): `r` is an orphaned request of
                    // this worker, not yet freed (its callback removes it from the set when it
                    // frees it, and membership is checked right before each cancel).
                    unsafe { sys::ucp_request_cancel(self.handle, r) };
                }
            }
            self.progress();
            if Instant::now() >= deadline {
                // Leak what is left: its buffers may still be written by UCX.
                break;
            }
        }
        // SAFETY: ucp.h (`ucp_worker_destroy`): destroys the worker once; every endpoint and
        // listener of it is already destroyed (they hold an `Rc` to us), and UCX does not call
        // our callbacks after this returns.
        unsafe { sys::ucp_worker_destroy(self.handle) };
    }
}

impl WorkerAddress {
    /// The address bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// An address from bytes received from a peer. UCX validates them when connecting.
    pub fn from_bytes(bytes: Vec<u8>) -> Self {
        Self { bytes }
    }
}

impl std::fmt::Debug for WorkerAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WorkerAddress({} bytes)", self.bytes.len())
    }
}

/// Future of [`Worker::flush`] and [`crate::Endpoint::flush`].
pub struct Flush {
    pub(crate) worker: Rc<WorkerInner>,
    pub(crate) ep: Option<Rc<crate::endpoint::EpInner>>,
    pub(crate) flight: Option<InFlight>,
    pub(crate) posted: bool,
}

impl Future for Flush {
    type Output = Result<()>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Result<()>> {
        let this = &mut *self;
        if !this.posted {
            this.posted = true;
            let ep = this.ep.clone();
            if let Some(ep) = &ep {
                if let Err(e) = ep.usable() {
                    return Poll::Ready(Err(e));
                }
            }
            let worker = this.worker.handle;
            let posted = request::post(
                &this.worker,
                CbKind::Send,
                ParamExtra::default(),
                &[],
                &[],
                |param, _| {
                    match &ep {
                        // SAFETY: ucp.h (`ucp_ep_flush_nbx`): live endpoint (held by `ep`),
                        // parameters fully initialised by `post`.
                        Some(ep) => unsafe { sys::ucp_ep_flush_nbx(ep.handle.get(), param) },
                        // SAFETY: ucp.h (`ucp_worker_flush_nbx`): live worker, as above.
                        None => unsafe { sys::ucp_worker_flush_nbx(worker, param) },
                    }
                },
            );
            match posted {
                Posted::Now(c) => return Poll::Ready(c.result()),
                Posted::Later(f) => this.flight = Some(f),
            }
        }
        match this.flight.as_mut() {
            Some(f) => f.poll(cx).map(|c| c.result()),
            None => Poll::Ready(Err(Error::Canceled)),
        }
    }
}

/// Minimal alignment of active-message data pointers handed to handlers
/// (`UCP_WORKER_PARAM_FIELD_AM_ALIGNMENT`): eager payloads arrive aligned for in-place reading
/// of 16-aligned archives (rkyv).
pub const AM_ALIGNMENT: usize = 16;

/// `max_am_header` of a fresh worker (0 when the query fails: every header is then refused by
/// callers that check it, and UCX itself still reports its own error).
fn query_max_am_header(handle: sys::ucp_worker_h) -> usize {
    // SAFETY: `ucp_worker_attr_t` holds integers, pointers and the `ucs_thread_mode_t` enum,
    // whose zero value is the declared `UCS_THREAD_MODE_SINGLE`: all-zero is valid, and only the
    // field named in the mask is read back.
    let mut attr: sys::ucp_worker_attr_t = unsafe { std::mem::zeroed() };
    attr.field_mask = ffi::UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER;
    // SAFETY: ucp.h (`ucp_worker_query`): live worker, attribute struct with a field mask naming
    // only `max_am_header`, which UCX fills in; nothing is allocated for it.
    let st = unsafe { ffi::ucp_worker_query(handle, &mut attr) };
    if st == status::UCS_OK {
        attr.max_am_header as usize
    } else {
        0
    }
}

/// Wait until one of `fds` is readable, or `timeout` passes. Returns whether one was readable.
pub(crate) fn poll_fds(fds: &[RawFd], timeout: Duration) -> bool {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: poll(2) on a valid array of `pfds.len()` pollfd structs.
    let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
    n > 0
}
