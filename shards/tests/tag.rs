//! Tier 3: tag send/recv between nodes of two shards each, in one process, over tcp on loopback.
//!
//! Every node runs in its own thread; the tests coordinate the nodes with atomics (phases), and
//! every wait is bounded.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // A test may panic: a panic is a failure it reports.

use std::future::Future;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use glommio::timer::sleep;
use shardcx_shards::net::{Dest, NetConfig};
use shardcx_shards::proto::{NodeId, ShardId, Tag, TagKind, TagMask};
use shardcx_shards::tag::{self, TagConfig, TAG_TRAILER_LEN};
use shardcx_shards::{NetError, Placement, ShardCtx, ShardsBuilder, TagStats};

/// Longest any one test may run.
const LIMIT: Duration = Duration::from_secs(60);
/// Longest one wait inside a test.
const WAIT: Duration = Duration::from_secs(10);
const KEY: &[u8] = b"sixteen byte key, and some more";
const A: NodeId = NodeId::new(0xA11CE);
const B: NodeId = NodeId::new(0xB0B);
const C: NodeId = NodeId::new(0xC0C0);
/// Messages per sending shard and phase.
const N: u32 = 20;

/// Nodes of two shards each must fit the 8 MiB locked-memory limit: one test at a time.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn node(id: NodeId, cfg: TagConfig) -> ShardsBuilder {
    ShardsBuilder::new()
        .shard_count(2)
        .placement(Placement::Unpinned)
        .transports("tcp")
        .io_memory(1 << 20)
        .node_id(id)
        .psk(KEY)
        .net(NetConfig {
            connect_timeout: Duration::from_secs(3),
            handshake_timeout: Duration::from_secs(3),
            linger: Duration::from_millis(200),
            ..NetConfig::default()
        })
        .on_start(move |ctx| tag::install_with(ctx, cfg))
}

/// A user tag (the runtime fills in kind and source shard).
fn utag(user: u64) -> Tag {
    Tag::new(TagKind::User, ShardId::new(0), user).unwrap()
}

/// Matches the user bits exactly, from any source shard.
fn exact() -> TagMask {
    TagMask::ANY_SOURCE
}

/// Matches the user bits under `user_mask`, from any source shard.
fn masked(user_mask: u64) -> TagMask {
    TagMask::from_raw(TagMask::ANY_SOURCE_ANY_USER.raw() | user_mask)
}

/// The payload of message `seq` of stream `stream`.
fn payload(stream: u64, seq: u32, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len + TAG_TRAILER_LEN);
    v.extend((0..len).map(|i| (i as u64 ^ stream.wrapping_mul(31) ^ u64::from(seq) << 3) as u8));
    v
}

/// Polls `cond` every millisecond until it holds or `WAIT` passes.
async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < WAIT, "timed out waiting for {what}");
        sleep(Duration::from_millis(1)).await;
    }
}

/// Async form of [`wait_for`].
async fn wait_for_async<F: Future<Output = bool>>(what: &str, mut cond: impl FnMut() -> F) {
    let t0 = Instant::now();
    while !cond().await {
        assert!(t0.elapsed() < WAIT, "timed out waiting for {what}");
        sleep(Duration::from_millis(1)).await;
    }
}

/// Tag counters of this shard (which matches the messages that arrive on its rails).
async fn shard_stats(ctx: &Rc<ShardCtx>) -> TagStats {
    ctx.tag_stats()
}

/// The listener's address, once its shard 0 has bound it.
type Addr = Arc<OnceLock<SocketAddr>>;

/// Runs a node in its own thread; its shards run `f`.
fn spawn<T, F, Fut>(b: ShardsBuilder, f: F) -> std::thread::JoinHandle<Vec<T>>
where
    F: Fn(Rc<ShardCtx>) -> Fut + Send + Clone + 'static,
    Fut: Future<Output = T> + 'static,
    T: Send + 'static,
{
    std::thread::spawn(move || b.run(f).expect("node runs"))
}

/// Joins node threads, failing the test after `LIMIT`.
fn join_all<T: Send + 'static>(hs: Vec<std::thread::JoinHandle<Vec<T>>>) -> Vec<Vec<T>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let out: Vec<_> = hs
            .into_iter()
            .map(|h| h.join().expect("node thread panicked"))
            .collect();
        let _ = tx.send(out);
    });
    rx.recv_timeout(LIMIT)
        .expect("nodes still running after LIMIT")
}

