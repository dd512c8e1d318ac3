//! A minimal blocking driver: run a future on this thread while progressing workers.
//!
//! shardcx's shards drive workers from glommio; this driver is for tests, examples and simple
//! programs that have no executor. It spins on `progress` while events keep coming, then arms
//! the workers and sleeps on their event fds (when they have `Features::wakeup`), so an idle
//! wait costs no CPU.

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use crate::worker::{poll_fds, Armed, Worker};

/// How long the driver keeps calling `progress` after the last event before it arms the
/// workers and sleeps.
///
/// Measured on a 2-core VM with UCX 1.12, 8-byte AM ping-pong, each side on its own core
/// (`SHARDCX_SPIN_US=N cargo run --release -p shardcx-ucx --example am_pingpong`): over TCP the
/// window hardly matters (p50 11.5 µs at 0, 50 and 250 µs), but over shared memory a thread that
/// sleeps as soon as it is idle pays a wake-up on most messages (spin 0: p50 0.46 µs, p99
/// 48.6 µs; spin 50 µs: p99 0.60 µs). 1 ms keeps an active exchange awake with a wide margin
/// while an idle thread still sleeps after 1 ms. (An earlier note here blamed TCP wake-up for
/// 2 ms round trips; the cause was both threads pinned to one core, see README.md.)
pub const DEFAULT_SPIN: Duration = Duration::from_millis(1);
/// Idle progress rounds between two looks at the clock.
const CLOCK_EVERY: u32 = 64;

/// Longest single sleep; a bound, in case an event is signalled some other way.
const MAX_SLEEP: Duration = Duration::from_millis(5);

struct Flag(AtomicBool);

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.0.store(true, Ordering::Release);
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.store(true, Ordering::Release);
    }
}

/// Run `fut` to completion, progressing `workers` (all owned by this thread) meanwhile,
/// spinning [`DEFAULT_SPIN`] before sleeping.
pub fn block_on<F: Future>(workers: &[&Worker], fut: F) -> F::Output {
    block_on_with(workers, DEFAULT_SPIN, fut)
}

/// [`block_on`] with a chosen spin window: how long to keep polling after the last event
/// before sleeping on the workers' event fds. `Duration::ZERO` sleeps as soon as idle.
pub fn block_on_with<F: Future>(workers: &[&Worker], spin: Duration, fut: F) -> F::Output {
    let flag = Arc::new(Flag(AtomicBool::new(true)));
    let waker = Waker::from(flag.clone());
    let mut cx = Context::from_waker(&waker);
    let mut fut = pin!(fut);
    let mut idle_since: Option<Instant> = None;
    let mut idle_rounds = 0u32;
    loop {
        if flag.0.swap(false, Ordering::AcqRel) {
            if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
                return v;
            }
        }
        let mut events = 0;
        for w in workers {
            events += w.progress();
        }
        if events > 0 || flag.0.load(Ordering::Acquire) {
            idle_since = None;
            idle_rounds = 0;
            continue;
        }
        // Reading the clock costs as much as an idle progress round, so look only every
        // CLOCK_EVERY rounds.
        idle_rounds = idle_rounds.wrapping_add(1);
        if idle_rounds % CLOCK_EVERY != 0 {
            continue;
        }
        let since = *idle_since.get_or_insert_with(Instant::now);
        if since.elapsed() < spin {
            continue;
        }
        idle_since = None;
        sleep(workers);
        // Something may have become ready without a waker (a missed edge): poll again.
        flag.0.store(true, Ordering::Release);
    }
}

fn sleep(workers: &[&Worker]) {
    let mut fds = Vec::with_capacity(workers.len());
    for w in workers {
        match w.arm() {
            Ok(Armed::Armed) => match w.event_fd() {
                Ok(fd) => fds.push(fd),
                Err(_) => return std::thread::sleep(Duration::from_micros(50)),
            },
            Ok(Armed::Busy) => return,
            // No wakeup feature: back off briefly instead of burning the core.
            Err(_) => return std::thread::sleep(Duration::from_micros(50)),
        }
    }
    poll_fds(&fds, MAX_SLEEP);
}
