//! The suite's clients that are not plain load: malformed requests from an authenticated peer
//! (R2), deadlines and cancellation (R9), raw TCP connections to the listener (R7), timed
//! legitimate connects (R7) and a metrics scrape (the gauges oracle).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::rc::Rc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures_lite::future;
use serde_json::json;
use shardcx::proto::rpc::{decode_error, request_prefix, CallFlags};
use shardcx::proto::{FrameKind, ReqId};
use shardcx::rpc::{RpcError, RpcFunction};
use shardcx::shards::net::bootstrap::fetch_directory_blocking;
use shardcx::shards::net::Dest;
use shardcx::shards::NetConfig;
use shardcx::{Node, Peer};

use super::{cli, error_kind, node_with, FaultPut, FaultSlow, Put, Slow, LATE_SLACK};

/// Deterministic bytes and choices from a seed (xorshift64*), so that a run can be replayed.
pub(crate) struct Rng(u64);

impl Rng {
    /// A generator for `seed` (any value, 0 included).
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15 | 1)
    }

    /// The next 64 random bits.
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A number below `n` (`n` > 0).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// `len` random bytes.
    pub(crate) fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| (self.next() >> 56) as u8).collect()
    }
}

#[derive(clap::Args, Debug)]
pub(crate) struct HostileArgs {
    /// The server.
    #[arg(long, value_name = "ADDR")]
    connect: SocketAddr,
    /// The seed of every random payload.
    #[arg(long, value_name = "N", default_value_t = 1)]
    seed: u64,
    /// Requests of each malformed class.
    #[arg(long, value_name = "N", default_value_t = 20)]
    rounds: u64,
    /// The server's RPC argument limit (`serve --max-args`): one byte more is sent.
    #[arg(long, value_name = "B", value_parser = cli::size)]
    max_args: usize,
    /// The server's payload limit (`serve --max-message`): one byte more is sent.
    #[arg(long, value_name = "B", value_parser = cli::size)]
    max_message: usize,
    /// At the end, malformed requests (random archives) sent one after another until one is
    /// not refused as `BadRequest` (the server dropped this peer), at most this many.
    #[arg(long, value_name = "N", default_value_t = 0)]
    persist: u64,
}

#[derive(clap::Args, Debug)]
pub(crate) struct DeadlineArgs {
    /// The server.
    #[arg(long, value_name = "ADDR")]
    connect: SocketAddr,
    /// The seed of the mixed batch's deadlines.
    #[arg(long, value_name = "N", default_value_t = 1)]
    seed: u64,
}

#[derive(clap::Args, Debug)]
pub(crate) struct AttackArgs {
    /// The listener.
    #[arg(long, value_name = "ADDR")]
    connect: SocketAddr,
    /// Connections held open (reopened when the listener closes one).
    #[arg(long, value_name = "N", default_value_t = 200)]
    raw: usize,
    /// Seconds of attack.
    #[arg(long = "for", value_name = "SECS", default_value = "5", value_parser = cli::seconds)]
    attack_for: Duration,
    /// The seed of the garbage.
    #[arg(long, value_name = "N", default_value_t = 1)]
    seed: u64,
}

#[derive(clap::Args, Debug)]
pub(crate) struct ProbeArgs {
    /// The server.
    #[arg(long, value_name = "ADDR")]
    connect: SocketAddr,
    /// Directory fetches.
    #[arg(long, value_name = "N", default_value_t = 20)]
    count: usize,
}

/// A raw request's outcome: the server's error code, `Answered` (the handler ran and
/// replied), or the net error's variant.
type Outcome = String;

