//! Request tracking: deadlines, at-most-once deduplication and credit-based flow control.
//!
//! * [`PendingTable`] — the client side of requests: one entry per request in flight, with a
//!   deadline. Completion, cancellation and expiry race; exactly one of them gets the entry.
//! * [`DedupWindow`] — the server side of at-most-once RPC: remembers which
//!   `(node, incarnation, shard, request)` it has seen, bounded by count and age.
//! * [`CreditWindow`] — per-peer flow control: bytes in flight never exceed the window.
//!
//! All three follow the crate's sans-IO pattern: time is passed in, expiry is pulled with
//! `poll_*`, and [`PendingTable::poll_timeout`] says when to come back.

use crate::ids::{Incarnation, NodeId, ReqId, ShardId};
use crate::time::Timestamp;
use std::cmp::Reverse;
use std::collections::hash_map::RandomState;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::hash::{BuildHasher, Hasher};
use std::time::Duration;
use thiserror::Error;

/// Requests in flight, keyed by [`ReqId`], each with a deadline.
///
/// # Exactly one completion
///
/// An entry leaves the table exactly once, through whichever of [`PendingTable::complete`],
/// [`PendingTable::cancel`], [`PendingTable::poll_expired`] or [`PendingTable::drain`] reaches it
/// first; that call returns `Some(value)` and every later one returns `None`. Ids are allocated
/// sequentially from 1 and never reused, so a late response cannot complete a newer request.
///
/// # Deadlines
///
/// A deadline of [`Timestamp::MAX`] (what `now + Duration::MAX` saturates to) never expires and
/// costs no timer entry. An entry whose deadline is at or before `now` expires on the next
/// [`PendingTable::poll_expired`].
///
/// # Calling order
///
/// Insert with [`PendingTable::insert`]; on each response or cancellation call
/// [`PendingTable::complete`] / [`PendingTable::cancel`]; when the time from
/// [`PendingTable::poll_timeout`] is reached, call [`PendingTable::poll_expired`] until it returns
/// `None`.
///
/// # Storage
///
/// Ids are the table's own and sequential, so a request goes to slot `id % 256` of a ring
/// when that slot is free, which it always is while fewer than 256 requests are pending and
/// they are answered about in order: entered, found and taken out with no hashing. A request
/// whose slot still holds an older one goes to a map, hashed with a [`DedupHasher`] of a fixed
/// key (a peer can look ids up with its replies but cannot add any).
///
/// Finite deadlines entered in order (each at or after the one entered before it: the usual
/// case of one timeout and a clock that moves forward) queue in entry order, the earliest
/// first; a request answered in order leaves the queue's front with it (no timer work per
/// request besides a push and a pop). Only a deadline earlier than the queue's last goes to a
/// min-heap. Entries answered out of order are skipped lazily in both, and both are kept
/// within a constant factor of the live entries. One request with a much longer timeout than
/// the ones after it holds the queue's back while it is pending: until it is answered, the
/// requests entered after it go to the heap (correct, at the heap's cost per request).
#[derive(Clone, Debug)]
pub struct PendingTable<T> {
    /// Requests by `id % RING`, each in the slot that was free when it was entered.
    ring: Box<[Option<(ReqId, Timestamp, T)>]>,
    /// The others (their slot held an older request still pending).
    spill: HashMap<ReqId, (Timestamp, T), DedupHasher>,
    /// Requests pending, in both.
    len: usize,
    /// Finite deadlines in non-decreasing order, with their ids (which increase too).
    queue: VecDeque<(Timestamp, ReqId)>,
    /// Min-heap of the other finite deadlines.
    timers: BinaryHeap<Reverse<(Timestamp, ReqId)>>,
    next_id: u64,
}

/// What the dedup window says about a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DedupVerdict<'a, R> {
    /// Never seen: it is now recorded as in progress; execute it.
    Fresh,
    /// Seen and still executing: drop this copy.
    InProgress,
    /// Seen and finished: resend the cached reply, do not execute again.
    Done(&'a R),
    /// Too old to tell (from an older incarnation, or below the window's floor after eviction):
    /// refuse it without executing, since it may already have run.
    TooOld,
}

/// The key of a request in the dedup window.
///
/// Request ids are allocated by each sending shard from its own [`PendingTable`], and several
/// shards of one node send to the same remote shard (one rail each, see [`crate::Rails`]), so
/// the sending shard is part of the key: `(node, incarnation, shard, request)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DedupKey {
    /// Sending node.
    pub node: NodeId,
    /// Its incarnation.
    pub incarnation: Incarnation,
    /// The sending shard (the frame's `src_shard`), whose pending table allocated `req_id`.
    pub shard: ShardId,
    /// The request.
    pub req_id: ReqId,
}

#[derive(Clone, Debug)]
enum DedupState<R> {
    InProgress,
    Done(R),
}

