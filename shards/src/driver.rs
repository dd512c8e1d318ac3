//! The progress driver: fast when busy, asleep when idle.
//!
//! One task per shard, in the shard's default task queue, calls [`Worker::progress`] in a loop
//! (application frames with eager data are handled inside it, in UCX's callback), dispatching
//! what UCX's callbacks recorded right after each call that reported events (handlers run
//! inline; see "The hot path" at `run`) and yielding to the shard's other tasks once a round found work,
//! while events keep coming and for a spin window ([`DriverConfig::spin`]) after the last
//! application event (liveness traffic starts none: see below). When the window has passed,
//! it arms the worker and sleeps until the worker's event fd is readable.
//!
//! ## How a glommio task sleeps on a UCX fd without unsafe code
//!
//! glommio 0.9 has no public "wait until this fd is readable", and wrapping a raw fd in a
//! glommio stream needs `FromRawFd` (unsafe, forbidden here). So each shard has a small
//! **waker thread** that blocks on a duplicate of the worker's event fd ([`WakeupFd`], `Send`)
//! and talks to the shard over a Unix stream socket:
//!
//! - the waker thread binds a `std` `UnixListener` on a unique path in the temporary
//!   directory; the shard connects with `glommio::net::UnixStream::connect` (safe), and the path
//!   is removed once connected;
//! - to sleep, the driver writes one byte ("watch") and awaits one byte back; the waker thread,
//!   which blocks in `read` between watches, then blocks in `poll(2)` on the event fd and
//!   writes one byte when it is readable.
//!
//! A Unix socket was chosen over a second glommio executor in the waker thread (so that a
//! glommio shared channel could connect the two) because an executor locks io memory, and the
//! machine's `RLIMIT_MEMLOCK` (8 MiB here) is better left to the shards. A wake-up costs one
//! socket round trip between two threads, the same as waking a thread blocked on a socket,
//! which is what DESIGN.md asks of the first message after idle.
//!
//! Other wake reasons: glommio timers and other tasks run while the driver sleeps (it is only
//! an awaiting task); a task that needs the driver to progress right away calls
//! [`crate::ShardCtx::wake_driver`], which signals the worker (`ucp_worker_signal`) and so makes
//! the event fd readable.
//!
//! ## The mesh's hook: cross-shard lanes polled every round
//!
//! The cross-shard mesh registers a hook (`Driver::set_poll_hook`, a `RoundHook`) that the
//! driver polls on every round, after `progress`: it takes whatever other shards have put in
//! this shard's lanes (one atomic load when nothing came; see the module docs of
//! [`crate::mesh`]). A spinning shard so sees a forwarded request or completion within one
//! round, instead of when glommio next looks at other threads' wake-ups (the executor's
//! preempt timer, 1 ms, `PREEMPT_TIMER` in `boot.rs`). What the hook takes counts as an event,
//! like a UCX one: the driver keeps spinning through an exchange of forwards.
//!
//! A sleeping driver does not poll it; the mesh's own inbox task, woken by the sender through
//! the executor's eventfd, takes instead, and leaves the driver asleep (the mesh's docs say
//! why). So that senders know which it is, the driver tells the hook when it goes to sleep,
//! and then polls it once more before arming (a message that came in between is taken, and
//! the driver spins on), and tells it again when it wakes.
//!
//! ## Shutdown
//!
//! Stopping the shard sets the stop flag and signals the worker: a sleeping driver is woken by its
//! waker thread, sees the flag and returns, dropping its socket; the waker thread, blocked in
//! `read`, then sees end-of-file and exits. The waker thread never blocks forever on the event
//! fd: it waits with a timeout ([`WATCH_SLICE`]) and checks the stop flag between waits.
//!
//! ## glommio 0.9 can park with the driver runnable: the backstop timer
//!
//! glommio's executor loop installs the task queues' preempt timer (here 1 ms, set for every
//! queue in `boot.rs`), then runs the task queues; if the preempt timer has
//! already fired by the time it checks (the thread was descheduled for longer than that in
//! between, which happens on a busy 2-core machine), it runs nothing, and then parks in
//! `io_uring_enter` as though no task were runnable. It wakes only for I/O or a timer. A driver
//! that had just yielded (`yield_now`, or formerly `yield_task_queue_now` when it had a task
//! queue of its own) is neither, so the
//! shard stopped for good: the `idle_wake` example hung in about one run in five, with the
//! driver parked between two progress rounds and its waker thread idle in `read`.
//!
//! So while it spins, the driver keeps a glommio timer registered ([`BACKSTOP`], re-armed
//! when half of it has passed, which costs one clock comparison per round): a park with the
//! driver runnable then lasts at most that long. While it sleeps on the socket, the
//! [`MAX_SLEEP`] timeout bounds a park after the socket's wake-up; a park after the timeout's
//! own wake-up is bounded by a backstop set to `MAX_SLEEP + BACKSTOP` (one timer per sleep,
//! which never fires on an idle shard). The race itself is in glommio (`LocalExecutor::run`
//! parks when `run_task_queues` returns false because `need_preempt()` was already true); the
//! shorter the preempt timer, the more often it happens.
//!
//! ## The watchdog
//!
//! The backstop bounds a park only if glommio's own timer wakes the executor. Shards were
//! still seen parked in `io_uring_enter` for good on a heavily loaded machine (the reliability
//! suite's 512-endpoint row, 1 run in 5 at load 26-42: a node that never connected, a server
//! that answered no handshake and no SIGTERM until a debugger's attach interrupted the wait).
//! The one such park caught with this watchdog in place (`scripts/repro-park`) was earlier
//! than anything here can reach: the executor parked before it first ran the shard's main
//! task, with no timer registered and no waker thread yet. That one is ended by signals: each
//! shard's executor thread is nudged (`shardcx_ucx::Nudger`, `start_nudger` in `boot.rs`)
//! until the shard's main task first runs, and from then on the backstop and this watchdog
//! take over. For a park once the driver runs, the waker
//! thread also watches the driver: every [`WATCH_SLICE`] it waits out (while the driver spins, or sleeps), it checks
//! that the driver was polled since its last look (the driver stores its poll count, an
//! atomic store per poll of up to [`IDLE_ROUNDS`] rounds) and, if it was not, wakes the driver
//! task from its own thread. glommio queues a foreign wake-up and writes the executor's event
//! fd, which ends any park; the executor then runs its timers and tasks. The driver is polled
//! at least every [`MAX_SLEEP`] even when asleep, so a look that finds no poll means the
//! thread was parked, descheduled, or busy in a task that does not yield for longer than a
//! slice; the wake-up is harmless in each case. [`DriverStats::watchdog_wakes`] counts them.
//!
//! ## Changing the spin/arm strategy
//!
//! The whole strategy is the driver task's loop (`run` in this module): when to arm, how long
//! to spin. Arming does not hide anything from `progress`: a message that arrives while the
//! driver spins with an armed worker is still found by `progress`, on TCP as on shared memory;
//! arming only decides whether the event fd will also report it. (Slow round trips over TCP
//! that were once blamed on arming came from UCX's async thread, which inherits the CPU
//! affinity of the thread that first creates a UCX context and so shared a core with a pinned,
//! spinning shard; `shardcx-ucx` now moves it off that core.)
//!
//! The default spin window is `shardcx_ucx::DEFAULT_SPIN` (1 ms): waking a sleeping shard
//! costs about 200 µs on this VM (the first message after idle, one way, in `idle_wake`),
//! against about a microsecond for a round trip while awake, so a shard keeps spinning through
//! the gaps of an active exchange, and an idle shard still sleeps 1 ms after its last event.
//! A shorter window saves CPU on bursty loads at the price of more wake-ups; measure with the
//! `idle_wake` example and `DriverConfig::spin`.
//!
//! ## Liveness traffic does not keep a shard awake
//!
//! Every rail sends a heartbeat each interval (100 ms by default) and answers the peer's, so a
//! shard holding many idle rails is woken often: the 16-shard server of the reliability
//! suite's R8b holds 512 rails, some 10,000 heartbeats and acks in and as many out each
//! second. When each of those wakes started a spin window, and an idle poll ran all of
//! [`IDLE_ROUNDS`] over TCP (an `epoll_wait` each), that idle server and its clients asked
//! for several times the 2-core machine's CPU and starved each other (a server shard
//! runnable for 1.9 s got 1 ms of CPU, and its peers declared it dead).
//!
//! So only what an application may wait on starts the spin window: frames other than
//! heartbeats and their acks, the mesh's messages, a task's send
//! ([`crate::ShardCtx::wake_driver`]) and UCX events that came with no frame (a rendezvous
//! under way; a round that also carried a heartbeat counts by its frames alone, so such an
//! event arriving with a heartbeat may find the driver asleep after its next idle poll: a
//! wake-up's latency, not a loss). A wake-up by itself starts none, nor does a heartbeat's send (a rail's sender
//! nudges the driver instead of waking it): a shard woken for a heartbeat handles it, runs one
//! idle poll and sleeps again. An idle poll runs as many rounds as fit in [`IDLE_SPAN`]
//! (measured on idle polls), not a fixed count. And heartbeats go out on a grid (see
//! "Liveness" in `shardcx_proto::conn`), so a shard sends all its rails' heartbeats in one
//! wake. `scripts/idle-rails` measures it: a 16-shard server holding the rails of one-shard
//! client nodes, idle, used 64% of a core with 16 rails (its clients 51%), and more than the
//! machine had with 64; now 17% with 16 and 64 rails, 24% with 128 (the clients' process 1%,
//! 4% and 10%).

