//! `rpc-lat-inline` and `rpc-rate-inline`: RPC driven from reply handlers
//! ([`crate::rpc::Caller`]), as `am-lat` is driven from its answer handler. Each reply is
//! checked, counted and answered with the next call inside the caller's handler, on the
//! progress driver; the test task only starts the calls and waits for the end.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Instant;

use super::{
    mesh_taken, more_at, pattern, record, BenchError, Budget, Figures, Progress, RpcEcho, RpcSink,
    Session, Waits, CONTENT_CHECK_EVERY, DEADLINE,
};
use crate::rpc::{ArchivedReply, Caller, RpcError};
use crate::Node;

/// The `rpc-lat-inline` ping-pong, driven by the caller's handler.
struct LatRun {
    payload: Vec<u8>,
    /// When the call in flight was made.
    sent: Instant,
    /// Round trips left before measuring.
    warmup: u64,
    budget: Budget,
    t0: Instant,
    mesh_at_t0: u64,
    figures: Figures,
    progress: Rc<Progress>,
    done: bool,
}

/// The `rpc-rate-inline` sliding window, driven by the caller's handler.
struct RateRun {
    payload: Vec<u8>,
    size: u64,
    window: u64,
    /// Calls made and answered so far (warm-up included).
    sent: u64,
    answered: u64,
    /// Calls answered before measuring.
    warmup: u64,
    /// The most calls to make (`u64::MAX` while a time budget runs).
    limit: u64,
    budget: Budget,
    t0: Instant,
    /// When the last window's worth of measured replies ended.
    mark: Instant,
    mesh_at_t0: u64,
    figures: Figures,
    progress: Rc<Progress>,
    done: bool,
}

impl Session {
    /// `rpc-lat-inline`: one [`RpcEcho`] call at a time, each reply's handler checking it
    /// (its length always, its bytes every [`CONTENT_CHECK_EVERY`]th), making the next call and
    /// then recording the round trip.
    pub(super) async fn rpc_lat_inline(
        &self,
        size: usize,
        budget: Budget,
        warmup: u64,
        progress: &Rc<Progress>,
    ) -> Result<Figures, BenchError> {
        self.mark();
        let now = Instant::now();
        let run = Rc::new(RefCell::new(LatRun {
            payload: pattern(size, 0xC3),
            sent: now,
            warmup,
            budget,
            t0: now,
            mesh_at_t0: self.mesh_at_t0.get(),
            figures: Figures::new(size),
            progress: progress.clone(),
            done: false,
        }));
        let (w, r, node) = (self.waits.clone(), run.clone(), self.node.clone());
        let caller: Caller<RpcEcho> = self
            .node
            .rpc()
            .caller_within(self.target, DEADLINE, move |caller, seq, reply| {
                on_echo(&w, &node, &r, caller, seq, reply);
            })
            .await?;
        let first = {
            let mut r = run.borrow_mut();
            r.sent = Instant::now();
            caller.call(&r.payload, 0)
        };
        let waited = match first {
            Ok(_) => self.waits.until("rpc reply", |_| run.borrow().done).await,
            Err(e) => Err(e.into()),
        };
        let r = run.borrow();
        self.mesh_at_t0.set(r.mesh_at_t0);
        waited.map(|()| r.figures.clone())
    }

    /// `rpc-rate-inline`: `window` [`RpcSink`] calls in flight, the window sliding: each
    /// reply's handler checks it and makes the next call, so the server never waits for a
    /// window to end. One latency sample per `window` measured replies (the time they took).
    pub(super) async fn rpc_rate_inline(
        &self,
        size: usize,
        window: usize,
        budget: Budget,
        warmup: u64,
        progress: &Rc<Progress>,
    ) -> Result<Figures, BenchError> {
        let window = window.max(1) as u64;
        let limit = match budget {
            Budget::Iters(n) => warmup.saturating_add(n.max(1)),
            Budget::Duration(_) => u64::MAX,
        };
        self.mark();
        let now = Instant::now();
        let run = Rc::new(RefCell::new(RateRun {
            payload: pattern(size, 0x96),
            size: size as u64,
            window,
            sent: 0,
            answered: 0,
            warmup,
            limit,
            budget,
            t0: now,
            mark: now,
            mesh_at_t0: self.mesh_at_t0.get(),
            figures: Figures::new(size),
            progress: progress.clone(),
            done: false,
        }));
        let (w, r, node) = (self.waits.clone(), run.clone(), self.node.clone());
        let caller: Caller<RpcSink> = self
            .node
            .rpc()
            .caller_within(self.target, DEADLINE, move |caller, _, reply| {
                on_sink(&w, &node, &r, caller, reply);
            })
            .await?;
        let started = {
            let mut r = run.borrow_mut();
            let now = Instant::now();
            (r.t0, r.mark) = (now, now);
            let mut started = Ok(());
            while r.sent < window.min(r.limit) {
                if let Err(e) = caller.call(&r.payload, r.sent) {
                    r.done = true;
                    started = Err(e);
                    break;
                }
                r.sent += 1;
            }
            started
        };
        let waited = match started {
            Ok(()) => self.waits.until("rpc reply", |_| run.borrow().done).await,
            Err(e) => Err(e.into()),
        };
        let r = run.borrow();
        self.mesh_at_t0.set(r.mesh_at_t0);
        waited.map(|()| r.figures.clone())
    }
}

