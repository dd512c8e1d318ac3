//! Helpers shared by the data-path tests (`dispatch.rs`, `rails.rs`): nodes of several shards
//! in one process over tcp on loopback, each in its own thread, every wait bounded.
//!
//! Each test binary uses a part of this module: what one of them leaves unused is not dead.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard, Once};
use std::time::{Duration, Instant};

use glommio::timer::sleep;

#[path = "../../../tests/common/stacks.rs"]
mod stacks;
use shardcx_shards::net::NetConfig;
use shardcx_shards::proto::NodeId;
use shardcx_shards::{MeshStats, NetStats, Placement, ShardCtx, ShardsBuilder};

/// Longest any one node may run, and any one wait of the test thread for a node.
pub(crate) const LIMIT: Duration = Duration::from_secs(40);
pub(crate) const KEY: &[u8] = b"sixteen byte key, and some more";
pub(crate) const A: NodeId = NodeId::new(0xA11CE);
pub(crate) const B: NodeId = NodeId::new(0xB0B);

/// Nodes of several shards each must fit the 8 MiB locked-memory limit, and the machine has two
/// cores: one test at a time.
pub(crate) fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

pub(crate) fn net_config() -> NetConfig {
    NetConfig {
        connect_timeout: Duration::from_secs(3),
        handshake_timeout: Duration::from_secs(3),
        linger: Duration::from_millis(200),
        ..NetConfig::default()
    }
}

/// [`net_config`] changed by `change`.
pub(crate) fn net_config_with(change: impl FnOnce(&mut NetConfig)) -> NetConfig {
    let mut c = net_config();
    change(&mut c);
    c
}

/// A node of `shards` unpinned shards over tcp, with the shared key and [`net_config`].
pub(crate) fn node(id: NodeId, shards: usize) -> ShardsBuilder {
    ShardsBuilder::new()
        .shard_count(shards)
        .placement(Placement::Unpinned)
        .transports("tcp")
        .io_memory(1 << 20)
        .node_id(id)
        .psk(KEY)
        .net(net_config())
}

/// What each shard of a [`Server`] reports when it ends.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ShardReport {
    pub(crate) stats: NetStats,
    pub(crate) mesh: MeshStats,
}

/// A listening node in its own thread, serving until [`Server::stop`] (or [`LIMIT`]).
pub(crate) struct Server {
    pub(crate) addr: SocketAddr,
    done: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<ShardReport>>,
}

impl Server {
    /// Starts `builder` (which must listen; its `on_start` hook registers the handlers) and
    /// waits until shard 0 has bound its listener.
    pub(crate) fn start(builder: ShardsBuilder) -> Server {
        Server::try_start(builder).unwrap_or_else(|e| panic!("server node failed: {e}"))
    }

    /// [`Server::start`], or why the node did not start (e.g. its address is taken).
    pub(crate) fn try_start(builder: ShardsBuilder) -> Result<Server, String> {
        let (tx, rx) = mpsc::channel::<Result<SocketAddr, String>>();
        let done = Arc::new(AtomicBool::new(false));
        let done2 = done.clone();
        let tx = Arc::new(Mutex::new(tx));
        let failed = tx.clone();
        let thread = std::thread::spawn(move || {
            let r = builder.run(move |ctx: Rc<ShardCtx>| {
                let (done, tx) = (done2.clone(), tx.clone());
                async move {
                    if let Some(addr) = ctx.listen_addr() {
                        let _ = tx.lock().unwrap().send(Ok(addr));
                    }
                    let deadline = Instant::now() + LIMIT;
                    while !done.load(Ordering::Acquire) && Instant::now() < deadline {
                        sleep(Duration::from_millis(5)).await;
                    }
                    ShardReport {
                        stats: ctx.net_stats(),
                        mesh: ctx.mesh_stats(),
                    }
                }
            });
            match r {
                Ok(reports) => reports,
                Err(e) => {
                    let _ = failed.lock().unwrap().send(Err(e.to_string()));
                    Vec::new()
                }
            }
        });
        let addr = recv_or_stacks(&rx, "server node start")?;
        Ok(Server { addr, done, thread })
    }

    /// Stops the node and returns its shards' reports, in shard order.
    pub(crate) fn stop(self) -> Vec<ShardReport> {
        self.done.store(true, Ordering::Release);
        join_bounded(self.thread, "server node")
    }
}

/// Joins `h` within [`LIMIT`].
pub(crate) fn join_bounded<T: Send + 'static>(h: std::thread::JoinHandle<T>, what: &str) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(h.join());
    });
    recv_or_stacks(&rx, what).unwrap_or_else(|_| panic!("{what} panicked"))
}