use std::cell::{Cell, OnceCell};
use std::future::Future;
use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Poll, Waker};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use futures_lite::{AsyncReadExt, AsyncWriteExt};
use glommio::net::UnixStream;
use glommio::timer::Timer;

use crate::stall::{current_tid, StallStats, StallWatch};
use crate::ucx::{Armed, WakeupFd, Worker};

/// Longest single wait of the waker thread on the event fd before it looks at the stop flag.
pub const WATCH_SLICE: Duration = Duration::from_millis(100);

/// Longest single sleep of the driver. A bound, not the wake-up path: should a wake-up ever be
/// lost (the event fd, the socket), the driver still progresses within this time.
pub const MAX_SLEEP: Duration = Duration::from_millis(50);

/// Longest time the shard's executor may stay parked while the driver task is runnable (see
/// the module docs: glommio 0.9 can park with runnable tasks). Only paid when that happens.
pub const BACKSTOP: Duration = Duration::from_millis(10);

/// Settings of a shard's progress driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DriverConfig {
    /// How long to keep calling `progress` after the last application event (not heartbeats,
    /// see the module docs) before arming and sleeping.
    pub spin: Duration,
}

impl Default for DriverConfig {
    fn default() -> Self {
        Self {
            spin: crate::ucx::DEFAULT_SPIN,
        }
    }
}

