//! The algorithms, and how one is chosen.
//!
//! Every algorithm is written against one operation's `send(to, step, bytes)` and
//! `recv(from, step)`; a message is named by its step, so each pair of ranks uses a step
//! number at most once per operation and messages may arrive in any order. An
//! operation made of phases (a reduce-scatter then an all-gather) gives each phase its own
//! range of steps (`phase << PHASE_SHIFT`).
//!
//! With `p` ranks and `n` bytes per rank:
//!
//! | operation | small (`n` < [`Tuning::large_from`], or cheaper by [`Tuning::costs`]) | large |
//! | --- | --- | --- |
//! | barrier | dissemination, ⌈log2 p⌉ rounds | – |
//! | broadcast | binomial tree (in pieces of at most 256 KiB, each passed on as it comes) | scatter (binomial) + ring all-gather (p > 2) |
//! | reduce | binomial tree | ring reduce-scatter + binomial gather (commutative, p > 2) |
//! | barrier, broadcast, reduce over several nodes | through the leaders (below), each level flat as above | the same |
//! | all-reduce | recursive doubling (non-powers of two folded in; each exchange pipelined in chunks of at most 256 KiB) | ring reduce-scatter + ring all-gather (commutative, p > 2); two ranks, 256 KiB to 4 MiB of built-in numbers: by halves, each rank reducing one and sending it from its result (any operator) |
//! | all-reduce over several nodes | through the leaders, unless every node has the same power-of-two number of ranks numbered node by node | by slices: a node's ranks reduce-scatter, rank `s` of every node all-reduces slice `s`, a node's ranks all-gather (commutative, as many ranks on every node) |
//! | reduce-scatter | reduce to rank 0 + scatter (each as above, so through the leaders over several nodes) | ring (commutative) |
//! | all-gather | Bruck, ⌈log2 p⌉ rounds | ring |
//! | all-gather over several nodes | through the leaders: gather at each leader, ring of the leaders, broadcast in each node | ring |
//! | gather, scatter | binomial tree | binomial tree |
//! | gather, scatter over several nodes | through the leaders, each level a binomial tree | the same |
//! | all-to-all | pairwise exchange, p − 1 rounds | pairwise exchange |
//! | scan, exclusive scan | recursive doubling | recursive doubling |
//!
//! Non-commutative operators always take the tree and recursive-doubling forms (and, on two
//! ranks, the halves, which combine each element once in rank order), which combine
//! contiguous blocks of ranks, lower ranks on the left: the result is `x0 ∘ x1 ∘ … ∘ x(p-1)`
//! (through the leaders only when every node's ranks are contiguous).
//!
//! Hierarchical forms ([`Tuning::with_hierarchical`], on by default; taken when the ranks span
//! several nodes and some node has several of them) run sub-algorithms on groups of the
//! operation's ranks: a node's ranks talk through the cross-shard mesh, ranks of different
//! nodes on their rails. Through the leaders, one rank per node (the root on the root's node,
//! else the node's first rank) carries its node's part across nodes: a barrier, a broadcast,
//! a reduce, a gather, a scatter, a small reduce-scatter (a reduce and a scatter), a small
//! all-gather and a small or unevenly spread all-reduce cross nodes with one
//! rank per node instead of all of them (two nodes of two ranks: a broadcast from rank 1
//! crosses once instead of three times, a barrier twice instead of six). Recursive doubling over
//! ranks numbered node by node, with the same power of two on every node, is already
//! hierarchical: its first rounds pair a node's shards, the later ones each shard with its
//! counterparts on the other nodes.

use std::borrow::Cow;
use std::ops::Range;

use std::rc::Rc;

use super::comm::{Group, Lent, PHASE_SHIFT};
use super::cost::{Costs, Shape};
use super::element::{
    combine_in_turns, combine_le_append_in_turns, combine_le_in_turns, decode_in_turns,
    decode_into_in_turns, encode_in_turns, extend_from_le_in_turns, Element, Operator,
};
use super::error::CollectiveError;
use super::state::{Bytes, MAX_BUFFERED_BYTES};

/// The algorithm an operation used ([`super::Communicator::last_algorithm`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Algorithm {
    /// Barrier: in round `k` each rank signals rank `r + 2^k`.
    Dissemination,
    /// A binomial tree rooted at the root (or at rank 0 for a non-commutative reduce).
    BinomialTree,
    /// Pairs of ranks `r ^ 2^k` exchange and combine.
    RecursiveDoubling,
    /// Around the ring of ranks, one block per step (on two ranks, an all-reduce by halves).
    Ring,
    /// Bruck's all-gather: blocks doubling each round.
    Bruck,
    /// All-to-all: in round `k`, rank `r` sends to `r + k` and receives from `r - k`.
    Pairwise,
    /// Reduce to rank 0 on a binomial tree, then scatter.
    ReduceThenScatter,
    /// Broadcast: scatter the blocks, then a ring all-gather.
    ScatterAllGather,
    /// Reduce: ring reduce-scatter, then gather the blocks at the root.
    ReduceScatterGather,
    /// Through the nodes' leaders: each node's ranks combine (all-reduce, reduce), gather
    /// (all-gather) or report (barrier) at their leader through the mesh, the leaders run the
    /// operation across nodes on their rails, and each leader hands the result to its node
    /// (broadcast: the root to the other nodes' leaders, each leader to its node).
    Hierarchical,
    /// All-reduce: each node's ranks reduce-scatter through the mesh, each slice is all-reduced
    /// by the ranks holding it on every node (each on its own rail), each node all-gathers.
    HierarchicalSlices,
}

/// What chooses the algorithms: the same on every rank of a communicator. By default a fixed
/// size, [`Tuning::large_from`], separates small messages from large ones; with measured
/// [`Costs`] ([`Tuning::with_costs`]) a cost model chooses per operation, rank count and size
/// (see [`super::cost`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuning {
    large_from: usize,
    hierarchical: bool,
    costs: Option<Costs>,
}

/// Default of [`Tuning::large_from`]: 64 KiB.
pub const DEFAULT_LARGE_FROM: usize = 64 << 10;

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            large_from: DEFAULT_LARGE_FROM,
            hierarchical: true,
            costs: None,
        }
    }
}

impl Tuning {
    /// Operations on at least this many bytes per rank take the large-message algorithms
    /// (see the module docs); `0` always, `usize::MAX` never. With [`Tuning::costs`], only
    /// all-gather still chooses by it (see [`super::cost`]).
    pub fn large_from(self) -> usize {
        self.large_from
    }

    /// With [`Tuning::large_from`] set to `bytes`, and no [`Tuning::costs`]: the fixed
    /// threshold decides for every operation.
    pub fn with_large_from(self, bytes: usize) -> Tuning {
        Tuning {
            large_from: bytes,
            costs: None,
            ..self
        }
    }

    /// The measured costs the algorithms are chosen by, if any.
    pub fn costs(self) -> Option<Costs> {
        self.costs
    }

    /// With the algorithms of all-reduce, broadcast, reduce and reduce-scatter (and the
    /// hierarchical all-reduce's form) chosen by the cost model with `costs` (e.g.
    /// `Costs::load` of the file `shardcx bench --test allreduce --save-costs FILE` wrote on
    /// this machine); all-gather keeps [`Tuning::large_from`]. Give every rank of a
    /// communicator the same costs.
    pub fn with_costs(self, costs: Costs) -> Tuning {
        Tuning {
            costs: Some(costs),
            ..self
        }
    }

    /// Whether barrier, broadcast, reduce, gather, scatter, all-gather (small blocks) and
    /// all-reduce may take a hierarchical form when the ranks span several nodes (default:
    /// yes; see the module docs).
    pub fn hierarchical(self) -> bool {
        self.hierarchical
    }

    /// With [`Tuning::hierarchical`] set to `on`.
    pub fn with_hierarchical(self, on: bool) -> Tuning {
        Tuning {
            hierarchical: on,
            ..self
        }
    }

    fn large(&self, bytes: usize) -> bool {
        bytes >= self.large_from
    }

