//! Cross-shard forwarding: bounded lanes between every ordered pair of shards.
//!
//! An operation called on a shard that does not own a peer is forwarded to the owner with
//! [`ShardCtx::forward`]: a `Send` closure crosses to the target shard, builds its `!Send`
//! future there, runs it as a local task, and the (`Send`) result comes back and resolves the
//! caller's future on the calling shard. Forwarding to the calling shard itself runs the job
//! in place.
//!
//! ## Lanes
//!
//! [`ShardsBuilder::run`](crate::ShardsBuilder::run) creates, before any executor starts, two
//! glommio shared channels (bounded single-producer, single-consumer queues) for every ordered
//! pair of shards `(i, j)`, `i != j`: a **request lane** `i → j` and a **completion lane**
//! `j → i` carrying the answers to `i`'s requests. Each shard connects its ends when it starts
//! (all concurrently: a `connect` waits for the other end's), and spawns one receiver task per
//! incoming lane. Both lanes hold [`MeshConfig::lane_capacity`] messages.
//!
//! A glommio shared channel wakes the receiving executor itself when it pushes into it (it
//! writes the executor's sleep eventfd), so a forwarded request does not wait for the target's
//! progress driver, even when that driver sleeps (`tests/mesh.rs` checks this). A target whose
//! driver *spins* (busy with UCX traffic) is not asleep, and glommio looks at its channels only
//! when its preempt timer fires: the progress queue's latency, 500 µs (see `boot.rs` for the
//! measured trade-off). That is the mesh's weak point under load (a forwarded call to a busy
//! shard costs about half a millisecond); the fix is lanes that the driver polls itself on
//! every round, with a doorbell (`ucp_worker_signal` on the target's worker) for a sleeping
//! target.
//!
//! ## Back-pressure, and why it never deadlocks
//!
//! The sender bounds the requests it has in flight on each lane: a forward takes a permit of the
//! lane before it sends, and gives it back only when the completion has been received (not
//! when the caller stops waiting: the job still runs). So the jobs spawned on a shard for one
//! lane are bounded, and a caller that finds no permit waits: that is the back-pressure.
//!
//! Nested forwarding (a forwarded job that forwards again, to a third shard or back) could
//! deadlock with a single pool of permits per lane: with capacity 2, two jobs `A → B` each
//! forwarding back to `A`, and two jobs `B → A` each forwarding to `B`, hold every permit and
//! wait for each other. Permits are therefore split by **nesting depth**: code that is not a
//! forwarded job runs at depth 0; a job forwarded at depth `d` runs at depth `d + 1` and its own
//! forwards take permits of level `d + 1` (the depth is tracked in a thread-local set while the
//! job's future is polled, so forwards made through other APIs inside a job count too). Forwards
//! at depth [`MeshConfig::max_depth`] fail with [`ForwardError::TooDeep`]. Every wait is then for
//! something that does not wait on the waiter:
//!
//! - a request lane's receiver only spawns each job as a local task, and a completion lane's
//!   receiver only resolves local waiters; neither ever waits on anything but its lane. So a
//!   full lane always drains, and a send waiting for room always finishes;
//! - a permit of level `d` is held by a job of depth `d + 1`, which waits (besides its own
//!   local work) only for permits of level `d + 1` and for lanes. Jobs at the deepest level take
//!   no permits, so they finish; by induction on the level, every permit is given back.
//!
//! Per lane, at most `lane_capacity × max_depth` jobs run at once on the target. Cycles between
//! shards (`A → B` while `B → A`, many at once) need no special case: the receivers never block.
//!
//! The argument assumes the jobs themselves terminate. A job that hands work to a task it
//! spawned and awaits it moves that work to depth 0 (a spawned task is not polled inside the
//! job); forward from the job itself to keep the guarantee.
//!
//! ## Shutdown
//!
//! A shard's user future is its life as a client, not as a server: when it ends, the shard
//! refuses new depth-0 forwards from tasks left behind ([`ForwardError::ShuttingDown`]) but
//! keeps serving requests from other shards and keeps its own nested forwards going. Executors
//! leave together, once the whole set is quiescent:
//!
//! - each shard counts its *busy* units: 1 while its user future runs, 1 per request it sent
//!   whose completion it has not received, 1 per job it runs for another shard until the
//!   job's completion is sent;
//! - a shared atomic counts the shards whose busy count is non-zero; it is touched only when a
//!   shard's count goes between 0 and 1 (never on the hot path of a running user future);
//! - the counter never drops to 0 while work exists: a job arriving at an idle shard is counted
//!   there before its sender's request is complete; once it is 0, no shard can create work
//!   (every user future has ended, no job runs), so it stays 0;
//! - at 0, each shard closes its lanes, stops its receivers and returns from
//!   [`ShardsBuilder::run`](crate::ShardsBuilder::run)'s executor. Closing the lanes wakes the
//!   other shards, which see the counter at 0 and leave too.
//!
//! Two cases end a shard early. A shard that fails or panics leaves: its lanes close, the
//! forwards waiting on it fail with [`ForwardError::ShardStopped`], and its units are removed
//! from the counter so the others still leave. And once every user future has ended, a shard
//! waits at most [`MeshConfig::drain_timeout`] for the set to become quiescent (a job that never
//! ends must not hold the process forever); after that it leaves the same way.
//!
//! ## What is `Send`
//!
//! [`MeshConfig`] and [`ForwardError`] are `Send`. The job closure and its result must be
//! `Send`; the job's future never leaves the target shard and need not be.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::rc::{Rc, Weak};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use futures_lite::FutureExt;
use glommio::channels::shared_channel::{
    self, ConnectedReceiver, ConnectedSender, SharedReceiver, SharedSender,
};

