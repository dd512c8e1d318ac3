//! The per-core benchmark suite behind `shardcx bench`, `shardcx node` and `cargo bench`.
//!
//! A benchmark run has two sides. The **server** ([`server::serve`], `shardcx node`) is one node
//! of `M` shards, shard `j` pinned to the `j`-th server CPU. The **client** ([`client::run`],
//! `shardcx bench`) is one node of `N` pinned shards; every client shard runs the same test at
//! the same time, each on its own rail to the server, and the figures are reported per shard
//! and merged. `shardcx bench` starts the server itself (a local peer process with as many
//! shards as the largest client) unless `--connect` names a running `shardcx node`.
//!
//! ## Rails: one connection per client shard
//!
//! Connections are shard-addressed rails (see `shardcx_shards::net`, "Rails"): between a node
//! of `N` shards and one of `M`, client shard `i` has a rail of its own to server shard
//! `i mod M`, one UCX endpoint in each direction between the two shards' own workers. Client
//! shard `i` sends every test's messages to server shard `i mod M`
//! ([`crate::Peer::shard`], which is its default rail), the server's handlers answer inline on
//! the rail the message came in on ([`crate::AmMsg::reply`]), and the answer's handler runs on
//! client shard `i` itself: no cross-shard hop on either side, so `--shards N` measures `N`
//! independent shards. With `M < N` (a `--connect`ed node with fewer shards) several client
//! shards share a server shard, each still on its own rail.
//!
//! The table's `route` column says what each shard measured, from its cross-shard mesh
//! counters ([`shardcx_shards::ShardCtx::mesh_stats`]) read when the measured part starts and
//! when it ends, not from where the rails should be: `rail` when nothing crossed the shard's
//! mesh lanes in between, `hop` when something did (the shard forwarded work to another shard
//! or served another shard's forward; the `hop` test always does).
//!
//! ## Tests
//!
//! | test | what one iteration is | latency columns |
//! | --- | --- | --- |
//! | `am-lat` | an active message of `size` bytes to the peer, echoed back with the same size | round trip |
//! | `am-rate` | one-way active messages, `window` in flight: the last of each window asks for an acknowledgement | one window (send `window` messages, get the ack) |
//! | `am-bw` | as `am-rate`, for large sizes (window capped to 8 MiB in flight, the server shard's default pool) | one window |
//! | `tag-lat` | tag send of `size` bytes, the peer's tag receive sends it back | round trip |
//! | `rpc-lat` | a typed call ([`RpcEcho`]): a `Vec<u8>` of `size` bytes, answered with the same bytes | round trip |
//! | `rpc-lat-inline` | as `rpc-lat`, the reply answered into a [`crate::rpc::Caller`]'s handler, which checks it and makes the next call (no task woken per call, as `am-lat`'s client) | round trip |
//! | `rpc-rate` | `window` typed calls ([`RpcSink`]) in flight together, each answered with the length it got | one window (start `window` calls, get every reply) |
//! | `rpc-rate-inline` | `window` [`RpcSink`] calls in flight, the window sliding: each reply's handler ([`crate::rpc::Caller`]) makes the next call | `window` replies in a row |
//! | `rpc-notify` | as `am-rate`, with RPC: `window - 1` one-way calls ([`RpcSink`], [`crate::rpc::Rpc::notify`]), then one answered call | one window |
//! | `put-bw` | a checked-mode put of `size` bytes, `window` in flight | one put (its completion) |
//! | `get-bw` | a checked-mode get of `size` bytes, `window` in flight | one get |
//! | `put-trusted-bw` | a trusted-mode put ([`crate::Peer::put_trusted`], native UCX RMA) of `size` bytes, `window` in flight | one put (remotely complete) |
//! | `hop` | forward an empty job to the next client shard and await it (needs 2 shards or more) | one hop |
//!
//! The collectives (`barrier`, `bcast`, `allreduce`, `allgather`, `reduce-scatter`, `alltoall`)
//! are not client/server tests: [`collective::run`] makes a world of two nodes of `--shards`
//! shards each in the benchmark's own process and times every call on every rank (see
//! [`collective`] for the topology, sizes, bus bandwidth and the allreduce cost model). They
//! run only when `--test` names them.
//!
//! The messaging loops are as lean as `ucx_perftest`'s. `am-lat` is a ping-pong driven by the
//! handlers: the server's echo handler answers inline on the progress driver
//! ([`crate::AmMsg::reply`], no task), and the client's answer handler records the round trip
//! in the shard's histogram and sends the next ping inline ([`crate::Peer::am_send_now`]) until
//! the iterations are done; only then is the test task woken. Each answer's length is checked,
//! and its content every [`CONTENT_CHECK_EVERY`] answers. `am-rate` and `am-bw` send each
//! window from the test task with [`crate::Peer::am_send_now`] in a tight loop; the server's
//! sink handler acknowledges the last message of each window inline. A lost answer fails the
//! run within the operation deadline (a watchdog per shard), it never hangs.
//!
//! `put-bw`/`get-bw` measure checked mode (put/get carried as messages and checked by the
//! target's shard). `put-trusted-bw` measures trusted mode: native UCX RMA into a region the
//! server shard mapped ([`crate::Node::register_trusted_region`]), each put flushed (remotely
//! complete) before it counts. Trusted mode needs [`crate::NodeBuilder::trusted_rma`] on both
//! nodes (`shardcx bench` turns it on for both when the test is planned; a `shardcx node` needs
//! `--trusted-rma`) and shared memory (or RDMA) between them: over `tcp` the test is skipped
//! (UCX 1.12 only emulates RMA over tcp, and shardcx refuses it).
//!
//! `rpc-lat` and `rpc-rate` measure the RPC layer ([`crate::rpc`]) against the AM tests it is
//! built on: the server's handlers are plain ones ([`crate::NodeBuilder::rpc`]), run inline on
//! the receiving shard with the argument read in place, so no task is spawned per call; the
//! client reads the reply's archive in place ([`crate::rpc::Rpc::call_archived_within`]) and
//! checks its length. Every `rpc-rate` call is answered (two messages per call, where `am-rate`
//! sends one message per iteration and one acknowledgement per window); a window is `window`
//! calls started together, and the next window starts when all of them have their reply.
//! `rpc-notify` sends what `am-rate` sends (one-way messages, one answer per window) through the
//! RPC layer: compare it with `am-rate` for the layer's cost per message, and `rpc-rate` for
//! what answered calls cost. `rpc-lat-inline` and `rpc-rate-inline` make the same calls through
//! a [`crate::rpc::Caller`]: each reply goes to a handler run on the progress driver, which
//! checks it and makes the next call, as `am-lat`'s client does; the awaited tests pay a task
//! wake-up per reply on top (about half a microsecond on these VMs).
//!
//! Latencies are **round trips**, in microseconds, from hdrhistogram (3 significant digits),
//! recorded after the warm-up. ucx_perftest's latency tests print half a round trip;
//! `scripts/compare-perftest` and `--vs-perftest` double them. `msgs/s` counts the iterations' messages over the
//! measured time: one per iteration (a call counts as one, its reply included), `window` per
//! window for the windowed tests (`am-rate`, `am-bw`, `rpc-rate`, `rpc-notify`). `MB/s` is
//! `msgs/s × size / 10^6` (one direction). The merged row adds the shards' histograms and counts,
//! over the longest shard's time.
//!
//! ## Device memory
//!
//! `--memory cuda` ([`Memory::Cuda`]) runs `am-lat`, `am-bw`, `rpc-lat`, `put-bw` and `get-bw`
//! with the client's buffers in CUDA device memory, on each client shard's own device (the
//! other tests are skipped, saying so). What is sent comes from a [`crate::DeviceBuffer`], and
//! what comes back lands in one, inside the measured time: `am-lat` sends each ping with
//! [`crate::Peer::am_send_device`] and lands each echo with [`crate::Node::copy_to_device`]
//! (driven by the test task, since the copies are awaited); `am-bw` sends every message with
//! `am_send_device`; `rpc-lat` stages its argument with [`crate::Node::copy_from_device`] and
//! lands the reply; `put-bw` stages what it puts, `get-bw` lands what it got. Every device
//! copy is staged through the shard's pinned bounce buffers, whatever the shard's CUDA mode
//! (the zero-copy path is not built yet), and a shard's staged copies take turns (see
//! `client::device`). The server answers from host memory as for `--memory host`: the frames on
//! the wire are the same. Each test checks at its end that its device buffers hold what they
//! should. A client whose CUDA mode is off fails the run with [`BenchError::CudaOff`], which
//! says why (`--memory cuda: CUDA is off on this node: libcuda not found ...`).
//!
//! ## Transports
//!
//! `shm` runs UCX with `sm,tcp` (tcp is needed for listening and connecting by address in UCX
//! 1.12; UCX moves the data over shared memory between processes on one host when it picks
//! it), `tcp` with `tcp` alone, `auto` with UCX's own choice (`UCX_TLS` or every transport).
//!
//! ## Placement
//!
//! Client shard `i` is pinned to the `i`-th CPU of the client core list, server shard `j` to the
//! `j`-th of the server list (both modulo the list's length). With two CPUs or more the default
//! puts the server on the last CPU and the client on the others first (`taskset` on each side
//! of ucx_perftest); `--cores CLIENT/SERVER` overrides (`--cores 0/1`, `--cores 0,1/1`). When
//! both sides end up on a single core the run says loudly that its latencies mean nothing.
//!
//! ## JSON
//!
//! `--json FILE` writes one array; each element is one (test, size, shards, transport):
//!
//! ```text
//! {
//!   "test": "am-lat",        // test name, as above (am-lat, am-rate, am-bw, tag-lat,
//!                            // rpc-lat, rpc-rate, rpc-notify, put-bw, get-bw,
//!                            // put-trusted-bw, hop)
//!   "size": 8,               // bytes per message (0 for hop)
//!   "shards": 2,             // client shards
//!   "transport": "shm",      // shm | tcp | auto
//!   "memory": "host",        // host | cuda: where the client's buffers were (--memory)
//!   "cuda_mode": "staging",  // only with "memory": "cuda": the client shards' CUDA mode
//!                            // (staging | zero-copy; device data is staged in both today)
//!   "iters": 40000,          // latency samples, all shards: iterations, or windows for
//!                            // am-rate/am-bw/rpc-rate/rpc-notify (where --iters counts
//!                            // messages or calls)
//!   "p50_us": 4.1,           // merged histogram, microseconds (round trip or per window, see above)
//!   "p99_us": 6.3,
//!   "p999_us": 11.2,
//!   "max_us": 80.5,
//!   "msgs_per_s": 480000.0,  // all shards (calls per second for the rpc tests)
//!   "mb_per_s": 3.84,        // all shards, 10^6 bytes per second
//!   "per_shard": [           // one object per client shard, same fields, plus:
//!     {"shard": 0, "route": "rail", "iters": 20000, "p50_us": 4.0, ...}
//!   ]                        // "route": "rail" (nothing crossed the shard's mesh lanes while
//!                            // it measured) or "hop" (something did); see "Rails" above
//! }
//! ```
//!
//! A collective's element ([`collective::json_objects`]) has its own fields:
//!
//! ```text
//! {
//!   "test": "allreduce",     // barrier, bcast, allreduce, allgather, reduce-scatter, alltoall
//!   "size": 8,               // the size asked for (0 for barrier)
//!   "bytes": 8,              // what moved: size in whole elements and blocks
//!   "nodes": 2, "shards": 1, // shards per node
//!   "ranks": 2,
//!   "transport": "shm",
//!   "algorithm": "RecursiveDoubling",  // rank 0's Communicator::last_algorithm
//!   "iters": 20000,          // timed calls per rank
//!   "p50_us": 2.6,           // the slowest rank's p50 and p99 of its calls, microseconds
//!   "p99_us": 3.4,
//!   "algbw_gb_s": 0.003,     // bytes / p50, 10^9 bytes per second
//!   "busbw_gb_s": 0.003,     // algbw x the NCCL factor (allreduce 2(p-1)/p, ...)
//!   "per_rank": [{"rank": 0, "iters": 20000, "p50_us": 2.6, "p99_us": 3.4,
//!                 "p999_us": 9.1, "max_us": 40.2}, ...]
//! }
//! ```
//!
//! With `--vs-perftest`, an element whose test has a `ucx_perftest` counterpart (`am-lat`,
//! `am-rate`, `am-bw`, `tag-lat`, `put-bw`; see [`perftest`]) also has, after `per_shard`:
//!
//! ```text
//!   "perftest": {
//!     "test": "ucp_am_lat",    // perftest's test (-t)
//!     "iters": 40000,          // its iterations (-n): client shard 0's measured messages
//!     "metric": "p50_us",      // what is compared: p50_us (am-lat, tag-lat), msgs_per_s
//!                              // (am-rate) or mb_per_s (am-bw, put-bw)
//!     "p50_us": 3.9,           // latency tests: perftest's median, doubled (a round trip)
//!     "msgs_per_s": 510000.0,  // the others: perftest's overall message rate and
//!     "mb_per_s": 4.08,        // bandwidth (its MiB/s in 10^6 bytes per second)
//!     "ratio": 1.05,           // client shard 0's figure / perftest's, on "metric"
//!                              // (client shard 0 and perftest's client are pinned alike)
//!     "error": "..."           // instead of the figures and ratio: why perftest has none
//!                              // (it failed or timed out)
//!   }
//! ```
//!
//! The other fields are the same with or without it.
//!
//! A skipped combination (e.g. `hop` with one shard, `put-trusted-bw` over tcp) is not in the
//! file; the table says why.
//!
//! ## Plots and progress
//!
//! `--plot FILE` draws latency and bandwidth against size as SVG or PNG ([`plot`]).
//! A test that runs longer than a second shows a progress bar on stderr when it is a terminal
//! (`--quiet` turns it off); it costs the measuring loops a counter test per iteration.