    /// Whether `shape` on `p` ranks (nodes, for [`Shape::AllReduceOverNodes`]) and `bytes`
    /// takes its large-message algorithm: by the cost model when there are costs, else by
    /// [`Tuning::large_from`].
    fn large_for(&self, shape: Shape, p: usize, bytes: usize) -> bool {
        match self.costs {
            Some(c) => c.prefers_large(shape, p, bytes),
            None => self.large(bytes),
        }
    }
}

/// Block `i` of `n` items cut into `p` blocks whose sizes differ by at most one.
fn block(n: usize, p: usize, i: usize) -> Range<usize> {
    let (base, extra) = (n / p, n % p);
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

/// The range covering blocks `first..first + count` (clipped to `p`).
fn blocks(n: usize, p: usize, first: usize, count: usize) -> Range<usize> {
    let last = (first + count).min(p);
    if first >= last {
        let s = block(n, p, first.min(p - 1)).end;
        return s..s;
    }
    block(n, p, first).start..block(n, p, last - 1).end
}

fn step(phase: u32, i: usize) -> u32 {
    (phase << PHASE_SHIFT) | i as u32
}

/// Rank of virtual rank `v` in a tree rooted at `root`.
fn real(v: usize, root: usize, p: usize) -> usize {
    (v + root) % p
}

/// Receives `len` bytes from `from`, or a mismatch naming it.
async fn recv_len(
    g: &Group<'_>,
    from: usize,
    st: u32,
    len: usize,
) -> Result<Bytes, CollectiveError> {
    let d = g.recv(from, st).await?;
    if d.len() != len {
        return Err(g.mismatch(from, format!("{} bytes where {len} were expected", d.len())));
    }
    Ok(d)
}

/// Receives `acc.len()` elements from `from` and combines them into `acc` (`from` holds the
/// lower ranks' contribution when `from_lower`), straight from the received bytes.
async fn recv_combine<T: Element, O: Operator<T> + ?Sized>(
    g: &Group<'_>,
    from: usize,
    st: u32,
    o: &O,
    acc: &mut [T],
    from_lower: bool,
) -> Result<(), CollectiveError> {
    let d = recv_len(g, from, st, acc.len() * T::SIZE).await?;
    combine_le_in_turns(o, acc, &d, from_lower).await;
    Ok(())
}

/// Most bytes of one message of a pipelined exchange ([`exchange_combine`]).
const CHUNK: usize = 256 << 10;

/// Most chunks of one pipelined exchange (larger vectors get larger chunks).
const MAX_CHUNKS: usize = 1024;

/// Chunks a pipelined exchange keeps sent ahead of the one it combines.
const AHEAD: usize = 2;

/// One exchange of recursive doubling, pipelined: `acc` goes to `peer` and what `peer` sends
/// (as long) is combined into it (`peer` holds the lower ranks' contribution when
/// `peer_is_lower`), in chunks of at most [`CHUNK`] bytes, each its own message (step
/// `step(phase, k * MAX_CHUNKS + c)`): chunk `c` is combined while chunks up to `c + AHEAD`
/// are on their way, so a chunk is reduced while it is still in cache and the next ones move
/// meanwhile. When `acc` is still the caller's (borrowed), the combination is written straight
/// into a new vector (no copy of it first).
async fn exchange_combine<T: Element, O: Operator<T> + ?Sized>(
    g: &Group<'_>,
    peer: usize,
    (phase, k): (u32, usize),
    o: &O,
    acc: Cow<'_, [T]>,
    peer_is_lower: bool,
) -> Result<Vec<T>, CollectiveError> {
    let n = acc.len();
    let chunks = (n * T::SIZE).div_ceil(CHUNK).clamp(1, MAX_CHUNKS);
    let per = n.div_ceil(chunks).max(1);
    let range = |c: usize| (c * per).min(n)..((c + 1) * per).min(n);
    let st = |c: usize| step(phase, k * MAX_CHUNKS + c);
    if chunks == 1 {
        // One message: no pipeline to set up.
        g.send_elems(peer, st(0), &acc).await?;
        return recv_combine_cow(g, peer, st(0), o, acc, peer_is_lower).await;
    }
    // The first chunk carries the vector's whole length (see `TOTAL_LEN`).
    let total = total_lead(n * T::SIZE);
    for c in 0..AHEAD.min(chunks) {
        let lead: &[u8] = if c == 0 { &total } else { &[] };
        g.send_elems_led(peer, st(c), lead, &acc[range(c)]).await?;
    }
    let mut out = match acc {
        Cow::Owned(v) => Ok(v),
        Cow::Borrowed(mine) => Err((mine, Vec::with_capacity(n))),
    };
    for c in 0..chunks {
        let r = range(c);
        let len = r.len() * T::SIZE;
        let d = recv_total(g, peer, st(c), len, (c == 0).then_some(n * T::SIZE)).await?;
        let d = &d[d.len() - len..];
        match &mut out {
            Ok(v) => combine_le_in_turns(o, &mut v[r], d, peer_is_lower).await,
            Err((mine, v)) => combine_le_append_in_turns(o, &mine[r], d, peer_is_lower, v).await,
        }
        if c + AHEAD < chunks {
            let ahead = range(c + AHEAD);
            match &out {
                Ok(v) => g.send_elems(peer, st(c + AHEAD), &v[ahead]).await?,
                Err((mine, _)) => g.send_elems(peer, st(c + AHEAD), &mine[ahead]).await?,
            }
        }
    }
    Ok(match out {
        Ok(v) | Err((_, v)) => v,
    })
}

/// [`recv_combine`] into `acc` when it is owned already; when it is still the caller's
/// (borrowed), the combination is written straight into a new vector (no copy of it first).
async fn recv_combine_cow<T: Element, O: Operator<T> + ?Sized>(
    g: &Group<'_>,
    from: usize,
    st: u32,
    o: &O,
    acc: Cow<'_, [T]>,
    from_lower: bool,
) -> Result<Vec<T>, CollectiveError> {
    match acc {
        Cow::Owned(mut v) => {
            recv_combine(g, from, st, o, &mut v, from_lower).await?;
            Ok(v)
        }
        Cow::Borrowed(mine) => {
            let d = recv_len(g, from, st, mine.len() * T::SIZE).await?;
            let mut v = Vec::new();
            combine_le_append_in_turns(o, mine, &d, from_lower, &mut v).await;
            Ok(v)
        }
    }
}

/// Receives `len` elements from `from`.
async fn recv_elems<T: Element>(
    g: &Group<'_>,
    from: usize,
    st: u32,
    len: usize,
) -> Result<Vec<T>, CollectiveError> {
    let d = recv_len(g, from, st, len * T::SIZE).await?;
    decode_in_turns(&d)
        .await
        .ok_or_else(|| g.mismatch(from, "a length that is not a whole number of elements"))
}

/// The two levels of an operation's hierarchical form: this rank's node (`local`, group phase
/// 1, led by its group rank `leader`) and, on the leaders only, one rank of every node
/// (`leaders`, group phase 2, in node order): the root on the root's node, every other node's
/// first rank; the root's node is `root_at` there. Ranks of one node talk through the
/// cross-shard mesh, leaders on their rails.
struct Levels<'a> {
    local: Group<'a>,
    leader: usize,
    leaders: Option<Group<'a>>,
    root_at: usize,
}

/// The levels of a hierarchical form rooted at `root`, or `None` when the operation stays
/// flat: [`Tuning::hierarchical`] off, the ranks on one node, or one rank on every node.
/// `in_rank_order` asks for every node's ranks to be contiguous too (what a non-commutative
/// reduction through the leaders needs).
fn levels<'a>(
    g: &Group<'a>,
    root: usize,
    in_rank_order: bool,
) -> Result<Option<Levels<'a>>, CollectiveError> {
    let p = g.size();
    let blocks = g.node_blocks();
    if !g.tuning().hierarchical() || blocks.len() < 2 || blocks.len() >= p {
        return Ok(None);
    }
    if in_rank_order && !blocks.iter().flatten().copied().eq(0..p) {
        return Ok(None);
    }
    let heads: Vec<usize> = blocks
        .iter()
        .map(|b| if b.contains(&root) { root } else { b[0] })
        .collect();
    let node = blocks
        .iter()
        .position(|b| b.contains(&g.rank()))
        .ok_or_else(|| g.invalid("this rank is on no node"))?;
    let leader = blocks[node]
        .iter()
        .position(|&r| r == heads[node])
        .ok_or_else(|| g.invalid("a node's leader is not on it"))?;
    let root_at = blocks
        .iter()
        .position(|b| b.contains(&root))
        .ok_or_else(|| g.invalid("the root is on no node"))?;
    let local = g
        .sub(blocks[node].clone(), 1)
        .ok_or_else(|| g.invalid("this rank is not in its node's group"))?;
    let leaders = if g.rank() == heads[node] {
        Some(
            g.sub(heads, 2)
                .ok_or_else(|| g.invalid("a node's leader is not among the leaders"))?,
        )
    } else {
        None
    };
    Ok(Some(Levels {
        local,
        leader,
        leaders,
        root_at,
    }))
}

