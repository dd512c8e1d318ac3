//! The deadlines of one shard's collective operations, kept by one timer task.
//!
//! An operation that finishes on its first poll needs no deadline at all, and one that waits
//! (most do: for another rank's message) registers its deadline here once, when it first
//! returns `Pending`: a slot in a table and, only when no timer of the shard's wakes earlier, a
//! watcher task sleeping until it. A glommio timer per operation instead (created, registered
//! with the reactor and removed again every call) cost an 8-byte all-reduce about 1,000
//! instructions of its 6,000. The watcher wakes at the earliest deadline it knows, marks the
//! expired slots and wakes their operations, and sleeps until the next one; with every
//! operation of one timeout, that is one wake-up per timeout, however many operations ran.

use std::cell::RefCell;
use std::rc::{Rc, Weak};
use std::task::Waker;
use std::time::Instant;

/// One shard's operation deadlines (see the module docs).
#[derive(Default)]
pub(crate) struct Deadlines {
    table: RefCell<Table>,
}

#[derive(Default)]
struct Table {
    /// Slots by index; `None` is free (and listed in `free`).
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    /// The running watcher's next wake-up and generation; `None` when none runs. A watcher
    /// that finds another generation here has been superseded (by one waking earlier) and ends.
    watcher: Option<(Instant, u64)>,
    /// The running watcher's task: cancelled when an earlier deadline starts a new one (else
    /// it would sleep on until its own wake-up, one task per superseded watcher).
    task: Option<glommio::task::JoinHandle<()>>,
    generations: u64,
}

struct Slot {
    at: Instant,
    waker: Waker,
    expired: bool,
}

/// An operation's registered deadline: its slot, freed when this is dropped (the operation
/// ended, or its future was dropped).
pub(crate) struct Armed {
    deadlines: Rc<Deadlines>,
    slot: usize,
}

impl Armed {
    /// Whether the deadline has passed (the watcher says so); otherwise the operation's task
    /// is woken through `waker` when it does.
    pub(crate) fn expired(&self, waker: &Waker) -> bool {
        let mut t = self.deadlines.table.borrow_mut();
        match t.slots.get_mut(self.slot) {
            Some(Some(s)) => {
                if !s.expired && !s.waker.will_wake(waker) {
                    s.waker = waker.clone();
                }
                s.expired
            }
            _ => false,
        }
    }
}

impl Drop for Armed {
    fn drop(&mut self) {
        let mut t = self.deadlines.table.borrow_mut();
        if let Some(s) = t.slots.get_mut(self.slot) {
            if s.take().is_some() {
                t.free.push(self.slot);
            }
        }
    }
}

impl Deadlines {
    /// Registers deadline `at` of the task that `waker` wakes; a watcher task is started (on
    /// the calling shard) unless one already wakes no later than `at`.
    pub(crate) fn arm(self: &Rc<Self>, at: Instant, waker: &Waker) -> Armed {
        let mut t = self.table.borrow_mut();
        let slot = Slot {
            at,
            waker: waker.clone(),
            expired: false,
        };
        let k = match t.free.pop() {
            Some(k) => {
                t.slots[k] = Some(slot);
                k
            }
            None => {
                t.slots.push(Some(slot));
                t.slots.len() - 1
            }
        };
        if !matches!(t.watcher, Some((w, _)) if w <= at) {
            t.generations += 1;
            let generation = t.generations;
            t.watcher = Some((at, generation));
            if let Some(old) = t.task.replace(watch(Rc::downgrade(self), at, generation)) {
                old.cancel();
            }
        }
        Armed {
            deadlines: self.clone(),
            slot: k,
        }
    }

    /// Marks the slots whose deadline is not after `now` expired and wakes their tasks; the
    /// earliest deadline still to come, if any.
    fn expire(&self, now: Instant) -> Option<Instant> {
        let mut wake = Vec::new();
        let next = {
            let mut t = self.table.borrow_mut();
            let mut next: Option<Instant> = None;
            for s in t.slots.iter_mut().flatten().filter(|s| !s.expired) {
                if s.at <= now {
                    s.expired = true;
                    wake.push(s.waker.clone());
                } else {
                    next = Some(next.map_or(s.at, |n| n.min(s.at)));
                }
            }
            next
        };
        for w in wake {
            w.wake();
        }
        next
    }
}

/// The watcher of generation `generation`: sleeps until `at`, expires what is due, and goes on
/// to the next deadline; ends when there is none, when superseded, or when the state is gone.
fn watch(
    deadlines: Weak<Deadlines>,
    at: Instant,
    generation: u64,
) -> glommio::task::JoinHandle<()> {
    glommio::spawn_local(async move {
        let mut at = at;
        loop {
            glommio::timer::sleep(at.saturating_duration_since(Instant::now())).await;
            let Some(d) = deadlines.upgrade() else {
                return;
            };
            if !matches!(d.table.borrow().watcher, Some((_, g)) if g == generation) {
                return;
            }
            let next = d.expire(Instant::now());
            d.table.borrow_mut().watcher = next.map(|n| (n, generation));
            match next {
                Some(n) => at = n,
                None => return,
            }
        }
    })
    .detach()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;
    use crate::testing::CountingWaker;
    use std::time::Duration;

    fn counter() -> (std::sync::Arc<CountingWaker>, Waker) {
        CountingWaker::new()
    }

    #[test]
    fn deadlines_expire_in_order_and_freed_slots_are_reused() {
        glommio::LocalExecutorBuilder::default()
            .io_memory(64 << 10)
            .spawn(|| async {
                let d = Rc::new(Deadlines::default());
                let t0 = Instant::now();
                let (late_n, late_w) = counter();
                let (soon_n, soon_w) = counter();
                let (gone_n, gone_w) = counter();
                let late = d.arm(t0 + Duration::from_millis(60), &late_w);
                // Earlier than the running watcher's wake-up: a new watcher takes over.
                let soon = d.arm(t0 + Duration::from_millis(20), &soon_w);
                let gone = d.arm(t0 + Duration::from_millis(10), &gone_w);
                drop(gone);
                assert!(!soon.expired(&soon_w) && !late.expired(&late_w));
                glommio::timer::sleep(Duration::from_millis(40)).await;
                assert!(soon.expired(&soon_w), "20 ms deadline not expired at 40 ms");
                assert!(!late.expired(&late_w), "60 ms deadline expired at 40 ms");
                assert_eq!(soon_n.count(), 1);
                assert_eq!(late_n.count(), 0);
                // The dropped slot's task is never woken, and its slot is taken again.
                assert_eq!(gone_n.count(), 0);
                let again = d.arm(t0 + Duration::from_secs(3600), &gone_w);
                assert_eq!(again.slot, 2);
                glommio::timer::sleep(Duration::from_millis(40)).await;
                assert!(late.expired(&late_w));
                assert_eq!(late_n.count(), 1);
                assert!(!again.expired(&gone_w));
                assert!(t0.elapsed() < Duration::from_secs(5));
            })
            .unwrap()
            .join()
            .unwrap();
    }
}
