//! Tag send/recv between nodes: ucx-py-style, per remote node, matched on the receiving shard.
//!
//! ## The model
//!
//! A tag message is a 64-bit [`Tag`] (proto's layout: kind 4 bits | source shard 12 bits | user
//! 48 bits) and a byte payload, sent to one connected node with [`ShardCtx::tag_send`] and
//! received from one node with [`ShardCtx::tag_recv`] (or [`ShardCtx::tag_recv_into`], which
//! lends a buffer). The runtime sets the kind ([`TagKind::User`]) and the source shard (the
//! shard that calls `tag_send`); the application chooses the user bits.
//!
//! ## On the wire
//!
//! A tag message is one application frame of the node pair's connection, an active message
//! with the reserved id [`TAG_AM`] (from the runtime's reserved range: **application AM ids must
//! stay below [`FIRST_RESERVED_AM_ID`]** = `0xFFFF_0000`). The frame header's `req_id` holds the
//! raw tag, and the payload is the application's bytes followed by the raw tag again, 8 bytes
//! little-endian ([`TAG_TRAILER_LEN`]): an eager frame's handler sees only the payload, a
//! rendezvous frame's buffer choice only the header, and both need the tag. So the frame is
//! subject to the connection's limits with those 8 bytes included
//! ([`crate::NetConfig::max_message_size`]); payloads over
//! [`crate::NetConfig::rndv_threshold`] go by rendezvous.
//!
//! ## Matching
//!
//! A tag message travels on a rail (see [`crate::net`]): from the sending shard, on its default
//! rail to the node (to the shard of it with the same index when the shard counts match) or on
//! its rail to the shard named with [`crate::net::Dest::shard`]. Each shard matches the
//! messages that arrive on its own rails, against the receives posted on it: a receive posted
//! on shard `i` for node `P` takes what `P`'s shards sent to shard `i`, with no hop. Per
//! remote node and receiving shard:
//!
//! - a receive for `P` with `(pattern, mask)` matches only messages from `P` (the connection's
//!   authenticated sender), whose tag satisfies `(tag ^ pattern) & mask == 0`;
//! - matching follows arrival order: a message arriving goes to the first posted receive (in
//!   posting order) that matches; a receive being posted takes the earliest queued message
//!   that matches. Messages with one tag from one sending shard are therefore received in the
//!   order they were sent (each `tag_send` returns once its frame is queued in order);
//! - a message that no posted receive matches waits in `P`'s *unexpected queue*, bounded by
//!   [`TagConfig::max_unexpected_bytes`] and [`TagConfig::max_unexpected_count`]. A message
//!   that would exceed either is dropped and counted ([`TagStats::dropped_unexpected`]); memory
//!   never grows without bound;
//! - a receive posted for a node whose connection then ends fails at once with the
//!   connection's error ([`NetError::PeerDead`], [`NetError::Transport`], [`NetError::Closed`];
//!   [`NetError::ShuttingDown`] when this node stops), after every frame that arrived before
//!   the end has been matched. So does a receive posted later that finds no queued message,
//!   until the node connects again. A receive for a node that has never been connected waits
//!   (the peer may be about to connect) until a message or its deadline;
//! - a receive ends at its deadline with [`NetError::TimedOut`] (`"tag receive"`). A receive
//!   that times out or is dropped is taken off the posted list, so it never swallows a later
//!   message; one that had been matched but not yet handed over gives its message back to the
//!   unexpected queue, in its place by arrival.
//!
//! ## Large messages
//!
//! Rendezvous frames are matched when their header arrives, before any data moves, through
//! [`ShardCtx::set_net_handler_rndv`]: when a posted receive matches, the data is pulled straight
//! into that receive's buffer (the one lent to [`ShardCtx::tag_recv_into`], grown only if it is
//! shorter than the message plus [`TAG_TRAILER_LEN`], or else a vector of exactly that size that
//! becomes the result), and no copy follows. Otherwise a vector is reserved in the unexpected
//! queue at the message's place and the data pulled into it. Eager messages are copied (out of
//! UCX's buffer; and into a lent buffer).
//!
//! ## Installing
//!
//! [`install`] registers the tag handlers on a shard and must run on every shard before it
//! serves frames: call it from [`crate::ShardsBuilder::on_start`] (the facade does). It is
//! idempotent. A shard that calls a tag function without it installs itself then, but a frame
//! that reached it before is dropped ([`crate::NetStats::dropped_no_handler`]).
//!
//! ## Limits (what is not here yet)
//!
//! - When a rendezvous pull fails and several messages with the same tag from the same node are
//!   being pulled, the failure is charged to the oldest of them (the net layer reports the
//!   failure without the buffer that identifies it). On a connection that works, pulls do not
//!   fail.
//! - The unexpected queue of a node that has gone away is kept until its messages are received
//!   (it is bounded by the caps above).
//! - No flow control: a sender whose messages are dropped for the cap is not told.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::future::poll_fn;
use std::rc::Rc;
use std::task::{Poll, Waker};
use std::time::Duration;

