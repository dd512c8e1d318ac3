//! Booting shards: one glommio executor per shard, each building its own [`ShardCtx`].
//!
//! ## Extensions: per-shard state of subsystems
//!
//! A subsystem that keeps state per shard (tag matching, the checked region table, the
//! trusted-mode endpoint cache, the facade's per-shard node state) keeps it in the shard's
//! *extension slot*, a small map from a type to one `Rc` of it: [`ShardCtx::ext`] finds the
//! value of a type, [`ShardCtx::ext_or_insert_with`] makes it on first use. The key is the
//! value's [`TypeId`], so a module that keeps its state type private keeps the state private
//! too: no other module can name it, let alone reach it.
//!
//! Invariants:
//!
//! - **State lives and dies with its shard.** The slot is a field of the [`ShardCtx`], not a
//!   thread-local: nothing can outlive the shard in it, nothing can be found by another run
//!   that happens to use the same thread, and no value needs to remember which shard it
//!   belongs to.
//! - **Torn down at shard shutdown, in a defined order.** When the shard stops, once its
//!   connections are closed, its mesh lanes are closed and its progress driver has stopped
//!   (so no handler or forwarded job can run any more), and before its UCX worker, pool and
//!   context are destroyed, the slot drops its values **in the reverse order of their
//!   insertion**: state made later, which may use state made earlier, goes first. From then
//!   on the slot is closed: [`ShardCtx::ext`] finds nothing, and
//!   [`ShardCtx::ext_or_insert_with`] makes a value it does not keep. A value that a handler
//!   or a task still holds (an `Rc` clone) lives until that holder drops it, which is at the
//!   latest when the shard's [`ShardCtx`] is dropped.
//! - Lookups are cheap and never panic: a linear scan of a short vector (one entry per
//!   subsystem in use, a handful) comparing `TypeId`s, and one `Rc` clone. The slot is never
//!   borrowed while user code runs (the value's constructor or destructor), so either may
//!   use the slot itself. Hot paths that already hold a handle (a handler closure) keep an
//!   `Rc` of their state instead of looking it up per message.

use std::any::{Any, TypeId};
use std::cell::{Cell, RefCell};
use std::future::Future;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use glommio::{LocalExecutorBuilder, Placement as GPlacement};

use crate::cuda::{ModeRequest, ShardCuda};
use crate::driver::{self, Driver, DriverConfig, DriverStats};
use crate::error::BootError;
use crate::mesh::{self, MeshConfig, MeshEnds, MeshState};
use crate::net::{self, NetConfig, NetState, NodeSettings};
use crate::pool::{PoolNewError, ShardPool};
use crate::proto::ids::{Incarnation, NodeId, ShardId};
use crate::proto::shard_map::MAX_SHARDS;
use crate::proto::PreSharedKey;
use crate::ucx::{Config, Context, Features, Worker};

/// Locked memory left for everything but the executors' io memory (UCX, the rings).
pub const MEMLOCK_RESERVE: u64 = 1 << 20;
/// Least io memory an executor is given (glommio rounds anything smaller up to 64 KiB).
pub const MIN_IO_MEMORY: u64 = 64 << 10;
/// Most io memory an executor is given.
pub const MAX_IO_MEMORY: u64 = 2 << 20;

/// Where shard threads run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Placement {
    /// Shard `i` is pinned to CPU `i` (modulo the CPUs available).
    #[default]
    Pinned,
    /// Threads float: for oversubscribed machines and tests.
    Unpinned,
}

/// Builds and runs a set of shards. `Send`: it is a recipe, the shards are built inside their
/// threads.
#[derive(Debug, Clone)]
pub struct ShardsBuilder {
    shard_count: usize,
    placement: Placement,
    transports: Option<String>,
    features: Features,
    arena_len: usize,
    driver: DriverConfig,
    mesh: MeshConfig,
    io_memory: Option<u64>,
    node_id: Option<NodeId>,
    incarnation: Option<Incarnation>,
    psk: Option<Vec<u8>>,
    listen: Option<SocketAddr>,
    net: NetConfig,
    on_start: Option<StartHook>,
    // `None`: `SHARDCX_CUDA`, read by `run`.
    cuda: Option<ModeRequest>,
    // Resolved by `run` and shared by the shards of one run.
    settings: Option<NodeSettings>,
}

/// The executors' preempt timer: how long task queues may run before the executor looks at
/// I/O, timers and other threads' wake-ups again. glommio's default is 100 ms, lowered only
/// while a `Latency::Matters` queue is in its active list; the progress queue leaves that list
/// each time it runs, and glommio then recomputes the timer without it, so a shard busy with UCX
/// traffic saw other threads' wake-ups up to 100 ms late (with the mesh's former lanes,
/// `am_echo --shards 2`'s forwarding shard had a 100 ms max round trip in every run). Set for
/// every queue, it bounds that delay.
pub const PREEMPT_TIMER: Duration = Duration::from_millis(1);

/// How often a shard's executor is sent a signal while it has not yet run the shard's main
/// task (see [`start_nudger`]).
const START_NUDGE: Duration = Duration::from_millis(20);

/// Called on a shard's executor thread before glommio's `run` (so not from the maker closure of
/// glommio's `LocalExecutorBuilder::spawn`, which `run` itself calls on the main task's first
/// poll: too late): nudge the thread with a signal every [`START_NUDGE`] until the shard's main
/// task first runs.
///
/// glommio 0.9's `LocalExecutor::run` can park before it has run the task it was given: if its
/// preempt timer (1 ms here, [`PREEMPT_TIMER`]) fired before it looked at its task queues,
/// which a thread descheduled on a loaded machine sees, it runs nothing and parks in
/// `io_uring_enter` with no timer and no I/O registered. The shard's main task, which would
/// register both (and start the driver's watchdog), then never runs: a node that never
/// connected, seen in the reliability suite's busiest rows and caught by
/// `scripts/repro-park`. A signal ends that wait (`EINTR`, which glommio takes as a spurious
/// wake-up); see [`shardcx_ucx::Nudger`]. On a healthy start the main task runs within
/// microseconds and nothing is sent. A shard whose nudger cannot start (no thread) starts
/// without one.
fn start_nudger(shard: usize) -> Option<shardcx_ucx::Nudger> {
    match shardcx_ucx::Nudger::start(START_NUDGE, &format!("shardcx-nudge-{shard}")) {
        Ok(n) => Some(n),
        Err(e) => {
            tracing::warn!(error = %e, "no start-up nudger for this shard");
            None
        }
    }
}