/// Barrier: through the leaders when the ranks span several nodes (a node's ranks report to
/// their leader through the mesh, the leaders run a dissemination barrier, each leader releases
/// its node), else a dissemination barrier.
pub(crate) async fn barrier(g: &Group<'_>) -> Result<(), CollectiveError> {
    if let Some(lv) = levels(g, 0, false)? {
        fan_in(&lv.local, lv.leader).await?;
        if let Some(leaders) = &lv.leaders {
            dissemination(leaders).await?;
        }
        binomial_bcast(&lv.local, lv.leader, &mut [], 1).await?;
        g.chose(Algorithm::Hierarchical);
        return Ok(());
    }
    g.chose(Algorithm::Dissemination);
    dissemination(g).await
}

/// Dissemination barrier: in round `k` each rank signals rank `r + 2^k`.
async fn dissemination(g: &Group<'_>) -> Result<(), CollectiveError> {
    let (r, p) = (g.rank(), g.size());
    let (mut dist, mut k) = (1, 0);
    while dist < p {
        g.send((r + dist) % p, step(0, k), Vec::new()).await?;
        g.recv((r + p - dist) % p, step(0, k)).await?;
        dist <<= 1;
        k += 1;
    }
    Ok(())
}

/// Empty messages up a binomial tree to `root` (step 0 of phase 0): it returns on `root` once
/// every rank has entered.
async fn fan_in(g: &Group<'_>, root: usize) -> Result<(), CollectiveError> {
    let (r, p) = (g.rank(), g.size());
    let vr = (r + p - root) % p;
    let mut mask = 1;
    while mask < p {
        if vr & mask != 0 {
            return g
                .send(real(vr - mask, root, p), step(0, 0), Vec::new())
                .await;
        }
        if vr + mask < p {
            recv_len(g, real(vr + mask, root, p), step(0, 0), 0).await?;
        }
        mask <<= 1;
    }
    Ok(())
}

/// Broadcast of `buf` (its bytes on the root; the same length everywhere): through the
/// leaders when the ranks span several nodes (the root to the other nodes' leaders, each
/// leader to its node through the mesh), else flat.
pub(crate) async fn broadcast(
    g: &Group<'_>,
    root: usize,
    buf: &mut [u8],
) -> Result<(), CollectiveError> {
    if let Some(lv) = levels(g, root, false)? {
        if let Some(leaders) = &lv.leaders {
            flat_broadcast(leaders, lv.root_at, buf).await?;
        }
        flat_broadcast(&lv.local, lv.leader, buf).await?;
        g.chose(Algorithm::Hierarchical);
        return Ok(());
    }
    flat_broadcast(g, root, buf).await
}

/// Flat broadcast: scatter + ring all-gather for large buffers (p > 2), else a binomial tree.
async fn flat_broadcast(g: &Group<'_>, root: usize, buf: &mut [u8]) -> Result<(), CollectiveError> {
    let p = g.size();
    if p > 2 && g.tuning().large_for(Shape::Broadcast, p, buf.len()) {
        g.chose(Algorithm::ScatterAllGather);
        scatter_allgather(g, root, buf).await
    } else {
        g.chose(Algorithm::BinomialTree);
        binomial_bcast(g, root, buf, 0).await
    }
}

async fn binomial_bcast(
    g: &Group<'_>,
    root: usize,
    buf: &mut [u8],
    phase: u32,
) -> Result<(), CollectiveError> {
    let (r, p) = (g.rank(), g.size());
    let vr = (r + p - root) % p;
    let mut mask = 1;
    let mut parent = None;
    while mask < p {
        if vr & mask != 0 {
            parent = Some(real(vr - mask, root, p));
            break;
        }
        mask <<= 1;
    }
    let mut children = Vec::new();
    mask >>= 1;
    while mask > 0 {
        if vr + mask < p {
            children.push(real(vr + mask, root, p));
        }
        mask >>= 1;
    }
    // In pieces, each passed on as soon as it is here: a rank forwards (or the root copies
    // out) the next piece while its children take the last, and no piece is larger than a
    // message's part, so none is put together in a vector of its own on arrival.
    // An empty buffer is still one (empty) message: a rank given a longer one hears of it.
    let pieces: Vec<Range<usize>> = match buf.len() {
        0 => std::iter::once(0..0).collect(),
        n => pieces::<u8>(0..n).collect(),
    };
    let several = pieces.len() > 1;
    for (c, piece) in pieces.into_iter().enumerate() {
        let lead = several && c == 0;
        if let Some(parent) = parent {
            let d = recv_total(
                g,
                parent,
                step(phase, c),
                piece.len(),
                lead.then_some(buf.len()),
            )
            .await?;
            buf[piece.clone()].copy_from_slice(&d[d.len() - piece.len()..]);
        }
        for &child in &children {
            let mut v = Vec::with_capacity(TOTAL_LEN + piece.len());
            if lead {
                v.extend_from_slice(&total_lead(buf.len()));
            }
            v.extend_from_slice(&buf[piece.clone()]);
            g.send(child, step(phase, c), v).await?;
        }
    }
    Ok(())
}

/// Bytes before the first of several pieces of one buffer: the buffer's whole length in
/// bytes, little-endian. The pieces alone could agree in length with what a rank given a
/// longer buffer expects and leave it waiting for pieces that never come; with the length it
/// fails at once with `Mismatch`.
const TOTAL_LEN: usize = 8;

/// The lead of the first of several pieces of a buffer of `bytes` bytes ([`TOTAL_LEN`]).
fn total_lead(bytes: usize) -> [u8; TOTAL_LEN] {
    (bytes as u64).to_le_bytes()
}

/// Receives a piece of `len` bytes from `from`: when `total` is given (the first of several
/// pieces), preceded by the sender's whole length, which must be `total`. Returns the message
/// (the piece is its last `len` bytes).
async fn recv_total(
    g: &Group<'_>,
    from: usize,
    st: u32,
    len: usize,
    total: Option<usize>,
) -> Result<Bytes, CollectiveError> {
    let Some(total) = total else {
        return recv_len(g, from, st, len).await;
    };
    let d = recv_len(g, from, st, TOTAL_LEN + len).await?;
    let mut t = [0u8; TOTAL_LEN];
    t.copy_from_slice(&d[..TOTAL_LEN]);
    let sent = u64::from_le_bytes(t);
    if sent != total as u64 {
        return Err(g.mismatch(
            from,
            format!("{sent} bytes in all where {total} were expected"),
        ));
    }
    Ok(d)
}

/// Van de Geijn's broadcast: the root's blocks scattered down a binomial tree, then a ring
/// all-gather (in virtual ranks, root first).
async fn scatter_allgather(
    g: &Group<'_>,
    root: usize,
    buf: &mut [u8],
) -> Result<(), CollectiveError> {
    let (r, p, n) = (g.rank(), g.size(), buf.len());
    let vr = (r + p - root) % p;
    let lowbit = vr & vr.wrapping_neg();
    if vr != 0 {
        let range = blocks(n, p, vr, lowbit.min(p - vr));
        let d = recv_len(g, real(vr - lowbit, root, p), step(0, 0), range.len()).await?;
        buf[range].copy_from_slice(&d);
    }
    let mut mask = if vr == 0 {
        p.next_power_of_two() >> 1
    } else {
        lowbit >> 1
    };
    while mask > 0 {
        if vr + mask < p {
            let range = blocks(n, p, vr + mask, mask.min(p - vr - mask));
            g.send(real(vr + mask, root, p), step(0, 0), buf[range].to_vec())
                .await?;
        }
        mask >>= 1;
    }
    let (right, left) = (real((vr + 1) % p, root, p), real((vr + p - 1) % p, root, p));
    for s in 0..p - 1 {
        let out = block(n, p, (vr + p - s) % p);
        g.send(right, step(1, s), buf[out].to_vec()).await?;
        let inn = block(n, p, (vr + 2 * p - s - 1) % p);
        let d = recv_len(g, left, step(1, s), inn.len()).await?;
        buf[inn].copy_from_slice(&d);
    }
    Ok(())
}