/// At-most-once bookkeeping for incoming requests, bounded by count and age.
///
/// Requests are keyed by [`DedupKey`]. An entry stays for at most `max_age` after it arrived and
/// the window holds at most `max_entries`; the oldest go first. A request arriving when the
/// window is full evicts the oldest `max_entries / 16` entries (at least one) at once, so that
/// the next ones find room: the window then holds between 15/16 of `max_entries` and all of it.
/// To stay at-most-once after
/// forgetting, the window keeps for each node the newest incarnation seen and, for each of its
/// sending shards, a *floor*: the largest request id it has evicted from that shard in that
/// incarnation. A request at or below its shard's floor, or from an older incarnation of its
/// node, is [`DedupVerdict::TooOld`]: it may have run, so it is refused. This relies on each
/// sending shard allocating request ids in increasing order (as [`PendingTable`] does); a
/// fresh request delayed past the window is refused too, which is the safe direction. The
/// incarnation is per node, not per shard: once any shard of a node is seen in a newer
/// incarnation, requests of every shard of its older one are refused. The floor tables grow
/// with the number of distinct peer shards, not with traffic.
///
/// # Cost and hashing
///
/// Entries are kept per sending shard, in arrival order, with the largest request id that
/// shard has sent (`top`). A sending shard's ids increase (its pending table allocates them
/// in order, and one rail carries them in order), so a fresh request is recognised by one
/// comparison with `top` and appended; [`DedupWindow::complete`] finds its request at the
/// back; eviction pops the front of the oldest entry's shard. No hashing per request: the
/// sending shard of the last request checked is remembered, and only a request from another
/// one looks its shard up (one keyed hash of `(node, shard)`, [`DedupHasher`]) and its node's
/// incarnation (one more). A request at or below `top` (a duplicate, or ids out of order,
/// which only a misbehaving peer sends) is looked for from the back of its shard's entries:
/// the work per operation is bounded by the window's size. The global arrival order is made
/// with room for `max_entries` (up to 64 Ki); a shard's entries grow by doubling, once per
/// size, and are freed once all of them have left the window. The hasher's key is drawn per
/// window from std's [`RandomState`] (as `HashMap::new` does): a peer that does not know it
/// cannot choose node ids that collide, and the tables hold one key per peer shard and node,
/// not per request.
#[derive(Clone, Debug)]
pub struct DedupWindow<R> {
    max_entries: usize,
    max_age: Duration,
    /// Every sending shard seen (in the newest incarnation of its node), with its entries;
    /// the slots of a restarted node's shards are reused (`free`).
    sources: Vec<Source<R>>,
    free: Vec<u32>,
    /// Where each sending shard is in `sources`.
    index: HashMap<(NodeId, ShardId), u32, DedupHasher>,
    /// The newest incarnation seen of each node.
    nodes: HashMap<NodeId, Incarnation, DedupHasher>,
    /// Every entry's arrival and sending shard, oldest first: the oldest entry is the front of
    /// the front's shard's entries.
    order: VecDeque<(Timestamp, u32)>,
    len: usize,
    evicted: u64,
    /// The sending shard of the last request checked.
    last: Option<u32>,
}

/// One sending shard's entries in a [`DedupWindow`].
#[derive(Clone, Debug)]
struct Source<R> {
    node: NodeId,
    incarnation: Incarnation,
    shard: ShardId,
    /// The largest request id evicted (absent: none evicted yet).
    floor: Option<ReqId>,
    /// The largest request id recorded (evicted or not).
    top: ReqId,
    /// Entries in arrival order.
    entries: VecDeque<(ReqId, DedupState<R>)>,
}

/// The keyed hash of [`DedupWindow`]'s tables: each 64-bit word `x` of the key is folded into
/// the state as `fold(x ^ k0, state ^ k1)`, where `fold` is the 128-bit product's halves
/// xored together (the construction of foldhash and wyhash). Not a cryptographic hash: its
/// key makes collisions hard to aim at, and the window's bound caps what one would cost.
#[derive(Clone)]
pub struct DedupHasher {
    k0: u64,
    k1: u64,
}

impl DedupHasher {
    /// A hasher with the key `(k0, k1)`.
    pub fn with_key(k0: u64, k1: u64) -> DedupHasher {
        DedupHasher { k0, k1 }
    }

    /// A hasher with a key from std's [`RandomState`].
    pub fn random() -> DedupHasher {
        let s = RandomState::new();
        let draw = |i: u64| {
            let mut h = s.build_hasher();
            h.write_u64(i);
            h.finish()
        };
        DedupHasher::with_key(draw(0), draw(1))
    }
}

/// [`DedupHasher::random`].
impl Default for DedupHasher {
    fn default() -> DedupHasher {
        DedupHasher::random()
    }
}

impl std::fmt::Debug for DedupHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key stays secret.
        f.write_str("DedupHasher")
    }
}

impl BuildHasher for DedupHasher {
    type Hasher = FoldHasher;

    fn build_hasher(&self) -> FoldHasher {
        FoldHasher {
            // Not `k1` itself: the first word's product would be zero.
            state: self.k1 ^ 0x243f_6a88_85a3_08d3,
            k0: self.k0,
            k1: self.k1,
        }
    }
}

/// The hasher of [`DedupHasher`].
#[derive(Clone, Debug)]
pub struct FoldHasher {
    state: u64,
    k0: u64,
    k1: u64,
}

/// The two halves of the 128-bit product of `a` and `b`, xored.
fn fold(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    // Truncations intended: the low and the high half.
    (p as u64) ^ ((p >> 64) as u64)
}

impl Hasher for FoldHasher {
    fn write_u64(&mut self, x: u64) {
        self.state = fold(x ^ self.k0, self.state ^ self.k1);
    }

    // Integers are one word each (not their bytes through `write`): ids and enum
    // discriminants are what these tables hold.
    fn write_u8(&mut self, x: u8) {
        self.write_u64(u64::from(x));
    }

    fn write_u16(&mut self, x: u16) {
        self.write_u64(u64::from(x));
    }

    fn write_u32(&mut self, x: u32) {
        self.write_u64(u64::from(x));
    }

    fn write_usize(&mut self, x: usize) {
        self.write_u64(x as u64);
    }

    fn write_isize(&mut self, x: isize) {
        self.write_u64(x as u64);
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(b));
        }
        // The length, so that trailing zero bytes still count.
        self.write_u64(bytes.len() as u64);
    }

    fn finish(&self) -> u64 {
        // One more round, so that the last word's bits reach the top ones (hashbrown's
        // control bytes) and the low ones (its bucket index).
        fold(self.state ^ self.k0, self.k1.rotate_left(23) | 1)
    }
}

/// Credit-based flow control for one peer.
///
/// `try_acquire(n)` succeeds only if `in_flight + n <= window`, so bytes in flight never exceed
/// the window. A single message larger than the whole window is refused with
/// [`CreditError::LargerThanWindow`] rather than let through: size the window at least as large
/// as the maximum message size. Credits are returned with [`CreditWindow::release`] when the
/// operation completes (response, error, cancellation or expiry).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CreditWindow {
    window: u64,
    in_flight: u64,
    high_water: u64,
}

