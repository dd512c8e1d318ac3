//! The `shardcx` command: `info`, `node` and `bench`. See `shardcx help`, and
//! [`shardcx::bench`] for what the benchmarks measure and the JSON schema.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, ExitCode, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use shardcx::bench::client::{self, ClientConfig};
use shardcx::bench::server::{self, ServeConfig};
use shardcx::bench::{
    parse_size, plot, report, BenchError, Budget, Measurement, Test, Transport, DEFAULT_PSK,
};
use shardcx::shards::boot::MEMLOCK_RESERVE;
use shardcx::shards::{memlock_limit, ShardsBuilder};
use shardcx::Shutdown;

const USAGE: &str = "\
usage: shardcx <command> [options]

commands:
  info                       UCX version (loaded and built against), transports and devices,
                             io_uring, locked memory, cores, CUDA
  node                       serve the benchmark and echo handlers until SIGINT/SIGTERM: one
                             node; client shard i is served by shard i mod N, on its own rail
      --listen ADDR          listen address (default 127.0.0.1:0); prints `listening ADDR`,
                             then `shards N`
      --shards N             shards of the node (default 1)
      --transport T          shm | tcp | auto (default shm)
      --cores LIST           CPUs for the shards, shard j on LIST[j % len] (default: unpinned)
      --trusted-rma          trusted-mode remote memory, for put-trusted-bw (any client can
                             then write anywhere in this process: trusted peers only)
      --psk-file F           pre-shared key file (default: the built-in bench key)
      --stop-on-stdin-eof    also stop when standard input closes
      --peers K              deprecated, ignored (bench peers are gone: every client shard
                             has its own rail to this node)
  bench                      run the benchmark suite (starts a local peer process, one node
                             with as many shards as the client, unless --connect is given)
                             and print a table per test; client shard i talks to server
                             shard i mod N on its own rail, and the `route` column says
                             whether it did so alone (`rail`) or something crossed its
                             shard-to-shard lanes while it measured (`hop`)
      --connect ADDR         use the node running at ADDR (`shardcx node`; put-trusted-bw
                             needs it started with --trusted-rma)
      --test LIST            am-lat,am-rate,am-bw,tag-lat,rpc-lat,rpc-rate,rpc-notify,
                             put-bw,get-bw,put-trusted-bw,hop (default: all);
                             put-trusted-bw is skipped over tcp
      --size LIST            message sizes, e.g. 8,4k,1m (default: per test)
      --iters N              measured iterations per test and shard (default: per test)
      --duration S           or: seconds per test and shard
      --warmup N             iterations before measuring (default: iters/10, at most 1000)
      --window N             operations in flight for am-rate/am-bw/rpc-rate/rpc-notify/
                             put-bw/get-bw/put-trusted-bw (default 64; the bandwidth
                             tests keep at most 8 MiB in flight)
      --shards LIST          client shard counts, each run in turn (default 1; hop needs 2)
      --transport LIST       shm,tcp,auto (default shm)
      --cores C[/S]          CPUs of the client shards [/ of the local peer's shards]
                             (default: peer on the last CPU, client on the others first)
      --json FILE            write the results as JSON (schema: shardcx::bench docs)
      --plot FILE            write latency and bandwidth against size as SVG
      --psk-file F           pre-shared key file (default: the built-in bench key)
  help                       this text";

/// A command-line mistake: printed with the usage hint, exit status 2.
struct Usage(String);

/// Why the command failed.
enum Failure {
    Usage(Usage),
    Run(String),
}

impl From<Usage> for Failure {
    fn from(u: Usage) -> Self {
        Failure::Usage(u)
    }
}

impl From<BenchError> for Failure {
    fn from(e: BenchError) -> Self {
        Failure::Run(e.to_string())
    }
}

/// Arguments, consumed front to back.
struct Args {
    rest: std::vec::IntoIter<String>,
}

impl Args {
    fn next(&mut self) -> Option<String> {
        self.rest.next()
    }

    fn value(&mut self, flag: &str) -> Result<String, Usage> {
        self.rest
            .next()
            .ok_or_else(|| Usage(format!("{flag} needs a value")))
    }

    fn parsed<T: std::str::FromStr>(&mut self, flag: &str) -> Result<T, Usage> {
        let v = self.value(flag)?;
        v.parse()
            .map_err(|_| Usage(format!("{flag}: cannot read {v:?}")))
    }
}

fn main() -> ExitCode {
    let mut args = Args {
        rest: std::env::args().skip(1).collect::<Vec<_>>().into_iter(),
    };
    let r = match args.next().as_deref() {
        Some("info") => info(args),
        Some("node") => node(args),
        Some("bench") => bench(args),
        Some("help" | "--help" | "-h") => {
            println!("{USAGE}");
            Ok(())
        }
        Some("--version" | "-V") => {
            println!("shardcx {}", env!("CARGO_PKG_VERSION"));
            Ok(())
        }
        Some(other) => Err(Usage(format!("unknown command {other:?}")).into()),
        None => Err(Usage("no command given".into()).into()),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Usage(Usage(m))) => {
            eprintln!("shardcx: {m}\n(run `shardcx help` for the commands and options)");
            ExitCode::from(2)
        }
        Err(Failure::Run(m)) => {
            eprintln!("shardcx: error: {m}");
            ExitCode::FAILURE
        }
    }
}

