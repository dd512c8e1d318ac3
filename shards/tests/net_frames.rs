//! Tier 3: requests with deadlines and rendezvous frames between two nodes of two shards each,
//! in one process, over tcp on loopback.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // A test/example may panic: a panic is a failure it reports.

use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use glommio::timer::sleep;
use shardcx_shards::net::Dest;
use shardcx_shards::net::NetConfig;
use shardcx_shards::proto::{AmId, FrameHeader, FrameKind, NodeId, ReqId, ShardId};
use shardcx_shards::ucx::AlignedBuf;
use shardcx_shards::{NetError, NetStats, Placement, ShardCtx, ShardsBuilder};

/// Longest any one test may run.
const LIMIT: Duration = Duration::from_secs(90);
const KEY: &[u8] = b"sixteen byte key, and some more";
const A: NodeId = NodeId::new(0xA11CE);
const B: NodeId = NodeId::new(0xB0B);
/// Large messages into a handler-chosen buffer.
const BIG: AmId = AmId::new(10);
/// Large messages into the plain handler's vector.
const PLAIN: AmId = AmId::new(11);
/// B's acknowledgement of a large message: its length and checksum.
const ACK: AmId = AmId::new(12);

/// Shard 0 of B: the requests and messages of these tests all go there, from A's shard 0 on its
/// rail to it and from A's shard 1 forwarded to A's shard 0 (shards of A hold rails to the shard
/// of B with their index), so that one shard of each side sees all the traffic, as the owner
/// shards did before rails.
fn b0() -> Dest {
    Dest::shard(B, ShardId::new(0))
}

/// The shard of A that holds the rail to shard 0 of B.
const RAIL_HOLDER: ShardId = ShardId::new(0);

/// Two nodes of two shards each must fit the 8 MiB locked-memory limit: one test at a time.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn net_config() -> NetConfig {
    NetConfig {
        connect_timeout: Duration::from_secs(3),
        handshake_timeout: Duration::from_secs(3),
        linger: Duration::from_millis(200),
        ..NetConfig::default()
    }
}

fn node(id: NodeId, cfg: NetConfig) -> ShardsBuilder {
    ShardsBuilder::new()
        .shard_count(2)
        .placement(Placement::Unpinned)
        .transports("tcp")
        .io_memory(1 << 20)
        .node_id(id)
        .psk(KEY)
        .net(cfg)
}

/// A byte pattern that differs with `seed` and position.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

/// A checksum of `bytes` (FNV-1a).
fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// What each shard of node B reports when it ends.
#[derive(Debug, Clone)]
struct Report {
    stats: NetStats,
}

/// Node B in its own thread: `setup` runs on every shard before B's address is published; B
/// ends when `done` is set (or after `LIMIT`).
struct NodeB {
    addr: SocketAddr,
    done: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<Report>>,
}

fn start_b<S>(cfg: NetConfig, setup: S) -> NodeB
where
    S: Fn(&Rc<ShardCtx>) + Send + Sync + Clone + 'static,
{
    let (tx, rx) = mpsc::channel();
    let done = Arc::new(AtomicBool::new(false));
    let done2 = done.clone();
    let tx = Arc::new(Mutex::new(tx));
    let thread = std::thread::spawn(move || {
        node(B, cfg)
            .listen("127.0.0.1:0".parse().unwrap())
            .run(move |ctx: Rc<ShardCtx>| {
                let (done, tx, setup) = (done2.clone(), tx.clone(), setup.clone());
                async move {
                    setup(&ctx);
                    // Both shards have their handlers before A can connect.
                    let _ = tx.lock().unwrap().send(ctx.listen_addr());
                    let deadline = Instant::now() + LIMIT;
                    while !done.load(Ordering::Acquire) && Instant::now() < deadline {
                        sleep(Duration::from_millis(5)).await;
                    }
                    Report {
                        stats: ctx.net_stats(),
                    }
                }
            })
            .unwrap()
    });
    let mut addr = None;
    for _ in 0..2 {
        if let Some(a) = rx.recv_timeout(LIMIT).expect("node B did not start") {
            addr = Some(a);
        }
    }
    NodeB {
        addr: addr.expect("shard 0 of B listens"),
        done,
        thread,
    }
}

impl NodeB {
    fn finish(self) -> Vec<Report> {
        self.done.store(true, Ordering::Release);
        let (tx, rx) = mpsc::channel();
        let h = self.thread;
        std::thread::spawn(move || {
            let _ = tx.send(h.join());
        });
        rx.recv_timeout(LIMIT)
            .expect("node B did not stop")
            .expect("node B panicked")
    }
}

/// Runs node A with `f` on every shard, bounded by `LIMIT`.
fn run_a<T, F, Fut>(cfg: NetConfig, f: F) -> Vec<T>
where
    F: Fn(Rc<ShardCtx>) -> Fut + Send + Clone + 'static,
    Fut: std::future::Future<Output = T> + 'static,
    T: Send + 'static,
{
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(node(A, cfg).run(f));
    });
    rx.recv_timeout(LIMIT)
        .expect("node A still running")
        .expect("node A failed")
}