/// Counters of one driver, readable from the shard.
#[derive(Debug, Default)]
pub struct DriverStats {
    /// Progress rounds run.
    pub rounds: Cell<u64>,
    /// Times the driver went to sleep.
    pub sleeps: Cell<u64>,
    /// Times the waker thread found the driver not polled for a whole [`WATCH_SLICE`] and
    /// woke its task from outside (see "The watchdog" in the module docs). Shared with the
    /// waker thread.
    pub watchdog_wakes: Arc<AtomicU64>,
    /// Stalls of the driver the watchdog saw (see [`crate::stall`]). Shared with the waker
    /// thread.
    pub stalls: Arc<StallStats>,
    /// Whether a poll of the driver runs now (its rounds of `progress`, dispatch and the
    /// mesh's lanes): what runs then (a handler, a send the mesh forwards to this shard) runs
    /// on the driver's behalf, and must not wait for a peer.
    pub(crate) polling: Cell<bool>,
}

/// What the driver calls besides `progress` (see "The mesh's hook" in the module docs).
pub(crate) trait RoundHook {
    /// Called on every round while the driver is awake: take what has come; true if anything
    /// had, which counts as an event for the spin window.
    fn poll(&self) -> bool;

    /// The driver is going to sleep (`true`; one more [`RoundHook::poll`] follows before it
    /// arms the worker), or is awake again (`false`). Also `true` when the driver stops.
    fn sleeping(&self, asleep: bool);
}

/// The hook as the driver holds it.
pub(crate) type PollHook = Rc<dyn RoundHook>;

/// The net layer's dispatch, called right after a `progress` that reported events, while a
/// backlog waits, and on the first and last round of a poll and every `DISPATCH_LOOK`th
/// (an idle round has nothing for it: see `spin`; "The hot path"), with a
/// budget and the round's number ([`DriverStats::rounds`]): handles at most `budget` of the
/// inputs UCX's callbacks recorded, calling their handlers inline, and returns how many it
/// handled and whether inputs are left (the budget ran out).
pub(crate) type DispatchHook = Rc<dyn Fn(usize, u64) -> Dispatched>;

