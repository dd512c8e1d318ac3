//! Per-shard collective state: the mailbox where messages wait for the operation that takes
//! them, aborts, lost nodes, and the communicators this shard takes part in.
//!
//! It lives in the shard's extension slot and is reached from the frame handler (messages
//! from other nodes, inline on the progress driver), from mesh jobs (messages from this node's
//! other shards) and from the operations running on the shard. Everything here is
//! synchronous: an arriving message is stored and the operation waiting for its
//! (communicator, sequence number) is woken.

use std::cell::RefCell;
use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::ops::Deref;
use std::rc::Rc;
use std::task::Waker;

use shardcx_shards::net::{Incoming, Payload};
use shardcx_shards::proto::request::DedupHasher;
use shardcx_shards::proto::NodeId;
use shardcx_shards::{NetError, ShardCtx};

use super::deadline::Deadlines;
use super::error::AbortCause;
use super::wire::{Header, Kind, COLLECTIVE_AM};

/// Most bytes of messages one shard keeps waiting for their operation (arrived early, or for
/// a communicator not created here yet); messages over it are dropped and counted, and the
/// operation that needed them ends at its deadline.
pub const MAX_BUFFERED_BYTES: usize = 1 << 30;

/// Whole messages longer than this (the default rendezvous threshold,
/// `NetConfig::rndv_threshold`) are kept in the buffer they landed in; shorter ones (eager,
/// in UCX's descriptor or the shard's shared inline buffer, which must not be held) are copied.
const KEEP_IN_PLACE_OVER: usize = 8 << 10;

/// Most send buffers one shard keeps for reuse (each at most one part, `wire::SEGMENT`).
const SEND_BUFS: usize = 16;

/// Most bytes of send buffers one shard keeps for reuse.
const SEND_BUF_BYTES: usize = 16 << 20;

/// Counters of one shard's collective messages.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CollectiveStats {
    /// Messages (or parts) that arrived and were kept.
    pub arrived: u64,
    /// Messages dropped because their operation had already ended on this shard (or their
    /// communicator was dropped here).
    pub dropped_stale: u64,
    /// Messages dropped as malformed (bad header, parts that do not fit, a rank's messages from
    /// two nodes).
    pub dropped_malformed: u64,
    /// Messages dropped because [`MAX_BUFFERED_BYTES`] were already waiting.
    pub dropped_over_cap: u64,
    /// Aborts received from other ranks.
    pub aborts_received: u64,
    /// Messages sent from the operation's result vector itself, read by UCX where it is (the
    /// all-gather half of a two-rank all-reduce, for element types that
    /// [`share_wire`](super::Element::share_wire)), not copied into a buffer of their own.
    pub sent_in_place: u64,
    /// Bytes waiting now.
    pub buffered_bytes: u64,
}

/// One message being put together, or complete and waiting.
struct Slot {
    /// The node it came from (its rank must be on that node).
    node: NodeId,
    buf: Bytes,
    got: usize,
}

impl Slot {
    fn empty(node: NodeId, total: usize) -> Slot {
        Slot {
            node,
            buf: Bytes::Vec(vec![0; total]),
            got: 0,
        }
    }
}

/// A received message's bytes as they are kept: a vector (from another shard of this node,
/// or put together from parts), or the payload of one frame read where it landed (a
/// rendezvous buffer of the shard's pool or receive cache, which goes back there when this is
/// dropped: no copy and no fresh allocation per message).
pub(crate) enum Bytes {
    /// An owned vector.
    Vec(Vec<u8>),
    /// A frame's payload, in place.
    Payload(Payload),
    /// A whole message of at most [`INLINE`] bytes, held in the slot itself (an 8-byte
    /// all-reduce's: no allocation to make and free per message).
    Inline([u8; INLINE], u8),
}

/// Most bytes of a message kept in its slot ([`Bytes::Inline`]).
const INLINE: usize = 64;

impl Bytes {
    /// The bytes as a vector: moved when they are one, copied out of a payload otherwise.
    pub(crate) fn into_vec(self) -> Vec<u8> {
        match self {
            Bytes::Vec(v) => v,
            Bytes::Payload(p) => p.as_slice().to_vec(),
            Bytes::Inline(b, n) => b[..usize::from(n)].to_vec(),
        }
    }
}

