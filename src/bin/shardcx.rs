//! The `shardcx` command: `info`, `node`, `bench` and `completions`. See `shardcx help` (and
//! `shardcx help <command>`), and [`shardcx::bench`] for what the benchmarks measure and the
//! JSON schema.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, ExitCode, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use clap::{CommandFactory, Parser, Subcommand};
use shardcx::bench::client::{self, ClientConfig};
use shardcx::bench::collective::{self, CollMeasurement, Collective, CollectiveConfig};
use shardcx::bench::perftest::{self, Perftest};
use shardcx::bench::server::{self, ServeConfig};
use shardcx::bench::{
    parse_size, plot, report, BenchError, Budget, Measurement, Memory, Test, Transport, DEFAULT_PSK,
};
use shardcx::collective::{Costs, Tuning};
use shardcx::shards::boot::MEMLOCK_RESERVE;
use shardcx::shards::{memlock_limit, ShardsBuilder};
use shardcx::Shutdown;

/// shardcx: a thread-per-core communication runtime over UCX.
#[derive(Parser)]
#[command(name = "shardcx", version, arg_required_else_help = true)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// UCX version (loaded, built against, and why that library), transports and devices,
    /// io_uring, locked memory, cores, CUDA.
    Info {
        /// Print one JSON object instead of the text.
        #[arg(long)]
        json: bool,
    },
    /// Serve the benchmark and echo handlers until SIGINT/SIGTERM: one node; client shard i is
    /// served by shard i mod N, on its own rail.
    Node(NodeArgs),
    /// Run the benchmark suite and print a table per test (starts a local peer process, one
    /// node with as many shards as the client, unless --connect is given).
    ///
    /// Client shard i talks to server shard i mod N on its own rail, and the `route` column
    /// says whether it did so alone (`rail`) or something crossed its shard-to-shard lanes
    /// while it measured (`hop`).
    Bench(Box<BenchArgs>),
    /// Print a shell completion script, e.g. `shardcx completions bash >
    /// ~/.local/share/bash-completion/completions/shardcx`.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

#[derive(clap::Args)]
struct NodeArgs {
    /// Listen address; prints `listening ADDR`, then `shards N`.
    #[arg(
        long,
        env = "SHARDCX_LISTEN",
        default_value = "127.0.0.1:0",
        value_name = "ADDR"
    )]
    listen: SocketAddr,
    /// Shards of the node.
    #[arg(long, default_value_t = 1, value_parser = shard_count, value_name = "N")]
    shards: usize,
    /// Transport: shm (shared memory for data, tcp to connect), tcp, or auto.
    #[arg(long, default_value = "shm", value_parser = transport, value_name = "T")]
    transport: Transport,
    /// CPUs for the shards, shard j on LIST[j % len] (default: unpinned).
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    cores: Option<Vec<usize>>,
    /// Trusted-mode remote memory, for put-trusted-bw (any client can then write anywhere in
    /// this process: trusted peers only).
    #[arg(long)]
    trusted_rma: bool,
    /// Pre-shared key file (default: the built-in bench key).
    #[arg(long, env = "SHARDCX_PSK_FILE", value_name = "FILE")]
    psk_file: Option<String>,
    /// Also stop when standard input closes.
    #[arg(long)]
    stop_on_stdin_eof: bool,
    /// Serve Prometheus metrics at http://ADDR/metrics (port 0 picks one; prints `metrics
    /// ADDR` after `shards N`).
    #[arg(long, env = "SHARDCX_METRICS", value_name = "ADDR")]
    metrics: Option<SocketAddr>,
    /// Deprecated, ignored: every client shard has its own rail to this node.
    #[arg(long, hide = true, value_name = "K")]
    peers: Option<usize>,
}

