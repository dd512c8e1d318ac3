//! Measure one cross-shard hop: forward an empty job to the other shard and await its result.
//!
//! `cargo run --release -p shardcx-shards --example hop`
//!
//! Two shards; shard 0 forwards, shard 1 serves. For pinned and unpinned placement, and for two
//! driver settings, it prints the latency of one hop at a time (hdrhistogram p50/p99/p99.9/max)
//! and the throughput with many hops in flight:
//!
//! - `default`: the default spin window, so a shard's driver sleeps 1 ms after its last event;
//!   this row also prints the latency of the first hop after both shards have idled (their
//!   drivers and executors asleep);
//! - `busy`: a spin window of an hour, so both drivers spin all the time, as they do on a shard
//!   busy with UCX traffic: the hop to a busy shard.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // A test/example may panic: a panic is a failure it reports.

use std::rc::Rc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use shardcx_shards::proto::ids::ShardId;
use shardcx_shards::{DriverConfig, Placement, ShardCtx, ShardsBuilder};

const WARMUP: usize = 2_000;
const SERIAL: usize = 100_000;
/// Fewer for the busy case: a hop to a busy shard once cost half a millisecond.
const BUSY_SERIAL: usize = 10_000;
const IDLE_SAMPLES: usize = 30;
const IN_FLIGHT: usize = 256;
const PER_TASK: usize = 1_000;
/// A spin window no run reaches: the drivers never sleep.
const BUSY_SPIN: Duration = Duration::from_secs(3600);

struct Figures {
    serial: Histogram<u64>,
    idle: Option<Histogram<u64>>,
    rate: f64,
}

fn us(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

async fn measure(ctx: Rc<ShardCtx>, busy: bool) -> Figures {
    let other = ShardId::new(1);
    let mut serial = Histogram::<u64>::new_with_bounds(1, 10_000_000_000, 3).unwrap();
    for _ in 0..WARMUP {
        ctx.forward(other, |_| async {}).await.unwrap();
    }
    for _ in 0..if busy { BUSY_SERIAL } else { SERIAL } {
        let t0 = Instant::now();
        ctx.forward(other, |_| async {}).await.unwrap();
        serial.record(t0.elapsed().as_nanos() as u64).unwrap();
    }
    // With spinning drivers nothing sleeps: no idle figure.
    let idle = if busy {
        None
    } else {
        let mut idle = Histogram::new_from(&serial);
        for _ in 0..IDLE_SAMPLES {
            glommio::timer::sleep(Duration::from_millis(30)).await;
            let t0 = Instant::now();
            ctx.forward(other, |_| async {}).await.unwrap();
            idle.record(t0.elapsed().as_nanos() as u64).unwrap();
        }
        Some(idle)
    };
    let t0 = Instant::now();
    let tasks: Vec<_> = (0..IN_FLIGHT)
        .map(|_| {
            let ctx = ctx.clone();
            glommio::spawn_local(async move {
                for _ in 0..PER_TASK {
                    ctx.forward(other, |_| async {}).await.unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await;
    }
    let rate = (IN_FLIGHT * PER_TASK) as f64 / t0.elapsed().as_secs_f64();
    Figures { serial, idle, rate }
}

fn main() {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("one hop = forward an empty job to the other shard and await its result");
    println!("2 shards, {cpus} CPUs, lane capacity 256; latency in µs");
    println!(
        "{:<10} {:<8} {:>8} {:>8} {:>8} {:>9} | {:>10} {:>10} | {:>12}",
        "placement", "drivers", "p50", "p99", "p99.9", "max", "idle p50", "idle max", "hops/s"
    );
    for (name, placement) in [
        ("pinned", Placement::Pinned),
        ("unpinned", Placement::Unpinned),
    ] {
        for busy in [false, true] {
            let driver = if busy {
                DriverConfig { spin: BUSY_SPIN }
            } else {
                DriverConfig::default()
            };
            let out = ShardsBuilder::new()
                .shard_count(2)
                .placement(placement)
                .transports("sm,self")
                .driver(driver)
                .run(move |ctx: Rc<ShardCtx>| async move {
                    if ctx.id().index() == 0 {
                        Some(measure(ctx, busy).await)
                    } else {
                        None
                    }
                })
                .expect("shards failed");
            let f = out.into_iter().flatten().next().expect("no figures");
            let (idle_p50, idle_max) = match &f.idle {
                Some(h) => (
                    format!("{:.2}", us(h, 0.5)),
                    format!("{:.2}", h.max() as f64 / 1000.0),
                ),
                None => ("-".to_owned(), "-".to_owned()),
            };
            println!(
                "{:<10} {:<8} {:>8.2} {:>8.2} {:>8.2} {:>9.2} | {:>10} {:>10} | {:>12.0}",
                name,
                if busy { "busy" } else { "default" },
                us(&f.serial, 0.5),
                us(&f.serial, 0.99),
                us(&f.serial, 0.999),
                f.serial.max() as f64 / 1000.0,
                idle_p50,
                idle_max,
                f.rate,
            );
        }
    }
    println!(
        "serial: {SERIAL} hops one at a time ({BUSY_SERIAL} busy); idle: {IDLE_SAMPLES} hops each \
         after 30 ms idle; hops/s: {IN_FLIGHT} tasks x {PER_TASK} hops; busy: both drivers spin \
         (spin window {BUSY_SPIN:?}), as under UCX traffic"
    );
}
