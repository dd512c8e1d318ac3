//! Asking a running node to stop: [`Shutdown`], a switch usable from any thread.
//!
//! A node's shards run the user's closure ([`crate::NodeBuilder::run`]); a *serving* node's
//! closure waits for [`crate::Node::stopped`] (or the node is started with
//! [`crate::NodeBuilder::serve`], which does just that). Anything holding the node's
//! [`Shutdown`] — another thread, a signal handler thread ([`Shutdown::trigger_on_signals`]),
//! a handler on a shard ([`crate::Node::shutdown`]) — then stops it:
//!
//! 1. [`Shutdown::trigger`]: every [`crate::Node::stopped`] future resolves, on every shard; the
//!    closures return;
//! 2. once every shard's closure has returned, the node **stops accepting** (the listener
//!    closes: a new `connect` to its address fails), and each shard **drains**: it waits until
//!    the work forwarded between its shards has finished, then until the requests it sent
//!    have been answered (checked put/get, requests of the runtime), for at most the drain
//!    deadline ([`crate::NodeBuilder::drain_deadline`], default [`DEFAULT_DRAIN_DEADLINE`])
//!    each (the shards layer does both: `ShardsBuilder::drain_timeout`);
//! 3. then it **closes** its connections (a `Close` frame to every peer, which fails the peer's
//!    pending requests at once rather than at their deadlines) and **destroys** its state in
//!    order: endpoints, worker, pool, context; [`crate::NodeBuilder::run`] returns.
//!
//! A node whose closures end by themselves takes the same steps 2 and 3 (and triggers its
//! switch, so that tasks left waiting on [`crate::Node::stopped`] end too).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

/// Default longest drain of in-flight work at shut-down (see the module docs).
pub const DEFAULT_DRAIN_DEADLINE: Duration = Duration::from_secs(5);

/// A switch that stops a running node. `Send + Sync + Clone`: every clone is the same switch.
/// Get a node's from [`crate::NodeBuilder::shutdown_handle`] (before or after `run`) or
/// [`crate::Node::shutdown_handle`].
#[derive(Clone, Default)]
pub struct Shutdown {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    triggered: AtomicBool,
    next_key: AtomicU64,
    /// Wakers of pending [`Stopped`] futures, by key (each removes its own on drop).
    waiters: Mutex<Vec<(u64, Waker)>>,
}

/// Resolves once its [`Shutdown`] is triggered. See [`Shutdown::wait`].
#[must_use = "futures do nothing unless polled"]
pub struct Stopped {
    shutdown: Shutdown,
    key: Option<u64>,
}

impl std::fmt::Debug for Shutdown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shutdown")
            .field("triggered", &self.is_triggered())
            .finish()
    }
}

impl Shutdown {
    /// A new switch, not triggered.
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks the node to stop (see the module docs). Idempotent; callable from any thread.
    pub fn trigger(&self) {
        if !self.inner.triggered.swap(true, Ordering::AcqRel) {
            tracing::debug!("shutdown triggered: draining");
        }
        let waiters = match self.inner.waiters.lock() {
            Ok(mut w) => std::mem::take(&mut *w),
            Err(poisoned) => std::mem::take(&mut *poisoned.into_inner()),
        };
        for (_, w) in waiters {
            w.wake();
        }
    }

    /// Whether [`Shutdown::trigger`] has been called.
    pub fn is_triggered(&self) -> bool {
        self.inner.triggered.load(Ordering::Acquire)
    }

    /// A future that resolves once the switch is triggered (at once if it already is).
    pub fn wait(&self) -> Stopped {
        Stopped {
            shutdown: self.clone(),
            key: None,
        }
    }

    /// Triggers the switch on `SIGINT` (Ctrl-C) or `SIGTERM`, from a thread of its own. A second
    /// such signal after the first ends the process at once (exit status 130), for a drain that
    /// takes too long. Fails if the signal handlers cannot be installed.
    pub fn trigger_on_signals(&self) -> std::io::Result<()> {
        use signal_hook::consts::{SIGINT, SIGTERM};
        let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])?;
        let switch = self.clone();
        std::thread::Builder::new()
            .name("shardcx-signals".into())
            .spawn(move || {
                for _ in signals.forever() {
                    if switch.is_triggered() {
                        eprintln!("shardcx: second signal, exiting now");
                        std::process::exit(130);
                    }
                    eprintln!("shardcx: shutting down (draining; signal again to exit now)");
                    switch.trigger();
                }
            })?;
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(u64, Waker)>> {
        match self.inner.waiters.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        }
    }
}

impl Future for Stopped {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.shutdown.is_triggered() {
            return Poll::Ready(());
        }
        let key = match self.key {
            Some(k) => k,
            None => {
                let k = self.shutdown.inner.next_key.fetch_add(1, Ordering::Relaxed);
                self.key = Some(k);
                k
            }
        };
        {
            let mut waiters = self.shutdown.lock();
            match waiters.iter_mut().find(|(k, _)| *k == key) {
                Some((_, w)) => w.clone_from(cx.waker()),
                None => waiters.push((key, cx.waker().clone())),
            }
        }
        // Checked again after registering: a trigger in between has taken the list already.
        if self.shutdown.is_triggered() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        if let Some(key) = self.key {
            self.shutdown.lock().retain(|(k, _)| *k != key);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;
    use crate::testing::CountingWaker;

    #[test]
    fn a_trigger_wakes_every_waiter_once_and_dropped_waiters_leave_no_trace() {
        let s = Shutdown::new();
        let (count, waker) = CountingWaker::new();
        let mut cx = Context::from_waker(&waker);
        let mut a = Box::pin(s.wait());
        let mut b = Box::pin(s.clone().wait());
        for _ in 0..3 {
            assert!(a.as_mut().poll(&mut cx).is_pending());
            assert!(b.as_mut().poll(&mut cx).is_pending());
        }
        // Re-polling replaces a waiter's waker instead of adding one.
        assert_eq!(s.lock().len(), 2);
        {
            let mut c = Box::pin(s.wait());
            assert!(c.as_mut().poll(&mut cx).is_pending());
            assert_eq!(s.lock().len(), 3);
        }
        assert_eq!(s.lock().len(), 2);
        assert!(!s.is_triggered());
        let t = s.clone();
        std::thread::spawn(move || t.trigger()).join().unwrap();
        assert!(s.is_triggered());
        assert_eq!(count.count(), 2);
        assert!(a.as_mut().poll(&mut cx).is_ready());
        assert!(b.as_mut().poll(&mut cx).is_ready());
        // A wait that starts after the trigger is ready at once.
        assert!(Box::pin(s.wait()).as_mut().poll(&mut cx).is_ready());
        s.trigger();
        assert_eq!(count.count(), 2);
    }
}