#[derive(clap::Args)]
struct BenchArgs {
    /// Use the node running at ADDR (`shardcx node`; put-trusted-bw needs it started with
    /// --trusted-rma).
    #[arg(long, value_name = "ADDR")]
    connect: Option<SocketAddr>,
    /// Tests to run: am-lat, am-rate, am-bw, tag-lat, rpc-lat, rpc-lat-inline, rpc-rate,
    /// rpc-rate-inline, rpc-notify, put-bw, get-bw, put-trusted-bw, hop (default: all of these;
    /// put-trusted-bw is skipped over tcp; the -inline ones answer each reply into a handler),
    /// and the collectives barrier, bcast, allreduce, allgather, reduce-scatter, alltoall (run
    /// only when named: two nodes of --shards shards each in this process, one world).
    #[arg(long = "test", value_delimiter = ',', value_parser = test, value_name = "LIST")]
    tests: Vec<Named>,
    /// Message sizes, e.g. 8,4k,1m (default: per test; for a collective, its whole buffer:
    /// 8 B to 16 MiB).
    #[arg(long = "size", value_delimiter = ',', value_parser = size, value_name = "LIST")]
    sizes: Option<Vec<usize>>,
    /// Measured iterations per test and shard (default: per test).
    #[arg(long, value_parser = positive, value_name = "N", conflicts_with = "duration")]
    iters: Option<u64>,
    /// Or: seconds per test and shard (0 to 3600).
    #[arg(long, value_parser = seconds, value_name = "S")]
    duration: Option<Duration>,
    /// Iterations before measuring (default: iters/10, at most 1000).
    #[arg(long, value_name = "N")]
    warmup: Option<u64>,
    /// Operations in flight for am-rate, am-bw, rpc-rate, rpc-rate-inline, rpc-notify, put-bw, get-bw and
    /// put-trusted-bw (the bandwidth tests keep at most 8 MiB in flight).
    #[arg(long, default_value_t = 64, value_parser = positive, value_name = "N")]
    window: u64,
    /// Client shard counts, each run in turn (hop needs 2); for the collectives, shards per
    /// node.
    #[arg(long, value_delimiter = ',', default_value = "1", value_parser = shard_count,
          value_name = "LIST")]
    shards: Vec<usize>,
    /// Transports, each run in turn: shm, tcp, auto.
    #[arg(long = "transport", value_delimiter = ',', default_value = "shm",
          value_parser = transport, value_name = "LIST")]
    transports: Vec<Transport>,
    /// The client's buffers: host, or cuda (device buffers on each client shard's GPU, for
    /// am-lat, am-bw, rpc-lat, put-bw and get-bw; staged through pinned host buffers; fails
    /// when CUDA is off, saying why).
    #[arg(long, default_value = "host", value_parser = memory, value_name = "M")]
    memory: Memory,
    /// CPUs of the client shards [/ of the local peer's shards], e.g. 0/1 or 0,1/2,3
    /// (default: the peer on the last CPU, the client on the others first); for the
    /// collectives, of node 0's [/ node 1's] shards (default: rank r on CPU r mod CPUs).
    #[arg(long, value_parser = core_split, value_name = "C[/S]")]
    cores: Option<CoreSplit>,
    /// Write the results as JSON (schema: the `shardcx::bench` docs).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Plot latency and bandwidth against size into FILE: SVG or PNG, by its extension
    /// (.svg, .png).
    #[arg(long, value_parser = plot_file, value_name = "FILE")]
    plot: Option<PathBuf>,
    /// Pre-shared key file (default: the built-in bench key).
    #[arg(long, env = "SHARDCX_PSK_FILE", value_name = "FILE")]
    psk_file: Option<String>,
    /// Also run UCX's ucx_perftest (from the loaded UCX's build, else PATH) for the tests that
    /// have a counterpart (am-lat, am-rate, am-bw, tag-lat, put-bw), on the same transport,
    /// CPUs, sizes and iterations, after each transport's shardcx runs: its figures and the
    /// ratio shardcx/perftest go in the table, the JSON and the plot (local peer only).
    #[arg(long, conflicts_with = "connect")]
    vs_perftest: bool,
    /// No progress bars on stderr (they are drawn only to a terminal, for tests that run
    /// longer than a second).
    #[arg(long, short)]
    quiet: bool,
    /// Collectives: choose their algorithms by the cost model with the costs in FILE (written
    /// by --save-costs) instead of the fixed 64 KiB threshold.
    #[arg(long, value_name = "FILE")]
    costs: Option<PathBuf>,
    /// Collectives: write the allreduce cost model's α and β (fitted through the smallest and
    /// the largest --size of the two-rank world, --shards 1; the first transport) to FILE, for
    /// --costs and Tuning::with_costs(Costs::load(FILE)?).
    #[arg(long, value_name = "FILE")]
    save_costs: Option<PathBuf>,
}

/// A `--test` name: a point-to-point test (against a peer node) or a collective (a world of
/// two nodes in this process).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Named {
    P2p(Test),
    Coll(Collective),
}

/// `--cores C[/S]`: client CPUs, and the local peer's if given.
#[derive(Clone)]
struct CoreSplit {
    client: Vec<usize>,
    server: Option<Vec<usize>>,
}

/// Why the command failed (exit status 1; clap's usage errors exit with 2).
struct Failure(String);

impl From<BenchError> for Failure {
    fn from(e: BenchError) -> Self {
        Failure(e.to_string())
    }
}

/// Logs to stderr through `tracing-subscriber`, filtered by `RUST_LOG` (e.g.
/// `RUST_LOG=shardcx_shards=debug`); without it, `info` for a node (sessions, failures,
/// shutdown) and `warn` for the other commands.
fn init_logging(cmd: &Cmd) {
    let default = match cmd {
        Cmd::Node(_) => "info",
        _ => "warn",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(&cli.command);
    let r = match cli.command {
        Cmd::Info { json } => info(json),
        Cmd::Node(a) => node(a),
        Cmd::Bench(a) => bench(*a),
        Cmd::Completions { shell } => {
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "shardcx",
                &mut std::io::stdout(),
            );
            Ok(())
        }
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure(m)) => {
            eprintln!("shardcx: error: {m}");
            ExitCode::FAILURE
        }
    }
}

// ---------------------------------------------------------------------------------------------
// info

/// Where the loaded libucp came from: `LD_LIBRARY_PATH`, this build's run path, or the
/// system's search path.
fn ucx_source(loaded: Option<&str>) -> String {
    // Always set by the build script (build-support/ucx_rpath.rs).
    let rpath = env!("SHARDCX_UCX_RPATH");
    let Some(loaded) = loaded else {
        return "unknown (the loaded library's path could not be read)".into();
    };
    let loaded_dir = std::path::Path::new(loaded).parent();
    let canon = |p: &std::path::Path| std::fs::canonicalize(p).ok();
    let loaded_dir = loaded_dir.and_then(canon);
    if let Ok(ld) = std::env::var("LD_LIBRARY_PATH") {
        let hit = ld
            .split(':')
            .filter(|d| !d.is_empty())
            .any(|d| canon(std::path::Path::new(d)) == loaded_dir);
        if hit {
            return "LD_LIBRARY_PATH (it comes before this build's run path)".into();
        }
    }
    if canon(std::path::Path::new(rpath)) == loaded_dir {
        return format!("this build's run path ({rpath}, the UCX that ucx1-sys built)");
    }
    format!("the system's library search path (this build's run path {rpath} had none)")
}

