//! Checked remote memory between two nodes: the server registers a region on each of its shards
//! and hands the descriptors to the client by active message; every client shard puts to and
//! gets from each region, checks what it reads back, and prints put and get latency
//! percentiles by route. Then the client shows refusals: an out-of-bounds put, and a put with
//! a descriptor the server has revoked; the server shows its memory unchanged by them.
//!
//! With `--trusted` (on both sides when they are two processes) both nodes also turn trusted
//! mode on (`NodeBuilder::trusted_rma`: native UCX RMA with packed remote keys, **no
//! protection of the target's memory**), the server registers a trusted region on each shard
//! too, and the client measures both modes, checked and trusted, side by side, for 8-byte and
//! 64 KiB accesses (or `--size` only, when given), then shows that an out-of-bounds trusted put
//! is refused by the initiator. Trusted mode needs shared memory or RDMA between the nodes (it
//! refuses peers only tcp reaches), so `--trusted` makes the default transports `sm,tcp`:
//! sessions and checked mode run over tcp, trusted endpoints over shared memory.
//!
//! ```text
//! cargo run --release --example rma_put_get                      # both nodes in this process
//! cargo run --release --example rma_put_get -- --trusted         # checked vs trusted
//! cargo run --release --example rma_put_get -- --listen 127.0.0.1:13338 [--for 60]   # server
//! cargo run --release --example rma_put_get -- --connect 127.0.0.1:13338             # client
//! ```
//!
//! Options: `--count N` puts and gets per client shard, region, mode and size (default 10000,
//! or 1000 with `--trusted`), `--size B` bytes per access (default 8), `--shards N` per node
//! (default 2), `--tls LIST` (default `tcp`, or `sm,tcp` with `--trusted`; listening and
//! connecting need tcp in UCX 1.12), `--trusted`. The key is fixed: it is an example.
//!
//! Client shards measure one after the other (each waits for the previous one), so that their
//! loops do not compete for the CPU; the server's shards serve all of them.
//!
//! Routes: a client shard that owns the server's connection sends itself ("owner"), another one
//! forwards to it ("forwarded"); on the server, the request arrives on its owner shard of the
//! client, which serves a region it holds itself ("local") or forwards to the region's shard
//! ("forwarded").

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // An example may panic: a panic is a failure it reports.

use std::cell::{Cell, RefCell};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use glommio::channels::local_channel::{self, LocalReceiver, LocalSender};
use glommio::timer::sleep;
use hdrhistogram::Histogram;
use shardcx::bench::format_size;
use shardcx::rma::{
    Permissions, Region, RemoteRegion, RmaOpError, TrustedDescriptor, TrustedRegion,
};
use shardcx::{AmId, AmMsg, Error, Node, NodeId, OwnedAmMsg, Peer, ShardId};

#[path = "common/cli.rs"]
mod cli;

const KEY: &[u8] = b"rma_put_get example pre-shared key";
/// Client → server: send me the descriptor of your region on shard `want`.
const ASK: AmId = AmId::new(1);
/// Client → server: revoke your region on shard `want`, send me the new descriptor.
const REVOKE: AmId = AmId::new(2);
/// Client → server: print and send me the checksum of your region on shard `want`.
const CHECK: AmId = AmId::new(3);
/// Server → client: a descriptor (answers `ASK` and `REVOKE`).
const DESC: AmId = AmId::new(4);
/// Server → client: a checksum (answers `CHECK`).
const SUM: AmId = AmId::new(5);
/// Client → server: send me the descriptor of your trusted region on shard `want`.
const ASK_TRUSTED: AmId = AmId::new(6);
/// Server → client: a trusted descriptor, or nothing if the server is not in trusted mode.
const TRUSTED_DESC: AmId = AmId::new(7);
/// Bytes of each server region (at least; see `region_len`).
const REGION_LEN: usize = 64 << 10;
/// The large access size measured with `--trusted`.
const LARGE: usize = 64 << 10;
/// Longest wait for an answer from the other node.
const ANSWER_LIMIT: Duration = Duration::from_secs(5);

