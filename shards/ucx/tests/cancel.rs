//! Dropping futures at every stage: nothing UCX may still touch is freed, and nothing dropped
//! is written afterwards (checked with canary buffers).

mod common;

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::{poll_fn, Future};
use std::pin::pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

use common::{pair, pattern, transports, Pair};
use shardcx_ucx::{AmPayload, AmProto, IoBuf, IoBufMut};

const CANARY: u8 = 0xCC;

/// Memory that outlives the buffers carved from it, so the test can look at it after a buffer
/// was dropped.
struct Arena {
    bytes: RefCell<Vec<u8>>,
}

/// A buffer over part of an [`Arena`]. On drop it records that it was released and takes a
/// snapshot of its bytes: from then on, nothing may change them.
struct Canary {
    ptr: *mut u8,
    len: usize,
    released: Rc<Cell<bool>>,
    snapshot: Rc<RefCell<Option<Vec<u8>>>>,
    _arena: Rc<Arena>,
}

struct Watch {
    arena: Rc<Arena>,
    released: Rc<Cell<bool>>,
    snapshot: Rc<RefCell<Option<Vec<u8>>>>,
}

fn canary(len: usize) -> (Canary, Watch) {
    let arena = Rc::new(Arena {
        bytes: RefCell::new(vec![CANARY; len]),
    });
    let ptr = arena.bytes.borrow_mut().as_mut_ptr();
    let released = Rc::new(Cell::new(false));
    let snapshot = Rc::new(RefCell::new(None));
    (
        Canary {
            ptr,
            len,
            released: released.clone(),
            snapshot: snapshot.clone(),
            _arena: arena.clone(),
        },
        Watch {
            arena,
            released,
            snapshot,
        },
    )
}

impl Drop for Canary {
    fn drop(&mut self) {
        self.released.set(true);
        // SAFETY: the arena (kept alive by `_arena`) holds `len` bytes at `ptr`; the buffer is
        // being dropped, so no operation uses it now.
        let bytes = unsafe { std::slice::from_raw_parts(self.ptr, self.len) }.to_vec();
        *self.snapshot.borrow_mut() = Some(bytes);
    }
}

// SAFETY: the bytes live in the arena's heap allocation, which the buffer keeps alive and which
// never moves (the arena vector is never resized).
unsafe impl IoBuf for Canary {
    fn stable_ptr(&self) -> *const u8 {
        self.ptr
    }
    fn bytes_init(&self) -> usize {
        self.len
    }
}

// SAFETY: as above; while an operation owns the buffer the test forms no reference to the
// arena's bytes.
unsafe impl IoBufMut for Canary {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
    fn bytes_total(&self) -> usize {
        self.len
    }
}

impl Watch {
    fn bytes(&self) -> Vec<u8> {
        self.arena.bytes.borrow().clone()
    }

    /// The arena still holds what it held when the buffer was dropped.
    fn unchanged_since_release(&self) -> bool {
        self.released.get() && self.snapshot.borrow().as_deref() == Some(&self.bytes()[..])
    }
}

/// Poll a future once with a no-op waker (posts its operation).
fn poll_once<F: Future>(fut: std::pin::Pin<&mut F>) -> Poll<F::Output> {
    let mut cx = Context::from_waker(Waker::noop());
    fut.poll(&mut cx)
}

fn progress_until(p: &Pair, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !done() {
        assert!(std::time::Instant::now() < deadline, "timed out");
        p.spin(1);
    }
}

#[test]
fn drop_before_posting_releases_at_once_and_receives_nothing() {
    for tls in transports() {
        let p = pair(tls);
        let (buf, watch) = canary(256);
        let fut = p.b.tag_recv(42, u64::MAX, buf);
        drop(fut);
        assert!(watch.released.get());
        assert_eq!(p.b.orphaned_requests(), 0);
        // The message goes to the next receive, not to the dropped buffer.
        p.run(async {
            let (res, _) = p.ab.tag_send(42, pattern(200, 1)).await;
            res.expect("send");
            let (res, got) = p.b.tag_recv(42, u64::MAX, vec![0u8; 256]).await;
            assert_eq!(res.expect("recv").len, 200);
            assert_eq!(&got[..200], &pattern(200, 1)[..]);
        });
        assert!(watch.bytes().iter().all(|&b| b == CANARY));
    }
}

