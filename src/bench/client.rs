//! The measuring side of a benchmark: one client node, every shard on its own rail to the
//! server (see [`crate::bench`]).
//!
//! [`run`] starts a node with the configured shard count, pins shard `i` to the `i`-th client
//! CPU, and on every shard: connects to the server (every shard gets its own rail), targets
//! server shard `i mod M` ([`Peer::shard`]: the shard's default rail), asks that shard for the
//! remote-memory regions the plan needs ([`super::REGION`]), and runs the planned (test, size)
//! pairs in order, all shards starting each one together (a barrier between tests).
//!
//! Answers come back on the rail their request went out on, so the answer handlers run on the
//! shard that waits for them; one that arrives anywhere else fails the run (it would mean a
//! hop). The handlers share a `Waits` with the shard's test task: `am-lat` runs entirely in
//! the echo-answer handler (record the round trip, send the next ping inline) and wakes the
//! task at the end; `am-rate`/`am-bw` wake it once per window, at the acknowledgement. A
//! watchdog task per shard fails a wait whose answer is `DEADLINE` overdue.
//!
//! Tag streams: client shard `s` sends pings tagged `1 << 12 | s` and receives pongs tagged
//! `2 << 12 | s`; `3 << 12 | s` ends the stream on the server.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::{poll_fn, Future};
use std::io::IsTerminal;
use std::net::SocketAddr;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use glommio::timer::sleep;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use shardcx_shards::proto::{NodeId, ShardId};
use shardcx_shards::{NetError, Placement, RemoteRegion, ShardCtx};

use super::server::{TAG_PING, TAG_PONG, TAG_STOP, TAG_STREAM};
use super::{
    header, net_config, parse_header, pin_current, BenchError, Budget, Figures, Measurement,
    Memory, Route, RpcEcho, RpcSink, ShardFigures, Test, Transport, ACK, CONTENT_CHECK_EVERY, ECHO,
    ECHO_REPLY, FLAG_ACK, FLAG_TRUSTED, REGION, REGION_REPLY, SINK, TAG_START,
};
use crate::cuda::CudaMode;
use crate::rma::TrustedDescriptor;

mod device;
mod inline;
use crate::{AmId, AmView, Node, OwnedAmMsg, Peer, TAG_MASK_EXACT};

/// Deadline of every operation and answer of a benchmark.
const DEADLINE: Duration = Duration::from_secs(30);
/// Bytes in flight at most in `am-bw` and the RMA tests (the window is capped to fit): the
/// server shard's default registered pool (8 MiB), so that rendezvous data lands in pool
/// blocks that are reused while still in cache. With 32 MiB in flight, most messages landed in
/// vectors of the receive cache, cycling through 32 MiB of cold memory: 1 MiB `am-bw` on
/// shared memory measured 5.3–6.5 GB/s against 9.8–11.3 GB/s with 8 MiB (same sitting;
/// `ucx_perftest` receives every message into one buffer). tcp is the same either way.
const BW_IN_FLIGHT: usize = 8 << 20;
/// How often shards waiting at the barrier between tests look again.
const GATE_POLL: Duration = Duration::from_micros(50);
/// Runs longer than this show progress on stderr (when it is a terminal).
const PROGRESS_AFTER: Duration = Duration::from_secs(1);
/// The progress bar is updated at most this often (indicatif redraws at most 20 times a second
/// anyway).
const PROGRESS_EVERY: Duration = Duration::from_millis(50);
/// Iterations between two looks at the clock for the progress bar: the `am-lat` handler runs
/// on the shard's driver once per round trip, and pays a division and a compare per iteration,
/// nothing more.
const PROGRESS_CHECK_EVERY: u64 = 64;

/// Settings of [`run`].
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// The server node.
    pub addr: SocketAddr,
    /// Client shards.
    pub shards: usize,
    /// UCX transports of the client node.
    pub transport: Transport,
    /// Tests, in order.
    pub tests: Vec<Test>,
    /// Sizes for every test but `hop` (`None`: each test's defaults).
    pub sizes: Option<Vec<usize>>,
    /// Measured iterations or time per test (`None`: each test's default iterations).
    pub budget: Option<Budget>,
    /// Iterations before measuring (`None`: a tenth of the iterations, at most 1000).
    pub warmup: Option<u64>,
    /// Operations in flight for the windowed tests.
    pub window: usize,
    /// CPUs for the client shards (shard `i` on `cores[i % len]`); `None`: unpinned.
    pub cores: Option<Vec<usize>>,
    /// The pre-shared key.
    pub psk: Vec<u8>,
    /// Show a progress bar on stderr for tests longer than a second (only when stderr is a
    /// terminal).
    pub progress: bool,
    /// glommio io memory per client shard (`None`: sized to the memlock limit; set it when the
    /// server runs in the same process).
    pub io_memory: Option<u64>,
    /// Where the client's buffers live: with [`Memory::Cuda`], the tests of
    /// [`Memory::CUDA_TESTS`] send from and land into device buffers, and the others are
    /// skipped (see the module docs of [`crate::bench`], "Device memory").
    pub memory: Memory,
}

thread_local! {
    /// What this shard's test task and answer handlers share (the handlers' factories and the
    /// task run on the shard's thread, so they find the same one).
    static WAITS: Rc<Waits> = Rc::new(Waits::default());
}

/// The barrier between tests: round `k` opens once every shard has arrived `k` times.
struct Gate {
    arrived: AtomicUsize,
    failed: AtomicBool,
    shards: usize,
}

/// What a shard's test task and its answer handlers share.
#[derive(Default)]
struct Waits {
    /// Control answers ([`REGION_REPLY`]), copied out of UCX's buffer.
    control: RefCell<VecDeque<OwnedAmMsg>>,
    /// Echoes kept for the device-memory `am-lat` task (see `device::on_echo_reply`).
    echoes: RefCell<VecDeque<OwnedAmMsg>>,
    /// The `am-lat` ping-pong, while it runs (and until the task takes its figures).
    pingpong: RefCell<Option<PingPong>>,
    /// Sequence number of the last acknowledged window.
    acked: Cell<u64>,
    /// What a handler found wrong: the waiting test fails with it.
    error: RefCell<Option<String>>,
    /// The test task, while it waits.
    task: RefCell<Option<Waker>>,
    /// Whether the task waits for an answer (the watchdog looks only then).
    waiting: Cell<bool>,
    /// Answers seen so far (the watchdog's sign of life).
    answered: Cell<u64>,
    /// Set by the watchdog: an answer is [`DEADLINE`] overdue, and every wait fails.
    overdue: Cell<bool>,
    /// Set when this shard's connection to the server ends (see [`ShardCtx::on_peer_lost`]):
    /// every wait fails with [`BenchError::PeerGone`].
    lost: RefCell<Option<(NodeId, NetError)>>,
}

