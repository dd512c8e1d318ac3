//! Communicators: who the ranks are, how they are made, and how one operation sends and
//! receives.

use std::cell::Cell;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use glommio::timer::sleep;
use shardcx_shards::proto::{NodeId, Rails, ShardId};
use shardcx_shards::NetError;

use super::algorithm::{Algorithm, Tuning};
use super::deadline::Armed;
use super::element::{decode_in_turns, encode_in_turns, encode_into_in_turns, Element};
use super::error::{AbortCause, CollectiveError};
use super::state::{self, Blocked, Bytes, Data, ShardState};
use super::wire::{Header, Kind, COLLECTIVE_AM, SEGMENT};
use crate::{Error, Node, Peer};

/// A rank's place: one shard of one node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Member {
    /// The node.
    pub node: NodeId,
    /// The shard of it.
    pub shard: ShardId,
}

/// The color of [`Communicator::split`]: ranks with the same color form one new communicator;
/// [`Color::UNDEFINED`] leaves the rank out of all of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Color(Option<u32>);

/// A group of ranks, as seen by one of them, on its shard: `!Send`.
///
/// A rank is one shard of one node ([`Member`]); ranks are numbered node by node, in the order
/// of the node list the world was made from, and by shard within a node. Every rank of a
/// communicator holds its own `Communicator` and calls the same operations on it in the same
/// order; operations take `&mut self`, so one rank runs one operation of a communicator at a
/// time ([`Communicator::dup`] gives another communicator to run operations concurrently).
///
/// Made collectively: [`Communicator::world`], then [`Communicator::split`],
/// [`Communicator::dup`], [`Communicator::node_local`] and [`Communicator::leaders`] on an
/// existing one. Dropping it on a rank makes that rank drop messages that still come for it.
pub struct Communicator {
    node: Node,
    state: Rc<ShardState>,
    id: u64,
    members: Rc<[Member]>,
    /// Its ranks by node, made once (see [`NodeBlocks`]).
    blocks: Rc<NodeBlocks>,
    rank: usize,
    next_seq: u64,
    tuning: Tuning,
    last_algorithm: Option<Algorithm>,
    /// The loss epoch when it was made: nodes lost after it are gone for [`Communicator::shrink`].
    born: u64,
    /// Shrinks begun on it (each one's messages are its own).
    shrinks: u64,
}

/// One operation in progress on one rank: its identity on the wire, its deadline, and what it
/// waits for. Ending it (done or failed) or dropping it releases its messages; a failure or a
/// drop revokes the communicator and tells the other ranks (an abort), unless another rank's
/// abort caused it.
pub(crate) struct Op {
    node: Node,
    state: Rc<ShardState>,
    comm: u64,
    members: Rc<[Member]>,
    blocks: Rc<NodeBlocks>,
    rank: usize,
    pub(crate) name: &'static str,
    seq: u64,
    timeout: Duration,
    since: u64,
    waiting_for: Cell<Option<usize>>,
    ended: Cell<bool>,
    algorithm: Cell<Option<Algorithm>>,
    pub(crate) tuning: Tuning,
}

/// Some ranks of an operation, renumbered `0..size()` in the order given, that run an
/// algorithm among themselves (a node's shards, the leaders of nodes): their messages are the
/// operation's, with the group's phase in the top bits of the step, so several groups of one
/// operation never take each other's messages.
pub(crate) struct Group<'a> {
    op: &'a Op,
    /// The operation ranks of the group's, in its order; `None` for all of them in rank order
    /// ([`Group::all`], which every operation starts from: no vector to make).
    ranks: Option<Vec<usize>>,
    me: usize,
    phase: u32,
}

/// Ranks `0..p` by node: each node's ranks ascending, nodes in the order of their lowest rank.
/// A communicator's are made once, when it is, and lent to its operations: an 8-byte
/// all-reduce spent a seventh of its instructions making them again per call.
#[derive(Debug)]
pub(crate) struct NodeBlocks(pub(crate) Vec<Vec<usize>>);

impl NodeBlocks {
    /// The blocks of the `p` ranks whose nodes `node_of` gives.
    pub(crate) fn of(p: usize, node_of: impl Fn(usize) -> NodeId) -> NodeBlocks {
        let mut blocks: Vec<(NodeId, Vec<usize>)> = Vec::new();
        for i in 0..p {
            let node = node_of(i);
            match blocks.iter_mut().find(|(n, _)| *n == node) {
                Some((_, b)) => b.push(i),
                None => blocks.push((node, vec![i])),
            }
        }
        NodeBlocks(blocks.into_iter().map(|(_, b)| b).collect())
    }
}

/// Most bytes of a message [`Op::send_elems`] encodes on the stack (an 8-byte all-reduce's,
/// a barrier's, a small vector's).
const SMALL_SEND: usize = 256;

/// Step bits below a group's phase.
const GROUP_SHIFT: u32 = 28;

/// How often [`Communicator::world_from_registry`] asks the registry again while fewer nodes
/// than it waits for are registered.
const REGISTRY_POLL: Duration = Duration::from_millis(20);

/// How often world creation looks whether the sessions to the other nodes are up.
const SESSION_POLL: Duration = Duration::from_millis(2);

/// Step numbers of one phase of an operation start at `phase << PHASE_SHIFT`.
pub(crate) const PHASE_SHIFT: u32 = 24;

const UNDEFINED_COLOR: i64 = -1;

impl Color {
    /// The rank takes part in no new communicator.
    pub const UNDEFINED: Color = Color(None);

    /// Color `c`.
    pub const fn new(c: u32) -> Color {
        Color(Some(c))
    }

    /// The color's value, `None` for [`Color::UNDEFINED`].
    pub fn get(self) -> Option<u32> {
        self.0
    }

    fn to_wire(self) -> i64 {
        self.0.map_or(UNDEFINED_COLOR, i64::from)
    }
}

impl Member {
    /// The peer this member is, from another node.
    pub fn peer(&self) -> Peer {
        Peer::new(self.node).shard(self.shard)
    }
}