use crate::boot::ShardCtx;
use crate::error::ForwardError;
use crate::proto::ids::ShardId;

/// Default capacity of each lane, and in-flight requests per lane and nesting level.
pub const DEFAULT_LANE_CAPACITY: usize = 256;
/// Default nesting limit: a job may forward again this many levels deep, minus one.
pub const DEFAULT_MAX_DEPTH: usize = 4;
/// Default longest wait for quiescence once every user future has ended.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
/// How often a draining shard looks at the shared counter without being woken (a bound, not the
/// wake-up path: lane closures wake it).
const DRAIN_TICK: Duration = Duration::from_millis(50);

/// Settings of the cross-shard mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MeshConfig {
    /// Messages each lane holds, and requests a shard may have in flight per lane and per
    /// nesting level.
    pub lane_capacity: usize,
    /// Nesting levels with their own permits (at least 1, at most 255). A forward made at depth
    /// `max_depth` (by a job nested that deep) fails with [`ForwardError::TooDeep`].
    pub max_depth: usize,
    /// Longest wait, after every shard's user future has ended, for the forwarded work still
    /// in flight to finish.
    pub drain_timeout: Duration,
}

/// A type-erased job result.
type Erased = Box<dyn Any + Send>;

/// What a request lane carries: a `Send` recipe that spawns the job on the target.
struct Request {
    /// The caller's pending-table slot.
    slot: u32,
    /// The nesting level of the caller's permit; the job runs one deeper.
    depth: u8,
    start: Box<dyn FnOnce(JobEnv) + Send>,
}

/// What a completion lane carries.
struct Completion {
    slot: u32,
    /// The job's result, or its panic message.
    outcome: Result<Erased, String>,
}

/// One shard's unconnected ends of the mesh, made before the executors start. `Send`.
pub(crate) struct MeshEnds {
    id: usize,
    peers: Vec<Option<PeerEnds>>,
    member: Membership,
}

struct PeerEnds {
    /// Requests from this shard to the peer.
    req_tx: SharedSender<Request>,
    /// Requests from the peer to this shard.
    req_rx: SharedReceiver<Request>,
    /// Completions of the peer's requests, from this shard to the peer.
    done_tx: SharedSender<Completion>,
    /// Completions of this shard's requests, from the peer.
    done_rx: SharedReceiver<Completion>,
}

/// Counters shared by all shards of a set.
#[derive(Debug)]
struct MeshShared {
    /// Shards whose busy count is non-zero (or that have not started yet).
    active: AtomicUsize,
    /// Shards whose user future has not ended (or that have not started yet).
    users_running: AtomicUsize,
}

/// One shard's share of the shared counters; whatever it still holds is given back on drop,
/// so a shard that fails, panics or never starts does not hold the others forever.
struct Membership {
    shared: Arc<MeshShared>,
    active: bool,
    user_running: bool,
}

/// One shard's connected mesh.
pub(crate) struct MeshState {
    id: ShardId,
    shard_count: usize,
    config: MeshConfig,
    lanes: Vec<Option<Lane>>,
    member: RefCell<Membership>,
    /// Busy units of this shard (see the module docs).
    busy: Cell<usize>,
    user_done: Cell<bool>,
    poke: Poke,
}

/// The running receiver tasks of one shard; dropping it stops them. Kept apart from
/// [`MeshState`], which the tasks only hold weakly: should the shard die, dropping its state
/// closes its lanes even if its tasks are never polled again.
pub(crate) struct MeshTasks {
    _tasks: Vec<glommio::Task<()>>,
}