/// Reduce to `root`: `Some(result)` there. Through the leaders when the ranks span several
/// nodes (a node's ranks reduce to their leader through the mesh, the leaders to the root;
/// for a non-commutative operator only when every node's ranks are contiguous, so that the
/// rank order holds), else flat.
pub(crate) async fn reduce<T: Element, O: Operator<T> + ?Sized>(
    g: &Group<'_>,
    root: usize,
    data: Vec<T>,
    o: &O,
) -> Result<Option<Vec<T>>, CollectiveError> {
    if let Some(lv) = levels(g, root, !o.is_commutative())? {
        let partial = flat_reduce(&lv.local, lv.leader, data, o).await?;
        let mut out = None;
        if let Some(leaders) = &lv.leaders {
            let partial = partial.ok_or_else(|| g.invalid("a leader got no partial result"))?;
            out = flat_reduce(leaders, lv.root_at, partial, o).await?;
        }
        g.chose(Algorithm::Hierarchical);
        return Ok(out);
    }
    flat_reduce(g, root, data, o).await
}

/// Flat reduce: ring reduce-scatter + gather for large commutative reductions (p > 2), else a
/// binomial tree.
async fn flat_reduce<T: Element, O: Operator<T> + ?Sized>(
    g: &Group<'_>,
    root: usize,
    data: Vec<T>,
    o: &O,
) -> Result<Option<Vec<T>>, CollectiveError> {
    let p = g.size();
    if p > 2
        && o.is_commutative()
        && data.len() >= p
        && g.tuning().large_for(Shape::Reduce, p, data.len() * T::SIZE)
    {
        g.chose(Algorithm::ReduceScatterGather);
        let n = data.len();
        let mut acc = data;
        ring_reduce_scatter(g, &mut acc, o, 0).await?;
        let mine = encode_in_turns(&acc[block(n, p, g.rank())]).await;
        let lens: Vec<usize> = (0..p).map(|i| block(n, p, i).len() * T::SIZE).collect();
        let all = gather_blocks(g, root, mine, &lens, 1).await?;
        return match all {
            Some(b) => decode_in_turns(&b)
                .await
                .map(Some)
                .ok_or_else(|| g.mismatch(root, "a partial length")),
            None => Ok(None),
        };
    }
    g.chose(Algorithm::BinomialTree);
    reduce_tree(g, root, data, o, 0).await
}

/// Binomial-tree reduce. A non-commutative operator reduces on a tree rooted at rank 0
/// (contiguous blocks of ranks, lower on the left) and rank 0 sends the result on to `root`.
async fn reduce_tree<T: Element, O: Operator<T> + ?Sized>(
    g: &Group<'_>,
    root: usize,
    data: Vec<T>,
    o: &O,
    phase: u32,
) -> Result<Option<Vec<T>>, CollectiveError> {
    let (r, p) = (g.rank(), g.size());
    let tree_root = if o.is_commutative() { root } else { 0 };
    let vr = (r + p - tree_root) % p;
    let n = data.len();
    let mut acc = Some(data);
    let mut mask = 1;
    while mask < p {
        if vr & mask != 0 {
            if let Some(a) = acc.take() {
                g.send_elems(real(vr - mask, tree_root, p), step(phase, 0), &a)
                    .await?;
            }
            break;
        }
        if vr + mask < p {
            let from = real(vr + mask, tree_root, p);
            match acc.as_mut() {
                Some(a) => recv_combine(g, from, step(phase, 0), o, a, false).await?,
                None => {
                    recv_elems::<T>(g, from, step(phase, 0), n).await?;
                }
            }
        }
        mask <<= 1;
    }
    if tree_root == root {
        return Ok(if r == root { acc } else { None });
    }
    if r == tree_root {
        if let Some(a) = acc.take() {
            g.send_elems(root, step(phase, 1), &a).await?;
        }
    }
    if r == root {
        return Ok(Some(recv_elems(g, tree_root, step(phase, 1), n).await?));
    }
    Ok(None)
}

/// All-reduce: hierarchical when the ranks span several nodes and some node has several of
/// them (see [`Group::node_blocks`] and the module docs), flat otherwise.
pub(crate) async fn all_reduce<T: Element, O: Operator<T> + ?Sized>(
    g: &Group<'_>,
    data: Cow<'_, [T]>,
    o: &O,
) -> Result<Vec<T>, CollectiveError> {
    let (p, n) = (g.size(), data.len());
    let blocks = g.node_blocks();
    let (nodes, k) = (blocks.len(), blocks[0].len());
    let contiguous = blocks.iter().flatten().copied().eq(0..p);
    if g.tuning().hierarchical() && nodes > 1 && nodes < p && (o.is_commutative() || contiguous) {
        let same = blocks.iter().all(|b| b.len() == k);
        // With as many ranks on every node, a power of two, numbered node by node, recursive
        // doubling already pairs a node's shards first, then each shard with its counterparts
        // on the other nodes (on their own rails): nothing to gain from leaders.
        let flat = same && k.is_power_of_two() && contiguous;
        let slices = g.tuning().large_for(
            Shape::AllReduceOverNodes {
                k,
                otherwise_flat: flat,
            },
            nodes,
            n * T::SIZE,
        );
        if o.is_commutative() && same && n >= k && slices {
            return sliced_all_reduce(g, &blocks, data.into_owned(), o).await;
        }
        if !flat {
            return leaders_all_reduce(g, &blocks, data.into_owned(), o).await;
        }
    }
    flat_all_reduce(g, data, o).await
}

/// Hierarchical all-reduce through the leaders: each node's ranks reduce to the lowest of them
/// through the mesh (binomial tree), the leaders all-reduce across nodes (flat), and each
/// leader broadcasts to its node. Rank order holds when every node's ranks are contiguous.
async fn leaders_all_reduce<T: Element, O: Operator<T> + ?Sized>(
    g: &Group<'_>,
    blocks: &[Vec<usize>],
    data: Vec<T>,
    o: &O,
) -> Result<Vec<T>, CollectiveError> {
    let n = data.len();
    let mine = blocks
        .iter()
        .find(|b| b.contains(&g.rank()))
        .ok_or_else(|| g.invalid("this rank is on no node"))?;
    let local = g
        .sub(mine.clone(), 1)
        .ok_or_else(|| g.invalid("this rank is not in its node's group"))?;
    let partial = reduce_tree(&local, 0, data, o, 0).await?;
    let mut bytes = match partial {
        Some(p) => {
            let leaders = g
                .sub(blocks.iter().map(|b| b[0]).collect(), 2)
                .ok_or_else(|| g.invalid("a node's first rank is not a leader"))?;
            let all = flat_all_reduce(&leaders, Cow::Owned(p), o).await?;
            encode_in_turns(&all).await
        }
        None => vec![0u8; n * T::SIZE],
    };
    binomial_bcast(&local, 0, &mut bytes, 1).await?;
    g.chose(Algorithm::Hierarchical);
    g.decode_result(&bytes).await
}

