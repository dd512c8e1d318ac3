//! The facade's tag send/recv: two nodes of two shards each in one process, over tcp on
//! loopback (the runtime-level cases, caps and rendezvous included, are in
//! `shards/tests/tag.rs`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // A test may panic: a panic is a failure it reports.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use glommio::timer::sleep;
use shardcx::shards::{NetError, Placement};
use shardcx::{Error, Node, NodeBuilder, NodeId, Peer, MAX_USER_TAG, TAG_MASK_ANY, TAG_MASK_EXACT};

mod common;
/// Longest any one test may run.
const LIMIT: Duration = Duration::from_secs(60);
const KEY: &[u8] = b"facade tag test key, 16+ bytes";
const A: NodeId = NodeId::new(0xA);
const B: NodeId = NodeId::new(0xB);
/// Messages per shard and stream.
const N: u32 = 50;

use common::serial;

fn node(id: NodeId) -> NodeBuilder {
    common::two_shard_node(id, KEY)
}

/// Waits until every shard of the node has started its closure (the node's start hook
/// installed the tag handlers on every shard before any served).
async fn install_all(node: &Node, count: &AtomicU32) {
    count.fetch_add(1, Ordering::AcqRel);
    wait_for(|| count.load(Ordering::Acquire) >= node.shard_count() as u32).await;
}

async fn wait_for(mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < LIMIT, "timed out waiting");
        sleep(Duration::from_millis(1)).await;
    }
}

fn payload(stream: u64, seq: u32) -> Vec<u8> {
    let len = (seq as usize * 13) % 300;
    (0..len)
        .map(|i| (i as u64 ^ stream ^ u64::from(seq) << 2) as u8)
        .collect()
}

/// Runs `f` on another thread; fails the test if it takes longer than `LIMIT` (with the stacks
/// of the test's threads).
fn within<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    common::within(LIMIT, f)
}

/// Runs node B (listening) and node A (connecting to it), two shards each: once every shard
/// of its node has started, each shard of A runs `on_a(node, B)` and each shard of B runs
/// `on_b(node, A)`. Returns each node's results, by shard; fails past `LIMIT`.
fn pair<FA, FutA, RA, FB, FutB, RB>(on_a: FA, on_b: FB) -> (Vec<RA>, Vec<RB>)
where
    FA: Fn(Node, Peer) -> FutA + Send + Clone + 'static,
    FutA: std::future::Future<Output = RA> + 'static,
    RA: Send + 'static,
    FB: Fn(Node, Peer) -> FutB + Send + Clone + 'static,
    FutB: std::future::Future<Output = RB> + 'static,
    RB: Send + 'static,
{
    let _g = serial();
    let addr: Arc<OnceLock<SocketAddr>> = Arc::default();
    let addr_a = addr.clone();
    let b = std::thread::spawn(move || {
        let ready = Arc::new(AtomicU32::new(0));
        node(B)
            .listen("127.0.0.1:0".parse().unwrap())
            .run(move |node: Node| {
                let (addr, ready, on_b) = (addr.clone(), ready.clone(), on_b.clone());
                async move {
                    install_all(&node, &ready).await;
                    if let Some(a) = node.listen_addr() {
                        let _ = addr.set(a);
                    }
                    on_b(node, Peer::new(A)).await
                }
            })
            .expect("node B")
    });
    let a = std::thread::spawn(move || {
        let ready = Arc::new(AtomicU32::new(0));
        node(A)
            .run(move |node: Node| {
                let (addr, ready, on_a) = (addr_a.clone(), ready.clone(), on_a.clone());
                async move {
                    install_all(&node, &ready).await;
                    wait_for(|| addr.get().is_some()).await;
                    let b = node.connect(*addr.get().unwrap()).await.expect("connect");
                    on_a(node, b).await
                }
            })
            .expect("node A")
    });
    let from_a = within(move || a.join().expect("node A panicked"));
    let from_b = within(move || b.join().expect("node B panicked"));
    (from_a, from_b)
}

