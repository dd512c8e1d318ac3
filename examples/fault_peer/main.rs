//! The two ends of the reliability suite (`tests/reliability.rs`, `../shared/RELIABILITY.md`),
//! usable by hand too: a journaling server, a load client that logs what was acknowledged, and
//! the suite's hostile and probing clients.
//!
//! ```sh
//! cargo run --release --example fault_peer -- serve --listen 127.0.0.1:7100 --journal /tmp/j
//! cargo run --release --example fault_peer -- load --connect 127.0.0.1:7100 --acked /tmp/a --for 5
//! ```
//!
//! `serve` answers the RPC function `fault.put` (a source, an incarnation, a sequence number,
//! a payload and its CRC-32): it checks the CRC, appends `src inc seq ok|bad` to the journal
//! (one `write` per line, before the reply goes out, so that a reply means a journal line even
//! after `kill -9`) and answers with the CRC it computed. `fault.slow` sleeps the milliseconds
//! it is given, then journals the same way (a call dropped by its deadline or cancel before
//! that journals nothing). It prints `listening ADDR` once it listens, and serves its metrics
//! with `--metrics ADDR`. `--node-id` keeps the node's id across restarts (a restart is a new
//! incarnation). SIGTERM or SIGINT stops it with a drain (the node's drain deadline).
//!
//! `load` connects (trying again for 10 s if it must, counted), then keeps `--window` calls in flight on each of its `--shards` for `--for`
//! seconds, each with the deadline `--deadline-ms`; a call answered with the right CRC appends
//! `src inc seq ms` to the `--acked` file (one `write` per line; `ms`: when, from the start of the run; `src` is
//! `--src` times 100 plus the shard). Calls that fail are counted by kind, and one that ends
//! later than its deadline plus 250 ms is counted as late, with the worst overrun. Lost
//! sessions are connected again on the next call (the peer's address is in the node's book).
//! SIGTERM ends the load early (calls in flight finish). At the end it prints one JSON line:
//! `{"src", "inc", "start_unix_ms", "sent", "ok", "late", "max_over_ms", "first_error_ms",
//! "last_error_ms", "failed": {kind: n}, "errors": [[ms, kind, took_ms], ...],
//! "connect_retries", "backlog_peak_bytes"}`, where the
//! error times count from the start of the run (`start_unix_ms`, wall clock), for the suite to
//! compare with when it injected a fault (`errors`: the first 200 failures, with how long each
//! call ran).
//!
//! `load --nodes N` runs N nodes in the process (each with `--shards` shards and its own
//! rails), and `--target-shards M` spreads each task's calls over the server's shards `0..M`
//! (R8b: 512 rails held at once).
//!
//! `serve --rma DIR` also holds remote-memory regions on every shard (see `rma.rs`), their
//! descriptors and CRC-32s written to `DIR/regions-SHARD.json` at start and the CRC-32s and
//! counters again to `DIR/final-SHARD.json` when it stops.
//!
//! The suite's other clients: `hostile` (R2: malformed requests and stray frames from an
//! authenticated peer), `deadlines` (R9: deadlines and cancellation at every phase), `attack`
//! (R7: raw TCP connections to the listener's port), `probe` (R7: how long legitimate connects
//! take), `rma-attack` (R12: every access to those regions that must be refused, and the ones
//! that must work), `rma-load` (R10: puts and gets kept in flight) and `scrape` (a node's
//! metrics, for the gauges oracle). Each prints one JSON line.

#![allow(clippy::unwrap_used, clippy::expect_used)] // An example may panic on a broken set-up.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::{Parser, Subcommand};
use shardcx::proto::NodeId;
use shardcx::rpc::{RpcConfig, RpcContext, RpcError};
use shardcx::shards::{DriverConfig, NetConfig, Placement};
use shardcx::ShardId;
use shardcx::{rpc_function, Node};

#[path = "../common/cli.rs"]
mod cli;
mod hostile;
mod rma;

/// One journaled call.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug)]
pub struct Put {
    /// The load client's id.
    pub src: u64,
    /// Its incarnation (start time).
    pub inc: u64,
    /// The call's sequence number.
    pub seq: u64,
    /// CRC-32 of `data`.
    pub crc: u32,
    /// The payload.
    pub data: Vec<u8>,
}