/// Hierarchical all-reduce by slices, for `k` ranks on every node: each node's ranks
/// reduce-scatter the vector into `k` slices through the mesh (ring), the `s`-th rank of every
/// node all-reduces slice `s` with its counterparts on the other nodes (each shard on its own
/// rail), and each node's ranks all-gather the slices (ring). Commutative operators only.
async fn sliced_all_reduce<T: Element, O: Operator<T> + ?Sized>(
    g: &Group<'_>,
    blocks: &[Vec<usize>],
    data: Vec<T>,
    o: &O,
) -> Result<Vec<T>, CollectiveError> {
    let n = data.len();
    let (node, s) = blocks
        .iter()
        .enumerate()
        .find_map(|(i, b)| b.iter().position(|&r| r == g.rank()).map(|s| (i, s)))
        .ok_or_else(|| g.invalid("this rank is on no node"))?;
    let k = blocks[node].len();
    let local = g
        .sub(blocks[node].clone(), 1)
        .ok_or_else(|| g.invalid("this rank is not in its node's group"))?;
    let mut acc = data;
    ring_reduce_scatter(&local, &mut acc, o, 0).await?;
    let slice = block(n, k, s);
    let column = g
        .sub(blocks.iter().map(|b| b[s]).collect(), 2)
        .ok_or_else(|| g.invalid("this rank is not in its column"))?;
    let reduced = flat_all_reduce(&column, Cow::Borrowed(&acc[slice.clone()]), o).await?;
    acc[slice].copy_from_slice(&reduced);
    let mut bytes = encode_in_turns(&acc).await;
    let ranges: Vec<Range<usize>> = (0..k)
        .map(|i| {
            let b = block(n, k, i);
            b.start * T::SIZE..b.end * T::SIZE
        })
        .collect();
    ring_allgather(&local, &mut bytes, &ranges, 1).await?;
    g.chose(Algorithm::HierarchicalSlices);
    g.decode_result(&bytes).await
}

/// Flat all-reduce: ring for large commutative reductions, recursive doubling otherwise.
async fn flat_all_reduce<T: Element, O: Operator<T> + ?Sized>(
    g: &Group<'_>,
    data: Cow<'_, [T]>,
    o: &O,
) -> Result<Vec<T>, CollectiveError> {
    let (p, n) = (g.size(), data.len());
    if p > 2
        && o.is_commutative()
        && n >= p
        && g.tuning().large_for(Shape::AllReduce, p, n * T::SIZE)
    {
        g.chose(Algorithm::Ring);
        let mut acc = data.into_owned();
        ring_reduce_scatter(g, &mut acc, o, 0).await?;
        let mut bytes = encode_in_turns(&acc).await;
        let ranges: Vec<Range<usize>> = (0..p)
            .map(|i| {
                let b = block(n, p, i);
                b.start * T::SIZE..b.end * T::SIZE
            })
            .collect();
        ring_allgather(g, &mut bytes, &ranges, 1).await?;
        return g.decode_result(&bytes).await;
    }
    let bytes = n * T::SIZE;
    if p == 2
        && g.tuning().large(bytes)
        && (TWO_RANK_HALVES_FROM..=TWO_RANK_HALVES_TO).contains(&bytes)
        && T::share_wire(&Rc::new(Vec::new()), 0..0).is_some()
    {
        g.chose(Algorithm::Ring);
        return two_rank_all_reduce(g, &data, o).await;
    }
    g.chose(Algorithm::RecursiveDoubling);
    recursive_doubling(g, data, o).await
}

/// Smallest vector (bytes) that two ranks all-reduce by halves ([`two_rank_all_reduce`]):
/// below it the second round trip costs more than the passes over memory it saves (64 KiB:
/// 27–28 µs by halves against 17 µs by recursive doubling; 128 KiB: even; 256 KiB: 59–60
/// against 70–75 µs; `shardcx bench --test allreduce --shards 1 --transport shm --cores 0/1`,
/// 2026-12-07).
const TWO_RANK_HALVES_FROM: usize = 256 << 10;

/// Largest vector (bytes) that two ranks all-reduce by halves: above it the pieces of the
/// all-gather, held until the peer has pulled the other half, no longer fit in cache (8 MiB:
/// 3.07–3.17 ms by halves against 2.87–2.93 ms; 16 MiB: 8.0–8.4 against 6.3 ms).
const TWO_RANK_HALVES_TO: usize = 4 << 20;

/// The pieces elements `range` travel in: messages of at most [`CHUNK`] bytes (at most
/// [`MAX_CHUNKS`] of them, none empty), the same on the sending and the receiving rank.
fn pieces<T: Element>(range: Range<usize>) -> impl Iterator<Item = Range<usize>> {
    let n = range.len();
    let chunks = (n * T::SIZE).div_ceil(CHUNK).clamp(1, MAX_CHUNKS);
    let per = n.div_ceil(chunks).max(1);
    (0..chunks)
        .map(move |c| range.start + (c * per).min(n)..range.start + ((c + 1) * per).min(n))
        .filter(|r| !r.is_empty())
}

/// All-reduce of two ranks for large vectors of element types whose memory is their wire form
/// (a ring of two): rank 0 reduces the lower half and rank 1 the upper one (reduce-scatter:
/// each sends the other the half it reduces, in pieces, and combines the pieces it gets as
/// they come, straight into the result), then each sends its reduced half from the result
/// itself ([`Group::send_shared`]: no copy into a send buffer) and puts the other's into
/// place (all-gather). Per rank the data crosses memory about two and a half times (half
/// encoded, both halves pulled, half combined, half put in place; rank 1 also fills the
/// lower half's place first) where recursive doubling takes three (all of it encoded, pulled
/// and combined).
async fn two_rank_all_reduce<T: Element, O: Operator<T> + ?Sized>(
    g: &Group<'_>,
    data: &[T],
    o: &O,
) -> Result<Vec<T>, CollectiveError> {
    let (r, n) = (g.rank(), data.len());
    let peer = 1 - r;
    let (lo, hi) = (block(n, 2, 0), block(n, 2, 1));
    let (mine, theirs) = if r == 0 { (lo, hi) } else { (hi, lo) };
    // The reduce-scatter's first piece carries the vector's whole length (`TOTAL_LEN`), so
    // that ranks given different lengths fail with `Mismatch`; its steps are those of
    // recursive doubling's first exchange (phase 1), so that a rank that chose recursive
    // doubling (given a length outside this algorithm's range) fails the same way.
    let total = total_lead(n * T::SIZE);
    for (c, piece) in pieces::<T>(theirs.clone()).enumerate() {
        let lead: &[u8] = if c == 0 { &total } else { &[] };
        g.send_elems_led(peer, step(1, c), lead, &data[piece])
            .await?;
    }
    let mut out = Vec::with_capacity(n);
    if r == 1 {
        // The lower half's place, written over by the all-gather below.
        out.resize(theirs.len(), data[0]);
    }
    for (c, piece) in pieces::<T>(mine.clone()).enumerate() {
        let len = piece.len() * T::SIZE;
        let total = (c == 0).then_some(n * T::SIZE);
        let d = recv_total(g, peer, step(1, c), len, total).await?;
        combine_le_append_in_turns(o, &data[piece], &d[d.len() - len..], r == 1, &mut out).await;
    }
    let out = Rc::new(out);
    let lent = Lent::default();
    for (c, piece) in pieces::<T>(mine).enumerate() {
        g.send_shared(peer, step(2, c), &out, piece, &lent).await?;
    }
    let mut got = Vec::new();
    for (c, piece) in pieces::<T>(theirs.clone()).enumerate() {
        got.push(recv_len(g, peer, step(2, c), piece.len() * T::SIZE).await?);
    }
    let mut out = g.reclaim(peer, out, &lent).await;
    if r == 0 {
        for d in &got {
            extend_from_le_in_turns(d, &mut out).await;
        }
    } else {
        for (d, piece) in got.iter().zip(pieces::<T>(theirs)) {
            match T::as_wire_mut(&mut out[piece.clone()]) {
                Some(w) => w.copy_from_slice(d),
                None => {
                    decode_into_in_turns(d, &mut out[piece]).await;
                }
            }
        }
    }
    Ok(out)
}