/// This shard's side of the lanes with one peer.
struct Lane {
    requests: ConnectedSender<Request>,
    completions: ConnectedSender<Completion>,
    /// Permits for requests to the peer, one pool per nesting level.
    gates: Vec<Rc<Gate>>,
    pending: RefCell<Slab<Pending>>,
    dead: Cell<bool>,
}

/// The receiving ends, handed to the receiver tasks.
pub(crate) struct MeshReceivers {
    lanes: Vec<(
        usize,
        ConnectedReceiver<Request>,
        ConnectedReceiver<Completion>,
    )>,
}

/// A request in flight: where its result goes, and its permit.
struct Pending {
    slot: Rc<Slot>,
    _permit: Permit,
}

/// Where a forwarded call's result lands on the calling shard.
#[derive(Default)]
struct Slot {
    outcome: RefCell<Option<Result<Erased, ForwardError>>>,
    waker: RefCell<Option<Waker>>,
}

/// A fixed-size table with recycled indices.
struct Slab<T> {
    entries: Vec<Option<T>>,
    free: Vec<u32>,
}

/// What a spawned job needs on the target shard.
struct JobEnv {
    ctx: Rc<ShardCtx>,
    depth: u8,
    reply: Reply,
}

/// Where a job's completion goes.
struct Reply {
    mesh: Rc<MeshState>,
    /// The calling shard.
    to: usize,
    slot: u32,
}

/// A local wake-up flag for the draining shard.
#[derive(Default)]
struct Poke {
    set: Cell<bool>,
    waker: RefCell<Option<Waker>>,
}

/// A local counting semaphore whose waiters may be dropped at any time without losing a
/// wake-up (glommio's `Semaphore` loses one when a woken waiter is dropped before it runs).
struct Gate {
    avail: Cell<usize>,
    closed: Cell<bool>,
    waiters: RefCell<VecDeque<Rc<GateWaiter>>>,
}

struct GateWaiter {
    state: Cell<WaitState>,
    waker: RefCell<Option<Waker>>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum WaitState {
    Queued,
    Woken,
    Cancelled,
}

/// Acquiring one unit of a [`Gate`].
struct Acquire {
    gate: Rc<Gate>,
    node: Option<Rc<GateWaiter>>,
    done: bool,
}

/// One unit of a [`Gate`], given back on drop.
struct Permit {
    gate: Rc<Gate>,
}

/// Makes the shard leave the mesh when dropped (see [`MeshState::leave_guard`]).
pub(crate) struct LeaveGuard(Rc<MeshState>);

/// Restores the previous nesting depth on drop (also when a job panics).
struct DepthGuard(u8);

/// Removes a pending entry whose request was never sent (the caller stopped waiting for room).
struct Reservation<'a> {
    mesh: &'a MeshState,
    to: usize,
    slot: u32,
    armed: bool,
}

thread_local! {
    /// Nesting depth of the code being polled on this thread (0 outside forwarded jobs).
    static DEPTH: Cell<u8> = const { Cell::new(0) };
}

impl MeshConfig {
    pub(crate) fn validate(&self) -> Result<(), &'static str> {
        if self.lane_capacity == 0 {
            return Err("lane capacity must be at least 1");
        }
        if self.lane_capacity > u32::MAX as usize / 256 {
            return Err("lane capacity too large");
        }
        if self.max_depth == 0 || self.max_depth > u8::MAX as usize {
            return Err("forward depth must be between 1 and 255");
        }
        Ok(())
    }
}

impl Default for MeshConfig {
    fn default() -> Self {
        Self {
            lane_capacity: DEFAULT_LANE_CAPACITY,
            max_depth: DEFAULT_MAX_DEPTH,
            drain_timeout: DEFAULT_DRAIN_TIMEOUT,
        }
    }
}