pub mod client;
pub mod collective;
pub mod perftest;
pub mod plot;
pub mod report;
pub mod server;

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use hdrhistogram::Histogram;
use shardcx_shards::proto::{AmId, ShardId};

/// The pre-shared key of benchmark nodes started without `--psk-file`.
pub const DEFAULT_PSK: &[u8] = b"shardcx bench default pre-shared key";

/// Active message: echo the header and payload back ([`ECHO_REPLY`]).
pub const ECHO: AmId = AmId::new(0x5343_0003);
/// Active message: the echo of an [`ECHO`].
pub const ECHO_REPLY: AmId = AmId::new(0x5343_0004);
/// Active message: one-way; acknowledged ([`ACK`]) when its header asks for it.
pub const SINK: AmId = AmId::new(0x5343_0005);
/// Active message: the acknowledgement of a [`SINK`] window.
pub const ACK: AmId = AmId::new(0x5343_0006);
/// Active message: start answering tag pings of one stream (see [`client`]).
pub const TAG_START: AmId = AmId::new(0x5343_0007);
/// Active message: make sure a region of at least the header's size exists on this shard (a
/// trusted-mode one when the header's flags have [`FLAG_TRUSTED`]).
pub const REGION: AmId = AmId::new(0x5343_0008);
/// Active message: the answer to [`REGION`]: one status byte (0: the region's descriptor
/// follows; 1: why there is none follows, as UTF-8).
pub const REGION_REPLY: AmId = AmId::new(0x5343_0009);

