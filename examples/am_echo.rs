//! Active-message echo between two nodes: every shard of the client node sends messages to the
//! server node, whose handler echoes each back; the client checks every reply's content and
//! prints round-trip percentiles per shard.
//!
//! ```text
//! cargo run --release --example am_echo                      # both nodes in this process
//! cargo run --release --example am_echo -- --listen 127.0.0.1:13337 [--for 60]   # server
//! cargo run --release --example am_echo -- --connect 127.0.0.1:13337             # client
//! ```
//!
//! Options: `--count N` messages per client shard (default 20000), `--size B` payload bytes
//! (default 8), `--shards N` per node (default 2), `--tls LIST` (default `tcp`; listening and
//! connecting need tcp in UCX 1.12). The key is fixed: it is an example.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // An example may panic: a panic is a failure it reports.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use glommio::channels::local_channel::{self, LocalSender};
use glommio::timer::sleep;
use hdrhistogram::Histogram;
use shardcx::{AmId, AmMsg, Node, NodeId, OwnedAmMsg, ShardId};

#[path = "common/cli.rs"]
mod cli;

const KEY: &[u8] = b"am_echo example pre-shared key";
const ECHO: AmId = AmId::new(1);
const REPLY: AmId = AmId::new(2);

use cli::Exchange as Opts;

/// Active-message echo between two nodes, with per-shard round-trip percentiles.
#[derive(clap::Parser)]
#[command(name = "am_echo")]
struct Args {
    #[command(flatten)]
    opts: Opts,
}

fn opts() -> Opts {
    <Args as clap::Parser>::parse().opts
}

fn node(o: &Opts, id: u64) -> shardcx::NodeBuilder {
    Node::builder()
        .shards(o.shards)
        .placement(shardcx::shards::Placement::Unpinned)
        .transports(&o.tls)
        .node_id(NodeId::new(id))
        .psk(KEY)
        // Two nodes may share this process: 1 MiB of io memory per shard fits 8 MiB memlock.
        .io_memory(1 << 20)
}

/// The server: echo every message back to its sender, header and payload unchanged.
fn serve(o: &Opts, addr: SocketAddr, bound: mpsc::Sender<SocketAddr>, stop: Arc<AtomicBool>) {
    let until = Instant::now() + o.serve_for;
    node(o, 2)
        .listen(addr)
        .on_am(ECHO, || {
            // Answered inline, on the rail the message came in on: no task, and no copy when
            // UCX takes the reply in place.
            |_node: &Node, msg: AmMsg| {
                if let Err(e) = msg.reply(REPLY, msg.header(), msg.payload()) {
                    eprintln!("server: reply failed: {e}");
                }
            }
        })
        .run(move |node: Node| {
            let (bound, stop) = (bound.clone(), stop.clone());
            async move {
                if node.shard() == ShardId::new(0) {
                    let _ = bound.send(node.listen_addr().unwrap());
                }
                while !stop.load(Ordering::Acquire) && Instant::now() < until {
                    sleep(Duration::from_millis(10)).await;
                }
            }
        })
        .expect("server node");
}

thread_local! {
    /// Replies for this shard's client loop.
    static REPLIES: RefCell<Option<LocalSender<OwnedAmMsg>>> = const { RefCell::new(None) };
}

fn deliver(msg: OwnedAmMsg) {
    REPLIES.with(|r| {
        if let Some(tx) = r.borrow().as_ref() {
            let _ = tx.try_send(msg);
        }
    });
}

/// The client: every shard sends `count` messages one at a time and checks each reply.
fn client(o: &Opts, addr: SocketAddr) {
    let (count, size) = (o.count, o.size);
    let out = node(o, 1)
        .on_am(REPLY, || {
            // Replies come back on the rail the request went out on, to the shard that waits
            // for them; the header names that shard, checked here.
            |node: &Node, msg: AmMsg| {
                let origin = ShardId::new(u16::from_le_bytes([msg.header()[0], msg.header()[1]]));
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
        })
        .run(move |node: Node| async move {
            let (tx, rx) = local_channel::new_unbounded();
            REPLIES.with(|r| *r.borrow_mut() = Some(tx));
            let peer = node.connect(addr).await.expect("connect");
            let me = node.shard();
            let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
            let mut payload = vec![0u8; size];
            let t0 = Instant::now();
            for seq in 0..count {
                let mut header = [0u8; 6];
                header[..2].copy_from_slice(&me.get().to_le_bytes());
                header[2..].copy_from_slice(&seq.to_le_bytes());
                for (i, b) in payload.iter_mut().enumerate() {
                    *b = (seq as usize).wrapping_add(i) as u8;
                }
                let start = Instant::now();
                peer.am_send(ECHO, &header, &payload).await.expect("send");
                let reply = futures_lite::future::or(async { rx.recv().await }, async {
                    sleep(Duration::from_secs(5)).await;
                    None
                })
                .await
                .expect("no reply within 5 s");
                hist.record(start.elapsed().as_nanos() as u64).unwrap();
                assert_eq!(reply.header(), &header[..], "reply header");
                assert_eq!(reply.payload(), &payload[..], "reply payload");
            }
            let elapsed = t0.elapsed();
            REPLIES.with(|r| r.borrow_mut().take());
            (me, node.owner_of(peer), hist, elapsed)
        })
        .expect("client node");
    println!(
        "{:<6} {:<9} {:>8} {:>9} {:>9} {:>9} {:>9} {:>10}",
        "shard", "route", "count", "p50 us", "p99 us", "p99.9 us", "max us", "msgs/s"
    );
    for (me, owner, hist, elapsed) in out {
        let us = |q: f64| hist.value_at_quantile(q) as f64 / 1000.0;
        println!(
            "{:<6} {:<9} {:>8} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>10.0}",
            me.to_string(),
            if me == owner { "own rail" } else { "forwarded" },
            hist.len(),
            us(0.5),
            us(0.99),
            us(0.999),
            hist.max() as f64 / 1000.0,
            hist.len() as f64 / elapsed.as_secs_f64()
        );
    }
    println!("round trips of {size}-byte messages, every reply's header and payload checked");
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