/// A call that takes its time.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug)]
pub struct Slow {
    /// The caller's id.
    pub src: u64,
    /// Its incarnation.
    pub inc: u64,
    /// The call's sequence number.
    pub seq: u64,
    /// How long the handler sleeps before it journals and answers, in milliseconds.
    pub ms: u32,
}

rpc_function!(
    /// Journals a call and answers with the payload's CRC-32.
    pub FaultPut: Put => u32, id = 0x4641, name = "fault.put"
);

rpc_function!(
    /// Sleeps, then journals the call and answers with its sequence number.
    pub FaultSlow: Slow => u64, id = 0x4642, name = "fault.slow"
);

/// How late a call may end after its deadline before it counts as late.
const LATE_SLACK: Duration = Duration::from_millis(250);

#[derive(Parser, Debug)]
#[command(about = "The reliability suite's journaling server and clients")]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Serve fault.put and fault.slow, journaling every call.
    Serve(ServeArgs),
    /// Call fault.put with a window of calls in flight, logging what was acknowledged.
    Load(LoadArgs),
    /// R2: send malformed requests and stray frames as an authenticated peer.
    Hostile(hostile::HostileArgs),
    /// R9: deadlines and cancellation at every phase of a call.
    Deadlines(hostile::DeadlineArgs),
    /// R7: hold raw TCP connections to a listener's port (silent, dripping, garbage).
    Attack(hostile::AttackArgs),
    /// R7: time directory fetches and one full connect and call.
    Probe(hostile::ProbeArgs),
    /// R12: attack the remote-memory regions of a `serve --rma` server.
    RmaAttack(rma::RmaAttackArgs),
    /// R10: keep puts and gets in flight to a `serve --rma` server.
    RmaLoad(rma::RmaLoadArgs),
    /// Print a node's metrics (`GET /metrics`).
    Scrape {
        /// The metrics address.
        #[arg(long, value_name = "ADDR")]
        at: SocketAddr,
    },
}

#[derive(clap::Args, Debug)]
struct ServeArgs {
    /// Where to listen.
    #[arg(long, value_name = "ADDR")]
    listen: SocketAddr,
    /// The journal file (appended to).
    #[arg(long, value_name = "FILE")]
    journal: PathBuf,
    /// The node's id (keep it across restarts).
    #[arg(long, value_name = "ID", default_value_t = 0xFA17)]
    node_id: u64,
    /// Shards.
    #[arg(long, value_name = "N", default_value = "2", value_parser = cli::positive)]
    shards: usize,
    /// How long to serve, in seconds.
    #[arg(long = "for", value_name = "SECS", default_value = "120", value_parser = cli::seconds)]
    serve_for: Duration,
    /// Serve the node's metrics at ADDR.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<SocketAddr>,
    /// The largest application payload accepted (the net layer's limit), e.g. 1m.
    #[arg(long, value_name = "B", value_parser = cli::size)]
    max_message: Option<usize>,
    /// The largest RPC arguments accepted (the RPC layer's limit), e.g. 64k.
    #[arg(long, value_name = "B", value_parser = cli::size)]
    max_args: Option<usize>,
    /// The drain deadline at shut-down, in milliseconds.
    #[arg(long, value_name = "MS")]
    drain_ms: Option<u64>,
    /// Hold remote-memory regions on every shard (R12), their descriptors and checksums
    /// written to DIR/regions-SHARD.json at start and DIR/final-SHARD.json at the end.
    #[arg(long, value_name = "DIR")]
    rma: Option<PathBuf>,
    /// The shards' spin window before they sleep, in microseconds (`DriverConfig::spin`;
    /// default the runtime's).
    #[arg(long, value_name = "US")]
    spin_us: Option<u64>,
}

