//! Checked remote memory through the facade: two nodes of two shards each in one process, over
//! tcp on loopback. The server node holds regions on both of its shards; the client puts and
//! gets from both of its shards to both, so every route is taken: on the client shard's own
//! rail to the region's shard, or forwarded on the client to the shard that holds that rail;
//! never forwarded on the server. Every refusal is checked to leave the server's memory
//! unchanged.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // A test may panic: a panic is a failure it reports.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use glommio::timer::sleep;
use shardcx::proto::region::{GetRequest, PutRequest, RmaReply};
use shardcx::proto::{FrameKind, Limits};
use shardcx::rma::{
    DescriptorError, Permissions, Region, RemoteRegion, RmaErrorCode, RmaOpError, RmaStats,
    TrustedDescriptor, TrustedRegion, TrustedStats,
};
use shardcx::shards::NetError;
use shardcx::{Error, Node, NodeBuilder, NodeId, Peer, ShardId};

mod common;
/// Longest any one test may run.
const LIMIT: Duration = Duration::from_secs(60);
/// Longest a client waits for the server to answer a control command.
const ASK_LIMIT: Duration = Duration::from_secs(10);
const KEY: &[u8] = b"rma facade test key, 16+ bytes";
const CLIENT: NodeId = NodeId::new(1);
const SERVER: NodeId = NodeId::new(2);
/// A node that is neither, for grants to someone else.
const STRANGER: NodeId = NodeId::new(99);

use common::serial;

fn node(id: NodeId) -> NodeBuilder {
    common::two_shard_node(id, KEY)
}

/// Runs `f` on another thread; fails the test if it takes longer than `LIMIT` (with the stacks
/// of the test's threads).
fn within<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    common::within(LIMIT, f)
}

/// A byte pattern that differs with `seed` and position.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

