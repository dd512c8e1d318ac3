//! The two ends of the reliability suite (`tests/reliability.rs`, `../shared/RELIABILITY.md`),
//! usable by hand too: a journaling server and a load client that logs what was acknowledged.
//!
//! ```sh
//! cargo run --release --example fault_peer -- serve --listen 127.0.0.1:7100 --journal /tmp/j
//! cargo run --release --example fault_peer -- load --connect 127.0.0.1:7100 --acked /tmp/a --for 5
//! ```
//!
//! `serve` answers the RPC function `fault.put` (a source, an incarnation, a sequence number,
//! a payload and its CRC-32): it checks the CRC, appends `src inc seq ok|bad` to the journal
//! (one `write` per line, before the reply goes out, so that a reply means a journal line even
//! after `kill -9`) and answers with the CRC it computed. It prints `listening ADDR` once
//! it listens. `--node-id` keeps the node's id across restarts (a restart is a new incarnation).
//!
//! `load` connects, then keeps `--window` calls in flight for `--for` seconds, each with the
//! deadline `--deadline-ms`; a call answered with the right CRC appends `src inc seq ms` to
//! the `--acked` file (`ms`: when, from the start of the run). Calls that fail are counted by kind, and one that ends later than its
//! deadline plus 250 ms is counted as late, with the worst overrun. Lost sessions are connected
//! again on the next call (the peer's address is in the node's book). At the end it prints one
//! JSON line: `{"src", "inc", "start_unix_ms", "sent", "ok", "late", "max_over_ms",
//! "first_error_ms", "last_error_ms", "failed": {kind: n}}`, where the error times count from
//! the start of the run (`start_unix_ms`, wall clock), for the suite to compare with when it
//! injected a fault.

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
use shardcx::rpc::{RpcContext, RpcError};
use shardcx::shards::Placement;
use shardcx::{rpc_function, Node};

#[path = "common/cli.rs"]
mod cli;

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

rpc_function!(
    /// Journals a call and answers with the payload's CRC-32.
    pub FaultPut: Put => u32, id = 0x4641, name = "fault.put"
);

/// How late a call may end after its deadline before it counts as late.
const LATE_SLACK: Duration = Duration::from_millis(250);

#[derive(Parser, Debug)]
#[command(about = "The reliability suite's journaling server and load client")]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Serve fault.put, journaling every call.
    Serve {
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
    },
    /// Call fault.put with a window of calls in flight, logging what was acknowledged.
    Load {
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
        /// Calls in flight.
        #[arg(long, value_name = "N", default_value = "4", value_parser = cli::positive)]
        window: usize,
        /// Payload bytes (e.g. 64, 16k: above 8 KiB goes by rendezvous).
        #[arg(long, value_name = "B", default_value = "256", value_parser = cli::size)]
        size: usize,
        /// Pause between a task's calls, in milliseconds (0: none).
        #[arg(long, value_name = "MS", default_value_t = 2)]
        pause_ms: u64,
        /// The source id written in every call.
        #[arg(long, value_name = "ID", default_value_t = 1)]
        src: u64,
    },
}

fn main() {
    let args = Args::parse();
    let r = match args.cmd {
        Cmd::Serve {
            listen,
            journal,
            node_id,
            shards,
            serve_for,
        } => serve(listen, &journal, node_id, shards, serve_for),
        Cmd::Load {
            connect,
            acked,
            load_for,
            deadline_ms,
            window,
            size,
            pause_ms,
            src,
        } => load(&LoadArgs {
            connect,
            acked,
            load_for,
            deadline: Duration::from_millis(deadline_ms),
            window,
            size,
            pause: Duration::from_millis(pause_ms),
            src,
        }),
    };
    if let Err(e) = r {
        eprintln!("fault_peer: {e}");
        std::process::exit(1);
    }
}

fn node() -> shardcx::NodeBuilder {
    Node::builder()
        .placement(Placement::Unpinned)
        .transports("tcp")
        .io_memory(1 << 20)
        .psk(b"the reliability suite's key, 16+ bytes")
}