// ---------------------------------------------------------------------------------------------
// info

fn info(mut args: Args) -> Result<(), Failure> {
    if let Some(a) = args.next() {
        return Err(Usage(format!("info takes no options, got {a:?}")).into());
    }
    let v = shardcx::ucx::version();
    println!("shardcx {}", env!("CARGO_PKG_VERSION"));
    println!(
        "UCX loaded:       {}.{}.{} ({}) from {}",
        v.loaded.0,
        v.loaded.1,
        v.loaded.2,
        v.loaded_string,
        v.library_path.as_deref().unwrap_or("an unknown file")
    );
    println!(
        "UCX built with:   {}.{} headers ({})",
        v.built.0,
        v.built.1,
        if v.matches() {
            "the loaded library matches"
        } else if v.compatible() {
            "the loaded library is newer and compatible"
        } else {
            "WARNING: the loaded library is not compatible with this build"
        }
    );
    match shardcx::ucx::Context::from_env(shardcx::ucx::Features::messaging()) {
        Ok(ctx) => {
            // `ucp_context_print_info` lists "resource N : md M dev D flags -- tl/device".
            let info = ctx.info();
            let found: Vec<&str> = info
                .lines()
                .filter(|l| l.contains("resource"))
                .filter_map(|l| l.split_whitespace().last())
                .collect();
            if found.is_empty() {
                println!("UCX transports and devices: none listed by UCX");
            } else {
                println!(
                    "UCX transports:   {} (transport/device; UCX_TLS and UCX_NET_DEVICES \
                     narrow them)",
                    found.join(" ")
                );
            }
        }
        Err(e) => println!("UCX transports and devices: cannot create a UCX context: {e}"),
    }
    println!("io_uring:         {}", io_uring_status());
    let cpus = cpu_list();
    let shards = ShardsBuilder::new();
    let limit = memlock_limit();
    let limit_s = if limit == u64::MAX {
        "unlimited".to_string()
    } else {
        format!("{} KiB", limit >> 10)
    };
    match shards.io_memory_for(limit) {
        Ok(per) => println!(
            "locked memory:    limit {limit_s}; {} shard(s) (one per CPU) get {} KiB of io \
             memory each, {} KiB in all with the {} KiB reserve: enough",
            cpus.len(),
            per >> 10,
            (per * cpus.len() as u64 + MEMLOCK_RESERVE) >> 10,
            MEMLOCK_RESERVE >> 10
        ),
        Err(e) => println!("locked memory:    limit {limit_s}: NOT ENOUGH: {e}"),
    }
    println!(
        "cores:            {} available to this process: {:?}",
        cpus.len(),
        cpus
    );
    println!("CUDA:             none: this build of shardcx has no CUDA support yet");
    Ok(())
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
        glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
            .io_memory(64 << 10)
            .make()
            .map(|ex| ex.run(async {}))
            .map_err(|e| e.to_string())
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

fn node(mut args: Args) -> Result<(), Failure> {
    let mut cfg = ServeConfig {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        shards: 1,
        transport: Transport::Shm,
        psk: DEFAULT_PSK.to_vec(),
        cores: None,
        trusted_rma: false,
    };
    let mut stdin_eof = false;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--listen" => cfg.listen = args.parsed("--listen")?,
            "--shards" => cfg.shards = positive(args.parsed("--shards")?, "--shards")?,
            "--peers" => {
                let _: usize = args.parsed("--peers")?;
                eprintln!(
                    "shardcx node: --peers is deprecated and ignored: there are no bench \
                     peers any more (every client shard has its own rail to this node; use \
                     --shards)"
                );
            }
            "--trusted-rma" => cfg.trusted_rma = true,
            "--transport" => cfg.transport = transport(&args.value("--transport")?)?,
            "--cores" => cfg.cores = Some(cores(&args.value("--cores")?)?),
            "--psk-file" => cfg.psk = psk_file(&args.value("--psk-file")?)?,
            "--stop-on-stdin-eof" => stdin_eof = true,
            other => return Err(Usage(format!("node: unknown option {other:?}")).into()),
        }
    }
    let stop = Shutdown::new();
    stop.trigger_on_signals()
        .map_err(|e| Failure::Run(format!("cannot install the signal handlers: {e}")))?;
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