/// A listening node: publishes its address, then runs `f`.
fn listener<T, F, Fut>(
    id: NodeId,
    cfg: TagConfig,
    addr: &Addr,
    f: F,
) -> std::thread::JoinHandle<Vec<T>>
where
    F: Fn(Rc<ShardCtx>) -> Fut + Send + Sync + Clone + 'static,
    Fut: Future<Output = T> + 'static,
    T: Send + 'static,
{
    let addr = addr.clone();
    spawn(
        node(id, cfg).listen("127.0.0.1:0".parse().unwrap()),
        move |ctx: Rc<ShardCtx>| {
            if let Some(a) = ctx.listen_addr() {
                let _ = addr.set(a);
            }
            f(ctx)
        },
    )
}

/// Connects to the listener at `addr` from this shard.
async fn connect(ctx: &Rc<ShardCtx>, addr: &Addr) {
    let t0 = Instant::now();
    let a = loop {
        if let Some(a) = addr.get() {
            break *a;
        }
        assert!(t0.elapsed() < WAIT, "no listener address");
        sleep(Duration::from_millis(1)).await;
    };
    ctx.connect(a).await.expect("connect");
}

/// Exact and masked matching, messages queued before their receive and receives posted before
/// their message, order per tag, on every shard's own rail, both ways.
#[test]
fn matching_queueing_order_and_routes() {
    let _g = serial();
    let addr = Addr::default();
    // Phases, counted by shards: B's shards have posted their early receives (phase 2).
    let posted = Arc::new(AtomicU32::new(0));
    let posted_b = posted.clone();
    let b = listener(B, TagConfig::default(), &addr, move |ctx: Rc<ShardCtx>| {
        let posted = posted_b.clone();
        async move {
            let me = ctx.id().get() as u64;
            // Phase 1: A's shard `me` sent N messages and then a marker, all before this
            // receive; the messages wait in the unexpected queue.
            let (t, m) = ctx
                .tag_recv(A, utag(0x300 | me), exact(), WAIT)
                .await
                .expect("marker");
            assert_eq!((t.user(), m.as_slice()), (0x300 | me, &b"sent"[..]));
            assert_eq!(t.source_shard(), ShardId::new(me as u16));
            assert!(shard_stats(&ctx).await.unexpected_now >= u64::from(N));
            for seq in 0..N {
                let (t, data) = ctx
                    .tag_recv(A, utag(0x100 | me), exact(), WAIT)
                    .await
                    .expect("queued message");
                assert_eq!(t.user(), 0x100 | me);
                assert_eq!(
                    data,
                    payload(0x100 | me, seq, 100 + seq as usize),
                    "seq {seq}"
                );
            }
            // Nothing else matches 0x100|me: a receive for it times out.
            let none = ctx
                .tag_recv(A, utag(0x100 | me), exact(), Duration::from_millis(100))
                .await;
            assert!(matches!(none, Err(NetError::TimedOut { .. })), "{none:?}");
            // Phase 2: a masked receive (any 0x4?? tag from the right shard's stream) posted
            // before A sends; then the rest in order, and each echoed back.
            let first = {
                let c = ctx.clone();
                glommio::spawn_local(async move {
                    c.tag_recv(A, utag(0x400 | me), masked(0xF0F), WAIT).await
                })
            };
            wait_for_async("posted receive", || {
                let c = ctx.clone();
                async move { shard_stats(&c).await.posted_now >= 1 }
            })
            .await;
            posted.fetch_add(1, Ordering::AcqRel);
            let mut got = vec![first.await.expect("early receive")];
            for _ in 1..N {
                got.push(
                    ctx.tag_recv(A, utag(0x400 | me), masked(0xF0F), WAIT)
                        .await
                        .expect("late receive"),
                );
            }
            for (seq, (t, data)) in got.into_iter().enumerate() {
                // Senders use user tags 0x4?0|me: the middle nibble is the seq, mod 16.
                assert_eq!(t.user(), 0x400 | me | ((seq as u64 % 16) << 4));
                assert_eq!(data, payload(0x400 | me, seq as u32, seq * 7));
                ctx.tag_send(A, utag(0x800 | me), data).await.expect("echo");
            }
            posted.fetch_add(1, Ordering::AcqRel);
            wait_for("both B shards", || posted.load(Ordering::Acquire) == 4).await;
            ctx.tag_stats()
        }
    });
    let a = spawn(node(A, TagConfig::default()), move |ctx: Rc<ShardCtx>| {
        let (addr, posted) = (addr.clone(), posted.clone());
        async move {
            connect(&ctx, &addr).await;
            let me = ctx.id().get() as u64;
            for seq in 0..N {
                let data = payload(0x100 | me, seq, 100 + seq as usize);
                ctx.tag_send(B, utag(0x100 | me), data).await.expect("send");
            }
            ctx.tag_send(B, utag(0x300 | me), b"sent".to_vec())
                .await
                .expect("marker");
            wait_for("B's early receives", || posted.load(Ordering::Acquire) >= 2).await;
            for seq in 0..N {
                let t = 0x400 | me | ((u64::from(seq) % 16) << 4);
                let data = payload(0x400 | me, seq, seq as usize * 7);
                ctx.tag_send(B, utag(t), data).await.expect("send");
            }
            for seq in 0..N {
                let (t, data) = ctx
                    .tag_recv(B, utag(0x800 | me), exact(), WAIT)
                    .await
                    .expect("echo");
                assert_eq!(t.user(), 0x800 | me);
                assert_eq!(data, payload(0x400 | me, seq, seq as usize * 7));
            }
            ctx.tag_stats()
        }
    });
    let a_stats = join_all(vec![a]).remove(0);
    let stats = join_all(vec![b]).remove(0);
    // Each shard of B matched what the shard of A with its index sent on their rail, and each
    // shard of A the echoes of its own messages: no shard saw another's.
    for s in &stats {
        assert_eq!(s.arrived, u64::from(2 * N + 1), "{stats:?}");
        assert!(s.matched_on_arrival >= 1, "{stats:?}");
        assert_eq!((s.dropped_unexpected, s.malformed), (0, 0), "{stats:?}");
        assert_eq!((s.unexpected_now, s.posted_now), (0, 0), "{stats:?}");
    }
    for s in &a_stats {
        assert_eq!(s.arrived, u64::from(N), "{a_stats:?}");
    }
}