impl Deref for Bytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Vec(v) => v,
            Bytes::Payload(p) => p.as_slice(),
            Bytes::Inline(b, n) => &b[..usize::from(*n)],
        }
    }
}

/// (communicator, sequence number, sending rank, step).
type Key = (u64, u64, u32, u32);

/// The state's tables: keyed from the network (other ranks' headers), so hashed with a key of
/// their own, by the shards' keyed fold hash (a few instructions a word, where std's SipHash
/// took 7 % of an 8-byte all-reduce).
type Map<K, V> = HashMap<K, V, DedupHasher>;

/// What this shard knows of a communicator id.
#[derive(Debug, Clone, Copy)]
enum CommEntry {
    /// Operations before `floor` have ended here; their messages are stale.
    Live { floor: u64 },
    /// Dropped here: every message for it is stale.
    Retired,
}

#[derive(Default)]
struct Inner {
    slots: Map<Key, Slot>,
    buffered: usize,
    comms: Map<u64, CommEntry>,
    aborts: Map<(u64, u64), (u32, AbortCause)>,
    /// Communicators revoked here: the first rank known to have failed, and why.
    revoked: Map<u64, (u32, AbortCause)>,
    /// Sends of an operation that failed after the operation went on (mesh sends are not
    /// awaited): the rank and why.
    failed_sends: Map<(u64, u64), (u32, String)>,
    waiters: Map<(u64, u64), Waker>,
    /// Nodes whose connection ended, with the epoch at which it did and why.
    lost: Map<NodeId, (u64, String)>,
    /// Reused send buffers ([`ShardState::take_send_buf`]); one held elsewhere too is still
    /// being sent.
    send_bufs: Vec<Rc<[u8]>>,
    /// Bumped at every loss.
    epoch: u64,
    /// The epoch at which this node began shutting down.
    shutting_down: Option<u64>,
    /// Worlds made on this shard per node list (by its hash): the next world's ordinal.
    worlds: Map<u64, u64>,
    stats: CollectiveStats,
}

/// A shard's collective state (see the module docs).
#[derive(Default)]
pub(crate) struct ShardState {
    inner: RefCell<Inner>,
    /// The deadlines of the operations waiting on this shard.
    pub(crate) deadlines: Rc<Deadlines>,
}

/// Where a failed wait comes from.
pub(crate) enum Blocked {
    /// Rank `by` aborted the operation.
    Aborted { by: u32, cause: AbortCause },
    /// The communicator is revoked: rank `by` failed an operation with `cause`.
    Revoked { by: u32, cause: AbortCause },
    /// A message of this operation to rank `to` could not be delivered.
    SendFailed { to: u32, why: String },
    /// The node of the awaited rank was lost after the operation began.
    Lost(String),
    /// This node is shutting down.
    ShuttingDown,
}

impl ShardState {
    /// Registers communicator `comm` on this shard; false when the id is already in use here.
    pub(crate) fn register(&self, comm: u64) -> bool {
        let mut s = self.inner.borrow_mut();
        if s.comms.contains_key(&comm) {
            return false;
        }
        s.comms.insert(comm, CommEntry::Live { floor: 0 });
        true
    }

    /// Communicator `comm` is dropped on this shard: its waiting messages go, later ones are
    /// dropped.
    pub(crate) fn retire(&self, comm: u64) {
        let mut s = self.inner.borrow_mut();
        s.comms.insert(comm, CommEntry::Retired);
        s.revoked.remove(&comm);
        s.purge(|c, _| c == comm);
    }

    /// The ordinal of the next world made from the node list hashing to `list`.
    pub(crate) fn next_world(&self, list: u64) -> u64 {
        let mut s = self.inner.borrow_mut();
        let n = s.worlds.entry(list).or_insert(0);
        let k = *n;
        *n += 1;
        k
    }

    /// Operation `seq` of `comm` begins: messages of earlier ones are stale from now on.
    /// Returns the loss epoch now (losses after it fail the operation's waits).
    pub(crate) fn begin(&self, comm: u64, seq: u64) -> u64 {
        let mut s = self.inner.borrow_mut();
        if let Some(CommEntry::Live { floor }) = s.comms.get_mut(&comm) {
            *floor = seq;
        }
        s.purge(|c, q| c == comm && q < seq);
        s.epoch
    }