struct BenchOpts {
    connect: Option<SocketAddr>,
    tests: Vec<Test>,
    sizes: Option<Vec<usize>>,
    budget: Option<Budget>,
    warmup: Option<u64>,
    window: usize,
    shards: Vec<usize>,
    transports: Vec<Transport>,
    client_cores: Option<Vec<usize>>,
    server_cores: Option<Vec<usize>>,
    json: Option<PathBuf>,
    plot: Option<PathBuf>,
    psk_file: Option<String>,
}

fn bench(mut args: Args) -> Result<(), Failure> {
    let cpus = cpu_list();
    let mut o = BenchOpts {
        connect: None,
        tests: Test::ALL.to_vec(),
        sizes: None,
        budget: None,
        warmup: None,
        window: 64,
        shards: vec![1],
        transports: vec![Transport::Shm],
        client_cores: None,
        server_cores: None,
        json: None,
        plot: None,
        psk_file: None,
    };
    while let Some(a) = args.next() {
        match a.as_str() {
            "--connect" => o.connect = Some(args.parsed("--connect")?),
            "--test" => {
                o.tests = list(&args.value("--test")?, "--test", |s| {
                    Test::parse(s).ok_or_else(|| format!("unknown test {s:?}"))
                })?
            }
            "--size" => {
                o.sizes = Some(list(&args.value("--size")?, "--size", |s| {
                    parse_size(s).ok_or_else(|| format!("cannot read size {s:?}"))
                })?)
            }
            "--iters" => {
                o.budget = Some(Budget::Iters(positive(args.parsed("--iters")?, "--iters")?))
            }
            "--duration" => {
                let s: f64 = args.parsed("--duration")?;
                if !(s > 0.0 && s <= 3600.0) {
                    return Err(Usage("--duration: seconds between 0 and 3600".into()).into());
                }
                o.budget = Some(Budget::Duration(Duration::from_secs_f64(s)));
            }
            "--warmup" => o.warmup = Some(args.parsed("--warmup")?),
            "--window" => o.window = positive(args.parsed("--window")?, "--window")?,
            "--shards" => {
                o.shards = list(&args.value("--shards")?, "--shards", |s| {
                    s.parse::<usize>()
                        .ok()
                        .filter(|n| (1..=256).contains(n))
                        .ok_or_else(|| format!("shard count {s:?} not in 1..=256"))
                })?
            }
            "--transport" => {
                o.transports = list(&args.value("--transport")?, "--transport", |s| {
                    Transport::parse(s).ok_or_else(|| format!("unknown transport {s:?}"))
                })?
            }
            "--cores" => {
                let v = args.value("--cores")?;
                let (c, s) = match v.split_once('/') {
                    Some((c, s)) => (c, Some(s)),
                    None => (v.as_str(), None),
                };
                o.client_cores = Some(cores(c)?);
                o.server_cores = s.map(cores).transpose()?;
            }
            "--json" => o.json = Some(args.value("--json")?.into()),
            "--plot" => o.plot = Some(args.value("--plot")?.into()),
            "--psk-file" => o.psk_file = Some(args.value("--psk-file")?),
            other => return Err(Usage(format!("bench: unknown option {other:?}")).into()),
        }
    }
    let psk = match &o.psk_file {
        Some(f) => psk_file(f)?,
        None => DEFAULT_PSK.to_vec(),
    };
    for c in o.client_cores.iter().chain(&o.server_cores).flatten() {
        if !cpus.contains(c) {
            return Err(Usage(format!("--cores: CPU {c} is not available (CPUs {cpus:?})")).into());
        }
    }
    // Default placement: the local peer on the last CPU, the client on the others first.
    let last = *cpus.last().unwrap_or(&0);
    let server_cores = o.server_cores.clone().unwrap_or_else(|| vec![last]);
    let client_cores = o.client_cores.clone().unwrap_or_else(|| {
        let mut c: Vec<usize> = cpus.iter().copied().filter(|&c| c != last).collect();
        c.push(last);
        c
    });
    let max_shards = o.shards.iter().copied().max().unwrap_or(1);
    let v = shardcx::ucx::version();
    println!(
        "shardcx bench: UCX {}.{}.{}, {} CPU(s) {:?}, client shard i on CPU {:?}[i], {}",
        v.loaded.0,
        v.loaded.1,
        v.loaded.2,
        cpus.len(),
        cpus,
        client_cores,
        match o.connect {
            Some(a) => format!("remote node {a}"),
            None => format!("local peer shard j on CPU {server_cores:?}[j]"),
        }
    );
    if o.connect.is_none() {
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
    for &transport in &o.transports {
        let mut local = None;
        // Trusted mode on the peer only when a test needs it (and can run: not over tcp).
        let trusted = o.tests.contains(&Test::PutTrustedBw) && transport != Transport::Tcp;
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
                tests: o.tests.clone(),
                sizes: o.sizes.clone(),
                budget: o.budget,
                warmup: o.warmup,
                window: o.window,
                cores: Some(client_cores.clone()),
                psk: psk.clone(),
                progress: true,
                io_memory: None,
            };
            results.extend(client::run(&cfg)?);
        }
        if let Some(p) = local {
            p.stop();
        }
    }
    // Grouped by test in `--test` order; within a test, in run order (a stable sort).
    results.sort_by_key(|m| o.tests.iter().position(|t| *t == m.test));
    print!("{}", report::table(&results));
    let _ = std::io::stdout().flush();
    if let Some(f) = &o.json {
        write_file(f, &report::json(&results))?;
        eprintln!("shardcx bench: wrote {}", f.display());
    }
    if let Some(f) = &o.plot {
        write_file(f, &plot::svg(&results))?;
        eprintln!("shardcx bench: wrote {}", f.display());
    }
    Ok(())
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
            .map_err(|e| Failure::Run(format!("cannot find this program to start a peer: {e}")))?;
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
            .map_err(|e| Failure::Run(format!("cannot start the local peer process: {e}")))?;
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
                return Err(Failure::Run(format!(
                    "the local peer process did not start: {}",
                    err.trim()
                )));
            }
        };
        let addr = addr
            .parse()
            .map_err(|_| Failure::Run(format!("the local peer printed a bad address {addr:?}")))?;
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
// helpers