/// 1 MiB messages by rendezvous: into the lent buffer of a posted receive (no copy: the same
/// allocation comes back), and through the unexpected queue.
#[test]
fn rendezvous_into_the_posted_receive_buffer() {
    const BIG: usize = 1 << 20;
    let _g = serial();
    let addr = Addr::default();
    // B's receives are posted (2), then done (4).
    let posted = Arc::new(AtomicU32::new(0));
    let posted_b = posted.clone();
    let b = listener(B, TagConfig::default(), &addr, move |ctx: Rc<ShardCtx>| {
        let posted = posted_b.clone();
        async move {
            let me = ctx.id().get() as u64;
            let buf = Vec::with_capacity(BIG + TAG_TRAILER_LEN);
            let ptr = buf.as_ptr() as usize;
            let recv = {
                let c = ctx.clone();
                glommio::spawn_local(async move {
                    c.tag_recv_into(A, utag(0x10 | me), exact(), buf, WAIT)
                        .await
                })
            };
            wait_for_async("posted receive", || {
                let c = ctx.clone();
                async move { shard_stats(&c).await.posted_now >= 1 }
            })
            .await;
            posted.fetch_add(1, Ordering::AcqRel);
            let (t, data) = recv.await.expect("big receive");
            assert_eq!(t.user(), 0x10 | me);
            assert_eq!(data.len(), BIG);
            assert!(
                data == payload(0x10 | me, 0, BIG),
                "content of the direct receive"
            );
            assert_eq!(
                data.as_ptr() as usize,
                ptr,
                "the data landed in the lent buffer"
            );
            // The second one was sent before this receive: pulled into the queue first.
            wait_for_async("queued big message", || {
                let c = ctx.clone();
                async move { shard_stats(&c).await.unexpected_bytes_now >= BIG as u64 }
            })
            .await;
            let (t, data) = ctx
                .tag_recv(A, utag(0x20 | me), exact(), WAIT)
                .await
                .expect("queued big receive");
            assert_eq!(t.user(), 0x20 | me);
            assert!(
                data == payload(0x20 | me, 1, BIG),
                "content of the queued receive"
            );
            posted.fetch_add(1, Ordering::AcqRel);
            wait_for("both B shards", || posted.load(Ordering::Acquire) == 4).await;
            ctx.tag_stats()
        }
    });
    let a = spawn(node(A, TagConfig::default()), move |ctx: Rc<ShardCtx>| {
        let (addr, posted) = (addr.clone(), posted.clone());
        async move {
            connect(&ctx, &addr).await;
            let me = ctx.id().get() as u64;
            wait_for("B's receives", || posted.load(Ordering::Acquire) >= 2).await;
            let data = payload(0x10 | me, 0, BIG);
            ctx.tag_send(B, utag(0x10 | me), data).await.expect("send");
            let data = payload(0x20 | me, 1, BIG);
            ctx.tag_send(B, utag(0x20 | me), data).await.expect("send");
            // Stay until B has received everything.
            wait_for("B's end", || posted.load(Ordering::Acquire) == 4).await;
        }
    });
    let b_stats = join_all(vec![b]).remove(0);
    join_all(vec![a]);
    for s in &b_stats {
        // The first message, and maybe the second if its receive came first.
        assert!(s.rndv_into_receive >= 1, "{b_stats:?}");
        assert_eq!((s.unexpected_now, s.posted_now), (0, 0), "{b_stats:?}");
        assert_eq!(s.pull_failed, 0, "{b_stats:?}");
    }
}

