//! Tag send/recv ping-pong between two nodes: every shard of the client node sends a tagged
//! ping to the server node and waits for the tagged pong; the server's shard `s` receives the
//! pings of stream `s` and sends each back. The client checks every pong's tag and content and
//! prints round-trip percentiles per shard.
//!
//! ```text
//! cargo run --release --example tag_pingpong                      # both nodes in this process
//! cargo run --release --example tag_pingpong -- --listen 127.0.0.1:13338 [--for 60]   # server
//! cargo run --release --example tag_pingpong -- --connect 127.0.0.1:13338             # client
//! ```
//!
//! Options: `--count N` round trips per client shard (default 20000), `--size B` payload bytes
//! (default 8), `--shards N` per node (default 2, the same on both sides), `--tls LIST`
//! (default `tcp`; listening and connecting need tcp in UCX 1.12). The key and the client's
//! node id are fixed (one client at a time): it is an example.
//!
//! Tags (48 user bits): ping `1 << 12 | s`, pong `2 << 12 | s`, stop `3 << 12 | s`, for
//! stream `s` (the client shard's index). The server receives with the user mask `0xFFF`, so
//! one receive takes a stream's pings and its stop, in order.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // An example may panic: a panic is a failure it reports.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use shardcx::{Error, Node, NodeId, Peer, ShardId, TAG_MASK_EXACT};

#[path = "common/cli.rs"]
mod cli;

const KEY: &[u8] = b"tag_pingpong example pre-shared key";
const CLIENT: NodeId = NodeId::new(0x7A6C);
const SERVER: NodeId = NodeId::new(0x7A65);
const PING: u64 = 1 << 12;
const PONG: u64 = 2 << 12;
const STOP: u64 = 3 << 12;
const STREAM_MASK: u64 = 0xFFF;

use cli::Exchange as Opts;

/// Tag send/recv ping-pong between two nodes.
#[derive(clap::Parser)]
#[command(name = "tag_pingpong")]
struct Args {
    #[command(flatten)]
    opts: Opts,
}

fn opts() -> Opts {
    let o = <Args as clap::Parser>::parse().opts;
    if o.shards > usize::from(STREAM_MASK as u16) {
        <Args as clap::CommandFactory>::command()
            .error(
                clap::error::ErrorKind::ValueValidation,
                format!("--shards: at most {}", STREAM_MASK),
            )
            .exit();
    }
    o
}

fn node(o: &Opts, id: NodeId) -> shardcx::NodeBuilder {
    Node::builder()
        .shards(o.shards)
        .placement(shardcx::shards::Placement::Unpinned)
        .transports(&o.tls)
        .node_id(id)
        .psk(KEY)
        // Two nodes may share this process: 1 MiB of io memory per shard fits 8 MiB memlock.
        .io_memory(1 << 20)
}

/// Waits until every shard of the node has started (the node's start hook installed the tag
/// handlers on every shard before any served).
async fn install_tags(node: &Node, installed: &AtomicUsize) {
    installed.fetch_add(1, Ordering::AcqRel);
    while installed.load(Ordering::Acquire) < node.shard_count() {
        glommio::timer::sleep(Duration::from_millis(1)).await;
    }
}

/// The payload of ping `seq` of stream `s`.
fn ping_payload(s: u64, seq: u32, size: usize) -> Vec<u8> {
    (0..size)
        .map(|i| (i as u64 ^ s << 5 ^ u64::from(seq)) as u8)
        .collect()
}