#[test]
fn dropping_a_posted_receive_cancels_it_and_the_buffer_is_never_written() {
    for tls in transports() {
        let p = pair(tls);
        let (buf, watch) = canary(1 << 20);
        {
            let mut fut = pin!(p.b.tag_recv(43, u64::MAX, buf));
            assert!(poll_once(fut.as_mut()).is_pending(), "nothing sent yet");
        }
        // A cancelled tag receive completes at once: the buffer is already released.
        progress_until(&p, || p.b.orphaned_requests() == 0);
        assert!(watch.released.get());
        p.run(async {
            for size in [100usize, 1 << 20] {
                let recv = p.b.tag_recv(43, u64::MAX, vec![0u8; 1 << 20]);
                let send = p.ab.tag_send(43, pattern(size, 7));
                let mut recv = pin!(recv);
                let mut send = pin!(send);
                let (mut r, mut s) = (None, None);
                poll_fn(|cx| {
                    if r.is_none() {
                        if let Poll::Ready(v) = recv.as_mut().poll(cx) {
                            r = Some(v);
                        }
                    }
                    if s.is_none() {
                        if let Poll::Ready(v) = send.as_mut().poll(cx) {
                            s = Some(v);
                        }
                    }
                    if r.is_some() && s.is_some() {
                        Poll::Ready(())
                    } else {
                        Poll::Pending
                    }
                })
                .await;
                let (res, got) = r.expect("recv");
                assert_eq!(res.expect("recv").len, size);
                assert!(got[..size] == pattern(size, 7)[..]);
            }
        });
        assert!(
            watch.bytes().iter().all(|&b| b == CANARY),
            "{tls}: dropped buffer written"
        );
    }
}

type Inbox = Rc<RefCell<VecDeque<AmPayload>>>;

fn inbox(p: &Pair, id: u16) -> Inbox {
    let q: Inbox = Rc::default();
    let q2 = q.clone();
    p.b.set_am_handler(id, move |_, payload| q2.borrow_mut().push_back(payload))
        .expect("handler");
    q
}

#[test]
fn dropping_a_rendezvous_pull_in_flight_parks_the_buffer_until_ucx_is_done() {
    for tls in transports() {
        let p = pair(tls);
        let q = inbox(&p, 11);
        let size = 4 << 20;
        let data = pattern(size, 5);
        let mut send = pin!(p.ab.am_send(11, b"", data.clone(), AmProto::Rendezvous));
        assert!(poll_once(send.as_mut()).is_pending());
        progress_until(&p, || !q.borrow().is_empty());
        let AmPayload::Rendezvous(r) = q.borrow_mut().pop_front().expect("message") else {
            panic!("expected rendezvous")
        };
        let (buf, watch) = canary(size);
        {
            let mut pull = pin!(p.b.am_recv_data(r, buf));
            if poll_once(pull.as_mut()).is_ready() {
                // Completed in place (possible on shared memory): nothing was in flight.
                assert!(watch.released.get());
            }
        }
        // Until UCX completes the pull, the buffer must stay allocated.
        if p.b.orphaned_requests() > 0 {
            assert!(
                !watch.released.get(),
                "{tls}: buffer freed while UCX may write it"
            );
        }
        progress_until(&p, || p.b.orphaned_requests() == 0);
        assert!(watch.released.get());
        // The sender completes once the pull ended (done or cancelled).
        let (res, _) = p.run(send.as_mut());
        let _ = res;
        // More traffic, then check that nothing touched the released buffer.
        p.run(async {
            let s = p.ab.am_send(11, b"", pattern(size, 6), AmProto::Rendezvous);
            let mut s = pin!(s);
            let _ = poll_once(s.as_mut());
            let r = poll_fn(|cx| match q.borrow_mut().pop_front() {
                Some(AmPayload::Rendezvous(r)) => Poll::Ready(r),
                Some(_) => panic!("expected rendezvous"),
                None => {
                    cx.waker().wake_by_ref();
                    Poll::Pending
                }
            })
            .await;
            let (res, got) = p.b.am_recv_data(r, vec![0u8; size]).await;
            res.expect("second pull");
            assert!(got == pattern(size, 6));
            s.await.0.expect("second send");
        });
        assert!(
            watch.unchanged_since_release(),
            "{tls}: buffer written after release"
        );
    }
}

#[test]
fn dropping_a_rendezvous_send_keeps_its_payload_readable_until_pulled() {
    for tls in transports() {
        let p = pair(tls);
        let q = inbox(&p, 12);
        let size = 2 << 20;
        let (buf, watch) = canary(size);
        {
            let mut send = pin!(p.ab.am_send(12, b"", buf, AmProto::Rendezvous));
            assert!(poll_once(send.as_mut()).is_pending());
        }
        // The send cannot complete before the receiver pulls or declines: parked, not freed.
        progress_until(&p, || !q.borrow().is_empty());
        assert!(
            !watch.released.get(),
            "{tls}: payload freed while UCX may read it"
        );
        assert_eq!(p.a.orphaned_requests(), 1);
        let AmPayload::Rendezvous(r) = q.borrow_mut().pop_front().expect("message") else {
            panic!("expected rendezvous")
        };
        let (res, got) = p.run(p.b.am_recv_data(r, vec![0u8; size]));
        // UCX may cancel the send before the data moves (the pull then fails) or complete it;
        // if data arrived it is the canary pattern, read from memory that was still valid.
        if res.is_ok() {
            assert!(got.iter().all(|&b| b == CANARY));
        }
        progress_until(&p, || p.a.orphaned_requests() == 0);
        assert!(watch.released.get());
    }
}