struct Opts {
    role: cli::Role,
    serve_for: Duration,
    count: u32,
    size: usize,
    shards: usize,
    tls: String,
    /// Access sizes to measure.
    sizes: Vec<usize>,
    trusted: bool,
}

/// Bytes of each server region: room for every client shard's largest access. Both sides of
/// a two-process run compute it from the same options, and the client checks the descriptors.
fn region_len(o: &Opts) -> usize {
    let largest = o.sizes.iter().copied().max().unwrap_or(o.size);
    REGION_LEN.max(largest.saturating_mul(o.shards))
}

/// Remote memory put/get between two nodes, checked by default (`--trusted`: native).
#[derive(clap::Parser)]
#[command(name = "rma_put_get")]
struct Args {
    #[command(flatten)]
    role: cli::Role,
    /// How long the server (--listen) serves, in seconds.
    #[arg(long = "for", value_name = "SECS", default_value = "60", value_parser = cli::seconds)]
    serve_for: Duration,
    /// Operations per client shard (default 10000; 1000 with --trusted).
    #[arg(long, value_name = "N")]
    count: Option<u32>,
    /// Access size, 1 B to 16 MiB (default 8; with --trusted both 8 B and 1 MiB).
    #[arg(long, value_name = "B", value_parser = cli::size)]
    size: Option<usize>,
    /// Shards per node.
    #[arg(long, value_name = "N", default_value = "2", value_parser = cli::positive)]
    shards: usize,
    /// UCX transports (default tcp; sm,tcp with --trusted).
    #[arg(long, value_name = "LIST")]
    tls: Option<String>,
    /// Trusted mode: native UCX RMA with packed remote keys.
    #[arg(long)]
    trusted: bool,
}

fn opts() -> Opts {
    let a = <Args as clap::Parser>::parse();
    if a.size.is_some_and(|s| s == 0 || s > 16 << 20) {
        <Args as clap::CommandFactory>::command()
            .error(
                clap::error::ErrorKind::ValueValidation,
                "--size must be within 1 B..=16 MiB",
            )
            .exit();
    }
    let size = a.size.unwrap_or(8);
    Opts {
        role: a.role,
        serve_for: a.serve_for,
        count: a.count.unwrap_or(if a.trusted { 1000 } else { 10_000 }),
        size,
        shards: a.shards,
        tls: a
            .tls
            .unwrap_or_else(|| if a.trusted { "sm,tcp" } else { "tcp" }.into()),
        sizes: match a.size {
            None if a.trusted => vec![8, LARGE],
            _ => vec![size],
        },
        trusted: a.trusted,
    }
}

fn node(o: &Opts, id: u64) -> shardcx::NodeBuilder {
    let b = Node::builder()
        .shards(o.shards)
        .placement(shardcx::shards::Placement::Unpinned)
        .transports(&o.tls)
        .node_id(NodeId::new(id))
        .psk(KEY)
        // Two nodes may share this process: 1 MiB of io memory per shard fits 8 MiB memlock.
        .io_memory(1 << 20);
    // Trusted mode only when asked: it lets the peer write anywhere in this process.
    if o.trusted {
        b.trusted_rma()
    } else {
        b
    }
}

/// A checksum (FNV-1a).
fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

thread_local! {
    /// The server's region on this shard.
    static REGION: RefCell<Option<Region>> = const { RefCell::new(None) };
    /// The server's trusted region on this shard (with `--trusted`).
    static TRUSTED: RefCell<Option<TrustedRegion>> = const { RefCell::new(None) };
    /// The checksum the server reported last, on this shard.
    static LAST_SUM: Cell<Option<u64>> = const { Cell::new(None) };
    /// Answers for this client shard.
    static ANSWERS: RefCell<Option<LocalSender<OwnedAmMsg>>> = const { RefCell::new(None) };
}