/// `am-lat` checks the content of every this-many answers (their length, every time).
pub const CONTENT_CHECK_EVERY: u64 = 64;

crate::rpc_function!(
    /// RPC of `rpc-lat`: the argument's bytes, echoed back.
    pub RpcEcho: Vec<u8> => Vec<u8>, id = 0x5343_0101, name = "shardcx.bench.echo"
);
crate::rpc_function!(
    /// RPC of `rpc-rate` and `rpc-notify`: answers the argument's length.
    pub RpcSink: Vec<u8> => u64, id = 0x5343_0102, name = "shardcx.bench.sink"
);

/// Largest message the benchmark nodes send or accept (16 MiB payloads plus headers).
pub const MAX_MESSAGE: u64 = 17 << 20;

/// Why a benchmark could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    /// A node could not start, or an operation failed.
    #[error(transparent)]
    Node(#[from] crate::Error),
    /// A remote call failed.
    #[error(transparent)]
    Rpc(#[from] crate::rpc::RpcError),
    /// A collective of the collective benchmarks failed (on the rank that failed first).
    #[error(transparent)]
    Collective(#[from] crate::collective::CollectiveError),
    /// The other side answered something unexpected, or nothing in time.
    #[error("{0}")]
    Protocol(String),
    /// The server node went away (its heartbeats stopped, it closed, or its endpoint failed)
    /// while the benchmark waited on it.
    #[error("the server node {node} is gone: {reason}")]
    PeerGone {
        /// The server node.
        node: shardcx_shards::proto::NodeId,
        /// How its connection ended.
        reason: shardcx_shards::NetError,
    },
    /// Bad settings.
    #[error("{0}")]
    Config(String),
    /// `--memory cuda` on a client node whose CUDA mode is off (no driver, no device, or
    /// `SHARDCX_CUDA=off`).
    #[error("--memory cuda: CUDA is off on this node: {reason}")]
    CudaOff {
        /// Why, as the shard's probe says it ([`crate::cuda::CudaProbe::off_reason`]).
        reason: String,
    },
    /// Starting or talking to the local peer process failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        source: std::io::Error,
    },
}

/// One benchmark of the suite (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Test {
    /// Active-message ping-pong.
    AmLat,
    /// One-way active messages with a window.
    AmRate,
    /// One-way large active messages with a window.
    AmBw,
    /// Tag send/recv ping-pong.
    TagLat,
    /// Typed RPC round trips, one call at a time.
    RpcLat,
    /// As `RpcLat`, each reply answered into a [`crate::rpc::Caller`]'s handler, which makes
    /// the next call (no task woken per call, as `AmLat`'s client).
    RpcLatInline,
    /// Typed RPCs with a window of calls in flight.
    RpcRate,
    /// Typed RPCs with a sliding window of calls in flight, each reply's handler making the
    /// next call ([`crate::rpc::Caller`]).
    RpcRateInline,
    /// One-way typed RPCs with a window, the last one answered (as `AmRate`).
    RpcNotify,
    /// Checked-mode puts with a window.
    PutBw,
    /// Checked-mode gets with a window.
    GetBw,
    /// Trusted-mode (native RMA) puts with a window.
    PutTrustedBw,
    /// Cross-shard forwarding within the client node.
    Hop,
}