/// What one dispatch did (see [`DispatchHook`]).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Dispatched {
    /// Inputs handled.
    pub(crate) handled: usize,
    /// The round's frames (recorded, or dispatched inside UCX's callback) included more than
    /// liveness frames (heartbeats and their acks): they start the driver's spin window. A
    /// round that carried only liveness frames is work, but not a reason to keep spinning (see
    /// "Liveness traffic does not keep a shard awake" in the module docs).
    pub(crate) app: bool,
    /// Inputs left recorded: the next round dispatches them before calling `progress` again.
    pub(crate) backlog: bool,
    /// The clock reading taken for the round's frames (dispatched inside UCX's callbacks or
    /// by the hook), if any was: the driver uses it instead of reading the clock again.
    pub(crate) at: Option<Instant>,
}

/// A shard's running progress driver: the waker thread and the flags shared with it.
pub(crate) struct Driver {
    stop: Arc<AtomicBool>,
    sleeping: Rc<Cell<bool>>,
    kick: Rc<Cell<Kick>>,
    hook: Rc<OnceCell<PollHook>>,
    dispatch: Rc<OnceCell<DispatchHook>>,
    waker: Option<JoinHandle<()>>,
    worker: Worker,
}

/// What the driver task shares with its waker thread's watchdog (see "The watchdog" in the
/// module docs).
struct Watch {
    /// The driver's polls so far (stored by the driver, read by the watchdog).
    polls: AtomicU64,
    /// The driver task's waker, while the task runs (set by the task at its start and taken
    /// back on its own thread before it returns, so that the watchdog never drops the last
    /// reference to the task).
    waker: Mutex<Option<Waker>>,
    /// The watchdog's wakes (also [`DriverStats::watchdog_wakes`]).
    wakes: Arc<AtomicU64>,
    /// Stalls seen (also [`DriverStats::stalls`]).
    stalls: Arc<StallStats>,
}

/// The pieces the driver task runs with.
pub(crate) struct DriverTask {
    worker: Worker,
    watch: Arc<Watch>,
    stream: UnixStream,
    stop: Arc<AtomicBool>,
    sleeping: Rc<Cell<bool>>,
    /// Set by [`Driver::wake`] and [`Driver::nudge`]: a task has work for UCX (a frame queued
    /// for a sender, a send posted): the next poll runs one round and yields, instead of
    /// spinning on.
    kick: Rc<Cell<Kick>>,
    hook: Rc<OnceCell<PollHook>>,
    dispatch: Rc<OnceCell<DispatchHook>>,
    stats: Rc<DriverStats>,
    config: DriverConfig,
    /// The last dispatch left inputs recorded (see "Backlog" in [`run`]'s docs).
    backlog: Cell<bool>,
}

/// A glommio timer kept registered with the reactor while the driver runs, so that the
/// executor never parks with nothing to wake it while the driver is runnable.
struct Backstop {
    timer: Option<Timer>,
    /// When to re-arm: half of [`BACKSTOP`] after the last arming.
    rearm_at: Instant,
}

static SOCKET_SEQ: AtomicU64 = AtomicU64::new(0);

impl Driver {
    /// Start the waker thread of `worker` and connect to it. Must run inside the shard's
    /// executor.
    pub(crate) async fn start(
        worker: &Worker,
        shard: usize,
        config: DriverConfig,
        stats: Rc<DriverStats>,
    ) -> std::io::Result<(Driver, DriverTask)> {
        let fd = worker.wakeup_fd().map_err(std::io::Error::other)?;
        let path = socket_path(shard);
        let listener = UnixListener::bind(&path)?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread_stop = stop.clone();
        let watch = Arc::new(Watch {
            polls: AtomicU64::new(0),
            waker: Mutex::new(None),
            wakes: stats.watchdog_wakes.clone(),
            stalls: stats.stalls.clone(),
        });
        let thread_watch = watch.clone();
        let stall = StallWatch::new(shard, current_tid());
        let waker = std::thread::Builder::new()
            .name(format!("shardcx-waker-{shard}"))
            .spawn(move || waker_thread(listener, fd, thread_stop, thread_watch, stall))?;
        let connected = UnixStream::connect(&path).await;
        // The path is only needed until the one connection is made.
        let _ = std::fs::remove_file(&path);
        let stream = connected?;
        let sleeping = Rc::new(Cell::new(false));
        let kick = Rc::new(Cell::new(Kick::None));
        let hook = Rc::new(OnceCell::new());
        let dispatch = Rc::new(OnceCell::new());
        Ok((
            Driver {
                stop: stop.clone(),
                sleeping: sleeping.clone(),
                kick: kick.clone(),
                hook: hook.clone(),
                dispatch: dispatch.clone(),
                waker: Some(waker),
                worker: worker.clone(),
            },
            DriverTask {
                worker: worker.clone(),
                watch,
                stream,
                stop,
                sleeping,
                kick,
                hook,
                dispatch,
                stats,
                config,
                backlog: Cell::new(false),
            },
        ))
    }