fn info(json: bool) -> Result<(), Failure> {
    let v = shardcx::ucx::version();
    let source = ucx_source(v.library_path.as_deref());
    let compat = if v.matches() {
        "the loaded library matches"
    } else if v.compatible() {
        "the loaded library is newer and compatible"
    } else {
        "WARNING: the loaded library is not compatible with this build"
    };
    let context = shardcx::ucx::Context::from_env(shardcx::ucx::Features::messaging());
    let transports = match &context {
        // `ucp_context_print_info` lists "resource N : md M dev D flags -- tl/device".
        Ok(ctx) => Ok(ctx
            .info()
            .lines()
            .filter(|l| l.contains("resource"))
            .filter_map(|l| l.split_whitespace().last())
            .map(str::to_string)
            .collect::<Vec<String>>()),
        Err(e) => Err(e.to_string()),
    };
    let cuda = CudaReport::new(context.as_ref().ok());
    let io_uring = io_uring_status();
    let cpus = cpu_list();
    let limit = memlock_limit();
    let io_memory = ShardsBuilder::new().io_memory_for(limit);
    let mut out = String::new();
    if json {
        let j = serde_json::json!({
            "shardcx": env!("CARGO_PKG_VERSION"),
            "ucx": {
                "loaded": format!("{}.{}.{}", v.loaded.0, v.loaded.1, v.loaded.2),
                "loaded_string": v.loaded_string,
                "library": v.library_path,
                "source": source,
                "built_with": format!("{}.{}", v.built.0, v.built.1),
                "compatible": v.compatible(),
                "transports": transports.as_ref().ok(),
                "transports_error": transports.as_ref().err(),
            },
            "io_uring": io_uring,
            "memlock_limit_bytes": (limit != u64::MAX).then_some(limit),
            "io_memory_per_shard_bytes": io_memory.as_ref().ok(),
            "io_memory_error": io_memory.as_ref().err().map(|e| e.to_string()),
            "cpus": cpus,
            "cuda": cuda.json(),
        });
        out = format!("{j:#}\n");
    } else {
        use std::fmt::Write as _;
        let _ = writeln!(out, "shardcx {}", env!("CARGO_PKG_VERSION"));
        let _ = writeln!(
            out,
            "UCX loaded:       {}.{}.{} ({}) from {}",
            v.loaded.0,
            v.loaded.1,
            v.loaded.2,
            v.loaded_string,
            v.library_path.as_deref().unwrap_or("an unknown file")
        );
        let _ = writeln!(out, "UCX found by:     {source}");
        let _ = writeln!(
            out,
            "UCX built with:   {}.{} headers ({compat})",
            v.built.0, v.built.1
        );
        let _ = match &transports {
            Ok(found) if found.is_empty() => {
                writeln!(out, "UCX transports and devices: none listed by UCX")
            }
            Ok(found) => writeln!(
                out,
                "UCX transports:   {} (transport/device; UCX_TLS and UCX_NET_DEVICES narrow \
                 them)",
                found.join(" ")
            ),
            Err(e) => writeln!(
                out,
                "UCX transports and devices: cannot create a UCX context: {e}"
            ),
        };
        let _ = writeln!(out, "io_uring:         {io_uring}");
        let limit_s = if limit == u64::MAX {
            "unlimited".to_string()
        } else {
            format!("{} KiB", limit >> 10)
        };
        let _ = match &io_memory {
            Ok(per) => writeln!(
                out,
                "locked memory:    limit {limit_s}; {} shard(s) (one per CPU) get {} KiB of io \
                 memory each, {} KiB in all with the {} KiB reserve: enough",
                cpus.len(),
                per >> 10,
                (per * cpus.len() as u64 + MEMLOCK_RESERVE) >> 10,
                MEMLOCK_RESERVE >> 10
            ),
            Err(e) => writeln!(out, "locked memory:    limit {limit_s}: NOT ENOUGH: {e}"),
        };
        let _ = writeln!(
            out,
            "cores:            {} available to this process: {:?}",
            cpus.len(),
            cpus
        );
        cuda.text(&mut out);
    }
    // One write; a closed pipe (`shardcx info | head -1`) is not an error worth a panic.
    let _ = std::io::stdout().lock().write_all(out.as_bytes());
    Ok(())
}

/// What `info` says about CUDA: the driver, its devices, the loaded UCX's memory types and the
/// mode a shard would run in (the same probe every shard makes at start).
struct CudaReport {
    driver: Result<&'static shardcx::cuda::DriverInfo, shardcx::cuda::Unavailable>,
    request: Result<shardcx::cuda::ModeRequest, shardcx::CudaError>,
    /// `None` when no UCX context could be made (both).
    probe: Option<Result<shardcx::cuda::CudaProbe, shardcx::CudaError>>,
    memory_types: Option<Result<shardcx::ucx::MemoryTypes, String>>,
}

