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
use std::time::Duration;

use crate::worker::{poll_fds, Armed, Worker};

/// Rounds of `progress` without events before the driver arms and sleeps.
const SPIN_ROUNDS: u32 = 2_000;
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

/// Run `fut` to completion, progressing `workers` (all owned by this thread) meanwhile.
pub fn block_on<F: Future>(workers: &[&Worker], fut: F) -> F::Output {
    let flag = Arc::new(Flag(AtomicBool::new(true)));
    let waker = Waker::from(flag.clone());
    let mut cx = Context::from_waker(&waker);
    let mut fut = pin!(fut);
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
            idle_rounds = 0;
            continue;
        }
        idle_rounds += 1;
        if idle_rounds < SPIN_ROUNDS {
            std::hint::spin_loop();
            continue;
        }
        idle_rounds = 0;
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