/// `fut`, after ending `nudger`'s signals on its first poll.
async fn nudged_until_polled<T>(
    nudger: Option<shardcx_ucx::Nudger>,
    fut: impl Future<Output = T>,
) -> T {
    if let Some(n) = nudger {
        n.done();
        if n.sent() > 0 {
            tracing::debug!(
                signals = n.sent(),
                "the executor was nudged before it first ran the shard"
            );
        }
    }
    fut.await
}

/// Runs `fut` on executor `ex` (made on this thread with `LocalExecutorBuilder::make`, not
/// glommio's `spawn`), nudging the thread with a signal until `fut` is first polled: glommio
/// 0.9's `run` can park before it runs the task it was given (README, "Known problems and
/// pitfalls"; [`shardcx_ucx::Nudger`]). The nudger's thread is named `shardcx-nudge-{shard}`.
/// For every executor shardcx makes: the shards, and probes such as `shardcx info`'s.
pub fn run_nudged<T>(ex: glommio::LocalExecutor, shard: usize, fut: impl Future<Output = T>) -> T {
    let nudger = start_nudger(shard);
    ex.run(nudged_until_polled(nudger, fut))
}

/// The size of a shared-memory FIFO element (UCX's `MM_FIFO_ELEM_SIZE`, 128 by default) that
/// shards ask for, unless the environment sets [`MM_FIFO_ELEM_ENV`]. A message goes by UCX's
/// short path (copied into the element, no request) only when it fits one element; every
/// shardcx frame carries 64 bytes of headers (routing and frame header), so with 128-byte
/// elements only payloads up to 16 bytes did (an 8-byte RPC call did not), and with 256 payloads
/// up to about 150 bytes do. Both sides of a shared-memory connection must use the same size
/// (UCX writes the peer's FIFO with its own element size): set the variable on every node or on
/// none.
pub const MM_FIFO_ELEM_SIZE: &str = "256";
/// The environment variable that overrides [`MM_FIFO_ELEM_SIZE`].
pub const MM_FIFO_ELEM_ENV: &str = "UCX_MM_FIFO_ELEM_SIZE";

/// Non-blocking TCP connects for UCX's `tcp` transport (UCX's `TCP_CONN_NB`, `n` by default in
/// UCX 1.12 and later), unless the environment sets [`TCP_CONN_NB_ENV`]. With UCX's default, the
/// first message to a peer over `tcp` calls a blocking `connect(2)` on the shard's thread: a
/// lost SYN held the shard for a second or more (the kernel's SYN retransmission), with its
/// timers, heartbeats and deadlines (the reliability suite's R13 saw calls end 0.84 s past their
/// deadline, and a stall report "S in connect"). Non-blocking, UCX waits for the connect in its
/// event loop instead.
pub const TCP_CONN_NB: &str = "y";
/// The environment variable that overrides [`TCP_CONN_NB`].
pub const TCP_CONN_NB_ENV: &str = "UCX_TCP_CONN_NB";

/// A family of UCX transports as a `UCX_TLS` list names it: any of `names` selects it, and
/// leaving out any of `whole` (with `^`) leaves all of it out.
struct Family {
    names: &'static [&'static str],
    whole: &'static [&'static str],
}

/// UCX's `tcp` transport.
const TCP: Family = Family {
    names: &["tcp"],
    whole: &["tcp"],
};

/// UCX's shared-memory FIFO transports, and the aliases that stand for all of them.
const SHARED_MEMORY: Family = Family {
    names: &["sm", "shm", "mm", "posix", "sysv", "xpmem"],
    whole: &["sm", "shm", "mm"],
};

/// Whether UCX may open a transport of `family` with transport list `tls` (`UCX_TLS` syntax: a
/// comma-separated list of transports and aliases, `all`, a `\` before a name that is not to
/// be expanded as an alias, or a list to leave out when it starts with `^`; `None`: UCX's
/// default, all of them). A setting for a transport UCX does not open makes it warn that the
/// setting is invalid: [`TCP_CONN_NB`] and [`MM_FIFO_ELEM_SIZE`] are set only where this holds.
fn may_open(tls: Option<&str>, family: &Family) -> bool {
    let Some(tls) = tls else { return true };
    let tokens: Vec<&str> = tls
        .split(',')
        .map(|t| t.trim().trim_start_matches('\\'))
        .collect();
    if tokens.iter().any(|t| t.starts_with('^')) {
        // A list of transports to leave out.
        !tokens
            .iter()
            .any(|t| family.whole.contains(&t.trim_start_matches('^')))
    } else {
        tokens
            .iter()
            .any(|t| *t == "all" || family.names.contains(t))
    }
}

/// A hook run on every shard once its state is built (see [`ShardsBuilder::on_start`]).
#[derive(Clone)]
struct StartHook(Arc<StartFn>);

type StartFn = dyn Fn(&Rc<ShardCtx>) + Send + Sync;

impl std::fmt::Debug for StartHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StartHook")
    }
}

/// One shard's state, built inside its thread and never moved out of it (`!Send`, reached as
/// `Rc<ShardCtx>`).
pub struct ShardCtx {
    // First: dropped before the UCX handles below (see the module docs, "Extensions").
    ext: Extensions,
    id: ShardId,
    shard_count: usize,
    worker: Worker,
    pool: ShardPool,
    driver: Driver,
    stats: Rc<DriverStats>,
    mesh: Rc<MeshState>,
    net: Rc<NetState>,
    cuda: ShardCuda,
    // Dropped last: the worker and the pool's memory hold the context alive themselves, this
    // keeps it for `context()`.
    context: Context,
}