#[derive(clap::Args, Debug)]
struct LoadArgs {
    /// The server.
    #[arg(long, value_name = "ADDR")]
    connect: SocketAddr,
    /// The acknowledged sequence numbers (appended to).
    #[arg(long, value_name = "FILE")]
    acked: PathBuf,
    /// Seconds of load.
    #[arg(long = "for", value_name = "SECS", default_value = "5", value_parser = cli::seconds)]
    load_for: Duration,
    /// Each call's deadline, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 2000)]
    deadline_ms: u64,
    /// Calls in flight per shard.
    #[arg(long, value_name = "N", default_value = "4", value_parser = cli::positive)]
    window: usize,
    /// Payload bytes (e.g. 64, 16k: above 8 KiB goes by rendezvous).
    #[arg(long, value_name = "B", default_value = "256", value_parser = cli::size)]
    size: usize,
    /// Pause between a task's calls, in milliseconds (0: none).
    #[arg(long, value_name = "MS", default_value_t = 2)]
    pause_ms: u64,
    /// The source id written in every call (times 100, plus the shard).
    #[arg(long, value_name = "ID", default_value_t = 1)]
    src: u64,
    /// Shards, each with its own connection and window.
    #[arg(long, value_name = "N", default_value = "1", value_parser = cli::positive)]
    shards: usize,
    /// Stop after this many calls per task (default: none, only `--for`).
    #[arg(long, value_name = "N")]
    calls: Option<u64>,
    /// Nodes in this process, each with `--shards` shards, its own connection and its own
    /// rails (node `n`'s source ids are `(src * 100 + n) * 100 + shard` when there are several).
    #[arg(long, value_name = "N", default_value = "1", value_parser = cli::positive)]
    nodes: usize,
    /// Spread each task's calls over the server's shards 0..N (`peer.shard(j)`), so that every
    /// rail to the server carries calls (default: the default rail only).
    #[arg(long, value_name = "N")]
    target_shards: Option<u16>,
    /// The shards' spin window before they sleep, in microseconds (`DriverConfig::spin`;
    /// default the runtime's).
    #[arg(long, value_name = "US")]
    spin_us: Option<u64>,
}

fn main() {
    let args = Args::parse();
    // The node's warnings (rails failed, reconnects backing off) on stderr, which the suite
    // keeps per process; RUST_LOG=info (or debug) says more.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
    let r = match args.cmd {
        Cmd::Serve(a) => serve(&a),
        Cmd::Load(a) => load(&a),
        Cmd::Hostile(a) => hostile::hostile(&a),
        Cmd::Deadlines(a) => hostile::deadlines(&a),
        Cmd::Attack(a) => hostile::attack(&a),
        Cmd::Probe(a) => hostile::probe(&a),
        Cmd::RmaAttack(a) => rma::rma_attack(&a),
        Cmd::RmaLoad(a) => rma::rma_load(&a),
        Cmd::Scrape { at } => hostile::scrape(at).map(|body| print!("{body}")),
    };
    if let Err(e) = r {
        eprintln!("fault_peer: {e}");
        std::process::exit(1);
    }
}

/// The suite's node settings: tcp, unpinned, a small io memory, the suite's key; the
/// shards' spin window `spin_us` when given.
fn node_with(spin_us: Option<u64>) -> shardcx::NodeBuilder {
    let b = Node::builder()
        .placement(Placement::Unpinned)
        .transports("tcp")
        .io_memory(1 << 20)
        .psk(b"the reliability suite's key, 16+ bytes");
    match spin_us {
        Some(us) => b.with_shards(|s| {
            s.driver(DriverConfig {
                spin: Duration::from_micros(us),
            })
        }),
        None => b,
    }
}

/// The suite's node settings with the runtime's spin window.
/// A flag set by SIGTERM or SIGINT.
fn stop_flag() -> Result<Arc<AtomicBool>, String> {
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, stop.clone()).map_err(|e| e.to_string())?;
    }
    Ok(stop)
}

/// Appends `src inc seq ok|bad` to the shard's journal (one `write`: atomic in append mode).
fn journal_line(
    file: &RefCell<Option<std::fs::File>>,
    (src, inc, seq): (u64, u64, u64),
    ok: bool,
) -> Result<(), String> {
    let line = format!("{src} {inc} {seq} {}\n", if ok { "ok" } else { "bad" });
    match file.borrow_mut().as_mut() {
        Some(f) => f
            .write_all(line.as_bytes())
            .map_err(|e| format!("journal: {e}")),
        None => Err("no journal".into()),
    }
}

