//! Tier 3: two nodes of two shards each, in one process, connected over tcp on loopback.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // A test/example may panic: a panic is a failure it reports.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use glommio::timer::sleep;
use shardcx_shards::net::{
    data_am_header, frame_am_header, NetConfig, NetStats, DATA_AM, FRAME_AM,
};
use shardcx_shards::proto::handshake::RejectReason;
use shardcx_shards::proto::wire::{encode_frame, frame_len};
use shardcx_shards::proto::{AmId, FrameHeader, FrameKind, Limits, NodeId};
use shardcx_shards::ucx::{AmProto, Endpoint, EpOptions, ErrorMode};
use shardcx_shards::{NetError, Placement, RemoteNode, ShardCtx, ShardsBuilder};

/// Longest any one test may run.
const LIMIT: Duration = Duration::from_secs(60);
const KEY: &[u8] = b"sixteen byte key, and some more";
const A: NodeId = NodeId::new(0xA11CE);
const B: NodeId = NodeId::new(0xB0B);
const PING: AmId = AmId::new(1);
const PONG: AmId = AmId::new(2);

/// Two nodes of two shards each must fit the 8 MiB locked-memory limit: one test at a time.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn node(id: NodeId, key: &[u8]) -> ShardsBuilder {
    ShardsBuilder::new()
        .shard_count(2)
        .placement(Placement::Unpinned)
        .transports("tcp")
        .io_memory(1 << 20)
        .node_id(id)
        .psk(key)
        .net(NetConfig {
            connect_timeout: Duration::from_secs(3),
            handshake_timeout: Duration::from_secs(3),
            linger: Duration::from_millis(200),
            ..NetConfig::default()
        })
}

/// What each shard of the listening node reports when it ends.
#[derive(Debug, Clone)]
struct Report {
    stats: NetStats,
    pings: u64,
}

/// Starts node B (listening, answering PING with PONG) in its own thread; returns its address,
/// the flag that ends it, and its thread.
fn start_b(
    key: &'static [u8],
) -> (
    SocketAddr,
    Arc<AtomicBool>,
    std::thread::JoinHandle<Vec<Report>>,
) {
    start_b_from(node(B, key))
}

/// [`start_b`] with B built by `b`.
fn start_b_from(
    b: ShardsBuilder,
) -> (
    SocketAddr,
    Arc<AtomicBool>,
    std::thread::JoinHandle<Vec<Report>>,
) {
    let (tx, rx) = mpsc::channel();
    let done = Arc::new(AtomicBool::new(false));
    let done2 = done.clone();
    let tx = Arc::new(Mutex::new(tx));
    let h = std::thread::spawn(move || {
        b.listen("127.0.0.1:0".parse().unwrap())
            .run(move |ctx: Rc<ShardCtx>| {
                let done = done2.clone();
                let tx = tx.clone();
                async move {
                    let pings = Rc::new(std::cell::Cell::new(0u64));
                    let p = pings.clone();
                    ctx.set_net_handler(PING, move |ctx, from, payload| {
                        p.set(p.get() + 1);
                        let ctx = ctx.clone();
                        glommio::spawn_local(async move {
                            let _ = ctx.send_am(from, PONG, payload).await;
                        })
                        .detach();
                    });
                    if ctx.id().get() == 0 {
                        let _ = tx.lock().unwrap().send(ctx.listen_addr().unwrap());
                    }
                    let deadline = Instant::now() + LIMIT;
                    while !done.load(Ordering::Acquire) && Instant::now() < deadline {
                        sleep(Duration::from_millis(5)).await;
                    }
                    Report {
                        stats: ctx.net_stats(),
                        pings: pings.get(),
                    }
                }
            })
            .unwrap()
    });
    let addr = rx.recv_timeout(LIMIT).expect("node B did not start");
    (addr, done, h)
}

/// Runs node A with `f` on every shard, bounded by `LIMIT`.
fn run_a<T, F, Fut>(key: &'static [u8], f: F) -> Vec<T>
where
    F: Fn(Rc<ShardCtx>) -> Fut + Send + Clone + 'static,
    Fut: std::future::Future<Output = T> + 'static,
    T: Send + 'static,
{
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(node(A, key).run(f));
    });
    rx.recv_timeout(LIMIT)
        .expect("node A still running")
        .expect("node A failed")
}

