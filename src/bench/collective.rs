//! Collective benchmarks (`shardcx bench --test barrier,bcast,allreduce,allgather,
//! reduce-scatter,alltoall`): a world of ranks runs one collective at a time, every rank
//! timing each call.
//!
//! ## Topology
//!
//! [`run`] starts **two nodes of `shards` shards each in this process** (node 0 listening on
//! loopback, node 1 connecting to it: one session, a rail per shard pair), and makes the world
//! communicator of both ([`Communicator::world`]): `2 × shards` ranks, numbered node by node.
//! No peer process is involved (the ranks are symmetric: every one of them runs the same
//! collectives, which `shardcx node` does not), so `--connect` does not apply. With
//! `--transport shm` the two nodes' rails use UCX's shared-memory transports (`sm,tcp`, tcp for
//! connecting), as two processes on one host would; `tcp` forces loopback TCP. Shard `s` of node
//! `i` is pinned to a CPU of its own list ([`CollectiveConfig::cores`]).
//!
//! ## What one iteration is
//!
//! One call of the collective on every rank, timed on each rank from the call to its return.
//! Before the timed calls: the warm-up calls and a barrier. All ranks must make the same
//! number of calls: `--iters N` is that number; with `--duration S` rank 0 looks at its clock
//! every batch of calls (about a fiftieth of `S` at the pace of the second half of its
//! warm-up; at least one warm-up call then) and broadcasts whether to go on, untimed; without
//! either, the count is [`Collective::default_iters`] by size, stopped the same way once the
//! timed calls have taken [`DEFAULT_MAX_TIME`]. Every
//! operation has a deadline ([`DEADLINE`]): a lost rank or a stuck collective fails the run
//! with its [`CollectiveError`], it does not hang. The last result of every size is checked
//! against its closed-form value on every rank.
//!
//! ## Sizes and bus bandwidth
//!
//! `size` is the operation's whole buffer, as in nccl-tests: the vector of each rank for
//! allreduce and bcast, the gathered result for allgather, each rank's input for
//! reduce-scatter and its send buffer for alltoall (each rank's block is `size / ranks`).
//! Reductions are `f32` sums, the others move bytes (`u8`). Sizes are rounded down to whole
//! elements and blocks, at least one each: the `bytes` column is what moved. For each rank
//! the percentiles are its own over the timed calls; the table shows the slowest rank's p50
//! and p99 (and the fastest rank's p50, for the spread). Bus bandwidth is
//! `bytes × factor / p50` with the slowest rank's p50 and the NCCL/MPI factor: allreduce
//! `2(p−1)/p`, bcast 1, allgather, reduce-scatter and alltoall `(p−1)/p`; algbw is
//! `bytes / p50`.
//!
//! ## Cost model
//!
//! By default the algorithm chooser ([`crate::collective::Tuning`]) switches to the
//! large-message algorithms at a fixed size ([`Tuning::large_from`]). For allreduce run at two
//! sizes or more, [`cost_model`] fits `T(n) = α + β·n` through the slowest rank's p50 at the
//! smallest and the largest size (with two ranks an allreduce is one exchange: `α` is the cost
//! of a message, `β` of a byte), and the table prints `α`, `β` and `n½ = α/β`, the size at which
//! the bandwidth term equals the latency term (see the README). `shardcx bench --save-costs
//! FILE` writes them ([`CostModel::costs`], [`Costs::to_json`]); [`Tuning::with_costs`] with
//! [`Costs::load`] of that file (or `shardcx bench --costs FILE`) has the cost model of
//! [`crate::collective::cost`] choose the algorithms instead of the fixed size.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, OnceLock};
use std::time::{Duration, Instant};

use glommio::timer::sleep;
use shardcx_shards::proto::NodeId;
use shardcx_shards::{Placement, ShardsBuilder};

use super::client::{pattern, record, Progress};
use super::{format_size, net_config, pin_current, BenchError, Budget, Figures, Transport};
use crate::collective::{Algorithm, CollectiveError, Communicator, Costs, CostsError, Sum, Tuning};
use crate::Node;

/// Deadline of every collective call of the benchmark (and of making the world).
pub const DEADLINE: Duration = Duration::from_secs(30);
/// Without `--iters` or `--duration`, the timed calls of one size take about this long at
/// most (estimated from rank 0's warm-up).
pub const DEFAULT_MAX_TIME: Duration = Duration::from_secs(5);
/// Nodes in the world of [`run`].
pub const NODES: usize = 2;
/// Node ids of the benchmark's two nodes (any two distinct ids; they live in this process).
const NODE_IDS: [NodeId; NODES] = [NodeId::new(0x5343_C011), NodeId::new(0x5343_C012)];