fn serve(a: &ServeArgs) -> Result<(), String> {
    let path = a.journal.clone();
    // Each shard opens the journal for appending: one `write` per line is atomic.
    let open = move || {
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| format!("cannot open the journal {}: {e}", path.display()))
    };
    open()?;
    let open2 = open.clone();
    let stop = stop_flag()?;
    let mut net = NetConfig::default();
    if let Some(max) = a.max_message {
        net.max_message_size = max as u64;
    }
    let mut builder = node_with(a.spin_us)
        .shards(a.shards)
        .node_id(NodeId::new(a.node_id))
        .listen(a.listen)
        .net(net)
        .rpc_config(RpcConfig {
            max_args_size: a.max_args.map(|m| m as u64),
            ..RpcConfig::default()
        });
    if let Some(addr) = a.metrics {
        builder = builder.metrics(addr);
    }
    if let Some(ms) = a.drain_ms {
        builder = builder.drain_deadline(Duration::from_millis(ms));
    }
    let serve_for = a.serve_for;
    let rma_dir = a.rma.clone();
    builder
        .rpc::<FaultPut, _, _>(move || {
            let file = RefCell::new(open().ok());
            move |_: &RpcContext, p: &ArchivedPut| {
                let crc = crc32fast::hash(&p.data);
                let ok = crc == p.crc.to_native();
                let key = (p.src.to_native(), p.inc.to_native(), p.seq.to_native());
                journal_line(&file, key, ok)?;
                Ok(crc)
            }
        })
        .rpc_async::<FaultSlow, _, _, _>(move || {
            let file = Rc::new(RefCell::new(open2().ok()));
            move |_: RpcContext, s: Slow| {
                let file = file.clone();
                async move {
                    glommio::timer::sleep(Duration::from_millis(u64::from(s.ms))).await;
                    journal_line(&file, (s.src, s.inc, s.seq), true)?;
                    Ok(s.seq)
                }
            }
        })
        .run(move |node: Node| {
            let (stop, rma_dir) = (stop.clone(), rma_dir.clone());
            async move {
                let held = match &rma_dir {
                    Some(dir) => Some(rma::serve_regions(&node, dir)?),
                    None => None,
                };
                if node.shard().index() == 0 {
                    if let Some(a) = node.listen_addr() {
                        println!("listening {a}");
                        let _ = std::io::stdout().flush();
                    }
                }
                let until = Instant::now() + serve_for;
                while !stop.load(Ordering::Acquire) && Instant::now() < until {
                    glommio::timer::sleep(Duration::from_millis(10)).await;
                }
                if let (Some(held), Some(dir)) = (&held, &rma_dir) {
                    held.finish(&node, dir)?;
                }
                Ok::<(), String>(())
            }
        })
        .map_err(|e| e.to_string())?
        .into_iter()
        .collect::<Result<Vec<()>, String>>()?;
    Ok(())
}

/// What the load saw.
#[derive(Default, Clone)]
struct Tally {
    sent: u64,
    ok: u64,
    late: u64,
    max_over: Duration,
    first_error: Option<Duration>,
    last_error: Option<Duration>,
    failed: BTreeMap<String, u64>,
    /// The first [`MAX_ERRORS_KEPT`] failures: when (ms from the start), what, and how long
    /// the call had run (ms).
    errors: Vec<(u64, String, u64)>,
    /// Failed connects before the first that succeeded.
    connect_retries: u64,
    /// The most bytes one rail of the shard held for the server that UCX had not completed
    /// (`NetStats::backlog_peak_bytes`; bounded by `NetConfig::max_backlog_bytes`).
    backlog_peak: u64,
}

/// Failures kept with their times in the summary (the counts cover them all).
const MAX_ERRORS_KEPT: usize = 200;