impl CudaReport {
    fn new(context: Option<&shardcx::ucx::Context>) -> Self {
        let request = shardcx::cuda::ModeRequest::from_env();
        let probe = match (&request, context) {
            (Ok(r), Some(ctx)) => Some(shardcx::cuda::probe(ctx, *r)),
            _ => None,
        };
        Self {
            driver: shardcx::cuda::driver(),
            request,
            probe,
            memory_types: context.map(|c| c.memory_types().map_err(|e| e.to_string())),
        }
    }

    /// The mode line: `off: REASON`, `staging`, `zero-copy`, or `ERROR: ...`.
    fn mode(&self) -> String {
        match (&self.request, &self.probe) {
            (Err(e), _) => format!("ERROR: {e}"),
            (Ok(_), None) => "unknown: no UCX context could be made".to_string(),
            (Ok(_), Some(Err(e))) => format!("ERROR: {e}"),
            (Ok(_), Some(Ok(p))) => match &p.off_reason {
                Some(reason) => format!("off: {reason}"),
                None => p.mode.to_string(),
            },
        }
    }

    fn text(&self, out: &mut String) {
        use std::fmt::Write as _;
        let _ = match &self.driver {
            Ok(d) => {
                let (major, minor) = d.version_pair();
                writeln!(
                    out,
                    "CUDA driver:      CUDA {major}.{minor} ({})",
                    d.version
                )
            }
            Err(u) => writeln!(out, "CUDA driver:      none: {u}"),
        };
        if let Ok(d) = &self.driver {
            if d.devices.is_empty() {
                let _ = writeln!(out, "CUDA devices:     none");
            }
            for dev in &d.devices {
                let _ = writeln!(
                    out,
                    "CUDA device {}:    {}, {:.1} GiB",
                    dev.ordinal,
                    dev.name,
                    dev.total_memory as f64 / f64::from(1u32 << 30)
                );
            }
        }
        let _ = match &self.memory_types {
            Some(Ok(t)) => writeln!(
                out,
                "UCX memory types: {t} ({})",
                if t.cuda() {
                    "moves CUDA memory: zero-copy possible"
                } else {
                    "no CUDA memory: device data would be staged through host memory"
                }
            ),
            Some(Err(e)) => writeln!(out, "UCX memory types: unknown: {e}"),
            None => Ok(()),
        };
        let _ = writeln!(out, "CUDA:             {}", self.mode());
    }

    fn json(&self) -> serde_json::Value {
        let (mode, off_reason, error) = match (&self.request, &self.probe) {
            (Err(e), _) | (Ok(_), Some(Err(e))) => (None, None, Some(e.to_string())),
            (Ok(_), None) => (None, None, Some("no UCX context could be made".to_string())),
            (Ok(_), Some(Ok(p))) => (Some(p.mode.as_str()), p.off_reason.clone(), None),
        };
        let memory_types = self.memory_types.as_ref();
        serde_json::json!({
            "mode": mode,
            "off_reason": off_reason,
            "error": error,
            "request": self.request.as_ref().ok().map(|r| r.as_str()),
            "driver": self.driver.as_ref().ok().map(|d| serde_json::json!({
                "cuda_version": format!("{}.{}", d.version_pair().0, d.version_pair().1),
                "version_raw": d.version,
            })),
            "driver_error": self.driver.as_ref().err().map(|u| u.to_string()),
            "devices": self.driver.as_ref().map(|d| d.devices.iter().map(|dev| serde_json::json!({
                "ordinal": dev.ordinal,
                "name": dev.name,
                "memory_bytes": dev.total_memory,
            })).collect::<Vec<_>>()).unwrap_or_default(),
            "ucx_memory_types": memory_types.and_then(|t| t.as_ref().ok()).map(|t| t.names()),
            "ucx_moves_cuda": memory_types.and_then(|t| t.as_ref().ok()).map(|t| t.cuda()),
        })
    }
}

/// Whether glommio can set up io_uring here (it makes one executor on a thread of its own).
fn io_uring_status() -> String {
    let disabled = std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
        .ok()
        .map(|s| s.trim().to_string());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into());
    let probe = std::thread::spawn(|| {
        let ex = glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
            .io_memory(64 << 10)
            .make()
            .map_err(|e| e.to_string())?;
        // glommio 0.9 can park before running the task it was given; signals end that park
        // (README, "Known problems and pitfalls").
        shardcx::shards::boot::run_nudged(ex, 0, async {});
        Ok::<(), String>(())
    })
    .join();
    let verdict = match probe {
        Ok(Ok(())) => "available (an executor started)".to_string(),
        Ok(Err(e)) => format!("NOT available: {e}"),
        Err(_) => "NOT available: the probe panicked".to_string(),
    };
    match disabled {
        Some(d) => format!("{verdict}; kernel {kernel}, kernel.io_uring_disabled = {d}"),
        None => format!("{verdict}; kernel {kernel}"),
    }
}

