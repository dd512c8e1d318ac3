//! The life of one UCX request, and what happens to its buffers when its future is dropped.
//!
//! Every operation allocates an [`OpState`] on the heap and hands its address to UCX as the
//! request's `user_data`. Then:
//!
//! - **completed immediately**: UCX returned `NULL` or an error; the state is freed at once and
//!   the future resolves with its buffers.
//! - **in flight**: UCX returned a request. The completion callback stores the status in the
//!   state and wakes the future, which frees the request and the state and returns the buffers.
//! - **future dropped while in flight**: the buffers are moved into the state (*parked*), the
//!   state is marked orphaned and recorded with the worker, and the request is cancelled with
//!   `ucp_request_cancel`. The request is *not* freed: `ucp_request_free` disables the callback,
//!   and the callback is the only way to learn that UCX no longer touches the buffers. When the
//!   callback finally runs (at once for a cancelled tag receive, after the data has moved for a
//!   send UCX cannot abort), it frees the request, the state and the parked buffers.
//! - **worker dropped with orphans outstanding**: the worker cancels them and progresses until
//!   they complete, for a bounded time; whatever is still outstanding then is leaked on purpose
//!   (never freed while UCX may write into it) before the worker is destroyed.
//!
//! Callbacks run inside `ucp_worker_progress` (or `ucp_request_cancel`) on the worker's thread.
//! They only record results and wake wakers, never call back into the worker, and never unwind
//! into C: a panic (from a waker, say) is caught and counted, see [`callback_panics`].

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::collections::HashSet;
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, Waker};

use ucx1_sys as sys;

use crate::buf::MemoryType;
use crate::ffi;
use crate::status::{self, Error, RawStatus, StatusPtr};
use crate::worker::WorkerInner;

static CALLBACK_PANICS: AtomicU64 = AtomicU64::new(0);

/// How many panics were caught inside UCX callbacks (wakers, active-message handlers) in this
/// process. A panic there is never allowed to unwind into C; it is caught, counted here, and
/// the operation or message concerned is treated as failed or dropped.
pub fn callback_panics() -> u64 {
    CALLBACK_PANICS.load(Ordering::Relaxed)
}

/// Run `f` inside a C callback, catching and counting any panic.
#[inline(always)]
pub(crate) fn guard<R>(default: R, f: impl FnOnce() -> R) -> R {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(_) => {
            CALLBACK_PANICS.fetch_add(1, Ordering::Relaxed);
            default
        }
    }
}

/// The requests whose futures were dropped before UCX finished with them.
#[derive(Default)]
pub(crate) struct Orphans {
    requests: RefCell<HashSet<usize>>,
}

impl Orphans {
    pub(crate) fn count(&self) -> usize {
        self.requests.borrow().len()
    }

    pub(crate) fn contains(&self, request: *mut c_void) -> bool {
        self.requests.borrow().contains(&(request as usize))
    }

    /// Snapshot of the outstanding requests (the set may change while they are cancelled).
    pub(crate) fn snapshot(&self) -> Vec<*mut c_void> {
        self.requests
            .borrow()
            .iter()
            .map(|&r| r as *mut c_void)
            .collect()
    }
}

/// What one completion carried.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Completion {
    pub(crate) status: RawStatus,
    pub(crate) length: usize,
    pub(crate) sender_tag: u64,
}

impl Completion {
    pub(crate) fn result(&self) -> Result<(), Error> {
        status::completion(self.status)
    }
}

/// Per-operation state shared with UCX through `user_data`.
pub(crate) struct OpState {
    done: Cell<Option<Completion>>,
    waker: RefCell<Option<Waker>>,
    orphaned: Cell<bool>,
    parked: Cell<Option<Box<dyn Any>>>,
    /// Memory UCX reads during the operation that the state itself owns (an AM header, an
    /// iovec array): it lives exactly as long as the request.
    keep: Keep,
    orphans: Rc<Orphans>,
}

/// Memory an operation's request owns: an AM header and an iovec array.
#[derive(Default)]
pub(crate) struct Keep {
    pub(crate) header: Vec<u8>,
    pub(crate) iov: Vec<sys::ucp_dt_iov_t>,
}