/// A control header: the client shard waiting for the answer, and the server shard meant.
fn header(origin: ShardId, want: u16) -> [u8; 4] {
    let mut h = [0u8; 4];
    h[..2].copy_from_slice(&origin.get().to_le_bytes());
    h[2..].copy_from_slice(&want.to_le_bytes());
    h
}

/// The server's handler of `ASK`, `REVOKE` and `CHECK`: runs on the owner shard of the client,
/// does the work on the shard holding the region, answers with its shard count and owner shard
/// in the header so the client can name the routes.
fn on_control(node: &Node, msg: AmMsg) {
    let h = msg.header();
    if h.len() != 4 {
        return;
    }
    let want = u16::from_le_bytes([h[2], h[3]]) % node.shard_count() as u16;
    let mut answer_header = h[..2].to_vec();
    answer_header.extend_from_slice(&want.to_le_bytes());
    answer_header.extend_from_slice(&(node.shard_count() as u16).to_le_bytes());
    answer_header.extend_from_slice(&node.owner_of(msg.from()).get().to_le_bytes());
    let (id, from, ctx) = (msg.id(), msg.from(), node.shard_ctx().clone());
    glommio::spawn_local(async move {
        let job = move |_| async move { on_region_shard(id) };
        match ctx.forward(ShardId::new(want), job).await {
            Ok(Some((answer, payload))) => {
                if let Err(e) = from.am_send(answer, &answer_header, &payload).await {
                    eprintln!("server: answer failed: {e}");
                }
            }
            Ok(None) => eprintln!("server: no region on shard {want} yet"),
            Err(e) => eprintln!("server: forward failed: {e}"),
        }
    })
    .detach();
}

/// On the shard holding the region: the answer to control message `id`.
fn on_region_shard(id: AmId) -> Option<(AmId, Vec<u8>)> {
    if id == ASK_TRUSTED {
        // An empty answer: this server is not in trusted mode.
        let bytes = TRUSTED.with(|t| t.borrow().as_ref().map(|t| t.descriptor().to_bytes()));
        return Some((TRUSTED_DESC, bytes.unwrap_or_default()));
    }
    REGION.with(|r| {
        let r = r.borrow();
        let region = r.as_ref()?;
        let d = region.descriptor();
        match id {
            ASK => Some((DESC, d.to_bytes().to_vec())),
            REVOKE => {
                let new = region.revoke().expect("revoke");
                println!(
                    "server: revoked region {} on shard {}: generation {} -> {}",
                    d.id(),
                    d.shard(),
                    d.generation(),
                    new.generation()
                );
                Some((DESC, new.to_bytes().to_vec()))
            }
            CHECK => {
                let sum = region.read(checksum).expect("read region");
                let verdict = match LAST_SUM.with(|l| l.replace(Some(sum))) {
                    None => "first check",
                    Some(last) if last == sum => "unchanged since the last check",
                    Some(_) => "changed since the last check",
                };
                println!(
                    "server: region {} on shard {}: checksum {sum:016x} ({verdict})",
                    d.id(),
                    d.shard()
                );
                Some((SUM, sum.to_le_bytes().to_vec()))
            }
            _ => None,
        }
    })
}

/// The server: one region per shard, control messages answered until `stop` or `--for`.
fn serve(o: &Opts, addr: SocketAddr, bound: mpsc::Sender<SocketAddr>, stop: Arc<AtomicBool>) {
    let until = Instant::now() + o.serve_for;
    let len = region_len(o);
    node(o, 2)
        .listen(addr)
        .on_am(ASK, || on_control)
        .on_am(REVOKE, || on_control)
        .on_am(CHECK, || on_control)
        .on_am(ASK_TRUSTED, || on_control)
        .run(move |node: Node| {
            let (bound, stop) = (bound.clone(), stop.clone());
            async move {
                let fill: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
                if node.trusted_rma_enabled() {
                    let t = node
                        .register_trusted_region(len, Permissions::READ_WRITE)
                        .expect("register trusted region");
                    t.write_at(0, &fill).expect("fill trusted region");
                    TRUSTED.with(|r| *r.borrow_mut() = Some(t));
                }
                let region = node
                    .register_region(fill, Permissions::READ_WRITE, None)
                    .expect("register region");
                REGION.with(|r| *r.borrow_mut() = Some(region));
                if node.shard() == ShardId::new(0) {
                    let _ = bound.send(node.listen_addr().unwrap());
                }
                while !stop.load(Ordering::Acquire) && Instant::now() < until {
                    sleep(Duration::from_millis(10)).await;
                }
                REGION.with(|r| r.borrow_mut().take());
                // Unmapped only now that no client will use its descriptor: in trusted mode
                // nothing stops a peer from writing memory that was given back.
                TRUSTED.with(|r| r.borrow_mut().take());
            }
        })
        .expect("server node");
}