/// Make every shard's ends: a request lane and a completion lane per ordered pair.
pub(crate) fn lanes(shard_count: usize, capacity: usize) -> Vec<MeshEnds> {
    let shared = Arc::new(MeshShared {
        active: AtomicUsize::new(shard_count),
        users_running: AtomicUsize::new(shard_count),
    });
    type Half<T> = Option<T>;
    let n = shard_count;
    let mut req_tx: Vec<Vec<Half<SharedSender<Request>>>> = grid(n);
    let mut req_rx: Vec<Vec<Half<SharedReceiver<Request>>>> = grid(n);
    let mut done_tx: Vec<Vec<Half<SharedSender<Completion>>>> = grid(n);
    let mut done_rx: Vec<Vec<Half<SharedReceiver<Completion>>>> = grid(n);
    for i in 0..n {
        for j in 0..n {
            if i == j {
                continue;
            }
            // Requests i → j.
            let (tx, rx) = shared_channel::new_bounded(capacity);
            req_tx[i][j] = Some(tx);
            req_rx[j][i] = Some(rx);
            // Completions of i's requests, j → i.
            let (tx, rx) = shared_channel::new_bounded(capacity);
            done_tx[j][i] = Some(tx);
            done_rx[i][j] = Some(rx);
        }
    }
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let mut peers = Vec::with_capacity(n);
        for j in 0..n {
            let ends = match (
                req_tx[i][j].take(),
                req_rx[i][j].take(),
                done_tx[i][j].take(),
                done_rx[i][j].take(),
            ) {
                (Some(req_tx), Some(req_rx), Some(done_tx), Some(done_rx)) => Some(PeerEnds {
                    req_tx,
                    req_rx,
                    done_tx,
                    done_rx,
                }),
                _ => None,
            };
            peers.push(ends);
        }
        out.push(MeshEnds {
            id: i,
            peers,
            member: Membership {
                shared: shared.clone(),
                active: true,
                user_running: true,
            },
        });
    }
    out
}

fn grid<T>(n: usize) -> Vec<Vec<Option<T>>> {
    (0..n).map(|_| (0..n).map(|_| None).collect()).collect()
}

impl MeshEnds {
    /// Connect every lane end (inside the shard's executor). Returns when every peer has
    /// connected its ends too, or has gone.
    pub(crate) async fn connect(self, config: MeshConfig) -> (Rc<MeshState>, MeshReceivers) {
        let MeshEnds { id, peers, member } = self;
        let shard_count = peers.len();
        let mut tasks = Vec::with_capacity(shard_count);
        for (peer, ends) in peers.into_iter().enumerate() {
            let Some(e) = ends else { continue };
            // All four at once: each `connect` waits for the other end's.
            tasks.push((
                peer,
                glommio::spawn_local(async move {
                    futures_lite::future::zip(
                        futures_lite::future::zip(e.req_tx.connect(), e.req_rx.connect()),
                        futures_lite::future::zip(e.done_tx.connect(), e.done_rx.connect()),
                    )
                    .await
                }),
            ));
        }
        let mut lanes: Vec<Option<Lane>> = (0..shard_count).map(|_| None).collect();
        let mut receivers = Vec::with_capacity(tasks.len());
        for (peer, task) in tasks {
            let ((requests, req_rx), (completions, done_rx)) = task.await;
            let gates = (0..config.max_depth)
                .map(|_| Rc::new(Gate::new(config.lane_capacity)))
                .collect();
            lanes[peer] = Some(Lane {
                requests,
                completions,
                gates,
                pending: RefCell::new(Slab::new()),
                dead: Cell::new(false),
            });
            receivers.push((peer, req_rx, done_rx));
        }
        let mesh = Rc::new(MeshState {
            id: shard_id(id),
            shard_count,
            config,
            lanes,
            member: RefCell::new(member),
            busy: Cell::new(1),
            user_done: Cell::new(false),
            poke: Poke::default(),
        });
        (mesh, MeshReceivers { lanes: receivers })
    }
}

impl MeshShared {
    fn active(&self) -> usize {
        self.active.load(Ordering::SeqCst)
    }
}