    /// Operation `seq` of `comm` has ended here (done, failed or dropped).
    pub(crate) fn end(&self, comm: u64, seq: u64) {
        let mut s = self.inner.borrow_mut();
        if let Some(CommEntry::Live { floor }) = s.comms.get_mut(&comm) {
            *floor = (*floor).max(seq + 1);
        }
        s.purge(|c, q| c == comm && q <= seq);
        s.waiters.remove(&(comm, seq));
    }

    /// The complete message `key`, with the node it came from, if it is here.
    pub(crate) fn take(&self, key: Key) -> Option<(NodeId, Bytes)> {
        let mut s = self.inner.borrow_mut();
        let slot = match s.slots.entry(key) {
            Entry::Occupied(e) if e.get().got == e.get().buf.len() => e.remove(),
            _ => return None,
        };
        s.buffered -= slot.buf.len();
        Some((slot.node, slot.buf))
    }

    /// Why operation `(comm, seq)`, begun at loss epoch `since`, cannot get a message from a
    /// rank on `node`, if it cannot.
    pub(crate) fn blocked(&self, comm: u64, seq: u64, node: NodeId, since: u64) -> Option<Blocked> {
        let s = self.inner.borrow();
        if let Some(&(by, cause)) = s.aborts.get(&(comm, seq)) {
            return Some(Blocked::Aborted { by, cause });
        }
        if let Some(&(by, cause)) = s.revoked.get(&comm) {
            return Some(Blocked::Revoked { by, cause });
        }
        if let Some((to, why)) = s.failed_sends.get(&(comm, seq)) {
            return Some(Blocked::SendFailed {
                to: *to,
                why: why.clone(),
            });
        }
        if s.shutting_down.is_some_and(|e| e > since) {
            return Some(Blocked::ShuttingDown);
        }
        match s.lost.get(&node) {
            Some((e, why)) if *e > since => Some(Blocked::Lost(why.clone())),
            _ => None,
        }
    }

    /// Revokes communicator `comm` on this shard (rank `by` failed an operation with `cause`;
    /// the first revocation stays): every wait of its operations fails from now on.
    pub(crate) fn revoke(&self, comm: u64, by: u32, cause: AbortCause) {
        let waiters: Vec<Waker> = {
            let mut s = self.inner.borrow_mut();
            s.revoked.entry(comm).or_insert((by, cause));
            s.waiters
                .iter()
                .filter(|((c, _), _)| *c == comm)
                .map(|(_, w)| w.clone())
                .collect()
        };
        for w in waiters {
            w.wake();
        }
    }

    /// The loss epoch now: [`ShardState::lost_since`] with it tells the nodes lost from now on.
    pub(crate) fn epoch(&self) -> u64 {
        self.inner.borrow().epoch
    }

    /// Whether `node`'s connection ended after loss epoch `epoch`.
    pub(crate) fn lost_since(&self, node: NodeId, epoch: u64) -> bool {
        self.inner
            .borrow()
            .lost
            .get(&node)
            .is_some_and(|(e, _)| *e > epoch)
    }

    /// Whether communicator `comm` is revoked here: the rank that failed, and why.
    pub(crate) fn revoked(&self, comm: u64) -> Option<(u32, AbortCause)> {
        self.inner.borrow().revoked.get(&comm).copied()
    }

    /// Whether rank `by`'s abort of `(comm, seq)` is here.
    pub(crate) fn aborted(&self, comm: u64, seq: u64) -> Option<(u32, AbortCause)> {
        self.inner.borrow().aborts.get(&(comm, seq)).copied()
    }