use futures_lite::future;
use glommio::timer::sleep;

use crate::boot::ShardCtx;
use crate::error::NetError;
use crate::net::Dest;
use crate::proto::{AmId, FrameHeader, FrameKind, NodeId, ReqId, Tag, TagKind, TagMask};

/// First active-message id of the range the runtime reserves for itself; application ids must
/// stay below it.
pub const FIRST_RESERVED_AM_ID: u32 = 0xFFFF_0000;
/// The active-message id of tag messages (in the reserved range).
pub const TAG_AM: AmId = AmId::new(FIRST_RESERVED_AM_ID);
/// Bytes after the application's payload in a tag frame: the raw tag, little-endian.
pub const TAG_TRAILER_LEN: usize = 8;
/// Longest a tag receive may wait (longer timeouts are cut to this).
pub const MAX_RECV_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

/// Bounds of each remote node's unexpected queue on its owner shard. `Send`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TagConfig {
    /// Most payload bytes queued per remote node, default 64 MiB.
    pub max_unexpected_bytes: usize,
    /// Most messages queued per remote node, default 4096.
    pub max_unexpected_count: usize,
}

/// Counters of one shard's tag matching (for the nodes it owns), and its queues now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TagStats {
    /// Messages received (eager or rendezvous headers), whatever became of them.
    pub arrived: u64,
    /// Messages that found a posted receive on arrival.
    pub matched_on_arrival: u64,
    /// Rendezvous messages pulled straight into a posted receive's buffer.
    pub rndv_into_receive: u64,
    /// Messages dropped because the sender's unexpected queue was full (count or bytes).
    pub dropped_unexpected: u64,
    /// Payload bytes of those.
    pub dropped_unexpected_bytes: u64,
    /// Frames dropped as malformed (too short for the trailer, or not a user tag).
    pub malformed: u64,
    /// Rendezvous pulls that failed.
    pub pull_failed: u64,
    /// Posted receives failed because their node's connection ended (or the node shut down).
    pub failed_on_loss: u64,
    /// Messages now waiting in unexpected queues of this shard.
    pub unexpected_now: u64,
    /// Payload bytes now waiting in them.
    pub unexpected_bytes_now: u64,
    /// Receives now posted on this shard.
    pub posted_now: u64,
}

/// What a receive resolves with.
type Outcome = Result<(Tag, Vec<u8>), NetError>;
/// A lent buffer that did not receive the data.
type Spare = Option<Vec<u8>>;

/// Where a matched message's outcome goes: its receive waits on it.
struct Slot {
    /// The message's place in arrival order (per shard).
    seq: u64,
    tag: Tag,
    /// Its payload length (without the trailer).
    len: usize,
    outcome: RefCell<Option<Outcome>>,
    /// A buffer lent by the receive that was not used for the data (eager arrival).
    spare: RefCell<Option<Vec<u8>>>,
    waker: RefCell<Option<Waker>>,
}

/// A receive waiting for a message.
struct Posted {
    id: u64,
    pattern: Tag,
    mask: TagMask,
    buf: Option<Vec<u8>>,
    /// Filled with the slot of the message that matched.
    matched: Rc<RefCell<Option<Rc<Slot>>>>,
    waker: Rc<RefCell<Option<Waker>>>,
}

/// A message no receive has taken yet (its data may still be on its way).
struct Unexpected {
    slot: Rc<Slot>,
}

/// A remote node's matching state.
#[derive(Default)]
struct PeerTags {
    posted: VecDeque<Posted>,
    unexpected: VecDeque<Unexpected>,
    unexpected_bytes: usize,
}

/// A rendezvous pull in flight.
struct InFlight {
    node: NodeId,
    /// The address of the buffer the data goes to.
    key: usize,
    slot: Rc<Slot>,
}

