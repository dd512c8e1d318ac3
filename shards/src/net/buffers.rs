//! Receive buffers for rendezvous data that no handler chose a buffer for.
//!
//! Such data lands in a block of the shard's registered pool ([`crate::ShardPool`]) when one
//! of its size class is free, else in a vector from the shard's receive cache: vectors of
//! power-of-two sizes (4 KiB and up), each allocated and zeroed once, handed out again as soon
//! as the payload holding it is dropped, and reused without being cleared (the pull overwrites
//! the bytes the payload exposes; the rest is never shown). In the steady state of a
//! bandwidth-bound connection no buffer is allocated and no byte is zeroed per message: the
//! counters [`super::NetStats::rndv_pooled`], [`super::NetStats::rndv_recycled`] and
//! [`super::NetStats::rndv_allocated`] say which of the three each transfer took.
//!
//! The cache keeps at most [`super::NetConfig::rndv_cache_bytes`] of idle vectors per shard;
//! a payload dropped when the cache is full frees its vector. A payload kept with
//! [`RecycledBuf::into_vec`] leaves the cache for good (no copy).
//!
//! # Pulls in flight, per rail
//!
//! Such pulls are also paced (`PullGates`): a pull starts while the bytes of the same rail's
//! pulls in flight (those of one remote shard) are under
//! [`super::NetConfig::rndv_pull_budget`], and the others wait, in arrival order, taking
//! their buffer only when they start. A stream of large messages then
//! lands in the same few buffers, each taken again right after its handler let go of it, and
//! still in the receiving core's cache; with every announced transfer pulled at once (64 in
//! flight, or eight of 1 MiB) each landed in a buffer of its own, and the receiving core
//! copied into memory it did not hold (`shardcx bench --test am-bw` over shared memory:
//! 64 KiB and 1 MiB messages, see the README). Pulls of different rails never wait for each
//! other, so a stalled peer (or peer shard) holds up only its own.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::rc::{Rc, Weak};

use crate::proto::request::DedupHasher;
use crate::proto::{NodeId, ShardId};

/// Smallest cached vector: 4 KiB (`1 << MIN_SHIFT`).
const MIN_SHIFT: u32 = 12;

/// Idle receive vectors of one shard, by size class.
pub(super) struct RecvCache {
    /// `classes[c]` holds idle vectors of `1 << (MIN_SHIFT + c)` bytes.
    classes: Vec<Vec<Vec<u8>>>,
    /// Bytes of the idle vectors.
    idle: usize,
    /// Most idle bytes kept.
    limit: usize,
}

/// A vector from a shard's receive cache holding `len` bytes of received data; it goes back to
/// the cache when dropped.
pub struct RecycledBuf {
    buf: Vec<u8>,
    len: usize,
    home: Weak<RefCell<RecvCache>>,
}

impl RecvCache {
    pub(super) fn new(limit: usize) -> Rc<RefCell<RecvCache>> {
        Rc::new(RefCell::new(RecvCache {
            classes: Vec::new(),
            idle: 0,
            limit,
        }))
    }

    /// The size class of `len` bytes and its vectors' length.
    fn class_of(len: usize) -> (usize, usize) {
        let size = len.max(1 << MIN_SHIFT).next_power_of_two();
        ((size.trailing_zeros() - MIN_SHIFT) as usize, size)
    }

    /// An idle vector of at least `len` bytes, if one is cached.
    fn take(&mut self, len: usize) -> Option<Vec<u8>> {
        let (class, _) = Self::class_of(len);
        let v = self.classes.get_mut(class)?.pop()?;
        self.idle -= v.len();
        Some(v)
    }

    /// Keeps `v` for a later transfer, unless the cache is full (or `v` is not one of its
    /// vectors: then it is freed).
    fn put(&mut self, v: Vec<u8>) {
        let n = v.len();
        if n < 1 << MIN_SHIFT || !n.is_power_of_two() || self.idle + n > self.limit {
            return;
        }
        let (class, _) = Self::class_of(n);
        if self.classes.len() <= class {
            self.classes.resize_with(class + 1, Vec::new);
        }
        self.idle += n;
        self.classes[class].push(v);
    }
}

/// A receive vector of at least `len` bytes from `cache`: a recycled one (`true`) or a new one
/// of its size class (`false`).
pub(super) fn recv_vec(cache: &Rc<RefCell<RecvCache>>, len: usize) -> (Vec<u8>, bool) {
    match cache.borrow_mut().take(len) {
        Some(v) => (v, true),
        None => (vec![0u8; RecvCache::class_of(len).1], false),
    }
}

impl RecycledBuf {
    /// `len` bytes of data at the start of `buf`, a vector of `cache`.
    pub(super) fn new(buf: Vec<u8>, len: usize, cache: &Rc<RefCell<RecvCache>>) -> RecycledBuf {
        RecycledBuf {
            len: len.min(buf.len()),
            buf,
            home: Rc::downgrade(cache),
        }
    }

