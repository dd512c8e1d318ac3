//! `pingpong.py`'s round trip without Python: the cost of crossing into Python, measured.
//!
//! A plain thread drives a node through the same bridge as the Python module (`src/bridge.rs`,
//! included here as a module): it hands commands to a shard and blocks until the shard's
//! completion wakes it through the same socket pair, as the event loop does. The server echoes
//! each 8-byte message the same way. So the figures differ from `pingpong.py`'s by what Python
//! costs (the event loop, futures, the conversions), and from `shardcx bench --test tag-lat` by
//! what the bridge's thread hops cost.
//!
//! ```text
//! cargo run --release --example thread_pingpong --manifest-path python/Cargo.toml -- [--iters N] [--warmup N]
//! ```
//!
//! With neither `--listen PORT` nor `--connect HOST:PORT`, the server runs in a child process
//! (this program with `--listen 0`). Prints one JSON line (`--json`) or a sentence.

#![forbid(unsafe_code)]

#[path = "../src/bridge.rs"]
#[allow(dead_code)] // The example uses only part of the bridge.
mod bridge;

use std::collections::HashSet;
use std::io::{BufRead, BufReader};
use std::net::{IpAddr, SocketAddr};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use bridge::{dest, Bridge, Cmd, Config, Event, Value, USER_TAG_BITS};
use shardcx::tag::TagConfig;
use shardcx::NodeId;

const KEY: &[u8] = b"pingpong example key";
const SIZE: usize = 8;
const WAIT: Duration = Duration::from_secs(30);
const DEADLINE: Duration = Duration::from_secs(30);

/// An endpoint as the bridge reports it: (local id, remote id, remote node, remote shard).
#[derive(Clone, Copy)]
struct Ep {
    ep: u32,
    remote_ep: u32,
    node: u64,
    remote_shard: u16,
}

/// One node and the thread (this one) that waits for its events.
struct Side {
    bridge: Bridge,
    next_op: u64,
    /// Events taken while waiting for another.
    early: Vec<Event>,
    /// Sends handed over whose completion nobody waits for (as Python's `send`).
    handed_over: HashSet<u64>,
}

impl Side {
    fn start(listen: Option<SocketAddr>) -> Result<Self, String> {
        let bridge = Bridge::start(Config {
            shards: 1,
            psk: Some(KEY.to_vec()),
            transports: Some("tcp".into()),
            listen,
            pinned: false,
            max_message_size: 64 << 20,
            default_deadline: DEADLINE,
            io_memory: 1 << 20,
            spin: Duration::ZERO,
            unexpected: TagConfig::default(),
        })?;
        bridge
            .blocking_waits(WAIT)
            .map_err(|e| format!("socket: {e}"))?;
        Ok(Self {
            bridge,
            next_op: 1,
            early: Vec::new(),
            handed_over: HashSet::new(),
        })
    }

    fn op(&mut self) -> u64 {
        self.next_op += 1;
        self.next_op
    }

    /// Waits for the first event `pick` takes (others are kept for later).
    fn wait_for<T>(&mut self, mut pick: impl FnMut(&Event) -> Option<T>) -> Result<T, String> {
        let start = Instant::now();
        loop {
            if let Some(i) = self.early.iter().position(|e| pick(e).is_some()) {
                let ev = self.early.remove(i);
                return pick(&ev).ok_or_else(|| "event changed".to_string());
            }
            if start.elapsed() > WAIT {
                return Err("timed out waiting for the node".into());
            }
            for ev in self.bridge.wait() {
                match &ev {
                    Event::StartFailed(e) | Event::Stopped(Some(e)) => {
                        return Err(format!("node: {e:?}"))
                    }
                    Event::Failed { err, .. } => return Err(format!("operation: {err:?}")),
                    Event::Done { op, .. } if self.handed_over.remove(op) => {}
                    _ => self.early.push(ev),
                }
            }
        }
    }

    fn started(&mut self) -> Result<Option<u16>, String> {
        self.wait_for(|e| match e {
            Event::Started { port, .. } => Some(*port),
            _ => None,
        })
    }

    fn done(&mut self, op: u64) -> Result<Option<Vec<u8>>, String> {
        let mut got = None;
        self.wait_for(|e| match e {
            Event::Done { op: o, value } if *o == op => {
                got = match value {
                    Value::Tagged(_, data) => Some(Some(data.clone())),
                    _ => Some(None),
                };
                Some(())
            }
            _ => None,
        })?;
        got.ok_or_else(|| "no value".into())
    }

    fn send(&mut self, ep: Ep, data: Vec<u8>) -> Result<(), String> {
        let op = self.op();
        self.bridge.submit(
            0,
            Cmd::TagSend {
                op,
                dest: dest(ep.node, ep.remote_shard),
                tag: u64::from(ep.remote_ep) << USER_TAG_BITS,
                data,
                timeout: DEADLINE,
            },
        )?;
        self.handed_over.insert(op);
        Ok(())
    }