impl ShardsBuilder {
    /// One shard per available CPU, pinned, UCX settings from the environment, messaging
    /// features, a 1 MiB pool per shard, the default driver.
    pub fn new() -> Self {
        Self {
            shard_count: std::thread::available_parallelism().map_or(1, |n| n.get()),
            placement: Placement::Pinned,
            transports: None,
            features: Features::messaging(),
            arena_len: 1 << 20,
            driver: DriverConfig::default(),
            mesh: MeshConfig::default(),
            io_memory: None,
            node_id: None,
            incarnation: None,
            psk: None,
            listen: None,
            net: NetConfig::default(),
            on_start: None,
            cuda: None,
            settings: None,
        }
    }

    /// Run `hook` on every shard, inside its thread, once the shard's state is built and before
    /// it serves anything: before its mesh's inbox task starts (and the driver takes from the
    /// lanes), before shard 0 listens, before the user future. The place to register handlers
    /// (e.g. [`ShardCtx::set_net_handler`]) that must be there before the first frame can
    /// arrive. Replaces any previous hook.
    pub fn on_start<H>(mut self, hook: H) -> Self
    where
        H: Fn(&Rc<ShardCtx>) + Send + Sync + 'static,
    {
        self.on_start = Some(StartHook(Arc::new(hook)));
        self
    }

    /// The CUDA mode every shard asks for (see [`crate::cuda`]); by default `SHARDCX_CUDA`, or
    /// [`ModeRequest::Auto`] when it is unset.
    pub fn cuda(mut self, request: ModeRequest) -> Self {
        self.cuda = Some(request);
        self
    }

    /// Number of shards.
    pub fn shard_count(mut self, n: usize) -> Self {
        self.shard_count = n;
        self
    }

    /// Where shard threads run.
    pub fn placement(mut self, p: Placement) -> Self {
        self.placement = p;
        self
    }

    /// UCX transport list (`UCX_TLS`), e.g. `"sm,self"` or `"tcp"`.
    pub fn transports(mut self, tls: &str) -> Self {
        self.transports = Some(tls.to_owned());
        self
    }

    /// UCX features of every shard's context (wake-up is always added).
    pub fn features(mut self, f: Features) -> Self {
        self.features = f;
        self
    }

    /// Bytes of each shard's registered pool arena.
    pub fn arena_len(mut self, len: usize) -> Self {
        self.arena_len = len;
        self
    }

    /// The progress driver's settings.
    pub fn driver(mut self, cfg: DriverConfig) -> Self {
        self.driver = cfg;
        self
    }

    /// The cross-shard mesh's settings (lane capacity, nesting depth, drain timeout).
    pub fn mesh(mut self, cfg: MeshConfig) -> Self {
        self.mesh = cfg;
        self
    }

    /// Capacity of every cross-shard lane, and requests in flight per lane and nesting level
    /// (default [`mesh::DEFAULT_LANE_CAPACITY`]).
    pub fn lane_capacity(mut self, n: usize) -> Self {
        self.mesh.lane_capacity = n;
        self
    }

    /// Longest wait, once every shard's user future has ended, for the work in flight between
    /// shards to finish, and then again for each shard's pending requests to be answered,
    /// before the shards close their connections anyway (default
    /// [`mesh::DEFAULT_DRAIN_TIMEOUT`]).
    pub fn drain_timeout(mut self, d: Duration) -> Self {
        self.mesh.drain_timeout = d;
        self
    }

    /// io memory of each executor, in bytes, instead of the automatic sizing (which assumes one
    /// shard set per process): set it when several sets share a process, so that all of them
    /// fit `RLIMIT_MEMLOCK`.
    pub fn io_memory(mut self, bytes: u64) -> Self {
        self.io_memory = Some(bytes);
        self
    }

    /// This node's id (default: drawn from `/dev/urandom` by [`ShardsBuilder::run`]).
    pub fn node_id(mut self, id: NodeId) -> Self {
        self.node_id = Some(id);
        self
    }

    /// This run's incarnation (default: the start time in nanoseconds since the Unix epoch).
    pub fn incarnation(mut self, incarnation: Incarnation) -> Self {
        self.incarnation = Some(incarnation);
        self
    }

    /// The cluster's pre-shared key (at least 16 bytes). Without one the node neither connects
    /// nor accepts connections.
    pub fn psk(mut self, key: &[u8]) -> Self {
        self.psk = Some(key.to_vec());
        self
    }

    /// Listen for other nodes on `addr` (port 0 picks one; see [`ShardCtx::listen_addr`]).
    /// Needs the `tcp` transport and a pre-shared key.
    pub fn listen(mut self, addr: SocketAddr) -> Self {
        self.listen = Some(addr);
        self
    }

    /// Settings of connections between nodes (timeouts, heartbeats).
    pub fn net(mut self, cfg: NetConfig) -> Self {
        self.net = cfg;
        self
    }

    /// io memory per executor so that all shards fit `limit` bytes of locked memory.
    pub fn io_memory_for(&self, limit: u64) -> Result<u64, BootError> {
        let n = self.shard_count.max(1) as u64;
        let need = MIN_IO_MEMORY * n + MEMLOCK_RESERVE;
        if limit < need {
            return Err(BootError::MemlockTooSmall {
                limit,
                need,
                shard_count: self.shard_count,
            });
        }
        let per = ((limit - MEMLOCK_RESERVE) / n).min(MAX_IO_MEMORY);
        Ok(per & !4095)
    }