fn finish_b(done: &AtomicBool, h: std::thread::JoinHandle<Vec<Report>>) -> Vec<Report> {
    done.store(true, Ordering::Release);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(h.join());
    });
    rx.recv_timeout(LIMIT)
        .expect("node B did not stop (see Driver::join)")
        .expect("node B panicked")
}

/// A connect from one shard sets up the whole node pair: one pre-shared-key handshake (on
/// shard 0 of each side), then every other rail joined, so that every shard of A holds its own
/// default rail to the shard of B with its index, and B holds the mirror rails.
#[test]
fn connect_sets_up_a_rail_on_every_shard() {
    let _g = serial();
    let (addr, done, b) = start_b(KEY);
    let got = run_a(KEY, move |ctx| async move {
        // Connect from shard 1, so that the establishment is forwarded to shard 0.
        if ctx.id().get() != 1 {
            return None;
        }
        let remote = ctx.connect(addr).await.expect("connect");
        // Every shard now holds its default rail: ask each one.
        let mut rails = Vec::new();
        for s in 0..2u16 {
            let to = shardcx_shards::proto::ShardId::new(s);
            let (nodes, stats) = ctx
                .forward(to, |c| async move { (c.connected_nodes(), c.net_stats()) })
                .await
                .unwrap();
            rails.push((nodes, stats));
        }
        Some((remote, rails))
    });
    let reports = finish_b(&done, b);
    let (remote, rails) = got.into_iter().flatten().next().expect("a result");
    assert_eq!(remote.node_id, B);
    assert_eq!(remote.shard_count, 2);
    assert_eq!((remote.owner.get(), remote.remote_shard.get()), (1, 1));
    for (s, (nodes, stats)) in rails.iter().enumerate() {
        let b = nodes.iter().find(|r| r.node_id == B);
        let b = b.unwrap_or_else(|| panic!("shard {s} of A has no rail to B: {nodes:?}"));
        assert_eq!((b.owner.index(), b.remote_shard.index()), (s, s));
        let (primary, joined) = if s == 0 { (1, 0) } else { (0, 1) };
        assert_eq!(
            (stats.handshakes, stats.joins),
            (primary, joined),
            "shard {s} of A"
        );
    }
    for (s, r) in reports.iter().enumerate() {
        let (primary, joined) = if s == 0 { (1, 0) } else { (0, 1) };
        assert_eq!(
            (r.stats.handshakes, r.stats.joins),
            (primary, joined),
            "shard {s} of B: {r:?}"
        );
        assert_eq!(r.stats.dropped_misrouted, 0);
        assert_eq!(r.stats.dropped_unauthenticated, 0);
    }
}

/// Pings from every shard of A, each on its own default rail, land on the shard of B with the
/// same index, whose answers go back on the same rail: no shard handles another's traffic.
#[test]
fn round_trip_from_every_shard() {
    let _g = serial();
    let (addr, done, b) = start_b(KEY);
    let pongs: Arc<Mutex<HashSet<Vec<u8>>>> = Arc::default();
    const N: u8 = 20;
    let rtts = run_a(KEY, move |ctx| {
        let pongs = pongs.clone();
        async move {
            let p = pongs.clone();
            let me = ctx.id().get() as u8;
            ctx.set_net_handler(PONG, move |_ctx, from, payload| {
                assert_eq!(from, B);
                assert_eq!(payload[0], me, "a pong for another shard's ping");
                p.lock().unwrap().insert(payload);
            });
            let remote = ctx.connect(addr).await.expect("connect");
            assert_eq!(remote.node_id, B);
            let mut worst = Duration::ZERO;
            for i in 0..N {
                let msg = vec![me, i, 0xAB];
                let t0 = Instant::now();
                ctx.send_am(B, PING, msg.clone()).await.expect("send");
                let deadline = t0 + Duration::from_secs(5);
                while !pongs.lock().unwrap().contains(&msg) {
                    assert!(Instant::now() < deadline, "no pong for {msg:?}");
                    sleep(Duration::from_micros(200)).await;
                }
                worst = worst.max(t0.elapsed());
            }
            worst
        }
    });
    let reports = finish_b(&done, b);
    assert_eq!(rtts.len(), 2);
    for (s, r) in reports.iter().enumerate() {
        assert_eq!(r.pings, u64::from(N), "shard {s} of B: {r:?}");
    }
    let handshakes: u64 = reports.iter().map(|r| r.stats.handshakes).sum();
    assert_eq!(handshakes, 1, "one pre-shared-key handshake per node pair");
}