/// What `rx` brings within [`LIMIT`]; past it, the test fails with the stacks of this
/// process's threads on stderr first (what the hang waited for).
pub(crate) fn recv_or_stacks<T>(rx: &mpsc::Receiver<T>, what: &str) -> T {
    match rx.recv_timeout(LIMIT) {
        Ok(v) => v,
        Err(_) => {
            eprintln!(
                "{what}: still running after {LIMIT:?}; the threads of this test process:\n{}",
                stacks::stacks(std::process::id())
            );
            panic!("{what}: still running after {LIMIT:?}");
        }
    }
}

/// Runs `builder` with `f` on every shard in a thread of its own; returns the shards' results
/// in shard order, within [`LIMIT`].
pub(crate) fn run_node<T, F, Fut>(builder: ShardsBuilder, f: F) -> Vec<T>
where
    F: Fn(Rc<ShardCtx>) -> Fut + Send + Clone + 'static,
    Fut: std::future::Future<Output = T> + 'static,
    T: Send + 'static,
{
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(builder.run(f));
    });
    recv_or_stacks(&rx, "node").expect("node failed")
}

/// Waits (polling, bounded by `limit`) until `cond` holds; whether it did.
pub(crate) async fn wait_until(limit: Duration, cond: impl Fn() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        sleep(Duration::from_millis(1)).await;
    }
}

/// A barrier for the `n` shards of one node that crosses no mesh lane (so that it leaves the
/// mesh counters alone): each shard arrives and waits, bounded, for the others.
#[derive(Clone, Default)]
pub(crate) struct Barrier(Arc<AtomicUsize>);

impl Barrier {
    pub(crate) async fn wait(&self, n: usize, round: usize) {
        self.0.fetch_add(1, Ordering::AcqRel);
        let reached = wait_until(Duration::from_secs(20), || {
            self.0.load(Ordering::Acquire) >= n * round
        })
        .await;
        assert!(
            reached,
            "barrier round {round}: the other shards never came"
        );
    }
}

/// Messages a shard's mesh lanes have delivered to it so far: unchanged over a span means no
/// cross-shard hop involving this shard in that span.
pub(crate) fn mesh_taken(s: MeshStats) -> u64 {
    s.taken_by_driver + s.taken_by_task
}

/// A byte pattern that differs with `seed` and position.
pub(crate) fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            // xorshift64
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A checksum of `bytes` (FNV-1a).
pub(crate) fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// A self-checking message of `len` bytes (at least 16) for sequence number `seq`: the
/// sequence number, [`pattern`] bytes seeded by it, and the checksum of all that.
pub(crate) fn canary(seq: u64, len: usize) -> Vec<u8> {
    assert!(len >= 16);
    let mut v = seq.to_le_bytes().to_vec();
    v.extend_from_slice(&pattern(len - 16, seq));
    let sum = checksum(&v);
    v.extend_from_slice(&sum.to_le_bytes());
    v
}

/// The sequence number of a [`canary`] message if it is intact, else why not.
pub(crate) fn check_canary(bytes: &[u8]) -> Result<u64, String> {
    if bytes.len() < 16 {
        return Err(format!("{} bytes: too short", bytes.len()));
    }
    let seq = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    let (body, sum) = bytes.split_at(bytes.len() - 8);
    let sum = u64::from_le_bytes(sum.try_into().unwrap());
    if checksum(body) != sum {
        return Err(format!("seq {seq} ({} bytes): bad checksum", bytes.len()));
    }
    if body[8..] != pattern(body.len() - 8, seq)[..] {
        return Err(format!("seq {seq} ({} bytes): bad pattern", bytes.len()));
    }
    Ok(seq)
}

/// Frames a shard dropped for any reason but one: `dropped_unauthenticated`, which a correct
/// set-up may count too. A rail's `Join` that reaches its shard of the peer before that node
/// has recorded the session (its primary handshake completes on another shard) is refused
/// with `UnknownSession`, counted there as unauthenticated, and tried again by the joining
/// side (its `join_retries`).
pub(crate) fn dropped(s: &NetStats) -> u64 {
    s.dropped_malformed
        + s.dropped_misrouted
        + s.dropped_no_handler
        + s.dropped_other
        + s.dropped_too_large
        + s.dropped_expired
        + s.dropped_unmatched
}

pub(crate) fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Keeps the default panic hook quiet for panics whose message starts with `prefix` (tests
/// that make handlers panic on purpose); every other panic is reported as before.
pub(crate) fn quiet_panics_starting_with(prefix: &'static str) {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let msg = info
                .payload()
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| info.payload().downcast_ref::<&str>().copied())
                .unwrap_or("");
            if !msg.starts_with(prefix) {
                default(info);
            }
        }));
    });
}