/// One shard's tag state, in the shard's extension slot ([`ShardCtx::ext`]); the handlers
/// [`install`] registers hold it too.
struct TagState {
    cfg: Cell<TagConfig>,
    peers: RefCell<HashMap<NodeId, PeerTags>>,
    inflight: RefCell<Vec<InFlight>>,
    next_id: Cell<u64>,
    next_seq: Cell<u64>,
    stats: Cell<TagStats>,
    /// Nodes whose connection ended, with its error, until they connect again.
    gone: RefCell<HashMap<NodeId, NetError>>,
    /// The shard is shutting down: receives fail at once.
    shut: Cell<bool>,
}

impl Default for TagConfig {
    fn default() -> Self {
        Self {
            max_unexpected_bytes: 64 << 20,
            max_unexpected_count: 4096,
        }
    }
}

impl Slot {
    fn new(seq: u64, tag: Tag, len: usize) -> Rc<Self> {
        Rc::new(Self {
            seq,
            tag,
            len,
            outcome: RefCell::new(None),
            spare: RefCell::new(None),
            waker: RefCell::new(None),
        })
    }

    fn fill(&self, outcome: Outcome) {
        *self.outcome.borrow_mut() = Some(outcome);
        let w = self.waker.borrow_mut().take();
        if let Some(w) = w {
            w.wake();
        }
    }
}

impl PeerTags {
    /// Inserts `slot` in the unexpected queue at its place by arrival.
    fn insert_unexpected(&mut self, slot: Rc<Slot>) {
        let at = self
            .unexpected
            .iter()
            .position(|u| u.slot.seq > slot.seq)
            .unwrap_or(self.unexpected.len());
        self.unexpected_bytes += slot.len;
        self.unexpected.insert(at, Unexpected { slot });
    }

    /// Takes the earliest queued message matching `(pattern, mask)`.
    fn claim_unexpected(&mut self, pattern: Tag, mask: TagMask) -> Option<Rc<Slot>> {
        let at = self
            .unexpected
            .iter()
            .position(|u| u.slot.tag.matches(pattern, mask))?;
        let u = self.unexpected.remove(at)?;
        self.unexpected_bytes -= u.slot.len;
        Some(u.slot)
    }

    /// Takes the first posted receive matching `tag`, dropping cancelled ones on the way.
    fn claim_posted(&mut self, tag: Tag) -> Option<Posted> {
        let at = self
            .posted
            .iter()
            .position(|p| tag.matches(p.pattern, p.mask))?;
        self.posted.remove(at)
    }

    fn is_empty(&self) -> bool {
        self.posted.is_empty() && self.unexpected.is_empty()
    }
}

impl TagState {
    fn new(cfg: TagConfig) -> Self {
        Self {
            cfg: Cell::new(cfg),
            peers: RefCell::new(HashMap::new()),
            inflight: RefCell::new(Vec::new()),
            next_id: Cell::new(1),
            next_seq: Cell::new(0),
            stats: Cell::new(TagStats::default()),
            gone: RefCell::new(HashMap::new()),
            shut: Cell::new(false),
        }
    }

    fn count(&self, f: impl FnOnce(&mut TagStats)) {
        let mut s = self.stats.get();
        f(&mut s);
        self.stats.set(s);
    }

    fn seq(&self) -> u64 {
        let s = self.next_seq.get();
        self.next_seq.set(s + 1);
        s
    }

    /// Whether `node`'s unexpected queue has room for `len` more bytes; counts a drop if not.
    fn room_for(&self, peer: &PeerTags, len: usize) -> bool {
        let cfg = self.cfg.get();
        let fits = peer.unexpected.len() < cfg.max_unexpected_count
            && peer.unexpected_bytes.saturating_add(len) <= cfg.max_unexpected_bytes;
        if !fits {
            self.count(|s| {
                s.dropped_unexpected += 1;
                s.dropped_unexpected_bytes += len as u64;
            });
        }
        fits
    }