/// Flow-control errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum CreditError {
    /// Not enough credit now; retry after some completes.
    #[error("{wanted} bytes wanted, {available} of {window} available")]
    Exhausted {
        /// Bytes requested.
        wanted: u64,
        /// Bytes available now.
        available: u64,
        /// The window.
        window: u64,
    },
    /// The message can never fit.
    #[error("{wanted} bytes exceed the whole window of {window}")]
    LargerThanWindow {
        /// Bytes requested.
        wanted: u64,
        /// The window.
        window: u64,
    },
    /// More released than was in flight (a bookkeeping bug in the caller).
    #[error("released {released} bytes with only {in_flight} in flight")]
    OverRelease {
        /// Bytes released.
        released: u64,
        /// Bytes that were in flight.
        in_flight: u64,
    },
}

/// Slots of a [`PendingTable`]'s ring (a power of two).
const RING: usize = 256;

impl<T> PendingTable<T> {
    /// An empty table.
    pub fn new() -> PendingTable<T> {
        PendingTable {
            ring: std::iter::repeat_with(|| None).take(RING).collect(),
            spill: HashMap::with_hasher(DedupHasher::with_key(
                0x9e37_79b9_7f4a_7c15,
                0xc2b2_ae3d_27d4_eb4f,
            )),
            len: 0,
            queue: VecDeque::new(),
            timers: BinaryHeap::new(),
            next_id: 1,
        }
    }

    /// The ring slot of `id`.
    #[inline(always)]
    fn slot(id: ReqId) -> usize {
        // Truncation intended: the low bits.
        (id.get() as usize) & (RING - 1)
    }

    /// The deadline and value of pending request `id`.
    #[inline]
    fn find(&self, id: ReqId) -> Option<(Timestamp, &T)> {
        match &self.ring[Self::slot(id)] {
            Some((i, d, v)) if *i == id => Some((*d, v)),
            _ => self.spill.get(&id).map(|(d, v)| (*d, v)),
        }
    }

    /// Takes pending request `id` out.
    #[inline]
    fn take(&mut self, id: ReqId) -> Option<(Timestamp, T)> {
        let slot = &mut self.ring[Self::slot(id)];
        let got = if slot.as_ref().is_some_and(|(i, _, _)| *i == id) {
            slot.take().map(|(_, d, v)| (d, v))
        } else {
            self.spill.remove(&id)
        };
        if got.is_some() {
            self.len -= 1;
        }
        got
    }

    /// Records a request due by `deadline` and returns its fresh id.
    pub fn insert(&mut self, deadline: Timestamp, value: T) -> ReqId {
        let id = ReqId::new(self.next_id);
        self.next_id = self.next_id.wrapping_add(1).max(1);
        let slot = &mut self.ring[Self::slot(id)];
        if slot.is_none() {
            *slot = Some((id, deadline, value));
        } else {
            self.spill.insert(id, (deadline, value));
        }
        self.len += 1;
        if !deadline.is_never() {
            if self.queue.back().is_none_or(|&(last, _)| deadline >= last) {
                self.queue.push_back((deadline, id));
            } else {
                self.timers.push(Reverse((deadline, id)));
            }
        }
        self.compact();
        id
    }

    /// Records a request due `timeout` after `now` (saturating: `Duration::MAX` never expires).
    pub fn insert_with_timeout(&mut self, now: Timestamp, timeout: Duration, value: T) -> ReqId {
        self.insert(now.saturating_add(timeout), value)
    }

    /// The response arrived: returns the entry if it was still pending.
    pub fn complete(&mut self, id: ReqId) -> Option<T> {
        let (_, v) = self.take(id)?;
        if self.queue.front().is_some_and(|&(_, front)| front == id) {
            self.queue.pop_front();
            // Entries answered before it, out of order, now at the front: skipped now. Only
            // looked for while the queue holds more than the live entries (there are some).
            while self.queue.len() > self.len {
                match self.queue.front() {
                    Some(&(_, next)) if !self.contains(next) => {
                        self.queue.pop_front();
                    }
                    _ => break,
                }
            }
        }
        Some(v)
    }

    /// The caller gave up: returns the entry if it was still pending.
    pub fn cancel(&mut self, id: ReqId) -> Option<T> {
        self.complete(id)
    }

    /// The deadline of a pending request.
    pub fn deadline(&self, id: ReqId) -> Option<Timestamp> {
        self.find(id).map(|(d, _)| d)
    }

    /// Whether `id` is pending.
    pub fn contains(&self, id: ReqId) -> bool {
        self.find(id).is_some()
    }

    /// The pending value for `id`.
    pub fn get(&self, id: ReqId) -> Option<&T> {
        self.find(id).map(|(_, v)| v)
    }

    /// The pending value for `id`, mutably (the deadline cannot be changed).
    pub fn get_mut(&mut self, id: ReqId) -> Option<&mut T> {
        match &mut self.ring[Self::slot(id)] {
            Some((i, _, v)) if *i == id => Some(v),
            _ => self.spill.get_mut(&id).map(|(_, v)| v),
        }
    }