fn outcome(
    r: Result<(shardcx::proto::FrameHeader, Vec<u8>), shardcx::shards::NetError>,
) -> Outcome {
    match r {
        Ok((h, body)) if h.kind == FrameKind::RpcError => match decode_error(&body) {
            Ok(e) => format!("{:?}", e.code),
            Err(_) => "MalformedErrorReply".into(),
        },
        Ok((h, _)) if h.kind == FrameKind::RpcResponse => "Answered".into(),
        Ok((h, _)) => format!("{:?}", h.kind),
        Err(e) => format!(
            "Net.{}",
            format!("{e:?}")
                .split([' ', '{', '('])
                .next()
                .unwrap_or("?")
        ),
    }
}

/// A valid `fault.put` request payload (prefix and archive) for `seq` with `len` bytes of data.
fn put_request(src: u64, seq: u64, len: usize) -> Vec<u8> {
    let data = vec![7u8; len];
    let put = Put {
        src,
        inc: 1,
        seq,
        crc: crc32fast::hash(&data),
        data,
    };
    let mut p = request_prefix(FaultPut::schema(), CallFlags::NONE).to_vec();
    p.extend_from_slice(&rkyv::to_bytes::<rkyv::rancor::Error>(&put).unwrap());
    p
}

/// R2: connects as an authenticated peer and sends, `rounds` of each: random payloads,
/// truncated requests, bad prefixes (schema hash, reserved flags), random archives after a
/// valid prefix, an unknown function, arguments over the server's limit, payloads over its
/// frame limit, and stray replies and cancels; then one valid call. Prints the outcomes per
/// class.
pub(crate) fn hostile(a: &HostileArgs) -> Result<(), String> {
    let (connect, seed, rounds, persist) = (a.connect, a.seed, a.rounds, a.persist);
    let (max_args, max_message) = (a.max_args, a.max_message);
    let mut net = NetConfig::default();
    // Ours above the server's, so that the oversized frames leave this node.
    net.max_message_size = (max_message as u64 + 1).max(net.max_message_size) * 2;
    let out = node_with(None)
        .shards(1)
        .net(net)
        .run(move |node: Node| async move {
            let peer = node
                .connect_within(connect, Duration::from_secs(10))
                .await
                .map_err(|e| format!("cannot connect to {connect}: {e}"))?;
            // A call after the session is lost connects again (the persist phase's last call).
            node.add_peer_addr(peer.node_id(), connect);
            let ctx = node.shard_ctx().clone();
            let dest = Dest::from(peer.node_id());
            let mut rng = Rng::new(seed);
            let mut classes: BTreeMap<&str, Vec<Vec<u8>>> = BTreeMap::new();
            let put_id = FaultPut::ID.get();
            for i in 0..rounds {
                let valid = put_request(7700, i, 1 + rng.below(512) as usize);
                let len = rng.below(1024) as usize;
                classes.entry("random").or_default().push(rng.bytes(len));
                let cut = rng.below(valid.len() as u64) as usize;
                classes
                    .entry("truncated")
                    .or_default()
                    .push(valid[..cut].to_vec());
                let mut bad = valid.clone();
                if i % 2 == 0 {
                    bad[rng.below(8) as usize] ^= 1 << rng.below(8); // the schema hash
                } else {
                    bad[11] |= 0x80; // a reserved flag bit
                }
                classes.entry("bad-prefix").or_default().push(bad);
                let mut archive = request_prefix(FaultPut::schema(), CallFlags::NONE).to_vec();
                let len = 1 + rng.below(256) as usize;
                archive.extend(rng.bytes(len));
                classes.entry("bad-archive").or_default().push(archive);
            }
            let mut results: BTreeMap<String, BTreeMap<Outcome, u64>> = BTreeMap::new();
            for (class, payloads) in classes {
                for p in payloads {
                    let r = ctx
                        .request(
                            dest,
                            FrameKind::RpcRequest,
                            put_id,
                            p,
                            Duration::from_secs(2),
                        )
                        .await;
                    *results
                        .entry(class.into())
                        .or_default()
                        .entry(outcome(r))
                        .or_default() += 1;
                }
            }
            // The same requests to a function the server does not have, and over its limits;
            // the oversized frames all at once (each waits for its deadline).
            for i in 0..rounds {
                let r = ctx
                    .request(
                        dest,
                        FrameKind::RpcRequest,
                        0x4699,
                        put_request(7700, i, 64),
                        Duration::from_secs(2),
                    )
                    .await;
                *results
                    .entry("unknown-function".into())
                    .or_default()
                    .entry(outcome(r))
                    .or_default() += 1;
                let r = ctx
                    .request(
                        dest,
                        FrameKind::RpcRequest,
                        put_id,
                        put_request(7700, i, max_args + 1),
                        Duration::from_secs(2),
                    )
                    .await;
                *results
                    .entry("over-args".into())
                    .or_default()
                    .entry(outcome(r))
                    .or_default() += 1;
            }
            let big: Vec<_> = (0..rounds.min(4))
                .map(|i| {
                    let ctx = ctx.clone();
                    let mut p = request_prefix(FaultPut::schema(), CallFlags::NONE).to_vec();
                    p.resize(max_message + 1 + i as usize, 0);
                    glommio::spawn_local(async move {
                        let r = ctx
                            .request(
                                dest,
                                FrameKind::RpcRequest,
                                put_id,
                                p,
                                Duration::from_secs(1),
                            )
                            .await;
                        outcome(r)
                    })
                })
                .collect();
            for t in big {
                *results
                    .entry("over-frame".into())
                    .or_default()
                    .entry(t.await)
                    .or_default() += 1;
            }
            // Replies and cancels nobody asked for: dropped (counted) by the server.
            let mut stray = 0u64;
            for i in 0..rounds {
                for kind in [
                    FrameKind::RpcResponse,
                    FrameKind::RpcError,
                    FrameKind::RmaReply,
                    FrameKind::RpcCancel,
                ] {
                    let len = rng.below(64) as usize;
                    let sent = ctx
                        .send_frame(dest, kind, put_id, ReqId::new(1 + i * 7919), rng.bytes(len))
                        .await;
                    stray += u64::from(sent.is_ok());
                }
            }
            // And the hostile peer is still served when it behaves.
            let put = Put {
                src: 7700,
                inc: 2,
                seq: 0,
                crc: crc32fast::hash(b"fine"),
                data: b"fine".to_vec(),
            };
            let valid = node
                .rpc()
                .call_within::<FaultPut>(peer, &put, Duration::from_secs(2))
                .await;
            // A peer that keeps sending malformed requests is dropped: the request that ends
            // the run is not answered (the server closed the rails), and a call after it,
            // which connects again, is refused.
            let (mut sent, mut ended, mut after) = (0u64, String::new(), String::new());
            if persist > 0 {
                for _ in 0..persist {
                    let mut archive = request_prefix(FaultPut::schema(), CallFlags::NONE).to_vec();
                    let len = 1 + rng.below(256) as usize;
                    archive.extend(rng.bytes(len));
                    let r = ctx
                        .request(
                            dest,
                            FrameKind::RpcRequest,
                            put_id,
                            archive,
                            Duration::from_secs(2),
                        )
                        .await;
                    sent += 1;
                    let o = outcome(r);
                    if o != "BadRequest" {
                        ended = o;
                        break;
                    }
                }
                let put = Put {
                    src: 7700,
                    inc: 3,
                    seq: 0,
                    crc: crc32fast::hash(b"after"),
                    data: b"after".to_vec(),
                };
                after = match node
                    .rpc()
                    .call_within::<FaultPut>(peer, &put, Duration::from_secs(3))
                    .await
                {
                    Ok(_) => "ok".to_owned(),
                    Err(e) => e.to_string(),
                };
            }
            Ok::<_, String>(json!({
                "classes": results,
                "persist": {"sent": sent, "ended": ended, "after": after},
                "stray_sent": stray,
                "valid": match valid {
                    Ok(c) if c == put.crc => "ok".to_owned(),
                    Ok(c) => format!("wrong crc {c}"),
                    Err(e) => error_kind(&e),
                },
            }))
        })
        .map_err(|e| e.to_string())?;
    for r in out {
        println!("{}", r?);
    }
    Ok(())
}

