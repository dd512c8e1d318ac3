//! Start and stop shard sets in a loop: a stress check of start-up and shut-down.
//!
//! `cargo run --release -p shardcx-shards --example boot_loop -- [ROUNDS] [SHARDS]`
//! (defaults 200 and 4). Each set forwards a few jobs between its shards and ends; a round that
//! takes over 10 s is reported as a hang and the program exits with status 1.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // An example may panic: a panic is a failure it reports.

use std::rc::Rc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use shardcx_shards::proto::ids::ShardId;
use shardcx_shards::{Placement, ShardCtx, ShardsBuilder};

fn main() {
    let mut args = std::env::args().skip(1);
    let rounds: usize = args.next().map_or(200, |a| a.parse().expect("ROUNDS"));
    let shards: usize = args.next().map_or(4, |a| a.parse().expect("SHARDS"));
    let t0 = Instant::now();
    let mut worst = Duration::ZERO;
    for round in 0..rounds {
        let (tx, rx) = mpsc::channel();
        let start = Instant::now();
        std::thread::spawn(move || {
            let out = ShardsBuilder::new()
                .shard_count(shards)
                .placement(Placement::Unpinned)
                .transports("sm,self")
                .run(move |ctx: Rc<ShardCtx>| async move {
                    let next = (ctx.id().index() + 1) % ctx.shard_count();
                    let to = ShardId::new(u16::try_from(next).unwrap());
                    let mut sum = 0;
                    for i in 0..8u64 {
                        sum += ctx.forward(to, move |_| async move { i }).await.unwrap();
                    }
                    sum
                });
            let _ = tx.send(out.map(|v| v.iter().sum::<u64>()));
        });
        match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(Ok(sum)) => assert_eq!(sum, 28 * shards as u64),
            Ok(Err(e)) => panic!("round {round}: {e}"),
            Err(_) => {
                eprintln!("round {round}: HANG (no end after 10 s)");
                std::process::exit(1);
            }
        }
        worst = worst.max(start.elapsed());
        if (round + 1) % 50 == 0 {
            eprintln!(
                "{} rounds, {:?}, worst round {worst:?}",
                round + 1,
                t0.elapsed()
            );
        }
    }
    println!(
        "{rounds} rounds of {shards} shards in {:?}, worst round {worst:?}",
        t0.elapsed()
    );
}
