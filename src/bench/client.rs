//! The measuring side of a benchmark: one client node, every shard against its own bench peer
//! (see [`crate::bench`]).
//!
//! [`run`] starts a node with the configured shard count, pins shard `i` to the `i`-th client
//! CPU, and on every shard: connects to the main node, asks it for the bench peers
//! ([`super::PEERS`]), connects to peer `shard % K`, and runs the planned (test, size) pairs in
//! order, all shards starting each one together (a barrier between tests). Answers to the
//! shard's requests may arrive on another shard (the owner of the peer); they are forwarded to
//! the shard named in their header.
//!
//! Tag streams: client shard `s` sends pings tagged `1 << 12 | s` and receives pongs tagged
//! `2 << 12 | s`; `3 << 12 | s` ends the stream on the peer.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use glommio::channels::local_channel::{self, LocalReceiver, LocalSender};
use glommio::timer::sleep;
use shardcx_shards::proto::ShardId;
use shardcx_shards::{Placement, RemoteRegion};

use super::server::{TAG_PING, TAG_PONG, TAG_STOP, TAG_STREAM};
use super::{
    header, net_config, parse_header, pin_current, reachable, BenchError, Budget, Figures,
    Measurement, Route, RpcEcho, RpcSink, ShardFigures, Test, Transport, ACK, ECHO, ECHO_REPLY,
    FLAG_ACK, PEERS, PEERS_REPLY, REGION, REGION_REPLY, SINK, TAG_START,
};
use crate::{AmId, AmMsg, Node, OwnedAmMsg, Peer, TAG_MASK_EXACT};

/// Deadline of every operation and answer of a benchmark.
const DEADLINE: Duration = Duration::from_secs(30);
/// Bytes in flight at most in `am-bw` (the window is capped to fit).
const BW_IN_FLIGHT: usize = 32 << 20;
/// How often shards waiting at the barrier between tests look again.
const GATE_POLL: Duration = Duration::from_micros(50);
/// Runs longer than this show progress on stderr (when it is a terminal).
const PROGRESS_AFTER: Duration = Duration::from_secs(1);

/// Settings of [`run`].
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// The main node of the server.
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
    /// Show progress on stderr for tests longer than a second.
    pub progress: bool,
    /// glommio io memory per client shard (`None`: sized to the memlock limit; set it when the
    /// server runs in the same process).
    pub io_memory: Option<u64>,
}

thread_local! {
    /// Where this shard's answers go.
    static ANSWERS: RefCell<Option<LocalSender<OwnedAmMsg>>> = const { RefCell::new(None) };
}

/// The barrier between tests: round `k` opens once every shard has arrived `k` times.
struct Gate {
    arrived: AtomicUsize,
    failed: AtomicBool,
    shards: usize,
}

/// What a shard needs for its tests.
struct Session {
    node: Node,
    me: ShardId,
    peer: Peer,
    route: Route,
    answers: LocalReceiver<OwnedAmMsg>,
    watch: Rc<Watch>,
    region: Option<RemoteRegion>,
    seq: Cell<u64>,
}

/// What the shard's watchdog ([`watchdog`]) looks at: whether the shard waits for an answer,
/// and how many it has had.
#[derive(Default)]
struct Watch {
    waiting: Cell<bool>,
    answered: Cell<u64>,
}