impl Communicator {
    /// The world of the nodes `nodes` (this node among them; the same list, in the same order,
    /// on every rank): every shard of every node is a rank, numbered node by node in list
    /// order. Collective: every shard of every node calls it, and it returns once all have,
    /// or fails at `timeout`.
    ///
    /// A rank may have its world before another does (the last messages of the members'
    /// all-gather still on their way to it): when a node leaves at once and a rank's next
    /// operation fails for it, that rank revokes the world, and a slower rank's `world` fails
    /// with [`CollectiveError::Revoked`] (see "Failure" in the
    /// [module docs](crate::collective)); it goes on as after any failure, with a new world.
    ///
    /// The other nodes must be connected (a session with each, from any shard, either way)
    /// or their listen addresses known ([`crate::NodeBuilder::peer_addr`]: then they are
    /// connected to here); it waits for their sessions until the deadline
    /// ([`CollectiveError::Unreachable`] then). Worlds made again from the same list are
    /// different communicators.
    pub async fn world(
        node: &Node,
        nodes: &[NodeId],
        timeout: Duration,
    ) -> Result<Communicator, CollectiveError> {
        const OP: &str = "world";
        let start = Instant::now();
        let me = node.id();
        let invalid = |what: String| CollectiveError::InvalidArgument { op: OP, what };
        if !nodes.contains(&me) {
            return Err(invalid(format!("this node ({me}) is not in the list")));
        }
        for (i, n) in nodes.iter().enumerate() {
            if nodes[..i].contains(n) {
                return Err(invalid(format!("node {n} is listed twice")));
            }
        }
        let mut members = Vec::new();
        for &n in nodes {
            let count = if n == me {
                node.shard_count()
            } else {
                usize::from(remote_shard_count(node, n, start, timeout).await?)
            };
            members.extend((0..count).map(|s| Member {
                node: n,
                shard: ShardId::new(s as u16),
            }));
        }
        let rank = members
            .iter()
            .position(|m| m.node == me && m.shard == node.shard())
            .ok_or_else(|| invalid("this shard is not a member".into()))?;
        let state = state::of(node.shard_ctx());
        let list = hash(nodes.iter().map(|n| n.get()));
        let ordinal = state.next_world(list);
        let id = hash([0x5752_4c44, list, ordinal]);
        // Each shard has waited for the rails it holds; once this node's shards have all
        // done so (a barrier through the mesh), any of them may send to any remote shard.
        let here: Rc<[Member]> = members.iter().filter(|m| m.node == me).copied().collect();
        let local_id = hash([0x4c4f_4341, id]);
        let local_rank = node.shard().index();
        let mut local =
            Communicator::make(node.clone(), state.clone(), local_id, here, local_rank, OP)?;
        let left = timeout.saturating_sub(start.elapsed());
        local.barrier(left).await.map_err(|e| rename(e, OP))?;
        drop(local);
        let mut comm = Communicator::make(node.clone(), state, id, members.into(), rank, OP)?;
        // Everyone must see the same members: gather every rank's view of them.
        let view = hash(
            comm.members
                .iter()
                .map(|m| m.node.get() << 16 | u64::from(m.shard.get())),
        );
        let left = timeout.saturating_sub(start.elapsed());
        let views = comm
            .all_gather(&[view], left)
            .await
            .map_err(|e| rename(e, OP))?;
        if let Some(other) = views.iter().position(|&v| v != view) {
            return Err(CollectiveError::Mismatch {
                op: OP,
                rank,
                other,
                what: "a different list of members (shard counts)".into(),
            });
        }
        Ok(comm)
    }

    /// The world of the nodes registered under `service` in `registry` (see
    /// [`crate::registry`]): waits until `count` nodes are registered there, this one among
    /// them, then makes their world ([`Communicator::world`]) with the nodes in the order of
    /// their ids. Collective: every shard of every one of those nodes calls it (each with its
    /// own registry client), and it fails at `timeout`.
    ///
    /// Each pair of nodes connects once, the node with the larger id to the address the other
    /// registered; nothing else needs to be known. More than `count` nodes under `service`
    /// is [`CollectiveError::InvalidArgument`] (every rank must see the same list), and so is
    /// this node missing from `count` of them; a registry that cannot be asked within the
    /// deadline is [`CollectiveError::Discovery`].
    pub async fn world_from_registry<R: crate::registry::Registry>(
        node: &Node,
        registry: &R,
        service: &str,
        count: usize,
        timeout: Duration,
    ) -> Result<Communicator, CollectiveError> {
        const OP: &str = "world_from_registry";
        let start = Instant::now();
        let me = node.id();
        let invalid = |what: String| CollectiveError::InvalidArgument { op: OP, what };
        if count == 0 {
            return Err(invalid("a world of no nodes".into()));
        }
        // How many the last answer listed.
        let mut seen = None;
        let records = loop {
            let left = timeout.saturating_sub(start.elapsed());
            let found =
                futures_lite::future::or(async { Some(registry.lookup(service).await) }, async {
                    sleep(left).await;
                    None
                })
                .await;
            let mut records = match found {
                Some(Ok(records)) => records,
                Some(Err(e)) => {
                    return Err(CollectiveError::Discovery {
                        op: OP,
                        cause: e.to_string(),
                    })
                }
                None => {
                    let cause = match seen {
                        Some(k) => format!(
                            "{k} of {count} nodes registered under {service:?} within {timeout:?}"
                        ),
                        None => format!("the registry did not answer within {timeout:?}"),
                    };
                    return Err(CollectiveError::Discovery { op: OP, cause });
                }
            };
            seen = Some(records.len());
            if records.len() > count {
                return Err(invalid(format!(
                    "{} nodes are registered under {service:?}, more than {count}",
                    records.len()
                )));
            }
            if records.len() == count {
                records.sort_by_key(|r| r.node.get());
                break records;
            }
            let left = timeout.saturating_sub(start.elapsed());
            sleep(REGISTRY_POLL.min(left)).await;
        };
        if !records.iter().any(|r| r.node == me) {
            return Err(invalid(format!(
                "this node ({me}) is not among the {count} registered under {service:?}"
            )));
        }
        // The node with the larger id connects: one connection per pair, none crossing.
        for r in records.iter().filter(|r| r.node.get() < me.get()) {
            node.add_peer_addr(r.node, r.addr);
        }
        let nodes: Vec<NodeId> = records.iter().map(|r| r.node).collect();
        let left = timeout.saturating_sub(start.elapsed());
        Communicator::world(node, &nodes, left)
            .await
            .map_err(|e| rename(e, OP))
    }

    /// Splits this communicator: ranks that pass the same `color` form a new communicator, in
    /// which they are ordered by `key`, then by rank here. Collective on this communicator;
    /// `Ok(None)` on the ranks that passed [`Color::UNDEFINED`].
    pub async fn split(
        &mut self,
        color: Color,
        key: i64,
        timeout: Duration,
    ) -> Result<Option<Communicator>, CollectiveError> {
        const OP: &str = "split";
        let seq = self.next_seq;
        let all = self
            .all_gather(&[color.to_wire(), key], timeout)
            .await
            .map_err(|e| rename(e, OP))?;
        let Some(c) = color.0 else { return Ok(None) };
        let mut chosen: Vec<(i64, usize)> = all
            .chunks_exact(2)
            .enumerate()
            .filter(|(_, ck)| ck[0] == i64::from(c))
            .map(|(r, ck)| (ck[1], r))
            .collect();
        chosen.sort_unstable();
        let members: Rc<[Member]> = chosen.iter().map(|&(_, r)| self.members[r]).collect();
        let rank = chosen
            .iter()
            .position(|&(_, r)| r == self.rank)
            .ok_or_else(|| CollectiveError::InvalidArgument {
                op: OP,
                what: "this rank is not in its own color".into(),
            })?;
        let id = hash([0x5350_4c54, self.id, seq, u64::from(c)]);
        Communicator::make(self.node.clone(), self.state.clone(), id, members, rank, OP).map(Some)
    }