    fn recv(&mut self, ep: Ep) -> Result<Vec<u8>, String> {
        let op = self.op();
        self.bridge.submit(
            0,
            Cmd::TagRecv {
                op,
                node: NodeId::new(ep.node),
                pattern: u64::from(ep.ep) << USER_TAG_BITS,
                mask: shardcx::proto::wire::TagLayout::USER_MASK,
                timeout: DEADLINE,
            },
        )?;
        self.done(op)?.ok_or_else(|| "receive gave no data".into())
    }
}

fn serve(port: u16) -> Result<(), String> {
    let mut side = Side::start(Some(SocketAddr::new(IpAddr::from([127, 0, 0, 1]), port)))?;
    side.bridge.set_accepting(true);
    let port = side.started()?.ok_or("not listening")?;
    println!("listening {port}");
    let ep = side.wait_for(|e| match e {
        Event::Accept {
            ep,
            remote_ep,
            node,
            remote_shard,
            ..
        } => Some(Ep {
            ep: *ep,
            remote_ep: *remote_ep,
            node: *node,
            remote_shard: *remote_shard,
        }),
        _ => None,
    })?;
    let header = side.recv(ep)?;
    let pings = bridge::read_u64(&header, 0).ok_or("bad header")?;
    for _ in 0..pings {
        let data = side.recv(ep)?;
        side.send(ep, data)?;
    }
    side.bridge.stop();
    side.bridge.join(WAIT);
    Ok(())
}

fn client(addr: SocketAddr, warmup: u64, iters: u64, json: bool) -> Result<(), String> {
    let mut side = Side::start(None)?;
    side.started()?;
    let op = side.op();
    side.bridge.submit(
        0,
        Cmd::Connect {
            op,
            addr,
            timeout: Duration::from_secs(10),
            endpoint: true,
        },
    )?;
    let mut ep = None;
    side.wait_for(|e| match e {
        Event::Done {
            op: o,
            value:
                Value::Endpoint {
                    ep: id,
                    remote_ep,
                    node,
                    remote_shard,
                },
        } if *o == op => {
            ep = Some(Ep {
                ep: *id,
                remote_ep: *remote_ep,
                node: *node,
                remote_shard: *remote_shard,
            });
            Some(())
        }
        _ => None,
    })?;
    let ep = ep.ok_or("no endpoint")?;
    side.send(ep, (warmup + iters).to_le_bytes().to_vec())?;
    let mut lat = Vec::with_capacity(iters as usize);
    for i in 0..warmup + iters {
        let t0 = Instant::now();
        side.send(ep, vec![0u8; SIZE])?;
        let back = side.recv(ep)?;
        if back.len() != SIZE {
            return Err(format!("echo of {} bytes", back.len()));
        }
        if i >= warmup {
            lat.push(t0.elapsed());
        }
    }
    lat.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let p50 = us(lat[lat.len() / 2]);
    let p99 = us(lat[lat.len() * 99 / 100]);
    if json {
        println!(
            "{{\"lib\": \"rust-thread\", \"rtt_p50_us\": {p50:.3}, \"rtt_p99_us\": {p99:.3}, \
             \"iters\": {iters}}}"
        );
    } else {
        println!(
            "rust thread through the bridge: 8-byte round trip p50 {p50:.1} us, \
             p99 {p99:.1} us ({iters} iterations)"
        );
    }
    side.bridge.stop();
    side.bridge.join(WAIT);
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let value = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let num =
        |name: &str, default: u64| value(name).and_then(|v| v.parse().ok()).unwrap_or(default);
    let (iters, warmup) = (num("--iters", 10_000).max(1), num("--warmup", 1_000));
    let json = args.iter().any(|a| a == "--json");
    let out = if let Some(port) = value("--listen") {
        port.parse()
            .map_err(|_| format!("bad port {port:?}"))
            .and_then(serve)
    } else if let Some(addr) = value("--connect") {
        addr.parse()
            .map_err(|_| format!("bad address {addr:?} (HOST:PORT with an IP)"))
            .and_then(|a| client(a, warmup, iters, json))
    } else {
        run_both(warmup, iters, json)
    };
    match out {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("thread_pingpong: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The server in a child process, the client here.
fn run_both(warmup: u64, iters: u64, json: bool) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .args(["--listen", "0"])
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start the server: {e}"))?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .map_err(|e| e.to_string())?;
    let port: u16 = line
        .strip_prefix("listening ")
        .and_then(|p| p.trim().parse().ok())
        .ok_or_else(|| format!("server said {line:?}"))?;
    let out = client(
        SocketAddr::new(IpAddr::from([127, 0, 0, 1]), port),
        warmup,
        iters,
        json,
    );
    if out.is_err() {
        let _ = child.kill();
    }
    let _ = child.wait();
    out
}
