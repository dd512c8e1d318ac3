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
//! bounded lock-free queues (`concurrent_queue::ConcurrentQueue`, which either end may close)
//! for every ordered pair of shards `(i, j)`, `i != j`: a **request lane** `i → j` and a
//! **completion lane** `j → i` carrying the answers to `i`'s requests. Both hold
//! [`MeshConfig::lane_capacity`] messages. Each shard also has a **doorbell**, which every
//! other shard can ring: a flag and the waker of the shard's inbox task (below).
//!
//! Sending is: push into the lane, then ring the target's doorbell (set the flag and, if it
//! was clear, wake the inbox task). Taking is: clear the flag, then drain every
//! incoming lane: resolve the completions, spawn the requests' jobs as local tasks. Two things
//! take, on the target's own thread:
//!
//! - the **progress driver**, on every round (`driver.rs` calls a hook the mesh registers;
//!   when nothing came, the hook is one load of the flag, `SeqCst`: a plain load on x86). A
//!   shard whose driver spins, busy with UCX traffic or in its spin window, sees a forwarded
//!   request or completion within one progress round, with no system call on either side.
//!   What it takes counts as an event for the spin window.
//! - the **inbox task**, one per shard, which puts its waker on the doorbell when it starts
//!   and sleeps whenever it finds the flag clear. When the target sleeps (its driver asleep,
//!   its executor parked), the sender's wake takes glommio's path for a waker woken from
//!   another thread: it queues the waker for the target's executor and, the executor being
//!   parked, writes its eventfd. The task drains the lanes.
//!
//! Mesh traffic keeps an awake driver awake, but does not wake a sleeping one: a shard whose
//! only work is forwarding (waiting for completions, or serving jobs now and then) sleeps as
//! before, and pays one wake-up per message that finds it asleep (the idle columns of the
//! `hop` example). Waking the driver (to spin for its spin window) when a request is sent or
//! taken was tried while this design was developed, and left out: it made a hop between two
//! otherwise idle shards faster when each had a core of its own, but with more shards than
//! cores (`am_echo`'s two nodes of two shards on the 2-core VM) the extra spinning shard took
//! the core the others needed, and forwarded round trips became several times slower.
//!
//! A spinning target gets the wake as well, queued without the eventfd write (the executor is
//! not parked), and runs the inbox task when glommio next looks at its foreign wakes (at the
//! progress queue's preempt, `boot.rs`); by then the driver has emptied the lanes. While the
//! target's driver polls, only the ring that sets the flag wakes: one wake per message when
//! the driver takes each message as it comes, fewer in bursts.
//!
//! While the target's driver sleeps (the doorbell's `asleep` flag, which the driver sets
//! through its hook before its last look at the lanes and clears when it wakes), every ring
//! wakes the inbox task. One wake per burst is not enough there: glommio 0.9 can park an
//! executor with a task runnable (see `driver.rs`), and while this design was developed,
//! `am_echo` showed, now and then, forwards to a sleeping shard that waited for its driver's
//! sleep timeout ([`MAX_SLEEP`](crate::driver::MAX_SLEEP)) until every ring woke the task. The
//! waker stays on the doorbell (woken by reference, not taken), so that each of those rings
//! reaches the executor whatever the inbox task is doing. A hop between two awake shards
//! costs two queue operations each way and a progress round (the busy rows of
//! `cargo run --release -p shardcx-shards --example hop`); the glommio shared channels used
//! before were looked at by a spinning target only at its preempt.
//!
//! The jobs a driver takes are spawned into the shard's default task queue, like those the
//! inbox task takes: they run like the shard's other tasks, not in the driver's latency queue.
//!
//! Why nothing is lost: whoever clears the flag drains after clearing it, and a sender sets it
//! after its push; both are read-modify-writes, so a push is either seen by the drain that
//! cleared the flag or sets it again. The inbox task puts its waker on the doorbell before it
//! first looks at the flag, and a sender that sets the flag wakes it, so a set flag always has
//! a drain coming (the driver's next round, or the inbox task, woken or about to look). The
//! driver marks itself asleep before its last look at the flag, and a sender reads the mark
//! after setting the flag (all `SeqCst`): either that look takes the message, or the sender
//! wakes the inbox task.
//!
//! A sender that finds its lane full registers its task on the lane (locally), marks the lane
//! "sender waiting", and looks again; a receiver that took items from a marked lane clears
//! the mark and rings the sender's doorbell, whose drain wakes the local waiters (a `SeqCst`
//! fence on each side between the write and the read: either the sender sees the room, or the
//! receiver sees the mark). The doorbell also carries closures (see "Shutdown").
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
//! - taking from a lane never waits: it spawns each job as a local task, resolves local
//!   waiters, and wakes local senders waiting for room. The driver or the inbox task takes
//!   whenever the target's executor runs, so a full lane always drains, and a send waiting for
//!   room always finishes;
//! - a permit of level `d` is held by a job of depth `d + 1`, which waits (besides its own
//!   local work) only for permits of level `d + 1` and for lanes. Jobs at the deepest level take
//!   no permits, so they finish; by induction on the level, every permit is given back.
//!
//! Per lane, at most `lane_capacity × max_depth` jobs run at once on the target. Cycles between
//! shards (`A → B` while `B → A`, many at once) need no special case: taking never blocks.
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
//! - at 0, each shard closes its lanes (both directions), stops its inbox task and returns
//!   from [`ShardsBuilder::run`](crate::ShardsBuilder::run)'s executor. Closing rings the
//!   other shards' doorbells, which see the lanes closed and the counter at 0, and leave too.
//!
//! Two cases end a shard early. A shard that fails or panics leaves: its lanes close, its
//! peers find its completion lane closed (once drained), and the forwards waiting on it fail
//! with [`ForwardError::ShardStopped`]; its units are removed from the counter so the others
//! still leave. (A shard whose executor never started drops its ends, which closes its lanes
//! the same way.) And once every user future has ended, a shard waits at most
//! [`MeshConfig::drain_timeout`] for the set to become quiescent (a job that never ends must
//! not hold the process forever); after that it leaves the same way.
//!
//! ## What is `Send`
//!
//! [`MeshConfig`], [`MeshStats`] and [`ForwardError`] are `Send`. The job closure and its
//! result must be `Send`; the job's future never leaves the target shard and need not be. The
//! lanes and doorbells are shared between threads (`Arc`), and carry only `Send` messages.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::rc::{Rc, Weak};
use std::sync::atomic::{fence, AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use concurrent_queue::{ConcurrentQueue, PopError, PushError};
use futures_lite::FutureExt;
use glommio::TaskQueueHandle;

use crate::boot::ShardCtx;
use crate::driver::{PollHook, RoundHook};
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

/// Counters of one shard's mesh ([`ShardCtx::mesh_stats`]): who took the requests and
/// completions that arrived in its lanes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MeshStats {
    /// Messages taken by the progress driver, in its rounds (the shard was awake).
    pub taken_by_driver: u64,
    /// Messages taken by the inbox task, woken by a sender (the driver was asleep, or had
    /// not looked yet).
    pub taken_by_task: u64,
    /// Requests this shard forwarded to other shards (each a hop through a lane).
    pub forwarded: u64,
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

/// One direction of one lane: a bounded queue from one shard to another, shared by the two.
struct Chan<T> {
    queue: ConcurrentQueue<T>,
    /// Set by the sending shard while one of its tasks waits for room; cleared by the receiving
    /// shard, which then rings the sender's doorbell.
    sender_waiting: AtomicBool,
}

/// A shard's doorbell: rung by the other shards after they push into one of its lanes, make
/// room in a lane it waits on, or close their lanes.
struct Doorbell {
    /// Something may be waiting in this shard's lanes; cleared before each drain.
    rung: AtomicBool,
    /// The shard's driver does not poll the lanes (it sleeps, stopped, or has not started):
    /// every ring wakes the inbox task, not only the one that sets `rung`.
    asleep: AtomicBool,
    /// The shard's inbox task, from its first poll until it ends. Locked only by a ring that
    /// sets the flag (to wake it by reference), and by the task when it starts and ends. A
    /// mutex rather than an atomic waker: the waker stays, and it is put and taken on the
    /// task's own thread, because a glommio waker dropped last by another thread after its
    /// executor has gone is never freed (nor is the executor's eventfd).
    waker: Mutex<Option<Waker>>,
}

/// One shard's ends of the mesh, made before the executors start. `Send`.
pub(crate) struct MeshEnds {
    id: usize,
    peers: Vec<Option<PeerEnds>>,
    bell: Arc<Doorbell>,
    member: Membership,
}

/// One shard's four lane ends with one peer, and the peer's doorbell. Dropping them closes the
/// lanes (a shard that never starts, or whose state is dropped, reads as gone to the peer).
struct PeerEnds {
    /// Requests from this shard to the peer.
    req_tx: Arc<Chan<Request>>,
    /// Requests from the peer to this shard.
    req_rx: Arc<Chan<Request>>,
    /// Completions of the peer's requests, from this shard to the peer.
    done_tx: Arc<Chan<Completion>>,
    /// Completions of this shard's requests, from the peer.
    done_rx: Arc<Chan<Completion>>,
    /// The peer's doorbell.
    bell: Arc<Doorbell>,
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

/// One shard's mesh.
pub(crate) struct MeshState {
    id: ShardId,
    shard_count: usize,
    config: MeshConfig,
    lanes: Vec<Option<Lane>>,
    /// This shard's doorbell.
    bell: Arc<Doorbell>,
    member: RefCell<Membership>,
    /// Busy units of this shard (see the module docs).
    busy: Cell<usize>,
    user_done: Cell<bool>,
    /// The shard has left: its lanes are closed and nothing more is taken from them.
    left: Cell<bool>,
    poke: Poke,
    /// The task queue the driver spawns jobs into (the shard's default queue), set by `start`.
    jobs: Cell<Option<TaskQueueHandle>>,
    taken_by_driver: Cell<u64>,
    taken_by_task: Cell<u64>,
    forwarded: Cell<u64>,
}

/// The running inbox task of one shard; dropping it stops the task. Kept apart from
/// [`MeshState`], which the task only holds weakly: should the shard die, dropping its state
/// closes its lanes even if its task is never polled again.
pub(crate) struct MeshTasks {
    _inbox: glommio::Task<()>,
}

/// This shard's side of the lanes with one peer.
struct Lane {
    ends: PeerEnds,
    /// Tasks of this shard waiting for room in `ends.req_tx` or `ends.done_tx`.
    room: RefCell<Vec<Waker>>,
    /// Permits for requests to the peer, one pool per nesting level.
    gates: Vec<Rc<Gate>>,
    pending: RefCell<Slab<Pending>>,
    dead: Cell<bool>,
}

/// Who takes from the lanes (see the module docs).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Taker {
    Driver,
    InboxTask,
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
    /// The task queue to spawn the job into, when the taker runs in another one (the driver).
    queue: Option<TaskQueueHandle>,
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

/// Takes the inbox task's waker off the doorbell when the task ends or is dropped, on its own
/// thread (see [`Doorbell::waker`]).
struct Unregister(Arc<Doorbell>);

/// What the progress driver calls (see [`MeshState::poll_hook`]); holds the shard weakly.
struct DriverHook {
    bell: Arc<Doorbell>,
    mesh: Weak<MeshState>,
    ctx: Weak<ShardCtx>,
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

/// Make every shard's ends: a request lane and a completion lane per ordered pair, and a
/// doorbell per shard. `capacity` must be at least 1 (checked by [`MeshConfig::validate`]).
pub(crate) fn lanes(shard_count: usize, capacity: usize) -> Vec<MeshEnds> {
    let shared = Arc::new(MeshShared {
        active: AtomicUsize::new(shard_count),
        users_running: AtomicUsize::new(shard_count),
    });
    let n = shard_count;
    let capacity = capacity.max(1);
    let bells: Vec<Arc<Doorbell>> = (0..n).map(|_| Arc::new(Doorbell::new())).collect();
    // `req[i][j]`: requests i → j. `done[i][j]`: completions of i's requests to j, j → i.
    let req: Vec<Vec<Option<Arc<Chan<Request>>>>> = grid(n, capacity);
    let done: Vec<Vec<Option<Arc<Chan<Completion>>>>> = grid(n, capacity);
    let ends = |i: usize, j: usize| -> Option<PeerEnds> {
        Some(PeerEnds {
            req_tx: req[i][j].clone()?,
            req_rx: req[j][i].clone()?,
            done_tx: done[j][i].clone()?,
            done_rx: done[i][j].clone()?,
            bell: bells[j].clone(),
        })
    };
    (0..n)
        .map(|i| MeshEnds {
            id: i,
            peers: (0..n).map(|j| ends(i, j)).collect(),
            bell: bells[i].clone(),
            member: Membership {
                shared: shared.clone(),
                active: true,
                user_running: true,
            },
        })
        .collect()
}

/// One channel per ordered pair `(i, j)`, `i != j`.
fn grid<T>(n: usize, capacity: usize) -> Vec<Vec<Option<Arc<Chan<T>>>>> {
    (0..n)
        .map(|i| {
            (0..n)
                .map(|j| (i != j).then(|| Arc::new(Chan::new(capacity))))
                .collect()
        })
        .collect()
}

impl<T> Chan<T> {
    fn new(capacity: usize) -> Self {
        Self {
            queue: ConcurrentQueue::bounded(capacity),
            sender_waiting: AtomicBool::new(false),
        }
    }

    /// A push would not find the lane full (it may find it closed).
    fn has_room(&self) -> bool {
        !self.queue.is_full() || self.queue.is_closed()
    }

    /// Push `item`, waiting for room (on `room`, the sending lane's waiters) while the lane is
    /// full, and ring `bell`, the receiver's doorbell. Gives the item back if the lane is
    /// closed.
    async fn send(&self, item: T, bell: &Doorbell, room: &RefCell<Vec<Waker>>) -> Result<(), T> {
        let mut item = item;
        loop {
            match self.queue.push(item) {
                Ok(()) => {
                    bell.ring();
                    return Ok(());
                }
                Err(PushError::Closed(back)) => return Err(back),
                Err(PushError::Full(back)) => item = back,
            }
            futures_lite::future::poll_fn(|cx| {
                if self.has_room() {
                    return Poll::Ready(());
                }
                {
                    let mut room = room.borrow_mut();
                    if !room.iter().any(|w| w.will_wake(cx.waker())) {
                        room.push(cx.waker().clone());
                    }
                }
                self.sender_waiting.store(true, Ordering::SeqCst);
                // Pairs with the fence in `room_made`: either this look sees the room, or the
                // receiver sees the mark.
                fence(Ordering::SeqCst);
                if self.has_room() {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                }
            })
            .await;
        }
    }

    /// The receiver took items: if the sender waits for room, ring its doorbell.
    fn room_made(&self, sender_bell: &Doorbell) {
        fence(Ordering::SeqCst);
        if self.sender_waiting.load(Ordering::Relaxed)
            && self.sender_waiting.swap(false, Ordering::AcqRel)
        {
            sender_bell.ring();
        }
    }
}

impl Doorbell {
    fn new() -> Self {
        Self {
            rung: AtomicBool::new(false),
            asleep: AtomicBool::new(true),
            waker: Mutex::new(None),
        }
    }

    /// Tell the shard that something is waiting for it. Call after the push (or the closure),
    /// from any thread.
    fn ring(&self) {
        // `SeqCst`, with the driver's in `DriverHook`: either this sees the driver asleep, or
        // the driver's last look before sleeping sees the flag.
        let was_rung = self.rung.swap(true, Ordering::SeqCst);
        if !was_rung || self.asleep.load(Ordering::SeqCst) {
            if let Some(w) = self.waker().as_ref() {
                w.wake_by_ref();
            }
        }
    }

    /// The inbox task's waker (a panic elsewhere while it was held cannot have left it
    /// half-written: it is one `Option` assignment).
    fn waker(&self) -> std::sync::MutexGuard<'_, Option<Waker>> {
        self.waker.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl PeerEnds {
    /// Close the four lanes with the peer and tell it. Idempotent.
    fn close(&self) {
        // Non-short-circuiting: close all four.
        let newly = self.req_tx.queue.close()
            | self.req_rx.queue.close()
            | self.done_tx.queue.close()
            | self.done_rx.queue.close();
        if newly {
            self.bell.ring();
        }
    }
}

impl Drop for PeerEnds {
    fn drop(&mut self) {
        self.close();
    }
}

impl MeshEnds {
    /// Make this shard's mesh from its ends (inside the shard's executor). The lanes need no
    /// connecting: what peers send before this shard starts waits in them, and the first look
    /// of the inbox task or the driver takes it.
    pub(crate) fn connect(self, config: MeshConfig) -> Rc<MeshState> {
        let MeshEnds {
            id,
            peers,
            bell,
            member,
        } = self;
        let shard_count = peers.len();
        let lanes = peers
            .into_iter()
            .map(|ends| {
                ends.map(|ends| Lane {
                    ends,
                    room: RefCell::new(Vec::new()),
                    gates: (0..config.max_depth)
                        .map(|_| Rc::new(Gate::new(config.lane_capacity)))
                        .collect(),
                    pending: RefCell::new(Slab::new()),
                    dead: Cell::new(false),
                })
            })
            .collect();
        Rc::new(MeshState {
            id: shard_id(id),
            shard_count,
            config,
            lanes,
            bell,
            member: RefCell::new(member),
            busy: Cell::new(1),
            user_done: Cell::new(false),
            left: Cell::new(false),
            poke: Poke::default(),
            jobs: Cell::new(None),
            taken_by_driver: Cell::new(0),
            taken_by_task: Cell::new(0),
            forwarded: Cell::new(0),
        })
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
    /// Start serving: spawn the inbox task (in the calling task's queue, the shard's default
    /// one, where the driver spawns jobs too). The task holds the shard and its mesh weakly: it
    /// must not keep the shard alive.
    pub(crate) fn start(self: &Rc<Self>, ctx: &Rc<ShardCtx>) -> MeshTasks {
        self.jobs
            .set(Some(glommio::executor().current_task_queue()));
        MeshTasks {
            _inbox: glommio::spawn_local(serve_inbox(
                Rc::downgrade(self),
                Rc::downgrade(ctx),
                self.bell.clone(),
            )),
        }
    }

    /// The hook the progress driver calls: every round, take what waits in the lanes; and
    /// tell the senders whether the driver sleeps. Holds the shard and its mesh weakly.
    pub(crate) fn poll_hook(self: &Rc<Self>, ctx: &Rc<ShardCtx>) -> PollHook {
        Rc::new(DriverHook {
            bell: self.bell.clone(),
            mesh: Rc::downgrade(self),
            ctx: Rc::downgrade(ctx),
        })
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

    /// Leave the mesh: close every lane, stop the inbox task, fail whatever still waits.
    pub(crate) fn close(&self, tasks: MeshTasks) {
        self.leave();
        // Dropping a glommio task cancels it.
        drop(tasks);
    }

    /// A guard that makes this shard leave the mesh when it is dropped: at the end of
    /// `shard_main`, on an early error return, and when the shard's main future is dropped
    /// because it panicked. Jobs of a dead shard may keep its state alive (glommio need not drop
    /// the futures of a dead executor), so leaving is explicit rather than left to `Drop`.
    pub(crate) fn leave_guard(self: &Rc<Self>) -> LeaveGuard {
        LeaveGuard(self.clone())
    }

    /// This shard's counters.
    fn stats(&self) -> MeshStats {
        MeshStats {
            taken_by_driver: self.taken_by_driver.get(),
            taken_by_task: self.taken_by_task.get(),
            forwarded: self.forwarded.get(),
        }
    }

    /// For each other shard, this shard's requests to it that have not completed.
    fn in_flight(&self) -> Vec<(ShardId, usize)> {
        self.lanes
            .iter()
            .enumerate()
            .filter_map(|(i, l)| Some((ShardId::new(i as u16), l.as_ref()?.pending.borrow().len())))
            .collect()
    }

    /// Give back this shard's shares of the shared counters and close its lanes, both ways;
    /// the peers, rung, find them closed and fail what waits on this shard. Idempotent.
    fn leave(&self) {
        self.user_done.set(true);
        self.left.set(true);
        {
            let mut member = self.member.borrow_mut();
            member.user_finished();
            member.leave();
        }
        for (peer, lane) in self.lanes.iter().enumerate() {
            if let Some(lane) = lane {
                lane_failed(self, peer);
                lane.ends.close();
                lane.wake_room();
            }
        }
    }

    fn lane(&self, peer: usize) -> Option<&Lane> {
        self.lanes.get(peer).and_then(Option::as_ref)
    }

    /// Take what waits in this shard's incoming lanes, if the doorbell was rung: resolve the
    /// completions, spawn the requests' jobs, wake local senders that wait for room or for a
    /// peer that has closed. Never waits. Returns the number of messages taken.
    fn take(self: &Rc<Self>, ctx: &Rc<ShardCtx>, by: Taker) -> usize {
        if !self.bell.rung.swap(false, Ordering::AcqRel) || self.left.get() {
            return 0;
        }
        // The driver runs in its own task queue; jobs belong in the shard's default one.
        let queue = match by {
            Taker::Driver => self.jobs.get(),
            Taker::InboxTask => None,
        };
        let mut taken = 0;
        for (peer, lane) in self.lanes.iter().enumerate() {
            let Some(lane) = lane else { continue };
            taken += self.take_completions(lane, peer);
            taken += self.take_requests(ctx, lane, peer, queue);
            lane.wake_room();
        }
        let counter = match by {
            Taker::Driver => &self.taken_by_driver,
            Taker::InboxTask => &self.taken_by_task,
        };
        counter.set(counter.get() + taken as u64);
        taken
    }

    fn take_completions(&self, lane: &Lane, peer: usize) -> usize {
        let (n, closed) = self.pop_lane(&lane.ends.done_rx, &lane.ends.bell, |c| {
            if let Some(p) = self.remove_pending(lane, c.slot) {
                let outcome = c.outcome.map_err(|message| ForwardError::JobPanicked {
                    shard: shard_id(peer),
                    message,
                });
                p.slot.resolve(outcome);
                // `p`'s permit is given back here.
            }
        });
        // The peer has gone, and everything it had sent has been taken.
        if closed && !lane.dead.get() {
            lane_failed(self, peer);
        }
        n
    }

    fn take_requests(
        self: &Rc<Self>,
        ctx: &Rc<ShardCtx>,
        lane: &Lane,
        peer: usize,
        queue: Option<TaskQueueHandle>,
    ) -> usize {
        let (n, closed) = self.pop_lane(&lane.ends.req_rx, &lane.ends.bell, |req| {
            // Counted before anything can complete it: the sender still counts its request.
            self.busy_inc();
            let env = JobEnv {
                ctx: ctx.clone(),
                depth: req.depth.saturating_add(1),
                reply: Reply {
                    mesh: self.clone(),
                    to: peer,
                    slot: req.slot,
                },
                queue,
            };
            // Spawns the job as a local task; never waits.
            (req.start)(env);
        });
        // The peer has gone (or closed at quiescence): no more requests from it.
        if closed {
            self.poke.wake();
        }
        n
    }

    /// Pop what waits in `chan`, an incoming lane, and hand each item to `each`; then, if any
    /// were taken, ring `sender_bell` should the sender wait for room. Returns how many were
    /// taken, and whether the lane was found closed with nothing left in it.
    fn pop_lane<T>(
        &self,
        chan: &Chan<T>,
        sender_bell: &Doorbell,
        mut each: impl FnMut(T),
    ) -> (usize, bool) {
        let mut n = 0;
        let mut closed = false;
        loop {
            // Bounded, so that peers pushing all the while cannot hold the taker here: the
            // rest is taken at the next look.
            if n == self.config.lane_capacity {
                // A read-modify-write, like the senders' rings: a store would cut their release
                // sequence, and the next drain might not see their pushes.
                self.bell.rung.swap(true, Ordering::AcqRel);
                break;
            }
            match chan.queue.pop() {
                Ok(item) => {
                    n += 1;
                    each(item);
                }
                Err(PopError::Empty) => break,
                Err(PopError::Closed) => {
                    closed = true;
                    break;
                }
            }
        }
        if n > 0 {
            chan.room_made(sender_bell);
        }
        (n, closed)
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
        self.forwarded.set(self.forwarded.get() + 1);
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

impl Lane {
    /// Wake this shard's tasks waiting for room in a lane to the peer, if there may be some
    /// (or the lane has closed): they look again.
    fn wake_room(&self) {
        if self.room.borrow().is_empty() {
            return;
        }
        if self.ends.req_tx.has_room() || self.ends.done_tx.has_room() {
            let waiters = std::mem::take(&mut *self.room.borrow_mut());
            for w in waiters {
                w.wake();
            }
        }
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

/// The inbox task: takes from the lanes when the doorbell is rung and the driver has not
/// taken first (it sleeps, or has not looked yet). It leaves the driver as it is (see the
/// module docs).
async fn serve_inbox(mesh: Weak<MeshState>, ctx: Weak<ShardCtx>, bell: Arc<Doorbell>) {
    let _unregister = Unregister(bell.clone());
    loop {
        futures_lite::future::poll_fn(|cx| {
            // On the doorbell before the flag is read: a ring after the read wakes this task.
            {
                let mut waker = bell.waker();
                if !waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    *waker = Some(cx.waker().clone());
                }
            }
            if bell.rung.load(Ordering::Acquire) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
        let (Some(mesh), Some(ctx)) = (mesh.upgrade(), ctx.upgrade()) else {
            return;
        };
        if mesh.left.get() {
            return;
        }
        mesh.take(&ctx, Taker::InboxTask);
        drop((mesh, ctx));
        // Peers may keep ringing: let the shard's other tasks run between two looks.
        futures_lite::future::yield_now().await;
    }
}

impl RoundHook for DriverHook {
    fn poll(&self) -> bool {
        // The whole cost of a round in which nothing came (a plain load on x86; `SeqCst` for
        // the look that follows `sleeping(true)`, see `Doorbell::ring`).
        if !self.bell.rung.load(Ordering::SeqCst) {
            return false;
        }
        match (self.mesh.upgrade(), self.ctx.upgrade()) {
            (Some(mesh), Some(ctx)) => mesh.take(&ctx, Taker::Driver) > 0,
            _ => false,
        }
    }

    fn sleeping(&self, asleep: bool) {
        self.bell.asleep.store(asleep, Ordering::SeqCst);
    }
}

impl Drop for Unregister {
    fn drop(&mut self) {
        let waker = self.0.waker().take();
        drop(waker);
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
        let JobEnv {
            ctx,
            depth,
            reply,
            queue,
        } = self;
        let task = async move {
            let outcome = run_job(ctx, depth, job).await;
            reply.send(outcome.map(|r| Box::new(r) as Erased)).await;
        };
        match queue {
            Some(queue) => spawn_into(task, queue),
            None => {
                glommio::spawn_local(task).detach();
            }
        }
    }
}

/// Spawn `task` into `queue`, or into the current one should `queue` no longer exist (a user
/// may remove task queues): the job must run, or its caller waits for ever.
fn spawn_into(task: impl Future<Output = ()> + 'static, queue: TaskQueueHandle) {
    let cell = Rc::new(Cell::new(Some(task)));
    let inner = cell.clone();
    let spawned = glommio::spawn_local_into(
        async move {
            if let Some(task) = inner.take() {
                task.await;
            }
        },
        queue,
    );
    match spawned {
        Ok(t) => {
            t.detach();
        }
        Err(_) => {
            if let Some(task) = cell.take() {
                glommio::spawn_local(task).detach();
            }
        }
    }
}

impl Reply {
    async fn send(self, outcome: Result<Erased, String>) {
        if let Some(lane) = self.mesh.lane(self.to) {
            // Waits only for room, which the caller's shard makes without waiting on anything.
            // An error means the caller has gone: nobody wants the result.
            let _ = lane
                .ends
                .done_tx
                .send(
                    Completion {
                        slot: self.slot,
                        outcome,
                    },
                    &lane.ends.bell,
                    &lane.room,
                )
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

    /// Who took the requests and completions that arrived in this shard's lanes: its progress
    /// driver (awake) or its inbox task (woken by the sender).
    pub fn mesh_stats(&self) -> MeshStats {
        self.mesh().stats()
    }

    /// For each other shard, the requests this shard forwarded to it that have not completed
    /// (the depth of its lane's pending table).
    pub fn lanes_in_flight(&self) -> Vec<(ShardId, usize)> {
        self.mesh().in_flight()
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
    if lane
        .ends
        .req_tx
        .send(request, &lane.ends.bell, &lane.room)
        .await
        .is_err()
    {
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

    /// Entries held.
    fn len(&self) -> usize {
        self.entries.len() - self.free.len()
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