/// How a call ended, and how far past its deadline.
#[derive(Default)]
struct Case {
    outcomes: BTreeMap<String, u64>,
    max_over: Duration,
    /// Sequence numbers the server must not have journaled.
    never: Vec<u64>,
    /// Sequence numbers acknowledged (the server must have journaled them).
    acked: Vec<u64>,
}

impl Case {
    fn record<T>(&mut self, seq: u64, r: &Result<T, RpcError>, took: Duration, deadline: Duration) {
        let kind = match r {
            Ok(_) => {
                self.acked.push(seq);
                "Ok".to_owned()
            }
            Err(e) => error_kind(e),
        };
        *self.outcomes.entry(kind).or_default() += 1;
        self.max_over = self.max_over.max(took.saturating_sub(deadline));
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "outcomes": self.outcomes,
            "max_over_ms": self.max_over.as_millis() as u64,
            "never": self.never,
            "acked": self.acked,
        })
    }
}

/// The `src` of R9's calls.
pub(crate) const DEADLINES_SRC: u64 = 900;

/// R9: calls with deadlines 0, 1 ms and `Duration::MAX`; a call dropped before it is polled,
/// one given up in flight while the handler sleeps, one whose deadline passes in the handler,
/// one dropped after its reply; then 200 calls at once with deadlines drawn from the seed.
/// Prints each case's outcomes, how late the latest ended, what the server must not have
/// journaled and what was acknowledged; then this shard's pending requests and cancels sent.
pub(crate) fn deadlines(a: &DeadlineArgs) -> Result<(), String> {
    let (connect, seed) = (a.connect, a.seed);
    let inc = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64);
    let out = node_with(None)
        .shards(1)
        .run(move |node: Node| async move {
            let peer = node
                .connect_within(connect, Duration::from_secs(10))
                .await
                .map_err(|e| format!("cannot connect to {connect}: {e}"))?;
            let rpc = node.rpc();
            let mut seq = 0u64;
            let mut next = || {
                seq += 1;
                seq
            };
            let put = |seq: u64| Put {
                src: DEADLINES_SRC,
                inc,
                seq,
                crc: crc32fast::hash(&[1, 2, 3]),
                data: vec![1, 2, 3],
            };
            let slow = |seq: u64, ms: u32| Slow {
                src: DEADLINES_SRC,
                inc,
                seq,
                ms,
            };
            let mut cases: BTreeMap<&str, Case> = BTreeMap::new();
            // Deadline zero: refused before anything is sent.
            for _ in 0..10 {
                let s = next();
                let t0 = Instant::now();
                let r = rpc
                    .call_within::<FaultPut>(peer, &put(s), Duration::ZERO)
                    .await;
                let c = cases.entry("zero").or_default();
                c.record(s, &r, t0.elapsed(), Duration::ZERO);
                c.never.push(s);
            }
            for (name, deadline) in [("one-ms", Duration::from_millis(1)), ("max", Duration::MAX)] {
                for _ in 0..20 {
                    let s = next();
                    let t0 = Instant::now();
                    let r = rpc.call_within::<FaultPut>(peer, &put(s), deadline).await;
                    cases
                        .entry(name)
                        .or_default()
                        .record(s, &r, t0.elapsed(), deadline);
                }
            }
            // Dropped before it was ever polled.
            {
                let s = next();
                let args = put(s);
                let call = rpc.call_within::<FaultPut>(peer, &args, Duration::from_secs(1));
                drop(call);
                cases.entry("dropped-unpolled").or_default().never.push(s);
            }
            // Given up in flight while the handler sleeps: the cancel reaches the server, which
            // drops the handler's task before it journals.
            for _ in 0..5 {
                let s = next();
                let args = slow(s, 400);
                let call = rpc.call_within::<FaultSlow>(peer, &args, Duration::from_secs(2));
                let given_up = future::or(async { Some(call.await) }, async {
                    glommio::timer::sleep(Duration::from_millis(50)).await;
                    None
                })
                .await;
                let c = cases.entry("cancelled-in-handler").or_default();
                match given_up {
                    None => {
                        *c.outcomes.entry("GivenUp".into()).or_default() += 1;
                        c.never.push(s);
                    }
                    Some(r) => c.record(s, &r, Duration::ZERO, Duration::ZERO),
                }
            }
            // The deadline passes while the handler sleeps.
            for _ in 0..5 {
                let s = next();
                let deadline = Duration::from_millis(100);
                let t0 = Instant::now();
                let r = rpc
                    .call_within::<FaultSlow>(peer, &slow(s, 400), deadline)
                    .await;
                let c = cases.entry("deadline-in-handler").or_default();
                c.record(s, &r, t0.elapsed(), deadline);
                c.never.push(s);
            }
            // Answered, then dropped.
            for _ in 0..5 {
                let s = next();
                let deadline = Duration::from_secs(2);
                let t0 = Instant::now();
                let r = rpc
                    .call_within::<FaultSlow>(peer, &slow(s, 10), deadline)
                    .await;
                cases
                    .entry("after-reply")
                    .or_default()
                    .record(s, &r, t0.elapsed(), deadline);
            }
            // 200 at once, with deadlines drawn from the seed: each ends exactly once.
            let mut rng = Rng::new(seed);
            let choices = [0, 1, 5, 50, 1000, u64::MAX];
            let completions = Rc::new(RefCell::new(Case::default()));
            let tasks: Vec<_> = (0..200)
                .map(|_| {
                    let s = next();
                    let ms = choices[rng.below(choices.len() as u64) as usize];
                    let deadline = if ms == u64::MAX {
                        Duration::MAX
                    } else {
                        Duration::from_millis(ms)
                    };
                    let (rpc, args, completions) = (rpc.clone(), put(s), completions.clone());
                    glommio::spawn_local(async move {
                        let t0 = Instant::now();
                        let r = rpc.call_within::<FaultPut>(peer, &args, deadline).await;
                        completions
                            .borrow_mut()
                            .record(s, &r, t0.elapsed(), deadline);
                    })
                })
                .collect();
            for t in tasks {
                t.await;
            }
            // Cancels and late replies settle.
            glommio::timer::sleep(Duration::from_millis(600)).await;
            let ctx = node.shard_ctx();
            let mixed = completions.borrow();
            let mut json_cases: BTreeMap<&str, serde_json::Value> =
                cases.iter().map(|(k, c)| (*k, c.json())).collect();
            json_cases.insert("mixed", mixed.json());
            Ok::<_, String>(json!({
                "inc": inc,
                "cases": json_cases,
                "mixed_completions": mixed.outcomes.values().sum::<u64>(),
                "pending_after": ctx.pending_requests(),
                "cancels_sent": ctx.net_stats().cancels_sent,
                "late_slack_ms": LATE_SLACK.as_millis() as u64,
            }))
        })
        .map_err(|e| e.to_string())?;
    for r in out {
        println!("{}", r?);
    }
    Ok(())
}

