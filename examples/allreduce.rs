//! All-reduce across two nodes of two shards each, in this process on loopback: the four
//! shards are the four ranks of one world communicator; every rank checks every result and
//! prints its round-trip percentiles and the algorithm used, per message size.
//!
//! ```text
//! cargo run --release --example allreduce
//! cargo run --release --example allreduce -- --shards 3 --count 2000 --size 8,64k,1m
//! ```
//!
//! Options: `--shards N` per node (default 2), `--count N` all-reduces per size (default
//! 1000), `--size LIST` bytes per rank (default 8,4k,1m), `--tls LIST` (default `tcp`;
//! listening and connecting need tcp in UCX 1.12). The key is fixed: it is an example.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // An example may panic: a panic is a failure it reports.

use std::net::SocketAddr;
use std::sync::{mpsc, Arc, OnceLock};
use std::time::{Duration, Instant};

use glommio::timer::sleep;
use hdrhistogram::Histogram;
use shardcx::collective::{Communicator, Sum};
use shardcx::{Node, NodeId};

#[path = "common/cli.rs"]
mod cli;

const KEY: &[u8] = b"allreduce example pre-shared key";
const DEADLINE: Duration = Duration::from_secs(10);

/// All-reduce across two nodes on loopback, every result checked on every rank.
#[derive(clap::Parser, Debug, Clone)]
#[command(name = "allreduce")]
struct Opts {
    /// Shards (ranks) per node.
    #[arg(long, value_name = "N", default_value = "2", value_parser = cli::positive)]
    shards: usize,
    /// All-reduces per size.
    #[arg(long, value_name = "N", default_value_t = 1000)]
    count: u32,
    /// Bytes per rank (u64 elements), comma-separated, e.g. 8,4k,1m.
    #[arg(long, value_name = "LIST", default_value = "8,4k,1m", value_delimiter = ',', value_parser = cli::size)]
    size: Vec<usize>,
    /// UCX transports (listening and connecting need tcp in UCX 1.12).
    #[arg(long, value_name = "LIST", default_value = "tcp")]
    tls: String,
}

/// Rank `r`'s element `i` in round `k`; the sum over `p` ranks is [`expected`].
fn value(r: usize, i: usize, k: u32) -> u64 {
    (r * 1000 + i) as u64 + u64::from(k)
}

fn expected(p: usize, i: usize, k: u32) -> u64 {
    (1000 * p * (p - 1) / 2 + p * i) as u64 + p as u64 * u64::from(k)
}

/// One rank: its world, then `count` checked all-reduces per size. Returns, per size, the
/// round-trip histogram and the algorithm.
async fn rank(
    node: Node,
    o: Opts,
    nodes: [NodeId; 2],
) -> (usize, Vec<(usize, Histogram<u64>, String)>) {
    let mut world = Communicator::world(&node, &nodes, DEADLINE)
        .await
        .expect("world");
    let (r, p) = (world.rank(), world.size());
    let mut out = Vec::new();
    for &bytes in &o.size {
        let n = (bytes / 8).max(1);
        let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
        for k in 0..o.count {
            let data: Vec<u64> = (0..n).map(|i| value(r, i, k)).collect();
            let t0 = Instant::now();
            let sum = world
                .all_reduce(&data, &Sum, DEADLINE)
                .await
                .expect("all_reduce");
            hist.record(t0.elapsed().as_nanos() as u64).unwrap();
            assert_eq!(sum.len(), n);
            if let Some(i) = (0..n).find(|&i| sum[i] != expected(p, i, k)) {
                panic!(
                    "rank {r}: round {k}, element {i}: {} != {}",
                    sum[i],
                    expected(p, i, k)
                );
            }
        }
        let algorithm = format!("{:?}", world.last_algorithm().expect("an algorithm"));
        out.push((n * 8, hist, algorithm));
    }
    // Nobody leaves while another rank may still need its messages.
    world.barrier(DEADLINE).await.expect("barrier");
    (r, out)
}

fn main() {
    let o = <Opts as clap::Parser>::parse();
    let nodes = [NodeId::new(1), NodeId::new(2)];
    let addr: Arc<OnceLock<SocketAddr>> = Arc::default();
    let (tx, rx) = mpsc::channel();
    let threads: Vec<_> = (0..2)
        .map(|i| {
            let (o, addr, tx) = (o.clone(), addr.clone(), tx.clone());
            std::thread::spawn(move || {
                let mut b = Node::builder()
                    .shards(o.shards)
                    .placement(shardcx::shards::Placement::Unpinned)
                    .transports(&o.tls)
                    .node_id(nodes[i])
                    .psk(KEY)
                    // Two nodes share this process: 1 MiB of io memory per shard.
                    .io_memory(1 << 20);
                if i == 0 {
                    b = b.listen("127.0.0.1:0".parse().unwrap());
                }
                let out = b
                    .run(move |node: Node| {
                        let (o, addr) = (o.clone(), addr.clone());
                        async move {
                            if let Some(a) = node.listen_addr() {
                                let _ = addr.set(a);
                            } else if node.shard().get() == 0 {
                                // Node 2 connects to node 1 (one session; a rail per shard).
                                while addr.get().is_none() {
                                    sleep(Duration::from_millis(2)).await;
                                }
                                node.connect(*addr.get().unwrap()).await.expect("connect");
                            }
                            rank(node, o, nodes).await
                        }
                    })
                    .expect("node");
                let _ = tx.send(out);
            })
        })
        .collect();
    drop(tx);
    let mut all: Vec<_> = rx.iter().flatten().collect();
    for t in threads {
        t.join().expect("node thread");
    }
    all.sort_by_key(|(r, _)| *r);
    println!(
        "{:<5} {:>9} {:<18} {:>7} {:>9} {:>9} {:>9}",
        "rank", "bytes", "algorithm", "count", "p50 us", "p99 us", "max us"
    );
    for (r, sizes) in &all {
        for (bytes, hist, algorithm) in sizes {
            let us = |q: f64| hist.value_at_quantile(q) as f64 / 1000.0;
            println!(
                "{r:<5} {bytes:>9} {algorithm:<18} {:>7} {:>9.1} {:>9.1} {:>9.1}",
                hist.len(),
                us(0.5),
                us(0.99),
                hist.max() as f64 / 1000.0
            );
        }
    }
    println!(
        "{} ranks ({} nodes of {} shards): every rank checked every element of {} all-reduces per size",
        all.len(),
        nodes.len(),
        o.shards,
        o.count
    );
}