/// One collective benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Collective {
    /// [`Communicator::barrier`].
    Barrier,
    /// [`Communicator::broadcast`] from rank 0.
    Bcast,
    /// [`Communicator::all_reduce`], `f32` sum.
    Allreduce,
    /// [`Communicator::all_gather`].
    Allgather,
    /// [`Communicator::reduce_scatter`], `f32` sum.
    ReduceScatter,
    /// [`Communicator::all_to_all`].
    Alltoall,
}

/// Settings of [`run`].
#[derive(Debug, Clone)]
pub struct CollectiveConfig {
    /// Shards (ranks) of each of the two nodes.
    pub shards: usize,
    /// UCX transports of both nodes.
    pub transport: Transport,
    /// Collectives, in order.
    pub tests: Vec<Collective>,
    /// Sizes for every collective but `barrier` (`None`: each one's defaults).
    pub sizes: Option<Vec<usize>>,
    /// Timed calls or time per size (`None`: [`Collective::default_iters`], at most
    /// [`DEFAULT_MAX_TIME`]).
    pub budget: Option<Budget>,
    /// Warm-up calls (`None`: a tenth of the count, at most 1000; with `--duration`, of
    /// [`Collective::default_iters`]; at least 1 when the count comes from a time).
    pub warmup: Option<u64>,
    /// CPUs of each node's shards: shard `s` of node `i` on `cores[i][s % len]`; `None` (or
    /// an empty list): unpinned.
    pub cores: Option<[Vec<usize>; NODES]>,
    /// The pre-shared key of the two nodes.
    pub psk: Vec<u8>,
    /// Show a progress bar on stderr for sizes that run longer than a second (only when
    /// stderr is a terminal).
    pub progress: bool,
    /// glommio io memory per shard (`None`: every shard of both nodes fits the memlock limit).
    pub io_memory: Option<u64>,
    /// What chooses the algorithms (`shardcx bench --costs FILE`: the default tuning with the
    /// costs in FILE).
    pub tuning: Tuning,
}

/// The result of one (collective, size, shards, transport).
#[derive(Debug, Clone)]
pub struct CollMeasurement {
    /// The collective.
    pub test: Collective,
    /// The size asked for (0 for barrier).
    pub size: usize,
    /// The bytes that moved: `size` rounded to whole elements and blocks (see the module docs).
    pub bytes: usize,
    /// Shards per node.
    pub shards: usize,
    /// The transport.
    pub transport: Transport,
    /// The algorithm rank 0 used (`Communicator::last_algorithm`), `None` when no call ran.
    pub algorithm: Option<Algorithm>,
    /// Per rank, in rank order: latencies of the timed calls (ns), their count, their time.
    pub per_rank: Vec<Figures>,
}

/// `T(n) = α + β·n` through two allreduce measurements (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    /// Ranks.
    pub ranks: usize,
    /// The transport.
    pub transport: Transport,
    /// The two sizes (bytes) the line goes through.
    pub from: (usize, usize),
    /// Per call, microseconds.
    pub alpha_us: f64,
    /// Per byte, nanoseconds.
    pub beta_ns_per_byte: f64,
}

/// What one rank hands back: its rank and, per planned (collective, size), its figures and
/// algorithm.
type RankOut = (usize, Vec<(Figures, Option<Algorithm>)>);

impl Collective {
    /// Every collective benchmark, in the order `--test` lists them.
    pub const ALL: [Collective; 6] = [
        Collective::Barrier,
        Collective::Bcast,
        Collective::Allreduce,
        Collective::Allgather,
        Collective::ReduceScatter,
        Collective::Alltoall,
    ];