impl Tally {
    /// Records a call's outcome (`Ok(true)`: answered with the right CRC), how far past its
    /// deadline it ended and when (from the start); true when it was acknowledged.
    fn record(
        &mut self,
        r: &Result<bool, RpcError>,
        (took, deadline): (Duration, Duration),
        at: Duration,
    ) -> bool {
        let over = took.saturating_sub(deadline);
        if over > LATE_SLACK {
            self.late += 1;
        }
        self.max_over = self.max_over.max(over);
        let failed = match r {
            Ok(true) => {
                self.ok += 1;
                return true;
            }
            Ok(false) => "BadCrc".to_owned(),
            Err(e) => {
                self.first_error.get_or_insert(at);
                self.last_error = Some(at);
                error_kind(e)
            }
        };
        if self.errors.len() < MAX_ERRORS_KEPT {
            let ms = |d: Duration| d.as_millis() as u64;
            self.errors.push((ms(at), failed.clone(), ms(took)));
        }
        *self.failed.entry(failed).or_default() += 1;
        false
    }

    /// Adds another shard's tally to this one.
    fn merge(&mut self, o: &Tally) {
        self.sent += o.sent;
        self.connect_retries += o.connect_retries;
        self.backlog_peak = self.backlog_peak.max(o.backlog_peak);
        self.ok += o.ok;
        self.late += o.late;
        self.max_over = self.max_over.max(o.max_over);
        self.first_error = match (self.first_error, o.first_error) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        self.last_error = self.last_error.max(o.last_error);
        for (k, n) in &o.failed {
            *self.failed.entry(k.clone()).or_default() += n;
        }
        let room = MAX_ERRORS_KEPT.saturating_sub(self.errors.len());
        self.errors.extend(o.errors.iter().take(room).cloned());
    }
}

/// The error's variant name (`Net.<variant>` for connection errors, `Node.<variant>` for the
/// node's others), for the tally.
fn error_kind(e: &RpcError) -> String {
    let head = |d: String| {
        d.split(['(', ' ', '{'])
            .next()
            .unwrap_or("Other")
            .to_owned()
    };
    match e {
        RpcError::Net(shardcx::Error::Net(net)) => format!("Net.{}", head(format!("{net:?}"))),
        RpcError::Net(inner) => format!("Node.{}", head(format!("{inner:?}"))),
        _ => head(format!("{e:?}")),
    }
}