fn serve(
    listen: SocketAddr,
    journal: &std::path::Path,
    node_id: u64,
    shards: usize,
    serve_for: Duration,
) -> Result<(), String> {
    let path = journal.to_path_buf();
    // Each shard opens the journal for appending: one `write` per line is atomic.
    let open = move || {
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| format!("cannot open the journal {}: {e}", path.display()))
    };
    open()?;
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, stop.clone()).map_err(|e| e.to_string())?;
    }
    node()
        .shards(shards)
        .node_id(NodeId::new(node_id))
        .listen(listen)
        .rpc::<FaultPut, _, _>(move || {
            let file = RefCell::new(open().ok());
            move |_: &RpcContext, p: &ArchivedPut| {
                let crc = crc32fast::hash(&p.data);
                let ok = crc == p.crc.to_native();
                let line = format!(
                    "{} {} {} {}\n",
                    p.src.to_native(),
                    p.inc.to_native(),
                    p.seq.to_native(),
                    if ok { "ok" } else { "bad" }
                );
                match file.borrow_mut().as_mut() {
                    Some(f) => f
                        .write_all(line.as_bytes())
                        .map_err(|e| format!("journal: {e}"))?,
                    None => return Err("no journal".into()),
                }
                Ok(crc)
            }
        })
        .run(move |node: Node| {
            let stop = stop.clone();
            async move {
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
            }
        })
        .map_err(|e| e.to_string())?;
    Ok(())
}

struct LoadArgs {
    connect: SocketAddr,
    acked: PathBuf,
    load_for: Duration,
    deadline: Duration,
    window: usize,
    size: usize,
    pause: Duration,
    src: u64,
}

/// What the load saw.
#[derive(Default)]
struct Tally {
    sent: u64,
    ok: u64,
    late: u64,
    max_over: Duration,
    first_error: Option<Duration>,
    last_error: Option<Duration>,
    failed: BTreeMap<String, u64>,
}

/// The error's variant name (`Net.<variant>` for connection errors, `Node.<variant>` for the
/// node's others), for the tally.
impl Tally {
    /// Records a call's outcome (`Ok(true)`: answered with the right CRC), how far past its
    /// deadline it ended and when (from the start); true when it was acknowledged.
    fn record(&mut self, r: &Result<bool, RpcError>, over: Duration, at: Duration) -> bool {
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
        *self.failed.entry(failed).or_default() += 1;
        false
    }
}

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
    let (connect, load_for, deadline, window, size, pause, src) = (
        a.connect, a.load_for, a.deadline, a.window, a.size, a.pause, a.src,
    );
    let acked = Arc::new(std::sync::Mutex::new(acked));
    let out = node()
        .shards(1)
        .run(move |node: Node| {
            let acked = acked.clone();
            async move {
                let start = Instant::now();
                let start_unix_ms = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis());
                let peer = node
                    .connect_within(connect, Duration::from_secs(10))
                    .await
                    .map_err(|e| format!("cannot connect to {connect}: {e}"))?;
                node.add_peer_addr(peer.node_id(), connect);
                let tally = Rc::new(RefCell::new(Tally::default()));
                let mut tasks = Vec::new();
                for w in 0..window {
                    let (node, tally, acked) = (node.clone(), tally.clone(), acked.clone());
                    tasks.push(glommio::spawn_local(async move {
                        let rpc = node.rpc();
                        let mut seq = w as u64;
                        while start.elapsed() < load_for {
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
                            let r = rpc.call_within::<FaultPut>(peer, &put, deadline).await;
                            let took = t0.elapsed();
                            let ok = tally.borrow_mut().record(
                                &r.map(|c| c == crc),
                                took.saturating_sub(deadline),
                                start.elapsed(),
                            );
                            if ok {
                                if let Ok(mut f) = acked.lock() {
                                    let at = start.elapsed().as_millis();
                                    let _ = writeln!(f, "{src} {inc} {seq} {at}");
                                }
                            } else {
                                // Do not spin on a dead peer: the next call reconnects.
                                glommio::timer::sleep(Duration::from_millis(20)).await;
                            }
                            seq += window as u64;
                            if !pause.is_zero() {
                                glommio::timer::sleep(pause).await;
                            }
                        }
                    }));
                }
                for t in tasks {
                    t.await;
                }
                let t = tally.borrow();
                let ms = |d: Option<Duration>| d.map(|d| d.as_millis() as u64);
                Ok::<String, String>(
                    serde_json::json!({
                        "src": src,
                        "inc": inc,
                        "start_unix_ms": start_unix_ms as u64,
                        "sent": t.sent,
                        "ok": t.ok,
                        "late": t.late,
                        "max_over_ms": t.max_over.as_millis() as u64,
                        "first_error_ms": ms(t.first_error),
                        "last_error_ms": ms(t.last_error),
                        "failed": t.failed,
                    })
                    .to_string(),
                )
            }
        })
        .map_err(|e| e.to_string())?;
    for line in out {
        println!("{}", line?);
    }
    Ok(())
}