/// The `am-lat` ping-pong, driven by the echo-answer handler ([`on_echo_reply`]).
struct PingPong {
    target: Peer,
    me: ShardId,
    payload: Vec<u8>,
    /// The ping in flight.
    seq: u64,
    /// When it was sent.
    sent: Instant,
    /// Round trips left before measuring.
    warmup: u64,
    budget: Budget,
    /// When measuring started.
    t0: Instant,
    /// The shard's mesh count then (see [`mesh_taken`]).
    mesh_at_t0: u64,
    figures: Figures,
    progress: Rc<Progress>,
    /// Measured, or failed: the handler sends nothing more.
    done: bool,
}

/// What a shard needs for its tests.
struct Session {
    node: Node,
    me: ShardId,
    /// Server shard `me mod M`: the other end of this shard's default rail.
    target: Peer,
    waits: Rc<Waits>,
    region: Option<RemoteRegion>,
    trusted: Option<TrustedDescriptor>,
    seq: Cell<u64>,
    /// The shard's mesh count when the current test's measured part started.
    mesh_at_t0: Cell<u64>,
}

/// A remote-memory test's operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RmaOp {
    Put,
    Get,
    PutTrusted,
}

/// A test's progress bar (indicatif) on stderr, drawn once the test has run
/// [`PROGRESS_AFTER`], on client shard 0 only (rank 0 for the collectives), and only when
/// stderr is a terminal.
pub(super) struct Progress {
    on: bool,
    label: String,
    start: Instant,
    /// When the bar was last updated.
    last: Cell<Instant>,
    /// Made at the first update.
    bar: RefCell<Option<ProgressBar>>,
}