/// The CPUs this process may run on.
fn cpu_list() -> Vec<usize> {
    match core_affinity::get_core_ids() {
        Some(ids) if !ids.is_empty() => ids.into_iter().map(|c| c.id).collect(),
        _ => (0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect(),
    }
}

// ---------------------------------------------------------------------------------------------
// node

fn node(a: NodeArgs) -> Result<(), Failure> {
    if a.peers.is_some() {
        eprintln!(
            "shardcx node: --peers is deprecated and ignored: there are no bench peers any more \
             (every client shard has its own rail to this node; use --shards)"
        );
    }
    let cfg = ServeConfig {
        listen: a.listen,
        shards: a.shards,
        transport: a.transport,
        psk: match &a.psk_file {
            Some(f) => psk_file(f)?,
            None => DEFAULT_PSK.to_vec(),
        },
        cores: a.cores,
        trusted_rma: a.trusted_rma,
        metrics: a.metrics,
    };
    let stdin_eof = a.stop_on_stdin_eof;
    let stop = Shutdown::new();
    stop.trigger_on_signals()
        .map_err(|e| Failure(format!("cannot install the signal handlers: {e}")))?;
    if stdin_eof {
        let s = stop.clone();
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
            s.trigger();
        });
    }
    server::serve(&cfg, &stop, |serving| {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "listening {}", serving.addr);
        let _ = writeln!(out, "shards {}", serving.shards);
        if let Some(m) = serving.metrics {
            let _ = writeln!(out, "metrics {m}");
        }
        let _ = out.flush();
        eprintln!(
            "shardcx node: serving on {} with {} shard(s) ({}{}); Ctrl-C or SIGTERM stops it",
            serving.addr,
            serving.shards,
            cfg.transport,
            if cfg.trusted_rma {
                ", trusted-mode remote memory ON"
            } else {
                ""
            }
        );
    })?;
    eprintln!("shardcx node: stopped");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// bench

fn bench(o: BenchArgs) -> Result<(), Failure> {
    let cpus = cpu_list();
    let colls: Vec<Collective> = o
        .tests
        .iter()
        .filter_map(|t| match t {
            Named::Coll(c) => Some(*c),
            Named::P2p(_) => None,
        })
        .collect();
    let tests: Vec<Test> = if o.tests.is_empty() {
        Test::ALL.to_vec()
    } else {
        o.tests
            .iter()
            .filter_map(|t| match t {
                Named::P2p(t) => Some(*t),
                Named::Coll(_) => None,
            })
            .collect()
    };
    if o.memory == Memory::Cuda && o.vs_perftest {
        usage_error(
            "bench",
            "--vs-perftest: compares host memory only (ucx_perftest -m cuda is not run yet)".into(),
        );
    }
    if !colls.is_empty() && o.connect.is_some() {
        usage_error(
            "bench",
            "--connect: the collective tests run both of their nodes in this process, not \
             against a running node"
                .into(),
        );
    }
    if colls.is_empty() && (o.costs.is_some() || o.save_costs.is_some()) {
        usage_error(
            "bench",
            "--costs and --save-costs are for the collectives (--test allreduce, ...)".into(),
        );
    }
    if o.save_costs.is_some() && !o.shards.contains(&1) {
        usage_error(
            "bench",
            "--save-costs fits a two-rank allreduce (one exchange per call): include 1 in --shards"
                .into(),
        );
    }
    // Read before anything runs: a bad file fails the command at once.
    let tuning = match &o.costs {
        Some(f) => Tuning::default()
            .with_costs(Costs::load(f).map_err(|e| Failure(format!("--costs: {e}")))?),
        None => Tuning::default(),
    };
    let budget = match (o.duration, o.iters) {
        (Some(d), _) => Some(Budget::Duration(d)),
        (None, Some(n)) => Some(Budget::Iters(n)),
        (None, None) => None,
    };
    let window = usize::try_from(o.window).unwrap_or(usize::MAX);
    let client_cores_opt = o.cores.as_ref().map(|c| c.client.clone());
    let server_cores_opt = o.cores.as_ref().and_then(|c| c.server.clone());

    let psk = match &o.psk_file {
        Some(f) => psk_file(f)?,
        None => DEFAULT_PSK.to_vec(),
    };
    for c in client_cores_opt.iter().chain(&server_cores_opt).flatten() {
        if !cpus.contains(c) {
            usage_error(
                "bench",
                format!("--cores: CPU {c} is not available (CPUs {cpus:?})"),
            );
        }
    }
    // Default placement: the local peer on the last CPU, the client on the others first.
    let last = *cpus.last().unwrap_or(&0);
    let server_cores = server_cores_opt.unwrap_or_else(|| vec![last]);
    let client_cores = client_cores_opt.unwrap_or_else(|| {
        let mut c: Vec<usize> = cpus.iter().copied().filter(|&c| c != last).collect();
        c.push(last);
        c
    });
    let max_shards = o.shards.iter().copied().max().unwrap_or(1);
    let v = shardcx::ucx::version();
    // Found before anything runs: a missing perftest costs no benchmark.
    let perftest_bin = if o.vs_perftest && !tests.is_empty() {
        let b = perftest::find(v.library_path.as_deref()).map_err(Failure)?;
        if let Some(w) = &b.warning {
            eprintln!("shardcx bench: WARNING: {w}");
        }
        println!("shardcx bench: comparing with {}", b.path.display());
        Some(b)
    } else {
        None
    };
    if !tests.is_empty() {
        println!(
            "shardcx bench: UCX {}.{}.{}, {} CPU(s) {:?}, client shard i on CPU {:?}[i], {}, \
             memory {}",
            v.loaded.0,
            v.loaded.1,
            v.loaded.2,
            cpus.len(),
            cpus,
            client_cores,
            match o.connect {
                Some(a) => format!("remote node {a}"),
                None => format!("local peer shard j on CPU {server_cores:?}[j]"),
            },
            o.memory
        );
    }
    if o.connect.is_none() && !tests.is_empty() {
        let used: Vec<usize> = client_cores.iter().take(max_shards).copied().collect();
        if used.iter().chain(&server_cores).all(|&c| c == used[0]) {
            eprintln!(
                "shardcx bench: WARNING: the client and its peer share CPU {}: both sides \
                 busy-poll one core, so LATENCY FIGURES WILL BE MEANINGLESS (use a machine \
                 with 2 CPUs or more, or --cores)",
                used[0]
            );
        }
    }
    let mut results: Vec<Measurement> = Vec::new();
    for &transport in o.transports.iter().filter(|_| !tests.is_empty()) {
        let mut local = None;
        // Trusted mode on the peer only when a test needs it (and can run: not over tcp).
        let trusted = tests.contains(&Test::PutTrustedBw) && transport != Transport::Tcp;
        let addr = match o.connect {
            Some(a) => a,
            None => {
                let p = LocalPeer::start(
                    transport,
                    max_shards,
                    &server_cores,
                    trusted,
                    o.psk_file.as_deref(),
                )?;
                let a = p.addr;
                local = Some(p);
                a
            }
        };
        for &shards in &o.shards {
            let cfg = ClientConfig {
                addr,
                shards,
                transport,
                tests: tests.clone(),
                sizes: o.sizes.clone(),
                budget,
                warmup: o.warmup,
                window,
                cores: Some(client_cores.clone()),
                psk: psk.clone(),
                progress: !o.quiet,
                io_memory: None,
                memory: o.memory,
            };
            results.extend(client::run(&cfg)?);
        }
        if let Some(p) = local {
            p.stop();
        }
        if let Some(binary) = &perftest_bin {
            let cpus = PerftestCpus {
                server: server_cores.first().copied(),
                client: client_cores.first().copied(),
            };
            compare_with_perftest(
                &mut results,
                transport,
                binary,
                cpus,
                o.warmup,
                budget,
                o.quiet,
            );
        }
    }
    // Grouped by test in `--test` order; within a test, in run order (a stable sort).
    results.sort_by_key(|m| tests.iter().position(|t| *t == m.test));
    if !tests.is_empty() {
        print!("{}", report::table(&results));
    }
    let _ = std::io::stdout().flush();
    let colls = bench_collectives(&o, &colls, tuning, budget, &psk, &cpus)?;
    if let Some(f) = &o.json {
        let mut objects = report::json_objects(&results);
        objects.extend(collective::json_objects(&colls));
        write_file(f, &report::json_array(&objects))?;
        eprintln!("shardcx bench: wrote {}", f.display());
    }
    if let Some(f) = &o.plot {
        if results.is_empty() {
            eprintln!("shardcx bench: --plot draws the point-to-point tests only; nothing to plot");
        } else {
            plot::write(f, &results).map_err(|e| Failure(e.to_string()))?;
            eprintln!("shardcx bench: wrote {}", f.display());
        }
    }
    Ok(())
}