/// Recursive doubling with the ranks beyond the largest power of two folded in first: ranks
/// `2i` and `2i + 1` (for `i` below the remainder) combine into one, so every participant
/// holds a contiguous block of ranks and the combination order stays the rank order. The
/// caller's `data` is sent from where it is and combined straight into the result: it is
/// never copied.
async fn recursive_doubling<T: Element, O: Operator<T> + ?Sized>(
    g: &Group<'_>,
    data: Cow<'_, [T]>,
    o: &O,
) -> Result<Vec<T>, CollectiveError> {
    let (r, p, n) = (g.rank(), g.size(), data.len());
    let pof2 = if p.is_power_of_two() {
        p
    } else {
        p.next_power_of_two() >> 1
    };
    let rem = p - pof2;
    let mut acc = data;
    let newrank = if r < 2 * rem {
        if r % 2 == 0 {
            g.send_elems(r + 1, step(0, 0), &acc).await?;
            None
        } else {
            acc = Cow::Owned(recv_combine_cow(g, r - 1, step(0, 0), o, acc, true).await?);
            Some(r / 2)
        }
    } else {
        Some(r - rem)
    };
    if let Some(nr) = newrank {
        let (mut mask, mut k) = (1, 0);
        while mask < pof2 {
            let nd = nr ^ mask;
            let dst = if nd < rem { nd * 2 + 1 } else { nd + rem };
            acc = Cow::Owned(exchange_combine(g, dst, (1, k), o, acc, dst < r).await?);
            mask <<= 1;
            k += 1;
        }
    }
    if r < 2 * rem {
        if r % 2 == 1 {
            g.send_elems(r - 1, step(2, 0), &acc).await?;
        } else {
            acc = Cow::Owned(recv_elems(g, r + 1, step(2, 0), n).await?);
        }
    }
    Ok(acc.into_owned())
}

/// Ring reduce-scatter in place: afterwards block `rank` of `acc` (blocks as [`block`]) holds
/// the reduction of everyone's block. Commutative operators only (the ring combines in ring
/// order).
async fn ring_reduce_scatter<T: Element, O: Operator<T> + ?Sized>(
    g: &Group<'_>,
    acc: &mut [T],
    o: &O,
    phase: u32,
) -> Result<(), CollectiveError> {
    let (r, p, n) = (g.rank(), g.size(), acc.len());
    let (right, left) = ((r + 1) % p, (r + p - 1) % p);
    for s in 0..p.saturating_sub(1) {
        let out = block(n, p, (r + 2 * p - s - 1) % p);
        g.send_elems(right, step(phase, s), &acc[out]).await?;
        let inn = block(n, p, (r + 2 * p - s - 2) % p);
        recv_combine(g, left, step(phase, s), o, &mut acc[inn], true).await?;
    }
    Ok(())
}

/// Ring all-gather in place: rank `i` holds bytes `ranges[i]` of `buf`; afterwards every
/// rank holds all of them.
async fn ring_allgather(
    g: &Group<'_>,
    buf: &mut [u8],
    ranges: &[Range<usize>],
    phase: u32,
) -> Result<(), CollectiveError> {
    let (r, p) = (g.rank(), g.size());
    let (right, left) = ((r + 1) % p, (r + p - 1) % p);
    for s in 0..p.saturating_sub(1) {
        let out = ranges[(r + p - s) % p].clone();
        g.send(right, step(phase, s), buf[out].to_vec()).await?;
        let inn = ranges[(r + 2 * p - s - 1) % p].clone();
        let d = recv_len(g, left, step(phase, s), inn.len()).await?;
        buf[inn].copy_from_slice(&d);
    }
    Ok(())
}

/// All-gather of equal blocks (`mine` from this rank): every rank's, in rank order. Small
/// blocks over several nodes go through the leaders (a node's blocks gathered at its leader
/// through the mesh, the leaders' node blocks around their ring, each leader broadcasting
/// the whole to its node); large ones around the ring of every rank.
pub(crate) async fn all_gather(g: &Group<'_>, mine: Vec<u8>) -> Result<Vec<u8>, CollectiveError> {
    let (r, p, b) = (g.rank(), g.size(), mine.len());
    if !g.tuning().large(b) {
        if let Some(lv) = levels(g, 0, false)? {
            return leaders_all_gather(g, &lv, mine).await;
        }
    }
    if p > 2 && g.tuning().large(b) {
        g.chose(Algorithm::Ring);
        let mut buf = vec![0u8; p * b];
        buf[r * b..(r + 1) * b].copy_from_slice(&mine);
        let ranges: Vec<Range<usize>> = (0..p).map(|i| i * b..(i + 1) * b).collect();
        ring_allgather(g, &mut buf, &ranges, 0).await?;
        return Ok(buf);
    }
    g.chose(Algorithm::Bruck);
    // `have` holds blocks r, r+1, ... (mod p), doubling each round.
    let mut have = mine;
    let (mut dist, mut k) = (1, 0);
    while dist < p {
        let count = dist.min(p - dist);
        g.send((r + p - dist) % p, step(0, k), have[..count * b].to_vec())
            .await?;
        let d = recv_len(g, (r + dist) % p, step(0, k), count * b).await?;
        have.extend_from_slice(&d);
        dist <<= 1;
        k += 1;
    }
    let mut out = vec![0u8; p * b];
    for (j, chunk) in have.chunks_exact(b.max(1)).enumerate().take(p) {
        let i = (r + j) % p;
        out[i * b..(i + 1) * b].copy_from_slice(chunk);
    }
    Ok(out)
}

/// [`all_gather`] through the leaders of `lv`.
async fn leaders_all_gather(
    g: &Group<'_>,
    lv: &Levels<'_>,
    mine: Vec<u8>,
) -> Result<Vec<u8>, CollectiveError> {
    let (p, b) = (g.size(), mine.len());
    let blocks = g.node_blocks();
    let lens = vec![b; lv.local.size()];
    let ours = gather_blocks(&lv.local, lv.leader, mine, &lens, 0).await?;
    // Every node's blocks, node after node (each in its ranks' order).
    let mut all = vec![0u8; p * b];
    if let Some(leaders) = &lv.leaders {
        let ours = ours.ok_or_else(|| g.invalid("a leader gathered nothing"))?;
        let mut ranges = Vec::with_capacity(blocks.len());
        let mut at = 0;
        for node in blocks.iter() {
            ranges.push(at..at + node.len() * b);
            at += node.len() * b;
        }
        let here = ranges[leaders.rank()].clone();
        if ours.len() != here.len() {
            return Err(g.invalid("a node's gathered blocks of the wrong length"));
        }
        all[here].copy_from_slice(&ours);
        ring_allgather(leaders, &mut all, &ranges, 0).await?;
    }
    binomial_bcast(&lv.local, lv.leader, &mut all, 1).await?;
    g.chose(Algorithm::Hierarchical);
    Ok(in_rank_order(&blocks, all, b))
}

/// Gather of equal blocks at `root`: every rank's block, in rank order, there. Through the
/// leaders when the ranks span several nodes (a node's blocks gathered at its leader through
/// the mesh, the leaders' node blocks at the root), else a binomial tree.
pub(crate) async fn gather(
    g: &Group<'_>,
    root: usize,
    mine: Vec<u8>,
) -> Result<Option<Vec<u8>>, CollectiveError> {
    if let Some(lv) = levels(g, root, false)? {
        let b = mine.len();
        let lens = vec![b; lv.local.size()];
        let ours = gather_blocks(&lv.local, lv.leader, mine, &lens, 0).await?;
        g.chose(Algorithm::Hierarchical);
        let Some(leaders) = &lv.leaders else {
            return Ok(None);
        };
        let ours = ours.ok_or_else(|| g.invalid("a leader gathered nothing"))?;
        let blocks = g.node_blocks();
        let lens: Vec<usize> = blocks.iter().map(|node| node.len() * b).collect();
        return Ok(gather_blocks(leaders, lv.root_at, ours, &lens, 0)
            .await?
            .map(|all| in_rank_order(&blocks, all, b)));
    }
    g.chose(Algorithm::BinomialTree);
    let lens = vec![mine.len(); g.size()];
    gather_blocks(g, root, mine, &lens, 0).await
}

/// `all`, blocks of `b` bytes node after node (each node's in its ranks' order, as `blocks`
/// lists them), in rank order.
fn in_rank_order(blocks: &[Vec<usize>], all: Vec<u8>, b: usize) -> Vec<u8> {
    let p = blocks.iter().map(Vec::len).sum();
    if blocks.iter().flatten().copied().eq(0..p) {
        return all;
    }
    let mut out = vec![0u8; all.len()];
    for (at, &rank) in blocks.iter().flatten().enumerate() {
        out[rank * b..(rank + 1) * b].copy_from_slice(&all[at * b..(at + 1) * b]);
    }
    out
}