    /// A communicator with the same ranks in the same order, whose operations never mix with
    /// this one's. Collective on this communicator.
    pub async fn dup(&mut self, timeout: Duration) -> Result<Communicator, CollectiveError> {
        const OP: &str = "dup";
        let seq = self.next_seq;
        self.barrier(timeout).await.map_err(|e| rename(e, OP))?;
        let id = hash([0x4455_5000, self.id, seq]);
        Communicator::make(
            self.node.clone(),
            self.state.clone(),
            id,
            self.members.clone(),
            self.rank,
            OP,
        )
    }

    /// The ranks of this communicator on this rank's node, in rank order. Collective on this
    /// communicator.
    pub async fn node_local(&mut self, timeout: Duration) -> Result<Communicator, CollectiveError> {
        let me = self.members[self.rank].node;
        let first = self
            .members
            .iter()
            .position(|m| m.node == me)
            .unwrap_or(self.rank);
        let color = Color::new(u32::try_from(first).unwrap_or(u32::MAX));
        let key = self.rank as i64;
        let comm = self.split(color, key, timeout).await?;
        comm.ok_or(CollectiveError::InvalidArgument {
            op: "node_local",
            what: "no communicator for a defined color".into(),
        })
    }

    /// The leaders: the lowest rank of this communicator on each node, in rank order.
    /// Collective on this communicator; `Ok(None)` on the ranks that are not leaders.
    pub async fn leaders(
        &mut self,
        timeout: Duration,
    ) -> Result<Option<Communicator>, CollectiveError> {
        let me = self.members[self.rank].node;
        let lead = self.members.iter().position(|m| m.node == me) == Some(self.rank);
        let color = if lead {
            Color::new(0)
        } else {
            Color::UNDEFINED
        };
        let key = self.rank as i64;
        self.split(color, key, timeout).await
    }

    /// A new communicator of the ranks of this one that survive: the ranks whose nodes have
    /// not lost their connection since this communicator was made, in the same order
    /// (renumbered from 0). Collective on the survivors, and usable on a revoked communicator:
    /// it is how ranks go on after a [`CollectiveError::RankFailed`] or an abort. Every
    /// surviving rank must call it; the new communicator keeps this one's [`Tuning`].
    ///
    /// The survivors agree through the lowest rank each of them sees alive (the coordinator):
    /// every rank sends it the ranks it sees alive, and the coordinator answers every rank
    /// with the ranks all of them see alive. A coordinator that fails meanwhile is replaced by
    /// the next rank, so a failure during the shrink is survived too. When the ranks'
    /// connections were cut but their nodes still run (a partition), each side shrinks to the
    /// ranks it still reaches; a rank that the coordinator heard from but another survivor
    /// saw as failed gets [`CollectiveError::Excluded`]. Fails at `timeout` (with the rank it
    /// waited for) when a rank that this one sees alive does not take part.
    pub async fn shrink(&mut self, timeout: Duration) -> Result<Communicator, CollectiveError> {
        const OP: &str = "shrink";
        let attempt = self.shrinks;
        self.shrinks += 1;
        // The agreement's messages go on a communicator of their own (this one may be
        // revoked), with the same ranks.
        let agree_id = hash([0x5348_524b, self.id, attempt]);
        let mut agree = Communicator::make(
            self.node.clone(),
            self.state.clone(),
            agree_id,
            self.members.clone(),
            self.rank,
            OP,
        )?;
        let op = agree.begin(OP, timeout);
        let (by, survivors) = op
            .run(std::pin::pin!(agree_on_survivors(&op, self.born)))
            .await?;
        drop(op);
        drop(agree);
        let rank =
            survivors
                .iter()
                .position(|&r| r == self.rank)
                .ok_or(CollectiveError::Excluded {
                    op: OP,
                    rank: self.rank,
                    by,
                })?;
        let members: Rc<[Member]> = survivors.iter().map(|&r| self.members[r]).collect();
        let id = hash(
            [0x5348_524e, self.id, attempt]
                .into_iter()
                .chain(survivors.iter().map(|&r| r as u64)),
        );
        let mut comm =
            Communicator::make(self.node.clone(), self.state.clone(), id, members, rank, OP)?;
        comm.tuning = self.tuning;
        Ok(comm)
    }

    /// This rank's number.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// The ranks, in rank order.
    pub fn members(&self) -> &[Member] {
        &self.members
    }

    /// The communicator's id (the same on every rank; it is on every message).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The node this rank runs on.
    pub fn node(&self) -> &Node {
        &self.node
    }

    /// The thresholds that choose algorithms.
    pub fn tuning(&self) -> Tuning {
        self.tuning
    }

    /// Sets the thresholds that choose algorithms (the same on every rank: ranks that choose
    /// differently do not meet, and fail at their deadline).
    pub fn set_tuning(&mut self, tuning: Tuning) {
        self.tuning = tuning;
    }

    /// The algorithm the last operation that ended here used.
    pub fn last_algorithm(&self) -> Option<Algorithm> {
        self.last_algorithm
    }

    /// Whether this communicator is revoked (an operation failed: every later one fails at
    /// once with [`CollectiveError::Revoked`]): the rank whose failure revoked it, and why.
    pub fn revoked(&self) -> Option<(usize, AbortCause)> {
        self.state
            .revoked(self.id)
            .map(|(by, cause)| (by as usize, cause))
    }

    /// This shard's collective counters (all communicators).
    pub fn stats(&self) -> super::CollectiveStats {
        self.state.stats()
    }

    fn make(
        node: Node,
        state: Rc<ShardState>,
        id: u64,
        members: Rc<[Member]>,
        rank: usize,
        op: &'static str,
    ) -> Result<Communicator, CollectiveError> {
        if !state.register(id) {
            return Err(CollectiveError::InvalidArgument {
                op,
                what: format!("communicator id {id:#x} already in use on this shard"),
            });
        }
        let born = state.epoch();
        let blocks = Rc::new(NodeBlocks::of(members.len(), |i| members[i].node));
        Ok(Communicator {
            node,
            state,
            id,
            members,
            blocks,
            rank,
            next_seq: 0,
            tuning: Tuning::default(),
            last_algorithm: None,
            born,
            shrinks: 0,
        })
    }