/// The collective tests: for every transport and shard count, a world of two nodes of that
/// many shards in this process ([`collective::run`]); prints their tables.
fn bench_collectives(
    o: &BenchArgs,
    tests: &[Collective],
    tuning: Tuning,
    budget: Option<Budget>,
    psk: &[u8],
    cpus: &[usize],
) -> Result<Vec<CollMeasurement>, Failure> {
    let mut out = Vec::new();
    if tests.is_empty() {
        return Ok(out);
    }
    if let (Some(c), Some(f)) = (tuning.costs(), &o.costs) {
        println!(
            "shardcx bench: collectives choose their algorithms by the cost model: α = {:.2} \
             µs, β = {:.4} ns/B (from {})",
            c.alpha_us(),
            c.beta_ns_per_byte(),
            f.display()
        );
    }
    let v = shardcx::ucx::version();
    for &transport in &o.transports {
        for &shards in &o.shards {
            // `--cores C/S`: node 0 on C, node 1 on S (default: the last CPU, as the peer's);
            // without it, rank r on CPU r mod CPUs.
            let cores = match &o.cores {
                Some(c) => [
                    c.client.clone(),
                    c.server
                        .clone()
                        .unwrap_or_else(|| cpus.last().copied().into_iter().collect()),
                ],
                None => {
                    let cpu = |r: usize| cpus.get(r % cpus.len().max(1)).copied().unwrap_or(0);
                    [
                        (0..shards).map(cpu).collect(),
                        (shards..2 * shards).map(cpu).collect(),
                    ]
                }
            };
            println!(
                "shardcx bench: UCX {}.{}.{}, collectives over {} nodes of {shards} shard(s) in \
                 this process ({transport}), node 0 shard s on CPU {:?}[s], node 1 on {:?}[s]",
                v.loaded.0,
                v.loaded.1,
                v.loaded.2,
                collective::NODES,
                cores[0],
                cores[1]
            );
            if 2 * shards > cpus.len() {
                eprintln!(
                    "shardcx bench: WARNING: {} ranks on {} CPU(s): ranks busy-poll shared cores, \
                     so the collective figures measure oversubscription",
                    2 * shards,
                    cpus.len()
                );
            }
            let cfg = CollectiveConfig {
                shards,
                transport,
                tests: tests.to_vec(),
                sizes: o.sizes.clone(),
                budget,
                warmup: o.warmup,
                cores: Some(cores),
                psk: psk.to_vec(),
                progress: !o.quiet,
                io_memory: None,
                tuning,
            };
            out.extend(collective::run(&cfg)?);
        }
    }
    // Grouped by collective in `--test` order, then in run order.
    out.sort_by_key(|m| tests.iter().position(|t| *t == m.test));
    print!("{}", collective::table(&out));
    let _ = std::io::stdout().flush();
    if let Some(f) = &o.save_costs {
        // Two ranks: an allreduce is one exchange, so the fit is the cost of a message.
        let fit = collective::cost_model(&out)
            .into_iter()
            .find(|c| c.ranks == 2)
            .ok_or_else(|| {
                Failure(
                    "--save-costs: the cost model needs a two-rank allreduce at two sizes \
                     (--test allreduce --size 8,1m --shards 1)"
                        .into(),
                )
            })?;
        let costs = fit
            .costs()
            .map_err(|e| Failure(format!("--save-costs: the fit is unusable: {e}")))?;
        let note = format!(
            "shardcx bench: allreduce of {} ranks ({}), p50 at {} and {} bytes, UCX {}.{}.{}",
            fit.ranks, fit.transport, fit.from.0, fit.from.1, v.loaded.0, v.loaded.1, v.loaded.2
        );
        write_file(f, &format!("{}\n", costs.to_json(&note)))?;
        eprintln!("shardcx bench: wrote {}", f.display());
    }
    Ok(out)
}