/// A UCX transport choice (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Transport {
    /// Shared memory for data (`sm,tcp`).
    Shm,
    /// TCP only.
    Tcp,
    /// UCX's choice.
    Auto,
}

/// Where the client's buffers live (`--memory`; see the module docs, "Device memory").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Memory {
    /// Host memory (the default).
    #[default]
    Host,
    /// CUDA device memory on the client: sends from a [`crate::DeviceBuffer`], received
    /// payloads landed in one.
    Cuda,
}

/// How long each test runs on each shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Budget {
    /// This many measured iterations.
    Iters(u64),
    /// Measured iterations until this much time has passed.
    Duration(Duration),
}

impl Budget {
    /// Iterations before measuring when `--warmup` is not given: a tenth of the measured
    /// iterations, at most 1000 (1000 for a budget of time).
    pub fn default_warmup(self) -> u64 {
        match self {
            Budget::Iters(n) => (n / 10).min(1000),
            Budget::Duration(_) => 1000,
        }
    }
}

/// The figures of one shard, or of all shards merged, for one test and size.
#[derive(Debug, Clone)]
pub struct Figures {
    /// Latencies in nanoseconds (round trip or per window, see the module docs).
    pub hist: Histogram<u64>,
    /// Messages counted for the rate.
    pub msgs: u64,
    /// Measured time (for a merged row, the longest shard's).
    pub elapsed: Duration,
    /// Bytes per message.
    pub size: usize,
}