    /// Begins the next operation.
    pub(crate) fn begin(&mut self, name: &'static str, timeout: Duration) -> Op {
        let seq = self.next_seq;
        self.next_seq += 1;
        let since = self.state.begin(self.id, seq);
        Op {
            node: self.node.clone(),
            state: self.state.clone(),
            comm: self.id,
            members: self.members.clone(),
            blocks: self.blocks.clone(),
            rank: self.rank,
            name,
            seq,
            timeout,
            since,
            waiting_for: Cell::new(None),
            ended: Cell::new(false),
            algorithm: Cell::new(None),
            tuning: self.tuning,
        }
    }

    /// Operation `op` has ended: remembers its algorithm.
    pub(crate) fn finish(&mut self, op: &Op) {
        if let Some(a) = op.algorithm.get() {
            self.last_algorithm = Some(a);
        }
    }
}

impl Op {
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    pub(crate) fn size(&self) -> usize {
        self.members.len()
    }

    /// The operation's ranks.
    pub(crate) fn members(&self) -> &[Member] {
        &self.members
    }

    /// Records the algorithm this operation runs.
    pub(crate) fn chose(&self, a: Algorithm) {
        self.algorithm.set(Some(a));
    }

    /// A failure of this operation caused by rank `failed`.
    pub(crate) fn failed(&self, failed: usize, cause: impl ToString) -> CollectiveError {
        CollectiveError::RankFailed {
            op: self.name,
            rank: self.rank,
            failed,
            cause: cause.to_string(),
        }
    }

    /// A message of the wrong shape from rank `other`.
    pub(crate) fn mismatch(&self, other: usize, what: impl ToString) -> CollectiveError {
        CollectiveError::Mismatch {
            op: self.name,
            rank: self.rank,
            other,
            what: what.to_string(),
        }
    }

    /// `bytes` as elements, or a mismatch with rank `from` (`what` says of what) when they
    /// are not a whole number of them.
    pub(crate) async fn decode<T: Element>(
        &self,
        bytes: &[u8],
        from: usize,
        what: &str,
    ) -> Result<Vec<T>, CollectiveError> {
        decode_in_turns(bytes)
            .await
            .ok_or_else(|| self.mismatch(from, what))
    }

    /// An invalid argument of this rank's.
    pub(crate) fn invalid(&self, what: impl ToString) -> CollectiveError {
        CollectiveError::InvalidArgument {
            op: self.name,
            what: what.to_string(),
        }
    }

    /// Runs the operation's body within its deadline (at once `Aborted` or `Revoked` when
    /// another rank's abort is already here); on a failure of its own, revokes the
    /// communicator here and tells the other ranks.
    ///
    /// The body is lent pinned where the caller made it: taken by value, it would be moved
    /// into this future and held twice in its state (the argument and the pinned local), and
    /// a body's state is copied whole on every move.
    pub(crate) async fn run<T>(
        &self,
        body: Pin<&mut impl Future<Output = Result<T, CollectiveError>>>,
    ) -> Result<T, CollectiveError> {
        let aborted = self.state.aborted(self.comm, self.seq);
        let out = match (aborted, self.state.revoked(self.comm)) {
            // Another rank has already given up on this operation.
            (Some((by, cause)), _) => Err(self.aborted(by, cause)),
            (None, Some((by, cause))) => Err(self.revoked(by, cause)),
            (None, None) => {
                // The deadline is registered when the body first waits (see `deadline`); a
                // timeout too long for the clock is none.
                let mut body = body;
                let mut armed = None;
                poll_fn(|cx| {
                    if let Poll::Ready(out) = body.as_mut().poll(cx) {
                        return Poll::Ready(out);
                    }
                    match &armed {
                        Some(a) if Armed::expired(a, cx.waker()) => {
                            return Poll::Ready(Err(CollectiveError::TimedOut {
                                op: self.name,
                                rank: self.rank,
                                waiting_for: self.waiting_for.get(),
                                after: self.timeout,
                            }))
                        }
                        Some(_) => {}
                        None => {
                            armed = Instant::now()
                                .checked_add(self.timeout)
                                .map(|at| self.state.deadlines.arm(at, cx.waker()));
                        }
                    }
                    Poll::Pending
                })
                .await
            }
        };
        self.ended.set(true);
        self.state.end(self.comm, self.seq);
        if let Err(e) = &out {
            if let Some(cause) = e.abort_cause() {
                self.state.revoke(self.comm, self.rank as u32, cause);
                self.abort_others(cause);
            }
        }
        out
    }

    fn revoked(&self, by: u32, cause: AbortCause) -> CollectiveError {
        CollectiveError::Revoked {
            op: self.name,
            rank: self.rank,
            by: by as usize,
            cause,
        }
    }

    fn aborted(&self, by: u32, cause: AbortCause) -> CollectiveError {
        CollectiveError::Aborted {
            op: self.name,
            rank: self.rank,
            by: by as usize,
            cause,
        }
    }

    fn header(&self, kind: Kind, step: u32, total: usize) -> Header {
        Header {
            kind,
            src: self.rank as u32,
            comm: self.comm,
            seq: self.seq,
            step,
            total: total as u64,
            offset: 0,
        }
    }

    /// Sends `data` as step `step` of this operation to rank `to`: through the mesh to a shard
    /// of this node (moved; resolves at once, the forward runs in a task of its own and a
    /// failure of it fails this operation's next wait), on the rail to the shard of another
    /// node (in parts of at most [`SEGMENT`] bytes; resolves once they are with UCX or
    /// queued).
    pub(crate) async fn send(
        &self,
        to: usize,
        step: u32,
        data: Vec<u8>,
    ) -> Result<(), CollectiveError> {
        let h = self.header(Kind::Data, step, data.len());
        let m = self.members[to];
        if m.node == self.node.id() && m.shard != self.node.shard() {
            // Through the mesh, not awaited (the receiver needs no answer, and waiting for the
            // job's completion would cost a cross-shard round trip per message); a failure
            // fails this operation's next wait.
            let state = self.state.clone();
            let (comm, seq, to32) = (self.comm, self.seq, to as u32);
            let from = self.node.id();
            let fwd = self
                .node
                .shard_ctx()
                .forward(m.shard, move |ctx| async move {
                    state::of(&ctx).deliver(from, h, Data::Owned(data));
                });
            glommio::spawn_local(async move {
                if let Err(e) = fwd.await {
                    state.send_failed(comm, seq, to32, e.to_string());
                }
            })
            .detach();
            return Ok(());
        }
        deliver_to(&self.node, m, h, data)
            .await
            .map_err(|e| self.failed(to, e))
    }