/// Runs the planned tests and returns one [`Measurement`] per (test, size), skipped ones
/// included (with their reason).
pub fn run(cfg: &ClientConfig) -> Result<Vec<Measurement>, BenchError> {
    if cfg.shards == 0 {
        return Err(BenchError::Config("--shards: at least 1".into()));
    }
    if cfg.window == 0 {
        return Err(BenchError::Config("--window: at least 1".into()));
    }
    let mut out = Vec::new();
    let mut plan = Vec::new();
    for &test in &cfg.tests {
        let sizes: Vec<usize> = match (&cfg.sizes, test) {
            (_, Test::Hop) => vec![0],
            (Some(s), _) => s.clone(),
            (None, t) => t.default_sizes().to_vec(),
        };
        for size in sizes {
            if !cfg.memory.runs(test) {
                out.push(skipped(
                    cfg,
                    test,
                    size,
                    "--memory cuda: only am-lat, am-bw, rpc-lat, put-bw and get-bw move device \
                     memory",
                ));
            } else if test == Test::Hop && cfg.shards < 2 {
                out.push(skipped(cfg, test, size, "needs --shards 2 or more"));
            } else if test == Test::PutTrustedBw && cfg.transport == Transport::Tcp {
                out.push(skipped(
                    cfg,
                    test,
                    size,
                    "trusted RMA needs shared memory or RDMA (UCX 1.12 only emulates RMA \
                     over tcp, and shardcx refuses it)",
                ));
            } else if size as u64 > super::MAX_MESSAGE - 1024 {
                out.push(skipped(cfg, test, size, "over the 16 MiB message limit"));
            } else {
                plan.push((test, size));
            }
        }
    }
    if plan.is_empty() {
        return Ok(out);
    }
    let gate = Arc::new(Gate {
        arrived: AtomicUsize::new(0),
        failed: AtomicBool::new(false),
        shards: cfg.shards,
    });
    let mut b = Node::builder()
        .shards(cfg.shards)
        .placement(Placement::Unpinned)
        .psk(&cfg.psk)
        .net(net_config(cfg.transport))
        .default_deadline(DEADLINE);
    if let Some(tls) = cfg.transport.tls() {
        b = b.transports(tls);
    }
    if let Some(bytes) = cfg.io_memory {
        b = b.io_memory(bytes);
    }
    if plan.iter().any(|(t, _)| *t == Test::PutTrustedBw) {
        b = b.trusted_rma();
    }
    // Chosen here, not per echo: the host handler is the measured loop of `am-lat`. With
    // device memory, the `am-lat` task lands each echo (see `device`).
    b = match cfg.memory {
        Memory::Host => b.on_am_view(ECHO_REPLY, || {
            let w = WAITS.with(Rc::clone);
            move |node: &Node, msg: &AmView<'_>| on_echo_reply(&w, node, msg)
        }),
        Memory::Cuda => b.on_am_view(ECHO_REPLY, || {
            let w = WAITS.with(Rc::clone);
            move |node: &Node, msg: &AmView<'_>| device::on_echo_reply(&w, node, msg)
        }),
    };
    b = b
        .on_am_view(ACK, || {
            let w = WAITS.with(Rc::clone);
            move |node: &Node, msg: &AmView<'_>| on_ack(&w, node, msg)
        })
        .on_am_view(REGION_REPLY, || {
            let w = WAITS.with(Rc::clone);
            move |node: &Node, msg: &AmView<'_>| on_control(&w, node, msg)
        });
    let shared = Arc::new((cfg.clone(), plan.clone()));
    let results = b.run(move |node: Node| {
        let (shared, gate) = (shared.clone(), gate.clone());
        async move {
            let (cfg, plan) = &*shared;
            if let Some(cores) = cfg.cores.as_ref().filter(|c| !c.is_empty()) {
                pin_current(cores[node.shard().index() % cores.len()]);
            }
            let r = shard_main(node, cfg, plan, &gate).await;
            if r.is_err() {
                gate.failed.store(true, Ordering::Release);
            }
            r
        }
    })?;
    let mut per_shard: Vec<Vec<ShardFigures>> = Vec::with_capacity(cfg.shards);
    let mut first_err = None;
    let mut cuda_mode = None;
    for r in results {
        match r {
            Ok((mode, v)) => {
                cuda_mode = cuda_mode.or(mode);
                per_shard.push(v);
            }
            // A server that is gone explains the other shards' failures.
            Err(e @ BenchError::PeerGone { .. }) => first_err = Some(e),
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    for (k, (test, size)) in plan.into_iter().enumerate() {
        let per_shard = per_shard.iter().filter_map(|v| v.get(k).cloned()).collect();
        out.push(Measurement {
            test,
            size,
            shards: cfg.shards,
            transport: cfg.transport,
            per_shard,
            memory: cfg.memory,
            cuda_mode,
            skipped: None,
            perftest: None,
        });
    }
    out.sort_by_key(|m| (cfg.tests.iter().position(|t| *t == m.test), m.size));
    Ok(out)
}

fn skipped(cfg: &ClientConfig, test: Test, size: usize, why: &str) -> Measurement {
    Measurement {
        test,
        size,
        shards: cfg.shards,
        transport: cfg.transport,
        per_shard: Vec::new(),
        memory: cfg.memory,
        cuda_mode: None,
        skipped: Some(why.into()),
        perftest: None,
    }
}

/// Messages the shard's cross-shard mesh lanes have delivered to it so far (requests from
/// other shards and completions of its own forwards): unchanged over a test means no hop.
fn mesh_taken(ctx: &ShardCtx) -> u64 {
    let s = ctx.mesh_stats();
    s.taken_by_driver + s.taken_by_task
}

/// The answer's origin shard, or why it is not this one's.
fn for_this_shard(node: &Node, msg: &AmView<'_>) -> Result<u64, String> {
    match parse_header(msg.header()) {
        Some((origin, seq, _)) if origin == node.shard() => Ok(seq),
        Some((origin, _, _)) => Err(format!(
            "an answer {} for client shard {origin} arrived on shard {} (a hop: answers \
             should come back on their request's rail)",
            msg.id(),
            node.shard()
        )),
        None => Err(format!("answer {} with a malformed header", msg.id())),
    }
}

/// The client's handler of [`ECHO_REPLY`]: the `am-lat` ping-pong, one round trip per call.
/// The next ping goes out as soon as the echo is known to be the one awaited, on its rail
/// (its sequence number and sender); the rest of the bookkeeping (the content check, the
/// histogram, the progress bar) is done while it travels, as a latency-minded application
/// answers first and accounts afterwards.
fn on_echo_reply(w: &Waits, node: &Node, msg: &AmView<'_>) {
    // The dispatch's clock reading (no second one between the echo and the next ping).
    let now = msg.arrived();
    w.answered.set(w.answered.get() + 1);
    let mut slot = w.pingpong.borrow_mut();
    let Some(p) = slot.as_mut().filter(|p| !p.done) else {
        drop(slot);
        w.fail("an echo that no ping-pong waits for".into());
        return;
    };
    if let Err(e) = p.check_route(node, msg) {
        p.done = true;
        drop(slot);
        w.fail(e);
        return;
    }
    let (measured, sent) = (p.warmup == 0, p.sent);
    let last = measured && !more_at(p.budget, p.figures.msgs + 1, p.t0, now);
    if !last {
        p.seq += 1;
        p.sent = now;
        // The next ping goes back on the rail the echo came in on (the target's), as an
        // answer from the handler: no look-up of the current shard.
        if let Err(e) = msg.reply(ECHO, &header(p.me, p.seq, 0), &p.payload) {
            p.done = true;
            let e = format!("echo ping #{}: {e}", p.seq);
            drop(slot);
            w.fail(e);
            return;
        }
    }
    // The echo just received: its bytes, then its figures.
    if let Err(e) = p.check_payload(msg, p.seq - u64::from(!last)) {
        p.done = true;
        drop(slot);
        w.fail(e);
        return;
    }
    if !measured {
        p.warmup -= 1;
        if p.warmup == 0 {
            p.t0 = now;
            p.mesh_at_t0 = mesh_taken(node.shard_ctx());
        }
        return;
    }
    record(&mut p.figures, now - sent);
    p.figures.msgs += 1;
    p.progress.tick(p.budget, p.figures.msgs, p.t0);
    if last {
        p.figures.elapsed = now - p.t0;
        p.done = true;
        drop(slot);
        w.wake();
    }
}

/// The client's handler of [`ACK`]: the acknowledgement of an `am-rate`/`am-bw` window.
fn on_ack(w: &Waits, node: &Node, msg: &AmView<'_>) {
    w.answered.set(w.answered.get() + 1);
    match for_this_shard(node, msg) {
        Ok(seq) => {
            w.acked.set(seq);
            w.wake();
        }
        Err(e) => w.fail(e),
    }
}

/// The client's handler of control answers ([`REGION_REPLY`]): queued for the task.
fn on_control(w: &Waits, node: &Node, msg: &AmView<'_>) {
    w.answered.set(w.answered.get() + 1);
    match for_this_shard(node, msg) {
        Ok(_) => {
            w.control.borrow_mut().push_back(msg.to_owned());
            w.wake();
        }
        Err(e) => w.fail(e),
    }
}

/// One shard's whole run: set-up, then every planned test; with it, the shard's CUDA mode
/// when the tests use device memory.
async fn shard_main(
    node: Node,
    cfg: &ClientConfig,
    plan: &[(Test, usize)],
    gate: &Gate,
) -> Result<(Option<CudaMode>, Vec<ShardFigures>), BenchError> {
    let waits = WAITS.with(Rc::clone);
    waits.reset();
    let cuda_mode = match cfg.memory {
        Memory::Host => None,
        Memory::Cuda => {
            let cuda = node.shard_ctx().cuda();
            if cuda.mode() == CudaMode::Off {
                return Err(BenchError::CudaOff {
                    reason: cuda
                        .probe()
                        .off_reason
                        .clone()
                        .unwrap_or_else(|| "no reason given".into()),
                });
            }
            Some(cuda.mode())
        }
    };
    let peer = node.connect_within(cfg.addr, DEADLINE).await?;
    // A server that dies (or is stopped) fails what waits on it at once: the answers awaited
    // here, and, through the shard's own failure of its requests, calls, receives and remote
    // memory operations.
    let (w, server) = (waits.clone(), peer.node_id());
    node.shard_ctx().on_peer_lost(move |n, e| {
        if n == Some(server) {
            w.lost.borrow_mut().get_or_insert((server, e.clone()));
            w.wake();
        }
    });
    let r = shard_tests(node, cfg, plan, gate, peer, waits.clone()).await;
    // Whatever failed first, a server that is gone is the reason.
    match (r, waits.gone()) {
        (Err(_), Some(gone)) => Err(gone),
        (r, _) => r.map(|v| (cuda_mode, v)),
    }
}

/// The tests of one shard, connected to the server `peer`.
async fn shard_tests(
    node: Node,
    cfg: &ClientConfig,
    plan: &[(Test, usize)],
    gate: &Gate,
    peer: Peer,
    waits: Rc<Waits>,
) -> Result<Vec<ShardFigures>, BenchError> {
    let me = node.shard();
    let remote = node
        .shard_ctx()
        .session(peer.node_id())
        .ok_or_else(|| BenchError::Protocol(format!("shard {me} has no rail to the server")))?;
    let server_shards = usize::from(remote.shard_count.max(1));
    // `server_shards` is a u16 count, so the index fits.
    let target = peer.shard(ShardId::new((me.index() % server_shards) as u16));
    // Cancelled when dropped, at the end of the shard's run.
    let _watchdog = glommio::spawn_local(watchdog(waits.clone()));
    let mut s = Session {
        node: node.clone(),
        me,
        target,
        waits,
        region: None,
        trusted: None,
        seq: Cell::new(0),
        mesh_at_t0: Cell::new(0),
    };
    let largest = |tests: &[Test]| {
        plan.iter()
            .filter(|(t, _)| tests.contains(t))
            .map(|(_, size)| *size)
            .max()
    };
    if let Some(size) = largest(&[Test::PutBw, Test::GetBw]) {
        let d = s.region(size, 0).await?;
        s.region = Some(RemoteRegion::from_bytes(&d).map_err(|e| {
            BenchError::Protocol(format!("the server sent a bad region descriptor: {e}"))
        })?);
    }
    if let Some(size) = largest(&[Test::PutTrustedBw]) {
        let d = s.region(size, FLAG_TRUSTED).await?;
        s.trusted = Some(TrustedDescriptor::from_bytes(&d).map_err(|e| {
            BenchError::Protocol(format!("the server sent a bad trusted descriptor: {e}"))
        })?);
    }
    let mut out = Vec::with_capacity(plan.len());
    for (k, &(test, size)) in plan.iter().enumerate() {
        gate.wait(k + 1).await?;
        let progress = Rc::new(Progress::new(
            cfg.progress && me.index() == 0,
            format!(
                "{test} {} B, {} shard(s), {}",
                super::format_size(size),
                cfg.shards,
                cfg.transport
            ),
        ));
        let figures = s.run_test(cfg, test, size, &progress).await?;
        let hopped = mesh_taken(node.shard_ctx()) != s.mesh_at_t0.get();
        progress.done();
        out.push(ShardFigures {
            shard: me,
            route: if hopped { Route::Hop } else { Route::Rail },
            figures,
        });
    }
    Ok(out)
}

impl Gate {
    /// Arrives for round `round` and waits for the other shards (or fails when one failed).
    async fn wait(&self, round: usize) -> Result<(), BenchError> {
        self.arrived.fetch_add(1, Ordering::AcqRel);
        while self.arrived.load(Ordering::Acquire) < round * self.shards {
            if self.failed.load(Ordering::Acquire) {
                return Err(BenchError::Protocol("another shard failed".into()));
            }
            sleep(GATE_POLL).await;
        }
        Ok(())
    }
}

impl Waits {
    /// Back to the start (a shard thread may have served an earlier run).
    fn reset(&self) {
        self.control.borrow_mut().clear();
        self.echoes.borrow_mut().clear();
        self.pingpong.borrow_mut().take();
        self.acked.set(0);
        self.error.borrow_mut().take();
        self.task.borrow_mut().take();
        self.waiting.set(false);
        self.answered.set(0);
        self.overdue.set(false);
        self.lost.borrow_mut().take();
    }

    /// The error of a shard whose server is gone, if it is.
    fn gone(&self) -> Option<BenchError> {
        let lost = self.lost.borrow();
        lost.as_ref().map(|(node, reason)| BenchError::PeerGone {
            node: *node,
            reason: reason.clone(),
        })
    }

    /// Wakes the test task, if it waits.
    fn wake(&self) {
        let task = self.task.borrow_mut().take();
        if let Some(t) = task {
            t.wake();
        }
    }

    /// Records what a handler found wrong (the first of it) and wakes the task.
    fn fail(&self, e: String) {
        self.error.borrow_mut().get_or_insert(e);
        self.wake();
    }

    /// Waits until `ready` holds, or a handler failed, or the watchdog found the answer
    /// (`what`) overdue.
    async fn until(&self, what: &str, ready: impl Fn(&Waits) -> bool) -> Result<(), BenchError> {
        self.waiting.set(true);
        let r = poll_fn(|cx| {
            if let Some(e) = self.gone() {
                return Poll::Ready(Err(e));
            }
            if let Some(e) = self.error.borrow_mut().take() {
                return Poll::Ready(Err(BenchError::Protocol(e)));
            }
            if ready(self) {
                return Poll::Ready(Ok(()));
            }
            if self.overdue.get() {
                return Poll::Ready(Err(BenchError::Protocol(format!(
                    "no {what} from the server within {DEADLINE:?}"
                ))));
            }
            *self.task.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        })
        .await;
        self.waiting.set(false);
        r
    }
}

impl PingPong {
    /// The length of every answer, and the content of every [`CONTENT_CHECK_EVERY`]-th.
    /// Whether `msg` is the echo awaited (sequence number) and came on the target's rail, which
    /// the next ping answers it on.
    fn check_route(&self, node: &Node, msg: &AmView<'_>) -> Result<(), String> {
        let seq = for_this_shard(node, msg)?;
        if seq != self.seq {
            return Err(format!("echo #{seq} when #{} was expected", self.seq));
        }
        let from = msg.from();
        if from.node_id() != self.target.node_id()
            || self
                .target
                .target_shard()
                .is_some_and(|j| from.target_shard() != Some(j))
        {
            return Err(format!(
                "echo #{seq} from {from:?}, pinged {:?}",
                self.target
            ));
        }
        Ok(())
    }

    /// Whether echo `seq` (`msg`) brought the ping's bytes back: its length always, its bytes
    /// every [`CONTENT_CHECK_EVERY`]th.
    fn check_payload(&self, msg: &AmView<'_>, seq: u64) -> Result<(), String> {
        let got = msg.payload();
        if got.len() != self.payload.len() {
            return Err(format!(
                "echo of {} bytes came back with {}",
                self.payload.len(),
                got.len()
            ));
        }
        if seq % CONTENT_CHECK_EVERY == 0 && got != self.payload.as_slice() {
            return Err(format!("echo #{seq} came back with other bytes"));
        }
        Ok(())
    }
}

impl Session {
    fn next_seq(&self) -> u64 {
        let s = self.seq.get() + 1;
        self.seq.set(s);
        s
    }

    /// The measured part starts now: remembers the shard's mesh count.
    fn mark(&self) {
        self.mesh_at_t0.set(mesh_taken(self.node.shard_ctx()));
    }

    /// Asks the target server shard for a region of at least `size` bytes (`flags`:
    /// [`FLAG_TRUSTED`] for a trusted-mode one) and returns its descriptor's bytes.
    async fn region(&self, size: usize, flags: u8) -> Result<Vec<u8>, BenchError> {
        self.target
            .am_send(REGION, &header(self.me, size as u64, flags), &[])
            .await?;
        let a = self.answer(REGION_REPLY, size as u64).await?;
        match a.payload().split_first() {
            Some((0, desc)) => Ok(desc.to_vec()),
            Some((_, why)) => Err(BenchError::Protocol(format!(
                "server shard {} has no {}region of {size} bytes: {}",
                self.target.target_shard().map_or(0, |s| s.index()),
                if flags & FLAG_TRUSTED != 0 {
                    "trusted "
                } else {
                    ""
                },
                String::from_utf8_lossy(why)
            ))),
            None => Err(BenchError::Protocol("an empty region answer".into())),
        }
    }

    /// The next control answer, which must be `id` with sequence number `seq`.
    async fn answer(&self, id: AmId, seq: u64) -> Result<OwnedAmMsg, BenchError> {
        let w = &self.waits;
        w.until(&format!("answer {id}"), |w| !w.control.borrow().is_empty())
            .await?;
        let msg = w
            .control
            .borrow_mut()
            .pop_front()
            .ok_or_else(|| BenchError::Protocol("a control answer went missing".into()))?;
        match parse_header(msg.header()) {
            Some((_, s, _)) if msg.id() == id && s == seq => Ok(msg),
            _ => Err(BenchError::Protocol(format!(
                "expected answer {id} #{seq}, got {} {:?}",
                msg.id(),
                parse_header(msg.header()).map(|h| h.1)
            ))),
        }
    }

    async fn run_test(
        &self,
        cfg: &ClientConfig,
        test: Test,
        size: usize,
        progress: &Rc<Progress>,
    ) -> Result<Figures, BenchError> {
        let budget = cfg
            .budget
            .unwrap_or_else(|| Budget::Iters(test.default_iters(size)));
        let warmup = cfg.warmup.unwrap_or(budget.default_warmup());
        let capped = cfg.window.min((BW_IN_FLIGHT / size.max(1)).max(1));
        if cfg.memory == Memory::Cuda {
            return self
                .device_test(test, size, capped, budget, warmup, progress)
                .await;
        }
        match test {
            Test::AmLat => self.am_lat(size, budget, warmup, progress).await,
            Test::AmRate => {
                self.am_stream(size, cfg.window, budget, warmup, progress)
                    .await
            }
            Test::AmBw => self.am_stream(size, capped, budget, warmup, progress).await,
            Test::TagLat => self.tag_lat(size, budget, warmup, progress).await,
            Test::RpcLat => self.rpc_lat(size, budget, warmup, progress).await,
            Test::RpcLatInline => self.rpc_lat_inline(size, budget, warmup, progress).await,
            Test::RpcRateInline => {
                self.rpc_rate_inline(size, cfg.window, budget, warmup, progress)
                    .await
            }
            Test::RpcRate | Test::RpcNotify => {
                let one_way = test == Test::RpcNotify;
                self.rpc_rate(one_way, size, cfg.window, budget, warmup, progress)
                    .await
            }
            Test::PutBw => {
                self.rma(RmaOp::Put, size, capped, budget, warmup, progress)
                    .await
            }
            Test::GetBw => {
                self.rma(RmaOp::Get, size, capped, budget, warmup, progress)
                    .await
            }
            Test::PutTrustedBw => {
                self.rma(RmaOp::PutTrusted, size, capped, budget, warmup, progress)
                    .await
            }
            Test::Hop => self.hop(budget, warmup, progress).await,
        }
    }

    /// `am-lat`: starts the ping-pong that [`on_echo_reply`] drives, and waits for its end.
    async fn am_lat(
        &self,
        size: usize,
        budget: Budget,
        warmup: u64,
        progress: &Rc<Progress>,
    ) -> Result<Figures, BenchError> {
        let payload = pattern(size, 0xA5);
        let seq = self.next_seq();
        self.mark();
        let now = Instant::now();
        *self.waits.pingpong.borrow_mut() = Some(PingPong {
            target: self.target,
            me: self.me,
            payload,
            seq,
            sent: now,
            warmup,
            budget,
            t0: now,
            mesh_at_t0: self.mesh_at_t0.get(),
            figures: Figures::new(size),
            progress: progress.clone(),
            done: false,
        });
        let first = self.waits.pingpong.borrow().as_ref().map(|p| {
            self.target
                .am_send_now(ECHO, &header(self.me, seq, 0), &p.payload)
        });
        let r = match first {
            Some(Err(e)) => Err(BenchError::from(e)),
            _ => {
                self.waits
                    .until("echo", |w| {
                        w.pingpong.borrow().as_ref().is_some_and(|p| p.done)
                    })
                    .await
            }
        };
        let p = self
            .waits
            .pingpong
            .borrow_mut()
            .take()
            .ok_or_else(|| BenchError::Protocol("the ping-pong went missing".into()))?;
        self.seq.set(p.seq);
        self.mesh_at_t0.set(p.mesh_at_t0);
        r.map(|()| p.figures)
    }

    /// `am-rate` and `am-bw`: windows of one-way messages sent in a tight loop, the last one
    /// acknowledged (inline, by the server's handler).
    async fn am_stream(
        &self,
        size: usize,
        window: usize,
        budget: Budget,
        warmup: u64,
        progress: &Progress,
    ) -> Result<Figures, BenchError> {
        // One shared buffer for every message, as ucx_perftest sends one buffer: queued and
        // rendezvous sends hold a reference to it, not a copy.
        let payload: Rc<[u8]> = pattern(size, 0x5A).into();
        let window_trip = || async {
            let mut last = 0;
            for k in 0..window {
                last = self.next_seq();
                let flags = if k + 1 == window { FLAG_ACK } else { 0 };
                self.target
                    .am_send_buf(SINK, &header(self.me, last, flags), payload.clone())?;
            }
            self.acknowledged(last).await
        };
        let w = window as u64;
        // `Iters` counts messages: each measured window is `w` of them.
        self.measure(size, budget, warmup.div_ceil(w), w, progress, window_trip)
            .await
    }

    /// Waits for the acknowledgement of the window that ended with message `last`.
    async fn acknowledged(&self, last: u64) -> Result<(), BenchError> {
        self.waits
            .until("acknowledgement", |w| w.acked.get() >= last)
            .await?;
        match self.waits.acked.get() {
            a if a == last => Ok(()),
            a => Err(BenchError::Protocol(format!(
                "acknowledgement #{a} for a window ending at #{last}"
            ))),
        }
    }

    async fn tag_lat(
        &self,
        size: usize,
        budget: Budget,
        warmup: u64,
        progress: &Progress,
    ) -> Result<Figures, BenchError> {
        let stream = u64::from(self.me.get()) & TAG_STREAM;
        self.target
            .am_send(TAG_START, &header(self.me, 0, 0), &[])
            .await?;
        let payload = pattern(size, 0x3C);
        let round_trip = || async {
            // Sent, then received: the receive is posted before the driver can dispatch the
            // pong (the send does not yield). Posting it first, polled together with the send
            // (`zip`), measured 2.07-2.12 us against 1.81-1.84 us this way (shm, 8 B).
            self.target
                .tag_send_within(TAG_PING | stream, &payload, DEADLINE)
                .await?;
            let (_, data) = self
                .target
                .tag_recv_within(TAG_PONG | stream, TAG_MASK_EXACT, DEADLINE)
                .await?;
            if data.len() != size {
                return Err(BenchError::Protocol(format!(
                    "tag pong of {} bytes for a {size}-byte ping",
                    data.len()
                )));
            }
            Ok::<(), BenchError>(())
        };
        let r = self
            .measure(size, budget, warmup, 1, progress, round_trip)
            .await;
        // Ends the server's stream whatever happened (it also ends by itself when idle).
        let _ = self.target.tag_send(TAG_STOP | stream, &[]).await;
        r
    }

    /// `rpc-lat`: one [`RpcEcho`] call at a time, its reply read in place.
    async fn rpc_lat(
        &self,
        size: usize,
        budget: Budget,
        warmup: u64,
        progress: &Progress,
    ) -> Result<Figures, BenchError> {
        let rpc = self.node.rpc();
        let payload = pattern(size, 0xC3);
        let round_trip = || async {
            let r = rpc
                .call_archived_within::<RpcEcho>(self.target, &payload, DEADLINE)
                .await?;
            echoed("rpc echo", size, r.get().len())
        };
        self.measure(size, budget, warmup, 1, progress, round_trip)
            .await
    }

    /// `rpc-rate`: windows of `window` [`RpcSink`] calls in flight together, polled by this
    /// task (no task per call); a window ends when every call has its reply. `rpc-notify`
    /// (`one_way`): `window - 1` one-way calls, then one answered call.
    async fn rpc_rate(
        &self,
        one_way: bool,
        size: usize,
        window: usize,
        budget: Budget,
        warmup: u64,
        progress: &Progress,
    ) -> Result<Figures, BenchError> {
        let rpc = self.node.rpc();
        let payload = pattern(size, 0x96);
        let call = || async {
            let r = rpc
                .call_archived_within::<RpcSink>(self.target, &payload, DEADLINE)
                .await?;
            let got = r.get().to_native();
            if got != size as u64 {
                return Err(BenchError::Protocol(format!(
                    "rpc sink of {size} bytes says it got {got}"
                )));
            }
            Ok::<(), BenchError>(())
        };
        // The window's futures live in boxes made for the first window and reused after.
        let mut calls = Window::default();
        let window_trip = async || {
            if one_way {
                // As `am-rate`: one-way, and the last one answered (after the others, on the
                // same rail and handled in order).
                for _ in 1..window {
                    rpc.notify::<RpcSink>(self.target, &payload).await?;
                }
                return call().await;
            }
            calls
                .run(window, call)
                .await
                .collect::<Result<(), BenchError>>()
        };
        let w = window as u64;
        // `Iters` counts calls: each measured window is `w` of them.
        self.measure(size, budget, warmup.div_ceil(w), w, progress, window_trip)
            .await
    }

    /// `put-bw`, `get-bw` and `put-trusted-bw`: `window` tasks, each doing one operation at a
    /// time.
    async fn rma(
        &self,
        kind: RmaOp,
        size: usize,
        window: usize,
        budget: Budget,
        warmup: u64,
        progress: &Rc<Progress>,
    ) -> Result<Figures, BenchError> {
        let missing = || BenchError::Protocol("no region for the remote-memory test".into());
        let checked = match kind {
            RmaOp::Put | RmaOp::Get => Some(self.region.ok_or_else(missing)?),
            RmaOp::PutTrusted => None,
        };
        let trusted = match kind {
            RmaOp::PutTrusted => Some(self.trusted.clone().ok_or_else(missing)?),
            RmaOp::Put | RmaOp::Get => None,
        };
        let peer = self.target;
        let data = pattern(size, 0x77);
        let op = async move |_: &mut ()| {
            match (kind, checked, trusted.as_ref()) {
                (RmaOp::Put, Some(desc), _) => {
                    peer.put_within(&desc, 0, &data, DEADLINE).await?;
                }
                (RmaOp::Get, Some(desc), _) => {
                    let got = peer.get_within(&desc, 0, size as u64, DEADLINE).await?;
                    if got.len() != size {
                        return Err(BenchError::Protocol(format!(
                            "get of {size} bytes returned {}",
                            got.len()
                        )));
                    }
                }
                (RmaOp::PutTrusted, _, Some(desc)) => {
                    peer.put_trusted_within(desc, 0, &data, DEADLINE).await?;
                }
                _ => return Err(BenchError::Protocol("no region for the test".into())),
            }
            Ok::<(), BenchError>(())
        };
        let (figures, _) = self
            .windowed(size, budget, warmup, progress, vec![(); window], op)
            .await?;
        Ok(figures)
    }

    /// The windowed remote-memory tests: one task per element of `states` (the window), each
    /// doing `op` on its own state, one operation at a time, after `warmup` operations on the
    /// first state; the figures, and the states back.
    async fn windowed<S: 'static>(
        &self,
        size: usize,
        budget: Budget,
        warmup: u64,
        progress: &Rc<Progress>,
        mut states: Vec<S>,
        op: impl AsyncFn(&mut S) -> Result<(), BenchError> + 'static,
    ) -> Result<(Figures, Vec<S>), BenchError> {
        if let Some(first) = states.first_mut() {
            for _ in 0..warmup {
                op(first).await?;
            }
        }
        let op = Rc::new(op);
        // One histogram for every task (one thread), made before the clock starts.
        let figures = Rc::new(RefCell::new(Figures::new(size)));
        let done = Rc::new(Cell::new(0u64));
        self.mark();
        let t0 = Instant::now();
        let tasks: Vec<_> = states
            .into_iter()
            .map(|mut state| {
                let (figures, done, op, progress) =
                    (figures.clone(), done.clone(), op.clone(), progress.clone());
                glommio::spawn_local(async move {
                    while more(budget, done.get(), t0) {
                        done.set(done.get() + 1);
                        let s = Instant::now();
                        op(&mut state).await?;
                        let mut f = figures.borrow_mut();
                        record(&mut f, s.elapsed());
                        f.msgs += 1;
                        progress.tick(budget, f.msgs, t0);
                    }
                    Ok::<S, BenchError>(state)
                })
            })
            .collect();
        let mut first_err = None;
        let mut back = Vec::with_capacity(tasks.len());
        for t in tasks {
            match t.await {
                Ok(state) => back.push(state),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        let elapsed = t0.elapsed();
        if let Some(e) = first_err {
            return Err(e);
        }
        let mut all = figures.borrow().clone();
        all.elapsed = elapsed;
        Ok((all, back))
    }

    /// `hop`: an empty job forwarded to the next shard, one at a time.
    async fn hop(
        &self,
        budget: Budget,
        warmup: u64,
        progress: &Progress,
    ) -> Result<Figures, BenchError> {
        let ctx = self.node.shard_ctx();
        let n = self.node.shard_count();
        // `n` fits: shard counts are at most 4096.
        let next = ShardId::new(((self.me.index() + 1) % n) as u16);
        let hop = || async {
            ctx.forward(next, |_| async {})
                .await
                .map_err(|e| BenchError::from(crate::Error::from(e)))
        };
        self.measure(0, budget, warmup, 1, progress, hop).await
    }

    /// Runs `step` `warmup` times, then measures it until `budget` is spent, at least once:
    /// one latency sample per step, each step counting `msgs` messages.
    async fn measure(
        &self,
        size: usize,
        budget: Budget,
        warmup: u64,
        msgs: u64,
        progress: &Progress,
        mut step: impl AsyncFnMut() -> Result<(), BenchError>,
    ) -> Result<Figures, BenchError> {
        for _ in 0..warmup {
            step().await?;
        }
        let mut f = Figures::new(size);
        self.mark();
        let t0 = Instant::now();
        while f.msgs == 0 || more(budget, f.msgs, t0) {
            let s = Instant::now();
            step().await?;
            record(&mut f, s.elapsed());
            f.msgs += msgs;
            progress.tick(budget, f.msgs, t0);
        }
        f.elapsed = t0.elapsed();
        Ok(f)
    }
}

/// `size` bytes of a pattern that starts at `seed` (so that a content check means something).
pub(super) fn pattern(size: usize, seed: u8) -> Vec<u8> {
    (0..size)
        .map(|i| seed.wrapping_add((i % 251) as u8))
        .collect()
}

/// Checks that an echo of `size` bytes came back whole.
fn echoed(what: &str, size: usize, got: usize) -> Result<(), BenchError> {
    if got == size {
        Ok(())
    } else {
        Err(BenchError::Protocol(format!(
            "{what} of {size} bytes came back with {got}"
        )))
    }
}

/// Fails the shard's waits once an answer is [`DEADLINE`] overdue (give or take a tenth): the
/// test then fails with a clear error instead of hanging.
async fn watchdog(w: Rc<Waits>) {
    let (mut last, mut stale) = (w.answered.get(), 0);
    while stale < 10 {
        sleep(DEADLINE / 10).await;
        let answered = w.answered.get();
        stale = if w.waiting.get() && answered == last {
            stale + 1
        } else {
            0
        };
        last = answered;
    }
    w.overdue.set(true);
    w.wake();
}

/// Whether a test with `done` measured iterations, started at `t0`, goes on.
pub(super) fn more(budget: Budget, done: u64, t0: Instant) -> bool {
    match budget {
        Budget::Iters(n) => done < n,
        Budget::Duration(d) => t0.elapsed() < d,
    }
}

/// [`more`], with the clock already read (`now`).
fn more_at(budget: Budget, done: u64, t0: Instant, now: Instant) -> bool {
    match budget {
        Budget::Iters(n) => done < n,
        Budget::Duration(d) => now - t0 < d,
    }
}

pub(super) fn record(f: &mut Figures, took: Duration) {
    let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
    f.hist.saturating_record(ns.max(1));
}

/// Futures run together on the calling task, window after window ([`Window::run`]): the boxes
/// that hold them and their wakers are made for the first window and kept, and each later
/// window's futures are written into the same boxes; the list of woken futures and the outputs
/// are vectors kept from window to window too, so a window allocates nothing (as
/// `ucx_perftest`'s loop allocates nothing per message). Each future is polled again only
/// when its own waker fires, so a window of `n` costs `O(n)` polls, not `O(n^2)`.
struct Window<F: Future> {
    futures: Vec<Pin<Box<F>>>,
    wakers: Vec<Waker>,
    ready: Arc<Ready>,
    /// The outputs of the window being run, by index.
    out: Vec<Option<F::Output>>,
    /// The woken list taken from `ready` while its futures are polled (then cleared and
    /// swapped back in, its capacity kept).
    polling: Vec<usize>,
}

impl<F: Future> Default for Window<F> {
    fn default() -> Self {
        Self {
            futures: Vec::new(),
            wakers: Vec::new(),
            ready: Arc::new(Ready {
                woken: Mutex::new(Vec::new()),
                task: Mutex::new(None),
            }),
            out: Vec::new(),
            polling: Vec::new(),
        }
    }
}

impl<F: Future> Window<F> {
    /// Runs `n` futures made by `make` together and returns their outputs in order (drained
    /// from a vector the window keeps).
    async fn run(
        &mut self,
        n: usize,
        mut make: impl FnMut() -> F,
    ) -> impl Iterator<Item = F::Output> + '_ {
        for i in 0..n {
            match self.futures.get_mut(i) {
                Some(f) => f.set(make()),
                None => {
                    self.futures.push(Box::pin(make()));
                    self.wakers.push(Waker::from(Arc::new(Slot {
                        index: i,
                        ready: self.ready.clone(),
                    })));
                }
            }
        }
        self.out.clear();
        self.out.resize_with(n, || None);
        // Every future is polled once first (a wake left over from the window before, of a
        // future already done then, finds its output slot empty: the future is new, polled
        // once more than it asked for, which is harmless).
        lock(&self.ready.woken).extend(0..n);
        let mut left = n;
        let (futures, wakers, ready) = (&mut self.futures, &self.wakers, &self.ready);
        let (out, polling) = (&mut self.out, &mut self.polling);
        std::future::poll_fn(|cx| {
            *lock(&ready.task) = Some(cx.waker().clone());
            loop {
                // The woken list and the one polled trade places: both keep their capacity.
                std::mem::swap(&mut *lock(&ready.woken), polling);
                if polling.is_empty() {
                    break;
                }
                for &i in polling.iter() {
                    if i >= n || out[i].is_some() {
                        continue;
                    }
                    let mut fcx = Context::from_waker(&wakers[i]);
                    if let Poll::Ready(v) = futures[i].as_mut().poll(&mut fcx) {
                        out[i] = Some(v);
                        left -= 1;
                    }
                }
                polling.clear();
            }
            if left == 0 {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
        self.out.drain(..).flatten()
    }
}

/// The futures of a [`Window`] that asked to be polled again, and the task polling them.
struct Ready {
    woken: Mutex<Vec<usize>>,
    task: Mutex<Option<Waker>>,
}

/// The waker of one future of a [`Window`].
struct Slot {
    index: usize,
    ready: Arc<Ready>,
}

impl Wake for Slot {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        lock(&self.ready.woken).push(self.index);
        if let Some(w) = lock(&self.ready.task).as_ref() {
            w.wake_by_ref();
        }
    }
}

/// Locks `m`; a panic while it was held leaves plain data, still usable.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Progress {
    pub(super) fn new(on: bool, label: String) -> Self {
        let now = Instant::now();
        Self {
            on: on && std::io::stderr().is_terminal(),
            label,
            start: now,
            last: Cell::new(now),
            bar: RefCell::new(None),
        }
    }

    /// Called after each measured iteration (by the `am-lat` handler on the driver, by the
    /// test tasks otherwise): cheap until the bar is due. Only every [`PROGRESS_CHECK_EVERY`]-th
    /// call reads the clock, and the bar is updated at most every [`PROGRESS_EVERY`].
    pub(super) fn tick(&self, budget: Budget, done: u64, t0: Instant) {
        if !self.on || done % PROGRESS_CHECK_EVERY != 0 {
            return;
        }
        let now = Instant::now();
        if now - self.start < PROGRESS_AFTER || now - self.last.get() < PROGRESS_EVERY {
            return;
        }
        self.last.set(now);
        let position = match budget {
            Budget::Iters(n) => done.min(n),
            Budget::Duration(d) => {
                let ms = |t: Duration| u64::try_from(t.as_millis()).unwrap_or(u64::MAX);
                ms(now - t0).min(ms(d))
            }
        };
        let mut slot = self.bar.borrow_mut();
        match slot.as_ref() {
            Some(bar) => bar.set_position(position),
            None => *slot = Some(self.bar_for(budget, position)),
        }
    }

    /// The bar, first drawn when the test has run [`PROGRESS_AFTER`]: iterations (messages
    /// for the windowed tests) out of the budget, or milliseconds out of `--duration`.
    fn bar_for(&self, budget: Budget, position: u64) -> ProgressBar {
        let (len, template) = match budget {
            Budget::Iters(n) => (
                n,
                "{prefix} [{wide_bar}] {percent:>3}% {human_pos}/{human_len} in {elapsed}",
            ),
            Budget::Duration(d) => (
                u64::try_from(d.as_millis()).unwrap_or(u64::MAX),
                "{prefix} [{wide_bar}] {percent:>3}% {elapsed} of {len} ms",
            ),
        };
        let style = ProgressStyle::with_template(template)
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("#>-");
        // Set up hidden, then shown: its first picture is already at `position`.
        // indicatif's rate and time estimates start with the bar: it starts late, so its rate
        // would be wrong at first; only the elapsed time (set here) is shown.
        let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::hidden())
            .with_elapsed(self.start.elapsed());
        bar.set_style(style);
        bar.set_prefix(self.label.clone());
        bar.set_position(position);
        bar.set_draw_target(ProgressDrawTarget::stderr());
        bar.tick();
        bar
    }

    /// The test is over: its bar, if it was drawn, is cleared.
    pub(super) fn done(&self) {
        if let Some(bar) = self.bar.borrow_mut().take() {
            bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;

    /// Ready after `left` polls that each wake the task first; counts its polls.
    struct Countdown {
        left: u32,
        polls: Rc<Cell<u32>>,
        value: usize,
    }

    impl Future for Countdown {
        type Output = usize;
        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<usize> {
            self.polls.set(self.polls.get() + 1);
            if self.left == 0 {
                return Poll::Ready(self.value);
            }
            self.left -= 1;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }

    #[test]
    fn a_window_keeps_order_polls_only_the_woken_and_reuses_its_boxes() {
        let polls = Rc::new(Cell::new(0));
        let waits = [5u32, 0, 3, 9, 1, 0, 2];
        let mut window = Window::default();
        let mut boxes = Vec::new();
        for round in 0..3 {
            let mut next = 0;
            let make = || {
                let (value, left) = (next, waits[next]);
                next += 1;
                Countdown {
                    left,
                    polls: polls.clone(),
                    value: value + 100 * round,
                }
            };
            polls.set(0);
            let out: Vec<usize> =
                futures_lite::future::block_on(window.run(waits.len(), make)).collect();
            let want: Vec<usize> = (0..waits.len()).map(|v| v + 100 * round).collect();
            assert_eq!(out, want, "round {round}");
            // Each future is polled once more than it waits: never again after it is ready,
            // and never for another future's wake-up.
            let polled: u32 = waits.iter().map(|w| w + 1).sum();
            assert_eq!(polls.get(), polled, "round {round}");
            // The same boxes every window, and the same vector for the outputs (nothing
            // allocated after the first window).
            let mut at: Vec<*const ()> = window
                .futures
                .iter()
                .map(|f| &**f as *const Countdown as *const ())
                .collect();
            at.push(window.out.as_ptr() as *const ());
            // The two woken lists trade places (either may be either) and both keep their
            // room: a list taken out would leave an empty one, with none.
            assert!(
                window.polling.capacity() > 0 && lock(&window.ready.woken).capacity() > 0,
                "round {round}: a woken list lost its room"
            );
            if round == 0 {
                boxes = at;
            } else {
                assert_eq!(at, boxes, "round {round}");
            }
        }
        assert!(
            futures_lite::future::block_on(Window::<Countdown>::default().run(0, || {
                unreachable!("no future is made for an empty window")
            }))
            .next()
            .is_none()
        );
    }
}