    /// The name on the command line and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Collective::Barrier => "barrier",
            Collective::Bcast => "bcast",
            Collective::Allreduce => "allreduce",
            Collective::Allgather => "allgather",
            Collective::ReduceScatter => "reduce-scatter",
            Collective::Alltoall => "alltoall",
        }
    }

    /// The collective named `s`.
    pub fn parse(s: &str) -> Option<Collective> {
        Collective::ALL.into_iter().find(|t| t.name() == s)
    }

    /// Sizes run when `--size` is not given: 8 B to 16 MiB by factors of 16 (barrier: none).
    pub fn default_sizes(self) -> &'static [usize] {
        match self {
            Collective::Barrier => &[0],
            _ => &[8, 128, 2 << 10, 32 << 10, 512 << 10, 8 << 20, 16 << 20],
        }
    }

    /// Timed calls when neither `--iters` nor `--duration` is given: 512 MiB of buffers,
    /// between 20 and 10 000 calls (cut further to [`DEFAULT_MAX_TIME`]).
    pub fn default_iters(self, bytes: usize) -> u64 {
        ((512u64 << 20) / bytes.max(1) as u64).clamp(20, 10_000)
    }

    /// Bus bandwidth factor for `p` ranks (NCCL's convention; 0 for barrier).
    pub fn bus_factor(self, p: usize) -> f64 {
        let p = p.max(1) as f64;
        match self {
            Collective::Barrier => 0.0,
            Collective::Bcast => 1.0,
            Collective::Allreduce => 2.0 * (p - 1.0) / p,
            Collective::Allgather | Collective::ReduceScatter | Collective::Alltoall => {
                (p - 1.0) / p
            }
        }
    }

    /// What the elements are, for the table heading.
    fn elements(self) -> &'static str {
        match self {
            Collective::Barrier => "no data",
            Collective::Allreduce | Collective::ReduceScatter => "f32 sum",
            Collective::Bcast | Collective::Allgather | Collective::Alltoall => "bytes",
        }
    }

    /// Element size in bytes.
    fn elem(self) -> usize {
        match self {
            Collective::Allreduce | Collective::ReduceScatter => 4,
            _ => 1,
        }
    }

    /// Whether `size` is cut into one block per rank.
    fn blocked(self) -> bool {
        matches!(
            self,
            Collective::Allgather | Collective::ReduceScatter | Collective::Alltoall
        )
    }

    /// The bytes that move for `size` over `p` ranks (see the module docs).
    pub fn bytes(self, size: usize, p: usize) -> usize {
        let e = self.elem();
        match self {
            Collective::Barrier => 0,
            _ if self.blocked() => (size / e / p).max(1) * e * p,
            _ => (size / e).max(1) * e,
        }
    }
}

impl CollMeasurement {
    /// Ranks of the world.
    pub fn ranks(&self) -> usize {
        self.per_rank.len()
    }

    /// The slowest rank's latency at quantile `q`, µs, and that rank.
    pub fn slowest_us(&self, q: f64) -> (f64, usize) {
        self.per_rank
            .iter()
            .enumerate()
            .map(|(r, f)| (f.quantile_us(q), r))
            .fold((0.0, 0), |a, b| if b.0 > a.0 { b } else { a })
    }

    /// The fastest rank's p50, µs.
    pub fn fastest_p50_us(&self) -> f64 {
        self.per_rank
            .iter()
            .map(|f| f.quantile_us(0.5))
            .fold(f64::INFINITY, f64::min)
    }

    /// Timed calls per rank (the same on every rank).
    pub fn iters(&self) -> u64 {
        self.per_rank.first().map_or(0, Figures::iters)
    }

    /// `bytes / p50` (slowest rank), GB/s (10^9 bytes per second).
    pub fn algbw_gb_s(&self) -> f64 {
        let us = self.slowest_us(0.5).0;
        if us > 0.0 {
            self.bytes as f64 / us / 1e3
        } else {
            0.0
        }
    }

    /// Bus bandwidth, GB/s: [`CollMeasurement::algbw_gb_s`] × the collective's factor.
    pub fn busbw_gb_s(&self) -> f64 {
        self.algbw_gb_s() * self.test.bus_factor(self.ranks())
    }

    /// The algorithm's name (`-` when none ran).
    pub fn algorithm_name(&self) -> String {
        self.algorithm
            .map_or_else(|| "-".into(), |a| format!("{a:?}"))
    }
}

impl CostModel {
    /// The fit as [`Costs`] for [`Tuning::with_costs`]: fails when it is out of range (a
    /// negative `α` or `β`: the two sizes too close, or the runs too noisy to fit a line).
    pub fn costs(&self) -> Result<Costs, CostsError> {
        Costs::new(self.alpha_us, self.beta_ns_per_byte)
    }

    /// `α / β`, bytes: the size at which the per-byte term equals the per-call one.
    pub fn half_size(&self) -> f64 {
        if self.beta_ns_per_byte > 0.0 {
            self.alpha_us * 1e3 / self.beta_ns_per_byte
        } else {
            f64::INFINITY
        }
    }
}