    /// Call `hook` on every round from now on. Set once, when the shard starts: a later call
    /// is ignored.
    pub(crate) fn set_poll_hook(&self, hook: PollHook) {
        let _ = self.hook.set(hook);
    }

    /// Call `hook` after `progress` from now on, as [`DispatchHook`] says (the net layer's
    /// dispatch of what UCX's callbacks recorded). Set once, when the shard starts: a later call is ignored.
    pub(crate) fn set_dispatch_hook(&self, hook: DispatchHook) {
        let _ = self.dispatch.set(hook);
    }

    /// Wake the driver if it sleeps, so that it progresses the worker now; if it spins, its
    /// next poll runs one round and yields, so that a task made runnable by the caller (a
    /// sender with a queued frame) runs within a round instead of after [`IDLE_ROUNDS`].
    /// What it wakes the driver for is application traffic: it starts the spin window.
    pub(crate) fn wake(&self) {
        self.kick.set(Kick::App);
        self.signal();
    }

    /// As [`Driver::wake`], for traffic of the connections' own that no application waits for
    /// (heartbeats and their acks, sent by a rail's sender): the driver progresses it, and
    /// goes back to sleep without a spin window unless something else came.
    pub(crate) fn nudge(&self) {
        if self.kick.get() == Kick::None {
            self.kick.set(Kick::Liveness);
        }
        self.signal();
    }

    fn signal(&self) {
        if self.sleeping.get() {
            // A failed signal only delays progress until the next event.
            let _ = self.worker.signal();
        }
    }

    /// Ask the driver task and the waker thread to stop (the task returns soon after).
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.worker.signal();
    }

    /// Wait for the waker thread to exit. Call after the driver task has returned: it shuts its
    /// socket down on the way out, so the thread is at end-of-file and exits at once; should the
    /// shutdown not get through, the thread still sees the stop flag within [`WATCH_SLICE`].
    pub(crate) fn join(mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(h) = self.waker.take() {
            let _ = h.join();
        }
    }
}

impl Backstop {
    fn new() -> Self {
        Self {
            timer: None,
            rearm_at: Instant::now(),
        }
    }

    /// Make sure a timer that fires no sooner than `BACKSTOP / 2` from `now` is registered,
    /// waking this task.
    async fn arm(&mut self, now: Instant) {
        if self.timer.is_some() && now < self.rearm_at {
            return;
        }
        self.arm_for(BACKSTOP).await;
        self.rearm_at = now + BACKSTOP / 2;
    }

    /// Register a timer that fires `span` from now, waking this task; the next [`Self::arm`]
    /// replaces it with a `BACKSTOP` one.
    async fn arm_for(&mut self, span: Duration) {
        let mut timer = Timer::new(span);
        // A glommio timer registers itself with the reactor when first polled; it is pending
        // (its deadline is `span` away), and it stays registered until it fires or is dropped.
        std::future::poll_fn(|cx| {
            let _ = Pin::new(&mut timer).poll(cx);
            Poll::Ready(())
        })
        .await;
        // Dropping the previous timer deregisters it.
        self.timer = Some(timer);
        self.rearm_at = Instant::now();
    }
}

/// Why a task kicked the driver (see [`Driver::wake`] and [`Driver::nudge`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kick {
    None,
    /// Liveness frames only: progress, but no spin window for them.
    Liveness,
    /// Application traffic: progress, and spin on.
    App,
}

/// What one poll of the driver found (see [`spin`]).
enum Found {
    /// Events, dispatched frames or mesh messages: handlers may have woken tasks. With the
    /// dispatch's clock reading when it had one, and whether any of it was more than liveness
    /// traffic (see [`Dispatched::app`]).
    Work(Option<Instant>, bool),
    /// Nothing within the idle budget (`true`: all of the poll's rounds ran), or the executor
    /// wants the thread back (`false`).
    Nothing(bool),
}