    /// Every pending request, in arbitrary order.
    pub fn iter(&self) -> impl Iterator<Item = (ReqId, &T)> + '_ {
        let ring = self.ring.iter().flatten().map(|(id, _, v)| (*id, v));
        ring.chain(self.spill.iter().map(|(id, (_, v))| (*id, v)))
    }

    /// Requests pending.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The next request whose deadline is at or before `now`, removed from the table.
    pub fn poll_expired(&mut self, now: Timestamp) -> Option<(ReqId, T)> {
        while let Some((deadline, id)) = self.earliest() {
            if deadline > now {
                return None;
            }
            self.pop_earliest(deadline, id);
            if self.deadline(id) == Some(deadline) {
                if let Some((_, v)) = self.take(id) {
                    return Some((id, v));
                }
            }
        }
        None
    }

    /// The earliest deadline still pending, if any is finite.
    pub fn poll_timeout(&mut self) -> Option<Timestamp> {
        while let Some((deadline, id)) = self.earliest() {
            if self.contains(id) {
                return Some(deadline);
            }
            self.pop_earliest(deadline, id);
        }
        None
    }

    /// The earlier of the queue's front and the heap's top (live or not).
    fn earliest(&self) -> Option<(Timestamp, ReqId)> {
        let heap = self.timers.peek().map(|Reverse(t)| *t);
        match (self.queue.front().copied(), heap) {
            (Some(q), Some(h)) => Some(q.min(h)),
            (q, h) => q.or(h),
        }
    }

    /// Takes out what [`PendingTable::earliest`] returned.
    fn pop_earliest(&mut self, deadline: Timestamp, id: ReqId) {
        if self.queue.front() == Some(&(deadline, id)) {
            self.queue.pop_front();
        } else {
            self.timers.pop();
        }
    }

    /// Removes and returns every pending request (e.g. when the connection failed), in id order.
    pub fn drain(&mut self) -> Vec<(ReqId, T)> {
        self.queue.clear();
        self.timers.clear();
        self.len = 0;
        let ring = self.ring.iter_mut().filter_map(Option::take);
        let mut all: Vec<(ReqId, T)> = ring
            .map(|(id, _, v)| (id, v))
            .chain(self.spill.drain().map(|(id, (_, v))| (id, v)))
            .collect();
        all.sort_by_key(|(id, _)| *id);
        all
    }

    /// Removes and returns the pending requests for which `pred` holds, in id order.
    pub fn drain_where(&mut self, mut pred: impl FnMut(ReqId, &T) -> bool) -> Vec<(ReqId, T)> {
        let ids: Vec<ReqId> = self
            .iter()
            .filter(|(id, v)| pred(*id, v))
            .map(|(id, _)| id)
            .collect();
        let mut out: Vec<(ReqId, T)> = ids
            .into_iter()
            .filter_map(|id| self.take(id).map(|(_, v)| (id, v)))
            .collect();
        out.sort_by_key(|(id, _)| *id);
        self.compact();
        out
    }

    /// Keeps the lazy timer queue and heap within a constant factor of the live entries.
    fn compact(&mut self) {
        let live = self.len;
        if self.queue.len() > 64 && self.queue.len() > 2 * live {
            let mut queue = std::mem::take(&mut self.queue);
            queue.retain(|(_, id)| self.contains(*id));
            self.queue = queue;
        }
        if self.timers.len() > 64 && self.timers.len() > 2 * live {
            let mut timers = std::mem::take(&mut self.timers);
            timers.retain(|Reverse((_, id))| self.contains(*id));
            self.timers = timers;
        }
    }
}

impl<T> Default for PendingTable<T> {
    fn default() -> PendingTable<T> {
        PendingTable::new()
    }
}

/// The most entries a [`DedupWindow`] makes room for when it is made; a larger window grows
/// past it as requests arrive.
const PRESIZE_MAX: usize = 64 * 1024;

/// Entries of room a sending shard's queue in a [`DedupWindow`] keeps once it is empty; a
/// larger queue is freed.
const SOURCE_KEEP: usize = 64;

impl<R> DedupWindow<R> {
    /// A window holding at most `max_entries` requests (at least 1) for at most `max_age` each.
    pub fn new(max_entries: usize, max_age: Duration) -> DedupWindow<R> {
        DedupWindow::with_hasher(max_entries, max_age, DedupHasher::random())
    }

    /// [`DedupWindow::new`] hashing with `hasher` (a fixed key makes runs reproducible).
    pub fn with_hasher(
        max_entries: usize,
        max_age: Duration,
        hasher: DedupHasher,
    ) -> DedupWindow<R> {
        let max_entries = max_entries.max(1);
        // Sized for a full window from the start (up to PRESIZE_MAX entries): growing it
        // moves every entry at once, on the path of one request. (The hash table of every
        // key this window once had took about 300 thousand instructions at a time to grow, up
        // to 16 Ki entries: `scripts/count-instructions --test rpc-lat --keep DIR`,
        // `reserve_rehash` in its call tree.) Pages are touched only as entries land.
        let presize = max_entries.min(PRESIZE_MAX);
        DedupWindow {
            max_entries,
            max_age,
            sources: Vec::new(),
            free: Vec::new(),
            index: HashMap::with_hasher(hasher.clone()),
            nodes: HashMap::with_hasher(hasher),
            order: VecDeque::with_capacity(presize),
            len: 0,
            evicted: 0,
            last: None,
        }
    }