/// How an attacking connection behaves.
#[derive(Clone, Copy)]
enum Mode {
    /// Connects and sends nothing.
    Silent,
    /// One byte every round.
    Drip,
    /// 64 KiB of random bytes, then nothing.
    Garbage,
}

/// R7: holds `raw` TCP connections to the listener for `attack_for`, a third each silent,
/// dripping a byte every 100 ms, or sending 64 KiB of garbage; a connection the listener
/// closes is opened again. Prints how many connects were made, failed, and closed by the
/// listener.
pub(crate) fn attack(a: &AttackArgs) -> Result<(), String> {
    let mut rng = Rng::new(a.seed);
    let modes = [Mode::Silent, Mode::Drip, Mode::Garbage];
    let mut conns: Vec<(Mode, Option<TcpStream>)> =
        (0..a.raw).map(|i| (modes[i % 3], None)).collect();
    let (mut connects, mut failed, mut closed) = (0u64, 0u64, 0u64);
    let until = Instant::now() + a.attack_for;
    let mut buf = [0u8; 4096];
    while Instant::now() < until {
        for (mode, conn) in &mut conns {
            if conn.is_none() {
                match TcpStream::connect_timeout(&a.connect, Duration::from_millis(500)) {
                    Ok(s) => {
                        connects += 1;
                        let _ = s.set_nonblocking(true);
                        let mut s = s;
                        if let Mode::Garbage = mode {
                            let _ = s.write(&rng.bytes(64 << 10));
                        }
                        *conn = Some(s);
                    }
                    Err(_) => failed += 1,
                }
                continue;
            }
            let Some(s) = conn.as_mut() else { continue };
            let gone = match s.read(&mut buf) {
                Ok(0) => true,
                Ok(_) => false,
                Err(e) if e.kind() == ErrorKind::WouldBlock => false,
                Err(_) => true,
            } || (matches!(mode, Mode::Drip)
                && matches!(s.write(&rng.bytes(1)), Err(e) if e.kind() != ErrorKind::WouldBlock));
            if gone {
                closed += 1;
                *conn = None;
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(conns);
    println!(
        "{}",
        json!({"connects": connects, "connect_failures": failed, "closed_by_listener": closed})
    );
    Ok(())
}

/// R7: `count` directory fetches from the listener, 50 ms apart, timed; then one full connect
/// and call. Prints the fetch times, the failures, the connect's time and the call's outcome.
pub(crate) fn probe(a: &ProbeArgs) -> Result<(), String> {
    let mut lat_ms = Vec::new();
    let mut failures = BTreeMap::<String, u64>::new();
    for _ in 0..a.count {
        let t0 = Instant::now();
        match fetch_directory_blocking(a.connect, Duration::from_secs(2)) {
            Ok(_) => lat_ms.push(t0.elapsed().as_millis() as u64),
            Err(e) => {
                let kind = format!("{e:?}");
                let kind = kind.split([' ', '{', '(']).next().unwrap_or("?").to_owned();
                *failures.entry(kind).or_default() += 1;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let connect = a.connect;
    let out = node_with(None)
        .shards(1)
        .run(move |node: Node| async move {
            let t0 = Instant::now();
            let peer: Peer = match node.connect_within(connect, Duration::from_secs(5)).await {
                Ok(p) => p,
                Err(e) => return json!({"connect": e.to_string()}),
            };
            let connect_ms = t0.elapsed().as_millis() as u64;
            let put = Put {
                src: 800,
                inc: SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(1, |d| d.as_nanos() as u64),
                seq: 0,
                crc: crc32fast::hash(b"probe"),
                data: b"probe".to_vec(),
            };
            let r = node
                .rpc()
                .call_within::<FaultPut>(peer, &put, Duration::from_secs(2))
                .await;
            json!({"connect": "ok", "connect_ms": connect_ms,
                   "call": r.map_or_else(|e| error_kind(&e), |_| "ok".into())})
        })
        .map_err(|e| e.to_string())?;
    println!(
        "{}",
        json!({"lat_ms": lat_ms, "failures": failures, "full": out.first()})
    );
    Ok(())
}

/// A node's metrics (`GET http://AT/metrics`).
pub(crate) fn scrape(at: SocketAddr) -> Result<String, String> {
    ureq::get(&format!("http://{at}/metrics"))
        .timeout(Duration::from_secs(3))
        .call()
        .map_err(|e| format!("scrape {at}: {e}"))?
        .into_string()
        .map_err(|e| format!("scrape {at}: {e}"))
}