    /// Receives step `step` of this operation from rank `from`. Fails when `from`'s node is
    /// lost, another rank aborts the operation, or this node shuts down; the deadline is the
    /// operation's (see [`Op::run`]).
    pub(crate) async fn recv(&self, from: usize, step: u32) -> Result<Bytes, CollectiveError> {
        let key = (self.comm, self.seq, from as u32, step);
        let node = self.members[from].node;
        self.waiting_for.set(Some(from));
        let got = poll_fn(|cx| {
            if let Some((sender, data)) = self.state.take(key) {
                return Poll::Ready(if sender == node {
                    Ok(data)
                } else {
                    Err(self.mismatch(
                        from,
                        format!("its message came from node {sender}, not {node}"),
                    ))
                });
            }
            match self.state.blocked(self.comm, self.seq, node, self.since) {
                Some(Blocked::Aborted { by, cause }) => Poll::Ready(Err(self.aborted(by, cause))),
                Some(Blocked::Revoked { by, cause }) => Poll::Ready(Err(self.revoked(by, cause))),
                Some(Blocked::Lost(why)) => Poll::Ready(Err(self.failed(from, why))),
                Some(Blocked::SendFailed { to, why }) => {
                    Poll::Ready(Err(self.failed(to as usize, why)))
                }
                Some(Blocked::ShuttingDown) => Poll::Ready(Err(CollectiveError::ShuttingDown {
                    op: self.name,
                    rank: self.rank,
                })),
                None => {
                    self.state.wait(self.comm, self.seq, cx.waker());
                    Poll::Pending
                }
            }
        })
        .await;
        self.waiting_for.set(None);
        got
    }

    /// Sends the bytes of `xs` as step `step` to rank `to` (see [`Op::send`]). A message of
    /// another node that goes by rendezvous in one part is written into one of the shard's
    /// reused send buffers and sent from there (no fresh allocation, no zero-fill and no copy
    /// in the send path: UCX reads it where it is); others are encoded into a vector and sent
    /// as [`Op::send`] sends.
    pub(crate) async fn send_elems<T: Element>(
        &self,
        to: usize,
        step: u32,
        xs: &[T],
    ) -> Result<(), CollectiveError> {
        self.send_elems_led(to, step, &[], xs).await
    }

    /// [`Op::send_elems`] of a message that starts with the bytes `lead`, then those of `xs`.
    pub(crate) async fn send_elems_led<T: Element>(
        &self,
        to: usize,
        step: u32,
        lead: &[u8],
        xs: &[T],
    ) -> Result<(), CollectiveError> {
        let len = lead.len() + xs.len() * T::SIZE;
        let m = self.members[to];
        // Without a lead, the encoding is the message (no second copy of it).
        let encoded = async || {
            if lead.is_empty() {
                return encode_in_turns(xs).await;
            }
            let mut v = vec![0u8; len];
            v[..lead.len()].copy_from_slice(lead);
            encode_into_in_turns(xs, &mut v[lead.len()..]).await;
            v
        };
        if m.node != self.node.id() && len <= SMALL_SEND {
            // Encoded on the stack and handed to UCX at once on this shard's rail: no vector
            // to allocate and free. Another shard's rail, or one not up yet, goes straight to
            // the sends that may wait (not through `deliver_to`, which would try again).
            let mut bytes = [0u8; SMALL_SEND];
            bytes[..lead.len()].copy_from_slice(lead);
            T::write_all_le(xs, &mut bytes[lead.len()..len]);
            let h = self.header(Kind::Data, step, len);
            let sent = match send_here(&self.node, m, &h, &bytes[..len]) {
                Some(sent) => sent,
                None => Box::pin(deliver_waiting(&self.node, m, h, bytes[..len].to_vec())).await,
            };
            return sent.map_err(|e| self.failed(to, e));
        }
        if !self.direct(m, len) {
            return self.send(to, step, encoded().await).await;
        }
        room_ahead(&self.node, m.node, len).await;
        let mut buf = self.state.take_send_buf(len);
        match Rc::get_mut(&mut buf) {
            Some(bytes) => {
                bytes[..lead.len()].copy_from_slice(lead);
                encode_into_in_turns(xs, &mut bytes[lead.len()..]).await
            }
            // `take_send_buf` hands out buffers nothing else holds.
            None => return self.send(to, step, encoded().await).await,
        }
        let h = self.header(Kind::Data, step, len);
        let sent = m
            .peer()
            .am_send_buf(COLLECTIVE_AM, &h.encode(), buf.clone())
            .map_err(|e| self.failed(to, e));
        self.state.keep_send_buf(buf);
        sent
    }

    /// Whether a message of `len` bytes to `m` goes by rendezvous, in one message, on a rail
    /// this shard holds: sent straight from a buffer the send owns, no copy on the way.
    fn direct(&self, m: Member, len: usize) -> bool {
        m.node != self.node.id()
            && len > RNDV_OVER
            && len <= SEGMENT
            && self.node.shard_ctx().rail(m.node, m.shard).is_some()
    }

    /// Sends elements `range` of `v` to member `to` from where they are, when the element type
    /// lends its memory to a send ([`Element::share_wire`]) and the message goes by rendezvous
    /// on a rail this shard holds: the send keeps a clone of `v` until UCX is done with the
    /// bytes, and `lent` is told when it lets go (see [`Op::reclaim`]). Otherwise the elements
    /// are encoded as [`Op::send_elems`] encodes them. Either way the receiver gets the same
    /// message.
    pub(crate) async fn send_shared<T: Element>(
        &self,
        to: usize,
        step: u32,
        v: &Rc<Vec<T>>,
        range: std::ops::Range<usize>,
        lent: &Lent,
    ) -> Result<(), CollectiveError> {
        let len = range.len() * T::SIZE;
        let m = self.members[to];
        let shared = if self.direct(m, len) {
            T::share_wire(v, range.clone())
        } else {
            None
        };
        let Some(elems) = shared else {
            return self.send_elems(to, step, &v[range]).await;
        };
        room_ahead(&self.node, m.node, len).await;
        let buf = crate::SendBuf::Elems(elems.on_release(lent.release()));
        let h = self.header(Kind::Data, step, len);
        m.peer()
            .am_send_buf(COLLECTIVE_AM, &h.encode(), buf)
            .map_err(|e| self.failed(to, e))?;
        self.state.count_sent_in_place();
        Ok(())
    }

    /// `v` back once no send holds it any more ([`Op::send_shared`]): at once when none does,
    /// else when the last one lets go (the peer `to` has pulled the bytes, or the send
    /// failed). The operation's deadline bounds the wait.
    pub(crate) async fn reclaim<T>(&self, to: usize, v: Rc<Vec<T>>, lent: &Lent) -> Vec<T> {
        let mut v = v;
        loop {
            match Rc::try_unwrap(v) {
                Ok(v) => {
                    return v;
                }
                Err(still) => {
                    v = still;
                    self.waiting_for.set(Some(to));
                    lent.released().await;
                    self.waiting_for.set(None);
                }
            }
        }
    }