#[test]
fn tagged_messages_both_ways_from_every_shard() {
    let (routes, _) = pair(
        |node: Node, b: Peer| async move {
            let me = u64::from(node.shard().get());
            for seq in 0..N {
                b.tag_send(0x100 | me, &payload(0x100 | me, seq))
                    .await
                    .expect("send");
            }
            for seq in 0..N {
                let t = 0x200 | me | (u64::from(seq) % 16) << 4;
                b.tag_send(t, &payload(0x200 | me, seq))
                    .await
                    .expect("send");
            }
            for seq in 0..N {
                let (t, d) = b.tag_recv(0x300 | me, TAG_MASK_EXACT).await.expect("echo");
                assert_eq!((t, d), (0x300 | me, payload(0x200 | me, seq)));
            }
            let (t, _) = b.tag_recv(0x500 | me, TAG_MASK_EXACT).await.expect("go");
            assert_eq!(t, 0x500 | me);
            b.tag_send(0x400 | me, b"last").await.expect("last");
            node.owner_of(b) == node.shard()
        },
        |node: Node, a: Peer| async move {
            let me = u64::from(node.shard().get());
            // Exact: this shard's stream, in order.
            for seq in 0..N {
                let (t, d) = a.tag_recv(0x100 | me, TAG_MASK_EXACT).await.expect("exact");
                assert_eq!((t, d), (0x100 | me, payload(0x100 | me, seq)));
            }
            // Masked: tags 0x2?m with any middle nibble, in order; echoed back.
            for seq in 0..N {
                let (t, d) = a.tag_recv(0x200 | me, 0xF0F).await.expect("masked");
                assert_eq!(t, 0x200 | me | (u64::from(seq) % 16) << 4);
                assert_eq!(d, payload(0x200 | me, seq));
                a.tag_send(0x300 | me, &d).await.expect("echo");
            }
            // A receive that times out does not take the next message.
            let r = a
                .tag_recv_within(0x400 | me, TAG_MASK_EXACT, Duration::from_millis(30))
                .await;
            assert!(
                matches!(
                    r,
                    Err(Error::TimedOut {
                        what: "tag_recv",
                        ..
                    })
                ),
                "{r:?}"
            );
            a.tag_send(0x500 | me, b"go").await.expect("go");
            let (t, d) = a.tag_recv(0x400 | me, TAG_MASK_EXACT).await.expect("last");
            assert_eq!((t, d.as_slice()), (0x400 | me, &b"last"[..]));
        },
    );
    // Every shard of A holds its own rail to B: no message was forwarded between shards.
    assert_eq!(routes.iter().filter(|&&own| own).count(), 2, "{routes:?}");
}

/// A tag sent to `peer.shard(j)` goes to the peer's shard `j` (on the rail to it), not to the
/// shard of the sender's default rail.
#[test]
fn a_tag_sent_to_a_named_shard_arrives_there() {
    let (_, got) = pair(
        |node: Node, b: Peer| async move {
            if node.shard().get() == 0 {
                b.shard(shardcx::ShardId::new(1))
                    .tag_send(0x600, b"to shard 1")
                    .await
                    .expect("send");
            }
        },
        |node: Node, a: Peer| async move {
            let wait = Duration::from_secs(if node.shard().get() == 1 { 20 } else { 2 });
            a.tag_recv_within(0x600, TAG_MASK_EXACT, wait)
                .await
                .map(|(_, d)| d)
        },
    );
    // Shard 0's receive ends without a message (at its deadline, or when A leaves).
    assert!(got[0].is_err(), "shard 0 got {:?}", got[0]);
    assert_eq!(
        got[1].as_deref().ok(),
        Some(&b"to shard 1"[..]),
        "{:?}",
        got[1]
    );
}

#[test]
fn bad_calls_fail_cleanly() {
    let r = futures_lite::future::block_on(Peer::new(A).tag_send(1, b"x"));
    assert!(matches!(r, Err(Error::NotOnShard)), "{r:?}");
    let r = futures_lite::future::block_on(Peer::new(A).tag_recv(1, TAG_MASK_EXACT));
    assert!(matches!(r, Err(Error::NotOnShard)), "{r:?}");
    let out = within(|| {
        Node::builder()
            .shards(1)
            .placement(Placement::Unpinned)
            .io_memory(1 << 20)
            .run(|_node: Node| async {
                let wide = Peer::new(B).tag_send(MAX_USER_TAG + 1, b"x").await;
                let stranger = Peer::new(B).tag_send(1, b"x").await;
                let nobody = Peer::new(B)
                    .tag_recv_within(1, TAG_MASK_ANY, Duration::from_millis(20))
                    .await;
                (
                    matches!(wide, Err(Error::Net(NetError::Wire { .. }))),
                    matches!(stranger, Err(Error::Net(NetError::NotConnected { .. }))),
                    matches!(nobody, Err(Error::TimedOut { .. })),
                )
            })
            .expect("node")
    });
    assert_eq!(out, [(true, true, true)]);
}