fn load(a: &LoadArgs) -> Result<(), String> {
    let inc = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64);
    let acked = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&a.acked)
        .map_err(|e| format!("cannot open {}: {e}", a.acked.display()))?;
    let (connect, load_for, deadline, window, size, pause, src, calls) = (
        a.connect,
        a.load_for,
        Duration::from_millis(a.deadline_ms),
        a.window,
        a.size,
        Duration::from_millis(a.pause_ms),
        a.src,
        a.calls.unwrap_or(u64::MAX),
    );
    let acked = Arc::new(std::sync::Mutex::new(acked));
    let stop = stop_flag()?;
    let start = Instant::now();
    let start_unix_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let (shards, nodes, targets, spin_us) = (a.shards, a.nodes, a.target_shards, a.spin_us);
    // One node of the process: its shards' tallies.
    let run_node = move |n: usize| -> Result<Vec<Result<Tally, String>>, String> {
        let (acked, stop) = (acked.clone(), stop.clone());
        let base = if nodes > 1 {
            (src * 100 + n as u64) * 100
        } else {
            src * 100
        };
        node_with(spin_us)
            .shards(shards)
            .run(move |node: Node| {
                let (acked, stop) = (acked.clone(), stop.clone());
                async move {
                    let src = base + node.shard().index() as u64;
                    // Connected within 10 s, trying again after a failure (a handshake that timed
                    // out on a machine too busy to answer it in time); each retry is counted.
                    let connect_by = Instant::now() + Duration::from_secs(10);
                    let mut retries = 0;
                    let peer = loop {
                        let left = connect_by.saturating_duration_since(Instant::now());
                        match node.connect_within(connect, left).await {
                            Ok(p) => break p,
                            Err(e)
                                if connect_by.saturating_duration_since(Instant::now())
                                    > Duration::from_millis(200) =>
                            {
                                eprintln!("fault_peer: connect failed ({e}); trying again");
                                retries += 1;
                                glommio::timer::sleep(Duration::from_millis(100)).await;
                            }
                            Err(e) => return Err(format!("cannot connect to {connect}: {e}")),
                        }
                    };
                    node.add_peer_addr(peer.node_id(), connect);
                    let tally = Rc::new(RefCell::new(Tally {
                        connect_retries: retries,
                        ..Tally::default()
                    }));
                    let mut tasks = Vec::new();
                    for w in 0..window {
                        let (node, tally, acked, stop) =
                            (node.clone(), tally.clone(), acked.clone(), stop.clone());
                        tasks.push(glommio::spawn_local(async move {
                            let rpc = node.rpc();
                            let mut seq = w as u64;
                            let mut made = 0;
                            while start.elapsed() < load_for
                                && made < calls
                                && !stop.load(Ordering::Acquire)
                            {
                                made += 1;
                                let data: Vec<u8> =
                                    (0..size).map(|i| (seq as usize + i) as u8).collect();
                                let crc = crc32fast::hash(&data);
                                let put = Put {
                                    src,
                                    inc,
                                    seq,
                                    crc,
                                    data,
                                };
                                let t0 = Instant::now();
                                tally.borrow_mut().sent += 1;
                                let to = match targets {
                                    Some(m) if m > 0 => peer.shard(ShardId::new(
                                        ((w as u64 + made) % u64::from(m)) as u16,
                                    )),
                                    _ => peer,
                                };
                                let r = rpc.call_within::<FaultPut>(to, &put, deadline).await;
                                let took = t0.elapsed();
                                let ok = tally.borrow_mut().record(
                                    &r.map(|c| c == crc),
                                    (took, deadline),
                                    start.elapsed(),
                                );
                                if ok {
                                    if let Ok(mut f) = acked.lock() {
                                        let at = start.elapsed().as_millis();
                                        // One `write` per line (`writeln!` on a `File` makes
                                        // one per formatted piece): a reader, or a SIGSTOP,
                                        // between two of them would leave a torn line.
                                        let line = format!("{src} {inc} {seq} {at}\n");
                                        let _ = f.write_all(line.as_bytes());
                                    }
                                } else {
                                    // Do not spin on a dead peer: the next call reconnects.
                                    glommio::timer::sleep(Duration::from_millis(20)).await;
                                }
                                seq += window as u64;
                                // A long pause ends with the load (`--for`) or a signal.
                                let until = Instant::now() + pause;
                                while start.elapsed() < load_for && !stop.load(Ordering::Acquire) {
                                    let left = until.saturating_duration_since(Instant::now());
                                    if left.is_zero() {
                                        break;
                                    }
                                    glommio::timer::sleep(left.min(Duration::from_millis(100)))
                                        .await;
                                }
                            }
                        }));
                    }
                    for t in tasks {
                        t.await;
                    }
                    tally.borrow_mut().backlog_peak =
                        node.shard_ctx().net_stats().backlog_peak_bytes;
                    let t = tally.borrow().clone();
                    Ok::<Tally, String>(t)
                }
            })
            .map_err(|e| e.to_string())
    };
    let out: Vec<Result<Tally, String>> = if nodes == 1 {
        run_node(0)?
    } else {
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..nodes)
                .map(|n| {
                    let run_node = run_node.clone();
                    scope.spawn(move || run_node(n))
                })
                .collect();
            let mut all = Vec::new();
            for h in handles {
                all.extend(
                    h.join()
                        .map_err(|_| "a node's thread panicked".to_owned())??,
                );
            }
            Ok::<_, String>(all)
        })?
    };
    let mut t = Tally::default();
    for shard in out {
        t.merge(&shard?);
    }
    let ms = |d: Option<Duration>| d.map(|d| d.as_millis() as u64);
    println!(
        "{}",
        serde_json::json!({
            "src": src,
            "inc": inc,
            "start_unix_ms": start_unix_ms,
            "sent": t.sent,
            "ok": t.ok,
            "late": t.late,
            "max_over_ms": t.max_over.as_millis() as u64,
            "first_error_ms": ms(t.first_error),
            "last_error_ms": ms(t.last_error),
            "failed": t.failed,
            "errors": t.errors,
            "connect_retries": t.connect_retries,
            "backlog_peak_bytes": t.backlog_peak,
        })
    );
    Ok(())
}