/// Where the perftest server and client run: like the local peer's shard 0 and client shard 0.
#[derive(Clone, Copy)]
struct PerftestCpus {
    server: Option<usize>,
    client: Option<usize>,
}

/// Runs `ucx_perftest` for every measured (test, size) of `transport` that has a counterpart,
/// once per (perftest test, size, iterations), and attaches its figures (or why there are none)
/// to the measurements. Iterations: client shard 0's measured messages.
fn compare_with_perftest(
    results: &mut [Measurement],
    transport: Transport,
    binary: &perftest::Binary,
    cpus: PerftestCpus,
    warmup: Option<u64>,
    budget: Option<Budget>,
    quiet: bool,
) {
    type Key = (&'static str, usize, u64, u64);
    let mut ran: Vec<(Key, Result<perftest::PerftestFigures, String>)> = Vec::new();
    for m in results
        .iter_mut()
        .filter(|m| m.transport == transport && m.skipped.is_none())
    {
        let (Some(counterpart), Some(shard0)) =
            (perftest::counterpart(m.test), m.per_shard.first())
        else {
            continue;
        };
        let iters = shard0.figures.msgs.max(1);
        // As shardcx's own run of the test did.
        let warmup =
            warmup.unwrap_or_else(|| budget.unwrap_or(Budget::Iters(iters)).default_warmup());
        let key = (counterpart.test, m.size, iters, warmup);
        let outcome = match ran.iter().find(|(k, _)| *k == key) {
            Some((_, outcome)) => outcome.clone(),
            None => {
                if !quiet {
                    eprintln!(
                        "shardcx bench: ucx_perftest -t {} -s {} -n {iters} ({transport}) ...",
                        counterpart.test, m.size
                    );
                }
                let outcome = perftest::run(&perftest::RunConfig {
                    binary,
                    transport,
                    server_cpu: cpus.server,
                    client_cpu: cpus.client,
                    counterpart,
                    size: m.size,
                    iters,
                    warmup,
                    // Generous: perftest is about as fast as shardcx, plus its start-up.
                    timeout: (shard0.figures.elapsed * 20)
                        .clamp(Duration::from_secs(30), Duration::from_secs(300)),
                });
                if let Err(why) = &outcome {
                    eprintln!("shardcx bench: {why}");
                }
                ran.push((key, outcome.clone()));
                outcome
            }
        };
        m.perftest = Some(Perftest {
            counterpart,
            iters,
            outcome,
        });
    }
}

/// The local peer process: `shardcx node` started from this binary (one node, as many shards
/// as the largest client), stopped by closing its standard input.
struct LocalPeer {
    child: Child,
    stdin: Option<ChildStdin>,
    addr: SocketAddr,
}

impl LocalPeer {
    fn start(
        transport: Transport,
        shards: usize,
        cores: &[usize],
        trusted_rma: bool,
        psk_file: Option<&str>,
    ) -> Result<Self, Failure> {
        let exe = std::env::current_exe()
            .map_err(|e| Failure(format!("cannot find this program to start a peer: {e}")))?;
        let core_list: Vec<String> = cores.iter().map(usize::to_string).collect();
        let mut cmd = Command::new(exe);
        cmd.args(["node", "--listen", "127.0.0.1:0"])
            .args(["--shards", &shards.to_string()])
            .args(["--transport", transport.name()])
            .args(["--cores", &core_list.join(",")])
            .arg("--stop-on-stdin-eof")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(f) = psk_file {
            cmd.args(["--psk-file", f]);
        }
        if trusted_rma {
            cmd.arg("--trusted-rma");
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| Failure(format!("cannot start the local peer process: {e}")))?;
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let Some(out) = stdout else { return };
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Some(a) = line.strip_prefix("listening ") {
                    let _ = tx.send(a.trim().to_string());
                }
            }
        });
        // The peer's stderr: kept for an error message, its start-up line dropped.
        let (etx, erx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut e) = stderr {
                let _ = e.read_to_string(&mut s);
            }
            let _ = etx.send(s);
        });
        let stdin = child.stdin.take();
        let addr = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(a) => a,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                let err = erx.recv_timeout(Duration::from_secs(5)).unwrap_or_default();
                return Err(Failure(format!(
                    "the local peer process did not start: {}",
                    err.trim()
                )));
            }
        };
        let addr = addr
            .parse()
            .map_err(|_| Failure(format!("the local peer printed a bad address {addr:?}")))?;
        Ok(Self { child, stdin, addr })
    }

    /// Closes the peer's standard input and waits for it to shut down (kills it after 20 s).
    fn stop(mut self) {
        drop(self.stdin.take());
        let until = Instant::now() + Duration::from_secs(20);
        while Instant::now() < until {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!("shardcx bench: the local peer did not stop within 20 s; killing it");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for LocalPeer {
    fn drop(&mut self) {
        // Reached on errors: make sure no peer process outlives the run.
        if self.stdin.is_some() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// argument parsers (clap value parsers) and helpers

/// A usage mistake found after parsing: printed as clap prints its own, exit status 2.
fn usage_error(subcommand: &str, msg: String) -> ! {
    let mut cmd = Cli::command();
    cmd.build();
    match cmd.find_subcommand_mut(subcommand) {
        Some(sub) => sub.error(clap::error::ErrorKind::InvalidValue, msg).exit(),
        None => cmd.error(clap::error::ErrorKind::InvalidValue, msg).exit(),
    }
}

fn positive(s: &str) -> Result<u64, String> {
    match s.parse::<u64>() {
        Ok(n) if n >= 1 => Ok(n),
        Ok(_) => Err("must be at least 1".into()),
        Err(_) => Err(format!("cannot read {s:?} as a count")),
    }
}

fn memory(s: &str) -> Result<Memory, String> {
    Memory::parse(s).ok_or_else(|| format!("unknown memory {s:?} (host, cuda)"))
}

fn transport(s: &str) -> Result<Transport, String> {
    Transport::parse(s).ok_or_else(|| format!("unknown transport {s:?} (shm, tcp, auto)"))
}

fn test(s: &str) -> Result<Named, String> {
    Test::parse(s)
        .map(Named::P2p)
        .or_else(|| Collective::parse(s).map(Named::Coll))
        .ok_or_else(|| {
            let names: Vec<&str> = Test::ALL
                .iter()
                .map(|t| t.name())
                .chain(Collective::ALL.iter().map(|c| c.name()))
                .collect();
            format!("unknown test {s:?} (one of {})", names.join(", "))
        })
}

fn size(s: &str) -> Result<usize, String> {
    parse_size(s).ok_or_else(|| format!("cannot read size {s:?} (e.g. 8, 4k, 1m)"))
}

fn seconds(s: &str) -> Result<Duration, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 3600.0 => Ok(Duration::from_secs_f64(v)),
        _ => Err(format!("{s:?}: seconds between 0 and 3600")),
    }
}

fn shard_count(s: &str) -> Result<usize, String> {
    s.parse::<usize>()
        .ok()
        .filter(|n| (1..=256).contains(n))
        .ok_or_else(|| format!("shard count {s:?} not in 1..=256"))
}

fn cpu_ids(s: &str) -> Result<Vec<usize>, String> {
    let v = s
        .split(',')
        .filter(|x| !x.trim().is_empty())
        .map(|c| {
            c.trim()
                .parse()
                .map_err(|_| format!("cannot read CPU {c:?}"))
        })
        .collect::<Result<Vec<usize>, String>>()?;
    if v.is_empty() {
        return Err("empty CPU list".into());
    }
    Ok(v)
}

fn core_split(s: &str) -> Result<CoreSplit, String> {
    let (c, srv) = match s.split_once('/') {
        Some((c, srv)) => (c, Some(srv)),
        None => (s, None),
    };
    Ok(CoreSplit {
        client: cpu_ids(c)?,
        server: srv.map(cpu_ids).transpose()?,
    })
}

/// `--plot FILE`: checked before the run, so that a bad extension costs no benchmark.
fn plot_file(s: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(s);
    plot::PlotFormat::of(&path)
        .map(|_| path)
        .map_err(|e| e.to_string())
}

fn psk_file(path: &str) -> Result<Vec<u8>, Failure> {
    let mut key = std::fs::read(path)
        .map_err(|e| Failure(format!("cannot read the key file {path}: {e}")))?;
    while key.last().is_some_and(|b| b.is_ascii_whitespace()) {
        key.pop();
    }
    if key.len() < 16 {
        return Err(Failure(format!(
            "the key in {path} has {} bytes; at least 16 are needed",
            key.len()
        )));
    }
    Ok(key)
}

fn write_file(path: &PathBuf, text: &str) -> Result<(), Failure> {
    std::fs::write(path, text).map_err(|e| Failure(format!("cannot write {}: {e}", path.display())))
}