    /// An eager message from `node`: payload then trailer.
    fn on_eager(&self, node: NodeId, mut payload: Vec<u8>) {
        self.count(|s| s.arrived += 1);
        let Some(tag) = split_trailer(&mut payload) else {
            self.count(|s| s.malformed += 1);
            return;
        };
        let slot = Slot::new(self.seq(), tag, payload.len());
        let mut peers = self.peers.borrow_mut();
        let peer = peers.entry(node).or_default();
        if let Some(mut p) = peer.claim_posted(tag) {
            self.count(|s| s.matched_on_arrival += 1);
            *slot.spare.borrow_mut() = p.buf.take();
            slot.fill(Ok((tag, payload)));
            hand_over(&p, slot);
        } else if self.room_for(peer, slot.len) {
            slot.fill(Ok((tag, payload)));
            peer.insert_unexpected(slot);
        } else if peer.is_empty() {
            peers.remove(&node);
        }
    }

    /// A rendezvous header from `node`: picks the buffer for its data, or declines it.
    fn on_rndv_header(&self, node: NodeId, header: &FrameHeader) -> Option<Vec<u8>> {
        self.count(|s| s.arrived += 1);
        let total = usize::try_from(header.payload_len).ok();
        let tag = Tag::parse(header.req_id.get())
            .ok()
            .filter(|t| t.kind() == TagKind::User);
        let (Some(total), Some(tag)) = (total, tag) else {
            self.count(|s| s.malformed += 1);
            return None;
        };
        let Some(len) = total.checked_sub(TAG_TRAILER_LEN) else {
            self.count(|s| s.malformed += 1);
            return None;
        };
        let slot = Slot::new(self.seq(), tag, len);
        let mut peers = self.peers.borrow_mut();
        let peer = peers.entry(node).or_default();
        let buf = if let Some(mut p) = peer.claim_posted(tag) {
            self.count(|s| {
                s.matched_on_arrival += 1;
                s.rndv_into_receive += 1;
            });
            let mut buf = p.buf.take().unwrap_or_default();
            buf.clear();
            buf.resize(total, 0);
            hand_over(&p, slot.clone());
            buf
        } else if self.room_for(peer, len) {
            peer.insert_unexpected(slot.clone());
            vec![0u8; total]
        } else {
            if peer.is_empty() {
                peers.remove(&node);
            }
            return None;
        };
        self.inflight.borrow_mut().push(InFlight {
            node,
            key: buf.as_ptr() as usize,
            slot,
        });
        Some(buf)
    }

    /// The end of a rendezvous pull from `node` (see the module docs for failures).
    fn on_rndv_data(&self, node: NodeId, header: &FrameHeader, res: Result<Vec<u8>, NetError>) {
        let tag = header.req_id.get();
        let mut inflight = self.inflight.borrow_mut();
        let by_key = res
            .as_ref()
            .ok()
            .and_then(|b| {
                let key = b.as_ptr() as usize;
                inflight.iter().position(|f| f.node == node && f.key == key)
            })
            .or_else(|| {
                inflight
                    .iter()
                    .position(|f| f.node == node && f.slot.tag.raw() == tag)
            });
        let Some(at) = by_key else { return };
        let f = inflight.remove(at);
        drop(inflight);
        match res {
            Ok(mut buf) => {
                buf.truncate(f.slot.len);
                f.slot.fill(Ok((f.slot.tag, buf)));
            }
            Err(e) => {
                self.count(|s| s.pull_failed += 1);
                // Still queued: forget it. Claimed by a receive: that receive fails.
                let mut peers = self.peers.borrow_mut();
                let queued = peers.get_mut(&node).and_then(|p| {
                    let at = p
                        .unexpected
                        .iter()
                        .position(|u| Rc::ptr_eq(&u.slot, &f.slot))?;
                    p.unexpected.remove(at);
                    p.unexpected_bytes -= f.slot.len;
                    Some(())
                });
                if queued.is_none() {
                    f.slot.fill(Err(e));
                }
            }
        }
    }

    /// The connection to `node` ended (`None`: every node, at shut-down): its posted
    /// receives fail with `err`. Messages already queued stay receivable; receives already
    /// matched (rendezvous data on its way) end with their pull.
    fn on_peer_lost(&self, node: Option<NodeId>, err: &NetError) {
        match node {
            Some(node) => {
                self.gone.borrow_mut().insert(node, err.clone());
            }
            None => self.shut.set(true),
        }
        let mut failed = Vec::new();
        {
            let mut peers = self.peers.borrow_mut();
            for (n, peer) in peers.iter_mut() {
                if node.is_none_or(|node| *n == node) {
                    failed.extend(peer.posted.drain(..));
                }
            }
            peers.retain(|_, p| !p.is_empty());
        }
        for p in failed {
            self.count(|s| s.failed_on_loss += 1);
            let slot = Slot::new(self.seq(), p.pattern, 0);
            slot.fill(Err(err.clone()));
            hand_over(&p, slot);
        }
    }