/// Whether a client shard's test crossed shards, as measured (see the module docs, "Rails").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Nothing crossed the shard's mesh lanes while it measured: it used its own rail only.
    Rail,
    /// Something did: the shard forwarded work to another shard, or served another's forward.
    Hop,
}

/// One client shard's figures.
#[derive(Debug, Clone)]
pub struct ShardFigures {
    /// The client shard.
    pub shard: ShardId,
    /// Whether it crossed shards while it measured.
    pub route: Route,
    /// Its figures.
    pub figures: Figures,
}

/// The result of one (test, size, shard count, transport).
#[derive(Debug, Clone)]
pub struct Measurement {
    /// The test.
    pub test: Test,
    /// Bytes per message (0 for `hop`).
    pub size: usize,
    /// Client shards.
    pub shards: usize,
    /// The transport.
    pub transport: Transport,
    /// Per client shard, in shard order (empty when skipped).
    pub per_shard: Vec<ShardFigures>,
    /// Where the client's buffers were.
    pub memory: Memory,
    /// The client shards' CUDA mode, with [`Memory::Cuda`] (`None` with host memory).
    pub cuda_mode: Option<crate::cuda::CudaMode>,
    /// Why the combination was skipped, if it was.
    pub skipped: Option<String>,
    /// What `ucx_perftest` measured for the same (test, size, transport) (`--vs-perftest`,
    /// tests with a counterpart only).
    pub perftest: Option<perftest::Perftest>,
}