    /// Tells every other rank that this operation ended here with `cause` (best effort, from a
    /// task of its own: a rank that cannot be reached is skipped).
    fn abort_others(&self, cause: AbortCause) {
        let (node, members, me) = (self.node.clone(), self.members.clone(), self.rank);
        let h = self.header(Kind::Abort(cause), 0, 0);
        glommio::spawn_local(async move {
            for (r, m) in members.iter().enumerate() {
                if r != me {
                    let _ = deliver_to(&node, *m, h, Vec::new()).await;
                }
            }
        })
        .detach();
    }
}

impl<'a> Group<'a> {
    /// Every rank of `op`, in rank order.
    pub(crate) fn all(op: &'a Op) -> Group<'a> {
        Group {
            op,
            ranks: None,
            me: op.rank(),
            phase: 0,
        }
    }

    /// The ranks `ranks` of the operation (operation ranks, in the new group's order), with
    /// group phase `phase` (1 to 15; distinct per group an operation uses); `None` when this
    /// rank is not among them.
    pub(crate) fn of(op: &'a Op, ranks: Vec<usize>, phase: u32) -> Option<Group<'a>> {
        let me = ranks.iter().position(|&r| r == op.rank())?;
        Some(Group {
            op,
            ranks: Some(ranks),
            me,
            phase,
        })
    }

    pub(crate) fn rank(&self) -> usize {
        self.me
    }

    pub(crate) fn size(&self) -> usize {
        self.ranks.as_ref().map_or(self.op.size(), Vec::len)
    }

    /// The operation rank of group rank `i`.
    fn op_rank(&self, i: usize) -> usize {
        self.ranks.as_ref().map_or(i, |r| r[i])
    }

    /// The group's ranks by node (group ranks): the communicator's, made once, for the whole
    /// operation; made here for a group of some of its ranks.
    pub(crate) fn node_blocks(&self) -> std::borrow::Cow<'_, [Vec<usize>]> {
        match &self.ranks {
            None => std::borrow::Cow::Borrowed(&self.op.blocks.0),
            Some(r) => std::borrow::Cow::Owned(NodeBlocks::of(r.len(), |i| self.node_of(i)).0),
        }
    }

    /// The operation's thresholds.
    pub(crate) fn tuning(&self) -> Tuning {
        self.op.tuning
    }

    /// Records the algorithm the operation runs.
    pub(crate) fn chose(&self, a: Algorithm) {
        self.op.chose(a);
    }

    /// The node of group rank `i`.
    pub(crate) fn node_of(&self, i: usize) -> NodeId {
        self.op.members()[self.op_rank(i)].node
    }

    /// The group of this group's ranks `ranks` (group ranks, in the new group's order), with
    /// group phase `phase` (1 to 15, distinct per group an operation uses; groups are made
    /// from the whole operation only); `None` when this rank is not among them.
    pub(crate) fn sub(&self, ranks: Vec<usize>, phase: u32) -> Option<Group<'a>> {
        debug_assert!(self.phase == 0 && (1..16).contains(&phase));
        let ranks: Vec<usize> = ranks.into_iter().map(|i| self.op_rank(i)).collect();
        Group::of(self.op, ranks, phase)
    }

    /// A message of the wrong shape from group rank `other`.
    pub(crate) fn mismatch(&self, other: usize, what: impl ToString) -> CollectiveError {
        self.op.mismatch(self.op_rank(other), what)
    }

    /// This rank's result, `bytes`, as elements (a length that is not a whole number of them
    /// is a mismatch of element sizes).
    pub(crate) async fn decode_result<T: Element>(
        &self,
        bytes: &[u8],
    ) -> Result<Vec<T>, CollectiveError> {
        self.op.decode(bytes, self.op.rank(), "element size").await
    }

    /// An invalid argument of this rank's.
    pub(crate) fn invalid(&self, what: impl ToString) -> CollectiveError {
        self.op.invalid(what)
    }

    fn step(&self, step: u32) -> u32 {
        debug_assert!(step < 1 << GROUP_SHIFT);
        self.phase << GROUP_SHIFT | step
    }

    /// [`Op::send`] to group rank `to`.
    pub(crate) async fn send(
        &self,
        to: usize,
        step: u32,
        data: Vec<u8>,
    ) -> Result<(), CollectiveError> {
        self.op.send(self.op_rank(to), self.step(step), data).await
    }

    /// [`Op::recv`] from group rank `from`.
    pub(crate) async fn recv(&self, from: usize, step: u32) -> Result<Bytes, CollectiveError> {
        self.op.recv(self.op_rank(from), self.step(step)).await
    }

    /// [`Op::send_shared`] to group rank `to`.
    pub(crate) async fn send_shared<T: Element>(
        &self,
        to: usize,
        step: u32,
        v: &Rc<Vec<T>>,
        range: std::ops::Range<usize>,
        lent: &Lent,
    ) -> Result<(), CollectiveError> {
        self.op
            .send_shared(self.op_rank(to), self.step(step), v, range, lent)
            .await
    }

    /// [`Op::reclaim`] of a vector sent to group rank `to`.
    pub(crate) async fn reclaim<T>(&self, to: usize, v: Rc<Vec<T>>, lent: &Lent) -> Vec<T> {
        self.op.reclaim(self.op_rank(to), v, lent).await
    }

    /// [`Op::send_elems_led`] to group rank `to`.
    pub(crate) async fn send_elems_led<T: Element>(
        &self,
        to: usize,
        step: u32,
        lead: &[u8],
        xs: &[T],
    ) -> Result<(), CollectiveError> {
        self.op
            .send_elems_led(self.op_rank(to), self.step(step), lead, xs)
            .await
    }

    /// [`Op::send_elems`] to group rank `to`.
    pub(crate) async fn send_elems<T: Element>(
        &self,
        to: usize,
        step: u32,
        xs: &[T],
    ) -> Result<(), CollectiveError> {
        self.op
            .send_elems(self.op_rank(to), self.step(step), xs)
            .await
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        self.state.retire(self.id);
    }
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("id", &format_args!("{:#x}", self.id))
            .field("rank", &self.rank)
            .field("size", &self.members.len())
            .field("next_seq", &self.next_seq)
            .finish_non_exhaustive()
    }
}

impl Drop for Op {
    fn drop(&mut self) {
        if !self.ended.get() {
            // Dropped before it ended: the other ranks would wait for this one until their
            // deadline.
            self.state.end(self.comm, self.seq);
            self.state
                .revoke(self.comm, self.rank as u32, AbortCause::Cancelled);
            self.abort_others(AbortCause::Cancelled);
        }
    }
}