    fn snapshot(&self) -> TagStats {
        let mut s = self.stats.get();
        let peers = self.peers.borrow();
        s.unexpected_now = peers.values().map(|p| p.unexpected.len() as u64).sum();
        s.unexpected_bytes_now = peers.values().map(|p| p.unexpected_bytes as u64).sum();
        s.posted_now = peers.values().map(|p| p.posted.len() as u64).sum();
        s
    }
}

/// Gives `slot` to the posted receive `p` that matched it.
fn hand_over(p: &Posted, slot: Rc<Slot>) {
    *p.matched.borrow_mut() = Some(slot);
    let w = p.waker.borrow_mut().take();
    if let Some(w) = w {
        w.wake();
    }
}

/// Splits the tag trailer off an eager payload; `None` if it is missing or not a user tag.
fn split_trailer(payload: &mut Vec<u8>) -> Option<Tag> {
    let at = payload.len().checked_sub(TAG_TRAILER_LEN)?;
    let raw: [u8; TAG_TRAILER_LEN] = payload.get(at..)?.try_into().ok()?;
    let tag = Tag::parse(u64::from_le_bytes(raw))
        .ok()
        .filter(|t| t.kind() == TagKind::User)?;
    payload.truncate(at);
    Some(tag)
}

/// Registers the tag handlers on this shard with the default [`TagConfig`]: run it on every
/// shard before it serves (from [`crate::ShardsBuilder::on_start`]). Idempotent.
pub fn install(ctx: &Rc<ShardCtx>) {
    install_with(ctx, TagConfig::default());
}

/// [`install`] with bounds of its own (on an installed shard, only the bounds change).
pub fn install_with(ctx: &Rc<ShardCtx>, cfg: TagConfig) {
    if let Some(st) = ctx.ext::<TagState>() {
        st.cfg.set(cfg);
        return;
    }
    let st = ctx.ext_or_insert_with(|| TagState::new(cfg));
    // Each handler keeps the state at hand (no lookup per message), weakly: the handlers live
    // as long as the shard's net state, the queued messages only until the shard's teardown.
    let eager = Rc::downgrade(&st);
    ctx.set_net_handler(TAG_AM, move |_ctx, node, payload| {
        if let Some(st) = eager.upgrade() {
            st.on_eager(node, payload);
        }
    });
    let lost = Rc::downgrade(&st);
    ctx.on_peer_lost(move |node, err| {
        if let Some(st) = lost.upgrade() {
            st.on_peer_lost(node, err);
        }
    });
    let (choose, done) = (Rc::downgrade(&st), Rc::downgrade(&st));
    ctx.set_net_handler_rndv::<Vec<u8>, _, _>(
        TAG_AM,
        move |_ctx, node, header| choose.upgrade()?.on_rndv_header(node, header),
        move |_ctx, node, header, res| {
            if let Some(st) = done.upgrade() {
                st.on_rndv_data(node, header, res);
            }
        },
    );
}

/// This shard's tag state, installing it now if needed.
fn state(ctx: &Rc<ShardCtx>) -> Rc<TagState> {
    if let Some(st) = ctx.ext::<TagState>() {
        return st;
    }
    install(ctx);
    // `install` has just put it in the slot (unless the shard is torn down: then a state of
    // its own, which nothing will ever match).
    ctx.ext_or_insert_with(|| TagState::new(TagConfig::default()))
}

/// On the owner shard: a receive from the moment it is posted until it ends or is dropped.
struct Receive {
    st: Rc<TagState>,
    node: NodeId,
    id: u64,
    matched: Rc<RefCell<Option<Rc<Slot>>>>,
    done: bool,
}

impl Drop for Receive {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut peers = self.st.peers.borrow_mut();
        let Some(peer) = peers.get_mut(&self.node) else {
            return;
        };
        if let Some(at) = peer.posted.iter().position(|p| p.id == self.id) {
            peer.posted.remove(at);
        } else if let Some(slot) = self.matched.borrow_mut().take() {
            // Matched but not handed over: back to the queue, at its place.
            let failed = matches!(&*slot.outcome.borrow(), Some(Err(_)));
            if !failed {
                peer.insert_unexpected(slot);
            }
        }
        if peer.is_empty() {
            peers.remove(&self.node);
        }
    }
}