/// Over the unexpected queue's caps, messages are dropped and counted.
#[test]
fn unexpected_queue_caps_drop_and_count() {
    let _g = serial();
    let addr = Addr::default();
    let cfg = TagConfig {
        max_unexpected_bytes: 1000,
        max_unexpected_count: 5,
    };
    let b = listener(B, cfg, &addr, move |ctx: Rc<ShardCtx>| async move {
        // Shard 0 of A sends on its rail to shard 0 of B.
        if ctx.id() != ShardId::new(0) {
            return None;
        }
        wait_for("13 messages", || ctx.tag_stats().arrived >= 13).await;
        let s = ctx.tag_stats();
        // 400 + 400 bytes fit, the third 400 does not; then three of ten small ones fit.
        assert_eq!(s.dropped_unexpected, 1 + 7, "{s:?}");
        assert_eq!(s.dropped_unexpected_bytes, 400 + 7 * 10, "{s:?}");
        assert_eq!(
            (s.unexpected_now, s.unexpected_bytes_now),
            (5, 830),
            "{s:?}"
        );
        let mut got = Vec::new();
        for _ in 0..5 {
            let (t, d) = ctx
                .tag_recv(A, utag(0), masked(0), WAIT)
                .await
                .expect("queued");
            got.push((t.user(), d.len()));
        }
        assert_eq!(got, [(0, 400), (1, 400), (3, 10), (4, 10), (5, 10)]);
        let more = ctx
            .tag_recv(A, utag(0), masked(0), Duration::from_millis(100))
            .await;
        // Nothing more is queued: the receive times out, or fails at once if A has already
        // left (its node closes the connection once it has sent).
        assert!(
            matches!(
                more,
                Err(NetError::TimedOut { .. }) | Err(NetError::Closed { .. })
            ),
            "{more:?}"
        );
        Some(ctx.tag_stats())
    });
    let a = spawn(node(A, cfg), move |ctx: Rc<ShardCtx>| {
        let addr = addr.clone();
        async move {
            connect(&ctx, &addr).await;
            if ctx.id() == ShardId::new(0) {
                for i in 0..13u32 {
                    let len = if i < 3 { 400 } else { 10 };
                    let data = payload(0, i, len);
                    ctx.tag_send(B, utag(u64::from(i)), data)
                        .await
                        .expect("send");
                }
            }
        }
    });
    let stats = join_all(vec![b]).remove(0);
    join_all(vec![a]);
    assert_eq!(stats.iter().flatten().count(), 1);
}