pub(crate) fn count_panic() {
    CALLBACK_PANICS.fetch_add(1, Ordering::Relaxed);
}

/// What kind of completion callback an operation uses.
#[derive(Clone, Copy)]
pub(crate) enum CbKind {
    Send,
    TagRecv,
    AmRecvData,
}

/// Optional parts of `ucp_request_param_t`.
#[derive(Default)]
pub(crate) struct ParamExtra {
    pub(crate) flags: Option<u32>,
    pub(crate) datatype: Option<sys::ucp_datatype_t>,
    pub(crate) memory_type: Option<MemoryType>,
}

/// An operation whose request UCX holds.
pub(crate) struct InFlight {
    state: NonNull<OpState>,
    request: *mut c_void,
    finished: bool,
    worker: Rc<WorkerInner>,
}

/// The outcome of posting an operation.
pub(crate) enum Posted {
    Now(Completion),
    Later(InFlight),
}

unsafe extern "C" fn send_done(request: *mut c_void, status: RawStatus, user: *mut c_void) {
    // SAFETY: `user` is the `OpState` pointer this crate gave UCX for this request; the state
    // stays allocated until this callback (orphaned case) or the owning future frees it after
    // seeing `done`.
    unsafe { complete(request, user, status, 0, 0) }
}

unsafe extern "C" fn tag_recv_done(
    request: *mut c_void,
    status: RawStatus,
    info: *const sys::ucp_tag_recv_info_t,
    user: *mut c_void,
) {
    let (len, tag) = if info.is_null() {
        (0, 0)
    } else {
        // SAFETY: ucp.h (`ucp_tag_recv_nbx_callback_t`): `tag_info` points to the receive
        // information, valid for the duration of the callback.
        let i = unsafe { &*info };
        (i.length as usize, i.sender_tag)
    };
    // SAFETY: as in `send_done`.
    unsafe { complete(request, user, status, len, tag) }
}

unsafe extern "C" fn am_data_done(
    request: *mut c_void,
    status: RawStatus,
    length: sys::size_t,
    user: *mut c_void,
) {
    // SAFETY: as in `send_done`.
    unsafe { complete(request, user, status, length as usize, 0) }
}

/// # Safety
/// `user` must be a live `OpState` created by [`post`] for `request`.
unsafe fn complete(
    request: *mut c_void,
    user: *mut c_void,
    status: RawStatus,
    length: usize,
    sender_tag: u64,
) {
    guard((), || {
        let state_ptr = user.cast::<OpState>();
        // SAFETY: the caller's contract: the state is alive.
        let state = unsafe { &*state_ptr };
        if state.orphaned.get() {
            state
                .orphans
                .requests
                .borrow_mut()
                .remove(&(request as usize));
            // SAFETY: ucp.h (`ucp_request_free`): releases a request; it may be called from its
            // completion callback, where the request is already marked completed and goes back
            // to the worker's pool at once. Nothing else refers to this request any more: its
            // future is gone.
            unsafe { sys::ucp_request_free(request) };
            // SAFETY: the state was leaked from a `Box` in `post`; its future is gone and UCX
            // has now completed the request, so this is the last reference. Dropping it drops
            // the parked buffers, which UCX no longer uses.
            drop(unsafe { Box::from_raw(state_ptr) });
        } else {
            state.done.set(Some(Completion {
                status,
                length,
                sender_tag,
            }));
            let waker = state.waker.borrow_mut().take();
            if let Some(w) = waker {
                w.wake();
            }
        }
    })
}