/// Waits for a filled slot.
async fn wait_slot(slot: &Slot) -> Outcome {
    poll_fn(|cx| {
        if let Some(o) = slot.outcome.borrow_mut().take() {
            return Poll::Ready(o);
        }
        *slot.waker.borrow_mut() = Some(cx.waker().clone());
        Poll::Pending
    })
    .await
}

/// A receive posted on this shard for messages from `node`.
async fn recv_local(
    ctx: &Rc<ShardCtx>,
    node: NodeId,
    (pattern, mask): (Tag, TagMask),
    buf: Option<Vec<u8>>,
    timeout: Duration,
) -> Outcome {
    let st = state(ctx);
    let timeout = timeout.min(MAX_RECV_TIMEOUT);
    let claimed = st
        .peers
        .borrow_mut()
        .get_mut(&node)
        .and_then(|p| p.claim_unexpected(pattern, mask));
    let id = st.next_id.get();
    st.next_id.set(id + 1);
    let matched = Rc::new(RefCell::new(claimed));
    let waker = Rc::new(RefCell::new(None::<Waker>));
    let lent = buf.is_some();
    let mut buf = buf;
    let mut rx = Receive {
        st: st.clone(),
        node,
        id,
        matched: matched.clone(),
        done: false,
    };
    if matched.borrow().is_none() {
        // Nothing queued: a node that has left (and not come back) sends nothing more.
        if st.shut.get() {
            return Err(NetError::ShuttingDown);
        }
        let gone = st.gone.borrow().get(&node).cloned();
        if let Some(err) = gone {
            if !ctx.is_connected(node) {
                return Err(err);
            }
            st.gone.borrow_mut().remove(&node);
        }
        st.peers
            .borrow_mut()
            .entry(node)
            .or_default()
            .posted
            .push_back(Posted {
                id,
                pattern,
                mask,
                buf: buf.take(),
                matched: matched.clone(),
                waker: waker.clone(),
            });
    }
    enum Got {
        /// The tag, the data, and the lent buffer if the data is not in it.
        Done(Result<(Tag, Vec<u8>, Spare), NetError>),
        TimedOut,
    }
    let got = future::or(
        async {
            // First the match, then (for rendezvous) the data.
            let slot = poll_fn(|cx| {
                if let Some(s) = matched.borrow().clone() {
                    return Poll::Ready(s);
                }
                *waker.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            })
            .await;
            let out = wait_slot(&slot).await;
            let spare = slot.spare.borrow_mut().take();
            Got::Done(out.map(|(tag, data)| (tag, data, spare)))
        },
        async {
            sleep(timeout).await;
            Got::TimedOut
        },
    )
    .await;
    let out = match got {
        Got::Done(o) => o,
        Got::TimedOut => {
            return Err(NetError::TimedOut {
                what: "tag receive",
            })
        }
    };
    rx.done = true;
    drop(rx);
    let (tag, data, spare) = out?;
    // A lent buffer that did not receive the data (it is `data` when it did): copy it in.
    match buf.or(spare).filter(|_| lent) {
        Some(mut b) => {
            b.clear();
            b.extend_from_slice(&data);
            Ok((tag, b))
        }
        None => Ok((tag, data)),
    }
}

impl ShardCtx {
    /// Sends `data` with `tag` to `dest`: on this shard's default rail to the node, or on the
    /// rail to the named shard (forwarded to the local shard that holds it when that is
    /// another). Resolves once the frame is with UCX or queued on the rail, in order with this
    /// shard's other frames on it.
    ///
    /// The tag's kind and source shard are set here ([`TagKind::User`], this shard); only its
    /// user bits are taken from `tag`. The tag is appended to `data` ([`TAG_TRAILER_LEN`]
    /// bytes): give `data` that much spare capacity to spare a reallocation. Errors as for
    /// [`ShardCtx::send_am`] ([`NetError::NotConnected`], [`NetError::TooLarge`] counting the
    /// trailer, [`NetError::Forward`]).
    pub async fn tag_send(
        self: &Rc<Self>,
        dest: impl Into<Dest>,
        tag: Tag,
        mut data: Vec<u8>,
    ) -> Result<(), NetError> {
        let tag = Tag::new(TagKind::User, self.id(), tag.user())
            .map_err(|source| NetError::Wire { source })?;
        data.extend_from_slice(&tag.raw().to_le_bytes());
        self.send_frame(
            dest,
            FrameKind::Am,
            TAG_AM.get(),
            ReqId::new(tag.raw()),
            data,
        )
        .await
    }

