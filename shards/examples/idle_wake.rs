//! Measure the progress driver: idle CPU, first message after idle, busy round trip.
//!
//! `cargo run --release -p shardcx-shards --example idle_wake`
//!
//! Two shards in one process, connected over shared memory (`sm,self`) by worker address.
//! The shards float (`Placement::Unpinned`): on a 2-core machine, pinned shards share their
//! cores with the waker threads and UCX's async thread, which measures placement, not the
//! driver. Every wait has a deadline: a stuck run fails with a message instead of hanging.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // A test/example may panic: a panic is a failure it reports.

use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use glommio::channels::local_channel;
use hdrhistogram::Histogram;
use shardcx_shards::ucx::{AmPayload, AmProto, Endpoint, EpOptions, ErrorMode, WorkerAddress};
use shardcx_shards::{memlock_limit, Placement, ShardCtx, ShardsBuilder};

const PING: u16 = 1;
const PONG: u16 = 2;
const IDLE_SAMPLES: usize = 50;
const BUSY_SAMPLES: usize = 20_000;
/// Longest wait for the peer's address, or for one message after idle.
const DEADLINE: Duration = Duration::from_secs(10);
/// Longest busy phase: generous, since a core shared with another busy thread turns some
/// round trips into a 4 ms scheduler tick.
const BUSY_DEADLINE: Duration = Duration::from_secs(30);
/// Longest life of the echo shard (its per-message waits are not timed: a timer per message
/// would be measured as part of the busy round trip).
const ECHO_DEADLINE: Duration = Duration::from_secs(50);

/// utime + stime of this process, in clock ticks (USER_HZ, 100 on Linux).
fn cpu_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = after.split_whitespace().collect();
    let utime: u64 = f.get(11).and_then(|s| s.parse().ok()).unwrap_or(0);
    let stime: u64 = f.get(12).and_then(|s| s.parse().ok()).unwrap_or(0);
    utime + stime
}

async fn exchange(ctx: &ShardCtx, book: &Mutex<Vec<Option<WorkerAddress>>>) -> WorkerAddress {
    let me = ctx.id().index();
    book.lock().unwrap()[me] = Some(ctx.worker().address().unwrap());
    let deadline = Instant::now() + DEADLINE;
    loop {
        if let Some(a) = book.lock().unwrap()[1 - me].clone() {
            return a;
        }
        assert!(
            Instant::now() < deadline,
            "shard {me}: the peer never published its address"
        );
        glommio::timer::sleep(Duration::from_millis(1)).await;
    }
}

/// The next message from the AM handler, or a panic naming `what` after [`DEADLINE`].
async fn recv<T>(rx: &local_channel::LocalReceiver<T>, what: &str) -> T {
    glommio::timer::timeout(DEADLINE, async { Ok(rx.recv().await) })
        .await
        .unwrap_or_else(|_| panic!("no {what} within {DEADLINE:?}"))
        .unwrap_or_else(|| panic!("{what}: the handler is gone"))
}