#[test]
fn wrong_key_is_refused() {
    let _g = serial();
    let (addr, done, b) = start_b(KEY);
    let got = timed_connect_from_shard_0(b"another key of sixteen bytes", addr);
    let reports = finish_b(&done, b);
    let (r, took) = got;
    assert!(
        matches!(
            r,
            Err(NetError::Refused {
                node: B,
                reason: RejectReason::BadProof
            })
        ),
        "{r:?}"
    );
    assert!(took < Duration::from_secs(3), "took {took:?}");
    assert!(
        reports.iter().all(|r| r.stats.handshakes == 0),
        "{reports:?}"
    );
}

/// Node A (pre-shared key `key`) connects to `addr` from shard 0; the outcome and how long it
/// took.
fn timed_connect_from_shard_0(
    key: &'static [u8],
    addr: SocketAddr,
) -> (Result<RemoteNode, NetError>, Duration) {
    let got = run_a(key, move |ctx| async move {
        if ctx.id().get() != 0 {
            return None;
        }
        let t0 = Instant::now();
        let r = ctx.connect(addr).await;
        Some((r, t0.elapsed()))
    });
    got.into_iter().flatten().next().expect("shard 0 connects")
}

#[test]
fn connect_without_listener_fails_within_deadline() {
    let _g = serial();
    // A port that nobody listens on (bound, then released).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let got = timed_connect_from_shard_0(KEY, addr);
    let (r, took) = got;
    assert!(
        matches!(
            r,
            Err(NetError::Unreachable { .. } | NetError::TimedOut { .. })
        ),
        "{r:?}"
    );
    // The connect timeout is 3 s.
    assert!(took < Duration::from_millis(3500), "took {took:?}");
}

#[test]
fn frame_before_handshake_is_dropped() {
    let _g = serial();
    let (addr, done, b) = start_b(KEY);
    run_a(KEY, move |ctx| async move {
        if ctx.id().get() != 0 {
            return;
        }
        // Learn B's workers, but do not handshake: send application frames straight to shard
        // 0 of B, claiming to be A, in the control frames' format and in the data frames'.
        let dir = ctx.bootstrap(addr).await.expect("bootstrap");
        let r = shardcx_shards::proto::ShardId::new(0);
        let opts = EpOptions {
            error_mode: ErrorMode::Peer,
        };
        let ep = Endpoint::connect_to_worker(ctx.worker(), &dir.workers[r.index()], opts).unwrap();
        let payload = b"sneaky";
        let header = FrameHeader {
            id: PING.get(),
            payload_len: payload.len() as u64,
            ..FrameHeader::new(FrameKind::Am)
        };
        let limits = Limits::default();
        let mut frame = vec![0u8; frame_len(header.payload_len, &limits).unwrap()];
        encode_frame(&header, payload, &mut frame, &limits).unwrap();
        for _ in 0..3 {
            let send = ep.am_send(
                FRAME_AM,
                &frame_am_header(A, 0),
                frame.clone(),
                AmProto::Eager,
            );
            ctx.wake_driver();
            let (res, _) = send.await;
            res.expect("raw send");
            let data_header = data_am_header(A, &header, &[]);
            let send = ep.am_send(DATA_AM, &data_header, payload.to_vec(), AmProto::Eager);
            ctx.wake_driver();
            let (res, _) = send.await;
            res.expect("raw data send");
        }
        let flushed = futures_lite::future::or(async { ep.flush().await.is_ok() }, async {
            sleep(Duration::from_secs(3)).await;
            false
        })
        .await;
        assert!(flushed, "flush timed out");
        // Give B's net task time to see them.
        sleep(Duration::from_millis(200)).await;
    });
    let reports = finish_b(&done, b);
    let dropped: u64 = reports
        .iter()
        .map(|r| r.stats.dropped_unauthenticated)
        .sum();
    assert_eq!(dropped, 6, "{reports:?}");
    assert!(reports
        .iter()
        .all(|r| r.pings == 0 && r.stats.delivered == 0));
}

#[test]
fn net_types_cross_threads() {
    fn send_sync<T: Send + Sync + 'static>() {}
    send_sync::<NetError>();
    send_sync::<NetConfig>();
    send_sync::<NetStats>();
    send_sync::<shardcx_shards::RemoteNode>();
    send_sync::<shardcx_shards::Directory>();
}