    /// The received bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.buf[..self.len]
    }

    /// The received bytes as a vector of their length, without a copy: the vector leaves the
    /// cache.
    pub fn into_vec(mut self) -> Vec<u8> {
        let mut v = std::mem::take(&mut self.buf);
        v.truncate(self.len);
        v
    }

    /// The whole vector (for a pull into it), leaving this buffer empty.
    pub(super) fn take_vec(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.buf)
    }

    /// Puts `v` back after a pull of `len` bytes into it.
    pub(super) fn restore(&mut self, v: Vec<u8>, len: usize) {
        self.len = len.min(v.len());
        self.buf = v;
    }
}

impl Drop for RecycledBuf {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.buf);
        if v.is_empty() {
            return;
        }
        if let Some(home) = self.home.upgrade() {
            if let Ok(mut cache) = home.try_borrow_mut() {
                cache.put(v);
            }
        }
    }
}

impl std::fmt::Debug for RecycledBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RecycledBuf({} of {} bytes)", self.len, self.buf.len())
    }
}

/// Rendezvous pulls into the runtime's own buffers (see "Pulls in flight, per rail" above),
/// per rail (a remote node's shard): what is in flight, what waits, and what may start now. `T` is a pull not yet
/// started (what it needs to start); its bytes count from when it may start until
/// [`PullGates::leave`].
pub(super) struct PullGates<T> {
    budget: usize,
    gates: HashMap<Rail, Gate<T>, DedupHasher>,
    /// Pulls that may start, in the order they were let in: [`PullGates::take_ready`].
    ready: VecDeque<T>,
    /// Set while a caller takes the ready pulls (one that starts may end at once and let the
    /// next in, which then waits in `ready` for the same caller instead of nesting).
    starting: bool,
}

/// A rail, as its remote end: the node and the shard the data comes from.
pub(super) type Rail = (NodeId, ShardId);

/// One rail's pulls.
struct Gate<T> {
    in_flight: usize,
    waiting: VecDeque<(usize, T)>,
}

impl<T> PullGates<T> {
    /// Gates with at most `budget` bytes of one rail's pulls in flight; one pull is always let
    /// in, whatever its size, when none of the rail's is.
    pub(super) fn new(budget: usize, hasher: DedupHasher) -> PullGates<T> {
        PullGates {
            budget,
            gates: HashMap::with_hasher(hasher),
            ready: VecDeque::new(),
            starting: false,
        }
    }

    /// A pull of `len` bytes on `rail`: ready to start when the rail's pulls in flight are
    /// under the budget, else kept until [`PullGates::leave`] makes room. Returns whether it
    /// has to wait.
    pub(super) fn enter(&mut self, rail: Rail, len: usize, pull: T) -> bool {
        let gate = self.gates.entry(rail).or_insert_with(|| Gate {
            in_flight: 0,
            waiting: VecDeque::new(),
        });
        if gate.waiting.is_empty() && (gate.in_flight == 0 || gate.in_flight < self.budget) {
            gate.in_flight += len;
            self.ready.push_back(pull);
            false
        } else {
            gate.waiting.push_back((len, pull));
            true
        }
    }

    /// A pull of `len` bytes on `rail` has ended (received, failed or given up): the rail's
    /// next waiting pulls that now fit become ready.
    pub(super) fn leave(&mut self, rail: Rail, len: usize) {
        let Some(gate) = self.gates.get_mut(&rail) else {
            return;
        };
        gate.in_flight = gate.in_flight.saturating_sub(len);
        while gate.in_flight == 0 || gate.in_flight < self.budget {
            let Some((n, pull)) = gate.waiting.pop_front() else {
                break;
            };
            gate.in_flight += n;
            self.ready.push_back(pull);
        }
        if gate.in_flight == 0 && gate.waiting.is_empty() {
            self.gates.remove(&rail);
        }
    }

    /// Claims the start of the ready pulls: `false` when a caller up the stack is already
    /// taking them (it takes the ones that become ready meanwhile too).
    pub(super) fn claim(&mut self) -> bool {
        !std::mem::replace(&mut self.starting, true)
    }

    /// The next ready pull, for the caller that claimed them; `None` ends the claim.
    pub(super) fn take_ready(&mut self) -> Option<T> {
        let next = self.ready.pop_front();
        if next.is_none() {
            self.starting = false;
        }
        next
    }

    /// Ends a claim without taking what is left (its caller is unwinding): the next caller
    /// takes it.
    pub(super) fn unclaim(&mut self) {
        self.starting = false;
    }