    /// Classifies a request arriving at `now` and records it if fresh.
    ///
    /// When the window is full, its oldest entries are evicted first (see the type's docs); a
    /// copy of one of them is then [`DedupVerdict::TooOld`], refused like any request below
    /// the floor.
    pub fn check_and_insert(&mut self, now: Timestamp, key: DedupKey) -> DedupVerdict<'_, R> {
        self.expire(now);
        if self.len >= self.max_entries {
            self.evict_batch();
        }
        let s = match self.last {
            Some(s) if self.is_source(s, key) => s,
            _ => match self.source_of(key) {
                Some(s) => s,
                None => return DedupVerdict::TooOld,
            },
        };
        let Some(src) = self.sources.get_mut(s as usize) else {
            return DedupVerdict::TooOld;
        };
        if src.floor.is_some_and(|f| key.req_id <= f) {
            return DedupVerdict::TooOld;
        }
        if key.req_id > src.top {
            // Above every id recorded: fresh, the common case.
            src.top = key.req_id;
        } else if let Some(at) = src.entries.iter().rposition(|(id, _)| *id == key.req_id) {
            // A copy (looked for from the back).
            return match &src.entries[at].1 {
                DedupState::Done(r) => DedupVerdict::Done(r),
                DedupState::InProgress => DedupVerdict::InProgress,
            };
        }
        src.entries.push_back((key.req_id, DedupState::InProgress));
        self.order.push_back((now, s));
        self.len += 1;
        DedupVerdict::Fresh
    }

    /// Records the reply of a request that finished, for resending to duplicates. Returns
    /// `false` if the request is no longer in the window.
    pub fn complete(&mut self, key: DedupKey, reply: R) -> bool {
        let s = match self.last {
            Some(s) if self.is_source(s, key) => s,
            _ => match self.index.get(&(key.node, key.shard)) {
                Some(&s) if self.sources[s as usize].incarnation == key.incarnation => s,
                _ => return false,
            },
        };
        let Some(src) = self.sources.get_mut(s as usize) else {
            return false;
        };
        // Usually the last one recorded; else looked for from the back.
        let state = match src.entries.back_mut() {
            Some((id, state)) if *id == key.req_id => Some(state),
            _ => src
                .entries
                .iter_mut()
                .rev()
                .find(|(id, _)| *id == key.req_id)
                .map(|(_, state)| state),
        };
        match state {
            Some(state) => {
                *state = DedupState::Done(reply);
                true
            }
            None => false,
        }
    }

    /// Forgets entries older than the window's age at `now`.
    pub fn expire(&mut self, now: Timestamp) {
        while let Some((at, _)) = self.order.front() {
            if now.saturating_duration_since(*at) < self.max_age {
                break;
            }
            self.evict_oldest();
        }
    }

    /// When the oldest entry ages out.
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        self.order
            .front()
            .map(|(at, _)| at.saturating_add(self.max_age))
    }

    /// Requests currently remembered.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Entries evicted so far (by age or count).
    pub fn evicted(&self) -> u64 {
        self.evicted
    }

    /// Whether slot `s` holds `key`'s sending shard, in `key`'s incarnation.
    fn is_source(&self, s: u32, key: DedupKey) -> bool {
        self.sources.get(s as usize).is_some_and(|src| {
            src.node == key.node && src.shard == key.shard && src.incarnation == key.incarnation
        })
    }

    /// The slot of `key`'s sending shard (a request from another one than the last), made if
    /// new, after the incarnation check: `None` if `key` comes from an older incarnation of
    /// its node. A newer incarnation voids everything of the node's previous life. The slot
    /// becomes the last source.
    fn source_of(&mut self, key: DedupKey) -> Option<u32> {
        match self.nodes.get(&key.node) {
            Some(&inc) if key.incarnation < inc => return None,
            Some(&inc) if key.incarnation > inc => {
                self.forget_node(key.node);
                self.nodes.insert(key.node, key.incarnation);
            }
            Some(_) => {}
            None => {
                self.nodes.insert(key.node, key.incarnation);
            }
        }
        let s = match self.index.get(&(key.node, key.shard)) {
            Some(&s) => s,
            None => {
                let src = Source {
                    node: key.node,
                    incarnation: key.incarnation,
                    shard: key.shard,
                    floor: None,
                    top: ReqId::NONE,
                    entries: VecDeque::new(),
                };
                let s = match self.free.pop() {
                    Some(s) => {
                        self.sources[s as usize] = src;
                        s
                    }
                    None => {
                        // Slots are u32: a window sees far fewer peer shards than that.
                        self.sources.push(src);
                        (self.sources.len() - 1) as u32
                    }
                };
                self.index.insert((key.node, key.shard), s);
                s
            }
        };
        self.last = Some(s);
        Some(s)
    }

    /// Drops every entry and shard of `node` (it restarted): they cannot crowd the window.
    fn forget_node(&mut self, node: NodeId) {
        let mut gone = Vec::new();
        for (s, src) in self.sources.iter_mut().enumerate() {
            if src.node == node && !self.free.contains(&(s as u32)) {
                self.len -= src.entries.len();
                src.entries = VecDeque::new();
                self.index.remove(&(node, src.shard));
                gone.push(s as u32);
            }
        }
        self.order.retain(|(_, s)| !gone.contains(s));
        if self.last.is_some_and(|s| gone.contains(&s)) {
            self.last = None;
        }
        self.free.extend(gone);
    }

    /// Evicts the oldest `max_entries / 16` entries (at least one), a run of one sending
    /// shard's at a time (a busy shard's entries come in long runs): per entry, little more
    /// than dropping it.
    fn evict_batch(&mut self) {
        let mut left = (self.max_entries / 16).max(1);
        while left > 0 {
            let Some(&(_, s)) = self.order.front() else {
                break;
            };
            let run = self
                .order
                .iter()
                .take(left)
                .take_while(|&&(_, t)| t == s)
                .count();
            self.order.drain(..run);
            left -= run;
            self.evict_from(s, run);
        }
    }

    /// Evicts the oldest entry, raising its shard's floor.
    fn evict_oldest(&mut self) {
        if let Some((_, s)) = self.order.pop_front() {
            self.evict_from(s, 1);
        }
    }

    /// Evicts the `n` oldest entries of sending shard `s` (whose places at the front of the
    /// window's order are gone already), raising its floor to the largest id evicted.
    fn evict_from(&mut self, s: u32, n: usize) {
        let src = &mut self.sources[s as usize];
        let n = n.min(src.entries.len());
        let mut floor = src.floor;
        for (id, _) in src.entries.drain(..n) {
            floor = Some(floor.map_or(id, |f| f.max(id)));
        }
        src.floor = floor;
        self.len -= n;
        self.evicted += n as u64;
        // A shard whose entries have all gone (it went quiet, or was evicted by a busier one)
        // gives its queue's memory back: what the window holds stays bounded by its entries,
        // not by every peer shard's largest backlog.
        if src.entries.is_empty() && src.entries.capacity() > SOURCE_KEEP {
            src.entries = VecDeque::new();
        }
    }
}

impl CreditWindow {
    /// A window of `window` bytes.
    pub fn new(window: u64) -> CreditWindow {
        CreditWindow {
            window,
            in_flight: 0,
            high_water: 0,
        }
    }

    /// Takes `bytes` of credit, or says why not.
    pub fn try_acquire(&mut self, bytes: u64) -> Result<(), CreditError> {
        if bytes > self.window {
            return Err(CreditError::LargerThanWindow {
                wanted: bytes,
                window: self.window,
            });
        }
        let available = self.available();
        if bytes > available {
            return Err(CreditError::Exhausted {
                wanted: bytes,
                available,
                window: self.window,
            });
        }
        self.in_flight += bytes;
        self.high_water = self.high_water.max(self.in_flight);
        Ok(())
    }

    /// Returns `bytes` of credit. Releasing more than is in flight is an error and changes
    /// nothing.
    pub fn release(&mut self, bytes: u64) -> Result<(), CreditError> {
        if bytes > self.in_flight {
            return Err(CreditError::OverRelease {
                released: bytes,
                in_flight: self.in_flight,
            });
        }
        self.in_flight -= bytes;
        Ok(())
    }