/// A listener that hands out a directory whose only worker never answers: the connect
/// bootstraps, then sends its Hello into silence.
fn silent_listener(stop: Arc<AtomicBool>) -> (SocketAddr, std::thread::JoinHandle<usize>) {
    use shardcx_shards::net::bootstrap::BOOTSTRAP_REQUEST;
    use shardcx_shards::net::Directory;
    use shardcx_shards::proto::Incarnation;
    use shardcx_shards::ucx::{Config, Context, Features, Worker};
    use std::io::{Read, Write};
    let (tx, rx) = mpsc::channel();
    let h = std::thread::spawn(move || {
        let mut cfg = Config::from_env().unwrap();
        cfg.set("TLS", "tcp").unwrap();
        let ctx = Context::new(&cfg, Features::messaging()).unwrap();
        // Never progressed, and without a frame handler anyway.
        let silent = Worker::new(&ctx).unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        tx.send(listener.local_addr().unwrap()).unwrap();
        let dir = Directory {
            node_id: NodeId::new(0x5113),
            incarnation: Incarnation::new(1),
            workers: vec![silent.address().unwrap()],
        }
        .encode();
        let mut served = 0;
        let deadline = Instant::now() + LIMIT;
        while !stop.load(Ordering::Acquire) && Instant::now() < deadline {
            if let Ok((mut s, _)) = listener.accept() {
                s.set_nonblocking(false).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                let mut req = [0u8; 8];
                s.read_exact(&mut req).unwrap();
                assert_eq!(req, BOOTSTRAP_REQUEST);
                s.write_all(&(dir.len() as u32).to_le_bytes()).unwrap();
                s.write_all(&dir).unwrap();
                served += 1;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        served
    });
    (rx.recv_timeout(LIMIT).expect("listener did not start"), h)
}

#[test]
fn an_unanswered_hello_fails_at_the_handshake_deadline() {
    let _g = serial();
    let stop = Arc::new(AtomicBool::new(false));
    let (addr, listener) = silent_listener(stop.clone());
    let got = timed_connect_from_shard_0(KEY, addr);
    stop.store(true, Ordering::Release);
    let served = listener.join().expect("listener panicked");
    let (r, took) = got;
    assert_eq!(served, 1, "one bootstrap");
    assert!(
        matches!(r, Err(NetError::TimedOut { what: "handshake" })),
        "{r:?}"
    );
    // The handshake timeout is 3 s.
    assert!(
        took >= Duration::from_millis(2900) && took < Duration::from_secs(5),
        "took {took:?}"
    );
}

/// Whether the node closed `s` (end of file or reset) within `limit`; `Err` if it sent
/// something instead.
fn closed_within(s: &mut std::net::TcpStream, limit: Duration) -> Result<bool, String> {
    use std::io::Read;
    s.set_read_timeout(Some(limit)).unwrap();
    let mut b = [0u8; 64];
    match s.read(&mut b) {
        Ok(0) => Ok(true),
        Ok(n) => Err(format!("{n} bytes from the node")),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            Ok(false)
        }
        Err(_) => Ok(true),
    }
}

/// Defect "foreign UCX clients": a UCX client that is not shardcx (here a plain endpoint of
/// the ucx crate dialling the node's address, as `ucx_perftest` would) used to be accepted by
/// the node's UCX listener and hang until its own timeout. Now it is refused at once; a
/// client that connects and says nothing is closed at the accept deadline; beyond
/// `max_half_open` connections being served, a new one is closed at once; every case is
/// counted, and a real node connects afterwards.
#[test]
fn foreign_ucx_clients_are_refused_and_half_open_connections_capped() {
    use shardcx_shards::ucx::{Config, Context, Features, Worker};
    let _g = serial();
    let accept_timeout = Duration::from_secs(1);
    let b = node(B, KEY).net(NetConfig {
        accept_timeout,
        max_half_open: 3,
        linger: Duration::from_millis(200),
        ..NetConfig::default()
    });
    let (addr, done, h) = start_b_from(b);
    // A raw UCX client: no bootstrap request, no handshake.
    let ucx_client = std::thread::spawn(move || {
        let mut cfg = Config::from_env().unwrap();
        cfg.set("TLS", "tcp").unwrap();
        let ctx = Context::new(&cfg, Features::messaging()).unwrap();
        let worker = Worker::new(&ctx).unwrap();
        let opts = EpOptions {
            error_mode: ErrorMode::Peer,
        };
        let t0 = Instant::now();
        let ep = Endpoint::connect(&worker, addr, opts).unwrap();
        while ep.error().is_none() && t0.elapsed() < Duration::from_secs(10) {
            worker.progress();
            std::thread::sleep(Duration::from_millis(1));
        }
        (ep.error(), t0.elapsed())
    });
    let (err, took) = ucx_client.join().expect("UCX client panicked");
    eprintln!("the raw UCX client's endpoint failed after {took:?}: {err:?}");
    assert!(
        err.is_some(),
        "the raw UCX client's endpoint is still up after {took:?}"
    );
    assert!(
        took < accept_timeout + Duration::from_millis(500),
        "{took:?}"
    );
    // Three silent clients fill the cap; two more are closed at once.
    std::thread::sleep(Duration::from_millis(100));
    let t0 = Instant::now();
    let mut silent: Vec<_> = (0..3)
        .map(|_| std::net::TcpStream::connect(addr).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    for i in 0..2 {
        let mut extra = std::net::TcpStream::connect(addr).unwrap();
        let closed = closed_within(&mut extra, Duration::from_millis(500));
        assert_eq!(closed, Ok(true), "connection {i} over the cap");
    }
    for (i, s) in silent.iter_mut().enumerate() {
        let closed = closed_within(s, Duration::from_secs(3));
        let at = t0.elapsed();
        assert_eq!(closed, Ok(true), "silent connection {i}");
        assert!(
            at >= accept_timeout - Duration::from_millis(100)
                && at < accept_timeout + Duration::from_millis(900),
            "silent connection {i} closed after {at:?}"
        );
    }
    // A node still gets in.
    let (r, _) = timed_connect_from_shard_0(KEY, addr);
    assert!(r.is_ok(), "{r:?}");
    let reports = finish_b(&done, h);
    let st = reports[0].stats;
    assert_eq!(st.bootstraps_refused, 1, "{st:?}");
    assert_eq!(st.bootstraps_timed_out, 3, "{st:?}");
    assert_eq!(st.bootstraps_over_cap, 2, "{st:?}");
    assert_eq!(st.bootstraps_served, 1, "{st:?}");
}

/// A listener that cannot bind (the port is taken) fails the whole run with its error: the
/// other shard never runs its closure and stops too, promptly.
#[test]
fn a_listener_that_cannot_bind_fails_the_run_and_no_shard_serves() {
    let _g = serial();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let ran = Arc::new(AtomicBool::new(false));
    let ran2 = ran.clone();
    let start = Instant::now();
    let r = node(B, KEY).listen(addr).run(move |_ctx: Rc<ShardCtx>| {
        let ran = ran2.clone();
        async move { ran.store(true, Ordering::Release) }
    });
    let err = r.expect_err("the run should fail");
    assert!(
        matches!(err, shardcx_shards::BootError::Listen { shard: 0, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("in use"), "{err}");
    assert!(!ran.load(Ordering::Acquire), "a shard ran its closure");
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "{:?}",
        start.elapsed()
    );
    drop(taken);
}

/// Strikes against a peer add up over the node's shards: 50 from each of two shards drop it
/// (the limit is 100), once, and every shard then sees it banned. (Counted per shard, a peer
/// spreading its malformed frames over N rails got N times the limit.)
#[test]
fn strikes_from_every_shard_add_up_to_one_drop() {
    let _g = serial();
    const X: NodeId = NodeId::new(0xBAD);
    let struck = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let out = run_a(KEY, move |ctx: Rc<ShardCtx>| {
        let struck = struck.clone();
        async move {
            let mut drops = 0;
            for _ in 0..50 {
                drops += usize::from(ctx.strike(X));
                // Interleave the two shards' strikes.
                glommio::yield_if_needed().await;
            }
            struck.fetch_add(1, Ordering::AcqRel);
            let t0 = Instant::now();
            while struck.load(Ordering::Acquire) < 2 && t0.elapsed() < LIMIT {
                sleep(Duration::from_millis(1)).await;
            }
            (drops, ctx.is_banned(X), ctx.net_stats().peers_dropped)
        }
    });
    let drops: usize = out.iter().map(|o| o.0).sum();
    assert_eq!(drops, 1, "{out:?}");
    assert!(
        out.iter().all(|o| o.1),
        "not banned on every shard: {out:?}"
    );
    assert_eq!(out.iter().map(|o| o.2).sum::<u64>(), 1, "{out:?}");
}