impl Membership {
    /// Count this shard as active again (its busy count went from 0 to 1).
    fn enter(&mut self) {
        if !self.active {
            self.active = true;
            self.shared.active.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// This shard's busy count went to 0; true if the whole set is now quiescent.
    fn leave(&mut self) -> bool {
        if self.active {
            self.active = false;
            self.shared.active.fetch_sub(1, Ordering::SeqCst) == 1
        } else {
            false
        }
    }

    fn user_finished(&mut self) {
        if self.user_running {
            self.user_running = false;
            self.shared.users_running.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        self.user_finished();
        self.leave();
    }
}

impl MeshState {
    /// Spawn the receiver tasks. They hold the shard and its mesh weakly: they must not keep
    /// the shard alive.
    pub(crate) fn start(
        self: &Rc<Self>,
        ctx: &Rc<ShardCtx>,
        receivers: MeshReceivers,
    ) -> MeshTasks {
        let mut tasks = Vec::with_capacity(2 * receivers.lanes.len());
        for (peer, req_rx, done_rx) in receivers.lanes {
            tasks.push(glommio::spawn_local(serve_requests(
                Rc::downgrade(self),
                Rc::downgrade(ctx),
                peer,
                req_rx,
            )));
            tasks.push(glommio::spawn_local(serve_completions(
                Rc::downgrade(self),
                peer,
                done_rx,
            )));
        }
        MeshTasks { _tasks: tasks }
    }

    /// The shard's user future has ended: refuse new depth-0 forwards, drop its busy unit.
    pub(crate) fn user_finished(&self) {
        self.user_done.set(true);
        self.member.borrow_mut().user_finished();
        self.busy_dec();
    }

    /// Wait until the whole set is quiescent, or for the drain timeout once every user future
    /// has ended. True if quiescent.
    pub(crate) async fn drain(&self) -> bool {
        let shared = self.member.borrow().shared.clone();
        let mut deadline = None;
        loop {
            if shared.active() == 0 {
                return true;
            }
            if shared.users_running.load(Ordering::SeqCst) == 0 {
                let d = *deadline.get_or_insert_with(|| Instant::now() + self.config.drain_timeout);
                if Instant::now() >= d {
                    return false;
                }
            }
            futures_lite::future::or(self.poke.wait(), async {
                glommio::timer::sleep(DRAIN_TICK).await;
            })
            .await;
        }
    }

    /// Leave the mesh: close every lane, stop the receivers, fail whatever still waits.
    pub(crate) fn close(&self, tasks: MeshTasks) {
        self.leave();
        // Dropping a glommio task cancels it (and drops its receivers).
        drop(tasks);
    }

    /// A guard that makes this shard leave the mesh when it is dropped: at the end of
    /// `shard_main`, on an early error return, and when the shard's main future is dropped
    /// because it panicked. Jobs of a dead shard may keep its state alive (glommio need not drop
    /// the futures of a dead executor), so leaving is explicit rather than left to `Drop`.
    pub(crate) fn leave_guard(self: &Rc<Self>) -> LeaveGuard {
        LeaveGuard(self.clone())
    }

    /// Give back this shard's shares of the shared counters and close its sending ends; the
    /// peers see the lanes close and fail what waits on this shard. Idempotent.
    fn leave(&self) {
        self.user_done.set(true);
        {
            let mut member = self.member.borrow_mut();
            member.user_finished();
            member.leave();
        }
        for (peer, lane) in self.lanes.iter().enumerate() {
            if let Some(lane) = lane {
                lane_failed(self, peer);
                lane.requests.close();
                lane.completions.close();
            }
        }
    }

    fn lane(&self, peer: usize) -> Option<&Lane> {
        self.lanes.get(peer).and_then(Option::as_ref)
    }

    fn busy_inc(&self) {
        let n = self.busy.get();
        self.busy.set(n + 1);
        if n == 0 {
            self.member.borrow_mut().enter();
        }
    }

    fn busy_dec(&self) {
        let n = self.busy.get().saturating_sub(1);
        self.busy.set(n);
        if n == 0 && self.member.borrow_mut().leave() {
            self.poke.wake();
        }
    }

    fn insert_pending(&self, lane: &Lane, pending: Pending) -> u32 {
        let slot = lane.pending.borrow_mut().insert(pending);
        self.busy_inc();
        slot
    }

    fn remove_pending(&self, lane: &Lane, slot: u32) -> Option<Pending> {
        let p = lane.pending.borrow_mut().remove(slot);
        if p.is_some() {
            self.busy_dec();
        }
        p
    }
}

/// `ShardsBuilder::run` refuses more than `u16::MAX` shards before any mesh is made.
fn shard_id(index: usize) -> ShardId {
    ShardId::new(u16::try_from(index).unwrap_or(u16::MAX))
}

/// Mark the lane to `peer` dead: close its permits and fail the requests waiting on it.
fn lane_failed(mesh: &MeshState, peer: usize) {
    let Some(lane) = mesh.lane(peer) else { return };
    lane.dead.set(true);
    for g in &lane.gates {
        g.close();
    }
    let drained = lane.pending.borrow_mut().drain();
    for p in drained {
        p.slot.resolve(Err(ForwardError::ShardStopped {
            from: mesh.id,
            to: shard_id(peer),
        }));
        mesh.busy_dec();
    }
    mesh.poke.wake();
}

async fn serve_requests(
    mesh: Weak<MeshState>,
    ctx: Weak<ShardCtx>,
    from: usize,
    rx: ConnectedReceiver<Request>,
) {
    while let Some(req) = rx.recv().await {
        let (Some(ctx), Some(mesh)) = (ctx.upgrade(), mesh.upgrade()) else {
            return;
        };
        // Counted before anything can complete it: the sender still counts its request.
        mesh.busy_inc();
        let env = JobEnv {
            ctx,
            depth: req.depth.saturating_add(1),
            reply: Reply {
                mesh: mesh.clone(),
                to: from,
                slot: req.slot,
            },
        };
        // Spawns the job as a local task; never waits.
        (req.start)(env);
    }
    // The peer has gone (or closed at quiescence): no more requests from it.
    if let Some(mesh) = mesh.upgrade() {
        mesh.poke.wake();
    }
}

async fn serve_completions(mesh: Weak<MeshState>, from: usize, rx: ConnectedReceiver<Completion>) {
    while let Some(c) = rx.recv().await {
        let Some(mesh) = mesh.upgrade() else { return };
        let Some(lane) = mesh.lane(from) else { return };
        if let Some(p) = mesh.remove_pending(lane, c.slot) {
            let outcome = c.outcome.map_err(|message| ForwardError::JobPanicked {
                shard: shard_id(from),
                message,
            });
            p.slot.resolve(outcome);
            // `p`'s permit is given back here.
        }
    }
    if let Some(mesh) = mesh.upgrade() {
        lane_failed(&mesh, from);
    }
}

impl JobEnv {
    /// Spawn `job` as a local task on this shard; its result goes back on the completion lane.
    fn spawn<F, Fut, R>(self, job: F)
    where
        F: FnOnce(Rc<ShardCtx>) -> Fut + Send + 'static,
        Fut: Future<Output = R> + 'static,
        R: Send + 'static,
    {
        let JobEnv { ctx, depth, reply } = self;
        glommio::spawn_local(async move {
            let outcome = run_job(ctx, depth, job).await;
            reply.send(outcome.map(|r| Box::new(r) as Erased)).await;
        })
        .detach();
    }
}

impl Reply {
    async fn send(self, outcome: Result<Erased, String>) {
        if let Some(lane) = self.mesh.lane(self.to) {
            // Never waits on anything but the caller's completion receiver, which never waits.
            // An error means the caller has gone: nobody wants the result.
            let _ = lane
                .completions
                .send(Completion {
                    slot: self.slot,
                    outcome,
                })
                .await;
        }
        self.mesh.busy_dec();
    }
}

/// Build and run `job` at `depth`, catching a panic of either step.
async fn run_job<F, Fut, R>(ctx: Rc<ShardCtx>, depth: u8, job: F) -> Result<R, String>
where
    F: FnOnce(Rc<ShardCtx>) -> Fut,
    Fut: Future<Output = R>,
{
    let fut = {
        let _depth = DepthGuard::enter(depth);
        std::panic::catch_unwind(AssertUnwindSafe(move || job(ctx))).map_err(panic_message)?
    };
    let mut fut = std::pin::pin!(fut);
    let at_depth = futures_lite::future::poll_fn(move |cx| {
        let _depth = DepthGuard::enter(depth);
        fut.as_mut().poll(cx)
    });
    AssertUnwindSafe(at_depth)
        .catch_unwind()
        .await
        .map_err(panic_message)
}

fn panic_message(payload: Box<dyn Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(non-string panic payload)".to_owned()
    }
}

impl ShardCtx {
    /// Run `job` on shard `to` and resolve, on this shard, with its result.
    ///
    /// The closure crosses threads (`Send`); the future it returns is built and run on the
    /// target shard as a local task and need not be `Send`; the result crosses back. Forwarding
    /// to this shard runs the job here, without a lane.
    ///
    /// Waits for a permit of the lane when this shard already has
    /// [`MeshConfig::lane_capacity`] requests in flight to `to` at this nesting level
    /// (back-pressure; see the module docs for why this never deadlocks). Dropping the returned
    /// future does not cancel a job already sent: it runs to its end and its result is dropped.
    ///
    /// Errors: [`ForwardError::NoSuchShard`], [`ForwardError::ShardStopped`] (the target has
    /// failed or left), [`ForwardError::ShuttingDown`] (this shard's user future has ended and
    /// the call does not come from a forwarded job), [`ForwardError::TooDeep`] and
    /// [`ForwardError::JobPanicked`].
    ///
    /// ```no_run
    /// # use std::rc::Rc;
    /// # use shardcx_shards::{ShardCtx, proto::ids::ShardId};
    /// # async fn demo(ctx: Rc<ShardCtx>) -> Result<(), shardcx_shards::ForwardError> {
    /// let owner = ShardId::new(1);
    /// let (who, sum) = ctx
    ///     .forward(owner, |ctx| async move { (ctx.id(), 2 + 2) })
    ///     .await?;
    /// assert_eq!((who, sum), (owner, 4));
    /// # Ok(()) }
    /// ```
    pub fn forward<F, Fut, R>(
        self: &Rc<Self>,
        to: ShardId,
        job: F,
    ) -> impl Future<Output = Result<R, ForwardError>>
    where
        F: FnOnce(Rc<ShardCtx>) -> Fut + Send + 'static,
        Fut: Future<Output = R> + 'static,
        R: Send + 'static,
    {
        // Read now, while the caller (maybe a forwarded job) is being polled.
        let depth = DEPTH.with(Cell::get);
        forward_from(self.clone(), to, depth, job)
    }

    /// Nesting depth of the code calling this: 0 outside forwarded jobs, `d + 1` inside a job
    /// forwarded at depth `d`.
    pub fn forward_depth(&self) -> usize {
        DEPTH.with(Cell::get) as usize
    }
}

async fn forward_from<F, Fut, R>(
    ctx: Rc<ShardCtx>,
    to: ShardId,
    depth: u8,
    job: F,
) -> Result<R, ForwardError>
where
    F: FnOnce(Rc<ShardCtx>) -> Fut + Send + 'static,
    Fut: Future<Output = R> + 'static,
    R: Send + 'static,
{
    let mesh = ctx.mesh().clone();
    let from = mesh.id;
    let target = to.index();
    if target == from.index() {
        return run_job(ctx, depth, job)
            .await
            .map_err(|message| ForwardError::JobPanicked { shard: to, message });
    }
    drop(ctx);
    let Some(lane) = mesh.lane(target) else {
        return Err(ForwardError::NoSuchShard {
            from,
            to,
            shard_count: mesh.shard_count,
        });
    };
    let stopped = || ForwardError::ShardStopped { from, to };
    let Some(gate) = lane.gates.get(depth as usize) else {
        return Err(ForwardError::TooDeep {
            from,
            to,
            depth: depth as usize,
        });
    };
    if depth == 0 && mesh.user_done.get() {
        return Err(ForwardError::ShuttingDown { from, to });
    }
    if lane.dead.get() {
        return Err(stopped());
    }
    let permit = gate.acquire().await.map_err(|()| stopped())?;
    if lane.dead.get() {
        return Err(stopped());
    }
    let slot = Rc::new(Slot::default());
    let id = mesh.insert_pending(
        lane,
        Pending {
            slot: slot.clone(),
            _permit: permit,
        },
    );
    let mut reservation = Reservation {
        mesh: &mesh,
        to: target,
        slot: id,
        armed: true,
    };
    let request = Request {
        slot: id,
        depth,
        start: Box::new(move |env: JobEnv| env.spawn(job)),
    };
    if lane.requests.send(request).await.is_err() {
        return Err(stopped());
    }
    reservation.armed = false;
    let outcome = futures_lite::future::poll_fn(|cx| slot.poll(cx)).await?;
    match outcome.downcast::<R>() {
        Ok(r) => Ok(*r),
        // The completion for this slot was made by the `start` closure above, for this `R`.
        Err(_) => unreachable!("forwarded job returned a value of another type"),
    }
}

impl Drop for LeaveGuard {
    fn drop(&mut self) {
        self.0.leave();
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if self.armed {
            if let Some(lane) = self.mesh.lane(self.to) {
                self.mesh.remove_pending(lane, self.slot);
            }
        }
    }
}

impl Slot {
    fn resolve(&self, outcome: Result<Erased, ForwardError>) {
        *self.outcome.borrow_mut() = Some(outcome);
        if let Some(w) = self.waker.borrow_mut().take() {
            w.wake();
        }
    }

    fn poll(&self, cx: &mut Context<'_>) -> Poll<Result<Erased, ForwardError>> {
        match self.outcome.borrow_mut().take() {
            Some(o) => Poll::Ready(o),
            None => {
                *self.waker.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

impl<T> Slab<T> {
    fn new() -> Self {
        Self {
            entries: Vec::new(),
            free: Vec::new(),
        }
    }

    fn insert(&mut self, v: T) -> u32 {
        if let Some(i) = self.free.pop() {
            self.entries[i as usize] = Some(v);
            i
        } else {
            self.entries.push(Some(v));
            // In-flight requests per lane are bounded by the permits (checked in `validate`).
            u32::try_from(self.entries.len() - 1).unwrap_or(u32::MAX)
        }
    }

    fn remove(&mut self, i: u32) -> Option<T> {
        let v = self.entries.get_mut(i as usize)?.take();
        if v.is_some() {
            self.free.push(i);
        }
        v
    }

    fn drain(&mut self) -> Vec<T> {
        self.free.clear();
        let out = self.entries.drain(..).flatten().collect();
        out
    }
}

impl Poke {
    fn wake(&self) {
        self.set.set(true);
        if let Some(w) = self.waker.borrow_mut().take() {
            w.wake();
        }
    }

    async fn wait(&self) {
        futures_lite::future::poll_fn(|cx| {
            if self.set.replace(false) {
                Poll::Ready(())
            } else {
                *self.waker.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            }
        })
        .await;
    }
}

impl Gate {
    fn new(units: usize) -> Self {
        Self {
            avail: Cell::new(units),
            closed: Cell::new(false),
            waiters: RefCell::new(VecDeque::new()),
        }
    }

    fn acquire(self: &Rc<Self>) -> Acquire {
        Acquire {
            gate: self.clone(),
            node: None,
            done: false,
        }
    }

    fn release(&self) {
        self.avail.set(self.avail.get() + 1);
        self.wake_next();
    }

    fn wake_next(&self) {
        loop {
            let Some(node) = self.waiters.borrow_mut().pop_front() else {
                return;
            };
            if node.state.get() == WaitState::Queued {
                node.state.set(WaitState::Woken);
                if let Some(w) = node.waker.borrow_mut().take() {
                    w.wake();
                }
                return;
            }
        }
    }

    fn close(&self) {
        self.closed.set(true);
        let waiters: Vec<_> = self.waiters.borrow_mut().drain(..).collect();
        for node in waiters {
            node.state.set(WaitState::Woken);
            if let Some(w) = node.waker.borrow_mut().take() {
                w.wake();
            }
        }
    }
}

impl Acquire {
    fn unqueue(&mut self) {
        if let Some(node) = self.node.take() {
            if node.state.get() == WaitState::Queued {
                node.state.set(WaitState::Cancelled);
            }
        }
    }
}

impl Future for Acquire {
    type Output = Result<Permit, ()>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if this.gate.closed.get() {
            this.unqueue();
            this.done = true;
            return Poll::Ready(Err(()));
        }
        let avail = this.gate.avail.get();
        if avail > 0 {
            this.gate.avail.set(avail - 1);
            this.unqueue();
            this.done = true;
            return Poll::Ready(Ok(Permit {
                gate: this.gate.clone(),
            }));
        }
        match &this.node {
            Some(node) if node.state.get() == WaitState::Queued => {
                *node.waker.borrow_mut() = Some(cx.waker().clone());
            }
            _ => {
                let node = Rc::new(GateWaiter {
                    state: Cell::new(WaitState::Queued),
                    waker: RefCell::new(Some(cx.waker().clone())),
                });
                this.gate.waiters.borrow_mut().push_back(node.clone());
                this.node = Some(node);
            }
        }
        Poll::Pending
    }
}

impl Drop for Acquire {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        if let Some(node) = self.node.take() {
            match node.state.get() {
                WaitState::Queued => node.state.set(WaitState::Cancelled),
                // Woken but never ran: pass the wake-up on.
                WaitState::Woken if self.gate.avail.get() > 0 => self.gate.wake_next(),
                _ => {}
            }
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.gate.release();
    }
}

impl DepthGuard {
    fn enter(depth: u8) -> Self {
        Self(DEPTH.with(|d| d.replace(depth)))
    }
}

impl Drop for DepthGuard {
    fn drop(&mut self) {
        DEPTH.with(|d| d.set(self.0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slab_recycles() {
        let mut s = Slab::new();
        let a = s.insert(1);
        let b = s.insert(2);
        assert_eq!(s.remove(a), Some(1));
        assert_eq!(s.remove(a), None);
        let c = s.insert(3);
        assert_eq!(c, a);
        assert_eq!(s.drain(), vec![3, 2]);
        let _ = b;
    }

    #[test]
    fn config_validation() {
        assert!(MeshConfig::default().validate().is_ok());
        let zero = MeshConfig {
            lane_capacity: 0,
            ..MeshConfig::default()
        };
        assert!(zero.validate().is_err());
        let deep = MeshConfig {
            max_depth: 0,
            ..MeshConfig::default()
        };
        assert!(deep.validate().is_err());
    }

    #[test]
    fn gate_hands_on_wakeups() {
        let ex = glommio::LocalExecutorBuilder::default()
            .io_memory(64 << 10)
            .make();
        let Ok(ex) = ex else {
            eprintln!("skipped: no glommio executor here (io_uring or memlock missing)");
            return;
        };
        ex.run(async {
            let gate = Rc::new(Gate::new(1));
            let held = gate.acquire().await.ok();
            let a = glommio::spawn_local({
                let gate = gate.clone();
                async move { gate.acquire().await.is_ok() }
            });
            let b = glommio::spawn_local({
                let gate = gate.clone();
                async move { gate.acquire().await.is_ok() }
            });
            glommio::executor().yield_task_queue_now().await;
            // Wake `a`, then cancel it before it runs: `b` must still get the unit.
            drop(held);
            drop(a);
            assert!(b.await);
        });
    }
}