/// Node B (one shard, listening, set up by `b_cfg`) runs `b_body`; node A (one shard)
/// connects to it and runs `a_body` with B as a peer. Returns B's result.
fn one_shard_pair<T, BB, BF, AB, AF>(
    b_cfg: impl FnOnce(NodeBuilder) -> NodeBuilder + Send + 'static,
    b_body: BB,
    a_body: AB,
) -> T
where
    T: Send + 'static,
    BB: Fn(Node) -> BF + Send + Clone + 'static,
    BF: std::future::Future<Output = T> + 'static,
    AB: Fn(Node, Peer) -> AF + Send + Clone + 'static,
    AF: std::future::Future<Output = ()> + 'static,
{
    let addr: Arc<OnceLock<SocketAddr>> = Arc::default();
    let addr_a = addr.clone();
    let b = std::thread::spawn(move || {
        b_cfg(node(B).shards(1))
            .listen("127.0.0.1:0".parse().unwrap())
            .run(move |node: Node| {
                let (addr, b_body) = (addr.clone(), b_body.clone());
                async move {
                    let _ = addr.set(node.listen_addr().unwrap());
                    b_body(node).await
                }
            })
            .expect("node B")
    });
    let a = std::thread::spawn(move || {
        node(A)
            .shards(1)
            .run(move |node: Node| {
                let (addr, a_body) = (addr_a.clone(), a_body.clone());
                async move {
                    wait_for(|| addr.get().is_some()).await;
                    let b = node.connect(*addr.get().unwrap()).await.expect("connect");
                    a_body(node, b).await
                }
            })
            .expect("node A")
    });
    within(move || a.join().expect("node A panicked"));
    within(move || b.join().expect("node B panicked"))
        .pop()
        .expect("one shard")
}

#[test]
fn the_unexpected_queue_bound_is_configurable() {
    let _g = serial();
    const SENT: u32 = 8;
    const CAP: usize = 3;
    let (dropped, got) = one_shard_pair(
        |b| {
            b.tag_config(shardcx::tag::TagConfig {
                max_unexpected_count: CAP,
                ..Default::default()
            })
        },
        |node: Node| async move {
            let ctx = node.shard_ctx().clone();
            // Nothing is posted while A's messages arrive: CAP wait, the rest drop.
            wait_for(|| ctx.tag_stats().arrived >= u64::from(SENT)).await;
            let stats = ctx.tag_stats();
            let a = Peer::new(A);
            let mut got = Vec::new();
            while let Ok((_, d)) = a
                .tag_recv_within(7, TAG_MASK_EXACT, Duration::from_millis(50))
                .await
            {
                got.push(d);
            }
            a.tag_send(8, b"done").await.expect("done");
            (stats.dropped_unexpected, got)
        },
        |_node: Node, b: Peer| async move {
            for seq in 0..SENT {
                b.tag_send(7, &payload(7, seq)).await.expect("send");
            }
            b.tag_recv(8, TAG_MASK_EXACT).await.expect("done");
        },
    );
    assert_eq!(dropped, u64::from(SENT) - CAP as u64);
    // The first CAP messages were kept, in order.
    let want: Vec<_> = (0..CAP as u32).map(|s| payload(7, s)).collect();
    assert_eq!(got, want);
}

#[test]
fn a_receive_for_a_peer_that_leaves_fails_at_once() {
    let _g = serial();
    let (first, second, third, elapsed) = one_shard_pair(
        |b| b,
        |_node: Node| async move {
            let a = Peer::new(A);
            // Posted before A connects: it waits for A's message.
            let first = a.tag_recv(1, TAG_MASK_EXACT).await;
            // Posted while A is connected; A then leaves (its node closes the
            // connection): this one fails then, not at its 30 s deadline. The message
            // A sent just before leaving is still received first.
            let t0 = Instant::now();
            let second = a.tag_recv(2, TAG_MASK_EXACT).await;
            let third = a
                .tag_recv_within(3, TAG_MASK_EXACT, Duration::from_secs(30))
                .await;
            (first, second, third, t0.elapsed())
        },
        |_node: Node, b: Peer| async move {
            b.tag_send(1, b"first").await.expect("send");
            sleep(Duration::from_millis(200)).await;
            b.tag_send(2, b"last words").await.expect("send");
        },
    );
    assert_eq!(first.as_ref().unwrap(), &(1, b"first".to_vec()));
    assert_eq!(second.as_ref().unwrap(), &(2, b"last words".to_vec()));
    assert!(
        matches!(&third, Err(Error::Net(NetError::Closed { node })) if *node == A),
        "{third:?}"
    );
    assert!(elapsed < Duration::from_secs(10), "{elapsed:?}");
}