/// Shows a test's progress on stderr after [`PROGRESS_AFTER`].
struct Progress {
    on: bool,
    label: String,
    start: Instant,
    last: Cell<Instant>,
    shown: Cell<bool>,
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
            if test == Test::Hop && cfg.shards < 2 {
                out.push(skipped(cfg, test, size, "needs --shards 2 or more"));
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
    for id in [PEERS_REPLY, ECHO_REPLY, ACK, REGION_REPLY] {
        b = b.on_am(id, || on_answer);
    }
    let shared = Arc::new((cfg.clone(), plan.clone()));
    let results = b.run(move |node: Node| {
        let (shared, gate) = (shared.clone(), gate.clone());
        async move {
            let (cfg, plan) = &*shared;
            if let Some(cores) = cfg.cores.as_ref().filter(|c| !c.is_empty()) {
                pin_current(cores[node.shard().index() % cores.len()]);
            }
            let (tx, rx) = local_channel::new_unbounded();
            ANSWERS.with(|a| *a.borrow_mut() = Some(tx));
            let r = shard_main(node, cfg, plan, &gate, rx).await;
            if r.is_err() {
                gate.failed.store(true, Ordering::Release);
            }
            ANSWERS.with(|a| a.borrow_mut().take());
            r.map_err(|e| e.to_string())
        }
    })?;
    let mut per_shard: Vec<Vec<ShardFigures>> = Vec::with_capacity(cfg.shards);
    let mut first_err = None;
    for r in results {
        match r {
            Ok(v) => per_shard.push(v),
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_err {
        return Err(BenchError::Protocol(e));
    }
    for (k, (test, size)) in plan.into_iter().enumerate() {
        let per_shard = per_shard.iter().filter_map(|v| v.get(k).cloned()).collect();
        out.push(Measurement {
            test,
            size,
            shards: cfg.shards,
            transport: cfg.transport,
            per_shard,
            skipped: None,
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
        skipped: Some(why.into()),
    }
}

/// The client's handler of answers: to the shard named in the header.
fn on_answer(node: &Node, msg: AmMsg) {
    let Some((origin, _, _)) = parse_header(msg.header()) else {
        return;
    };
    let msg = msg.into_owned();
    if origin == node.shard() {
        deliver(msg);
    } else if origin.index() < node.shard_count() {
        let ctx = node.shard_ctx().clone();
        glommio::spawn_local(async move {
            let _ = ctx
                .forward(origin, move |_| async move { deliver(msg) })
                .await;
        })
        .detach();
    }
}

fn deliver(msg: OwnedAmMsg) {
    ANSWERS.with(|a| {
        if let Some(tx) = a.borrow().as_ref() {
            let _ = tx.try_send(msg);
        }
    });
}

/// One shard's whole run: set-up, then every planned test.
async fn shard_main(
    node: Node,
    cfg: &ClientConfig,
    plan: &[(Test, usize)],
    gate: &Gate,
    answers: LocalReceiver<OwnedAmMsg>,
) -> Result<Vec<ShardFigures>, BenchError> {
    let me = node.shard();
    let main = node.connect_within(cfg.addr, DEADLINE).await?;
    let watch = Rc::new(Watch::default());
    // Cancelled when dropped, at the end of the shard's run.
    let _watchdog = glommio::spawn_local(watchdog(watch.clone()));
    let mut s = Session {
        node: node.clone(),
        me,
        peer: main,
        route: Route::Forwarded,
        answers,
        watch,
        region: None,
        seq: Cell::new(0),
    };
    main.am_send(PEERS, &header(me, 0, 0), &[]).await?;
    let list = s.answer(PEERS_REPLY, 0).await?;
    let peers = super::server::decode_peers(list.payload())
        .filter(|p| !p.is_empty())
        .ok_or_else(|| BenchError::Protocol("the server sent a malformed peer list".into()))?;
    let (id, addr) = peers[me.index() % peers.len()];
    let peer = node
        .connect_within(reachable(addr, cfg.addr), DEADLINE)
        .await?;
    if peer.node_id() != id {
        return Err(BenchError::Protocol(format!(
            "bench peer at {addr} is node {}, not {id}",
            peer.node_id()
        )));
    }
    s.peer = peer;
    s.route = if node.owner_of(peer) == me {
        Route::Owner
    } else {
        Route::Forwarded
    };
    let rma = plan
        .iter()
        .filter(|(t, _)| matches!(t, Test::PutBw | Test::GetBw))
        .map(|(_, size)| *size)
        .max();
    if let Some(size) = rma {
        peer.am_send(REGION, &header(me, size as u64, 0), &[])
            .await?;
        let d = s.answer(REGION_REPLY, size as u64).await?;
        let desc = RemoteRegion::from_bytes(d.payload()).map_err(|e| {
            BenchError::Protocol(format!("the bench peer has no region of {size} bytes: {e}"))
        })?;
        s.region = Some(desc);
    }
    let mut out = Vec::with_capacity(plan.len());
    for (k, &(test, size)) in plan.iter().enumerate() {
        gate.wait(k + 1).await?;
        let progress = Progress::new(
            cfg.progress && me.index() == 0,
            format!(
                "{test} {} B, {} shard(s), {}",
                super::format_size(size),
                cfg.shards,
                cfg.transport
            ),
        );
        let figures = s.run_test(cfg, test, size, &progress).await?;
        progress.done();
        out.push(ShardFigures {
            shard: me,
            route: if test == Test::Hop {
                Route::Local
            } else {
                s.route
            },
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

impl Session {
    fn next_seq(&self) -> u64 {
        let s = self.seq.get() + 1;
        self.seq.set(s);
        s
    }

    /// The next answer, which must be `id` with sequence number `seq`.
    async fn answer(&self, id: AmId, seq: u64) -> Result<OwnedAmMsg, BenchError> {
        // No timer per answer: the watchdog closes the channel when an answer is overdue.
        self.watch.waiting.set(true);
        let msg = self.answers.recv().await;
        self.watch.waiting.set(false);
        let msg = msg.ok_or_else(|| {
            BenchError::Protocol(format!("no answer {id} from the peer within {DEADLINE:?}"))
        })?;
        self.watch.answered.set(self.watch.answered.get() + 1);
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
        progress: &Progress,
    ) -> Result<Figures, BenchError> {
        let budget = cfg
            .budget
            .unwrap_or_else(|| Budget::Iters(test.default_iters(size)));
        let warmup = cfg.warmup.unwrap_or(match budget {
            Budget::Iters(n) => (n / 10).min(1000),
            Budget::Duration(_) => 1000,
        });
        match test {
            Test::AmLat => self.am_lat(size, budget, warmup, progress).await,
            Test::AmRate | Test::AmBw => {
                let window = if test == Test::AmBw {
                    cfg.window.min((BW_IN_FLIGHT / size.max(1)).max(1))
                } else {
                    cfg.window
                };
                self.am_stream(size, window, budget, warmup, progress).await
            }
            Test::TagLat => self.tag_lat(size, budget, warmup, progress).await,
            Test::RpcLat => self.rpc_lat(size, budget, warmup, progress).await,
            Test::RpcRate | Test::RpcNotify => {
                let one_way = test == Test::RpcNotify;
                self.rpc_rate(one_way, size, cfg.window, budget, warmup, progress)
                    .await
            }
            Test::PutBw | Test::GetBw => {
                let window = cfg.window.min((BW_IN_FLIGHT / size.max(1)).max(1));
                self.rma(test == Test::PutBw, size, window, budget, warmup, progress)
                    .await
            }
            Test::Hop => self.hop(budget, warmup, progress).await,
        }
    }

    async fn am_lat(
        &self,
        size: usize,
        budget: Budget,
        warmup: u64,
        progress: &Progress,
    ) -> Result<Figures, BenchError> {
        let payload = vec![0xA5u8; size];
        let round_trip = || async {
            let seq = self.next_seq();
            self.peer
                .am_send_within(ECHO, &header(self.me, seq, 0), &payload, DEADLINE)
                .await?;
            let r = self.answer(ECHO_REPLY, seq).await?;
            echoed("echo", size, r.payload().len())
        };
        measure(size, budget, warmup, 1, progress, round_trip).await
    }

    /// `am-rate` and `am-bw`: windows of one-way messages, the last one acknowledged.
    async fn am_stream(
        &self,
        size: usize,
        window: usize,
        budget: Budget,
        warmup: u64,
        progress: &Progress,
    ) -> Result<Figures, BenchError> {
        let payload = vec![0x5Au8; size];
        let window_trip = || async {
            let mut last = 0;
            for k in 0..window {
                last = self.next_seq();
                let flags = if k + 1 == window { FLAG_ACK } else { 0 };
                self.peer
                    .am_send_within(SINK, &header(self.me, last, flags), &payload, DEADLINE)
                    .await?;
            }
            self.answer(ACK, last).await.map(drop)
        };
        let w = window as u64;
        // `Iters` counts messages: each measured window is `w` of them.
        measure(size, budget, warmup.div_ceil(w), w, progress, window_trip).await
    }

    async fn tag_lat(
        &self,
        size: usize,
        budget: Budget,
        warmup: u64,
        progress: &Progress,
    ) -> Result<Figures, BenchError> {
        let stream = u64::from(self.me.get()) & TAG_STREAM;
        self.peer
            .am_send(TAG_START, &header(self.me, 0, 0), &[])
            .await?;
        let payload = vec![0x3Cu8; size];
        let round_trip = || async {
            self.peer
                .tag_send_within(TAG_PING | stream, &payload, DEADLINE)
                .await?;
            let (_, data) = self
                .peer
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
        let r = measure(size, budget, warmup, 1, progress, round_trip).await;
        // Ends the peer's stream whatever happened (it also ends by itself when idle).
        let _ = self.peer.tag_send(TAG_STOP | stream, &[]).await;
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
        let payload = vec![0xC3u8; size];
        let round_trip = || async {
            let r = rpc
                .call_archived_within::<RpcEcho>(self.peer, &payload, DEADLINE)
                .await?;
            echoed("rpc echo", size, r.get().len())
        };
        measure(size, budget, warmup, 1, progress, round_trip).await
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
        let payload = vec![0x96u8; size];
        let call = || async {
            let r = rpc
                .call_archived_within::<RpcSink>(self.peer, &payload, DEADLINE)
                .await?;
            let got = r.get().to_native();
            if got != size as u64 {
                return Err(BenchError::Protocol(format!(
                    "rpc sink of {size} bytes says it got {got}"
                )));
            }
            Ok::<(), BenchError>(())
        };
        let window_trip = || async {
            if one_way {
                // As `am-rate`: one-way, and the last one answered (after the others, on the
                // same connection and handled in order).
                for _ in 1..window {
                    rpc.notify::<RpcSink>(self.peer, &payload).await?;
                }
                return call().await;
            }
            join_all((0..window).map(|_| call()))
                .await
                .into_iter()
                .collect::<Result<(), BenchError>>()
        };
        let w = window as u64;
        // `Iters` counts calls: each measured window is `w` of them.
        measure(size, budget, warmup.div_ceil(w), w, progress, window_trip).await
    }

    /// `put-bw` and `get-bw`: `window` tasks, each doing one operation at a time.
    async fn rma(
        &self,
        put: bool,
        size: usize,
        window: usize,
        budget: Budget,
        warmup: u64,
        progress: &Progress,
    ) -> Result<Figures, BenchError> {
        let desc = self
            .region
            .ok_or_else(|| BenchError::Protocol("no region for put/get".into()))?;
        let peer = self.peer;
        let op = move |data: Rc<Vec<u8>>| async move {
            if put {
                peer.put_within(&desc, 0, &data, DEADLINE).await?;
            } else {
                let got = peer.get_within(&desc, 0, size as u64, DEADLINE).await?;
                if got.len() != size {
                    return Err(BenchError::Protocol(format!(
                        "get of {size} bytes returned {}",
                        got.len()
                    )));
                }
            }
            Ok::<(), BenchError>(())
        };
        let data = Rc::new(vec![0x77u8; size]);
        for _ in 0..warmup {
            op(data.clone()).await?;
        }
        // One histogram for every task (one thread), made before the clock starts.
        let figures = Rc::new(RefCell::new(Figures::new(size)));
        let done = Rc::new(Cell::new(0u64));
        let t0 = Instant::now();
        let tasks: Vec<_> = (0..window)
            .map(|_| {
                let (figures, done, data) = (figures.clone(), done.clone(), data.clone());
                glommio::spawn_local(async move {
                    while more(budget, done.get(), t0) {
                        done.set(done.get() + 1);
                        let s = Instant::now();
                        op(data.clone()).await?;
                        let mut f = figures.borrow_mut();
                        record(&mut f, s);
                        f.msgs += 1;
                    }
                    Ok::<(), BenchError>(())
                })
            })
            .collect();
        let mut first_err = None;
        for t in tasks {
            if let Err(e) = t.await {
                first_err.get_or_insert(e);
            }
            progress.tick(budget, done.get(), t0);
        }
        let elapsed = t0.elapsed();
        if let Some(e) = first_err {
            return Err(e);
        }
        let mut all = figures.borrow().clone();
        all.elapsed = elapsed;
        Ok(all)
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
        measure(0, budget, warmup, 1, progress, hop).await
    }
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

/// Runs `step` `warmup` times, then measures it until `budget` is spent, at least once: one
/// latency sample per step, each step counting `msgs` messages.
async fn measure<F, Fut>(
    size: usize,
    budget: Budget,
    warmup: u64,
    msgs: u64,
    progress: &Progress,
    step: F,
) -> Result<Figures, BenchError>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<(), BenchError>>,
{
    for _ in 0..warmup {
        step().await?;
    }
    let mut f = Figures::new(size);
    let t0 = Instant::now();
    while f.msgs == 0 || more(budget, f.msgs, t0) {
        let s = Instant::now();
        step().await?;
        record(&mut f, s);
        f.msgs += msgs;
        progress.tick(budget, f.msgs, t0);
    }
    f.elapsed = t0.elapsed();
    Ok(f)
}

/// Runs `futures` together on the calling task and returns their outputs in order. Each
/// future is polled again only when its own waker fires, so a window of `n` calls costs `O(n)`
/// polls, not `O(n^2)`.
async fn join_all<F: Future>(futures: impl IntoIterator<Item = F>) -> Vec<F::Output> {
    let mut pending: Vec<Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    let n = pending.len();
    let mut out: Vec<Option<F::Output>> = (0..n).map(|_| None).collect();
    let ready = Arc::new(Ready {
        // Every future is polled once first.
        woken: Mutex::new((0..n).collect()),
        task: Mutex::new(None),
    });
    let wakers: Vec<Waker> = (0..n)
        .map(|index| {
            Waker::from(Arc::new(Slot {
                index,
                ready: ready.clone(),
            }))
        })
        .collect();
    let mut left = n;
    std::future::poll_fn(|cx| {
        *lock(&ready.task) = Some(cx.waker().clone());
        loop {
            let woken = std::mem::take(&mut *lock(&ready.woken));
            if woken.is_empty() {
                break;
            }
            for i in woken {
                if out[i].is_some() {
                    continue;
                }
                let mut fcx = Context::from_waker(&wakers[i]);
                if let Poll::Ready(v) = pending[i].as_mut().poll(&mut fcx) {
                    out[i] = Some(v);
                    left -= 1;
                }
            }
        }
        if left == 0 {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await;
    out.into_iter().flatten().collect()
}

/// The futures of a [`join_all`] that asked to be polled again, and the task polling them.
struct Ready {
    woken: Mutex<Vec<usize>>,
    task: Mutex<Option<Waker>>,
}

/// The waker of one future of a [`join_all`].
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

/// Ends the shard's wait for an answer that is [`DEADLINE`] overdue (give or take a tenth), by
/// closing the shard's answer channel: the wait then fails with a clear error.
async fn watchdog(watch: Rc<Watch>) {
    let (mut last, mut stale) = (watch.answered.get(), 0);
    while stale < 10 {
        sleep(DEADLINE / 10).await;
        let answered = watch.answered.get();
        stale = if watch.waiting.get() && answered == last {
            stale + 1
        } else {
            0
        };
        last = answered;
    }
    ANSWERS.with(|a| a.borrow_mut().take());
}

/// Whether a test with `done` measured iterations, started at `t0`, goes on.
fn more(budget: Budget, done: u64, t0: Instant) -> bool {
    match budget {
        Budget::Iters(n) => done < n,
        Budget::Duration(d) => t0.elapsed() < d,
    }
}

fn record(f: &mut Figures, since: Instant) {
    let ns = u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX);
    f.hist.saturating_record(ns.max(1));
}

impl Progress {
    fn new(on: bool, label: String) -> Self {
        let now = Instant::now();
        Self {
            on: on && std::io::stderr().is_terminal(),
            label,
            start: now,
            last: Cell::new(now),
            shown: Cell::new(false),
        }
    }

    fn tick(&self, budget: Budget, done: u64, t0: Instant) {
        if !self.on || done % 64 != 0 {
            return;
        }
        let now = Instant::now();
        if now - self.start < PROGRESS_AFTER || now - self.last.get() < Duration::from_millis(200) {
            return;
        }
        self.last.set(now);
        self.shown.set(true);
        let frac = match budget {
            Budget::Iters(n) => done as f64 / n.max(1) as f64,
            Budget::Duration(d) => t0.elapsed().as_secs_f64() / d.as_secs_f64().max(1e-9),
        }
        .clamp(0.0, 1.0);
        let filled = (frac * 30.0) as usize;
        let mut e = std::io::stderr().lock();
        let _ = write!(
            e,
            "\r{} [{}{}] {:3.0}%",
            self.label,
            "#".repeat(filled),
            " ".repeat(30 - filled),
            frac * 100.0
        );
        let _ = e.flush();
    }

    fn done(&self) {
        if self.shown.get() {
            let mut e = std::io::stderr().lock();
            let _ = write!(e, "\r{}\r", " ".repeat(self.label.len() + 40));
            let _ = e.flush();
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
    fn join_all_keeps_order_and_polls_only_the_woken() {
        let polls = Rc::new(Cell::new(0));
        let waits = [5u32, 0, 3, 9, 1, 0, 2];
        let futs = waits.iter().enumerate().map(|(value, &left)| Countdown {
            left,
            polls: polls.clone(),
            value,
        });
        let out = futures_lite::future::block_on(join_all(futs));
        assert_eq!(out, (0..waits.len()).collect::<Vec<_>>());
        // Each future is polled once more than it waits: never again after it is ready, and
        // never for another future's wake-up.
        let want: u32 = waits.iter().map(|w| w + 1).sum();
        assert_eq!(polls.get(), want);
        assert!(futures_lite::future::block_on(join_all(Vec::<Countdown>::new())).is_empty());
    }
}