/// Most progress rounds one poll of the driver runs while nothing happens, before it returns
/// to look at the clock (spin window) and to yield. A round is a `progress`, a look at the
/// recorded inputs and one at the mesh's doorbell: about 50 ns when idle on shared memory, so
/// 256 rounds is some 10-20 µs between clock reads. Where a round costs more (over TCP, UCX's
/// progress is an `epoll_wait` system call, about 1 µs), the driver runs fewer: as many as fit
/// in [`IDLE_SPAN`], measured on idle polls (see [`fit_idle_rounds`]), and at least
/// [`MIN_IDLE_ROUNDS`].
pub const IDLE_ROUNDS: u32 = 256;

/// Fewest progress rounds of an idle poll (see [`IDLE_ROUNDS`]).
pub const MIN_IDLE_ROUNDS: u32 = 8;

/// About how long one idle poll of the driver runs its rounds (see [`IDLE_ROUNDS`]): what a
/// shard woken by a heartbeat spends looking for more before it sleeps again, when its spin
/// window does not keep it awake.
pub const IDLE_SPAN: Duration = Duration::from_micros(20);

/// The rounds an idle poll should run, from the last full idle poll's `rounds` and how long
/// they took: as many as fit in [`IDLE_SPAN`], within [`MIN_IDLE_ROUNDS`]..=[`IDLE_ROUNDS`].
/// A poll whose thread was descheduled looks slow and lowers the count; the next one
/// measured raises it again.
pub fn fit_idle_rounds(rounds: u32, took: Duration) -> u32 {
    let per_round = took.as_nanos() / u128::from(rounds.max(1));
    let fit = IDLE_SPAN.as_nanos() / per_round.max(1);
    fit.clamp(u128::from(MIN_IDLE_ROUNDS), u128::from(IDLE_ROUNDS)) as u32
}

/// An idle round calls the dispatch hook only on the first and last round of a poll and every
/// this many rounds (see `spin`): a round whose `progress` reported no event has nothing for
/// it.
const DISPATCH_LOOK: u32 = 64;

/// Recorded inputs dispatched per round at most, so that a flood on one connection cannot keep
/// the driver from progressing UCX, taking the mesh's lanes and yielding to timers and tasks.
pub const DISPATCH_BUDGET: usize = 64;