fn deliver(msg: OwnedAmMsg) {
    ANSWERS.with(|a| {
        if let Some(tx) = a.borrow().as_ref() {
            let _ = tx.try_send(msg);
        }
    });
}

/// The client's handler of `DESC` and `SUM`: to the shard named in the header.
fn on_answer(node: &Node, msg: AmMsg) {
    let Some(h) = msg.header().get(..2) else {
        return;
    };
    let origin = ShardId::new(u16::from_le_bytes([h[0], h[1]]));
    let msg = msg.into_owned();
    if origin == node.shard() {
        deliver(msg);
    } else {
        let ctx = node.shard_ctx().clone();
        glommio::spawn_local(async move {
            let _ = ctx
                .forward(origin, move |_| async move { deliver(msg) })
                .await;
        })
        .detach();
    }
}

/// Sends control message `id` about server shard `want` and waits for the answer.
async fn call(
    peer: Peer,
    rx: &LocalReceiver<OwnedAmMsg>,
    me: ShardId,
    id: AmId,
    want: u16,
) -> OwnedAmMsg {
    peer.am_send(id, &header(me, want), &[])
        .await
        .expect("send control message");
    futures_lite::future::or(async { rx.recv().await }, async {
        sleep(ANSWER_LIMIT).await;
        None
    })
    .await
    .expect("no answer from the server")
}

/// A region of the server, as the client learnt it.
struct Remote {
    desc: RemoteRegion,
    /// Whether the server serves it on the shard that receives the client's requests.
    local: bool,
    /// The trusted region of the same server shard (with `--trusted`).
    trusted: Option<TrustedDescriptor>,
}

/// Which way a put or get goes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Carried as a request, checked by the holder.
    Checked,
    /// Native UCX RMA with the holder's remote key.
    Trusted,
}

/// The descriptor in a `DESC` answer, and what its header says about the server.
fn remote_of(msg: &OwnedAmMsg) -> (Remote, u16) {
    let h = msg.header();
    let shard = u16::from_le_bytes([h[2], h[3]]);
    let shards = u16::from_le_bytes([h[4], h[5]]);
    let owner = u16::from_le_bytes([h[6], h[7]]);
    let desc = RemoteRegion::from_bytes(msg.payload()).expect("descriptor");
    (
        Remote {
            desc,
            local: shard == owner,
            trusted: None,
        },
        shards,
    )
}

/// One put and one get in `mode`; the get's bytes.
async fn put_get(
    peer: Peer,
    mode: Mode,
    r: &Remote,
    offset: u64,
    data: &[u8],
    put: &mut Histogram<u64>,
    get: &mut Histogram<u64>,
) -> Vec<u8> {
    let len = data.len() as u64;
    let t0 = Instant::now();
    match (mode, &r.trusted) {
        (Mode::Trusted, Some(t)) => peer.put_trusted(t, offset, data).await.expect("put"),
        _ => peer.put(&r.desc, offset, data).await.expect("put"),
    }
    put.record(t0.elapsed().as_nanos() as u64).unwrap();
    let t0 = Instant::now();
    let back = match (mode, &r.trusted) {
        (Mode::Trusted, Some(t)) => peer.get_trusted(t, offset, len).await.expect("get"),
        _ => peer.get(&r.desc, offset, len).await.expect("get"),
    };
    get.record(t0.elapsed().as_nanos() as u64).unwrap();
    back
}