/// Binomial gather at `root` of blocks whose lengths (`lens[rank]`) every rank knows: a
/// rank collects the blocks of its subtree (virtual ranks `vr..vr + 2^k`) and sends them up.
async fn gather_blocks(
    g: &Group<'_>,
    root: usize,
    mine: Vec<u8>,
    lens: &[usize],
    phase: u32,
) -> Result<Option<Vec<u8>>, CollectiveError> {
    let (r, p) = (g.rank(), g.size());
    let vr = (r + p - root) % p;
    let vlen = |v: usize| lens[real(v, root, p)];
    let mut buf = mine;
    let mut mask = 1;
    while mask < p {
        if vr & mask != 0 {
            g.send(real(vr - mask, root, p), step(phase, 0), buf)
                .await?;
            return Ok(None);
        }
        if vr + mask < p {
            let last = (vr + 2 * mask).min(p);
            let len: usize = (vr + mask..last).map(vlen).sum();
            let d = recv_len(g, real(vr + mask, root, p), step(phase, 0), len).await?;
            buf.extend_from_slice(&d);
        }
        mask <<= 1;
    }
    // The root: blocks in virtual-rank order; put them in rank order.
    let mut offsets = Vec::with_capacity(p);
    let mut at = 0;
    for v in 0..p {
        offsets.push(at);
        at += vlen(v);
    }
    let mut out = Vec::with_capacity(at);
    for i in 0..p {
        let v = (i + p - root) % p;
        out.extend_from_slice(&buf[offsets[v]..offsets[v] + lens[i]]);
    }
    Ok(Some(out))
}

/// Scatter from `root` of `p` equal blocks (`data` on the root, in rank order): this rank's
/// block. Through the leaders when the ranks span several nodes (each node's blocks to its
/// leader, then through the mesh to its ranks; steps of `phase` in both groups), else a
/// binomial tree.
pub(crate) async fn scatter(
    g: &Group<'_>,
    root: usize,
    data: Option<&[u8]>,
    phase: u32,
) -> Result<Vec<u8>, CollectiveError> {
    if let Some(lv) = levels(g, root, false)? {
        let mut ours = None;
        if let Some(leaders) = &lv.leaders {
            let chunks = match data.filter(|_| g.rank() == root) {
                Some(data) => {
                    let b = data.len() / g.size();
                    // Each node's ranks' blocks, one slice copy per block (not byte by byte).
                    let chunks = g
                        .node_blocks()
                        .iter()
                        .map(|node| {
                            let mut chunk = Vec::with_capacity(node.len() * b);
                            for &r in node {
                                chunk.extend_from_slice(&data[r * b..(r + 1) * b]);
                            }
                            chunk
                        })
                        .collect();
                    Some(chunks)
                }
                None => None,
            };
            ours = Some(scatter_blocks(leaders, lv.root_at, chunks, phase).await?);
        }
        let mine = binomial_scatter(&lv.local, lv.leader, ours.as_deref(), phase).await?;
        g.chose(Algorithm::Hierarchical);
        return Ok(mine);
    }
    g.chose(Algorithm::BinomialTree);
    binomial_scatter(g, root, data, phase).await
}

/// Binomial scatter from `root` of `p` equal blocks (`data` on the root): this rank's block.
async fn binomial_scatter(
    g: &Group<'_>,
    root: usize,
    data: Option<&[u8]>,
    phase: u32,
) -> Result<Vec<u8>, CollectiveError> {
    let (r, p) = (g.rank(), g.size());
    let vr = (r + p - root) % p;
    let lowbit = vr & vr.wrapping_neg();
    // `buf`: the blocks of virtual ranks vr.. of this rank's subtree, `b` bytes each.
    let (buf, b) = if vr == 0 {
        let data = data.ok_or_else(|| g.invalid("the root has no data to scatter"))?;
        let b = data.len() / p;
        let mut buf = Vec::with_capacity(data.len());
        for v in 0..p {
            let i = real(v, root, p);
            buf.extend_from_slice(&data[i * b..(i + 1) * b]);
        }
        (Bytes::Vec(buf), b)
    } else {
        let parent = real(vr - lowbit, root, p);
        let count = lowbit.min(p - vr);
        let buf = g.recv(parent, step(phase, 0)).await?;
        if buf.len() % count != 0 {
            return Err(g.mismatch(parent, format!("{} bytes for {count} blocks", buf.len())));
        }
        let b = buf.len() / count;
        (buf, b)
    };
    let mut mask = if vr == 0 {
        p.next_power_of_two() >> 1
    } else {
        lowbit >> 1
    };
    while mask > 0 {
        if vr + mask < p {
            let count = mask.min(p - vr - mask);
            let part = buf[mask * b..(mask + count) * b].to_vec();
            g.send(real(vr + mask, root, p), step(phase, 0), part)
                .await?;
        }
        mask >>= 1;
    }
    Ok(buf[..b].to_vec())
}

/// Blocks of varying lengths in one message: a `u32` count and a `u64` length per block
/// (little-endian), then the blocks' bytes.
fn pack(blocks: &[Vec<u8>]) -> Vec<u8> {
    let data: usize = blocks.iter().map(Vec::len).sum();
    let mut out = Vec::with_capacity(4 + 8 * blocks.len() + data);
    out.extend_from_slice(&(blocks.len() as u32).to_le_bytes());
    for b in blocks {
        out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    }
    for b in blocks {
        out.extend_from_slice(b);
    }
    out
}

/// The `count` blocks [`pack`]ed in `msg` from group rank `from`, or a mismatch.
fn unpack(
    g: &Group<'_>,
    from: usize,
    msg: &[u8],
    count: usize,
) -> Result<Vec<Vec<u8>>, CollectiveError> {
    let bad = |what: &str| g.mismatch(from, format!("a block list with {what}"));
    let n = msg
        .get(..4)
        .and_then(|b| b.try_into().ok())
        .map(u32::from_le_bytes)
        .ok_or_else(|| bad("no count"))?;
    if n as usize != count {
        return Err(bad(&format!("{n} blocks, not {count}")));
    }
    let mut at = 4 + 8 * count;
    let lens = msg.get(4..at).ok_or_else(|| bad("no lengths"))?;
    let mut out = Vec::with_capacity(count);
    for l in lens.chunks_exact(8) {
        let len = l
            .try_into()
            .map(u64::from_le_bytes)
            .ok()
            .and_then(|l| usize::try_from(l).ok())
            .ok_or_else(|| bad("a bad length"))?;
        let end = at.checked_add(len).ok_or_else(|| bad("a bad length"))?;
        out.push(
            msg.get(at..end)
                .ok_or_else(|| bad("lengths past its end"))?
                .to_vec(),
        );
        at = end;
    }
    if at != msg.len() {
        return Err(bad("bytes after its blocks"));
    }
    Ok(out)
}

/// Binomial gather at `root` of blocks of any length: every rank's block, in rank order, there.
pub(crate) async fn gatherv(
    g: &Group<'_>,
    root: usize,
    mine: Vec<u8>,
) -> Result<Option<Vec<Vec<u8>>>, CollectiveError> {
    g.chose(Algorithm::BinomialTree);
    let (r, p) = (g.rank(), g.size());
    let vr = (r + p - root) % p;
    // The blocks of virtual ranks vr, vr + 1, ... of this rank's subtree.
    let mut have = vec![mine];
    let mut mask = 1;
    while mask < p {
        if vr & mask != 0 {
            g.send(real(vr - mask, root, p), step(0, 0), pack(&have))
                .await?;
            return Ok(None);
        }
        if vr + mask < p {
            let from = real(vr + mask, root, p);
            let d = g.recv(from, step(0, 0)).await?;
            have.extend(unpack(g, from, &d, mask.min(p - vr - mask))?);
        }
        mask <<= 1;
    }
    let mut out = vec![Vec::new(); p];
    for (v, b) in have.into_iter().enumerate() {
        out[real(v, root, p)] = b;
    }
    Ok(Some(out))
}