/// The driver task: progress while busy, sleep on the event fd when idle.
///
/// ## The hot path
///
/// One poll of this task runs rounds of `progress` (inside which UCX's callback dispatches
/// application frames with eager data: see "The hot path" in the net module), then the net
/// layer's dispatch of what the callbacks recorded ([`DispatchHook`]: handlers run inline, on
/// this stack), then the mesh's lanes, and returns as soon as a round found anything, so that tasks the handlers woke run
/// next; or after its idle rounds ([`IDLE_ROUNDS`] at most, fewer where a round costs more:
/// [`fit_idle_rounds`]) came up empty, or when glommio's preempt timer says the executor
/// should look at its timers and I/O (`need_preempt`). Idle rounds so cost no task switch;
/// the clock is read at most once per round that found frames, by the first frame that needs
/// it, and that reading serves the poll, and once more only by a poll that follows an idle
/// one (to fit the idle rounds). The driver runs in the shard's
/// default task queue, with the tasks it wakes, so that handing over to them is a plain
/// `yield_now` (the next task of the same queue), not a switch of task queues, which in glommio
/// 0.9 reads the clock twice.
///
/// ## Backlog
///
/// While the last dispatch left inputs recorded (its budget ran out), a round dispatches them
/// without calling `progress` first. The recorded inputs are one FIFO for all connections of
/// the shard, so a `progress` that moves a whole flood from one connection into it would put
/// every other connection's next frame behind that flood (and grow the FIFO without bound);
/// left in UCX, the backlog stays per connection (in UCX's receive queues, the sockets, the
/// peer's send queues, where TCP and UCX's own flow control push back on the flooder), and the
/// FIFO holds at most one budget plus what one `progress` brings.
pub(crate) async fn run(mut task: DriverTask) {
    let mut last_event = Instant::now();
    let mut byte = [0u8; 1];
    let mut watching = false;
    let mut backstop = Backstop::new();
    let waker = std::future::poll_fn(|cx| Poll::Ready(cx.waker().clone())).await;
    *lock(&task.watch.waker) = Some(waker);
    let mut polls = 0u64;
    // Rounds of an idle poll, fitted to what a round costs (see `IDLE_ROUNDS`); measured on a
    // poll that follows an idle one, so that a busy poll reads the clock no more.
    let mut idle_rounds = IDLE_ROUNDS;
    let mut was_idle = false;
    while !task.stop.load(Ordering::Acquire) {
        polls += 1;
        task.watch.polls.store(polls, Ordering::Relaxed);
        let (found, began) = std::future::poll_fn(|_| {
            let began = was_idle.then(Instant::now);
            Poll::Ready((spin(&task, idle_rounds), began))
        })
        .await;
        // The mesh's lanes (see "The mesh's hook").
        let hook = task.hook.get();
        // One clock reading per poll: the dispatch's when it took one.
        let now = match found {
            Found::Work(Some(at), _) => at,
            _ => Instant::now(),
        };
        was_idle = matches!(found, Found::Nothing(_));
        if let (Found::Nothing(true), Some(began)) = (&found, began) {
            idle_rounds = fit_idle_rounds(idle_rounds, now.saturating_duration_since(began));
        }
        if let Found::Work(_, app) = found {
            // Liveness traffic alone does not start the spin window.
            if app {
                last_event = now;
            }
        } else if now.duration_since(last_event) >= task.config.spin {
            // Say so before the last look at the lanes: a sender then either sees the driver
            // asleep (and wakes the mesh's inbox task), or its message is taken here.
            if let Some(hook) = hook {
                hook.sleeping(true);
                if hook.poll() {
                    hook.sleeping(false);
                    last_event = now;
                    backstop.arm(now).await;
                    futures_lite::future::yield_now().await;
                    continue;
                }
            }
            match task.worker.arm() {
                // Events came meanwhile: the next poll takes them, and what they are decides
                // whether the driver spins on.
                Ok(Armed::Busy) => {}
                Ok(Armed::Armed) => {
                    // The sleep's own timeout wakes the driver, but glommio may consume that
                    // wake-up and then park (see the module docs): keep a later timer behind it.
                    backstop.arm_for(MAX_SLEEP + BACKSTOP).await;
                    task.sleeping.set(true);
                    task.stats.sleeps.set(task.stats.sleeps.get() + 1);
                    // One watch request is outstanding at a time: a sleep cut short by
                    // MAX_SLEEP leaves it in place, and its answer wakes a later sleep early.
                    if !watching {
                        watching = task.stream.write_all(b"w").await.is_ok();
                    }
                    let stream = &mut task.stream;
                    let woke = glommio::timer::timeout(MAX_SLEEP, async {
                        stream.read_exact(&mut byte).await.map_err(Into::into)
                    })
                    .await;
                    task.sleeping.set(false);
                    match woke {
                        // The wake-up itself starts no spin window: the next poll looks, and
                        // spins on only if it finds more than liveness traffic (a shard woken
                        // by a heartbeat goes back to sleep after one idle poll).
                        Ok(()) => watching = false,
                        // A bounded sleep ran out with no event: progress once and sleep
                        // again, without a spin window.
                        Err(glommio::GlommioError::TimedOut(_)) => {}
                        Err(_) => {
                            // The waker thread is gone: fall back to polling, slowly.
                            glommio::timer::sleep(Duration::from_millis(1)).await;
                        }
                    }
                }
                Err(_) => {
                    // Without wake-up support the worker cannot be slept on: poll slowly.
                    glommio::timer::sleep(Duration::from_micros(100)).await;
                }
            }
            if let Some(hook) = hook {
                hook.sleeping(false);
            }
        }
        // Yield with a timer registered (see "glommio 0.9 can park with the driver
        // runnable"). `now` is at most one poll old; after a sleep, the timer is re-armed.
        backstop.arm(now).await;
        futures_lite::future::yield_now().await;
    }
    // The watchdog wakes this task no more; its waker is dropped here, on the task's thread.
    drop(lock(&task.watch.waker).take());
    // From now on the hook is not polled.
    if let Some(hook) = task.hook.get() {
        hook.sleeping(true);
    }
    // Tell the waker thread now. Dropping a glommio socket only queues its close on the ring,
    // and the shard may block in `Driver::join` before the ring runs it.
    let _ = task.stream.shutdown(std::net::Shutdown::Both).await;
}