impl Test {
    /// Every test, in the order the suite runs them.
    pub const ALL: [Test; 13] = [
        Test::AmLat,
        Test::AmRate,
        Test::AmBw,
        Test::TagLat,
        Test::RpcLat,
        Test::RpcLatInline,
        Test::RpcRate,
        Test::RpcRateInline,
        Test::RpcNotify,
        Test::PutBw,
        Test::GetBw,
        Test::PutTrustedBw,
        Test::Hop,
    ];

    /// The test's name on the command line and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Test::AmLat => "am-lat",
            Test::AmRate => "am-rate",
            Test::AmBw => "am-bw",
            Test::TagLat => "tag-lat",
            Test::RpcLat => "rpc-lat",
            Test::RpcLatInline => "rpc-lat-inline",
            Test::RpcRate => "rpc-rate",
            Test::RpcRateInline => "rpc-rate-inline",
            Test::RpcNotify => "rpc-notify",
            Test::PutBw => "put-bw",
            Test::GetBw => "get-bw",
            Test::PutTrustedBw => "put-trusted-bw",
            Test::Hop => "hop",
        }
    }

    /// The test named `s`.
    pub fn parse(s: &str) -> Option<Test> {
        Test::ALL.into_iter().find(|t| t.name() == s)
    }

    /// Message sizes run when `--size` is not given.
    pub fn default_sizes(self) -> &'static [usize] {
        match self {
            Test::AmLat | Test::RpcLat | Test::RpcLatInline => &[8, 4096],
            Test::AmRate | Test::RpcRate | Test::RpcRateInline | Test::RpcNotify => &[64],
            Test::AmBw => &[64 << 10, 1 << 20, 16 << 20],
            Test::TagLat => &[8],
            Test::PutBw | Test::GetBw | Test::PutTrustedBw => &[4096, 1 << 20],
            Test::Hop => &[0],
        }
    }

    /// Measured iterations when neither `--iters` nor `--duration` is given: enough for stable
    /// percentiles, small enough that the default suite stays well under a minute on 2 cores.
    pub fn default_iters(self, size: usize) -> u64 {
        let by_bytes = |budget: u64, lo: u64, hi: u64| (budget / size.max(1) as u64).clamp(lo, hi);
        match self {
            Test::AmLat | Test::TagLat | Test::RpcLat | Test::RpcLatInline => {
                by_bytes(64 << 20, 200, 10_000)
            }
            // Messages or calls (not windows).
            Test::AmRate | Test::RpcRate | Test::RpcRateInline | Test::RpcNotify => 100_000,
            Test::AmBw => by_bytes(256 << 20, 16, 100_000),
            Test::PutBw | Test::GetBw | Test::PutTrustedBw => by_bytes(64 << 20, 64, 10_000),
            Test::Hop => 10_000,
        }
    }

    /// What one latency sample is, for table headings.
    pub fn sample(self) -> &'static str {
        match self {
            Test::AmLat | Test::TagLat | Test::RpcLat | Test::RpcLatInline => "round trip",
            Test::AmRate | Test::AmBw | Test::RpcRate | Test::RpcNotify => "per window",
            Test::RpcRateInline => "per window's worth of replies",
            Test::PutBw | Test::GetBw | Test::PutTrustedBw => "per operation, window in flight",
            Test::Hop => "per hop",
        }
    }
}

impl fmt::Display for Test {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Transport {
    /// The transport's name on the command line and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Transport::Shm => "shm",
            Transport::Tcp => "tcp",
            Transport::Auto => "auto",
        }
    }

    /// The transport named `s`.
    pub fn parse(s: &str) -> Option<Transport> {
        [Transport::Shm, Transport::Tcp, Transport::Auto]
            .into_iter()
            .find(|t| t.name() == s)
    }

    /// The UCX transport list (`None`: UCX's choice).
    pub fn tls(self) -> Option<&'static str> {
        match self {
            Transport::Shm => Some("sm,tcp"),
            Transport::Tcp => Some("tcp"),
            Transport::Auto => None,
        }
    }
}

impl fmt::Display for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Memory {
    /// The tests that run with [`Memory::Cuda`]; the others are skipped, saying so.
    pub const CUDA_TESTS: [Test; 5] = [
        Test::AmLat,
        Test::AmBw,
        Test::RpcLat,
        Test::PutBw,
        Test::GetBw,
    ];