/// Latencies of one client shard against one server region.
struct Row {
    me: ShardId,
    owner: bool,
    server_shard: ShardId,
    local: bool,
    mode: Mode,
    size: usize,
    put: Histogram<u64>,
    get: Histogram<u64>,
}

/// The client: every shard puts and gets `count` times to each server region, in each mode and
/// size, then shard 0 shows the refusals.
fn client(o: &Opts, addr: SocketAddr) {
    let (count, sizes, trusted) = (o.count, o.sizes.clone(), o.trusted);
    let len = region_len(o) as u64;
    let finished = Arc::new(AtomicUsize::new(0));
    let out = node(o, 1)
        .on_am(DESC, || on_answer)
        .on_am(SUM, || on_answer)
        .on_am(TRUSTED_DESC, || on_answer)
        .run(move |node: Node| {
            let (finished, sizes) = (finished.clone(), sizes.clone());
            async move {
                let (tx, rx) = local_channel::new_unbounded();
                ANSWERS.with(|a| *a.borrow_mut() = Some(tx));
                let peer = node.connect(addr).await.expect("connect");
                let me = node.shard();
                let (first, shards) = remote_of(&call(peer, &rx, me, ASK, 0).await);
                let mut remotes = vec![first];
                for want in 1..shards {
                    remotes.push(remote_of(&call(peer, &rx, me, ASK, want).await).0);
                }
                for (want, r) in remotes.iter_mut().enumerate() {
                    assert!(r.desc.len() >= len, "the server's regions are too small");
                    if trusted {
                        let msg = call(peer, &rx, me, ASK_TRUSTED, want as u16).await;
                        if msg.payload().is_empty() {
                            panic!("the server is not in trusted mode: start it with --trusted");
                        }
                        let t = TrustedDescriptor::from_bytes(msg.payload()).expect("descriptor");
                        assert!(t.len() >= len, "the server's trusted regions are too small");
                        // Trusted mode refuses a peer that only tcp reaches: say so, measure
                        // checked mode only.
                        match peer.get_trusted(&t, 0, 1).await {
                            Err(Error::Rma(e @ RmaOpError::TrustedTransport { .. })) => {
                                if me == ShardId::new(0) && want == 0 {
                                    println!(
                                        "client: trusted mode refused: {e} (try --tls sm,tcp)"
                                    );
                                }
                            }
                            other => {
                                other.expect("trusted get");
                                r.trusted = Some(t);
                            }
                        }
                    }
                }
                // One client shard measures at a time: on a small machine, shards spinning through
                // their own loops would otherwise take the CPU the others' peers need.
                let deadline = Instant::now() + Duration::from_secs(600);
                while finished.load(Ordering::Acquire) < me.index() && Instant::now() < deadline {
                    sleep(Duration::from_millis(1)).await;
                }
                let modes: &[Mode] = if remotes.iter().all(|r| r.trusted.is_some()) && trusted {
                    &[Mode::Checked, Mode::Trusted]
                } else {
                    &[Mode::Checked]
                };
                let mut rows = Vec::new();
                for r in &remotes {
                    for &size in &sizes {
                        let offset = (me.index() * size) as u64;
                        for &mode in modes {
                            let hist =
                                || Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
                            let (mut put, mut get) = (hist(), hist());
                            let mut data = vec![0u8; size];
                            for i in 0..count {
                                for (j, b) in data.iter_mut().enumerate() {
                                    *b = (i as usize).wrapping_mul(7).wrapping_add(j) as u8;
                                }
                                let back =
                                    put_get(peer, mode, r, offset, &data, &mut put, &mut get).await;
                                assert_eq!(back, data, "get returned what was put");
                            }
                            rows.push(Row {
                                me,
                                owner: node.owner_of(peer) == me,
                                server_shard: r.desc.shard(),
                                local: r.local,
                                mode,
                                size,
                                put,
                                get,
                            });
                        }
                    }
                }
                finished.fetch_add(1, Ordering::AcqRel);
                if me == ShardId::new(0) {
                    // Once every shard's puts are done, the server's memory stays still.
                    let deadline = Instant::now() + Duration::from_secs(60);
                    while finished.load(Ordering::Acquire) < node.shard_count()
                        && Instant::now() < deadline
                    {
                        sleep(Duration::from_millis(1)).await;
                    }
                    refusals(peer, &rx, me, remotes[0].desc).await;
                    if let Some(t) = &remotes[0].trusted {
                        match peer.put_trusted(t, t.len() - 4, &[0xFF; 8]).await {
                            Err(e) => println!("client: out-of-bounds trusted put refused: {e}"),
                            Ok(()) => panic!("an out-of-bounds trusted put was accepted"),
                        }
                    }
                }
                ANSWERS.with(|a| a.borrow_mut().take());
                rows
            }
        })
        .expect("client node");
    println!(
        "{:<6} {:<9} {:<12} {:<8} {:>6} {:<4} {:>8} {:>9} {:>9} {:>9} {:>9}",
        "shard",
        "route",
        "region",
        "mode",
        "size",
        "op",
        "count",
        "p50 us",
        "p99 us",
        "p99.9 us",
        "max us"
    );
    for row in out.into_iter().flatten() {
        for (op, hist) in [("put", &row.put), ("get", &row.get)] {
            let us = |q: f64| hist.value_at_quantile(q) as f64 / 1000.0;
            println!(
                "{:<6} {:<9} {:<12} {:<8} {:>6} {:<4} {:>8} {:>9.1} {:>9.1} {:>9.1} {:>9.1}",
                row.me.to_string(),
                if row.owner { "owner" } else { "forwarded" },
                format!(
                    "{} {}",
                    row.server_shard,
                    if row.local { "local" } else { "forwarded" }
                ),
                match row.mode {
                    Mode::Checked => "checked",
                    Mode::Trusted => "trusted",
                },
                format_size(row.size),
                op,
                hist.len(),
                us(0.5),
                us(0.99),
                us(0.999),
                hist.max() as f64 / 1000.0
            );
        }
    }
    println!(
        "puts and gets one at a time; every get checked against the put before it; a trusted \
         put resolves once remotely complete (flushed)"
    );
}