    /// Bytes in flight.
    pub fn in_flight(&self) -> u64 {
        self.in_flight
    }

    /// Bytes that may be acquired now.
    pub fn available(&self) -> u64 {
        self.window - self.in_flight
    }

    /// The window size.
    pub fn window(&self) -> u64 {
        self.window
    }

    /// The most bytes ever in flight at once.
    pub fn high_water(&self) -> u64 {
        self.high_water
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;

    fn t(ms: u64) -> Timestamp {
        Timestamp::from_nanos(ms * 1_000_000)
    }

    #[test]
    fn first_completion_wins() {
        let mut p = PendingTable::new();
        let a = p.insert(t(10), "a");
        let b = p.insert(t(20), "b");
        let c = p.insert(t(30), "c");
        assert_eq!(p.poll_timeout(), Some(t(10)));
        assert_eq!(p.complete(a), Some("a"));
        assert_eq!(p.cancel(a), None);
        assert_eq!(
            p.poll_expired(t(15)),
            None,
            "completed entries do not expire"
        );
        assert_eq!(p.cancel(b), Some("b"));
        assert_eq!(p.complete(b), None);
        assert_eq!(p.poll_timeout(), Some(t(30)));
        assert_eq!(p.poll_expired(t(29)), None);
        assert_eq!(p.poll_expired(t(30)), Some((c, "c")));
        assert_eq!(p.complete(c), None);
        assert_eq!(p.poll_timeout(), None);
        assert!(p.is_empty());
    }

    #[test]
    fn duration_max_deadline_is_safe() {
        let mut p = PendingTable::new();
        let id = p.insert_with_timeout(t(5), Duration::MAX, 1);
        assert_eq!(p.deadline(id), Some(Timestamp::MAX));
        assert_eq!(p.poll_timeout(), None);
        assert_eq!(p.poll_expired(Timestamp::MAX), None);
        let id2 = p.insert_with_timeout(Timestamp::MAX, Duration::from_secs(1), 2);
        assert_eq!(p.poll_expired(Timestamp::MAX), None);
        assert_eq!(p.len(), 2);
        assert_eq!(p.drain(), vec![(id, 1), (id2, 2)]);
    }

    #[test]
    fn ids_are_unique_and_expiry_is_ordered() {
        let mut p = PendingTable::new();
        let ids: Vec<ReqId> = (0..100).map(|i| p.insert(t(100 - i), i)).collect();
        let mut sorted = ids.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 100);
        let mut last = Timestamp::ZERO;
        let mut n = 0;
        while let Some((id, v)) = p.poll_expired(t(1_000)) {
            let deadline = t(100 - v);
            assert!(deadline >= last, "expiry out of order");
            assert_eq!(ids[v as usize], id);
            last = deadline;
            n += 1;
        }
        assert_eq!(n, 100);
        let d = p.insert(t(1), 7);
        assert!(p.contains(d));
        assert_eq!(p.get(d), Some(&7));
        assert_eq!(p.drain_where(|_, v| *v == 7), vec![(d, 7)]);
    }

    #[test]
    fn heap_stays_bounded() {
        // In order: each request leaves the queue with its answer, nothing goes to the heap.
        let mut p = PendingTable::new();
        for i in 0..10_000u64 {
            let id = p.insert(t(i + 1), i);
            assert_eq!(p.complete(id), Some(i));
            assert!(p.queue.len() <= 1 && p.timers.is_empty());
        }
        // A window of 100 answered out of order, behind one request that stays pending with a
        // later deadline (the later ones go to the heap): queue and heap stay within a constant
        // factor of what is pending, and the ring's spill small.
        let mut p = PendingTable::new();
        let long = p.insert(t(1 << 30), u64::MAX);
        let mut window = std::collections::VecDeque::new();
        let mut spill = 0;
        for i in 0..200_000u64 {
            window.push_back(p.insert(t(i + 1), i));
            let bound = (2 * p.len()).max(64);
            let (queue, heap) = (p.queue.len(), p.timers.len());
            assert!(
                queue <= bound && heap <= bound,
                "{i}: queue {queue}, heap {heap}"
            );
            if window.len() == 100 {
                // Every third answer out of order: the newest instead of the oldest.
                let id = if i % 3 == 0 {
                    window.pop_back()
                } else {
                    window.pop_front()
                };
                assert!(p.complete(id.expect("in the window")).is_some());
            }
            spill = spill.max(p.spill.len());
        }
        assert!(spill <= 1, "spill {spill}");
        assert_eq!(p.complete(long), Some(u64::MAX));
    }

    fn key(node: u64, inc: u64, req: u64) -> DedupKey {
        shard_key(node, inc, 0, req)
    }

    fn shard_key(node: u64, inc: u64, shard: u16, req: u64) -> DedupKey {
        DedupKey {
            node: NodeId::new(node),
            incarnation: Incarnation::new(inc),
            shard: ShardId::new(shard),
            req_id: ReqId::new(req),
        }
    }

    /// The window's tables are made with room for a full window: filling it, and turning it
    /// over twice (evictions and fresh keys), never grows them (a growth rehashes every entry
    /// on one request's path).
    #[test]
    fn a_full_window_never_grows_its_tables() {
        const MAX: usize = 4096;
        let mut w: DedupWindow<u64> = DedupWindow::new(MAX, Duration::from_secs(3600));
        let order = w.order.capacity();
        assert!(order >= MAX, "{order}");
        let mut grown = 0;
        for req in 1..=(3 * MAX as u64) {
            let k = key(1, 1, req);
            assert_eq!(w.check_and_insert(t(req), k), DedupVerdict::Fresh);
            assert!(w.complete(k, req));
            // The shard's entries reach their size within the first full window.
            if req == MAX as u64 {
                grown = w.sources[0].entries.capacity();
            }
        }
        assert!(w.len() <= MAX && w.evicted() >= 2 * MAX as u64 - 1);
        assert_eq!(
            w.sources[0].entries.capacity(),
            grown,
            "the shard's entries grew"
        );
        assert_eq!(w.order.capacity(), order, "the age queue grew");
    }