    /// The memory's name on the command line and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Memory::Host => "host",
            Memory::Cuda => "cuda",
        }
    }

    /// The memory named `s`.
    pub fn parse(s: &str) -> Option<Memory> {
        [Memory::Host, Memory::Cuda]
            .into_iter()
            .find(|m| m.name() == s)
    }

    /// Whether `test` runs with this memory.
    pub fn runs(self, test: Test) -> bool {
        match self {
            Memory::Host => true,
            Memory::Cuda => Self::CUDA_TESTS.contains(&test),
        }
    }
}

impl fmt::Display for Memory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Figures {
    /// Empty figures for messages of `size` bytes.
    pub fn new(size: usize) -> Self {
        Self {
            hist: new_histogram(),
            msgs: 0,
            elapsed: Duration::ZERO,
            size,
        }
    }

    /// Latency at quantile `q`, in microseconds.
    pub fn quantile_us(&self, q: f64) -> f64 {
        self.hist.value_at_quantile(q) as f64 / 1000.0
    }

    /// Largest latency, in microseconds.
    pub fn max_us(&self) -> f64 {
        self.hist.max() as f64 / 1000.0
    }

    /// Messages per second.
    pub fn msgs_per_s(&self) -> f64 {
        let s = self.elapsed.as_secs_f64();
        if s > 0.0 {
            self.msgs as f64 / s
        } else {
            0.0
        }
    }

    /// Megabytes (10^6 bytes) per second, one direction.
    pub fn mb_per_s(&self) -> f64 {
        self.msgs_per_s() * self.size as f64 / 1e6
    }

    /// The latency samples: measured iterations, or windows for the windowed tests.
    pub fn iters(&self) -> u64 {
        self.hist.len()
    }
}

impl Route {
    /// The route's name in tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Route::Rail => "rail",
            Route::Hop => "hop",
        }
    }
}

impl Measurement {
    /// Every shard's figures merged (histograms added, counts summed, the longest time).
    pub fn merged(&self) -> Figures {
        let mut all = Figures::new(self.size);
        for s in &self.per_shard {
            // Same bounds and precision on both sides: adding cannot fail.
            let _ = all.hist.add(&s.figures.hist);
            all.msgs += s.figures.msgs;
            all.elapsed = all.elapsed.max(s.figures.elapsed);
        }
        all
    }
}

/// A histogram of nanoseconds from 1 ns to 100 s, 3 significant digits.
pub fn new_histogram() -> Histogram<u64> {
    // Valid bounds (low >= 1, high >= 2 * low, sigfig <= 5): cannot fail.
    Histogram::new_with_bounds(1, 100_000_000_000, 3).expect("valid histogram bounds")
}

/// Parses a size: `8`, `4k`, `64KiB`, `1m`, `16MiB` (powers of two).
pub fn parse_size(s: &str) -> Option<usize> {
    let t = s.trim();
    let lower = t.to_ascii_lowercase();
    let (digits, shift) = if let Some(d) = lower
        .strip_suffix("kib")
        .or_else(|| lower.strip_suffix("kb"))
        .or_else(|| lower.strip_suffix('k'))
    {
        (d, 10)
    } else if let Some(d) = lower
        .strip_suffix("mib")
        .or_else(|| lower.strip_suffix("mb"))
        .or_else(|| lower.strip_suffix('m'))
    {
        (d, 20)
    } else {
        (lower.strip_suffix('b').unwrap_or(&lower), 0)
    };
    let n: usize = digits.trim().parse().ok()?;
    n.checked_mul(1usize << shift)
}

/// Formats a size the way [`parse_size`] reads it (`8`, `4K`, `16M`).
pub fn format_size(n: usize) -> String {
    if n >= 1 << 20 && n % (1 << 20) == 0 {
        format!("{}M", n >> 20)
    } else if n >= 1 << 10 && n % (1 << 10) == 0 {
        format!("{}K", n >> 10)
    } else {
        n.to_string()
    }
}