    /// Pulls waiting for room, on every rail.
    #[cfg(test)]
    fn waiting(&self) -> usize {
        self.gates.values().map(|g| g.waiting.len()).sum()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;

    #[test]
    fn vectors_come_back_by_class_and_within_the_limit() {
        let cache = RecvCache::new((3 << 20) - 1);
        let (v, again) = recv_vec(&cache, 10_000);
        assert!(!again);
        assert_eq!(v.len(), 16 << 10);
        let ptr = v.as_ptr();
        let b = RecycledBuf::new(v, 10_000, &cache);
        assert_eq!(b.as_slice().len(), 10_000);
        drop(b);
        // The same vector again, for any length of its class, not cleared.
        let (v, again) = recv_vec(&cache, 9_000);
        assert!(again);
        assert_eq!(v.as_ptr(), ptr);
        // Another class: a new vector.
        let (w, again) = recv_vec(&cache, 1 << 20);
        assert!(!again);
        assert_eq!(w.len(), 1 << 20);
        // A 1 MiB and a 2 MiB vector do not fit a cache of just under 3 MiB together.
        let (x, _) = recv_vec(&cache, (1 << 20) + 1);
        drop(RecycledBuf::new(w, 1 << 20, &cache));
        drop(RecycledBuf::new(x, 5, &cache));
        assert_eq!(cache.borrow().idle, 1 << 20);
        drop(RecycledBuf::new(v, 1, &cache));
        assert_eq!(cache.borrow().idle, (1 << 20) + (16 << 10));
    }

    #[test]
    fn a_kept_payload_leaves_the_cache_without_a_copy() {
        let cache = RecvCache::new(1 << 20);
        let (mut v, _) = recv_vec(&cache, 5_000);
        v[..3].copy_from_slice(b"abc");
        let ptr = v.as_ptr();
        let kept = RecycledBuf::new(v, 3, &cache).into_vec();
        assert_eq!(kept, b"abc");
        assert_eq!(kept.as_ptr(), ptr);
        assert_eq!(cache.borrow().idle, 0);
        // Small lengths still use the smallest class.
        assert_eq!(RecvCache::class_of(1), (0, 4096));
        assert_eq!(RecvCache::class_of(4097), (1, 8192));
    }

    fn node(n: u64) -> Rail {
        (NodeId::new(n), ShardId::new(0))
    }

    fn drain(g: &mut PullGates<u32>) -> Vec<u32> {
        assert!(g.claim());
        std::iter::from_fn(|| g.take_ready()).collect()
    }

    #[test]
    fn pulls_wait_for_their_rails_budget_in_arrival_order() {
        let mut g = PullGates::new(512 << 10, DedupHasher::random());
        let (a, b) = (node(1), node(2));
        // Under the budget: in at once; 64 KiB pulls, eight at a time.
        for i in 0..10 {
            assert_eq!(g.enter(a, 64 << 10, i), i >= 8, "pull {i}");
        }
        // Another peer is not held up by the first one's, nor another shard of the first.
        assert!(!g.enter((a.0, ShardId::new(1)), 1 << 20, 99));
        g.leave((a.0, ShardId::new(1)), 1 << 20);
        assert!(!g.enter(b, 1 << 20, 100));
        assert!(g.enter(b, 1 << 20, 101), "one 1 MiB pull at a time");
        assert_eq!(drain(&mut g), vec![0, 1, 2, 3, 4, 5, 6, 7, 99, 100]);
        assert_eq!(g.waiting(), 3);
        g.leave(a, 64 << 10);
        assert_eq!(drain(&mut g), vec![8]);
        g.leave(a, 64 << 10);
        g.leave(b, 1 << 20);
        assert_eq!(drain(&mut g), vec![9, 101]);
        assert_eq!(g.waiting(), 0);
        // Everything ends: no gate is kept for a rail with nothing in flight.
        for _ in 0..8 {
            g.leave(a, 64 << 10);
        }
        g.leave(b, 1 << 20);
        assert!(g.gates.is_empty());
        // A pull larger than the budget still goes when the rail has nothing in flight.
        assert!(!g.enter(a, 16 << 20, 7));
        assert_eq!(drain(&mut g), vec![7]);
    }

    #[test]
    fn a_claim_is_taken_once_and_a_budget_of_zero_lets_one_pull_in() {
        let mut g = PullGates::new(0, DedupHasher::random());
        assert!(!g.enter(node(3), 10, 1));
        assert!(g.enter(node(3), 10, 2));
        assert!(g.claim());
        assert!(
            !g.claim(),
            "a nested caller leaves the ready pulls to the first"
        );
        assert_eq!(g.take_ready(), Some(1));
        // The first pull ends while the claim is held: the next becomes ready for the same
        // caller.
        g.leave(node(3), 10);
        assert_eq!(g.take_ready(), Some(2));
        assert_eq!(g.take_ready(), None);
        assert!(g.claim(), "the claim ended with the last ready pull");
        g.unclaim();
        assert!(g.claim());
    }
}