/// Shows the refusals on the server's region of its shard 0, and that they changed nothing.
async fn refusals(peer: Peer, rx: &LocalReceiver<OwnedAmMsg>, me: ShardId, old: RemoteRegion) {
    let sum = |m: OwnedAmMsg| u64::from_le_bytes(m.payload().try_into().expect("8-byte checksum"));
    let before = sum(call(peer, rx, me, CHECK, 0).await);
    let junk = [0xFFu8; 8];
    match peer.put(&old, old.len() - 4, &junk).await {
        Err(e) => println!("client: out-of-bounds put refused: {e}"),
        Ok(()) => panic!("an out-of-bounds put was accepted"),
    }
    let new = remote_of(&call(peer, rx, me, REVOKE, 0).await).0.desc;
    match peer.put(&old, 0, &junk).await {
        Err(e) => println!("client: put with the revoked descriptor refused: {e}"),
        Ok(()) => panic!("a put with a revoked descriptor was accepted"),
    }
    let after = sum(call(peer, rx, me, CHECK, 0).await);
    assert_eq!(before, after, "a refused put changed the server's memory");
    println!("client: the server's memory is unchanged by the refused puts ({after:016x})");
    let first = peer
        .get(&new, 0, 8)
        .await
        .expect("get with the new descriptor");
    println!(
        "client: the new descriptor (generation {}) reads {first:?}",
        new.generation()
    );
}

fn main() {
    let o = opts();
    cli::run_role(
        &o.role,
        o.serve_for,
        |addr, bound, stop| serve(&o, addr, bound, stop),
        |addr| client(&o, addr),
    );
}