fn list<T>(s: &str, flag: &str, item: impl Fn(&str) -> Result<T, String>) -> Result<Vec<T>, Usage> {
    let v: Vec<T> = s
        .split(',')
        .filter(|x| !x.trim().is_empty())
        .map(|x| item(x.trim()).map_err(|e| Usage(format!("{flag}: {e}"))))
        .collect::<Result<_, _>>()?;
    if v.is_empty() {
        return Err(Usage(format!("{flag}: empty list")));
    }
    Ok(v)
}

fn positive<T: PartialOrd + Default>(n: T, flag: &str) -> Result<T, Usage> {
    if n > T::default() {
        Ok(n)
    } else {
        Err(Usage(format!("{flag}: must be at least 1")))
    }
}

fn transport(s: &str) -> Result<Transport, Usage> {
    Transport::parse(s).ok_or_else(|| Usage(format!("unknown transport {s:?} (shm, tcp, auto)")))
}

fn cores(s: &str) -> Result<Vec<usize>, Usage> {
    list(s, "--cores", |c| {
        c.parse().map_err(|_| format!("cannot read CPU {c:?}"))
    })
}

fn psk_file(path: &str) -> Result<Vec<u8>, Failure> {
    let mut key = std::fs::read(path)
        .map_err(|e| Failure::Run(format!("cannot read the key file {path}: {e}")))?;
    while key.last().is_some_and(|b| b.is_ascii_whitespace()) {
        key.pop();
    }
    if key.len() < 16 {
        return Err(Failure::Run(format!(
            "the key in {path} has {} bytes; at least 16 are needed",
            key.len()
        )));
    }
    Ok(key)
}

fn write_file(path: &PathBuf, text: &str) -> Result<(), Failure> {
    std::fs::write(path, text)
        .map_err(|e| Failure::Run(format!("cannot write {}: {e}", path.display())))
}