    /// A batch of evictions takes the oldest entries whatever shard sent them: runs of one
    /// shard's, and single ones between another's.
    #[test]
    fn a_batch_evicts_the_oldest_of_every_shard() {
        // 64 entries, evicted 4 at a time.
        let mut w: DedupWindow<u64> = DedupWindow::new(64, Duration::from_secs(3600));
        let (a, b) = (|req| shard_key(1, 1, 0, req), |req| shard_key(1, 1, 1, req));
        // A1 A2 A3 B1, then A and B alternating.
        let mut keys = vec![a(1), a(2), a(3), b(1)];
        for req in 2..=31 {
            keys.push(a(req + 2));
            keys.push(b(req));
        }
        assert_eq!(keys.len(), 64);
        for (i, &k) in keys.iter().enumerate() {
            assert_eq!(w.check_and_insert(t(i as u64), k), DedupVerdict::Fresh);
            assert!(w.complete(k, i as u64));
        }
        // Full: the next one evicts the 4 oldest, A1 A2 A3 B1.
        assert_eq!(w.check_and_insert(t(100), a(34)), DedupVerdict::Fresh);
        // The evicted are refused, the next ones still answered from the window.
        let after_batch =
            |w: &mut DedupWindow<u64>, at, gone: [DedupKey; 4], kept: [(DedupKey, u64); 2]| {
                for k in gone {
                    assert_eq!(w.check_and_insert(t(at), k), DedupVerdict::TooOld, "{k:?}");
                }
                for (k, r) in kept {
                    assert_eq!(
                        w.check_and_insert(t(at), k),
                        DedupVerdict::Done(&r),
                        "{k:?}"
                    );
                }
            };
        assert_eq!((w.len(), w.evicted()), (61, 4));
        after_batch(
            &mut w,
            101,
            [a(1), a(2), a(3), b(1)],
            [(a(4), 4), (b(2), 5)],
        );
        // The next batch (once full again) takes A4 B2 A5 B3: single ones, alternating.
        for req in 35..=37 {
            assert_eq!(w.check_and_insert(t(102), a(req)), DedupVerdict::Fresh);
        }
        assert_eq!(w.len(), 64);
        assert_eq!(w.check_and_insert(t(103), a(38)), DedupVerdict::Fresh);
        assert_eq!((w.len(), w.evicted()), (61, 8));
        after_batch(
            &mut w,
            104,
            [a(4), b(2), a(5), b(3)],
            [(a(6), 8), (b(4), 9)],
        );
    }

    #[test]
    fn a_shard_whose_entries_all_left_gives_its_memory_back() {
        let mut w: DedupWindow<u64> = DedupWindow::new(4096, Duration::from_millis(100));
        for req in 1..=1000 {
            assert_eq!(
                w.check_and_insert(t(1), key(1, 1, req)),
                DedupVerdict::Fresh
            );
        }
        assert!(w.sources[0].entries.capacity() >= 1000);
        // All age out: the queue is freed, the floor kept.
        w.expire(t(200));
        assert_eq!((w.len(), w.evicted()), (0, 1000));
        assert_eq!(w.sources[0].entries.capacity(), 0);
        assert_eq!(
            w.check_and_insert(t(201), key(1, 1, 1000)),
            DedupVerdict::TooOld
        );
        assert_eq!(
            w.check_and_insert(t(201), key(1, 1, 1001)),
            DedupVerdict::Fresh
        );
    }

    #[test]
    fn dedup_states() {
        let mut w: DedupWindow<&str> = DedupWindow::new(3, Duration::from_secs(10));
        assert_eq!(w.check_and_insert(t(0), key(1, 1, 1)), DedupVerdict::Fresh);
        assert_eq!(
            w.check_and_insert(t(1), key(1, 1, 1)),
            DedupVerdict::InProgress
        );
        assert!(w.complete(key(1, 1, 1), "r1"));
        assert_eq!(
            w.check_and_insert(t(2), key(1, 1, 1)),
            DedupVerdict::Done(&"r1")
        );
        assert!(!w.complete(key(9, 9, 9), "x"));
        // Count bound: the fourth entry evicts the first and raises the floor.
        for r in 2..=4 {
            assert_eq!(w.check_and_insert(t(3), key(1, 1, r)), DedupVerdict::Fresh);
        }
        assert_eq!(w.len(), 3);
        assert_eq!(w.evicted(), 1);
        assert_eq!(w.check_and_insert(t(4), key(1, 1, 1)), DedupVerdict::TooOld);
        // Other nodes are independent.
        assert_eq!(w.check_and_insert(t(4), key(2, 1, 1)), DedupVerdict::Fresh);
    }

    #[test]
    fn dedup_age_and_incarnation() {
        let mut w: DedupWindow<()> = DedupWindow::new(100, Duration::from_millis(10));
        assert_eq!(w.check_and_insert(t(0), key(1, 5, 1)), DedupVerdict::Fresh);
        assert_eq!(w.poll_timeout(), Some(t(10)));
        assert_eq!(
            w.check_and_insert(t(9), key(1, 5, 1)),
            DedupVerdict::InProgress
        );
        assert_eq!(
            w.check_and_insert(t(10), key(1, 5, 1)),
            DedupVerdict::TooOld
        );
        assert!(w.is_empty());
        assert_eq!(
            w.check_and_insert(t(11), key(1, 4, 50)),
            DedupVerdict::TooOld
        );
        assert_eq!(w.check_and_insert(t(11), key(1, 5, 2)), DedupVerdict::Fresh);
        // A new incarnation voids the old one, including its entries.
        assert_eq!(w.check_and_insert(t(12), key(1, 6, 1)), DedupVerdict::Fresh);
        assert_eq!(w.len(), 1);
        assert_eq!(
            w.check_and_insert(t(12), key(1, 5, 3)),
            DedupVerdict::TooOld
        );
    }