/// Post an operation. `call` receives the request parameters (callback and user data already
/// set) and the state's `keep` bytes, and returns UCX's status pointer.
pub(crate) fn post(
    worker: &Rc<WorkerInner>,
    kind: CbKind,
    extra: ParamExtra,
    header: &[u8],
    iov: &[sys::ucp_dt_iov_t],
    call: impl FnOnce(&sys::ucp_request_param_t, &Keep) -> *mut c_void,
) -> Posted {
    // States are recycled through the worker's free list: no allocation per operation in the
    // steady state.
    let spare = worker.spare_ops.borrow_mut().pop();
    let mut state = spare.unwrap_or_else(|| {
        Box::new(OpState {
            done: Cell::new(None),
            waker: RefCell::new(None),
            orphaned: Cell::new(false),
            parked: Cell::new(None),
            keep: Keep::default(),
            orphans: worker.orphans.clone(),
        })
    });
    state.keep.header.extend_from_slice(header);
    state.keep.iov.extend_from_slice(iov);
    let state_ptr = Box::into_raw(state);
    let mut recv_len: sys::size_t = 0;
    // SAFETY: `ucp_tag_recv_info_t` is two integers; all-zero is a valid value.
    let mut tag_info: sys::ucp_tag_recv_info_t = unsafe { std::mem::zeroed() };

    let mut mask = ffi::UCP_OP_ATTR_FIELD_CALLBACK | ffi::UCP_OP_ATTR_FIELD_USER_DATA;
    let cb = match kind {
        CbKind::Send => sys::ucp_request_param_t__bindgen_ty_1 {
            send: ffi::send_cb(send_done),
        },
        CbKind::TagRecv => {
            // UCX 1.12's `ucp_tag_recv_nbx` ignores `recv_info` on immediate completion (only
            // later releases fill it), so the sender tag and length of a message matched at
            // once would be lost. Deny immediate completion: UCX then runs the callback, with
            // the information, before returning the request.
            mask |= ffi::UCP_OP_ATTR_FIELD_RECV_INFO | ffi::UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
            sys::ucp_request_param_t__bindgen_ty_1 {
                recv: ffi::tag_recv_cb(tag_recv_done),
            }
        }
        CbKind::AmRecvData => {
            mask |= ffi::UCP_OP_ATTR_FIELD_RECV_INFO;
            sys::ucp_request_param_t__bindgen_ty_1 {
                recv_am: ffi::am_recv_data_cb(am_data_done),
            }
        }
    };
    let recv_info = match kind {
        CbKind::TagRecv => sys::ucp_request_param_t__bindgen_ty_2 {
            tag_info: &mut tag_info,
        },
        _ => sys::ucp_request_param_t__bindgen_ty_2 {
            length: &mut recv_len,
        },
    };
    let mut flags = 0;
    if let Some(f) = extra.flags {
        mask |= ffi::UCP_OP_ATTR_FIELD_FLAGS;
        flags = f;
    }
    let mut datatype = ffi::UCP_DATATYPE_CONTIG_BYTES;
    if let Some(dt) = extra.datatype {
        mask |= ffi::UCP_OP_ATTR_FIELD_DATATYPE;
        datatype = dt;
    }
    let mut memory_type = sys::ucs_memory_type::UCS_MEMORY_TYPE_HOST;
    if let Some(mt) = extra.memory_type {
        mask |= ffi::UCP_OP_ATTR_FIELD_MEMORY_TYPE;
        memory_type = match mt {
            MemoryType::Host => sys::ucs_memory_type::UCS_MEMORY_TYPE_HOST,
            MemoryType::Cuda => sys::ucs_memory_type::UCS_MEMORY_TYPE_CUDA,
        };
    }
    // Every field is written, with declared enum variants only.
    let param = sys::ucp_request_param_t {
        op_attr_mask: mask,
        flags,
        request: std::ptr::null_mut(),
        cb,
        datatype,
        user_data: state_ptr.cast(),
        reply_buffer: std::ptr::null_mut(),
        memory_type,
        recv_info,
    };
    // SAFETY: `state_ptr` is a live box we own; `keep` is only read, here and by UCX, and its
    // heap memory stays where it is until the state is freed.
    let keep = unsafe { &(*state_ptr).keep };
    let ptr = call(&param, keep);
    match status::status_ptr(ptr) {
        StatusPtr::Request(request) => Posted::Later(InFlight {
            // SAFETY: `state_ptr` came from `Box::into_raw`, so it is non-null.
            state: unsafe { NonNull::new_unchecked(state_ptr) },
            request,
            finished: false,
            worker: worker.clone(),
        }),
        other => {
            // SAFETY: completed immediately (or failed to start): UCX does not call the
            // callback (ucp.h: "the callback is not invoked if the operation completes
            // immediately") and keeps no reference to the state.
            recycle(worker, unsafe { Box::from_raw(state_ptr) });
            let (status, length, sender_tag) = match other {
                StatusPtr::Done => match kind {
                    CbKind::TagRecv => (
                        status::UCS_OK,
                        tag_info.length as usize,
                        tag_info.sender_tag,
                    ),
                    _ => (status::UCS_OK, recv_len as usize, 0),
                },
                StatusPtr::Failed(e) => (e.raw().unwrap_or(-1), 0, 0),
                StatusPtr::Request(_) => unreachable!("handled above"),
            };
            Posted::Now(Completion {
                status,
                length,
                sender_tag,
            })
        }
    }
}