/// Runs the planned collectives on two nodes of `cfg.shards` shards in this process and
/// returns one [`CollMeasurement`] per (collective, size).
pub fn run(cfg: &CollectiveConfig) -> Result<Vec<CollMeasurement>, BenchError> {
    if cfg.shards == 0 {
        return Err(BenchError::Config("--shards: at least 1".into()));
    }
    let p = NODES * cfg.shards;
    let mut plan = Vec::new();
    for &test in &cfg.tests {
        let sizes: Vec<usize> = match (&cfg.sizes, test) {
            (_, Collective::Barrier) => vec![0],
            (Some(s), _) => s.clone(),
            (None, t) => t.default_sizes().to_vec(),
        };
        for size in sizes {
            // Allgather's result and alltoall's buffers are `size`; messages are cut in parts,
            // so the only limit is memory: 1 GiB of buffers per rank.
            if test.bytes(size, p) > 1 << 30 {
                return Err(BenchError::Config(format!(
                    "--size {}: {test} buffers over 1 GiB per rank",
                    format_size(size)
                )));
            }
            plan.push((test, size));
        }
    }
    if plan.is_empty() {
        return Ok(Vec::new());
    }
    let io_memory = match cfg.io_memory {
        Some(b) => b,
        None => ShardsBuilder::new()
            .shard_count(p)
            .io_memory_for(shardcx_shards::memlock_limit())
            .map_err(crate::Error::from)?,
    };
    let addr: Arc<OnceLock<SocketAddr>> = Arc::default();
    let failed = Arc::new(AtomicBool::new(false));
    let shared = Arc::new((cfg.clone(), plan.clone()));
    let (tx, rx) = mpsc::channel();
    let threads: Vec<_> = (0..NODES)
        .map(|i| {
            let (shared, addr, failed, tx) =
                (shared.clone(), addr.clone(), failed.clone(), tx.clone());
            std::thread::Builder::new()
                .name(format!("bench-node-{i}"))
                .spawn(move || {
                    let cfg = &shared.0;
                    let mut b = Node::builder()
                        .shards(cfg.shards)
                        .placement(Placement::Unpinned)
                        .node_id(NODE_IDS[i])
                        .psk(&cfg.psk)
                        .net(net_config(cfg.transport))
                        .default_deadline(DEADLINE)
                        .io_memory(io_memory);
                    if let Some(tls) = cfg.transport.tls() {
                        b = b.transports(tls);
                    }
                    if i == 0 {
                        // Port 0 picks a free one; node 1 reads it from `addr`.
                        b = b.listen(SocketAddr::from(([127, 0, 0, 1], 0)));
                    }
                    let started = {
                        let (addr, failed) = (addr.clone(), failed.clone());
                        b.run(move |node: Node| {
                            let (shared, addr, failed) =
                                (shared.clone(), addr.clone(), failed.clone());
                            async move {
                                let (cfg, plan) = &*shared;
                                if let Some(cores) = cfg.cores.as_ref().map(|c| &c[i]) {
                                    if !cores.is_empty() {
                                        pin_current(cores[node.shard().index() % cores.len()]);
                                    }
                                }
                                let r = rank_main(node, cfg, plan, &addr, &failed).await;
                                if r.is_err() {
                                    failed.store(true, Ordering::Release);
                                }
                                r
                            }
                        })
                    };
                    if started.is_err() {
                        // Node 1 waits for node 0's address: it must not wait for nothing.
                        failed.store(true, Ordering::Release);
                    }
                    let _ = tx.send(started);
                })
        })
        .collect::<Result<_, _>>()
        .map_err(|e| BenchError::Io {
            what: "cannot start a node thread".into(),
            source: e,
        })?;
    drop(tx);
    let mut ranks: Vec<RankOut> = Vec::new();
    let mut first_err: Option<BenchError> = None;
    let mut note = |e: BenchError| {
        // The rank that failed first explains the others (which were aborted by it).
        let aborted = matches!(
            e,
            BenchError::Collective(CollectiveError::Aborted { .. })
                | BenchError::Collective(CollectiveError::Revoked { .. })
        );
        match &first_err {
            None => first_err = Some(e),
            Some(BenchError::Collective(
                CollectiveError::Aborted { .. } | CollectiveError::Revoked { .. },
            )) if !aborted => first_err = Some(e),
            Some(_) => {}
        }
    };
    for out in rx {
        match out {
            Ok(per_shard) => {
                for r in per_shard {
                    match r {
                        Ok(v) => ranks.push(v),
                        Err(e) => note(e),
                    }
                }
            }
            Err(e) => note(BenchError::Node(e)),
        }
    }
    for t in threads {
        if t.join().is_err() {
            note(BenchError::Protocol("a bench node thread panicked".into()));
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    ranks.sort_by_key(|(r, _)| *r);
    if ranks.len() != p {
        return Err(BenchError::Protocol(format!(
            "{} of {p} ranks reported",
            ranks.len()
        )));
    }
    let mut out = Vec::with_capacity(plan.len());
    for (k, &(test, size)) in plan.iter().enumerate() {
        let mut per_rank = Vec::with_capacity(p);
        let mut algorithm = None;
        for (r, sizes) in &ranks {
            let (f, a) = sizes
                .get(k)
                .cloned()
                .ok_or_else(|| BenchError::Protocol(format!("rank {r} skipped a test")))?;
            if *r == 0 {
                algorithm = a;
            }
            per_rank.push(f);
        }
        out.push(CollMeasurement {
            test,
            size,
            bytes: test.bytes(size, p),
            shards: cfg.shards,
            transport: cfg.transport,
            algorithm,
            per_rank,
        });
    }
    Ok(out)
}

/// One rank: connect (node 1's shard 0 connects to node 0), make the world, run the plan.
async fn rank_main(
    node: Node,
    cfg: &CollectiveConfig,
    plan: &[(Collective, usize)],
    addr: &OnceLock<SocketAddr>,
    failed: &AtomicBool,
) -> Result<RankOut, BenchError> {
    if let Some(a) = node.listen_addr() {
        let _ = addr.set(a);
    } else if node.shard().index() == 0 {
        let t0 = Instant::now();
        let a = loop {
            if let Some(a) = addr.get() {
                break *a;
            }
            if failed.load(Ordering::Acquire) || t0.elapsed() > DEADLINE {
                return Err(BenchError::Protocol(
                    "node 0 did not start listening".into(),
                ));
            }
            sleep(Duration::from_millis(2)).await;
        };
        node.connect_within(a, DEADLINE).await?;
    }
    let mut world = Communicator::world(&node, &NODE_IDS, DEADLINE).await?;
    world.set_tuning(cfg.tuning);
    let (r, p) = (world.rank(), world.size());
    let mut out = Vec::with_capacity(plan.len());
    for &(test, size) in plan {
        let progress = Progress::new(
            cfg.progress && r == 0,
            format!(
                "{test} {} B, {p} ranks, {}",
                format_size(test.bytes(size, p)),
                cfg.transport
            ),
        );
        let f = one(&mut world, cfg, test, size, &progress).await;
        progress.done();
        out.push(f?);
    }
    // Nobody leaves while another rank may still need its messages.
    world.barrier(DEADLINE).await?;
    Ok((r, out))
}

/// The buffers of one (collective, size) on one rank, made before the clock starts.
enum Buffers {
    None,
    Bytes(Vec<u8>),
    Floats(Vec<f32>),
}

/// One (collective, size) on one rank: warm-up, the agreed count of timed calls, a check of
/// the last result. Returns the figures and the algorithm of the timed calls.
async fn one(
    world: &mut Communicator,
    cfg: &CollectiveConfig,
    test: Collective,
    size: usize,
    progress: &Progress,
) -> Result<(Figures, Option<Algorithm>), BenchError> {
    let (r, p) = (world.rank(), world.size());
    let bytes = test.bytes(size, p);
    let mut bufs = buffers(test, bytes, r, p);
    let default_count = test.default_iters(bytes);
    let calibrate = !matches!(cfg.budget, Some(Budget::Iters(_)));
    // A tenth of the count (at most 1000); with `--duration`, of the default count, so that a
    // 16 MiB warm-up is not 1000 calls.
    let warmup = cfg
        .warmup
        .unwrap_or_else(|| match cfg.budget {
            Some(b @ Budget::Iters(_)) => b.default_warmup(),
            _ => Budget::Iters(default_count).default_warmup(),
        })
        .max(u64::from(calibrate));
    world.barrier(DEADLINE).await?;
    // The cost of a call, for `--duration` and the default time cap: the second half of the
    // warm-up only (the first calls of a world or a size are many times slower: an 8-byte
    // count sized from the whole warm-up came out 20x short).
    let half = warmup / 2;
    let mut t = Instant::now();
    let mut last = Buffers::None;
    for k in 0..warmup {
        if k == half {
            t = Instant::now();
        }
        last = call(world, test, &mut bufs).await?;
    }
    let per_call = t.elapsed() / u32::try_from((warmup - half).max(1)).unwrap_or(u32::MAX);
    // Every rank makes the same number of calls. A count alone (`--iters`) needs no more; a
    // time limit is checked by rank 0 every `batch` calls, about a fiftieth of the limit at the
    // warm-up's pace, and its verdict broadcast (untimed), so that the run ends on every rank
    // at the same call whatever the pace of each.
    let (limit_calls, limit_time) = match cfg.budget {
        Some(Budget::Iters(n)) => (n, None),
        Some(Budget::Duration(d)) => (u64::MAX, Some(d)),
        None => (default_count, Some(DEFAULT_MAX_TIME)),
    };
    let mut batch = [match limit_time {
        Some(d) => {
            let n = (d / 50).as_nanos() / per_call.as_nanos().max(1);
            u64::try_from(n).unwrap_or(u64::MAX).clamp(1, limit_calls)
        }
        None => limit_calls,
    }];
    world.broadcast(0, &mut batch, DEADLINE).await?;
    let budget = match limit_time {
        Some(d) if limit_calls == u64::MAX => Budget::Duration(d),
        _ => Budget::Iters(limit_calls),
    };
    world.barrier(DEADLINE).await?;
    let mut f = Figures::new(bytes);
    let mut algorithm;
    let t0 = Instant::now();
    loop {
        for _ in 0..batch[0].min(limit_calls - f.msgs) {
            let s = Instant::now();
            last = call(world, test, &mut bufs).await?;
            record(&mut f, s.elapsed());
            f.msgs += 1;
            progress.tick(budget, f.msgs, t0);
        }
        // Before the broadcast below makes it the communicator's last operation.
        algorithm = world.last_algorithm();
        let Some(d) = limit_time.filter(|_| f.msgs < limit_calls) else {
            break;
        };
        // Only rank 0's clock counts.
        let mut stop = [u8::from(t0.elapsed() >= d)];
        world.broadcast(0, &mut stop, DEADLINE).await?;
        if stop[0] != 0 {
            break;
        }
    }
    f.elapsed = t0.elapsed();
    check(test, &bufs, &last, r, p).map_err(BenchError::Protocol)?;
    Ok((f, algorithm))
}

/// Rank `r`'s input: `bytes` of it (see [`check`] for the values).
fn buffers(test: Collective, bytes: usize, r: usize, p: usize) -> Buffers {
    match test {
        Collective::Barrier => Buffers::None,
        Collective::Bcast => Buffers::Bytes(if r == 0 {
            pattern(bytes, 0x42)
        } else {
            vec![0; bytes]
        }),
        Collective::Allreduce => {
            Buffers::Floats((0..bytes / 4).map(|i| float_value(r, i)).collect())
        }
        Collective::ReduceScatter => {
            let blk = bytes / 4 / p;
            Buffers::Floats((0..p * blk).map(|i| float_value(r, i / blk)).collect())
        }
        Collective::Allgather => Buffers::Bytes(pattern(bytes / p, seed(r, 0))),
        Collective::Alltoall => {
            let blk = bytes / p;
            Buffers::Bytes((0..p).flat_map(|j| pattern(blk, seed(r, j))).collect())
        }
    }
}

/// Rank `r`'s `f32` at index `i` (small integers: sums are exact).
fn float_value(r: usize, i: usize) -> f32 {
    ((r + 1) + i % 7) as f32
}

/// The pattern seed of rank `r`'s block for rank `j`.
fn seed(r: usize, j: usize) -> u8 {
    (r * 16 + j) as u8
}

/// One call of `test`; returns what it produced (bcast fills its buffer in place).
async fn call(
    world: &mut Communicator,
    test: Collective,
    bufs: &mut Buffers,
) -> Result<Buffers, CollectiveError> {
    Ok(match (test, bufs) {
        (Collective::Barrier, _) => {
            world.barrier(DEADLINE).await?;
            Buffers::None
        }
        (Collective::Bcast, Buffers::Bytes(b)) => {
            world.broadcast(0, b, DEADLINE).await?;
            Buffers::None
        }
        (Collective::Allreduce, Buffers::Floats(v)) => {
            Buffers::Floats(world.all_reduce(v, &Sum, DEADLINE).await?)
        }
        (Collective::ReduceScatter, Buffers::Floats(v)) => {
            Buffers::Floats(world.reduce_scatter(v, &Sum, DEADLINE).await?)
        }
        (Collective::Allgather, Buffers::Bytes(b)) => {
            Buffers::Bytes(world.all_gather(b, DEADLINE).await?)
        }
        (Collective::Alltoall, Buffers::Bytes(b)) => {
            Buffers::Bytes(world.all_to_all(b, DEADLINE).await?)
        }
        // `buffers` makes the kind each collective takes.
        _ => Buffers::None,
    })
}

/// Checks the last call's result on rank `r` of `p`.
fn check(
    test: Collective,
    input: &Buffers,
    last: &Buffers,
    r: usize,
    p: usize,
) -> Result<(), String> {
    let bad = |what: String| Err(format!("{test} on rank {r}: {what}"));
    match (test, input, last) {
        (Collective::Barrier, _, _) => Ok(()),
        (Collective::Bcast, Buffers::Bytes(b), _) => {
            if *b == pattern(b.len(), 0x42) {
                Ok(())
            } else {
                bad("the buffer is not rank 0's".into())
            }
        }
        (Collective::Allreduce, _, Buffers::Floats(v)) => {
            let ranks: usize = (1..=p).sum();
            match (0..v.len()).find(|&i| v[i] != (ranks + p * (i % 7)) as f32) {
                None => Ok(()),
                Some(i) => bad(format!("element {i} is {}", v[i])),
            }
        }
        (Collective::ReduceScatter, _, Buffers::Floats(v)) => {
            let want = ((1..=p).sum::<usize>() + p * (r % 7)) as f32;
            match v.iter().position(|&x| x != want) {
                None => Ok(()),
                Some(i) => bad(format!("element {i} is {}, not {want}", v[i])),
            }
        }
        (Collective::Allgather, Buffers::Bytes(mine), Buffers::Bytes(all)) => {
            let blk = mine.len();
            match (0..p)
                .find(|&j| all.get(j * blk..(j + 1) * blk) != Some(&pattern(blk, seed(j, 0))[..]))
            {
                None => Ok(()),
                Some(j) => bad(format!("block {j} is not rank {j}'s")),
            }
        }
        (Collective::Alltoall, Buffers::Bytes(mine), Buffers::Bytes(got)) => {
            let blk = mine.len() / p;
            match (0..p)
                .find(|&j| got.get(j * blk..(j + 1) * blk) != Some(&pattern(blk, seed(j, r))[..]))
            {
                None => Ok(()),
                Some(j) => bad(format!("block {j} is not rank {j}'s block for rank {r}")),
            }
        }
        _ => bad("no result".into()),
    }
}

/// The allreduce cost models of `results`: one per (ranks, transport) measured at two sizes or
/// more, through the smallest and the largest.
pub fn cost_model(results: &[CollMeasurement]) -> Vec<CostModel> {
    let mut out: Vec<CostModel> = Vec::new();
    for m in results.iter().filter(|m| m.test == Collective::Allreduce) {
        let (ranks, transport) = (m.ranks(), m.transport);
        if out
            .iter()
            .any(|c| c.ranks == ranks && c.transport == transport)
        {
            continue;
        }
        let group: Vec<&CollMeasurement> = results
            .iter()
            .filter(|o| {
                o.test == Collective::Allreduce && o.ranks() == ranks && o.transport == transport
            })
            .collect();
        let (Some(lo), Some(hi)) = (
            group.iter().min_by_key(|m| m.bytes),
            group.iter().max_by_key(|m| m.bytes),
        ) else {
            continue;
        };
        if hi.bytes == lo.bytes {
            continue;
        }
        let (t0, t1) = (lo.slowest_us(0.5).0, hi.slowest_us(0.5).0);
        let beta_us = (t1 - t0) / (hi.bytes - lo.bytes) as f64;
        out.push(CostModel {
            ranks,
            transport,
            from: (lo.bytes, hi.bytes),
            alpha_us: t0 - beta_us * lo.bytes as f64,
            beta_ns_per_byte: beta_us * 1e3,
        });
    }
    out
}

/// The results as tables, one per collective, in the order they first appear; after
/// allreduce's, its cost model.
pub fn table(results: &[CollMeasurement]) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let mut tests: Vec<Collective> = Vec::new();
    for m in results {
        if !tests.contains(&m.test) {
            tests.push(m.test);
        }
    }
    for test in tests {
        let _ = writeln!(
            out,
            "\n{test}: {} nodes in this process, {}; latency per call in µs, the slowest \
             rank's percentiles; bus bandwidth GB/s (NCCL convention)",
            NODES,
            test.elements()
        );
        let _ = writeln!(
            out,
            "{:>6} {:>9} {:<5} {:>5} {:<18} {:>7} {:>9} {:>9} {:>9} {:>9} {:>9}",
            "size",
            "bytes",
            "tls",
            "ranks",
            "algorithm",
            "iters",
            "p50",
            "p99",
            "p50 min",
            "algbw",
            "busbw"
        );
        for m in results.iter().filter(|m| m.test == test) {
            let bw = |v: f64| {
                if test == Collective::Barrier {
                    "-".to_string()
                } else {
                    format!("{v:.3}")
                }
            };
            let _ = writeln!(
                out,
                "{:>6} {:>9} {:<5} {:>5} {:<18} {:>7} {:>9.2} {:>9.2} {:>9.2} {:>9} {:>9}",
                format_size(m.size),
                m.bytes,
                m.transport.name(),
                format!("{}x{}", NODES, m.shards),
                m.algorithm_name(),
                m.iters(),
                m.slowest_us(0.5).0,
                m.slowest_us(0.99).0,
                m.fastest_p50_us(),
                bw(m.algbw_gb_s()),
                bw(m.busbw_gb_s())
            );
        }
        if test == Collective::Allreduce {
            for c in cost_model(results) {
                let _ = writeln!(
                    out,
                    "allreduce cost model, {} ranks ({}): T(n) = α + β·n through the slowest \
                     rank's p50 at {} and {} bytes: α = {:.2} µs, β = {:.4} ns/B ({:.2} GB/s), \
                     n½ = α/β = {:.0} B (--save-costs FILE keeps them for \
                     Tuning::with_costs)",
                    c.ranks,
                    c.transport,
                    c.from.0,
                    c.from.1,
                    c.alpha_us,
                    c.beta_ns_per_byte,
                    if c.beta_ns_per_byte > 0.0 {
                        1.0 / c.beta_ns_per_byte
                    } else {
                        f64::INFINITY
                    },
                    c.half_size(),
                );
            }
        }
    }
    out
}

/// The results as JSON objects (schema in [`crate::bench`]).
pub fn json_objects(results: &[CollMeasurement]) -> Vec<String> {
    let num = |v: f64| {
        if v.is_finite() {
            format!("{v:.4}")
        } else {
            "null".into()
        }
    };
    results
        .iter()
        .map(|m| {
            let per_rank: Vec<String> = m
                .per_rank
                .iter()
                .enumerate()
                .map(|(r, f)| {
                    format!(
                        "{{\"rank\": {r}, \"iters\": {}, \"p50_us\": {}, \"p99_us\": {}, \
                         \"p999_us\": {}, \"max_us\": {}}}",
                        f.iters(),
                        num(f.quantile_us(0.5)),
                        num(f.quantile_us(0.99)),
                        num(f.quantile_us(0.999)),
                        num(f.max_us())
                    )
                })
                .collect();
            format!(
                "  {{\"test\": \"{}\", \"size\": {}, \"bytes\": {}, \"nodes\": {NODES}, \
                 \"shards\": {}, \"ranks\": {}, \"transport\": \"{}\", \"algorithm\": \"{}\", \
                 \"iters\": {}, \"p50_us\": {}, \"p99_us\": {}, \"algbw_gb_s\": {}, \
                 \"busbw_gb_s\": {}, \"per_rank\": [{}]}}",
                m.test.name(),
                m.size,
                m.bytes,
                m.shards,
                m.ranks(),
                m.transport.name(),
                m.algorithm_name(),
                m.iters(),
                num(m.slowest_us(0.5).0),
                num(m.slowest_us(0.99).0),
                num(m.algbw_gb_s()),
                num(m.busbw_gb_s()),
                per_rank.join(", ")
            )
        })
        .collect()
}

impl std::fmt::Display for Collective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;

    #[test]
    fn names_sizes_and_factors() {
        for t in Collective::ALL {
            assert_eq!(Collective::parse(t.name()), Some(t));
        }
        assert_eq!(Collective::parse("all-reduce"), None);
        // Whole elements and blocks, at least one of each.
        assert_eq!(Collective::Allreduce.bytes(8, 4), 8);
        assert_eq!(Collective::Allreduce.bytes(2, 4), 4);
        assert_eq!(Collective::ReduceScatter.bytes(8, 4), 16);
        assert_eq!(Collective::Allgather.bytes(8, 4), 8);
        assert_eq!(Collective::Alltoall.bytes(10, 4), 8);
        assert_eq!(Collective::Barrier.bytes(1 << 20, 4), 0);
        assert_eq!(Collective::Allreduce.bus_factor(2), 1.0);
        assert_eq!(Collective::Allgather.bus_factor(4), 0.75);
        assert_eq!(Collective::Bcast.bus_factor(4), 1.0);
    }

    #[test]
    fn cost_model_goes_through_the_ends() {
        let m = |bytes: usize, us: u64| {
            let mut f = Figures::new(bytes);
            for _ in 0..10 {
                f.hist.record(us * 1000).unwrap();
            }
            CollMeasurement {
                test: Collective::Allreduce,
                size: bytes,
                bytes,
                shards: 1,
                transport: Transport::Shm,
                algorithm: None,
                per_rank: vec![f.clone(), f],
            }
        };
        let (lo, hi) = (m(8, 2), m(1 << 20, 200));
        // The histogram's 3 significant digits: the line goes through what it reports.
        let (t0, t1) = (lo.slowest_us(0.5).0, hi.slowest_us(0.5).0);
        assert!(
            (t0 - 2.0).abs() < 0.01 && (t1 - 200.0).abs() < 0.2,
            "{t0} {t1}"
        );
        let c = cost_model(&[lo, hi, m(1000, 3)]);
        assert_eq!(c.len(), 1);
        let c = c[0];
        assert_eq!(c.from, (8, 1 << 20));
        let beta_us = (t1 - t0) / ((1 << 20) - 8) as f64;
        assert!((c.beta_ns_per_byte - beta_us * 1e3).abs() < 1e-9);
        assert!((c.alpha_us - (t0 - beta_us * 8.0)).abs() < 1e-9);
        assert!((c.half_size() - c.alpha_us * 1e3 / c.beta_ns_per_byte).abs() < 1e-6);
        assert!(cost_model(&[m(8, 2)]).is_empty());
    }
}
