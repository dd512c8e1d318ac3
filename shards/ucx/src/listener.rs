//! `Listener`: accept connections on a socket address.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::ffi::c_void;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::ptr;
use std::rc::Rc;
use std::task::{Context as TaskContext, Poll, Waker};

use ucx1_sys as sys;

use crate::endpoint::socket_addr_from;
use crate::ffi;
use crate::status::{check, Error, Result};
use crate::worker::{Worker, WorkerInner};

struct ListenerShared {
    queue: RefCell<VecDeque<sys::ucp_conn_request_h>>,
    waker: RefCell<Option<Waker>>,
}

struct ListenerInner {
    handle: sys::ucp_listener_h,
    shared: Box<ListenerShared>,
    // Declared last: the worker outlives the listener.
    worker: Rc<WorkerInner>,
}

/// A UCP listener (`ucp_listener_h`) on a socket address. `!Send`, `!Sync`.
///
/// Incoming connection requests queue in the listener until taken with [`Listener::accept`] or
/// [`Listener::try_accept`]; each must then be accepted ([`crate::Endpoint::accept`]) or
/// rejected, and a request that is dropped is rejected.
pub struct Listener {
    inner: Rc<ListenerInner>,
}

/// A pending connection request from a client.
pub struct ConnRequest {
    raw: sys::ucp_conn_request_h,
    listener: Option<Rc<ListenerInner>>,
}

unsafe extern "C" fn on_conn(request: sys::ucp_conn_request_h, arg: *mut c_void) {
    crate::request::guard((), || {
        // SAFETY: `arg` is the listener's boxed `ListenerShared`, alive until the listener is
        // destroyed, after which UCX calls no handler of it.
        let shared = unsafe { &*arg.cast::<ListenerShared>() };
        shared.queue.borrow_mut().push_back(request);
        let waker = shared.waker.borrow_mut().take();
        if let Some(w) = waker {
            w.wake();
        }
    })
}

impl Listener {
    /// Listen on `addr` (port 0 picks a free port; see [`Listener::local_addr`]).
    pub fn bind(worker: &Worker, addr: SocketAddr) -> Result<Self> {
        let shared = Box::new(ListenerShared {
            queue: RefCell::new(VecDeque::new()),
            waker: RefCell::new(None),
        });
        let (storage, len) = crate::endpoint::sockaddr_of(&addr);
        let params = sys::ucp_listener_params_t {
            field_mask: ffi::UCP_LISTENER_PARAM_FIELD_SOCK_ADDR
                | ffi::UCP_LISTENER_PARAM_FIELD_CONN_HANDLER,
            sockaddr: sys::ucs_sock_addr_t {
                addr: (&storage as *const libc::sockaddr_storage).cast::<sys::sockaddr>(),
                addrlen: len,
            },
            accept_handler: sys::ucp_listener_accept_handler_t {
                cb: None,
                arg: ptr::null_mut(),
            },
            conn_handler: sys::ucp_listener_conn_handler_t {
                cb: Some(on_conn),
                arg: (&*shared as *const ListenerShared) as *mut c_void,
            },
        };
        let mut handle = ptr::null_mut();
        // SAFETY: ucp.h (`ucp_listener_create`): live worker, parameters with the socket
        // address (copied by UCX) and a connection handler whose `arg` outlives the listener.
        check(unsafe { ffi::ucp_listener_create(worker.inner.handle, &params, &mut handle) })?;
        crate::affinity::after_ucx_start();
        if handle.is_null() {
            return Err(Error::NoMemory);
        }
        Ok(Self {
            inner: Rc::new(ListenerInner {
                handle,
                shared,
                worker: worker.inner.clone(),
            }),
        })
    }

    /// The address the listener is bound to (with the port UCX chose for port 0).
    pub fn local_addr(&self) -> Result<SocketAddr> {
        // SAFETY: plain data (a mask and a sockaddr_storage); all-zero is valid.
        let mut attr: sys::ucp_listener_attr_t = unsafe { std::mem::zeroed() };
        attr.field_mask = ffi::UCP_LISTENER_ATTR_FIELD_SOCKADDR;
        // SAFETY: ucp.h (`ucp_listener_query`): live listener, attribute struct with its mask.
        check(unsafe { ffi::ucp_listener_query(self.inner.handle, &mut attr) })?;
        socket_addr_from((&attr.sockaddr as *const sys::sockaddr_storage).cast())
            .ok_or(Error::InvalidAddr)
    }

    /// Take a pending connection request, if one arrived (call `progress` to receive them).
    pub fn try_accept(&self) -> Option<ConnRequest> {
        let raw = self.inner.shared.queue.borrow_mut().pop_front()?;
        Some(ConnRequest {
            raw,
            listener: Some(self.inner.clone()),
        })
    }

    /// Wait for the next connection request.
    pub fn accept(&self) -> Accept<'_> {
        Accept { listener: self }
    }
}

/// Future of [`Listener::accept`].
pub struct Accept<'a> {
    listener: &'a Listener,
}

impl Future for Accept<'_> {
    type Output = ConnRequest;

    fn poll(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<ConnRequest> {
        match self.listener.try_accept() {
            Some(r) => Poll::Ready(r),
            None => {
                *self.listener.inner.shared.waker.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

impl ConnRequest {
    /// The client's socket address, when UCX can tell.
    pub fn client_addr(&self) -> Option<SocketAddr> {
        // SAFETY: plain data; all-zero is valid.
        let mut attr: sys::ucp_conn_request_attr_t = unsafe { std::mem::zeroed() };
        attr.field_mask = ffi::UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
        // SAFETY: ucp.h (`ucp_conn_request_query`): a pending, not yet consumed request.
        let st = unsafe { ffi::ucp_conn_request_query(self.raw, &mut attr) };
        if check(st).is_err() {
            return None;
        }
        socket_addr_from((&attr.client_address as *const sys::sockaddr_storage).cast())
    }

    /// Refuse the connection; the client's endpoint sees [`Error::Rejected`] or a reset.
    pub fn reject(mut self) -> Result<()> {
        self.reject_inner()
    }

    fn reject_inner(&mut self) -> Result<()> {
        let Some(listener) = self.listener.take() else {
            return Ok(());
        };
        // SAFETY: ucp.h (`ucp_listener_reject`): the request came from this listener's handler
        // and has not been consumed (taking `listener` above guarantees once).
        check(unsafe { ffi::ucp_listener_reject(listener.handle, self.raw) })
    }

    /// Hand the raw request to `ucp_ep_create`, which consumes it.
    pub(crate) fn into_raw(mut self) -> sys::ucp_conn_request_h {
        self.listener = None;
        self.raw
    }
}

impl Drop for ConnRequest {
    fn drop(&mut self) {
        let _ = self.reject_inner();
    }
}

impl Drop for ListenerInner {
    fn drop(&mut self) {
        let pending: Vec<_> = self.shared.queue.borrow_mut().drain(..).collect();
        for raw in pending {
            // SAFETY: ucp.h (`ucp_listener_reject`): unconsumed requests of this listener.
            unsafe { ffi::ucp_listener_reject(self.handle, raw) };
        }
        // SAFETY: ucp.h (`ucp_listener_destroy`): destroys the listener once; its worker is
        // alive (we hold an `Rc` to it).
        unsafe { sys::ucp_listener_destroy(self.handle) };
        let _ = &self.worker;
    }
}