fn us(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

fn main() {
    let builder = ShardsBuilder::new()
        .shard_count(2)
        .placement(Placement::Unpinned)
        .transports("sm,self");
    let limit = memlock_limit();
    println!(
        "RLIMIT_MEMLOCK {limit} bytes; io memory per executor {} bytes",
        builder.io_memory_for(limit).unwrap()
    );
    let board = Arc::new(Board {
        addrs: Mutex::new(vec![None, None]),
        last_recv: Mutex::new(None),
    });
    let out = builder
        .run(move |ctx: Rc<ShardCtx>| {
            let board = board.clone();
            async move { shard(ctx, &board).await }
        })
        .unwrap();
    let (idle_ticks, first, busy) = out.into_iter().next().unwrap().unwrap();
    println!(
        "idle: 2 shards used {} ms of CPU in 2 s ({:.2}% of one core per shard)",
        idle_ticks * 10,
        idle_ticks as f64 * 10.0 / 2000.0 * 100.0 / 2.0
    );
    println!(
        "first message after 100 ms idle, one way ({} samples): p50 {:.1} us, p99 {:.1} us, max {:.1} us",
        first.len(),
        us(&first, 0.5),
        us(&first, 0.99),
        first.max() as f64 / 1000.0
    );
    println!(
        "busy 8-byte AM round trip ({} samples): p50 {:.2} us, p99 {:.2} us",
        busy.len(),
        us(&busy, 0.5),
        us(&busy, 0.99)
    );
}

type Report = (u64, Histogram<u64>, Histogram<u64>);

/// What the two shards share: their worker addresses, and the echo shard's last receive time.
struct Board {
    addrs: Mutex<Vec<Option<WorkerAddress>>>,
    last_recv: Mutex<Option<Instant>>,
}

async fn shard(ctx: Rc<ShardCtx>, board: &Board) -> Option<Report> {
    let peer = exchange(&ctx, &board.addrs).await;
    let opts = EpOptions {
        error_mode: ErrorMode::None,
    };
    let ep = Endpoint::connect_to_worker(ctx.worker(), &peer, opts).unwrap();
    let (tx, rx) = local_channel::new_unbounded();
    let id = if ctx.id().index() == 0 { PONG } else { PING };
    ctx.worker()
        .set_am_handler(id, move |_h, p| {
            let len = match &p {
                AmPayload::Data(d) => d.len(),
                AmPayload::Rendezvous(r) => r.len(),
            };
            let _ = tx.try_send((Instant::now(), len));
        })
        .unwrap();
    if ctx.id().index() == 1 {
        // Echo every ping until the zero-length stop message; publish its arrival time
        // before answering, so that the pinger can read it once the pong is in.
        let echo = glommio::timer::timeout(ECHO_DEADLINE, async {
            loop {
                let (at, len) = rx.recv().await.expect("the handler is gone");
                if len == 0 {
                    return Ok(());
                }
                *board.last_recv.lock().unwrap() = Some(at);
                let (r, _) = ep.am_send(PONG, &[], vec![0u8; 8], AmProto::Eager).await;
                r.unwrap();
            }
        })
        .await;
        assert!(echo.is_ok(), "no stop message within {ECHO_DEADLINE:?}");
        return None;
    }
    // Shard 0 drives the measurements.
    glommio::timer::sleep(Duration::from_millis(300)).await;
    let before = cpu_ticks();
    glommio::timer::sleep(Duration::from_secs(2)).await;
    let idle_ticks = cpu_ticks() - before;

    // First message after idle: both shards have slept 100 ms; one way, from the send call
    // on this shard to the handler on the echo shard (same process, so one clock).
    let mut first = Histogram::<u64>::new(3).unwrap();
    for _ in 0..IDLE_SAMPLES {
        glommio::timer::sleep(Duration::from_millis(100)).await;
        let t0 = Instant::now();
        let (r, _) = ep.am_send(PING, &[], vec![0u8; 8], AmProto::Eager).await;
        r.unwrap();
        let _ = recv(&rx, "pong after idle").await;
        let at = board.last_recv.lock().unwrap().take().unwrap();
        first
            .record(at.duration_since(t0).as_nanos() as u64)
            .unwrap();
    }

    let mut busy = Histogram::<u64>::new(3).unwrap();
    let busy_run = glommio::timer::timeout(BUSY_DEADLINE, async {
        for _ in 0..BUSY_SAMPLES {
            let t0 = Instant::now();
            let (r, _) = ep.am_send(PING, &[], vec![0u8; 8], AmProto::Eager).await;
            r.unwrap();
            let _ = rx.recv().await.expect("the handler is gone");
            busy.record(t0.elapsed().as_nanos() as u64).unwrap();
        }
        Ok(())
    })
    .await;
    assert!(
        busy_run.is_ok(),
        "busy phase not done within {BUSY_DEADLINE:?}"
    );
    let (r, _) = ep
        .am_send(PING, &[], Vec::<u8>::new(), AmProto::Eager)
        .await;
    r.unwrap();
    ctx.wake_driver();
    Some((idle_ticks, first, busy))
}