/// Binomial scatter from `root` of one block of any length per rank (`blocks` on the root,
/// in rank order): this rank's block.
pub(crate) async fn scatterv(
    g: &Group<'_>,
    root: usize,
    blocks: Option<Vec<Vec<u8>>>,
) -> Result<Vec<u8>, CollectiveError> {
    g.chose(Algorithm::BinomialTree);
    scatter_blocks(g, root, blocks, 0).await
}

/// Binomial scatter from `root` of blocks of any length (`blocks` on the root, in rank order;
/// steps of `phase`): this rank's block.
async fn scatter_blocks(
    g: &Group<'_>,
    root: usize,
    blocks: Option<Vec<Vec<u8>>>,
    phase: u32,
) -> Result<Vec<u8>, CollectiveError> {
    let (r, p) = (g.rank(), g.size());
    let vr = (r + p - root) % p;
    let lowbit = vr & vr.wrapping_neg();
    let have: Vec<Vec<u8>> = if vr == 0 {
        let mut blocks = blocks.ok_or_else(|| g.invalid("the root has no blocks to scatter"))?;
        (0..p)
            .map(|v| std::mem::take(&mut blocks[real(v, root, p)]))
            .collect()
    } else {
        let parent = real(vr - lowbit, root, p);
        let d = g.recv(parent, step(phase, 0)).await?;
        unpack(g, parent, &d, lowbit.min(p - vr))?
    };
    let mut mask = if vr == 0 {
        p.next_power_of_two() >> 1
    } else {
        lowbit >> 1
    };
    while mask > 0 {
        if vr + mask < p {
            let count = mask.min(p - vr - mask);
            let part = pack(&have[mask..mask + count]);
            g.send(real(vr + mask, root, p), step(phase, 0), part)
                .await?;
        }
        mask >>= 1;
    }
    Ok(have.into_iter().next().unwrap_or_default())
}

/// All-gather of blocks of any length: the lengths first (an all-gather), then a ring.
pub(crate) async fn all_gatherv(
    g: &Group<'_>,
    mine: Vec<u8>,
) -> Result<Vec<Vec<u8>>, CollectiveError> {
    let (r, p) = (g.rank(), g.size());
    let lens = all_gather(g, (mine.len() as u64).to_le_bytes().to_vec()).await?;
    let mut ranges = Vec::with_capacity(p);
    let mut at = 0usize;
    for (i, l) in lens.chunks_exact(8).enumerate() {
        let len = l
            .try_into()
            .map(u64::from_le_bytes)
            .ok()
            .and_then(|l| usize::try_from(l).ok())
            .and_then(|l| {
                at.checked_add(l)
                    .filter(|&end| end <= MAX_BUFFERED_BYTES)
                    .map(|e| e - at)
            })
            .ok_or_else(|| g.mismatch(i, "a block too large to gather"))?;
        ranges.push(at..at + len);
        at += len;
    }
    let mut buf = vec![0u8; at];
    buf[ranges[r].clone()].copy_from_slice(&mine);
    ring_allgather(g, &mut buf, &ranges, 1).await?;
    g.chose(Algorithm::Ring);
    Ok(ranges
        .into_iter()
        .map(|range| buf[range].to_vec())
        .collect())
}

/// All-to-all of blocks of any length (`blocks[j]` for rank `j`): block `i` of the result
/// came from rank `i`.
pub(crate) async fn all_to_allv(
    g: &Group<'_>,
    mut blocks: Vec<Vec<u8>>,
) -> Result<Vec<Vec<u8>>, CollectiveError> {
    g.chose(Algorithm::Pairwise);
    let (r, p) = (g.rank(), g.size());
    let mut out = vec![Vec::new(); p];
    out[r] = std::mem::take(&mut blocks[r]);
    for s in 1..p {
        let (to, from) = ((r + s) % p, (r + p - s) % p);
        g.send(to, step(0, s), std::mem::take(&mut blocks[to]))
            .await?;
        out[from] = g.recv(from, step(0, s)).await?.into_vec();
    }
    Ok(out)
}

/// Reduce-scatter of equal blocks: this rank's block of the reduction.
pub(crate) async fn reduce_scatter<T: Element, O: Operator<T> + ?Sized>(
    g: &Group<'_>,
    data: Vec<T>,
    o: &O,
) -> Result<Vec<T>, CollectiveError> {
    let (r, p, n) = (g.rank(), g.size(), data.len());
    let count = n / p;
    if o.is_commutative() && p > 1 && g.tuning().large_for(Shape::ReduceScatter, p, n * T::SIZE) {
        g.chose(Algorithm::Ring);
        let mut acc = data;
        ring_reduce_scatter(g, &mut acc, o, 0).await?;
        return Ok(acc[r * count..(r + 1) * count].to_vec());
    }
    // Through the leaders over several nodes (reduce and scatter both). The reduce takes
    // phases 0 and 1 of each group's steps (1: a reduce-scatter + gather reduce's gather, which
    // its cost model may choose for a node's group), the scatter phase 2.
    let all = reduce(g, 0, data, o).await?;
    let bytes = match &all {
        Some(a) => Some(encode_in_turns(a).await),
        None => None,
    };
    let mine = scatter(g, 0, bytes.as_deref(), 2).await?;
    g.chose(Algorithm::ReduceThenScatter);
    decode_in_turns(&mine)
        .await
        .ok_or_else(|| g.mismatch(0, "a block that is not a whole number of elements"))
}

/// All-to-all of equal blocks: block `i` of the result came from rank `i`.
pub(crate) async fn all_to_all(g: &Group<'_>, data: &[u8]) -> Result<Vec<u8>, CollectiveError> {
    g.chose(Algorithm::Pairwise);
    let (r, p) = (g.rank(), g.size());
    let b = data.len() / p;
    let mut out = vec![0u8; data.len()];
    out[r * b..(r + 1) * b].copy_from_slice(&data[r * b..(r + 1) * b]);
    for s in 1..p {
        let (to, from) = ((r + s) % p, (r + p - s) % p);
        g.send(to, step(0, s), data[to * b..(to + 1) * b].to_vec())
            .await?;
        let d = recv_len(g, from, step(0, s), b).await?;
        out[from * b..(from + 1) * b].copy_from_slice(&d);
    }
    Ok(out)
}

/// Inclusive (`exclusive == false`) or exclusive scan by recursive doubling: `Some` of the
/// reduction of ranks `0..=rank` (`0..rank`), `None` for rank 0's exclusive scan.
pub(crate) async fn scan<T: Element, O: Operator<T> + ?Sized>(
    g: &Group<'_>,
    data: Vec<T>,
    o: &O,
    exclusive: bool,
) -> Result<Option<Vec<T>>, CollectiveError> {
    g.chose(Algorithm::RecursiveDoubling);
    let (r, p, n) = (g.rank(), g.size(), data.len());
    let mut result = if exclusive { None } else { Some(data.clone()) };
    let mut partial = data;
    let (mut mask, mut k) = (1, 0);
    while mask < p {
        let dst = r ^ mask;
        if dst < p {
            g.send_elems(dst, step(0, k), &partial).await?;
            let t: Vec<T> = recv_elems(g, dst, step(0, k), n).await?;
            if dst < r {
                combine_in_turns(o, &mut partial, &t, true).await;
                result = Some(match result {
                    None => t,
                    Some(mut x) => {
                        combine_in_turns(o, &mut x, &t, true).await;
                        x
                    }
                });
            } else {
                combine_in_turns(o, &mut partial, &t, false).await;
            }
        }
        mask <<= 1;
        k += 1;
    }
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_everything_once() {
        for n in 0..20 {
            for p in 1..9 {
                let mut at = 0;
                for i in 0..p {
                    let b = block(n, p, i);
                    assert_eq!(b.start, at);
                    at = b.end;
                }
                assert_eq!(at, n);
                for first in 0..p {
                    for count in 0..=p {
                        let r = blocks(n, p, first, count);
                        let want: usize = (first..(first + count).min(p))
                            .map(|i| block(n, p, i).len())
                            .sum();
                        assert_eq!(r.len(), want, "n {n} p {p} first {first} count {count}");
                    }
                }
            }
        }
    }
}