    /// A message of operation `(comm, seq)` to rank `to` could not be delivered: its waits
    /// fail from now on.
    pub(crate) fn send_failed(&self, comm: u64, seq: u64, to: u32, why: String) {
        let waker = {
            let mut s = self.inner.borrow_mut();
            let live =
                matches!(s.comms.get(&comm), Some(CommEntry::Live { floor }) if seq >= *floor);
            if !live {
                return;
            }
            s.failed_sends.entry((comm, seq)).or_insert((to, why));
            s.waiters.get(&(comm, seq)).cloned()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// The operation `(comm, seq)` waits: `waker` is woken when a message or an abort for it
    /// arrives, or a node is lost.
    pub(crate) fn wait(&self, comm: u64, seq: u64, waker: &Waker) {
        let mut s = self.inner.borrow_mut();
        match s.waiters.get_mut(&(comm, seq)) {
            Some(w) if w.will_wake(waker) => {}
            Some(w) => w.clone_from(waker),
            None => {
                s.waiters.insert((comm, seq), waker.clone());
            }
        }
    }

    /// A message (or a part of one) from `node`: kept for its operation, or dropped and counted.
    /// `data` is taken when it is the whole message, copied otherwise.
    pub(crate) fn deliver(&self, node: NodeId, h: Header, data: Data<'_>) {
        if let Kind::Abort(cause) = h.kind {
            self.abort(h, cause);
            return;
        }
        {
            let mut s = self.inner.borrow_mut();
            if let Some(entry) = s.comms.get(&h.comm) {
                let stale = match entry {
                    CommEntry::Retired => true,
                    CommEntry::Live { floor } => h.seq < *floor,
                };
                if stale {
                    s.stats.dropped_stale += 1;
                    return;
                }
            }
            match h.kind {
                Kind::Abort(_) => {}
                Kind::Data => {
                    if !s.store(node, h, data) {
                        return;
                    }
                }
            }
            // Woken by reference, the state still borrowed: a glommio wake only queues the
            // task (no clone of the waker to make and drop per message).
            if let Some(w) = s.waiters.get(&(h.comm, h.seq)) {
                w.wake_by_ref();
            }
        }
    }

    /// Rank `h.src` ended operation `h.seq` with `cause`: that operation fails here (now, or
    /// when it starts), and the communicator is revoked, also when the operation has already
    /// ended here (its rank will not take part in the next ones).
    fn abort(&self, h: Header, cause: AbortCause) {
        {
            let mut s = self.inner.borrow_mut();
            let live = match s.comms.get(&h.comm) {
                Some(CommEntry::Retired) => {
                    s.stats.dropped_stale += 1;
                    return;
                }
                Some(CommEntry::Live { floor }) => h.seq >= *floor,
                None => true,
            };
            s.stats.aborts_received += 1;
            if live {
                s.aborts.entry((h.comm, h.seq)).or_insert((h.src, cause));
            }
        }
        self.revoke(h.comm, h.src, cause);
    }

    /// `node`'s connection ended (`None`: this node is shutting down): waits on ranks there
    /// fail.
    fn lost(&self, node: Option<NodeId>, err: &NetError) {
        let waiters: Vec<Waker> = {
            let mut s = self.inner.borrow_mut();
            s.epoch += 1;
            let epoch = s.epoch;
            match node {
                Some(n) => {
                    s.lost.insert(n, (epoch, err.to_string()));
                }
                None => s.shutting_down = Some(epoch),
            }
            s.waiters.values().cloned().collect()
        };
        for w in waiters {
            w.wake();
        }
    }

    /// A send buffer of exactly `len` bytes that nothing else holds: a reused one when one of
    /// that length is idle (its old bytes still in it), else a new one. Give it back with
    /// [`ShardState::keep_send_buf`] once it is handed to UCX.
    pub(crate) fn take_send_buf(&self, len: usize) -> Rc<[u8]> {
        let mut s = self.inner.borrow_mut();
        let idle = s
            .send_bufs
            .iter()
            .position(|b| b.len() == len && Rc::strong_count(b) == 1);
        match idle {
            Some(i) => s.send_bufs.swap_remove(i),
            None => std::iter::repeat_n(0u8, len).collect(),
        }
    }

    /// Keeps `buf` (possibly still being sent) for a later [`ShardState::take_send_buf`], within
    /// [`SEND_BUFS`] buffers and [`SEND_BUF_BYTES`] bytes: when they are full, `buf` takes the
    /// place of an idle one, or is let go (freed once UCX is done with it).
    pub(crate) fn keep_send_buf(&self, buf: Rc<[u8]>) {
        let mut s = self.inner.borrow_mut();
        let kept: usize = s.send_bufs.iter().map(|b| b.len()).sum();
        if s.send_bufs.len() < SEND_BUFS && kept + buf.len() <= SEND_BUF_BYTES {
            s.send_bufs.push(buf);
            return;
        }
        let idle = s
            .send_bufs
            .iter()
            .position(|b| Rc::strong_count(b) == 1 && kept - b.len() + buf.len() <= SEND_BUF_BYTES);
        if let Some(i) = idle {
            s.send_bufs[i] = buf;
        }
    }

    /// Counts a message sent from a vector in place ([`CollectiveStats::sent_in_place`]).
    pub(crate) fn count_sent_in_place(&self) {
        self.inner.borrow_mut().stats.sent_in_place += 1;
    }

    pub(crate) fn stats(&self) -> CollectiveStats {
        let s = self.inner.borrow();
        CollectiveStats {
            buffered_bytes: s.buffered as u64,
            ..s.stats
        }
    }
}

/// A message's data as it arrived.
pub(crate) enum Data<'a> {
    /// Read in place (a part of a message): copied into its slot.
    Borrowed(&'a [u8]),
    /// Owned (a message from another shard): moved if it is the whole message.
    Owned(Vec<u8>),
    /// A frame's payload (from another node): kept as it is if it is the whole message.
    Payload(Payload),
}

impl Data<'_> {
    fn len(&self) -> usize {
        self.as_slice().len()
    }

    fn as_slice(&self) -> &[u8] {
        match self {
            Data::Borrowed(b) => b,
            Data::Owned(v) => v,
            Data::Payload(p) => p.as_slice(),
        }
    }
}

impl Inner {
    /// Drops waiting messages and aborts of the operations `keep_out(comm, seq)` names.
    fn purge(&mut self, gone: impl Fn(u64, u64) -> bool) {
        let mut freed = 0;
        self.slots.retain(|&(c, q, _, _), slot| {
            let drop = gone(c, q);
            if drop {
                freed += slot.buf.len();
            }
            !drop
        });
        self.buffered -= freed;
        self.aborts.retain(|&(c, q), _| !gone(c, q));
        self.failed_sends.retain(|&(c, q), _| !gone(c, q));
    }