    /// Receives from `node` the earliest message whose tag matches `pattern` under `mask`
    /// (`(tag ^ pattern) & mask == 0`) among those that arrive on this shard's rails (see the
    /// module docs). Resolves with the message's tag and payload, or
    /// [`NetError::TimedOut`] (`"tag receive"`) after `timeout` (at most
    /// [`MAX_RECV_TIMEOUT`]); a receive that times out or is dropped never takes a later
    /// message. Other errors: [`NetError::Receive`] when a rendezvous pull of the matched
    /// message failed, [`NetError::Forward`].
    pub async fn tag_recv(
        self: &Rc<Self>,
        node: NodeId,
        pattern: Tag,
        mask: TagMask,
        timeout: Duration,
    ) -> Result<(Tag, Vec<u8>), NetError> {
        recv_local(self, node, (pattern, mask), None, timeout).await
    }

    /// [`ShardCtx::tag_recv`] into a lent buffer: the result's vector is `buf`, cleared and
    /// holding the payload. A message that comes by rendezvous to this receive while it is
    /// posted is pulled straight into `buf` (with the tag trailer: give it a capacity of the
    /// payload plus [`TAG_TRAILER_LEN`] to spare a reallocation); other messages are copied
    /// into it.
    pub async fn tag_recv_into(
        self: &Rc<Self>,
        node: NodeId,
        pattern: Tag,
        mask: TagMask,
        buf: Vec<u8>,
        timeout: Duration,
    ) -> Result<(Tag, Vec<u8>), NetError> {
        recv_local(self, node, (pattern, mask), Some(buf), timeout).await
    }

    /// This shard's tag counters and queue sizes (for the messages that arrive on its rails).
    pub fn tag_stats(&self) -> TagStats {
        self.ext::<TagState>()
            .map(|st| st.snapshot())
            .unwrap_or_default()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;
    use crate::proto::ShardId;

    fn tag(user: u64) -> Tag {
        Tag::new(TagKind::User, ShardId::new(1), user).unwrap()
    }

    fn frame(t: Tag, data: &[u8]) -> Vec<u8> {
        let mut v = data.to_vec();
        v.extend_from_slice(&t.raw().to_le_bytes());
        v
    }

    #[test]
    fn trailer_is_checked() {
        let mut ok = frame(tag(7), b"abc");
        assert_eq!(split_trailer(&mut ok), Some(tag(7)));
        assert_eq!(ok, b"abc");
        let mut short = vec![0u8; 7];
        assert_eq!(split_trailer(&mut short), None);
        let stream = Tag::new(TagKind::Stream, ShardId::new(0), 1).unwrap();
        let mut wrong_kind = frame(stream, b"x");
        assert_eq!(split_trailer(&mut wrong_kind), None);
    }

    #[test]
    fn unexpected_queue_is_bounded_and_ordered() {
        let st = TagState::new(TagConfig {
            max_unexpected_bytes: 10,
            max_unexpected_count: 2,
        });
        let n = NodeId::new(1);
        st.on_eager(n, frame(tag(1), b"12345"));
        st.on_eager(n, frame(tag(2), b"123456")); // 11 bytes: over the byte cap
        st.on_eager(n, frame(tag(3), b"1"));
        st.on_eager(n, frame(tag(4), b"")); // third message: over the count cap
        st.on_eager(n, b"short".to_vec());
        let s = st.snapshot();
        assert_eq!((s.arrived, s.dropped_unexpected, s.malformed), (5, 2, 1));
        assert_eq!((s.unexpected_now, s.unexpected_bytes_now), (2, 6));
        let mut peers = st.peers.borrow_mut();
        let p = peers.get_mut(&n).unwrap();
        let any = TagMask::ANY_SOURCE_ANY_USER;
        assert_eq!(p.claim_unexpected(tag(0), any).unwrap().tag, tag(1));
        let back = Slot::new(0, tag(1), 5);
        p.insert_unexpected(back);
        assert_eq!(p.claim_unexpected(tag(0), any).unwrap().tag, tag(1));
        assert_eq!(p.claim_unexpected(tag(0), any).unwrap().tag, tag(3));
        assert!(p.claim_unexpected(tag(0), any).is_none());
        assert_eq!(p.unexpected_bytes, 0);
    }
}