    /// Start the shards; each runs `f(ctx)` to completion, then stops its driver. Returns each
    /// shard's result, in shard order.
    pub fn run<F, Fut, T>(self, f: F) -> Result<Vec<T>, BootError>
    where
        F: Fn(Rc<ShardCtx>) -> Fut + Send + Clone + 'static,
        Fut: Future<Output = T> + 'static,
        T: Send + 'static,
    {
        if self.shard_count == 0 {
            return Err(BootError::Config("shard count must be at least 1"));
        }
        if self.shard_count > usize::from(MAX_SHARDS) {
            return Err(BootError::Config("too many shards"));
        }
        self.mesh.validate().map_err(BootError::Config)?;
        let io_memory = match self.io_memory {
            Some(bytes) => bytes,
            None => self.io_memory_for(memlock_limit())?,
        };
        let cuda = match self.cuda {
            Some(request) => request,
            None => {
                ModeRequest::from_env().map_err(|source| BootError::Cuda { shard: 0, source })?
            }
        };
        // One identity for every shard of this run.
        let recipe = Self {
            settings: Some(self.node_settings()?),
            cuda: Some(cuda),
            ..self
        };
        // A listen port that is taken fails the run here, before any shard starts: a shard 0
        // that failed to listen would leave the others serving without it. (glommio binds with
        // SO_REUSEPORT, which would let a second node share the port by mistake; a node racing
        // this one to the same port between this bind and shard 0's is not caught.)
        if let Some(addr) = recipe.listen.filter(|a| a.port() != 0) {
            check_listen_port(addr)?;
        }
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut handles = Vec::with_capacity(recipe.shard_count);
        // Made before any executor starts; a shard whose ends are dropped unconnected (its
        // executor failed to start) reads as gone to the others.
        let mut ends = mesh::lanes(recipe.shard_count, recipe.mesh.lane_capacity).into_iter();
        for (shard, ends) in (0..recipe.shard_count).zip(&mut ends) {
            let placement = match recipe.placement {
                Placement::Pinned => GPlacement::Fixed(shard % cpus),
                Placement::Unpinned => GPlacement::Unbound,
            };
            let me = recipe.clone();
            let f = f.clone();
            let builder = LocalExecutorBuilder::new(placement)
                .preempt_timer(PREEMPT_TIMER)
                .io_memory(io_memory as usize);
            // Not glommio's `spawn`: it calls the future's maker inside `run`, on the main
            // task's first poll, which is too late for the nudger (see `start_nudger`).
            let h = std::thread::Builder::new()
                .name(format!("shardcx-{shard}"))
                .spawn(move || {
                    let ex = builder.make().map_err(|e| BootError::Executor {
                        shard,
                        reason: e.to_string(),
                    })?;
                    // Every event on this shard's thread (all its tasks) carries `shard=N`.
                    let span = tracing::info_span!("shard", id = shard).entered();
                    run_nudged(ex, shard, async move {
                        let _span = span;
                        me.shard_main(shard, ends, f).await
                    })
                })
                .map_err(|e| BootError::Executor {
                    shard,
                    reason: e.to_string(),
                })?;
            handles.push(h);
        }
        let mut out = Vec::with_capacity(handles.len());
        let mut first_err = None;
        for (shard, h) in handles.into_iter().enumerate() {
            match h.join() {
                Ok(Ok(v)) => out.push(v),
                Ok(Err(e)) => {
                    first_err.get_or_insert(e);
                }
                Err(_panic) => {
                    first_err.get_or_insert(BootError::Panicked { shard });
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    fn node_settings(&self) -> Result<NodeSettings, BootError> {
        let node_id = match self.node_id {
            Some(id) => id,
            None => {
                let mut b = [0u8; 8];
                net::os_random(&mut b)
                    .map_err(|_| BootError::Config("cannot read /dev/urandom for a node id"))?;
                NodeId::new(u64::from_le_bytes(b))
            }
        };
        let incarnation = self.incarnation.unwrap_or_else(|| {
            let nanos = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(1, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
            Incarnation::new(nanos)
        });
        let psk =
            match &self.psk {
                Some(k) => Some(PreSharedKey::new(k).map_err(|_| {
                    BootError::Config("pre-shared key too short (16 bytes at least)")
                })?),
                None => None,
            };
        if self.listen.is_some() && psk.is_none() {
            return Err(BootError::Config("listening needs a pre-shared key"));
        }
        let error_mode = self
            .net
            .error_mode
            .unwrap_or_else(|| net::error_mode_for(self.transports.as_deref()));
        Ok(NodeSettings {
            node_id,
            incarnation,
            psk,
            listen: self.listen,
            listen_addr: Arc::new(OnceLock::new()),
            sessions: Arc::default(),
            bans: Arc::default(),
            error_mode,
            cfg: self.net.clone(),
        })
    }

    async fn shard_main<F, Fut, T>(self, shard: usize, ends: MeshEnds, f: F) -> Result<T, BootError>
    where
        F: Fn(Rc<ShardCtx>) -> Fut,
        Fut: Future<Output = T>,
    {
        // First, so that a shard that fails below leaves the mesh (its lanes close) instead of
        // hanging the others.
        let mesh = ends.connect(self.mesh);
        let _leave = mesh.leave_guard();
        let ucx = |source| BootError::Ucx { shard, source };
        let mut config = Config::from_env().map_err(ucx)?;
        if let Some(tls) = &self.transports {
            config.set("TLS", tls).map_err(ucx)?;
        }
        let tls = self
            .transports
            .clone()
            .or_else(|| std::env::var("UCX_TLS").ok());
        if std::env::var_os(MM_FIFO_ELEM_ENV).is_none() && may_open(tls.as_deref(), &SHARED_MEMORY)
        {
            // A UCX without the setting keeps its default: only slower, never wrong.
            let _ = config.set(&MM_FIFO_ELEM_ENV["UCX_".len()..], MM_FIFO_ELEM_SIZE);
        }
        if std::env::var_os(TCP_CONN_NB_ENV).is_none() && may_open(tls.as_deref(), &TCP) {
            // A UCX without the setting keeps its blocking connects.
            // UCX matches a cached transport setting against the tcp table's own field names, which
            // carry no `TCP_` prefix.
            let _ = config.set("CONN_NB", TCP_CONN_NB);
        }
        let mut features = self.features;
        features.wakeup = true;
        let context = Context::new(&config, features).map_err(ucx)?;
        // Before the worker: a shard that moves device memory has its CUDA context current on
        // its thread when UCX sets up its transports.
        let cuda = ShardCuda::start(&context, shard, self.cuda.unwrap_or_default())
            .map_err(|source| BootError::Cuda { shard, source })?;
        let worker = Worker::new(&context).map_err(ucx)?;
        let pool = ShardPool::new(&context, self.arena_len).map_err(|e| match e {
            PoolNewError::Ucx(source) => BootError::Ucx { shard, source },
            PoolNewError::Pool(source) => BootError::Pool { shard, source },
        })?;
        let stats = Rc::new(DriverStats::default());
        let (driver, task) = backstopped(Driver::start(&worker, shard, self.driver, stats.clone()))
            .await
            .map_err(|source| BootError::Driver { shard, source })?;
        // The driver runs in the default task queue, with the tasks its handlers wake (see
        // `driver::run`, "The hot path").
        let progress = glommio::spawn_local(driver::run(task));
        let id =
            ShardId::new(u16::try_from(shard).map_err(|_| BootError::Config("too many shards"))?);
        let settings = self
            .settings
            .clone()
            .ok_or(BootError::Config("node settings not resolved"))?;
        let net = Rc::new(NetState::new(settings, &worker).map_err(ucx)?);
        let ctx = Rc::new(ShardCtx {
            ext: Extensions::default(),
            id,
            shard_count: self.shard_count,
            worker,
            pool,
            driver,
            stats,
            mesh: mesh.clone(),
            net,
            cuda,
            context,
        });
        let installed = net::install(&ctx);
        if installed.is_ok() {
            if let Some(hook) = &self.on_start {
                (hook.0)(&ctx);
            }
        }
        // The mesh's lanes are taken by the driver on every round while it runs, and by the
        // mesh's inbox task while it sleeps (see `mesh` and `driver`).
        let mesh_tasks = mesh.start(&ctx);
        ctx.driver.set_poll_hook(mesh.poll_hook(&ctx));
        ctx.driver.set_dispatch_hook(net::dispatch_hook(&ctx));
        let started = match installed {
            Ok(()) => net::listen(&ctx).await,
            Err(e) => Err(e),
        };
        let out = match started {
            Ok(()) => Ok(f(ctx.clone()).await),
            Err(e) => Err(e),
        };
        // Keep serving the other shards until the whole set is quiescent (see `mesh`).
        mesh.user_finished();
        backstopped(async {
            mesh.drain().await;
            net::shutdown(&ctx, self.mesh.drain_timeout).await;
            mesh.close(mesh_tasks);
            // The driver's waker thread, whose watchdog ends a glommio park, exits once the
            // driver stops: a park from here to the end of this shard would be for good (seen
            // once in R8b, 2026-11-28: a one-shard node parked in `run` with no waker thread
            // and no nudger). Signals end it, as they do before the shard's first poll.
            let _nudger = start_nudger(shard);
            ctx.driver.stop();
            progress.await;
        })
        .await;
        // Nothing runs on this shard any more: its subsystems' state goes now, newest first,
        // while the UCX worker, pool and context it may use are still there.
        ctx.ext.teardown();
        drop(mesh);
        match Rc::try_unwrap(ctx) {
            Ok(ctx) => ctx.driver.join(),
            // The user kept the context alive: the waker thread exits on its own once the
            // driver's socket is closed, which already happened.
            Err(_still_shared) => {}
        }
        out
    }
}

/// A shard's extension slot (see the module docs, "Extensions"): one `Rc` per type, in
/// insertion order.
#[derive(Default)]
struct Extensions {
    entries: RefCell<Vec<(TypeId, Rc<dyn Any>)>>,
    /// Set by [`Extensions::teardown`]: nothing is kept from then on.
    closed: Cell<bool>,
}

/// Run `fut` with a glommio timer always registered, for the phases of a shard's life without
/// a running progress driver (start-up before it, shut-down after it). glommio 0.9 can park
/// the executor with a task runnable when its preempt timer fired before it looked at the task
/// queues (see [`driver`]'s module docs); it then wakes only for I/O or a timer. The driver keeps
/// a timer registered while it runs; without it, a park in these phases lasted for ever (a CI
/// run hung in `tests/mesh.rs` after the driver had stopped). With this, it lasts at most
/// [`driver::BACKSTOP`].
async fn backstopped<T>(fut: impl Future<Output = T>) -> T {
    futures_lite::future::or(fut, async {
        loop {
            glommio::timer::sleep(driver::BACKSTOP).await;
        }
    })
    .await
}

impl Extensions {
    fn get<T: 'static>(&self) -> Option<Rc<T>> {
        let id = TypeId::of::<T>();
        // Never borrowed mutably while other code runs (see `insert_with` and `teardown`).
        let entries = self.entries.borrow();
        let (_, any) = entries.iter().find(|(t, _)| *t == id)?;
        any.clone().downcast::<T>().ok()
    }

    fn get_or_insert_with<T: 'static>(&self, make: impl FnOnce() -> T) -> Rc<T> {
        if let Some(v) = self.get::<T>() {
            return v;
        }
        // Made with the slot unborrowed: `make` may use the slot itself.
        let v = Rc::new(make());
        if self.closed.get() {
            return v;
        }
        // `make` may have inserted a `T` itself: the first one stays, so that there is only
        // ever one per type.
        if let Some(first) = self.get::<T>() {
            return first;
        }
        let any: Rc<dyn Any> = v.clone();
        self.entries.borrow_mut().push((TypeId::of::<T>(), any));
        v
    }

    /// Drops every value, newest first, and closes the slot.
    fn teardown(&self) {
        self.closed.set(true);
        let mut entries = std::mem::take(&mut *self.entries.borrow_mut());
        // One at a time and with the slot unborrowed: a destructor may use the slot.
        while let Some(entry) = entries.pop() {
            drop(entry);
        }
    }
}

impl Drop for Extensions {
    fn drop(&mut self) {
        // The same order when the shard's context is dropped without a shutdown (a shard
        // that failed to start).
        self.teardown();
    }
}

impl Default for ShardsBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl ShardCtx {
    /// This shard's id.
    pub fn id(&self) -> ShardId {
        self.id
    }

    /// Number of shards in the set.
    pub fn shard_count(&self) -> usize {
        self.shard_count
    }

    /// This shard's UCX worker.
    pub fn worker(&self) -> &Worker {
        &self.worker
    }

    /// This shard's UCX context.
    pub fn context(&self) -> &Context {
        &self.context
    }

    /// This shard's CUDA mode and device (see [`crate::cuda`]).
    pub fn cuda(&self) -> &ShardCuda {
        &self.cuda
    }

    /// This shard's registered memory pool.
    pub fn pool(&self) -> &ShardPool {
        &self.pool
    }

    /// Wake the progress driver if it sleeps (call after starting an operation that needs
    /// progress before any network event can arrive).
    pub fn wake_driver(&self) {
        self.driver.wake();
    }

    /// As [`ShardCtx::wake_driver`], for an operation no application waits on (a heartbeat
    /// or its ack): the driver progresses it but starts no spin window for it, so that a shard
    /// with many idle connections sleeps between their heartbeats.
    pub(crate) fn nudge_driver(&self) {
        self.driver.nudge();
    }

    /// Progress rounds the driver has run.
    pub fn progress_rounds(&self) -> u64 {
        self.stats.rounds.get()
    }

    /// Whether the shard's progress driver is polling now: the caller runs on its behalf (a
    /// handler, inline or from the driver's dispatch; a send the mesh forwarded), not in a
    /// task of its own.
    pub(crate) fn driver_polling(&self) -> bool {
        self.stats.polling.get()
    }

    /// Times the driver went to sleep.
    pub fn driver_sleeps(&self) -> u64 {
        self.stats.sleeps.get()
    }

    /// Times the driver's watchdog found it not polled for a whole watch slice and woke it
    /// from the waker thread (see "The watchdog" in [`crate::driver`]): a park glommio did not
    /// end, the thread descheduled, or a task that kept the thread for longer without yielding.
    pub fn driver_watchdog_wakes(&self) -> u64 {
        self.stats
            .watchdog_wakes
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Stalls of this shard's driver of [`crate::stall::STALL_REPORT`] or longer, ended so
    /// far, and the longest in milliseconds (each is also logged; see [`crate::stall`]).
    pub fn driver_stalls(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        let s = &self.stats.stalls;
        (s.stalls.load(Relaxed), s.longest_ms.load(Relaxed))
    }

    /// This shard's value of type `T` in its extension slot, if there is one (see the module
    /// docs, "Extensions"). `None` after the shard's teardown.
    pub fn ext<T: 'static>(&self) -> Option<Rc<T>> {
        self.ext.get::<T>()
    }

    /// This shard's value of type `T` in its extension slot, made with `make` and kept there
    /// if there is none yet. One value per type: a later call returns the same `Rc` (`make`
    /// may itself use the slot; should it insert a `T`, that one is kept and returned). After
    /// the shard's teardown the value made is returned but not kept.
    pub fn ext_or_insert_with<T: 'static>(&self, make: impl FnOnce() -> T) -> Rc<T> {
        self.ext.get_or_insert_with(make)
    }

    pub(crate) fn mesh(&self) -> &Rc<MeshState> {
        &self.mesh
    }

    pub(crate) fn net(&self) -> &Rc<NetState> {
        &self.net
    }
}

/// Fails when `addr` cannot be listened on: another listener holds it, or the address is not
/// this host's or needs privileges.
///
/// A plain bind (std's, with `SO_REUSEADDR`) answers most of it, but it also fails on the
/// `TIME_WAIT` remnants of connections that an earlier listener of this port closed first (a
/// node that stopped a moment ago): they carry that listener's `SO_REUSEPORT` and not
/// `SO_REUSEADDR`, so they refuse std's bind for a minute while glommio's `SO_REUSEPORT` bind
/// succeeds. So a bind refused with `AddrInUse` fails the run only if a socket is *listening*
/// on the port (`/proc/net/tcp`, `tcp6`); remnants do not.
fn check_listen_port(addr: SocketAddr) -> Result<(), BootError> {
    let refused = |e: &dyn std::fmt::Display| BootError::Listen {
        shard: 0,
        reason: format!("cannot listen on {addr}: {e}"),
    };
    match std::net::TcpListener::bind(addr) {
        Ok(probe) => {
            drop(probe);
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && !listening_on(addr) => Ok(()),
        Err(e) => Err(refused(&e)),
    }
}

/// Whether a TCP socket of this host (any network namespace's view of it: this one's) is
/// listening on `addr`'s port at `addr` or at a wildcard address that covers it. Unreadable
/// tables count as a listener (the bind's refusal stands).
fn listening_on(addr: SocketAddr) -> bool {
    let tables = ["/proc/net/tcp", "/proc/net/tcp6"];
    let mut read_any = false;
    for table in tables {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        read_any = true;
        if text.lines().skip(1).any(|line| listens_at(line, addr)) {
            return true;
        }
    }
    !read_any
}

/// Whether one line of `/proc/net/tcp` or `tcp6` is a socket in `LISTEN` state (`0A`) on
/// `addr`'s port whose address is `addr`'s, or a wildcard, or `addr` is a wildcard.
fn listens_at(line: &str, addr: SocketAddr) -> bool {
    let mut fields = line.split_whitespace();
    let (Some(local), Some(_remote), Some(state)) = (fields.nth(1), fields.next(), fields.next())
    else {
        return false;
    };
    if state != "0A" {
        return false;
    }
    let Some((ip_hex, port_hex)) = local.split_once(':') else {
        return false;
    };
    if u16::from_str_radix(port_hex, 16) != Ok(addr.port()) {
        return false;
    }
    // The kernel prints each 32-bit word of the address as a number in host byte order.
    let words: Option<Vec<[u8; 4]>> = (0..ip_hex.len() / 8)
        .map(|i| {
            let word = ip_hex.get(8 * i..8 * i + 8)?;
            u32::from_str_radix(word, 16).ok().map(u32::to_ne_bytes)
        })
        .collect();
    let ip: std::net::IpAddr = match words.as_deref() {
        Some([a]) => std::net::Ipv4Addr::from(*a).into(),
        Some([a, b, c, d]) => {
            let mut bytes = [0u8; 16];
            for (chunk, word) in bytes.chunks_exact_mut(4).zip([a, b, c, d]) {
                chunk.copy_from_slice(word);
            }
            std::net::Ipv6Addr::from(bytes).into()
        }
        _ => return false,
    };
    let mapped = |ip: std::net::IpAddr| match ip {
        std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, Into::into),
        v4 => v4,
    };
    let (theirs, ours) = (mapped(ip), mapped(addr.ip()));
    theirs == ours || theirs.is_unspecified() || ours.is_unspecified()
}

/// `RLIMIT_MEMLOCK` in bytes, read from `/proc/self/limits` (std has no `getrlimit` and this
/// crate has no unsafe). `u64::MAX` when unlimited or unreadable.
pub fn memlock_limit() -> u64 {
    std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|s| parse_memlock(&s))
        .unwrap_or(u64::MAX)
}

fn parse_memlock(limits: &str) -> Option<u64> {
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max locked memory"))?;
    let soft = line
        .trim_start_matches("Max locked memory")
        .split_whitespace()
        .next()?;
    if soft == "unlimited" {
        return Some(u64::MAX);
    }
    soft.parse().ok()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;

    /// glommio 0.9 parks before running the task it was given when its preempt timer fired
    /// before it looked at its queues; with a 10 µs timer that is almost every start (without
    /// a nudger, a run of this loop hung on its first or second executor, 2026-11-27). The
    /// nudger's signals end each such park until the task has run.
    ///
    /// A timer shorter than the executor's own loop (from installing the timer to looking at
    /// it) fires before every look: glommio then runs nothing ever, nudged or not (a livelock,
    /// not a park). That loop's length moves by 2x from day to day on the development VM: a
    /// fixed 10 µs livelocked a debug build on 2026-12-01 and a release build on 2026-12-02
    /// (both had passed in CI), where 15 µs parked no release start and 20 µs parked one in
    /// 30 (hand runs of this test with the timer edited, 2026-12-02). So the timer is 25 µs in release builds and 50 µs in debug ones: starts park now and
    /// then (each park ended by a nudge, 20 ms), none livelocks at twice today's loop. Shards
    /// use a 1 ms timer ([`crate::PREEMPT_TIMER`]).
    #[test]
    fn an_executor_parked_before_its_first_task_is_nudged_until_it_runs() {
        let timer = Duration::from_micros(if cfg!(debug_assertions) { 50 } else { 25 });
        for i in 0..10 {
            let (tx, rx) = std::sync::mpsc::channel();
            let t = std::thread::spawn(move || {
                let Ok(ex) = LocalExecutorBuilder::new(GPlacement::Unbound)
                    .io_memory(64 << 10)
                    .preempt_timer(timer)
                    .make()
                else {
                    eprintln!("skipped: no glommio executor here (io_uring or memlock missing)");
                    let _ = tx.send(None);
                    return;
                };
                let ran = run_nudged(ex, i, async { true });
                let _ = tx.send(Some(ran));
            });
            match rx.recv_timeout(Duration::from_secs(20)) {
                Ok(Some(ran)) => assert!(ran),
                Ok(None) => return,
                Err(e) => panic!("executor {i} never ran its task (timer {timer:?}): {e}"),
            }
            t.join().unwrap();
        }
    }

    #[test]
    fn listeners_are_read_from_proc_net_tcp_lines() {
        // Real lines: 127.0.0.1:15324 listening, the same port in TIME_WAIT (06), and
        // [::]:8080 listening.
        let v4 = "   3: 0100007F:3BDC 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 1 1 0 100 0 0 10 0";
        let tw = "   4: 0100007F:3BDC 0100007F:9C40 06 00000000:00000000 03:00000F6B 00000000     0        0 0 3 0";
        let v6 = "   0: 00000000000000000000000000000000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 1 1 0 100 0 0 10 0";
        let at = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert!(listens_at(v4, at("127.0.0.1:15324")));
        assert!(listens_at(v4, at("0.0.0.0:15324")));
        assert!(!listens_at(v4, at("127.0.0.2:15324")));
        assert!(!listens_at(v4, at("127.0.0.1:15325")));
        assert!(!listens_at(tw, at("127.0.0.1:15324")));
        assert!(listens_at(v6, at("127.0.0.1:8080")));
        assert!(listens_at(v6, at("[::1]:8080")));
        assert!(!listens_at("garbage", at("127.0.0.1:8080")));
        // A socket listening now is seen.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        assert!(listening_on(l.local_addr().unwrap()));
    }

    #[test]
    fn shared_memory_is_seen_in_transport_lists() {
        for tls in [
            None,
            Some("sm,tcp"),
            Some("posix"),
            Some("^tcp"),
            Some("all"),
            Some("tcp,\\sysv"),
            Some("^posix"),
        ] {
            assert!(may_open(tls, &SHARED_MEMORY), "{tls:?}");
        }
        for tls in ["tcp", "tcp,self", "rc,ud", "", "^sm", "^tcp,shm"] {
            assert!(!may_open(Some(tls), &SHARED_MEMORY), "{tls}");
        }
    }

    #[test]
    fn tcp_is_seen_in_transport_lists() {
        for tls in [
            None,
            Some("sm,tcp"),
            Some("tcp"),
            Some("^sm"),
            Some("all"),
            Some("\\tcp"),
        ] {
            assert!(may_open(tls, &TCP), "{tls:?}");
        }
        for tls in ["sm", "posix,self", "^tcp", "^sm,tcp", "rc,ud", ""] {
            assert!(!may_open(Some(tls), &TCP), "{tls}");
        }
    }

    /// Records its name in a shared log when dropped.
    struct Noted(&'static str, Rc<RefCell<Vec<&'static str>>>);

    impl Drop for Noted {
        fn drop(&mut self) {
            self.1.borrow_mut().push(self.0);
        }
    }

    // Two types with the same layout: the slot tells them apart by type, not by shape.
    struct First(Noted);
    struct Second(Noted);

    #[test]
    fn extensions_insert_get_and_distinct_types() {
        let ext = Extensions::default();
        assert!(ext.get::<u32>().is_none());
        let a = ext.get_or_insert_with(|| 7u32);
        let again = ext.get_or_insert_with(|| 8u32);
        assert!(Rc::ptr_eq(&a, &again));
        assert_eq!(*again, 7);
        assert!(ext.get::<u64>().is_none());
        let log = Rc::new(RefCell::new(Vec::new()));
        ext.get_or_insert_with(|| First(Noted("first", log.clone())));
        ext.get_or_insert_with(|| Second(Noted("second", log.clone())));
        assert_eq!(ext.get::<First>().unwrap().0 .0, "first");
        assert_eq!(ext.get::<Second>().unwrap().0 .0, "second");
        assert!(Rc::ptr_eq(&ext.get::<u32>().unwrap(), &a));
        assert!(log.borrow().is_empty());
    }

    #[test]
    fn extensions_drop_newest_first_then_close() {
        let log = Rc::new(RefCell::new(Vec::new()));
        let ext = Extensions::default();
        ext.get_or_insert_with(|| First(Noted("first", log.clone())));
        let second = ext.get_or_insert_with(|| Second(Noted("second", log.clone())));
        ext.get_or_insert_with(|| Noted("third", log.clone()));
        ext.teardown();
        // `second` is still held here: it goes when its last holder lets go.
        assert_eq!(*log.borrow(), ["third", "first"]);
        drop(second);
        assert_eq!(*log.borrow(), ["third", "first", "second"]);
        // Closed: nothing found, nothing kept.
        assert!(ext.get::<First>().is_none());
        let late = ext.get_or_insert_with(|| Noted("late", log.clone()));
        assert!(ext.get::<Noted>().is_none());
        drop(late);
        assert_eq!(log.borrow().last(), Some(&"late"));
        // Dropping a torn-down slot drops nothing twice.
        drop(ext);
        assert_eq!(log.borrow().len(), 4);
    }

    #[test]
    fn extensions_dropped_with_the_slot_newest_first() {
        let log = Rc::new(RefCell::new(Vec::new()));
        let ext = Extensions::default();
        ext.get_or_insert_with(|| First(Noted("first", log.clone())));
        ext.get_or_insert_with(|| Second(Noted("second", log.clone())));
        drop(ext);
        assert_eq!(*log.borrow(), ["second", "first"]);
    }

    #[test]
    fn extensions_constructors_and_destructors_may_use_the_slot() {
        let ext = Rc::new(Extensions::default());
        // A constructor that needs another subsystem's state.
        let inner = ext.clone();
        let v = ext.get_or_insert_with(move || {
            let n = inner.get_or_insert_with(|| 5u8);
            u16::from(*n) + 1
        });
        assert_eq!((*v, *ext.get::<u8>().unwrap()), (6, 5));
        // A constructor that inserts its own type first: that one is kept.
        let inner = ext.clone();
        let s = ext.get_or_insert_with(move || {
            inner.get_or_insert_with(|| String::from("inner"));
            String::from("outer")
        });
        assert_eq!(*s, "inner");
        assert_eq!(*ext.get::<String>().unwrap(), "inner");
        // A destructor that looks in the slot (torn down: finds nothing, does not panic).
        struct Looks(Rc<Extensions>, Rc<Cell<Option<bool>>>);
        impl Drop for Looks {
            fn drop(&mut self) {
                self.1.set(Some(self.0.get::<u8>().is_some()));
            }
        }
        let seen = Rc::new(Cell::new(None));
        ext.get_or_insert_with(|| Looks(ext.clone(), seen.clone()));
        ext.teardown();
        assert_eq!(seen.get(), Some(false));
    }

    #[test]
    fn memlock_parse() {
        let s = "Limit Soft Hard Units\nMax locked memory         8388608              8388608              bytes\n";
        assert_eq!(parse_memlock(s), Some(8 << 20));
        let u = "Max locked memory         unlimited            unlimited            bytes\n";
        assert_eq!(parse_memlock(u), Some(u64::MAX));
    }

    #[test]
    fn node_settings_are_checked() {
        let short = ShardsBuilder::new().psk(b"short").node_settings();
        assert!(matches!(short, Err(BootError::Config(_))));
        let deaf = ShardsBuilder::new()
            .listen(([127, 0, 0, 1], 0).into())
            .node_settings();
        assert!(matches!(deaf, Err(BootError::Config(_))));
        let a = ShardsBuilder::new().node_settings().ok();
        let b = ShardsBuilder::new().node_settings().ok();
        // Random node ids: equal with probability 2^-64.
        assert!(a.zip(b).is_some_and(|(a, b)| a.node_id != b.node_id));
        let fixed = ShardsBuilder::new()
            .node_id(NodeId::new(5))
            .psk(&[7; 16])
            .node_settings()
            .ok();
        assert!(fixed.is_some_and(|s| s.node_id == NodeId::new(5) && s.psk.is_some()));
    }

    #[test]
    fn io_memory_fits_or_errors() {
        let b = ShardsBuilder::new().shard_count(2);
        let per = b.io_memory_for(8 << 20).ok();
        assert!(per.is_some_and(|p| 2 * p + MEMLOCK_RESERVE <= 8 << 20));
        let e = ShardsBuilder::new().shard_count(200).io_memory_for(8 << 20);
        assert!(matches!(e, Err(BootError::MemlockTooSmall { limit, .. }) if limit == 8 << 20));
    }
}