    /// Stores a data part; whether it completed a message.
    fn store(&mut self, node: NodeId, h: Header, data: Data<'_>) -> bool {
        let key = (h.comm, h.seq, h.src, h.step);
        let len = data.len();
        let (Ok(total), Ok(offset)) = (usize::try_from(h.total), usize::try_from(h.offset)) else {
            self.stats.dropped_malformed += 1;
            return false;
        };
        if offset.checked_add(len).is_none_or(|end| end > total) {
            self.stats.dropped_malformed += 1;
            return false;
        }
        // One look at the table for a message that arrives whole (the usual case).
        let over_cap = self.buffered.saturating_add(total) > MAX_BUFFERED_BYTES;
        if let Entry::Vacant(vacant) = self.slots.entry(key) {
            if over_cap {
                self.stats.dropped_over_cap += 1;
                return false;
            }
            self.buffered += total;
            if len == total {
                // The whole message: moved in (a vector), kept where it landed (a payload),
                // or copied once (one read in place: into the slot itself when short).
                let buf = match data {
                    Data::Owned(v) => Bytes::Vec(v),
                    Data::Payload(p) => Bytes::Payload(p),
                    Data::Borrowed(b) if len <= INLINE => {
                        let mut inline = [0u8; INLINE];
                        inline[..len].copy_from_slice(b);
                        // `len <= INLINE` (64) fits a byte.
                        Bytes::Inline(inline, len as u8)
                    }
                    Data::Borrowed(b) => Bytes::Vec(b.to_vec()),
                };
                vacant.insert(Slot {
                    node,
                    buf,
                    got: total,
                });
                self.stats.arrived += 1;
                return true;
            }
            vacant.insert(Slot::empty(node, total));
        }
        self.copy_part(key, node, total, offset, data.as_slice())
    }