/// Ends a handler-driven run with `e` (the test task fails with it).
fn failed(w: &Waits, done: &mut bool, e: String) {
    *done = true;
    w.fail(e);
}

/// The `rpc-lat-inline` reply handler: the next call first, then the bookkeeping.
fn on_echo(
    w: &Waits,
    node: &Node,
    run: &RefCell<LatRun>,
    caller: &Caller<RpcEcho>,
    seq: u64,
    reply: Result<ArchivedReply<Vec<u8>>, RpcError>,
) {
    let now = Instant::now();
    w.answered.set(w.answered.get() + 1);
    let mut guard = run.borrow_mut();
    let r = &mut *guard;
    if r.done {
        return;
    }
    let echo = match reply {
        Ok(echo) => echo,
        Err(e) => return failed(w, &mut r.done, format!("rpc echo #{seq}: {e}")),
    };
    let got = echo.get();
    if got.len() != r.payload.len() {
        let e = format!(
            "rpc echo of {} bytes came back with {}",
            r.payload.len(),
            got.len()
        );
        return failed(w, &mut r.done, e);
    }
    let measured = r.warmup == 0;
    let last = measured && !more_at(r.budget, r.figures.msgs + 1, r.t0, now);
    let sent = r.sent;
    if !last {
        r.sent = now;
        if let Err(e) = caller.call(&r.payload, seq + 1) {
            return failed(w, &mut r.done, format!("rpc echo #{}: {e}", seq + 1));
        }
    }
    if seq % CONTENT_CHECK_EVERY == 0 && got.as_slice() != r.payload.as_slice() {
        return failed(
            w,
            &mut r.done,
            format!("rpc echo #{seq} came back with other bytes"),
        );
    }
    if !measured {
        r.warmup -= 1;
        if r.warmup == 0 {
            r.t0 = now;
            r.mesh_at_t0 = mesh_taken(node.shard_ctx());
        }
        return;
    }
    record(&mut r.figures, now - sent);
    r.figures.msgs += 1;
    r.progress.tick(r.budget, r.figures.msgs, r.t0);
    if last {
        r.figures.elapsed = now - r.t0;
        r.done = true;
        drop(guard);
        w.wake();
    }
}

/// The `rpc-rate-inline` reply handler: checks the reply, counts it (a clock reading once per
/// `window` measured replies), makes the next call while calls are left, and ends the run
/// with its last reply.
fn on_sink(
    w: &Waits,
    node: &Node,
    run: &RefCell<RateRun>,
    caller: &Caller<RpcSink>,
    reply: Result<ArchivedReply<u64>, RpcError>,
) {
    w.answered.set(w.answered.get() + 1);
    let mut guard = run.borrow_mut();
    let r = &mut *guard;
    if r.done {
        return;
    }
    r.answered += 1;
    match reply.map(|a| a.get().to_native()) {
        Ok(got) if got == r.size => {}
        Ok(got) => {
            let e = format!("rpc sink of {} bytes says it got {got}", r.size);
            return failed(w, &mut r.done, e);
        }
        Err(e) => return failed(w, &mut r.done, format!("rpc sink call: {e}")),
    }
    if r.answered == r.warmup {
        let now = Instant::now();
        (r.t0, r.mark) = (now, now);
        r.mesh_at_t0 = mesh_taken(node.shard_ctx());
    } else if r.answered > r.warmup {
        r.figures.msgs += 1;
        if r.figures.msgs % r.window == 0 {
            let now = Instant::now();
            record(&mut r.figures, now - r.mark);
            r.mark = now;
            r.progress.tick(r.budget, r.figures.msgs, r.t0);
            if !more_at(r.budget, r.figures.msgs, r.t0, now) {
                // Enough: no more calls (those in flight are still counted).
                r.limit = r.sent;
            }
        }
    }
    if r.sent < r.limit {
        if let Err(e) = caller.call(&r.payload, r.sent) {
            return failed(w, &mut r.done, format!("rpc sink call #{}: {e}", r.sent));
        }
        r.sent += 1;
    } else if r.answered == r.sent {
        let now = Instant::now();
        if r.figures.msgs % r.window != 0 {
            record(&mut r.figures, now - r.mark);
        }
        r.figures.elapsed = now - r.t0;
        r.done = true;
        drop(guard);
        w.wake();
    }
}