/// A receive that timed out, or was dropped, does not take a later message, on either shard.
#[test]
fn ended_receives_do_not_swallow_later_messages() {
    let _g = serial();
    let addr = Addr::default();
    let ready = Arc::new(AtomicU32::new(0));
    let ready_b = ready.clone();
    let b = listener(B, TagConfig::default(), &addr, move |ctx: Rc<ShardCtx>| {
        let ready = ready_b.clone();
        async move {
            let me = ctx.id().get() as u64;
            let r = ctx
                .tag_recv(A, utag(0x50 | me), exact(), Duration::from_millis(50))
                .await;
            assert!(matches!(r, Err(NetError::TimedOut { .. })), "{r:?}");
            {
                // Posted (polled once), then dropped.
                let mut f = Box::pin(ctx.tag_recv(A, utag(0x50 | me), exact(), WAIT));
                assert!(futures_lite::future::poll_once(&mut f).await.is_none());
                sleep(Duration::from_millis(20)).await;
            }
            // The shard forgets both.
            wait_for_async("no posted receives", || {
                let c = ctx.clone();
                async move { shard_stats(&c).await.posted_now == 0 }
            })
            .await;
            ready.fetch_add(1, Ordering::AcqRel);
            wait_for_async("A's message", || {
                let c = ctx.clone();
                async move { shard_stats(&c).await.unexpected_now > 0 }
            })
            .await;
            let (t, d) = ctx
                .tag_recv(A, utag(0x50 | me), exact(), WAIT)
                .await
                .expect("the later message");
            (t.user(), d)
        }
    });
    let a = spawn(node(A, TagConfig::default()), move |ctx: Rc<ShardCtx>| {
        let (addr, ready) = (addr.clone(), ready.clone());
        async move {
            connect(&ctx, &addr).await;
            let me = ctx.id().get() as u64;
            wait_for("B's ended receives", || ready.load(Ordering::Acquire) == 2).await;
            ctx.tag_send(B, utag(0x50 | me), b"later".to_vec())
                .await
                .expect("send");
        }
    });
    join_all(vec![a]);
    let got = join_all(vec![b]).remove(0);
    assert_eq!(got, [(0x50, b"later".to_vec()), (0x51, b"later".to_vec())]);
}

/// A receive for one peer never takes another peer's message with the same tag.
#[test]
fn receives_match_only_their_peer() {
    let _g = serial();
    let addr = Addr::default();
    // A has sent (1), C may send (2).
    let phase = Arc::new(AtomicU32::new(0));
    let (phase_a, phase_c) = (phase.clone(), phase.clone());
    let b = listener(B, TagConfig::default(), &addr, move |ctx: Rc<ShardCtx>| {
        let phase = phase.clone();
        async move {
            if ctx.id() != ShardId::new(0) {
                return Vec::new();
            }
            wait_for("A's message", || phase.load(Ordering::Acquire) >= 1).await;
            wait_for_async("A's message queued", || {
                let c = ctx.clone();
                async move { shard_stats(&c).await.unexpected_now == 1 }
            })
            .await;
            // Posted while A's message with the same tag waits: only C's may match.
            let from_c = {
                let c = ctx.clone();
                glommio::spawn_local(async move { c.tag_recv(C, utag(7), exact(), WAIT).await })
            };
            sleep(Duration::from_millis(20)).await;
            phase.store(2, Ordering::Release);
            let (_, c_data) = from_c.await.expect("from C");
            let (_, a_data) = ctx
                .tag_recv(A, utag(7), exact(), WAIT)
                .await
                .expect("from A");
            vec![c_data, a_data]
        }
    });
    let addr_c = addr.clone();
    let a = spawn(node(A, TagConfig::default()), move |ctx: Rc<ShardCtx>| {
        let (addr, phase) = (addr.clone(), phase_a.clone());
        async move {
            connect(&ctx, &addr).await;
            if ctx.id() == ShardId::new(0) {
                ctx.tag_send(B, utag(7), b"from A".to_vec())
                    .await
                    .expect("send");
                phase.store(1, Ordering::Release);
            }
            wait_for("the end", || phase.load(Ordering::Acquire) >= 2).await;
        }
    });
    let c = spawn(node(C, TagConfig::default()), move |ctx: Rc<ShardCtx>| {
        let (addr, phase) = (addr_c.clone(), phase_c.clone());
        async move {
            connect(&ctx, &addr).await;
            wait_for("B's receive", || phase.load(Ordering::Acquire) >= 2).await;
            if ctx.id() == ShardId::new(1) {
                // To shard 0 of B, which holds the receive (forwarded to C's shard 0).
                ctx.tag_send(Dest::shard(B, ShardId::new(0)), utag(7), b"from C".to_vec())
                    .await
                    .expect("send");
            }
        }
    });
    let got = join_all(vec![b]).remove(0);
    join_all(vec![a, c]);
    assert_eq!(got[0], [b"from C".to_vec(), b"from A".to_vec()]);
}