/// Rounds of progress, dispatch and the mesh's lanes, inside one poll (see [`run`]): at most
/// `idle_rounds` of them while nothing happens.
fn spin(task: &DriverTask, idle_rounds: u32) -> Found {
    task.stats.polling.set(true);
    let found = spin_rounds(task, idle_rounds);
    task.stats.polling.set(false);
    found
}

/// The rounds of [`spin`].
#[inline(always)]
fn spin_rounds(task: &DriverTask, idle_rounds: u32) -> Found {
    let dispatch = task.dispatch.get();
    let hook = task.hook.get();
    let executor = glommio::executor();
    // Set by a task since the last poll (see `Driver::wake`): other tasks are runnable.
    let kicked = task.kick.replace(Kick::None);
    for i in 0..idle_rounds {
        // See "Backlog" in `run`'s docs.
        let backlog = task.backlog.get();
        let events = if backlog { 0 } else { task.worker.progress() };
        let round = task.stats.rounds.get();
        // What the dispatch takes comes from UCX's callbacks (in a `progress` that reports
        // events), from a backlog, or from tasks, which run only between polls: a round with
        // none of these has nothing to dispatch. Looked at anyway every `DISPATCH_LOOK`th
        // round, in case a callback ran in a `progress` that reported no event.
        // And on the last idle round, so that nothing recorded waits through a sleep.
        let look = events > 0 || backlog || i % DISPATCH_LOOK == 0 || i + 1 == idle_rounds;
        let done = match dispatch {
            Some(d) if look => d(DISPATCH_BUDGET, round),
            _ => Dispatched::default(),
        };
        task.backlog.set(done.backlog);
        let hooked = hook.is_some_and(|hook| hook.poll());
        task.stats.rounds.set(round + 1);
        if events > 0 || done.handled > 0 || hooked || kicked != Kick::None {
            // More than liveness traffic: application frames, the mesh's messages, a task's
            // application send, or UCX events with no frame handled (a rendezvous under way,
            // completions): conservatively, all of these keep the driver spinning.
            let app =
                done.app || hooked || kicked == Kick::App || (events > 0 && done.handled == 0);
            return Found::Work(done.at, app);
        }
        if executor.need_preempt() {
            return Found::Nothing(false);
        }
    }
    Found::Nothing(true)
}

fn socket_path(shard: usize) -> PathBuf {
    let seq = SOCKET_SEQ.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("shardcx-{}-{shard}-{seq}.sock", std::process::id()))
}

/// `m` locked, whether or not another thread panicked while holding it.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Watch {
    /// One look of the watchdog, every [`WATCH_SLICE`] at most: if the driver has not been
    /// polled since the last look (`stall` keeps the poll count it saw), wake its task from
    /// this thread. glommio then writes its executor's event fd, which ends a park that
    /// nothing else would end. `stall` records what the shard's thread does meanwhile (see
    /// [`crate::stall`]).
    fn look(&self, stall: &mut StallWatch) {
        if stall.look(self.polls.load(Ordering::Relaxed), &self.stalls) {
            return;
        }
        if let Some(w) = lock(&self.waker).as_ref() {
            w.wake_by_ref();
            self.wakes.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The waker thread: wait for a watch request, wait for the event fd, answer; until stopped.
/// Between (and during) waits, every [`WATCH_SLICE`], the watchdog looks at the driver.
fn waker_thread(
    listener: UnixListener,
    fd: WakeupFd,
    stop: Arc<AtomicBool>,
    watch: Arc<Watch>,
    mut stall: StallWatch,
) {
    let Ok((mut stream, _)) = listener.accept() else {
        return;
    };
    drop(listener);
    // Blocking reads time out so that the stop flag is seen even if the socket's end-of-file
    // never comes (a glommio socket's close is queued on its ring, which may never run again
    // once the shard is joining this thread).
    if stream.set_read_timeout(Some(WATCH_SLICE)).is_err() {
        return;
    }
    let mut byte = [0u8; 1];
    loop {
        match stream.read(&mut byte) {
            // The driver asks to sleep: it runs, whatever the looks saw since.
            Ok(1) => stall.polled(&watch.stalls),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                if stop.load(Ordering::Acquire) {
                    return;
                }
                watch.look(&mut stall);
                continue;
            }
            _ => return,
        }
        loop {
            if fd.wait(Some(WATCH_SLICE)) {
                break;
            }
            if stop.load(Ordering::Acquire) {
                break;
            }
            watch.look(&mut stall);
        }
        if stream.write_all(b"e").is_err() {
            return;
        }
    }
}