/// What a server shard is asked to do, by the test or by a client shard.
enum Cmd {
    /// A copy of the named region's memory.
    Read(&'static str, mpsc::Sender<Vec<u8>>),
    /// Revoke the named region; its new descriptor.
    Revoke(&'static str, mpsc::Sender<RemoteRegion>),
}

/// Registers a shard's regions, by name.
type Setup = Arc<dyn Fn(&Node) -> Vec<(&'static str, Region)> + Send + Sync>;

/// One server shard at start: its id, the listen address (shard 0), its regions' descriptors
/// (as bytes, as an application would send them), and its command channel.
type Hello = (
    ShardId,
    Option<SocketAddr>,
    Vec<(&'static str, [u8; RemoteRegion::ENCODED_LEN])>,
    mpsc::Sender<Cmd>,
);

/// The server node, running in its own thread.
struct Server {
    addr: SocketAddr,
    /// Descriptors by server shard, then by name.
    regions: Vec<HashMap<&'static str, RemoteRegion>>,
    cmds: Arc<Vec<mpsc::Sender<Cmd>>>,
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<RmaStats>>,
}

fn start_server(setup: Setup, slow_gets: bool) -> Server {
    let (tx, rx) = mpsc::channel::<Hello>();
    let tx = Arc::new(Mutex::new(tx));
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let thread = std::thread::spawn(move || {
        node(SERVER)
            .listen("127.0.0.1:0".parse().unwrap())
            .run(move |node: Node| {
                let (tx, stop, setup) = (tx.clone(), stop2.clone(), setup.clone());
                async move {
                    if slow_gets {
                        // Takes every get and never answers.
                        node.shard_ctx()
                            .set_frame_handler(FrameKind::RmaGet, |_, _, _, _| {})
                            .unwrap();
                    }
                    let regions: HashMap<_, _> = setup(&node).into_iter().collect();
                    let descs = regions
                        .iter()
                        .map(|(n, r)| (*n, r.descriptor().to_bytes()))
                        .collect();
                    let (cmd_tx, cmd_rx) = mpsc::channel();
                    let hello = (node.shard(), node.listen_addr(), descs, cmd_tx);
                    tx.lock().unwrap().send(hello).unwrap();
                    let deadline = Instant::now() + LIMIT;
                    while !stop.load(Ordering::Acquire) && Instant::now() < deadline {
                        while let Ok(cmd) = cmd_rx.try_recv() {
                            match cmd {
                                Cmd::Read(name, back) => {
                                    let _ = back.send(regions[name].to_vec().unwrap());
                                }
                                Cmd::Revoke(name, back) => {
                                    let _ = back.send(regions[name].revoke().unwrap());
                                }
                            }
                        }
                        sleep(Duration::from_millis(1)).await;
                    }
                    node.rma_stats()
                }
            })
            .unwrap()
    });
    let mut addr = None;
    let mut regions = vec![HashMap::new(), HashMap::new()];
    let mut cmds = vec![None, None];
    let deadline = Instant::now() + LIMIT;
    for _ in 0..2 {
        // Fails fast if the server node stops (e.g. could not boot) instead of waiting LIMIT.
        let (shard, a, descs, cmd) = loop {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(hello) => break hello,
                Err(_) if thread.is_finished() => panic!("server node stopped at start"),
                Err(_) => assert!(Instant::now() < deadline, "server did not start"),
            }
        };
        addr = addr.or(a);
        for (name, bytes) in descs {
            let d = RemoteRegion::from_bytes(&bytes).expect("descriptor decodes");
            assert_eq!((d.node(), d.shard()), (SERVER, shard));
            regions[shard.index()].insert(name, d);
        }
        cmds[shard.index()] = Some(cmd);
    }
    Server {
        addr: addr.expect("shard 0 listens"),
        regions,
        cmds: Arc::new(cmds.into_iter().map(Option::unwrap).collect()),
        stop,
        thread,
    }
}

impl Server {
    /// The named region's memory on `shard`, read there (from the test thread).
    fn read(&self, shard: usize, name: &'static str) -> Vec<u8> {
        let (tx, rx) = mpsc::channel();
        self.cmds[shard].send(Cmd::Read(name, tx)).unwrap();
        rx.recv_timeout(ASK_LIMIT).expect("server read")
    }

    fn finish(self) -> Vec<RmaStats> {
        self.stop.store(true, Ordering::Release);
        let h = self.thread;
        within(move || h.join().expect("server panicked"))
    }
}

/// Asks a server shard for something from a client shard, without blocking the client's
/// executor; bounded by `ASK_LIMIT`.
async fn ask<T>(
    cmds: &[mpsc::Sender<Cmd>],
    shard: usize,
    make: impl FnOnce(mpsc::Sender<T>) -> Cmd,
) -> T {
    let (tx, rx) = mpsc::channel();
    cmds[shard].send(make(tx)).unwrap();
    let deadline = Instant::now() + ASK_LIMIT;
    loop {
        if let Ok(v) = rx.try_recv() {
            return v;
        }
        assert!(Instant::now() < deadline, "server did not answer");
        sleep(Duration::from_millis(1)).await;
    }
}

/// Runs the client node with `f` on both shards, bounded by `LIMIT`.
fn run_client<T, F, Fut>(f: F) -> Vec<T>
where
    F: Fn(Node) -> Fut + Send + Clone + 'static,
    Fut: std::future::Future<Output = T> + 'static,
    T: Send + 'static,
{
    within(move || {
        node(CLIENT)
            .run(move |node: Node| {
                let f = f.clone();
                async move { f(node).await }
            })
            .expect("client node")
    })
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

const RW_LEN: usize = 64 << 10;
/// Bytes of the RW region each client shard writes (its own half).
const HALF: usize = RW_LEN / 2;

#[test]
fn put_get_round_trips_on_every_route() {
    let _g = serial();
    let server = start_server(
        Arc::new(|node: &Node| {
            let r = node
                .register_region(vec![0; RW_LEN], Permissions::READ_WRITE, None)
                .unwrap();
            assert_eq!(r.len(), RW_LEN);
            vec![("rw", r)]
        }),
        false,
    );
    let (addr, regions) = (server.addr, server.regions.clone());
    const ROUNDS: usize = 40;
    const TIMED: usize = 300;
    let got = run_client(move |node: Node| {
        let regions = regions.clone();
        async move {
            let peer = node.connect(addr).await.expect("connect");
            let me = node.shard().index();
            let base = me * HALF;
            // What this shard wrote into its half of each server shard's region.
            let mut mirrors = vec![vec![0u8; HALF]; 2];
            let sizes = [0usize, 1, 7, 100, 1000, 9000, 20_000];
            for (holder, mirror) in mirrors.iter_mut().enumerate() {
                let d = regions[holder]["rw"];
                for i in 0..ROUNDS {
                    let len = sizes[i % sizes.len()];
                    let off = (i * 4099) % (HALF - len + 1);
                    let data = pattern(len, (i + 16 * me + 64 * holder) as u8);
                    peer.put(&d, (base + off) as u64, &data).await.expect("put");
                    mirror[off..off + len].copy_from_slice(&data);
                    let back = peer
                        .get(&d, (base + off) as u64, len as u64)
                        .await
                        .expect("get");
                    assert_eq!(back, data, "get after put, round {i}");
                }
                let whole = peer
                    .get(&d, base as u64, HALF as u64)
                    .await
                    .expect("get half");
                assert!(whole == *mirror, "half of shard {holder}'s region");
            }
            // Latency of 8-byte puts and gets, by server shard.
            let mut times = Vec::new();
            for holder in 0..2 {
                let d = regions[holder]["rw"];
                let (mut puts, mut gets) = (Vec::new(), Vec::new());
                for i in 0..TIMED {
                    let v = (i as u64).to_le_bytes();
                    let t0 = Instant::now();
                    peer.put(&d, base as u64, &v).await.expect("put");
                    puts.push(t0.elapsed());
                    let t0 = Instant::now();
                    let back = peer.get(&d, base as u64, 8).await.expect("get");
                    gets.push(t0.elapsed());
                    assert_eq!(back, v);
                }
                mirrors[holder][..8].copy_from_slice(&((TIMED - 1) as u64).to_le_bytes());
                puts.sort();
                gets.sort();
                times.push((holder, puts, gets));
            }
            (node.shard(), node.owner_of(peer), mirrors, times)
        }
    });
    // The server's memory, read on the server: each client shard's half is what it wrote.
    for holder in 0..2 {
        let mem = server.read(holder, "rw");
        for (client_shard, _, mirrors, _) in &got {
            let base = client_shard.index() * HALF;
            assert!(
                mem[base..base + HALF] == mirrors[holder][..],
                "server shard {holder}, half of client shard {client_shard}"
            );
        }
    }
    let stats = server.finish();
    for (client_shard, _, _, times) in &got {
        for (holder, puts, gets) in times {
            let route = if client_shard.index() == *holder {
                "its own rail"
            } else {
                "forwarded on the client"
            };
            eprintln!(
                "client shard {client_shard}, region on server shard {holder} ({route}): \
                 8-byte put p50 {:?} p99 {:?}, get p50 {:?} p99 {:?}",
                percentile(puts, 0.5),
                percentile(puts, 0.99),
                percentile(gets, 0.5),
                percentile(gets, 0.99)
            );
        }
    }
    // Every access was served where the memory is, sent there on the rail to it: none was
    // forwarded on the server.
    let per_holder = 2 * (2 * ROUNDS + 1 + 2 * TIMED) as u64;
    for (i, s) in stats.iter().enumerate() {
        assert_eq!(s.puts + s.gets, per_holder, "server shard {i}: {s:?}");
        assert_eq!(
            s.refused + s.malformed + s.expired + s.unanswered,
            0,
            "{s:?}"
        );
    }
    for s in &stats {
        assert_eq!(s.forwarded, 0, "{stats:?}");
    }
}

const SMALL: usize = 256;

/// The regions of the refusal test, each filled with a pattern of its own.
fn refusal_regions(node: &Node) -> Vec<(&'static str, Region)> {
    let reg = |seed: u8, perms, grantee: Option<NodeId>| {
        node.register_region(pattern(SMALL, seed), perms, grantee.map(Peer::new))
            .unwrap()
    };
    let gone = reg(5, Permissions::READ_WRITE, None);
    let gone_desc = gone.descriptor();
    assert_eq!(gone.deregister().unwrap(), pattern(SMALL, 5));
    // Registered again: it may take the slot of the deregistered one, with a new generation.
    let again = reg(6, Permissions::READ_WRITE, None);
    assert_ne!(again.descriptor().generation(), gone_desc.generation());
    vec![
        ("rw", reg(1, Permissions::READ_WRITE, None)),
        ("ro", reg(2, Permissions::READ, None)),
        ("other", reg(3, Permissions::READ_WRITE, Some(STRANGER))),
        ("mine", reg(4, Permissions::READ_WRITE, Some(CLIENT))),
        ("rev", reg(7, Permissions::READ_WRITE, None)),
        ("again", again),
    ]
}

const SEEDS: [(&str, u8); 6] = [
    ("rw", 1),
    ("ro", 2),
    ("other", 3),
    ("mine", 4),
    ("rev", 7),
    ("again", 6),
];

/// A copy of `d` with fields changed, as a forger would make it from the bytes.
fn forge(d: &RemoteRegion, f: impl FnOnce(&mut [u8; RemoteRegion::ENCODED_LEN])) -> RemoteRegion {
    let mut b = d.to_bytes();
    f(&mut b);
    RemoteRegion::from_bytes(&b).expect("forged descriptor decodes")
}

fn code_of<T: std::fmt::Debug>(r: Result<T, Error>) -> (bool, RmaErrorCode) {
    match r {
        Err(Error::Rma(e @ RmaOpError::Invalid { .. })) => (false, e.code().unwrap()),
        Err(Error::Rma(e @ RmaOpError::Refused { .. })) => (true, e.code().unwrap()),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// Sends a raw RMA request (bypassing the initiator's checks) and returns the reply's status.
async fn raw(node: &Node, kind: FrameKind, d: &RemoteRegion, payload: Vec<u8>) -> Option<u8> {
    let (h, reply) = node
        .shard_ctx()
        .request(SERVER, kind, d.id().get(), payload, Duration::from_secs(5))
        .await
        .expect("raw request");
    assert_eq!(h.kind, FrameKind::RmaReply);
    let r = RmaReply::decode(&reply, &Limits::default()).expect("reply decodes");
    r.status.err().map(|c| c.to_u8())
}

#[test]
fn refused_accesses_leave_memory_unchanged() {
    let _g = serial();
    let server = start_server(Arc::new(refusal_regions), false);
    let (addr, regions, cmds) = (server.addr, server.regions.clone(), server.cmds.clone());
    use RmaErrorCode::*;
    let got = run_client(move |node: Node| {
        let (regions, cmds) = (regions.clone(), cmds.clone());
        async move {
            let peer = node.connect(addr).await.expect("connect");
            let me = node.shard().index();
            for (holder, r) in regions.iter().enumerate() {
                let rw = r["rw"];
                // Out of bounds, caught by the initiator.
                let x = [0xEEu8; 10];
                assert_eq!(code_of(peer.put(&rw, 250, &x).await), (false, OutOfBounds));
                assert_eq!(code_of(peer.get(&rw, 257, 0).await), (false, OutOfBounds));
                assert_eq!(
                    code_of(peer.put(&rw, u64::MAX, &x).await),
                    (false, OutOfBounds)
                );
                assert_eq!(
                    code_of(peer.get(&rw, 1, u64::MAX).await),
                    (false, OutOfBounds)
                );
                // ... and by the holder, for a descriptor that lies about the length.
                let long = forge(&rw, |b| b[24..32].copy_from_slice(&u64::MAX.to_le_bytes()));
                assert_eq!(code_of(peer.put(&long, 250, &x).await), (true, OutOfBounds));
                assert_eq!(code_of(peer.get(&long, 4096, 8).await), (true, OutOfBounds));
                // ... and offset + len overflowing u64, sent raw past the initiator's check.
                let over = PutRequest {
                    generation: rw.generation(),
                    offset: u64::MAX - 3,
                    data: &x,
                };
                let mut p = Vec::new();
                over.encode_to_vec(&mut p, &Limits::default()).unwrap();
                let code = raw(&node, FrameKind::RmaPut, &rw, p).await;
                assert_eq!(code, Some(OutOfBounds.to_u8()));
                let over = GetRequest {
                    generation: rw.generation(),
                    offset: u64::MAX,
                    len: 8,
                };
                let p = over.to_bytes(&Limits::default()).unwrap().to_vec();
                let code = raw(&node, FrameKind::RmaGet, &rw, p).await;
                assert_eq!(code, Some(OutOfBounds.to_u8()));
                // A malformed request is answered, not dropped.
                let code = raw(&node, FrameKind::RmaPut, &rw, vec![1, 2, 3]).await;
                assert_eq!(code, Some(Malformed.to_u8()));
                // A read-only region refuses puts, at both ends.
                let ro = r["ro"];
                assert_eq!(code_of(peer.put(&ro, 0, &x).await), (false, NotPermitted));
                let rw_ro = forge(&ro, |b| b[14] = Permissions::READ_WRITE.bits());
                assert_eq!(code_of(peer.put(&rw_ro, 0, &x).await), (true, NotPermitted));
                assert_eq!(
                    peer.get(&ro, 0, SMALL as u64).await.unwrap(),
                    pattern(SMALL, 2)
                );
                // A region granted to another node refuses this one; one granted to it works.
                let other = r["other"];
                assert_eq!(code_of(peer.put(&other, 0, &x).await), (true, NotGrantee));
                assert_eq!(code_of(peer.get(&other, 0, 1).await), (true, NotGrantee));
                assert_eq!(peer.get(&r["mine"], 0, 4).await.unwrap(), pattern(4, 4));
                // Unknown regions: a slot never used, and a shard the server does not have.
                let unused = forge(&rw, |b| {
                    b[8..12].copy_from_slice(&(d_id(&rw) + 500).to_le_bytes())
                });
                assert_eq!(
                    code_of(peer.put(&unused, 0, &x).await),
                    (true, UnknownRegion)
                );
                let nowhere = forge(&rw, |b| {
                    b[8..12].copy_from_slice(&((7u32 << 20) | 1).to_le_bytes());
                    b[12..14].copy_from_slice(&7u16.to_le_bytes());
                });
                assert_eq!(
                    code_of(peer.get(&nowhere, 0, 1).await),
                    (true, UnknownRegion)
                );
                // A stale generation (another region's old one) is refused.
                let old = forge(&r["again"], |b| {
                    b[16..24].copy_from_slice(&1u64.to_le_bytes())
                });
                assert_eq!(
                    code_of(peer.put(&old, 0, &x).await),
                    (true, StaleGeneration)
                );
                // Revocation: old descriptors are refused, the new one works. Client shard 0
                // revokes; shard 1 checks that its descriptor is refused once that is done.
                if me == 0 {
                    let rev = r["rev"];
                    assert_eq!(peer.get(&rev, 0, 4).await.unwrap(), pattern(4, 7));
                    let new = ask(&cmds, holder, |tx| Cmd::Revoke("rev", tx)).await;
                    assert!(new.generation() > rev.generation());
                    assert_eq!(new.id(), rev.id());
                    assert_eq!(
                        code_of(peer.put(&rev, 0, &x).await),
                        (true, StaleGeneration)
                    );
                    assert_eq!(code_of(peer.get(&rev, 0, 1).await), (true, StaleGeneration));
                    assert_eq!(
                        peer.get(&new, 0, SMALL as u64).await.unwrap(),
                        pattern(SMALL, 7)
                    );
                }
            }
            me
        }
    });
    assert_eq!(got.len(), 2);
    // Nothing refused wrote anything.
    for holder in 0..2 {
        for (name, seed) in SEEDS {
            assert_eq!(
                server.read(holder, name),
                pattern(SMALL, seed),
                "server shard {holder}, region {name}"
            );
        }
    }
    let stats = server.finish();
    for s in &stats {
        assert_eq!(s.puts, 0, "{s:?}");
        assert!(s.refused >= 2 * 10, "{s:?}");
        assert!(s.malformed >= 2, "{s:?}");
    }
}

fn d_id(d: &RemoteRegion) -> u32 {
    d.id().get()
}

#[test]
fn deadlines_end_every_access() {
    let _g = serial();
    let server = start_server(
        Arc::new(|node: &Node| {
            let r = node
                .register_region(vec![9; 64], Permissions::READ_WRITE, None)
                .unwrap();
            vec![("rw", r)]
        }),
        true,
    );
    let (addr, regions) = (server.addr, server.regions.clone());
    let timeout = Duration::from_millis(300);
    // Every shard checks before any connects (a session is the node's, for all its shards).
    let checked = Arc::new(AtomicUsize::new(0));
    let got = run_client(move |node: Node| {
        let (regions, checked) = (regions.clone(), checked.clone());
        async move {
            let d = regions[0]["rw"];
            // Before connecting: a typed connection error.
            let r = Peer::new(SERVER).put(&d, 0, b"x").await;
            assert!(
                matches!(r, Err(Error::Net(NetError::NotConnected { .. }))),
                "{r:?}"
            );
            checked.fetch_add(1, Ordering::AcqRel);
            let until = Instant::now() + Duration::from_secs(30);
            while checked.load(Ordering::Acquire) < node.shard_count() && Instant::now() < until {
                sleep(Duration::from_millis(1)).await;
            }
            let peer = node.connect(addr).await.expect("connect");
            // The descriptor of one node used through another peer.
            let r = Peer::new(STRANGER).get(&d, 0, 1).await;
            assert!(
                matches!(r, Err(Error::Rma(RmaOpError::WrongNode { .. }))),
                "{r:?}"
            );
            let mut took = Vec::new();
            for r in regions.iter() {
                let d = r["rw"];
                // Puts are answered...
                peer.put_within(&d, 0, b"ok", timeout).await.expect("put");
                // ... gets never are: they end at their deadline.
                let t0 = Instant::now();
                let r = peer.get_within(&d, 0, 8, timeout).await;
                took.push(t0.elapsed());
                assert!(
                    matches!(r, Err(Error::TimedOut { what: "get", .. })),
                    "{r:?}"
                );
                // A deadline too short for any round trip (the frame may still be sent: it
                // writes away from the bytes checked below).
                let r = peer
                    .put_within(&d, 8, b"late", Duration::from_nanos(1))
                    .await;
                assert!(
                    matches!(r, Err(Error::TimedOut { what: "put", .. })),
                    "{r:?}"
                );
            }
            took
        }
    });
    assert_eq!(server.read(0, "rw")[..2], *b"ok");
    let _ = server.finish();
    for took in got.into_iter().flatten() {
        assert!(took >= timeout, "gave up early: {took:?}");
        assert!(took < timeout + Duration::from_secs(1), "took {took:?}");
    }
}

#[test]
fn calls_outside_a_shard_fail_cleanly() {
    let d = RemoteRegion::from_bytes(&{
        let mut b = [0u8; RemoteRegion::ENCODED_LEN];
        b[8] = 1;
        b
    })
    .unwrap();
    let r = futures_lite::future::block_on(Peer::new(NodeId::new(0)).get(&d, 0, 1));
    assert!(matches!(r, Err(Error::NotOnShard)), "{r:?}");
}

#[test]
fn public_types_auto_traits() {
    fn send_sync<T: Send + Sync + 'static>() {}
    fn copy<T: Copy>() {}
    send_sync::<RemoteRegion>();
    copy::<RemoteRegion>();
    send_sync::<RmaOpError>();
    send_sync::<RmaStats>();
    send_sync::<DescriptorError>();
    send_sync::<TrustedDescriptor>();
    send_sync::<TrustedStats>();
    trait AmbiguousIfSend<A> {
        fn some_item() {}
    }
    impl<T: ?Sized> AmbiguousIfSend<()> for T {}
    impl<T: ?Sized + Send> AmbiguousIfSend<u8> for T {}
    trait AmbiguousIfSync<A> {
        fn some_item() {}
    }
    impl<T: ?Sized> AmbiguousIfSync<()> for T {}
    impl<T: ?Sized + Sync> AmbiguousIfSync<u8> for T {}
    // Each line compiles only if the type is NOT Send (resp. Sync): the memory stays on its
    // shard.
    let _ = <Region as AmbiguousIfSend<_>>::some_item;
    let _ = <Region as AmbiguousIfSync<_>>::some_item;
    let _ = <TrustedRegion as AmbiguousIfSend<_>>::some_item;
    let _ = <TrustedRegion as AmbiguousIfSync<_>>::some_item;
}

// ---------------------------------------------------------------------------------------------
// Trusted mode: native UCX RMA with packed remote keys, on only with `NodeBuilder::trusted_rma`.
// ---------------------------------------------------------------------------------------------

/// Bytes of each trusted server shard's read-write region.
const TRUSTED_LEN: usize = 64 << 10;
/// Bytes of each trusted server shard's read-only region.
const TRUSTED_RO_LEN: usize = 256;

/// What a trusted server shard ends with: its read-write and read-only regions' memory, and
/// its counters.
type TrustedEnd = (Vec<u8>, Vec<u8>, TrustedStats);

/// A trusted server node in its own thread: a read-write and a read-only region on each shard.
struct TrustedServer {
    addr: SocketAddr,
    /// Encoded descriptors by server shard: (read-write, read-only).
    descs: Vec<(Vec<u8>, Vec<u8>)>,
    stop: Arc<AtomicBool>,
    /// Each shard's final memory (read-write, read-only) and counters.
    thread: std::thread::JoinHandle<Vec<TrustedEnd>>,
}

type TrustedHello = (ShardId, Option<SocketAddr>, Vec<u8>, Vec<u8>);

fn start_trusted_server(tls: &'static str) -> TrustedServer {
    let (tx, rx) = mpsc::channel::<TrustedHello>();
    let tx = Arc::new(Mutex::new(tx));
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let thread = std::thread::spawn(move || {
        node(SERVER)
            .transports(tls)
            .trusted_rma()
            .listen("127.0.0.1:0".parse().unwrap())
            .run(move |node: Node| {
                let (tx, stop) = (tx.clone(), stop2.clone());
                async move {
                    assert!(node.trusted_rma_enabled());
                    assert!(node.shard_ctx().context().features().rma);
                    let seed = node.shard().index() as u8;
                    let rw = node
                        .register_trusted_region(TRUSTED_LEN, Permissions::READ_WRITE)
                        .unwrap();
                    assert_eq!(rw.to_vec(), vec![0; TRUSTED_LEN], "registered zeroed");
                    rw.write_at(0, &pattern(TRUSTED_LEN, seed)).unwrap();
                    let ro = node
                        .register_trusted_region(TRUSTED_RO_LEN, Permissions::READ)
                        .unwrap();
                    ro.write_at(0, &pattern(TRUSTED_RO_LEN, 100 + seed))
                        .unwrap();
                    // Local accesses are bounds-checked too.
                    let r = rw.write_at(TRUSTED_LEN as u64 - 1, b"xy");
                    assert!(matches!(r, Err(RmaOpError::Invalid { .. })), "{r:?}");
                    let r = rw.read_at(u64::MAX, &mut [0; 2]);
                    assert!(matches!(r, Err(RmaOpError::Invalid { .. })), "{r:?}");
                    let d = rw.descriptor();
                    assert_eq!((d.node(), d.shard()), (SERVER, node.shard()));
                    assert_eq!(d.incarnation(), node.incarnation());
                    assert_eq!(d.len(), TRUSTED_LEN as u64);
                    let hello = (
                        node.shard(),
                        node.listen_addr(),
                        d.to_bytes(),
                        ro.descriptor().to_bytes(),
                    );
                    tx.lock().unwrap().send(hello).unwrap();
                    let deadline = Instant::now() + LIMIT;
                    while !stop.load(Ordering::Acquire) && Instant::now() < deadline {
                        sleep(Duration::from_millis(1)).await;
                    }
                    (rw.to_vec(), ro.to_vec(), node.trusted_rma_stats())
                }
            })
            .unwrap()
    });
    let mut addr = None;
    let mut descs = vec![None, None];
    let deadline = Instant::now() + LIMIT;
    for _ in 0..2 {
        let (shard, a, rw, ro) = loop {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(hello) => break hello,
                Err(_) if thread.is_finished() => panic!("trusted server stopped at start"),
                Err(_) => assert!(Instant::now() < deadline, "trusted server did not start"),
            }
        };
        addr = addr.or(a);
        descs[shard.index()] = Some((rw, ro));
    }
    TrustedServer {
        addr: addr.expect("shard 0 listens"),
        descs: descs.into_iter().map(Option::unwrap).collect(),
        stop,
        thread,
    }
}

impl TrustedServer {
    fn finish(self) -> Vec<TrustedEnd> {
        self.stop.store(true, Ordering::Release);
        let h = self.thread;
        within(move || h.join().expect("trusted server panicked"))
    }
}

/// What one client shard of the trusted test reports.
struct TrustedReport {
    shard: ShardId,
    owner: ShardId,
    /// What this shard wrote into its half of each server shard's read-write region.
    mirrors: Vec<Vec<u8>>,
    stats: TrustedStats,
    /// p50 of 8-byte puts and gets.
    p50: (Duration, Duration),
}

/// Both client shards (each running its own operations, on endpoints of its own)
/// put and get on every server shard's region, check every byte read back, and check the local
/// refusals; the server's memory is then compared with what the client wrote.
fn trusted_round_trips(tls: &'static str) {
    let server = start_trusted_server(tls);
    let (addr, descs) = (server.addr, server.descs.clone());
    const ROUNDS: usize = 60;
    const TIMED: usize = 200;
    let finished = Arc::new(AtomicUsize::new(0));
    let reports = within(move || {
        node(CLIENT)
            .transports(tls)
            .trusted_rma()
            .run(move |node: Node| {
                let (descs, finished) = (descs.clone(), finished.clone());
                async move {
                    let decode = |b: &[u8]| TrustedDescriptor::from_bytes(b).expect("decodes");
                    let rws: Vec<_> = descs.iter().map(|(rw, _)| decode(rw)).collect();
                    let ros: Vec<_> = descs.iter().map(|(_, ro)| decode(ro)).collect();
                    // No session yet: a typed connection error, not a hang. (Both shards look
                    // before either connects.)
                    let r = Peer::new(SERVER).put_trusted(&rws[0], 0, b"x").await;
                    assert!(
                        matches!(r, Err(Error::Net(NetError::NotConnected { .. }))),
                        "{r:?}"
                    );
                    finished.fetch_add(1, Ordering::AcqRel);
                    let deadline = Instant::now() + LIMIT;
                    while finished.load(Ordering::Acquire) < 2 && Instant::now() < deadline {
                        sleep(Duration::from_millis(1)).await;
                    }
                    let peer = node.connect(addr).await.expect("connect");
                    let me = node.shard().index();
                    let base = me * (TRUSTED_LEN / 2);
                    let half = TRUSTED_LEN / 2;
                    let mut mirrors = Vec::new();
                    let sizes = [0usize, 1, 8, 100, 4096, 9000, 20_000];
                    for (holder, d) in rws.iter().enumerate() {
                        let mut mirror =
                            pattern(TRUSTED_LEN, holder as u8)[base..base + half].to_vec();
                        for i in 0..ROUNDS {
                            let len = sizes[i % sizes.len()];
                            let off = (i * 4099) % (half - len + 1);
                            let data = pattern(len, (i + 16 * me + 64 * holder) as u8);
                            peer.put_trusted(d, (base + off) as u64, &data)
                                .await
                                .expect("trusted put");
                            mirror[off..off + len].copy_from_slice(&data);
                            let back = peer
                                .get_trusted(d, (base + off) as u64, len as u64)
                                .await
                                .expect("trusted get");
                            assert_eq!(back, data, "{tls}: get after put, round {i}");
                        }
                        let whole = peer
                            .get_trusted(d, base as u64, half as u64)
                            .await
                            .expect("get half");
                        assert!(whole == mirror, "{tls}: half of shard {holder}'s region");
                        mirrors.push(mirror);
                        // Refused before anything is sent: out of bounds (also with offset +
                        // len overflowing), and a put to a read-only region.
                        let x = [0xEEu8; 10];
                        let refused = |r: Result<(), Error>| match r {
                            Err(Error::Rma(e @ RmaOpError::Invalid { .. })) => e.code().unwrap(),
                            other => panic!("expected a local refusal, got {other:?}"),
                        };
                        use RmaErrorCode::{NotPermitted, OutOfBounds};
                        let end = TRUSTED_LEN as u64;
                        assert_eq!(refused(peer.put_trusted(d, end - 4, &x).await), OutOfBounds);
                        assert_eq!(
                            refused(peer.put_trusted(d, u64::MAX, &x).await),
                            OutOfBounds
                        );
                        assert_eq!(
                            refused(peer.get_trusted(d, end + 1, 0).await.map(drop)),
                            OutOfBounds
                        );
                        assert_eq!(
                            refused(peer.get_trusted(d, 1, u64::MAX).await.map(drop)),
                            OutOfBounds
                        );
                        let ro = &ros[holder];
                        assert_eq!(refused(peer.put_trusted(ro, 0, &x).await), NotPermitted);
                        let got = peer.get_trusted(ro, 0, TRUSTED_RO_LEN as u64).await;
                        assert_eq!(got.unwrap(), pattern(TRUSTED_RO_LEN, 100 + holder as u8));
                        // A descriptor of another run of the server: refused by the owner.
                        let mut stale = d.to_bytes();
                        let inc = d.incarnation().get().wrapping_sub(1).to_le_bytes();
                        stale[16..24].copy_from_slice(&inc);
                        let r = peer.put_trusted(&decode(&stale), 0, b"x").await;
                        assert!(
                            matches!(r, Err(Error::Rma(RmaOpError::StaleIncarnation { .. }))),
                            "{r:?}"
                        );
                        // A (forged) length no buffer here can hold: a typed error, where
                        // allocating it would abort the process.
                        let mut huge = d.to_bytes();
                        huge[40..48].copy_from_slice(&(1u64 << 62).to_le_bytes());
                        let r = peer.get_trusted(&decode(&huge), 0, 1 << 62).await;
                        assert!(
                            matches!(r, Err(Error::Rma(RmaOpError::TooLarge { .. }))),
                            "{r:?}"
                        );
                        // A descriptor used through the wrong peer.
                        let r = Peer::new(STRANGER).get_trusted(d, 0, 1).await;
                        assert!(
                            matches!(r, Err(Error::Rma(RmaOpError::WrongNode { .. }))),
                            "{r:?}"
                        );
                        // A deadline that has passed before the owner shard could start.
                        let r = peer
                            .put_trusted_within(d, base as u64, b"late", Duration::from_nanos(1))
                            .await;
                        assert!(matches!(r, Err(Error::TimedOut { .. })), "{r:?}");
                    }
                    // 8-byte latency against server shard 0 (for the log; not asserted).
                    let d = &rws[0];
                    let (mut puts, mut gets) = (Vec::new(), Vec::new());
                    for i in 0..TIMED {
                        let v = (i as u64).to_le_bytes();
                        let t0 = Instant::now();
                        peer.put_trusted_within(d, base as u64, &v, Duration::from_secs(5))
                            .await
                            .expect("put");
                        puts.push(t0.elapsed());
                        let t0 = Instant::now();
                        let back = peer
                            .get_trusted_within(d, base as u64, 8, Duration::from_secs(5))
                            .await
                            .expect("get");
                        gets.push(t0.elapsed());
                        assert_eq!(back, v);
                    }
                    mirrors[0][..8].copy_from_slice(&((TIMED - 1) as u64).to_le_bytes());
                    puts.sort();
                    gets.sort();
                    // Read the counters once every shard is done.
                    finished.fetch_add(1, Ordering::AcqRel);
                    let deadline = Instant::now() + LIMIT;
                    while finished.load(Ordering::Acquire) < 4 && Instant::now() < deadline {
                        sleep(Duration::from_millis(1)).await;
                    }
                    TrustedReport {
                        shard: node.shard(),
                        owner: node.owner_of(peer),
                        mirrors,
                        stats: node.trusted_rma_stats(),
                        p50: (percentile(&puts, 0.5), percentile(&gets, 0.5)),
                    }
                }
            })
            .expect("client node")
    });
    let out = server.finish();
    for (holder, (rw, ro, stats)) in out.iter().enumerate() {
        for r in &reports {
            let base = r.shard.index() * (TRUSTED_LEN / 2);
            assert!(
                rw[base..base + TRUSTED_LEN / 2] == r.mirrors[holder][..],
                "{tls}: server shard {holder}, half of client shard {}",
                r.shard
            );
        }
        assert_eq!(
            *ro,
            pattern(TRUSTED_RO_LEN, 100 + holder as u8),
            "{tls}: read-only"
        );
        // The server ran no trusted operation of its own: the accesses cost it nothing.
        assert_eq!(stats.puts + stats.gets, 0, "{stats:?}");
        assert_eq!(stats.regions, 2, "{stats:?}");
    }
    for r in &reports {
        assert_eq!(r.shard, r.owner, "every shard runs its own operations");
        eprintln!(
            "{tls}: trusted 8-byte put p50 {:?}, get p50 {:?} from client shard {}",
            r.p50.0, r.p50.1, r.shard
        );
        let s = r.stats;
        // Every operation of this client shard ran here: one endpoint per server shard, one
        // key per region, found in the cache afterwards. Per server shard: the rounds, the
        // whole half, the read-only get; then the timed loop against server shard 0.
        let per_shard = (2 * (2 * ROUNDS + 1 + 1) + 2 * TIMED) as u64;
        assert_eq!(s.puts + s.gets, per_shard, "{tls}: {s:?}");
        // The late puts, whether the shard or the facade's deadline saw them first.
        assert!(s.timed_out <= 2, "{tls}: {s:?}");
        assert_eq!(s.endpoints, 2, "{tls}: {s:?}");
        assert_eq!(s.keys_unpacked, 4, "{tls}: {s:?}");
        assert_eq!(
            s.key_hits + s.keys_unpacked,
            s.puts + s.gets,
            "{tls}: {s:?}"
        );
        assert_eq!(s.failed, 0, "{tls}: {s:?}");
    }
}

#[test]
fn trusted_put_get_over_shared_memory() {
    let _g = serial();
    // Connection set-up needs tcp (UCX 1.12); trusted endpoints then use shared memory.
    trusted_round_trips("sm,tcp");
}

/// Over tcp alone, trusted operations are refused with a typed error before any endpoint is
/// made (UCX 1.12 only emulates RMA over tcp, and its tcp transport crashed the target with
/// trusted endpoints: see `shardcx_shards::rma_trusted`).
#[test]
fn trusted_access_over_tcp_only_is_refused() {
    let _g = serial();
    let server = start_trusted_server("tcp");
    let (addr, descs) = (server.addr, server.descs.clone());
    let stats = within(move || {
        node(CLIENT)
            .shards(1)
            .trusted_rma()
            .run(move |node: Node| {
                let descs = descs.clone();
                async move {
                    let peer = node.connect(addr).await.expect("connect");
                    for (rw, _) in &descs {
                        let d = TrustedDescriptor::from_bytes(rw).unwrap();
                        let r = peer.put_trusted(&d, 0, b"over tcp").await;
                        assert!(
                            matches!(
                                r,
                                Err(Error::Rma(RmaOpError::TrustedTransport { node })) if node == SERVER
                            ),
                            "{r:?}"
                        );
                        let r = peer.get_trusted(&d, 0, 8).await;
                        assert!(
                            matches!(r, Err(Error::Rma(RmaOpError::TrustedTransport { .. }))),
                            "{r:?}"
                        );
                    }
                    node.trusted_rma_stats()
                }
            })
            .expect("client node")
    });
    let out = server.finish();
    for (holder, (rw, _, _)) in out.iter().enumerate() {
        assert_eq!(
            *rw,
            pattern(TRUSTED_LEN, holder as u8),
            "nothing was written"
        );
    }
    let s = stats[0];
    assert_eq!((s.endpoints, s.puts, s.gets), (0, 0, 0), "{s:?}");
}

#[test]
fn trusted_mode_is_off_unless_enabled() {
    let _g = serial();
    let server = start_trusted_server("tcp");
    let (addr, descs) = (server.addr, server.descs.clone());
    within(move || {
        // A node without `trusted_rma`: UCP_FEATURE_RMA is off, and every trusted call says so.
        node(CLIENT)
            .run(move |node: Node| {
                let descs = descs.clone();
                async move {
                    assert!(!node.trusted_rma_enabled());
                    assert!(!node.shard_ctx().context().features().rma);
                    let off = |r: Result<(), Error>| {
                        assert!(
                            matches!(r, Err(Error::Rma(RmaOpError::TrustedOff { .. }))),
                            "{r:?}"
                        );
                    };
                    off(node
                        .register_trusted_region(64, Permissions::READ_WRITE)
                        .map(drop));
                    let peer = node.connect(addr).await.expect("connect");
                    let d = TrustedDescriptor::from_bytes(&descs[0].0).unwrap();
                    off(peer.put_trusted(&d, 0, b"x").await);
                    off(peer.get_trusted(&d, 0, 1).await.map(drop));
                    // Even an access the descriptor forbids: the mode is checked first.
                    off(peer.put_trusted(&d, u64::MAX, b"x").await);
                    let e = peer.put_trusted(&d, 0, b"x").await.unwrap_err();
                    assert!(e.to_string().contains("trusted"), "{e}");
                    // No trusted operation ran.
                    assert_eq!(node.trusted_rma_stats(), TrustedStats::default());
                }
            })
            .expect("client node")
    });
    let out = server.finish();
    assert_eq!(out[0].0, pattern(TRUSTED_LEN, 0), "nothing was written");
}

/// A server that restarts (a new incarnation, same node id) invalidates the client's cached
/// endpoints and keys: the old descriptors are refused, the new ones work.
#[test]
fn trusted_cache_is_invalidated_when_the_session_ends() {
    let _g = serial();
    let first = start_trusted_server("sm,tcp");
    let (addr1, descs1) = (first.addr, first.descs.clone());
    let (go_tx, go_rx) = mpsc::channel::<(SocketAddr, Vec<(Vec<u8>, Vec<u8>)>)>();
    let go_rx = Arc::new(Mutex::new(go_rx));
    let (ready_tx, ready_rx) = mpsc::channel::<()>();
    let ready_tx = Arc::new(Mutex::new(ready_tx));
    let client = std::thread::spawn(move || {
        node(CLIENT)
            .shards(1)
            .transports("sm,tcp")
            .trusted_rma()
            .run(move |node: Node| {
                let (descs1, go_rx, ready_tx) = (descs1.clone(), go_rx.clone(), ready_tx.clone());
                async move {
                    let old = TrustedDescriptor::from_bytes(&descs1[0].0).unwrap();
                    let peer = node.connect(addr1).await.expect("connect");
                    peer.put_trusted(&old, 0, b"first").await.expect("put");
                    assert_eq!(peer.get_trusted(&old, 0, 5).await.unwrap(), b"first");
                    let before = node.trusted_rma_stats();
                    assert_eq!(
                        (before.endpoints, before.keys_unpacked),
                        (1, 1),
                        "{before:?}"
                    );
                    ready_tx.lock().unwrap().send(()).unwrap();
                    // The first server goes away; wait for the session to end. (Not by trying the
                    // old descriptor: in trusted mode a key of memory its holder has unmapped
                    // reads or writes whatever is there now, and may crash the holder.)
                    let deadline = Instant::now() + LIMIT;
                    while node
                        .shard_ctx()
                        .connected_nodes()
                        .iter()
                        .any(|r| r.node_id == SERVER)
                    {
                        assert!(Instant::now() < deadline, "session did not end");
                        sleep(Duration::from_millis(10)).await;
                    }
                    // The end of the session dropped the cached endpoint and key: the net task
                    // runs the connection-lost hook in the same step that takes the session
                    // off the list above. (Read before any trusted call, which would drop the
                    // entry itself on finding no session.)
                    let at_end = node.trusted_rma_stats();
                    assert!(at_end.invalidated >= 1, "{at_end:?}");
                    // With no session, the old descriptor is refused before UCX is touched
                    // (asked of the shards' API: the facade would try to reconnect first).
                    let r = node
                        .shard_ctx()
                        .trusted_get(&old, 0, 1, Duration::from_secs(1))
                        .await;
                    assert!(
                        matches!(r, Err(RmaOpError::Net(NetError::NotConnected { .. }))),
                        "{r:?}"
                    );
                    let (addr2, descs2) = loop {
                        if let Ok(x) = go_rx.lock().unwrap().try_recv() {
                            break x;
                        }
                        assert!(Instant::now() < deadline, "no second server");
                        sleep(Duration::from_millis(5)).await;
                    };
                    let peer = node.connect(addr2).await.expect("reconnect");
                    let r = peer.put_trusted(&old, 0, b"stale").await;
                    assert!(
                        matches!(r, Err(Error::Rma(RmaOpError::StaleIncarnation { .. }))),
                        "{r:?}"
                    );
                    let new = TrustedDescriptor::from_bytes(&descs2[0].0).unwrap();
                    assert_ne!(new.incarnation(), old.incarnation());
                    peer.put_trusted(&new, 0, b"second").await.expect("put");
                    assert_eq!(peer.get_trusted(&new, 0, 6).await.unwrap(), b"second");
                    node.trusted_rma_stats()
                }
            })
            .expect("client node")
    });
    ready_rx.recv_timeout(LIMIT).expect("client did not start");
    let out1 = first.finish();
    assert_eq!(&out1[0].0[..5], b"first");
    let second = start_trusted_server("sm,tcp");
    go_tx.send((second.addr, second.descs.clone())).unwrap();
    let stats = within(move || client.join().expect("client panicked"));
    let out2 = second.finish();
    assert_eq!(&out2[0].0[..6], b"second");
    // The caches of the first run were dropped, and new ones made for the second.
    let s = stats[0];
    assert!(s.invalidated >= 1, "{s:?}");
    assert_eq!((s.endpoints, s.keys_unpacked), (2, 2), "{s:?}");
}