/// Most states a worker keeps for reuse.
const SPARE_OPS: usize = 256;
/// Largest header buffer a recycled state keeps.
const SPARE_HEADER_CAPACITY: usize = 4096;

/// Return a finished state to the worker's free list (or free it).
fn recycle(worker: &WorkerInner, mut state: Box<OpState>) {
    state.done.set(None);
    state.waker.get_mut().take();
    state.parked.get_mut().take();
    state.orphaned.set(false);
    state.keep.header.clear();
    state.keep.iov.clear();
    if state.keep.header.capacity() > SPARE_HEADER_CAPACITY {
        state.keep.header = Vec::new();
    }
    let mut spare = worker.spare_ops.borrow_mut();
    if spare.len() < SPARE_OPS {
        spare.push(state);
    }
}

impl InFlight {
    /// Poll for completion; on completion the request is released.
    pub(crate) fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Completion> {
        if self.finished {
            // Polled again after completion: report cancellation rather than panic.
            return Poll::Ready(Completion {
                status: status::UCS_ERR_CANCELED,
                length: 0,
                sender_tag: 0,
            });
        }
        // SAFETY: the state is alive until this `InFlight` frees it or orphans it.
        let state = unsafe { self.state.as_ref() };
        if let Some(done) = state.done.get() {
            self.release();
            return Poll::Ready(done);
        }
        let mut slot = state.waker.borrow_mut();
        match &*slot {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => *slot = Some(cx.waker().clone()),
        }
        Poll::Pending
    }

    /// Whether UCX has reported completion (without consuming it).
    pub(crate) fn is_done(&self) -> bool {
        // SAFETY: as in `poll`.
        self.finished || unsafe { self.state.as_ref() }.done.get().is_some()
    }

    /// Park buffers with the state until UCX completes the request.
    pub(crate) fn park(&mut self, buffers: Box<dyn Any>) {
        if !self.finished {
            // SAFETY: as in `poll`.
            unsafe { self.state.as_ref() }.parked.set(Some(buffers));
        }
    }

    fn release(&mut self) {
        self.finished = true;
        // SAFETY: ucp.h (`ucp_request_free`): the request completed (its callback ran), so it
        // returns to the worker's pool at once; we never use it again.
        unsafe { sys::ucp_request_free(self.request) };
        // SAFETY: the callback ran, so UCX holds no reference to the state; we are its owner.
        recycle(&self.worker, unsafe { Box::from_raw(self.state.as_ptr()) });
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        // SAFETY: as in `poll`.
        let state = unsafe { self.state.as_ref() };
        if state.done.get().is_some() {
            // Completed but never polled: release normally; parked buffers drop with the state.
            self.release();
            return;
        }
        state.orphaned.set(true);
        self.worker
            .orphans
            .requests
            .borrow_mut()
            .insert(self.request as usize);
        self.finished = true;
        // SAFETY: ucp.h (`ucp_request_cancel`): cancels an outstanding request; if it can be
        // cancelled its callback runs with UCS_ERR_CANCELED (possibly right here, which frees
        // the orphaned state), otherwise the operation completes normally later. The request
        // was returned by this worker and has not been freed. After this call the state may be
        // gone, so it is not touched again.
        unsafe { sys::ucp_request_cancel(self.worker.handle, self.request) };
    }
}
