//! Two nodes of two shards each in one process, connected over tcp on loopback: prints which
//! shard owns the other node on each side, and the round-trip time of a small message from each
//! shard of the connecting node (the non-owner's goes through the mesh to the owner).
//!
//! `cargo run --release -p shardcx-shards --example two_nodes`

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // A test/example may panic: a panic is a failure it reports.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use glommio::channels::local_channel;
use glommio::timer::sleep;
use shardcx_shards::proto::{AmId, NodeId, ShardId};
use shardcx_shards::{Placement, ShardCtx, ShardsBuilder};

const KEY: &[u8] = b"example pre-shared key (16+ bytes)";
const PING: AmId = AmId::new(1);
const PONG: AmId = AmId::new(2);
const ROUNDS: usize = 2000;

fn node(id: u64) -> ShardsBuilder {
    ShardsBuilder::new()
        .shard_count(2)
        .placement(Placement::Unpinned)
        .transports("tcp")
        // Two sets of shards share this process: 1 MiB of io memory each fits 8 MiB memlock.
        .io_memory(1 << 20)
        .node_id(NodeId::new(id))
        .psk(KEY)
}

fn main() {
    let (addr_tx, addr_rx) = mpsc::channel();
    let addr_tx = Arc::new(Mutex::new(addr_tx));
    let done = Arc::new(AtomicBool::new(false));
    let done_b = done.clone();
    let b = std::thread::spawn(move || {
        node(2)
            .listen("127.0.0.1:0".parse().unwrap())
            .run(move |ctx: Rc<ShardCtx>| {
                let (addr_tx, done) = (addr_tx.clone(), done_b.clone());
                async move {
                    ctx.set_net_handler(PING, |ctx, from, payload| {
                        let ctx = ctx.clone();
                        glommio::spawn_local(async move {
                            let _ = ctx.send_am(from, PONG, payload).await;
                        })
                        .detach();
                    });
                    if ctx.id() == ShardId::new(0) {
                        let _ = addr_tx.lock().unwrap().send(ctx.listen_addr().unwrap());
                    }
                    let deadline = Instant::now() + Duration::from_secs(120);
                    while !done.load(Ordering::Acquire) && Instant::now() < deadline {
                        sleep(Duration::from_millis(10)).await;
                    }
                    println!(
                        "node 2 shard {}: {} handshake(s) completed here",
                        ctx.id(),
                        ctx.net_stats().handshakes
                    );
                }
            })
            .unwrap()
    });
    let addr = addr_rx
        .recv_timeout(Duration::from_secs(30))
        .expect("node 2 did not start");
    println!("node 2 listens on {addr}");
    // A shard whose user future has ended may no longer start forwards (see `mesh`): the owner
    // shard stays until both shards have measured, so that it can still hand pongs on.
    let finished = Arc::new(AtomicUsize::new(0));
    let a = node(1)
        .run(move |ctx: Rc<ShardCtx>| {
            let finished = finished.clone();
            async move {
                // Pongs arrive on the owner shard of node 2, which hands each to the shard that sent
                // the ping (by forward when that is another shard).
                let me = ctx.id();
                let (tx, rx) = local_channel::new_unbounded::<()>();
                PONG_TX.with(|p| *p.borrow_mut() = Some(tx));
                ctx.set_net_handler(PONG, |ctx, _from, payload| {
                    let origin = ShardId::new(u16::from(payload[0]));
                    if origin == ctx.id() {
                        pong_arrived();
                    } else {
                        let ctx = ctx.clone();
                        glommio::spawn_local(async move {
                            let _ = ctx.forward(origin, |_c| async { pong_arrived() }).await;
                        })
                        .detach();
                    }
                });
                let remote = ctx.connect(addr).await.expect("connect");
                println!(
                    "node 1 shard {me}: connected to node {} (incarnation {}); on node 1 shard {} \
                 owns node 2, on node 2 shard {} owns node 1",
                    remote.node_id, remote.incarnation, remote.owner, remote.remote_shard
                );
                let mut rtts = Vec::with_capacity(ROUNDS);
                for i in 0..ROUNDS {
                    let t0 = Instant::now();
                    let msg = vec![me.get() as u8, (i % 256) as u8];
                    ctx.send_am(remote.node_id, PING, msg).await.expect("send");
                    let got =
                        futures_lite::future::or(async { rx.recv().await.is_some() }, async {
                            sleep(Duration::from_secs(5)).await;
                            false
                        })
                        .await;
                    assert!(got, "no pong within 5 s");
                    rtts.push(t0.elapsed());
                }
                rtts.sort();
                println!(
                    "node 1 shard {me} ({}): round trip p50 {:?}, p99 {:?}, max {:?} over {ROUNDS}",
                    if me == remote.owner {
                        "owner"
                    } else {
                        "forwarded via the owner"
                    },
                    rtts[ROUNDS / 2],
                    rtts[ROUNDS * 99 / 100],
                    rtts[ROUNDS - 1]
                );
                finished.fetch_add(1, Ordering::AcqRel);
                let deadline = Instant::now() + Duration::from_secs(30);
                while finished.load(Ordering::Acquire) < ctx.shard_count()
                    && Instant::now() < deadline
                {
                    sleep(Duration::from_millis(1)).await;
                }
                PONG_TX.with(|p| p.borrow_mut().take());
            }
        })
        .expect("node 1");
    drop(a);
    done.store(true, Ordering::Release);
    b.join().expect("node 2 panicked");
}

thread_local! {
    /// This shard's pong channel (one round trip in flight per shard).
    static PONG_TX: RefCell<Option<local_channel::LocalSender<()>>> = const { RefCell::new(None) };
}

fn pong_arrived() {
    PONG_TX.with(|p| {
        if let Some(tx) = p.borrow().as_ref() {
            let _ = tx.try_send(());
        }
    });
}