/// The server: shard `s` answers the pings of stream `s` until that stream's stop, or until
/// `serve_for` passes.
fn serve(o: &Opts, addr: SocketAddr, bound: mpsc::Sender<SocketAddr>) {
    let until = Instant::now() + o.serve_for;
    let installed = Arc::new(AtomicUsize::new(0));
    let served = node(o, SERVER)
        .listen(addr)
        .run(move |node: Node| {
            let (bound, installed) = (bound.clone(), installed.clone());
            async move {
                install_tags(&node, &installed).await;
                if node.shard() == ShardId::new(0) {
                    let _ = bound.send(node.listen_addr().unwrap());
                }
                let client = Peer::new(CLIENT);
                let s = u64::from(node.shard().get());
                let mut pongs = 0u64;
                while Instant::now() < until {
                    let wait = until
                        .saturating_duration_since(Instant::now())
                        .min(Duration::from_secs(1));
                    match client.tag_recv_within(s, STREAM_MASK, wait).await {
                        Ok((t, _)) if t == STOP | s => break,
                        Ok((t, data)) if t == PING | s => {
                            client.tag_send(PONG | s, &data).await.expect("pong");
                            pongs += 1;
                        }
                        Ok((t, _)) => panic!("unexpected tag {t:#x}"),
                        Err(Error::TimedOut { .. }) => {}
                        Err(e) => panic!("receive failed: {e}"),
                    }
                }
                pongs
            }
        })
        .expect("server node");
    println!("server: pongs per shard {served:?}");
}

/// The client: every shard sends `count` pings one at a time, checks each pong, then stops its
/// server stream.
fn client(o: &Opts, addr: SocketAddr) {
    let (count, size) = (o.count, o.size);
    let installed = Arc::new(AtomicUsize::new(0));
    let out = node(o, CLIENT)
        .run(move |node: Node| {
            let installed = installed.clone();
            async move {
                install_tags(&node, &installed).await;
                let peer = node.connect(addr).await.expect("connect");
                let s = u64::from(node.shard().get());
                let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
                let t0 = Instant::now();
                for seq in 0..count {
                    let ping = ping_payload(s, seq, size);
                    let start = Instant::now();
                    peer.tag_send(PING | s, &ping).await.expect("ping");
                    let (t, pong) = peer
                        .tag_recv(PONG | s, TAG_MASK_EXACT)
                        .await
                        .expect("pong within the deadline");
                    hist.record(start.elapsed().as_nanos() as u64).unwrap();
                    assert_eq!(t, PONG | s, "pong tag");
                    assert!(
                        pong == ping,
                        "pong {seq} of stream {s} differs from its ping"
                    );
                }
                let elapsed = t0.elapsed();
                peer.tag_send(STOP | s, b"").await.expect("stop");
                (node.shard(), node.owner_of(peer), hist, elapsed)
            }
        })
        .expect("client node");
    println!(
        "{:<6} {:<9} {:>8} {:>9} {:>9} {:>9} {:>9} {:>10}",
        "shard", "route", "count", "p50 us", "p99 us", "p99.9 us", "max us", "rtt/s"
    );
    let mut all = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
    for (me, owner, hist, elapsed) in &out {
        all.add(hist).unwrap();
        let us = |q: f64| hist.value_at_quantile(q) as f64 / 1000.0;
        println!(
            "{:<6} {:<9} {:>8} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>10.0}",
            me.to_string(),
            if me == owner { "owner" } else { "forwarded" },
            hist.len(),
            us(0.5),
            us(0.99),
            us(0.999),
            hist.max() as f64 / 1000.0,
            hist.len() as f64 / elapsed.as_secs_f64()
        );
    }
    let us = |q: f64| all.value_at_quantile(q) as f64 / 1000.0;
    println!(
        "{:<6} {:<9} {:>8} {:>9.1} {:>9.1} {:>9.1} {:>9.1}",
        "all",
        "",
        all.len(),
        us(0.5),
        us(0.99),
        us(0.999),
        all.max() as f64 / 1000.0
    );
    println!("tag round trips of {size}-byte messages, every pong's tag and payload checked");
}

fn main() {
    let o = opts();
    // The server ends by itself once the client has said so.
    cli::run_role(
        &o.role,
        o.serve_for,
        |addr, bound, _stop| serve(&o, addr, bound),
        |addr| client(&o, addr),
    );
}