/// Waits (polling every `step`) until `count` reaches `n`, for at most `limit`.
async fn wait_for_count(count: &AtomicUsize, n: usize, limit: Duration, step: Duration) {
    let deadline = Instant::now() + limit;
    while count.load(Ordering::Acquire) < n && Instant::now() < deadline {
        sleep(step).await;
    }
}

/// The one shard of A that reported (the others returned `None`).
fn the_one<T>(out: Vec<Option<T>>) -> T {
    out.into_iter()
        .flatten()
        .next()
        .expect("the reporting shard of A")
}

/// Keeps a shard of A alive (serving forwards) until both shards are done, bounded.
async fn wait_for_both(finished: &AtomicUsize) {
    finished.fetch_add(1, Ordering::AcqRel);
    let deadline = Instant::now() + Duration::from_secs(20);
    while finished.load(Ordering::Acquire) < 2 && Instant::now() < deadline {
        sleep(Duration::from_millis(2)).await;
    }
}

/// B's RPC handler: answers with the payload reversed, or with an `RpcError` when the request's
/// deadline did not arrive as a time-to-live within (0, 10 s].
fn echo_reversed(ctx: &Rc<ShardCtx>) {
    ctx.set_frame_handler(FrameKind::RpcRequest, |ctx, from, header, mut payload| {
        let ok_ttl = header.ttl_ns > 0 && header.ttl_ns <= 10_000_000_000;
        let h = *header;
        let ctx = ctx.clone();
        payload.reverse();
        glommio::spawn_local(async move {
            let kind = if ok_ttl {
                FrameKind::RpcResponse
            } else {
                FrameKind::RpcError
            };
            ctx.reply(from, &h, kind, payload).await.expect("reply");
        })
        .detach();
    })
    .unwrap();
    ctx.set_frame_handler(FrameKind::RmaGet, |ctx, from, header, _payload| {
        let h = *header;
        let ctx = ctx.clone();
        glommio::spawn_local(async move {
            // A get of region `id` returns `id` four times; asking for the wrong reply kind
            // is refused.
            let bytes = h.id.to_le_bytes().repeat(4);
            assert!(matches!(
                ctx.reply(from, &h, FrameKind::RpcResponse, vec![]).await,
                Err(NetError::BadKind { .. })
            ));
            ctx.reply(from, &h, FrameKind::RmaReply, bytes)
                .await
                .expect("reply");
        })
        .detach();
    })
    .unwrap();
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

#[test]
fn requests_from_owner_and_non_owner_get_their_replies() {
    let _g = serial();
    let b = start_b(net_config(), echo_reversed);
    let addr = b.addr;
    let owner_a = RAIL_HOLDER;
    let finished = Arc::new(AtomicUsize::new(0));
    const N: usize = 200;
    let got = run_a(net_config(), move |ctx| {
        let finished = finished.clone();
        async move {
            ctx.connect(addr).await.expect("connect");
            let me = ctx.id().get() as u8;
            let mut rtts = Vec::with_capacity(N);
            let mut last_req = ReqId::NONE;
            for i in 0..N {
                let msg = vec![me, i as u8, (i >> 8) as u8, 0xAB, 0xCD];
                let t0 = Instant::now();
                let (h, reply) = ctx
                    .request(
                        b0(),
                        FrameKind::RpcRequest,
                        7,
                        msg.clone(),
                        Duration::from_secs(5),
                    )
                    .await
                    .expect("request");
                rtts.push(t0.elapsed());
                assert_eq!(h.kind, FrameKind::RpcResponse, "ttl did not arrive");
                assert_eq!(h.id, 7);
                assert_ne!(h.req_id, ReqId::NONE);
                if ctx.id() == owner_a {
                    // Ids are allocated in order on the owner.
                    assert!(h.req_id > last_req);
                    last_req = h.req_id;
                }
                let mut want = msg;
                want.reverse();
                assert_eq!(reply, want);
            }
            if ctx.id() == owner_a {
                // A short request gives its vector back once sent: the next request is
                // encoded into it (no allocation per request).
                let mut v = ctx.request_buffer();
                // A capacity of its own, which a new vector would not have.
                v.reserve(700);
                v.extend_from_slice(&[me, 1, 2, 3]);
                let (at, room) = (v.as_ptr(), v.capacity());
                let (_, reply) = ctx
                    .request(b0(), FrameKind::RpcRequest, 7, v, Duration::from_secs(5))
                    .await
                    .expect("request from the spare vector");
                assert_eq!(reply, [3, 2, 1, me]);
                let again = ctx.request_buffer();
                assert!(again.is_empty());
                assert_eq!(
                    (again.as_ptr(), again.capacity()),
                    (at, room),
                    "the request's vector was not kept"
                );
            }
            // Large request and reply, both by rendezvous.
            let big = pattern(300 << 10, me);
            let (h, reply) = ctx
                .request(
                    b0(),
                    FrameKind::RpcRequest,
                    8,
                    big.clone(),
                    Duration::from_secs(10),
                )
                .await
                .expect("large request");
            assert_eq!(h.kind, FrameKind::RpcResponse);
            assert_eq!(reply.len(), big.len());
            assert!(reply.iter().rev().eq(big.iter()), "large reply content");
            // A long request's vector is handed over, not kept as the spare.
            assert!(ctx.request_buffer().capacity() < big.len());
            // An RMA get carries its region id.
            let (h, reply) = ctx
                .request(
                    b0(),
                    FrameKind::RmaGet,
                    0x1234,
                    vec![],
                    Duration::from_secs(5),
                )
                .await
                .expect("rma get");
            assert_eq!(h.kind, FrameKind::RmaReply);
            assert_eq!(reply, 0x1234u32.to_le_bytes().repeat(4));
            // Kinds that are not requests are refused before anything is sent.
            let r = ctx
                .request(b0(), FrameKind::Am, 1, vec![], Duration::from_secs(1))
                .await;
            assert!(matches!(r, Err(NetError::BadKind { .. })), "{r:?}");
            let pending = ctx
                .forward(owner_a, |c| async move { c.pending_requests() })
                .await
                .unwrap();
            wait_for_both(&finished).await;
            rtts.sort();
            (ctx.id(), rtts, pending)
        }
    });
    let reports = b.finish();
    for (shard, rtts, pending) in &got {
        assert_eq!(rtts.len(), N);
        let role = if *shard == owner_a {
            "owner"
        } else {
            "non-owner"
        };
        eprintln!(
            "request round trip from the {role} shard {shard}: p50 {:?}, p99 {:?}, max {:?}",
            percentile(rtts, 0.5),
            percentile(rtts, 0.99),
            rtts[rtts.len() - 1]
        );
        assert!(*pending <= 1, "owner still has {pending} pending");
    }
    let owner_b = ShardId::new(0);
    let s = reports[owner_b.index()].stats;
    // 2 × (N + 2) requests delivered to handlers, and the owner's one from its spare vector.
    assert_eq!(s.delivered, 2 * (N as u64 + 2) + 1, "{s:?}");
    // Each large request came by rendezvous.
    assert_eq!(s.rendezvous, 2, "{s:?}");
    assert_eq!(s.dropped_no_handler + s.dropped_malformed, 0, "{s:?}");
}

#[test]
fn unanswered_requests_time_out() {
    let _g = serial();
    let seen = Arc::new(AtomicUsize::new(0));
    let seen_b = seen.clone();
    let b = start_b(net_config(), move |ctx: &Rc<ShardCtx>| {
        let seen = seen_b.clone();
        ctx.set_frame_handler(FrameKind::RpcRequest, move |_, _, _, _| {
            seen.fetch_add(1, Ordering::AcqRel);
        })
        .unwrap();
    });
    let addr = b.addr;
    let owner_a = RAIL_HOLDER;
    let finished = Arc::new(AtomicUsize::new(0));
    let timeout = Duration::from_millis(300);
    let got = run_a(net_config(), move |ctx| {
        let finished = finished.clone();
        async move {
            // Before connecting: nothing to send on.
            let r = ctx
                .request(b0(), FrameKind::RpcRequest, 1, vec![1], timeout)
                .await;
            assert_eq!(r, Err(NetError::NotConnected { node: B }));
            ctx.connect(addr).await.expect("connect");
            let t0 = Instant::now();
            let r = ctx
                .request(b0(), FrameKind::RpcRequest, 1, vec![1, 2, 3], timeout)
                .await;
            let took = t0.elapsed();
            let pending = ctx
                .forward(owner_a, |c| async move { c.pending_requests() })
                .await
                .unwrap();
            wait_for_both(&finished).await;
            (r, took, pending)
        }
    });
    let _ = b.finish();
    assert_eq!(seen.load(Ordering::Acquire), 2, "B saw both requests");
    for (r, took, pending) in got {
        assert_eq!(r, Err(NetError::TimedOut { what: "request" }));
        assert!(took >= timeout, "gave up early: {took:?}");
        assert!(took < timeout + Duration::from_secs(1), "took {took:?}");
        // The other shard's request may still be in flight; never more.
        assert!(pending <= 1, "{pending} pending");
    }
}

/// A burst of eager frames just under the rendezvous threshold, sent without yielding, so that
/// TCP usually cannot take them all at once: those UCX took in place and those queued (copied)
/// for the sender all arrive, intact and in order.
#[test]
fn a_burst_of_eager_frames_arrives_in_order() {
    const FRAMES: u64 = 3000;
    const SEQ: AmId = AmId::new(13);
    let _g = serial();
    let len = NetConfig::default().rndv_threshold;
    let got = Arc::new(AtomicUsize::new(0));
    let bad = Arc::new(AtomicUsize::new(0));
    let (got_b, bad_b) = (got.clone(), bad.clone());
    let b = start_b(net_config(), move |ctx: &Rc<ShardCtx>| {
        let (got, bad) = (got_b.clone(), bad_b.clone());
        let next = std::cell::Cell::new(0u64);
        ctx.set_net_handler(SEQ, move |_, _, payload| {
            let seq = payload
                .get(..8)
                .and_then(|s| s.try_into().ok())
                .map(u64::from_le_bytes);
            let intact =
                payload.len() == len && payload[8..].iter().all(|&x| x == seq.unwrap_or(0) as u8);
            if seq != Some(next.get()) || !intact {
                bad.fetch_add(1, Ordering::Relaxed);
            }
            next.set(seq.unwrap_or(0) + 1);
            got.fetch_add(1, Ordering::Release);
        });
    });
    let addr = b.addr;
    let owner_a = RAIL_HOLDER;
    let got_a = got.clone();
    let sent = run_a(net_config(), move |ctx| {
        let got = got_a.clone();
        async move {
            if ctx.id() != owner_a {
                return None;
            }
            ctx.connect(addr).await.expect("connected");
            for seq in 0..FRAMES {
                let mut payload = vec![seq as u8; len];
                payload[..8].copy_from_slice(&seq.to_le_bytes());
                ctx.send_am(b0(), SEQ, payload).await.expect("queued");
            }
            wait_for_count(&got, FRAMES as usize, LIMIT, Duration::from_millis(1)).await;
            Some(ctx.net_stats())
        }
    });
    let _ = b.finish();
    let sent = the_one(sent);
    assert_eq!(got.load(Ordering::Acquire), FRAMES as usize, "{sent:?}");
    assert_eq!(
        bad.load(Ordering::Relaxed),
        0,
        "frames out of order or damaged"
    );
    // How many UCX took in place, how many were posted at once and how many were queued
    // (copied) for the sender depends on the socket buffers and the timing: said, and only
    // their sum asserted.
    eprintln!(
        "{} frames sent in place, {} posted, {} queued for the sender",
        sent.sent_in_place, sent.sent_posted, sent.sent_queued
    );
    assert_eq!(
        sent.sent_in_place + sent.sent_posted + sent.sent_queued,
        FRAMES,
        "{sent:?}"
    );
}

/// A request whose deadline comes before every other timer of the owner shard's net task (a
/// longer request pending, heartbeats 5 s apart) still times out at its own deadline: the
/// net task's one timer is moved earlier for it.
#[test]
fn a_shorter_request_times_out_at_its_own_deadline() {
    let _g = serial();
    let quiet = || NetConfig {
        heartbeat_interval: Duration::from_secs(5),
        ..net_config()
    };
    let b = start_b(quiet(), |ctx: &Rc<ShardCtx>| {
        ctx.set_frame_handler(FrameKind::RpcRequest, |_, _, _, _| {})
            .unwrap();
    });
    let addr = b.addr;
    let owner_a = RAIL_HOLDER;
    let got = run_a(quiet(), move |ctx| async move {
        if ctx.id() != owner_a {
            return None;
        }
        ctx.connect(addr).await.expect("connect");
        let c = ctx.clone();
        // Pending for 20 s: the net task's timer is armed for it (and for heartbeats, 5 s).
        let long = glommio::spawn_local(async move {
            c.request(
                B,
                FrameKind::RpcRequest,
                1,
                vec![1],
                Duration::from_secs(20),
            )
            .await
        });
        glommio::timer::sleep(Duration::from_millis(20)).await;
        let t0 = Instant::now();
        let r = ctx
            .request(
                B,
                FrameKind::RpcRequest,
                1,
                vec![2],
                Duration::from_millis(50),
            )
            .await;
        let took = t0.elapsed();
        drop(long);
        Some((r, took))
    });
    let _ = b.finish();
    let (r, took) = the_one(got);
    assert_eq!(r, Err(NetError::TimedOut { what: "request" }));
    assert!(took >= Duration::from_millis(50), "gave up early: {took:?}");
    assert!(took < Duration::from_millis(1000), "took {took:?}");
}

/// A handler's answer: its token, the request's outcome, and whether a request the handler sent
/// then was refused.
type Answered = (u64, Result<(), NetError>, bool);

/// Node B, whose shards take `RmaPut` requests (counted in `seen`) and never answer them.
fn silent_b(seen: &Arc<AtomicUsize>) -> NodeB {
    let seen_b = seen.clone();
    start_b(net_config(), move |ctx: &Rc<ShardCtx>| {
        let seen = seen_b.clone();
        ctx.set_frame_handler(FrameKind::RmaPut, move |_, _, _, _| {
            seen.fetch_add(1, Ordering::AcqRel);
        })
        .unwrap();
    })
}

#[test]
fn pending_requests_fail_when_the_peer_shuts_down() {
    let _g = serial();
    let seen = Arc::new(AtomicUsize::new(0));
    let b = silent_b(&seen);
    let addr = b.addr;
    let b_done = b.done.clone();
    const PER_SHARD: usize = 3;
    let got = run_a(net_config(), move |ctx| {
        let (seen, b_done) = (seen.clone(), b_done.clone());
        async move {
            ctx.connect(addr).await.expect("connect");
            let mut tasks = Vec::new();
            for i in 0..PER_SHARD {
                let c = ctx.clone();
                tasks.push(glommio::spawn_local(async move {
                    let t0 = Instant::now();
                    let r = c
                        .request(
                            B,
                            FrameKind::RmaPut,
                            i as u32,
                            vec![0u8; 100],
                            Duration::from_secs(30),
                        )
                        .await;
                    (r, t0.elapsed())
                }));
            }
            // Once B has every request, stop B.
            let (limit, step) = (Duration::from_secs(10), Duration::from_millis(2));
            wait_for_count(&seen, 2 * PER_SHARD, limit, step).await;
            b_done.store(true, Ordering::Release);
            let mut out = Vec::new();
            for t in tasks {
                out.push(t.await);
            }
            out
        }
    });
    let _ = b.finish();
    let all: Vec<_> = got.into_iter().flatten().collect();
    assert_eq!(all.len(), 2 * PER_SHARD);
    for (r, took) in all {
        assert!(
            matches!(
                r,
                Err(NetError::Closed { node: B }
                    | NetError::PeerDead { node: B }
                    | NetError::Transport { node: B })
            ),
            "{r:?}"
        );
        // Well before the 30 s deadline.
        assert!(took < Duration::from_secs(10), "took {took:?}");
    }
}

#[test]
fn requests_answered_into_a_handler_fail_when_the_peer_shuts_down() {
    let _g = serial();
    let seen = Arc::new(AtomicUsize::new(0));
    let b = silent_b(&seen);
    let addr = b.addr;
    let b_done = b.done.clone();
    const PER_SHARD: u64 = 3;
    let got = run_a(net_config(), move |ctx| {
        let (seen, b_done) = (seen.clone(), b_done.clone());
        async move {
            ctx.connect(addr).await.expect("connect");
            // Each answer, and what a request sent from the handler then got (the handler may
            // send while the failed rail's requests are being answered).
            let answers: Rc<std::cell::RefCell<Vec<Answered>>> = Rc::default();
            let (a, c) = (answers.clone(), ctx.clone());
            let ignore: shardcx_shards::net::ReplyHandler = Rc::new(|_, _| {});
            let handler: shardcx_shards::net::ReplyHandler = Rc::new(move |token, r| {
                let again = c
                    .request_then(
                        B,
                        (FrameKind::RmaPut, 9),
                        vec![0u8; 8],
                        (Duration::from_secs(30), Duration::from_secs(30)),
                        (&ignore, 0),
                    )
                    .is_err();
                a.borrow_mut().push((token, r.map(|_| ()), again));
            });
            for i in 0..PER_SHARD {
                ctx.request_then(
                    B,
                    (FrameKind::RmaPut, i as u32),
                    vec![0u8; 100],
                    (Duration::from_secs(30), Duration::from_secs(30)),
                    (&handler, i),
                )
                .expect("sent");
            }
            assert!(answers.borrow().is_empty(), "answered before any reply");
            let (limit, step) = (Duration::from_secs(10), Duration::from_millis(2));
            wait_for_count(&seen, 2 * PER_SHARD as usize, limit, step).await;
            b_done.store(true, Ordering::Release);
            let t0 = Instant::now();
            while (answers.borrow().len() as u64) < PER_SHARD {
                assert!(t0.elapsed() < limit, "answers: {:?}", answers.borrow());
                sleep(step).await;
            }
            let out = answers.borrow().clone();
            (out, ctx.net_stats().handler_panics)
        }
    });
    let _ = b.finish();
    for (mut answers, panics) in got {
        assert_eq!(panics, 0);
        answers.sort_by_key(|a| a.0);
        assert_eq!(
            answers.iter().map(|a| a.0).collect::<Vec<_>>(),
            (0..PER_SHARD).collect::<Vec<_>>(),
            "each request answered once"
        );
        for (_, r, again_refused) in answers {
            assert!(
                matches!(
                    r,
                    Err(NetError::Closed { node: B }
                        | NetError::PeerDead { node: B }
                        | NetError::Transport { node: B })
                ),
                "{r:?}"
            );
            // The rail is gone by then: a request from the handler is refused, not lost.
            assert!(again_refused);
        }
    }
}

#[test]
fn requests_pending_at_shutdown_are_answered_within_the_drain_timeout() {
    let _g = serial();
    let seen = Arc::new(AtomicUsize::new(0));
    let seen_b = seen.clone();
    // B answers each request 300 ms after it arrives.
    let b = start_b(net_config(), move |ctx: &Rc<ShardCtx>| {
        let seen = seen_b.clone();
        ctx.set_frame_handler(FrameKind::RpcRequest, move |ctx, from, header, payload| {
            seen.fetch_add(1, Ordering::AcqRel);
            let (ctx, h) = (ctx.clone(), *header);
            glommio::spawn_local(async move {
                sleep(Duration::from_millis(300)).await;
                let _ = ctx.reply(from, &h, FrameKind::RpcResponse, payload).await;
            })
            .detach();
        })
        .unwrap();
    });
    let addr = b.addr;
    type Answers = Arc<Mutex<Vec<Result<Vec<u8>, String>>>>;
    let results: Answers = Arc::default();
    let out = results.clone();
    run_a(net_config(), move |ctx| {
        let (seen, out) = (seen.clone(), out.clone());
        async move {
            ctx.connect(addr).await.expect("connect");
            // Only from the shard that holds the rail: a request from the other shard is a
            // forwarded job, which the mesh's drain waits for anyway.
            if ctx.id() != RAIL_HOLDER {
                return;
            }
            // A request left running when the shard's future returns.
            let c = ctx.clone();
            glommio::spawn_local(async move {
                let r = c
                    .request(
                        b0(),
                        FrameKind::RpcRequest,
                        1,
                        vec![7],
                        Duration::from_secs(30),
                    )
                    .await;
                out.lock()
                    .unwrap()
                    .push(r.map(|(_, p)| p).map_err(|e| e.to_string()));
            })
            .detach();
            wait_for_count(&seen, 1, Duration::from_secs(10), Duration::from_millis(2)).await;
        }
    });
    let _ = b.finish();
    // The shutdown waited for the answer instead of failing the request with ShuttingDown.
    let got = results.lock().unwrap().clone();
    assert_eq!(got, vec![Ok(vec![7])]);
}

/// Registers BIG (into an aligned buffer of the handler's choosing) and PLAIN (into the plain
/// handler's vector) on a shard of B; each acknowledges with (length, checksum). Counts the
/// buffers `choose` handed out.
fn large_handlers(chosen: Arc<AtomicUsize>) -> impl Fn(&Rc<ShardCtx>) + Send + Sync + Clone {
    move |ctx: &Rc<ShardCtx>| {
        let chosen = chosen.clone();
        ctx.set_net_handler_rndv(
            BIG,
            move |_ctx, _from, header: &FrameHeader| {
                chosen.fetch_add(1, Ordering::AcqRel);
                AlignedBuf::zeroed(header.payload_len as usize, 4096).ok()
            },
            |ctx, from, header, res| {
                let buf = res.expect("rendezvous data");
                let data = &buf.as_slice()[..header.payload_len as usize];
                let ack = ack_bytes(data);
                let ctx = ctx.clone();
                glommio::spawn_local(async move {
                    ctx.send_am(from, ACK, ack).await.expect("ack");
                })
                .detach();
            },
        );
        for id in [BIG, PLAIN] {
            ctx.set_net_handler(id, |ctx, from, payload| {
                let ack = ack_bytes(&payload);
                let ctx = ctx.clone();
                glommio::spawn_local(async move {
                    ctx.send_am(from, ACK, ack).await.expect("ack");
                })
                .detach();
            });
        }
    }
}

fn ack_bytes(data: &[u8]) -> Vec<u8> {
    let mut v = (data.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(&checksum(data).to_le_bytes());
    v
}

type Acks = Arc<Mutex<Vec<(u64, u64)>>>;

/// On every shard of A: collect B's acks.
fn collect_acks(ctx: &Rc<ShardCtx>, acks: &Acks) {
    let acks = acks.clone();
    ctx.set_net_handler(ACK, move |_, _, p| {
        let len = u64::from_le_bytes(p[..8].try_into().unwrap());
        let sum = u64::from_le_bytes(p[8..16].try_into().unwrap());
        acks.lock().unwrap().push((len, sum));
    });
}

async fn wait_for_ack(acks: &Acks, want: (u64, u64), limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if acks.lock().unwrap().contains(&want) {
            return true;
        }
        sleep(Duration::from_millis(1)).await;
    }
    false
}

#[test]
fn large_messages_arrive_by_rendezvous_in_the_handlers_buffer() {
    let _g = serial();
    let chosen = Arc::new(AtomicUsize::new(0));
    let b = start_b(net_config(), large_handlers(chosen.clone()));
    let addr = b.addr;
    let owner_a = RAIL_HOLDER;
    let acks: Acks = Arc::default();
    let finished = Arc::new(AtomicUsize::new(0));
    let got = run_a(net_config(), move |ctx| {
        let (acks, finished) = (acks.clone(), finished.clone());
        async move {
            collect_acks(&ctx, &acks);
            ctx.connect(addr).await.expect("connect");
            // The owner sends 1 MiB, the other shard 16 MiB (forwarded to the owner); both
            // also send 1 MiB to the plain handler.
            let me = ctx.id().get() as u8;
            let size = if ctx.id() == owner_a {
                1 << 20
            } else {
                16 << 20
            };
            let mut ok = Vec::new();
            for (id, len) in [(BIG, size), (PLAIN, 1 << 20)] {
                let msg = pattern(len, me.wrapping_add(id.get() as u8));
                let want = (len as u64, checksum(&msg));
                let t0 = Instant::now();
                ctx.send_am(b0(), id, msg).await.expect("send");
                let arrived = wait_for_ack(&acks, want, Duration::from_secs(30)).await;
                ok.push((id, len, arrived, t0.elapsed()));
            }
            wait_for_both(&finished).await;
            ok
        }
    });
    let reports = b.finish();
    for (id, len, arrived, took) in got.into_iter().flatten() {
        assert!(arrived, "no ack for {len} bytes to {id:?}");
        eprintln!("{len} bytes to {id:?} acknowledged after {took:?}");
    }
    assert_eq!(chosen.load(Ordering::Acquire), 2, "choose ran once per BIG");
    let owner_b = ShardId::new(0);
    let s = reports[owner_b.index()].stats;
    assert_eq!(s.rendezvous, 4, "{s:?}");
    assert_eq!(
        s.declined + s.dropped_too_large + s.dropped_malformed,
        0,
        "{s:?}"
    );
}

#[test]
fn oversized_payloads_are_refused_before_allocation() {
    let _g = serial();
    let chosen = Arc::new(AtomicUsize::new(0));
    // B accepts at most 1 MiB.
    let b_cfg = NetConfig {
        max_message_size: 1 << 20,
        ..net_config()
    };
    let b = start_b(b_cfg, large_handlers(chosen.clone()));
    let addr = b.addr;
    let owner_a = RAIL_HOLDER;
    // A sends up to 1.5 MiB eager, and accepts the default 16 MiB.
    let a_cfg = NetConfig {
        rndv_threshold: 3 << 19,
        ..net_config()
    };
    let acks: Acks = Arc::default();
    let got = run_a(a_cfg, move |ctx| {
        let acks = acks.clone();
        async move {
            // Over A's own limit: refused on this shard, from either shard, before sending.
            let max = 16u64 << 20;
            let too_big = vec![0u8; (max + 1) as usize];
            let r = ctx.send_am(b0(), BIG, too_big.clone()).await;
            assert_eq!(r, Err(NetError::TooLarge { len: max + 1, max }));
            let r = ctx
                .request(
                    b0(),
                    FrameKind::RpcRequest,
                    1,
                    too_big,
                    Duration::from_secs(1),
                )
                .await;
            assert!(matches!(r, Err(NetError::TooLarge { .. })), "{r:?}");
            if ctx.id() != owner_a {
                return None;
            }
            collect_acks(&ctx, &acks);
            ctx.connect(addr).await.expect("connect");
            // Over B's limit: 2 MiB by rendezvous, 1.25 MiB eager. B drops both.
            for len in [2 << 20, 5 << 18] {
                ctx.send_am(b0(), BIG, pattern(len, 1)).await.expect("send");
            }
            // Then one within the limit (eager here) still arrives: the connection is fine.
            let msg = pattern(1 << 20, 2);
            let want = (msg.len() as u64, checksum(&msg));
            ctx.send_am(b0(), BIG, msg).await.expect("send");
            Some(wait_for_ack(&acks, want, Duration::from_secs(20)).await)
        }
    });
    let reports = b.finish();
    assert_eq!(got.into_iter().flatten().collect::<Vec<_>>(), vec![true]);
    // Neither oversized message reached `choose` or was pulled.
    assert_eq!(chosen.load(Ordering::Acquire), 0);
    let owner_b = ShardId::new(0);
    let s = reports[owner_b.index()].stats;
    assert_eq!(s.dropped_too_large, 2, "{s:?}");
    assert_eq!(s.rendezvous, 0, "{s:?}");
    assert_eq!(s.delivered, 1, "{s:?}");
}

/// Stops the shard of B it reaches: its thread sleeps, so nothing sent to it completes.
const STALL: AmId = AmId::new(13);

/// A rail's backlog (`NetConfig::max_backlog_bytes`, 1 MiB here): while B's shard is stalled,
/// A's rendezvous sends to it stay incomplete and hold their bytes; the send that would go
/// over the limit is refused with `Backlogged` (nothing sent), the figures read back, every
/// accepted send arrives once B runs again, the backlog empties, and an empty rail takes a
/// frame larger than the limit.
#[test]
fn a_stalled_peer_fills_the_rails_backlog_and_further_sends_are_refused() {
    let _g = serial();
    let chosen = Arc::new(AtomicUsize::new(0));
    let stalled = Arc::new(AtomicBool::new(false));
    // Heartbeats may miss the whole stall without the peer being declared dead.
    let cfg = NetConfig {
        dead_after: 50,
        ..net_config()
    };
    let b = start_b(cfg.clone(), {
        let (handlers, stalled) = (large_handlers(chosen.clone()), stalled.clone());
        move |ctx: &Rc<ShardCtx>| {
            handlers(ctx);
            let stalled = stalled.clone();
            ctx.set_net_handler(STALL, move |_, _, _| {
                stalled.store(true, Ordering::Release);
                std::thread::sleep(Duration::from_millis(1500));
            });
        }
    });
    let addr = b.addr;
    let limit = 1u64 << 20;
    let a_cfg = NetConfig {
        max_backlog_bytes: limit,
        ..cfg
    };
    let acks: Acks = Arc::default();
    let got = run_a(a_cfg, move |ctx| {
        let (acks, stalled) = (acks.clone(), stalled.clone());
        async move {
            if ctx.id() != RAIL_HOLDER {
                return None;
            }
            collect_acks(&ctx, &acks);
            ctx.connect(addr).await.expect("connect");
            ctx.send_am_now(b0(), STALL, &[], &[]).expect("stall");
            let deadline = Instant::now() + Duration::from_secs(10);
            while !stalled.load(Ordering::Acquire) && Instant::now() < deadline {
                sleep(Duration::from_millis(1)).await;
            }
            assert!(stalled.load(Ordering::Acquire), "B never stalled");
            // 256 KiB each, by rendezvous: posted, and not pulled while B sleeps.
            let mut accepted = Vec::new();
            let mut refused = None;
            for i in 0..16u8 {
                let msg = pattern(256 << 10, i);
                let want = (msg.len() as u64, checksum(&msg));
                match ctx.send_am_buf_now(b0(), BIG, &[], msg) {
                    Ok(()) => accepted.push(want),
                    Err(NetError::Backlogged { held, limit, .. }) => {
                        refused = Some((i, held, limit, ctx.backlog_bytes(B)));
                        break;
                    }
                    Err(e) => panic!("send {i}: {e}"),
                }
            }
            let mut arrived = 0;
            for want in &accepted {
                if wait_for_ack(&acks, *want, Duration::from_secs(20)).await {
                    arrived += 1;
                }
            }
            // The senders see the completions shortly after B's acks.
            let deadline = Instant::now() + Duration::from_secs(5);
            while ctx.backlog_bytes(B) > 0 && Instant::now() < deadline {
                sleep(Duration::from_millis(1)).await;
            }
            let drained = ctx.backlog_bytes(B);
            // An empty rail takes a frame over the limit.
            let big = pattern(2 << 20, 99);
            let want = (big.len() as u64, checksum(&big));
            ctx.send_am_buf_now(b0(), BIG, &[], big)
                .expect("a large frame on an empty rail");
            let big_arrived = wait_for_ack(&acks, want, Duration::from_secs(20)).await;
            Some((
                accepted.len(),
                arrived,
                refused,
                drained,
                big_arrived,
                ctx.net_stats(),
            ))
        }
    });
    b.finish();
    let (accepted, arrived, refused, drained, big_arrived, stats) = the_one(got);
    eprintln!("accepted {accepted}, refused {refused:?}, stats {stats:?}");
    let (at, held, said_limit, read) = refused.expect("a send was refused");
    assert_eq!(said_limit, limit);
    assert_eq!(at as usize, accepted);
    // Three 256 KiB frames (and their headers) fit 1 MiB, a fourth does not.
    assert_eq!(accepted, 3);
    assert!(held > 3 * (256 << 10) && held <= limit, "{held}");
    assert_eq!(read, held, "backlog_bytes reads what the refusal said");
    assert_eq!(arrived, accepted, "every accepted send arrived");
    assert_eq!(drained, 0, "the backlog empties once the peer runs");
    assert!(big_arrived);
    assert_eq!(stats.sends_backlogged, 1);
    assert!(stats.backlog_peak_bytes >= held, "{stats:?}");
}

#[test]
fn frame_handlers_only_for_request_kinds() {
    let _g = serial();
    run_a(net_config(), |ctx| async move {
        for kind in FrameKind::ALL {
            let r = ctx.set_frame_handler(kind, |_, _, _, _| {});
            let allowed = matches!(
                kind,
                FrameKind::RpcRequest
                    | FrameKind::RpcCancel
                    | FrameKind::RmaPut
                    | FrameKind::RmaGet
            );
            assert_eq!(r.is_ok(), allowed, "{kind:?}: {r:?}");
        }
        let r = ctx
            .send_frame(B, FrameKind::Heartbeat, 0, ReqId::NONE, vec![])
            .await;
        assert!(matches!(r, Err(NetError::BadKind { .. })), "{r:?}");
    });
}

/// Slow handlers do not silence a shard: B's handler takes 30 ms a frame and A sends 60
/// frames at once (1.8 s of handler time), with peers declared dead after 500 ms without a
/// heartbeat. B's dispatch stops at glommio's preempt timer and yields (the rest stays
/// recorded), so its heartbeats still go out: every frame is handled, in order, and neither
/// side declares the other dead, and B counts its dispatches cut short
/// (`dispatch_preempted`). (Dispatched all in one go, they held B's shard for 1.8 s.)
#[test]
fn slow_handlers_leave_room_for_heartbeats() {
    const SLOW: AmId = AmId::new(14);
    const FRAMES: usize = 60;
    let _g = serial();
    let cfg = NetConfig {
        heartbeat_interval: Duration::from_millis(100),
        dead_after: 5,
        ..net_config()
    };
    let got = Arc::new(AtomicUsize::new(0));
    let bad = Arc::new(AtomicUsize::new(0));
    let (got_b, bad_b) = (got.clone(), bad.clone());
    let b = start_b(cfg.clone(), move |ctx: &Rc<ShardCtx>| {
        let (got, bad) = (got_b.clone(), bad_b.clone());
        ctx.set_net_handler(SLOW, move |_, _, payload| {
            if payload.first().copied() != Some(got.load(Ordering::Acquire) as u8) {
                bad.fetch_add(1, Ordering::Relaxed);
            }
            std::thread::sleep(Duration::from_millis(30));
            got.fetch_add(1, Ordering::Release);
        });
    });
    let addr = b.addr;
    let got_a = got.clone();
    let out = run_a(cfg, move |ctx| {
        let got = got_a.clone();
        async move {
            if ctx.id() != RAIL_HOLDER {
                return None;
            }
            ctx.connect(addr).await.expect("connect");
            for i in 0..FRAMES {
                ctx.send_am_now(b0(), SLOW, &[], &[i as u8; 8])
                    .expect("sent");
            }
            wait_for_count(
                &got,
                FRAMES,
                Duration::from_secs(20),
                Duration::from_millis(5),
            )
            .await;
            Some(ctx.net_stats())
        }
    });
    let reports = b.finish();
    let a = the_one(out);
    assert_eq!(got.load(Ordering::Acquire), FRAMES, "{a:?}");
    assert_eq!(bad.load(Ordering::Relaxed), 0, "frames out of order");
    assert_eq!(a.peers_dead, 0, "A declared B dead: {a:?}");
    for r in &reports {
        assert_eq!(r.stats.peers_dead, 0, "B declared A dead: {:?}", r.stats);
    }
    // Cut short by the preempt timer, and counted so (not as a flood).
    let preempted: u64 = reports.iter().map(|r| r.stats.dispatch_preempted).sum();
    assert!(preempted > 0, "{reports:?}");
}