/// Step of a rank's view of the survivors, sent to coordinator `c` (see [`agree_on_survivors`]).
fn view_step(c: usize) -> u32 {
    c as u32
}

/// Step of coordinator `c`'s answer: the survivors.
fn survivors_step(c: usize) -> u32 {
    1 << PHASE_SHIFT | c as u32
}

/// The rank a loss names, when `e` is one: that rank is gone for the agreement.
fn lost_rank(e: &CollectiveError) -> Option<usize> {
    match e {
        CollectiveError::RankFailed { failed, .. } => Some(*failed),
        _ => None,
    }
}

/// The agreement of [`Communicator::shrink`], on its own communicator (`op`, with the ranks of
/// the one being shrunk): returns the coordinator that decided and the surviving ranks, in
/// rank order. `born` is the loss epoch when the shrunk communicator was made.
///
/// Each round, a rank takes the lowest rank it sees alive as coordinator. Any other rank
/// sends it its view (one byte per rank: 1 alive) and waits for the answer; the coordinator
/// waits for the view of every rank it sees alive (a rank lost meanwhile is left out) and
/// answers each rank it heard from with the ranks that it and every one of them see alive
/// (as little-endian `u32`s). When the coordinator fails (lost, or a send to it fails), the
/// rank marks it dead and goes on with the next. Every round marks a rank dead, so there are
/// at most as many rounds as ranks; the operation's deadline bounds the waits.
async fn agree_on_survivors(op: &Op, born: u64) -> Result<(usize, Vec<usize>), CollectiveError> {
    let (n, me) = (op.size(), op.rank());
    // Read after the operation began: a loss from now on ends the waits on that rank.
    let mut alive: Vec<bool> = op
        .members()
        .iter()
        .map(|m| !op.state.lost_since(m.node, born))
        .collect();
    alive[me] = true;
    // A rank found dead; false when it was already (nothing new learnt: give up).
    let gone = |alive: &mut Vec<bool>, e: CollectiveError| match lost_rank(&e) {
        Some(r) if r != me && alive[r] => {
            alive[r] = false;
            Ok(())
        }
        _ => Err(e),
    };
    loop {
        let c = alive.iter().position(|&a| a).unwrap_or(me);
        if c != me {
            let view: Vec<u8> = alive.iter().map(|&a| u8::from(a)).collect();
            if let Err(e) = op.send(c, view_step(c), view).await {
                gone(&mut alive, e)?;
                continue;
            }
            match op.recv(c, survivors_step(c)).await {
                Ok(bytes) => {
                    let mut survivors = Vec::with_capacity(bytes.len() / 4);
                    for w in bytes.chunks(4) {
                        let r = <[u8; 4]>::try_from(w).map(u32::from_le_bytes);
                        match r {
                            Ok(r) if (r as usize) < n && survivors.last() < Some(&(r as usize)) => {
                                survivors.push(r as usize)
                            }
                            _ => return Err(op.mismatch(c, "a malformed list of survivors")),
                        }
                    }
                    return Ok((c, survivors));
                }
                Err(e) => gone(&mut alive, e)?,
            }
            continue;
        }
        // The coordinator.
        let mut common = alive.clone();
        let mut heard = vec![false; n];
        heard[me] = true;
        for r in 0..n {
            if r == me || !alive[r] {
                continue;
            }
            match op.recv(r, view_step(me)).await {
                Ok(view) if view.len() == n => {
                    heard[r] = true;
                    for (c, v) in common.iter_mut().zip(view.iter()) {
                        *c &= *v == 1;
                    }
                }
                Ok(_) => return Err(op.mismatch(r, "a view of another number of ranks")),
                Err(e) => gone(&mut alive, e)?,
            }
        }
        let survivors: Vec<usize> = (0..n).filter(|&r| heard[r] && common[r]).collect();
        let answer: Vec<u8> = survivors
            .iter()
            .flat_map(|&r| (r as u32).to_le_bytes())
            .collect();
        // Every rank that took part hears the outcome, also one left out (it then fails with
        // `Excluded` instead of waiting); a rank that fails now is found by the new
        // communicator's first operation.
        for r in (0..n).filter(|&r| r != me && heard[r]) {
            let _ = op.send(r, survivors_step(me), answer.clone()).await;
        }
        return Ok((me, survivors));
    }
}

/// Messages longer than this (the default rendezvous threshold, `NetConfig::rndv_threshold`)
/// are handed to UCX as owned buffers when this shard holds the rail; shorter ones are sent
/// from where they are (UCX copies them at once, eager).
const RNDV_OVER: usize = 8 << 10;

/// Most bytes this shard's rails to one node may hold unsent (queued, or with UCX and not
/// completed) before a large send of a collective waits for them to drain ([`room_ahead`]).
const SEND_AHEAD: u64 = 16 << 20;

/// How often [`room_ahead`] looks whether the rails have drained.
const ROOM_POLL: Duration = Duration::from_micros(20);

/// Waits until this shard's rails to `to` hold at most [`SEND_AHEAD`] bytes with `len` more
/// (or nothing): a rank that sends without waiting for an answer (a broadcast's root, called
/// in a loop) would otherwise run ahead of a slower receiver until the rail refuses the send
/// at `NetConfig::max_backlog_bytes` ([`NetError::Backlogged`]), failing the operation. Every
/// send to another node's shard over the rendezvous threshold, and every part of one over
/// [`SEGMENT`], looks first. The operation's deadline bounds the wait; a rail that fails
/// lets go of its frames; an eager message (at most [`RNDV_OVER`] bytes) never waits. What it
/// does not see: a send through another shard of this node
/// (that shard's rail, reached through the mesh), and the sends of other operations that
/// looked at the same moment (each is let through: with the rail's limit at four times
/// [`SEND_AHEAD`], it takes several large operations at once on one shard to reach it).
async fn room_ahead(node: &Node, to: NodeId, len: usize) {
    if len <= RNDV_OVER {
        // Eager: UCX copies it at once, and an abort (empty, from a task with no deadline of
        // its own) must not wait behind a stalled peer's backlog.
        return;
    }
    let ctx = node.shard_ctx();
    loop {
        let held = ctx.backlog_bytes(to);
        if held == 0 || held.saturating_add(len as u64) <= SEND_AHEAD {
            return;
        }
        sleep(ROOM_POLL).await;
    }
}

/// Tells the task that lent a vector to sends ([`Op::send_shared`]) when one of them lets go of
/// it: each send carries a [`Release`] guard, dropped right after its clone of the vector.
#[derive(Default)]
pub(crate) struct Lent(Rc<Cell<Option<Waker>>>);

impl Lent {
    /// The guard a send carries.
    fn release(&self) -> Release {
        Release(self.0.clone())
    }