/// Runs a client against a bench server started in this process (the `cargo bench` programs):
/// starts [`server::serve`] with `serve` on a thread, runs [`client::run`] with
/// `client(server address)`, then stops the server and returns the client's result (an error
/// of the server's own, at shutdown, is reported on stderr).
pub fn run_in_process(
    serve: server::ServeConfig,
    client: impl FnOnce(SocketAddr) -> client::ClientConfig,
) -> Result<Vec<Measurement>, BenchError> {
    let stop = crate::Shutdown::new();
    let (tx, rx) = std::sync::mpsc::channel::<SocketAddr>();
    let server_stop = stop.clone();
    let server = std::thread::spawn(move || {
        server::serve(&serve, &server_stop, |s| {
            let _ = tx.send(s.addr);
        })
    });
    let joined = |server: std::thread::JoinHandle<Result<(), BenchError>>| {
        server
            .join()
            .unwrap_or_else(|_| Err(BenchError::Protocol("the bench server panicked".into())))
    };
    // `serve` sends the address once it listens, or returns (dropping the sender) when it fails.
    let Ok(addr) = rx.recv() else {
        return Err(joined(server).err().unwrap_or_else(|| {
            BenchError::Protocol("the bench server stopped before it listened".into())
        }));
    };
    let r = client::run(&client(addr));
    stop.trigger();
    if let Err(e) = joined(server) {
        eprintln!("bench server: {e}");
    }
    r
}

/// Header flag of a [`SINK`]: acknowledge it.
pub(crate) const FLAG_ACK: u8 = 1;
/// Header flag of a [`REGION`]: a trusted-mode region.
pub const FLAG_TRUSTED: u8 = 2;
/// Length of the header of every benchmark message.
pub(crate) const HEADER_LEN: usize = 11;

/// A benchmark message header: the client shard waiting for the answer, a sequence number (or
/// a size, for [`REGION`]) and flags.
pub(crate) fn header(origin: ShardId, seq: u64, flags: u8) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..2].copy_from_slice(&origin.get().to_le_bytes());
    h[2..10].copy_from_slice(&seq.to_le_bytes());
    h[10] = flags;
    h
}

/// The fields of a [`header`], or `None` when it is too short.
pub(crate) fn parse_header(h: &[u8]) -> Option<(ShardId, u64, u8)> {
    let origin = u16::from_le_bytes(h.get(..2)?.try_into().ok()?);
    let seq = u64::from_le_bytes(h.get(2..10)?.try_into().ok()?);
    Some((ShardId::new(origin), seq, *h.get(10)?))
}

/// Connection settings of benchmark nodes: room for 16 MiB messages.
///
/// Over shared memory, endpoints use UCX's error mode NONE: in UCX 1.12 the shared-memory
/// transports cannot detect a failed peer, so error mode PEER (the default whenever `tcp` is in
/// the list) makes UCX pick tcp for the node-to-node endpoints even between processes of one
/// host. Heartbeats still detect a dead peer.
pub(crate) fn net_config(transport: Transport) -> shardcx_shards::NetConfig {
    shardcx_shards::NetConfig {
        max_message_size: MAX_MESSAGE,
        rndv_timeout: Duration::from_secs(30),
        error_mode: match transport {
            Transport::Shm => Some(crate::ucx::ErrorMode::None),
            Transport::Tcp | Transport::Auto => None,
        },
        ..Default::default()
    }
}

/// Pins the calling thread to CPU `cpu`; false when the CPU cannot be used.
pub(crate) fn pin_current(cpu: usize) -> bool {
    core_affinity::set_for_current(core_affinity::CoreId { id: cpu })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_and_print() {
        for (s, n) in [
            ("8", 8),
            ("4k", 4096),
            ("64KiB", 65536),
            ("1m", 1 << 20),
            ("16MiB", 16 << 20),
            ("10b", 10),
        ] {
            assert_eq!(parse_size(s), Some(n), "{s}");
            assert_eq!(parse_size(&format_size(n)), Some(n));
        }
        for bad in ["", "x", "-1", "1g", "k"] {
            assert_eq!(parse_size(bad), None, "{bad}");
        }
        assert_eq!(parse_size("99999999999999999999m"), None);
    }

    #[test]
    fn names_round_trip() {
        for t in Test::ALL {
            assert_eq!(Test::parse(t.name()), Some(t));
        }
        assert_eq!(Transport::parse("shm"), Some(Transport::Shm));
        assert_eq!(Transport::parse("rdma"), None);
        for m in [Memory::Host, Memory::Cuda] {
            assert_eq!(Memory::parse(m.name()), Some(m));
        }
        assert_eq!(Memory::parse("gpu"), None);
        assert!(Test::ALL.into_iter().all(|t| Memory::Host.runs(t)));
        assert!(Memory::Cuda.runs(Test::GetBw) && !Memory::Cuda.runs(Test::TagLat));
    }
}