#[test]
fn dropping_after_completion_and_completed_but_unpolled() {
    for tls in transports() {
        let p = pair(tls);
        // Completed and polled: the buffer comes back.
        let (buf, watch) = canary(64);
        let (res, buf) = p.run(p.ab.tag_send(1, buf));
        res.expect("send");
        assert!(!watch.released.get());
        drop(buf);
        assert!(watch.released.get());
        let (res, got) = p.run(p.b.tag_recv(1, u64::MAX, vec![0u8; 64]));
        res.expect("recv");
        assert!(got.iter().all(|&b| b == CANARY));
        // Posted, completed by UCX, then dropped without being polled again.
        let (buf, watch) = canary(64);
        {
            let mut fut = pin!(p.b.tag_recv(2, u64::MAX, buf));
            assert!(poll_once(fut.as_mut()).is_pending());
            p.run(async { p.ab.tag_send(2, pattern(64, 2)).await.0.expect("send") });
            progress_until(&p, || {
                // Completion is recorded by the callback; poll_once would consume it.
                p.b.orphaned_requests() == 0 && p.b.progress() == 0
            });
        }
        assert!(watch.released.get());
        assert_eq!(p.b.orphaned_requests(), 0);
        let snap = watch.snapshot.borrow().clone().expect("snapshot");
        assert_eq!(
            &snap[..],
            &pattern(64, 2)[..],
            "data landed before the drop"
        );
    }
}

#[test]
fn worker_teardown_with_orphans_outstanding_does_not_hang() {
    let p = pair("tcp");
    let (buf, watch) = canary(1 << 20);
    {
        let mut send = pin!(p.ab.am_send(13, b"", buf, AmProto::Rendezvous));
        assert!(poll_once(send.as_mut()).is_pending());
    }
    assert_eq!(p.a.orphaned_requests(), 1);
    let started = std::time::Instant::now();
    drop(p);
    // Dropping the endpoint force-closes it, which cancels the send: the buffer is released
    // during teardown, without waiting for the peer.
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
    assert!(watch.released.get());
}

/// Runs every other test of this file again in a child process and checks that UCX printed no
/// warning or error: no leaked request, no unmatched message, no unreleased descriptor.
#[test]
fn teardown_prints_no_ucx_warnings() {
    let exe = std::env::current_exe().expect("test binary");
    let out = std::process::Command::new(exe)
        .args([
            "--skip",
            "teardown_prints_no_ucx_warnings",
            "--test-threads=1",
        ])
        .env("UCX_LOG_LEVEL", "warn")
        .output()
        .expect("run child");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "child failed:\n{stdout}\n{stderr}");
    // Every other test of this file ran in the child (update when adding one).
    assert!(
        stdout.contains("7 passed"),
        "child ran the scenarios:\n{stdout}"
    );
    for line in stderr.lines().chain(stdout.lines()) {
        assert!(
            !line.contains("UCX  WARN") && !line.contains("UCX  ERROR"),
            "UCX complained: {line}"
        );
    }
}

#[test]
fn a_dropped_send_of_a_memslice_releases_it_only_when_ucx_is_done() {
    for tls in transports() {
        let p = pair(tls);
        let q = inbox(&p, 13);
        let size = 2 << 20;
        let region = Rc::new(shardcx_ucx::MemHandle::allocate(&p.a_context, size).expect("region"));
        let released = Rc::new(Cell::new(false));
        let flag = released.clone();
        let slice = region
            .slice(0, size)
            .expect("lease")
            .on_release(move || flag.set(true));
        {
            let mut send = pin!(p.ab.am_send(13, b"", slice, AmProto::Rendezvous));
            assert!(poll_once(send.as_mut()).is_pending());
        }
        progress_until(&p, || !q.borrow().is_empty());
        assert!(!released.get(), "{tls}: lease ended while UCX may read it");
        assert!(
            region.slice(0, 1).is_err(),
            "{tls}: range leased again while UCX may read it"
        );
        let AmPayload::Rendezvous(r) = q.borrow_mut().pop_front().expect("message") else {
            panic!("expected rendezvous")
        };
        let _ = p.run(p.b.am_recv_data(r, vec![0u8; size]));
        progress_until(&p, || p.a.orphaned_requests() == 0);
        assert!(released.get(), "{tls}: release hook never ran");
        assert!(region.slice(0, size).is_ok(), "{tls}: lease not ended");
    }
}