    /// Resolves after the next release (or a spurious wake-up: the caller looks again).
    async fn released(&self) {
        let mut waited = false;
        poll_fn(|cx| {
            if waited {
                return Poll::Ready(());
            }
            waited = true;
            self.0.set(Some(cx.waker().clone()));
            Poll::Pending
        })
        .await
    }
}

/// Wakes the task waiting in [`Lent::released`] when dropped.
struct Release(Rc<Cell<Option<Waker>>>);

impl Drop for Release {
    fn drop(&mut self) {
        if let Some(w) = self.0.take() {
            w.wake();
        }
    }
}

/// How long an abort may take to reach one rank.
const ABORT_DEADLINE: Duration = Duration::from_secs(1);

/// Sends message `h` with `data` to member `to` (see [`Op::send`]).
async fn deliver_to(node: &Node, to: Member, h: Header, data: Vec<u8>) -> Result<(), Error> {
    let me = node.id();
    if to.node == me && to.shard == node.shard() {
        state::of(node.shard_ctx()).deliver(me, h, Data::Owned(data));
        return Ok(());
    }
    if to.node != me && data.len() <= SEGMENT {
        let peer = to.peer();
        let here = node.shard_ctx().rail(to.node, to.shard).is_some();
        if here && data.len() > RNDV_OVER {
            // This shard holds the rail: the vector is moved to UCX, which sends it from where
            // it is (by rendezvous), instead of copied into a buffer of the rail's.
            room_ahead(node, to.node, data.len()).await;
            return peer.am_send_buf(COLLECTIVE_AM, &h.encode(), data);
        }
        if let Some(sent) = send_here(node, to, &h, &data) {
            return sent;
        }
    }
    // Boxed: the state of a send that may wait (a forward through the mesh, a connection, a
    // deadline) is many times that of the rest of an operation, and would otherwise be part
    // of every operation's future, copied whole each time it is moved.
    Box::pin(deliver_waiting(node, to, h, data)).await
}

/// Sends `bytes` (with header `h`) to `to`, another node's shard, at once on this shard's rail:
/// UCX takes the frame, or it is queued behind the rail's earlier frames; nothing to wait for.
/// `None` when this shard holds no ready rail to `to` (another shard's, or none yet).
fn send_here(node: &Node, to: Member, h: &Header, bytes: &[u8]) -> Option<Result<(), Error>> {
    let dest = to.peer().dest();
    match crate::node::send_now(node.shard_ctx(), dest, COLLECTIVE_AM, &h.encode(), bytes) {
        Err(Error::Net(NetError::NotConnected { .. } | NetError::OtherShard { .. })) => None,
        sent => Some(sent),
    }
}

/// [`deliver_to`] by the paths that may wait: a shard of this node through the mesh, another
/// node's shard on a rail this shard does not hold or that is not up yet, and messages of more
/// than one part.
async fn deliver_waiting(node: &Node, to: Member, h: Header, data: Vec<u8>) -> Result<(), Error> {
    if to.node == node.id() {
        let from = node.id();
        node.shard_ctx()
            .forward(to.shard, move |ctx| async move {
                state::of(&ctx).deliver(from, h, Data::Owned(data));
            })
            .await?;
        return Ok(());
    }
    let peer = to.peer();
    let timeout = if matches!(h.kind, Kind::Abort(_)) {
        ABORT_DEADLINE
    } else {
        node.default_deadline()
    };
    if data.len() <= SEGMENT {
        room_ahead(node, to.node, data.len()).await;
        return peer
            .am_send_within(COLLECTIVE_AM, &h.encode(), &data, timeout)
            .await;
    }
    for (i, part) in data.chunks(SEGMENT).enumerate() {
        let part_h = Header {
            offset: (i * SEGMENT) as u64,
            ..h
        };
        room_ahead(node, to.node, part.len()).await;
        peer.am_send_within(COLLECTIVE_AM, &part_h.encode(), part, timeout)
            .await?;
    }
    Ok(())
}

/// The number of shards of node `n`, from this shard's session with it, once the rails this
/// shard holds to it are ready: connected to first when its address is known; waited for
/// until `start + timeout` otherwise.
async fn remote_shard_count(
    node: &Node,
    n: NodeId,
    start: Instant,
    timeout: Duration,
) -> Result<u16, CollectiveError> {
    let mut tried_connect = false;
    loop {
        let ctx = node.shard_ctx();
        let session = ctx.session(n);
        if let Some(remote) = &session {
            // Ready once every rail this shard holds to the node is (`owner_of_shard` knows
            // no owner for a rail not up yet: the rails' own rule says whose it is).
            let local = u16::try_from(ctx.shard_count()).unwrap_or(u16::MAX);
            let rails = Rails::new(local, remote.shard_count).ok();
            let ready = (0..remote.shard_count).all(|j| {
                let j = ShardId::new(j);
                let mine = rails.is_none_or(|r| r.owner_of_remote(j) == ctx.id());
                !mine || ctx.rail(n, j).is_some()
            });
            if ready {
                return Ok(remote.shard_count);
            }
        }
        let left = timeout.saturating_sub(start.elapsed());
        if left.is_zero() {
            return Err(CollectiveError::Unreachable {
                op: "world",
                node: n,
                cause: format!("no session within {timeout:?}"),
            });
        }
        if !tried_connect && node.known_peers().iter().any(|(p, _)| p.node_id() == n) {
            tried_connect = true;
            if let Err(e) = crate::node::connect_lazily(node, n, left).await {
                return Err(CollectiveError::Unreachable {
                    op: "world",
                    node: n,
                    cause: e.to_string(),
                });
            }
            continue;
        }
        sleep(SESSION_POLL.min(left)).await;
    }
}

/// An error of the operation a communicator was made with, named after the creation.
fn rename(mut e: CollectiveError, name: &'static str) -> CollectiveError {
    match &mut e {
        CollectiveError::TimedOut { op, .. }
        | CollectiveError::RankFailed { op, .. }
        | CollectiveError::Aborted { op, .. }
        | CollectiveError::Revoked { op, .. }
        | CollectiveError::Mismatch { op, .. }
        | CollectiveError::InvalidArgument { op, .. }
        | CollectiveError::Excluded { op, .. }
        | CollectiveError::ShuttingDown { op, .. } => *op = name,
        CollectiveError::Unreachable { .. }
        | CollectiveError::Discovery { .. }
        | CollectiveError::NotOnShard => {}
    }
    e
}

/// FNV-1a over the words, then a 64-bit finalizer (communicator ids: the same inputs give
/// the same id on every rank; different inputs collide with probability about 2^-64).
fn hash(words: impl IntoIterator<Item = u64>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for w in words {
        for b in w.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}
