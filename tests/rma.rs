//! Checked remote memory through the facade: two nodes of two shards each in one process, over
//! tcp on loopback. The server node holds regions on both of its shards; the client puts and
//! gets from both of its shards (the one that owns the server, and the one that forwards), so
//! every route is taken: owner or forwarded on the client, region on the server's owner shard
//! or on the other one. Every refusal is checked to leave the server's memory unchanged.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // A test may panic: a panic is a failure it reports.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use glommio::timer::sleep;
use shardcx::proto::region::{GetRequest, PutRequest, RmaReply};
use shardcx::proto::{FrameKind, Limits, ShardMap};
use shardcx::rma::{
    DescriptorError, Permissions, Region, RemoteRegion, RmaErrorCode, RmaOpError, RmaStats,
};
use shardcx::shards::{NetError, Placement};
use shardcx::{Error, Node, NodeBuilder, NodeId, Peer, ShardId};

/// Longest any one test may run.
const LIMIT: Duration = Duration::from_secs(60);
/// Longest a client waits for the server to answer a control command.
const ASK_LIMIT: Duration = Duration::from_secs(10);
const KEY: &[u8] = b"rma facade test key, 16+ bytes";
const CLIENT: NodeId = NodeId::new(1);
const SERVER: NodeId = NodeId::new(2);
/// A node that is neither, for grants to someone else.
const STRANGER: NodeId = NodeId::new(99);

/// Two nodes of two shards each must fit the 8 MiB locked-memory limit: one test at a time.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn node(id: NodeId) -> NodeBuilder {
    Node::builder()
        .shards(2)
        .placement(Placement::Unpinned)
        .transports("tcp")
        .io_memory(1 << 20)
        .node_id(id)
        .psk(KEY)
}

/// Runs `f` on another thread; fails the test if it takes longer than `LIMIT`.
fn within<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(LIMIT).expect("still running after LIMIT")
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
    let server_owner = ShardMap::new(2).unwrap().owner_of(CLIENT);
    for (client_shard, owner, _, times) in &got {
        let route = if client_shard == owner {
            "owner"
        } else {
            "forwarded"
        };
        for (holder, puts, gets) in times {
            let region = if *holder == server_owner.index() {
                "on the server's owner shard"
            } else {
                "forwarded on the server"
            };
            eprintln!(
                "client shard {client_shard} ({route}), region {region}: 8-byte put p50 {:?} \
                 p99 {:?}, get p50 {:?} p99 {:?}",
                percentile(puts, 0.5),
                percentile(puts, 0.99),
                percentile(gets, 0.5),
                percentile(gets, 0.99)
            );
        }
    }
    // Every access was served where the memory is, half of them after a forward.
    let per_holder = 2 * (2 * ROUNDS + 1 + 2 * TIMED) as u64;
    for (i, s) in stats.iter().enumerate() {
        assert_eq!(s.puts + s.gets, per_holder, "server shard {i}: {s:?}");
        assert_eq!(
            s.refused + s.malformed + s.expired + s.unanswered,
            0,
            "{s:?}"
        );
    }
    assert_eq!(
        stats[server_owner.index()].forwarded,
        per_holder,
        "{stats:?}"
    );
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
    let got = run_client(move |node: Node| {
        let regions = regions.clone();
        async move {
            let d = regions[0]["rw"];
            // Before connecting: a typed connection error.
            let r = Peer::new(SERVER).put(&d, 0, b"x").await;
            assert!(
                matches!(r, Err(Error::Net(NetError::NotConnected { .. }))),
                "{r:?}"
            );
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
}