    #[test]
    fn dedup_keys_and_floors_are_per_sending_shard() {
        let mut w: DedupWindow<u32> = DedupWindow::new(100, Duration::from_millis(10));
        let fresh = DedupVerdict::Fresh;
        // Two shards of one node use the same request id: two distinct requests.
        assert_eq!(w.check_and_insert(t(0), shard_key(1, 1, 0, 5)), fresh);
        assert_eq!(w.check_and_insert(t(0), shard_key(1, 1, 1, 5)), fresh);
        assert!(w.complete(shard_key(1, 1, 1, 5), 51));
        assert_eq!(
            w.check_and_insert(t(1), shard_key(1, 1, 1, 5)),
            DedupVerdict::Done(&51)
        );
        assert_eq!(
            w.check_and_insert(t(1), shard_key(1, 1, 0, 5)),
            DedupVerdict::InProgress
        );
        assert_eq!(w.check_and_insert(t(5), shard_key(1, 1, 2, 1)), fresh);
        // At 10 ms the two requests of t = 0 age out: shards 0 and 1 get floor 5, shard 2 none.
        for (shard, req) in [(0, 5), (0, 4), (1, 5)] {
            assert_eq!(
                w.check_and_insert(t(10), shard_key(1, 1, shard, req)),
                DedupVerdict::TooOld,
                "shard {shard} request {req}"
            );
        }
        assert_eq!(w.evicted(), 2);
        assert_eq!(w.check_and_insert(t(10), shard_key(1, 1, 0, 6)), fresh);
        assert_eq!(
            w.check_and_insert(t(10), shard_key(1, 1, 2, 1)),
            DedupVerdict::InProgress,
            "shard 2 has no floor"
        );
        assert_eq!(w.check_and_insert(t(10), shard_key(1, 1, 3, 1)), fresh);
        // A newer incarnation seen on one shard voids the old incarnation on every shard.
        assert_eq!(w.check_and_insert(t(11), shard_key(1, 2, 0, 1)), fresh);
        assert_eq!(w.len(), 1);
        assert_eq!(
            w.check_and_insert(t(11), shard_key(1, 1, 7, 100)),
            DedupVerdict::TooOld,
            "old incarnation, shard never seen"
        );
        assert_eq!(
            w.check_and_insert(t(11), shard_key(1, 2, 1, 5)),
            fresh,
            "floors restart with the incarnation"
        );
    }

    #[test]
    fn dedup_evicts_the_oldest_in_batches() {
        let mut w: DedupWindow<u32> = DedupWindow::new(64, Duration::from_secs(10));
        for r in 1..=64 {
            assert_eq!(w.check_and_insert(t(r), key(1, 1, r)), DedupVerdict::Fresh);
        }
        assert_eq!((w.len(), w.evicted()), (64, 0));
        assert!(w.complete(key(1, 1, 10), 10));
        // Full: the 65th evicts the 4 oldest (64 / 16) at once, and the next 3 find room.
        assert_eq!(
            w.check_and_insert(t(65), key(1, 1, 65)),
            DedupVerdict::Fresh
        );
        assert_eq!((w.len(), w.evicted()), (61, 4));
        for r in 66..=68 {
            assert_eq!(w.check_and_insert(t(r), key(1, 1, r)), DedupVerdict::Fresh);
        }
        assert_eq!((w.len(), w.evicted()), (64, 4));
        // The evicted are below the floor. A full window evicts before it looks (5 to 8 here),
        // so a copy of an entry of that batch is too old as well.
        for r in 1..=8 {
            assert_eq!(
                w.check_and_insert(t(70), key(1, 1, r)),
                DedupVerdict::TooOld
            );
        }
        assert_eq!(
            (w.len(), w.evicted()),
            (60, 8),
            "refused copies are not recorded"
        );
        assert_eq!(
            w.check_and_insert(t(70), key(1, 1, 10)),
            DedupVerdict::Done(&10)
        );
        assert_eq!(
            w.check_and_insert(t(70), key(1, 1, 11)),
            DedupVerdict::InProgress
        );
    }

    #[test]
    fn dedup_hasher_is_keyed() {
        use std::hash::BuildHasher;
        let a = DedupHasher::with_key(1, 2);
        let b = DedupHasher::with_key(3, 4);
        let k = key(7, 8, 9);
        assert_eq!(a.hash_one(k), DedupHasher::with_key(1, 2).hash_one(k));
        assert_ne!(a.hash_one(k), b.hash_one(k));
        // Every field counts, and neighbouring ids spread over the top and the low bits.
        assert_ne!(a.hash_one(k), a.hash_one(key(7, 8, 10)));
        assert_ne!(a.hash_one(k), a.hash_one(key(7, 9, 9)));
        assert_ne!(a.hash_one(k), a.hash_one(key(8, 8, 9)));
        assert_ne!(a.hash_one(k), a.hash_one(shard_key(7, 8, 1, 9)));
        let top: std::collections::HashSet<u64> =
            (0..256).map(|r| a.hash_one(key(7, 8, r)) >> 57).collect();
        let low: std::collections::HashSet<u64> =
            (0..256).map(|r| a.hash_one(key(7, 8, r)) & 127).collect();
        assert!(
            top.len() > 64 && low.len() > 64,
            "{} {}",
            top.len(),
            low.len()
        );
        assert_eq!(format!("{a:?}"), "DedupHasher", "the key is not printed");
    }

    #[test]
    fn credits_never_exceed_window() {
        let mut c = CreditWindow::new(100);
        assert_eq!(c.try_acquire(60), Ok(()));
        assert_eq!(
            c.try_acquire(50),
            Err(CreditError::Exhausted {
                wanted: 50,
                available: 40,
                window: 100
            })
        );
        assert_eq!(c.try_acquire(40), Ok(()));
        assert_eq!(c.available(), 0);
        assert_eq!(
            c.try_acquire(101),
            Err(CreditError::LargerThanWindow {
                wanted: 101,
                window: 100
            })
        );
        assert_eq!(c.release(60), Ok(()));
        assert_eq!(c.in_flight(), 40);
        assert!(matches!(
            c.release(41),
            Err(CreditError::OverRelease { .. })
        ));
        assert_eq!(c.in_flight(), 40);
        assert_eq!(c.high_water(), 100);
        assert_eq!(c.window(), 100);
    }
}