    /// Copies a part into its slot; whether it completed the message.
    fn copy_part(
        &mut self,
        key: Key,
        node: NodeId,
        total: usize,
        offset: usize,
        part: &[u8],
    ) -> bool {
        let len = part.len();
        let Some(slot) = self.slots.get_mut(&key) else {
            return false;
        };
        let Bytes::Vec(buf) = &mut slot.buf else {
            // A whole message is here already: this part is one too many.
            self.stats.dropped_malformed += 1;
            return false;
        };
        if slot.node != node || buf.len() != total || slot.got + len > total {
            self.stats.dropped_malformed += 1;
            return false;
        }
        buf[offset..offset + len].copy_from_slice(part);
        slot.got += len;
        self.stats.arrived += 1;
        slot.got == total
    }
}

/// This shard's collective state.
pub(crate) fn of(ctx: &ShardCtx) -> Rc<ShardState> {
    ctx.ext_or_insert_with(ShardState::default)
}

/// Installs the collective message handler and the loss hook on a shard (from the node's
/// start hook, before the shard serves).
pub(crate) fn install(ctx: &Rc<ShardCtx>) {
    let st = of(ctx);
    let weak = Rc::downgrade(&st);
    ctx.on_peer_lost(move |node, err| {
        if let Some(st) = weak.upgrade() {
            st.lost(node, err);
        }
    });
    let weak = Rc::downgrade(&st);
    ctx.set_frame_either_handler_am(COLLECTIVE_AM, move |_ctx, frame: Incoming<'_>| {
        let Some(st) = weak.upgrade() else { return };
        let user = match &frame {
            Incoming::Lent(v) => v.user_header(),
            Incoming::Owned(f) => f.user_header(),
        };
        let Some(h) = Header::decode(user) else {
            st.inner.borrow_mut().stats.dropped_malformed += 1;
            return;
        };
        match frame {
            // Read where UCX received it (a short message): copied into its slot.
            Incoming::Lent(v) => st.deliver(v.node(), h, Data::Borrowed(v.payload())),
            Incoming::Owned(frame) => {
                let node = frame.node();
                let len = frame.payload().len();
                if h.offset == 0 && len as u64 == h.total && len > KEEP_IN_PLACE_OVER {
                    // The whole message, by rendezvous: kept where it landed (a buffer of the
                    // shard's pool or receive cache), read in place by the operation and
                    // given back when it is done with it.
                    st.deliver(node, h, Data::Payload(frame.into_payload()));
                } else if h.offset == 0 && len as u64 == h.total && len > INLINE {
                    // A short whole message: copied once out of UCX's descriptor, which is
                    // released at once; one of at most `INLINE` bytes is copied into its slot.
                    st.deliver(node, h, Data::Owned(frame.into_vec()));
                } else {
                    st.deliver(node, h, Data::Borrowed(frame.payload()));
                }
            }
        }
    });
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;

    #[test]
    fn send_buffers_are_reused_once_idle_and_kept_within_their_limits() {
        let st = ShardState::default();
        let a = st.take_send_buf(100);
        let pa = a.as_ptr();
        // Still held elsewhere (UCX sending it): a new one.
        let in_flight = a.clone();
        st.keep_send_buf(a);
        let b = st.take_send_buf(100);
        assert_ne!(b.as_ptr(), pa);
        st.keep_send_buf(b);
        // Let go: the first comes back, for its exact length only.
        drop(in_flight);
        assert_ne!(st.take_send_buf(99).as_ptr(), pa);
        let again = st.take_send_buf(100);
        assert_eq!(again.as_ptr(), pa);
        st.keep_send_buf(again);
        // Past the byte limit: an idle one makes room, a buffer that does not fit is let go.
        let big = st.take_send_buf(SEND_BUF_BYTES);
        st.keep_send_buf(big);
        let kept = |st: &ShardState| -> usize {
            st.inner.borrow().send_bufs.iter().map(|b| b.len()).sum()
        };
        assert!(kept(&st) <= SEND_BUF_BYTES, "{}", kept(&st));
        // All in flight: nothing idle to replace, the limits hold.
        let mut held = Vec::new();
        for _ in 0..2 * SEND_BUFS {
            let b = st.take_send_buf(1 << 20);
            held.push(b.clone());
            st.keep_send_buf(b);
        }
        let s = st.inner.borrow();
        assert!(s.send_bufs.len() <= SEND_BUFS);
        assert!(s.send_bufs.iter().map(|b| b.len()).sum::<usize>() <= SEND_BUF_BYTES);
    }
}
