//! Checked-mode remote memory: regions held by shards, put and get carried as requests.
//!
//! UCX over TCP and shared memory does not enforce remote keys (a peer holding any rkey can
//! write anywhere in the target process, and unregistering revokes nothing), so by default no
//! rkey ever leaves a node. A put or a get is a request frame ([`FrameKind::RmaPut`],
//! [`FrameKind::RmaGet`], sent with [`ShardCtx::request`] and its deadline) to the node that
//! holds the region; the region's shard checks it against its [`RegionTable`] and only then
//! copies bytes; the answer is an [`FrameKind::RmaReply`] with a status code. The check and the
//! payloads are proto's ([`crate::proto::region`]); this module holds the memory, routes the
//! requests and turns replies into typed errors ([`RmaOpError`]).
//!
//! This is the default, and the only mode that protects the target. The other one, trusted
//! mode ([`crate::rma_trusted`]: native UCX RMA with packed rkeys handed to peers, no target
//! CPU on RDMA hardware), lets any peer holding a key write anywhere in the holder's process,
//! and is on only when the shards were started with `UCP_FEATURE_RMA`
//! ([`crate::ShardsBuilder::features`]); shards start with
//! [`crate::ucx::Features::messaging`], in which it is off, and the trusted calls then fail with
//! [`RmaOpError::TrustedOff`]. Checked put/get work the same in either mode.
//!
//! ## Regions and descriptors
//!
//! [`ShardCtx::register_region`] takes a `Vec<u8>` from the caller and keeps it on the calling
//! shard, with its [`Permissions`] and, optionally, the one node allowed to use it (its
//! *grantee*). It returns a [`RemoteRegion`]: proto's [`RegionDescriptor`] (region id,
//! generation, length, permissions) with the node and the shard that hold the memory. A
//! `RemoteRegion` is `Send + Copy` and encodes to [`RemoteRegion::ENCODED_LEN`] bytes
//! ([`RemoteRegion::to_bytes`], [`RemoteRegion::from_bytes`]) so that an application can hand it
//! to a peer, e.g. in an active message. It is a name, not a capability: the holder's checks
//! decide every access.
//!
//! [`ShardCtx::revoke_region`] moves the region to a new generation (every descriptor handed out
//! before is refused from then on, [`RmaErrorCode::StaleGeneration`]) and returns the new one;
//! [`ShardCtx::deregister_region`] removes the region and gives its memory back. The owner reads
//! and writes its memory locally with [`ShardCtx::with_region`] and
//! [`ShardCtx::with_region_mut`].
//!
//! ## Region ids on the wire
//!
//! A request frame names its region in the header's 32-bit `id` only. It is sent on the rail
//! to the shard that holds the memory (see "A request's path"), but a frame that arrives on
//! another shard must still find it, so the id says which shard holds it: its top 12 bits are the
//! shard index ([`crate::proto::shard_map::MAX_SHARDS`] is 4096) and its low [`SLOT_BITS`] bits
//! a slot of that shard (never zero). Slots are reused after deregistration; the table's
//! generations are not (they grow from the node's incarnation, see proto), so a descriptor of a
//! region that was deregistered never matches the region that later takes its slot. A shard
//! holds at most [`MAX_REGIONS_PER_SHARD`] regions at once.
//!
//! ## A request's path
//!
//! 1. The initiator (any shard) checks the access against the descriptor
//!    ([`RegionDescriptor::check`]: permissions, overflow-safe bounds); a refusal is
//!    [`RmaOpError::Invalid`] and nothing is sent. Then it sends the request on the rail to the
//!    region's shard ([`ShardCtx::request`] to [`crate::net::Dest::shard`]: from the calling
//!    shard when it holds that rail, else forwarded to the local shard that does), whose
//!    deadline travels as the frame's `ttl_ns`.
//! 2. On the target, the handler [`install`]ed for the request kinds runs on the shard the
//!    request arrived on: the region's. Should a request arrive on another shard (a peer that
//!    addressed it to the node), it is forwarded there over the mesh ([`ShardCtx::forward`])
//!    together with the initiator's node id as authenticated by the rail (never a value from
//!    the payload).
//! 3. The region's shard drops the request if its deadline has passed (nobody waits for the
//!    answer any more; counted in [`RmaStats::expired`]), else decodes it and runs
//!    [`RegionTable::check`] (unknown region, grantee, generation, permission, bounds), copies
//!    the bytes, and answers. The check and the copy happen in one synchronous step on the
//!    shard that owns the memory, so no other access, deregistration or local write can come
//!    between them, and the memory is never touched from another thread.
//! 4. The reply goes back on the rail the request came in on; the initiator maps a refusal to
//!    [`RmaOpError::Refused`] with its [`RmaErrorCode`].
//!
//! ## Installing
//!
//! [`install`] must run on every shard before it serves anything, from
//! [`crate::ShardsBuilder::on_start`] (the facade's node does it for its shards): it creates the
//! shard's region state and registers the handlers of [`FrameKind::RmaPut`] and
//! [`FrameKind::RmaGet`]. A request that reaches a shard without them is dropped, and its
//! initiator times out. Registering a region on a shard without it fails with
//! [`RmaOpError::NotInstalled`].
//!
//! ## Where the state lives, and what is `Send`
//!
//! The region state of a shard is in the shard's extension slot ([`ShardCtx::ext`], see
//! [`crate::boot`]): it belongs to that [`ShardCtx`] alone, so no other context (another run on
//! the same thread) can ever see it. The request handlers [`install`] registers hold it weakly
//! and serve without looking it up. The memory is freed when the region is deregistered, or
//! at the shard's teardown (after its connections are closed and its driver has stopped),
//! whatever descriptors remote nodes still hold.
//!
//! [`RemoteRegion`], [`RmaStats`], [`RmaOpError`] and [`DescriptorError`] are `Send + Sync`;
//! the memory itself never leaves its shard.
//!
//! ## Limits
//!
//! - Regions are plain host memory (`Vec<u8>`), copied by the CPU of the region's shard; pool
//!   buffers and device memory are not regions yet.
//! - A get reads at most [`Limits::DEFAULT_MAX_MESSAGE_SIZE`] minus 8 bytes (its reply must fit
//!   proto's default limit), a put writes at most what fits the net's maximum message size; the
//!   owner of a larger get refuses it with [`RmaErrorCode::TooLarge`].
//! - Puts and gets are not ordered with each other unless the caller awaits each one. A put
//!   that times out may or may not have been applied (a deadline passed on the region's shard
//!   drops it, one passed on the way back does not undo it).
//! - Nothing limits how many requests a peer has in flight beyond the net's and the mesh's
//!   own bounds.

use std::cell::{Cell, RefCell};
use std::ops::Range;
use std::rc::{Rc, Weak};
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::boot::ShardCtx;
use crate::error::NetError;
use crate::net::Dest;
use crate::proto::region::{
    Access, GetRequest, Permissions, PutRequest, RegionDescriptor, RegionError, RegionSpec,
    RegionTable, RmaError, RmaErrorCode, RmaReply,
};
use crate::proto::wire::NO_DEADLINE_TTL;
use crate::proto::{
    FrameHeader, FrameKind, Generation, Incarnation, Limits, NodeId, RegionId, ShardId,
};

/// Bits of a region id that number the region within its shard (the bits above name the shard).
pub const SLOT_BITS: u32 = 20;

/// Most regions a shard holds at once.
pub const MAX_REGIONS_PER_SHARD: usize = (1 << SLOT_BITS) - 1;

/// Limits used to decode replies and puts: the net has already bounded their size by its own
/// maximum message size, so they are not bounded again here.
const UNBOUNDED: Limits = Limits {
    max_message_size: u64::MAX,
};

/// A region as other nodes name it: proto's [`RegionDescriptor`] with the node and shard that
/// hold the memory. `Send + Copy`; encode it with [`RemoteRegion::to_bytes`] to hand it to a
/// peer. Only [`ShardCtx::register_region`], [`ShardCtx::revoke_region`] and
/// [`RemoteRegion::from_bytes`] make one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    node: NodeId,
    shard: ShardId,
    region: RegionDescriptor,
}

/// Why bytes do not decode as a [`RemoteRegion`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Error)]
#[error("malformed region descriptor: {reason}")]
pub struct DescriptorError {
    pub(crate) reason: &'static str,
}

/// Counters of one shard's remote-memory service.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RmaStats {
    /// Puts applied to regions of this shard.
    pub puts: u64,
    /// Gets served from regions of this shard.
    pub gets: u64,
    /// Requests to regions of this shard refused by the region check.
    pub refused: u64,
    /// Requests to this shard whose payload did not decode (answered with an error code).
    pub malformed: u64,
    /// Requests dropped on this shard because their deadline had passed.
    pub expired: u64,
    /// Requests this shard received for regions of another shard, and forwarded.
    pub forwarded: u64,
    /// Replies that could not be sent (the connection had gone).
    pub unanswered: u64,
}

/// Why a remote-memory operation, or a region's registration, failed.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RmaOpError {
    /// Refused before anything was sent: the descriptor does not allow the access
    /// ([`RmaError::NotPermitted`], [`RmaError::OutOfBounds`]).
    #[error("refused locally: {source}")]
    Invalid {
        /// The check's error.
        #[source]
        source: RmaError,
    },
    /// The node holding the region refused the access.
    #[error("node {node} refused access to region {region}: {code}")]
    Refused {
        /// The node holding the region.
        node: NodeId,
        /// The region (the descriptor's id).
        region: RegionId,
        /// Why ([`RmaErrorCode::UnknownRegion`], [`RmaErrorCode::NotGrantee`],
        /// [`RmaErrorCode::StaleGeneration`], [`RmaErrorCode::NotPermitted`],
        /// [`RmaErrorCode::OutOfBounds`], [`RmaErrorCode::TooLarge`], ...).
        code: RmaErrorCode,
    },
    /// A get of this many bytes asks for a reply larger than the limit (refused before
    /// sending); puts larger than the net's limit fail with [`NetError::TooLarge`].
    #[error("remote memory access of {len} bytes exceeds the maximum of {max}")]
    TooLarge {
        /// The reply's length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The request failed on the network: [`NetError::TimedOut`] (no reply within the
    /// deadline), [`NetError::NotConnected`], [`NetError::PeerDead`], [`NetError::Closed`], ...
    #[error(transparent)]
    Net(#[from] NetError),
    /// The reply did not decode, or does not fit the request.
    #[error("malformed remote memory reply from node {node}: {reason}")]
    BadReply {
        /// The node that answered.
        node: NodeId,
        /// What was wrong.
        reason: &'static str,
    },
    /// The region's registration, revocation or deregistration failed (unknown region, too
    /// large, generations exhausted).
    #[error("region: {source}")]
    Region {
        /// The table's error.
        #[source]
        source: RegionError,
    },
    /// The shard holds [`MAX_REGIONS_PER_SHARD`] regions already.
    #[error("shard {shard} holds the maximum number of regions")]
    TooManyRegions {
        /// The shard.
        shard: ShardId,
    },
    /// [`install`] has not run on this shard.
    #[error("remote memory is not installed on shard {shard}")]
    NotInstalled {
        /// The shard.
        shard: ShardId,
    },
    /// The region is held by another shard than the one called (regions are managed on their
    /// own shard), or does not exist.
    #[error("region {region} is not held by shard {shard}")]
    NotHere {
        /// The region.
        region: RegionId,
        /// The shard called.
        shard: ShardId,
    },
    /// The region belongs to another node than the one the operation was addressed to.
    #[error("region of node {region_node} used with node {node}")]
    WrongNode {
        /// The node the operation was addressed to.
        node: NodeId,
        /// The node holding the region.
        region_node: NodeId,
    },
    /// A region call was made from inside [`ShardCtx::with_region`]'s closure.
    #[error("region state of shard {shard} is in use (call from inside with_region)")]
    Reentrant {
        /// The shard.
        shard: ShardId,
    },
    /// A trusted-mode call ([`crate::rma_trusted`]) on a node whose shards were started
    /// without `UCP_FEATURE_RMA`: trusted mode is off unless enabled explicitly.
    #[error("trusted remote memory is off on shard {shard} (UCP_FEATURE_RMA not enabled)")]
    TrustedOff {
        /// The shard called.
        shard: ShardId,
    },
    /// A trusted descriptor of another run of its node than the one connected now: its key and
    /// addresses name memory of a process that is gone.
    #[error(
        "trusted descriptor of node {node} is for incarnation {descriptor}, \
         the session is with incarnation {session}"
    )]
    StaleIncarnation {
        /// The node.
        node: NodeId,
        /// The descriptor's incarnation.
        descriptor: Incarnation,
        /// The connected session's incarnation.
        session: Incarnation,
    },
    /// A trusted-mode access to a node that only tcp reaches (no shared memory with it, no
    /// RDMA transport): UCX 1.12 has no RMA over tcp, only an emulation served by the target's
    /// CPU, and its tcp transport crashed the target with trusted endpoints (see
    /// [`crate::rma_trusted`]). Checked put/get serve such peers.
    #[error(
        "trusted remote memory to node {node} would run over tcp (needs shared memory or RDMA)"
    )]
    TrustedTransport {
        /// The node holding the region.
        node: NodeId,
    },
    /// UCX failed a trusted-mode step (`op`: `"map"`, `"pack remote key"`, `"connect"`,
    /// `"unpack remote key"`, `"put"`, `"get"`, ...).
    #[error("trusted {op}: {source}")]
    Ucx {
        /// The step.
        op: &'static str,
        /// UCX's error.
        #[source]
        source: crate::ucx::Error,
    },
}

/// The memory of one registered region and its id in the table.
struct Slot {
    table_id: RegionId,
    memory: Vec<u8>,
}

/// One shard's regions: the table (checks) and the memory, by slot.
struct Regions {
    table: RegionTable,
    /// Index 0 is never used, so that no region id is zero.
    slots: Vec<Option<Slot>>,
    free: Vec<u32>,
}

/// One shard's remote-memory state (in the shard's extension slot).
struct RmaState {
    regions: RefCell<Regions>,
    stats: Cell<RmaStats>,
}

impl RemoteRegion {
    /// Bytes of [`RemoteRegion::to_bytes`].
    pub const ENCODED_LEN: usize = 32;

    /// The node holding the region.
    pub fn node(&self) -> NodeId {
        self.node
    }

    /// The shard of that node holding the memory.
    pub fn shard(&self) -> ShardId {
        self.shard
    }

    /// The region's id (it names the shard too; see the module docs).
    pub fn id(&self) -> RegionId {
        self.region.id
    }

    /// The generation this descriptor is valid for.
    pub fn generation(&self) -> Generation {
        self.region.generation
    }

    /// The region's length in bytes.
    pub fn len(&self) -> u64 {
        self.region.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.region.len == 0
    }

    /// What remote nodes may do.
    pub fn permissions(&self) -> Permissions {
        self.region.permissions
    }

    /// proto's descriptor (id, generation, length, permissions).
    pub fn descriptor(&self) -> RegionDescriptor {
        self.region
    }

    /// The initiator-side check of an access of `len` bytes at `offset` (permissions and
    /// overflow-safe bounds); the holder checks again, and also the generation and grantee.
    pub fn check(&self, offset: u64, len: u64, access: Access) -> Result<(), RmaError> {
        self.region.check(offset, len, access)
    }

    /// The descriptor as [`RemoteRegion::ENCODED_LEN`] little-endian bytes:
    ///
    /// ```text
    ///  0 u64 node id        8 u32 region id     12 u16 shard
    /// 14 u8  permissions   15 u8  reserved = 0  16 u64 generation   24 u64 length
    /// ```
    pub fn to_bytes(&self) -> [u8; RemoteRegion::ENCODED_LEN] {
        let mut b = [0u8; Self::ENCODED_LEN];
        b[0..8].copy_from_slice(&self.node.get().to_le_bytes());
        b[8..12].copy_from_slice(&self.region.id.get().to_le_bytes());
        b[12..14].copy_from_slice(&self.shard.get().to_le_bytes());
        b[14] = self.region.permissions.bits();
        b[16..24].copy_from_slice(&self.region.generation.get().to_le_bytes());
        b[24..32].copy_from_slice(&self.region.len.to_le_bytes());
        b
    }

    /// Decodes [`RemoteRegion::to_bytes`]'s output. Refuses a wrong length, undefined
    /// permission bits, a non-zero reserved byte, a zero slot, and a shard that does not match
    /// the region id. Any byte string is safe to decode; the result is a name, not a grant.
    pub fn from_bytes(b: &[u8]) -> Result<RemoteRegion, DescriptorError> {
        let bad = |reason| DescriptorError { reason };
        let b: &[u8; Self::ENCODED_LEN] = b.try_into().map_err(|_| bad("wrong length"))?;
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        let id = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
        let shard = ShardId::new(u16::from_le_bytes([b[12], b[13]]));
        let permissions = Permissions::from_bits(b[14]).ok_or(bad("undefined permission bits"))?;
        if b[15] != 0 {
            return Err(bad("reserved byte is not zero"));
        }
        let region = RegionId::new(id);
        if holder_of(region) != shard {
            return Err(bad("shard does not match the region id"));
        }
        if slot_of(region) == 0 {
            return Err(bad("zero region slot"));
        }
        Ok(RemoteRegion {
            node: NodeId::new(u64_at(0)),
            shard,
            region: RegionDescriptor {
                id: region,
                generation: Generation::new(u64_at(16)),
                len: u64_at(24),
                permissions,
            },
        })
    }
}

impl RmaOpError {
    /// The refusal's code, whether the initiator's check ([`RmaOpError::Invalid`]) or the
    /// holder ([`RmaOpError::Refused`]) refused; `None` for other errors.
    pub fn code(&self) -> Option<RmaErrorCode> {
        match self {
            RmaOpError::Invalid { source } => Some(source.code()),
            RmaOpError::Refused { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// Whether the operation ran out of time ([`NetError::TimedOut`]).
    pub fn is_timeout(&self) -> bool {
        matches!(self, RmaOpError::Net(NetError::TimedOut { .. }))
    }
}

impl Regions {
    fn new(first: Generation) -> Self {
        Self {
            table: RegionTable::starting_at(first),
            slots: vec![None],
            free: Vec::new(),
        }
    }

    fn slot(&self, region: RegionId) -> Option<&Slot> {
        self.slots.get(slot_of(region) as usize)?.as_ref()
    }

    /// The region check of an access to `region` (a wire id of this shard): the slot and the
    /// byte range to copy.
    fn check(
        &self,
        requester: NodeId,
        region: RegionId,
        (generation, offset, len): (Generation, u64, u64),
        access: Access,
    ) -> Result<(usize, Range<usize>), RmaErrorCode> {
        let slot = self.slot(region).ok_or(RmaErrorCode::UnknownRegion)?;
        let checked = self
            .table
            .check(requester, slot.table_id, generation, offset, len, access)
            .map_err(|e| e.code())?;
        Ok((slot_of(region) as usize, checked.range()))
    }

    fn memory_mut(&mut self, slot: usize, range: Range<usize>) -> Option<&mut [u8]> {
        self.slots.get_mut(slot)?.as_mut()?.memory.get_mut(range)
    }

    fn memory(&self, slot: usize, range: Range<usize>) -> Option<&[u8]> {
        self.slots.get(slot)?.as_ref()?.memory.get(range)
    }
}

impl RmaState {
    fn count(&self, f: impl FnOnce(&mut RmaStats)) {
        let mut s = self.stats.get();
        f(&mut s);
        self.stats.set(s);
    }
}

/// Creates this shard's region state (unless it has one) and registers the handlers of
/// [`FrameKind::RmaPut`] and [`FrameKind::RmaGet`]. Call it on every shard before it serves:
/// from [`crate::ShardsBuilder::on_start`]. Calling it again keeps the regions.
pub fn install(ctx: &Rc<ShardCtx>) {
    let state = ctx.ext_or_insert_with(|| RmaState {
        regions: RefCell::new(Regions::new(Generation::new(ctx.incarnation().get()))),
        stats: Cell::new(RmaStats::default()),
    });
    for kind in [FrameKind::RmaPut, FrameKind::RmaGet] {
        // The handler keeps the state at hand (no lookup per request), weakly: the handler
        // lives as long as the shard's net state, the regions' memory only until the shard's
        // teardown.
        let state = Rc::downgrade(&state);
        // Cannot fail: both kinds are request kinds `set_frame_handler` accepts.
        let _ = ctx.set_frame_handler(kind, move |ctx, from, header, payload| {
            on_request(ctx, &state, from, header, payload);
        });
    }
}

/// The state of `ctx`'s shard, if [`install`] ran on it (see the module docs).
fn state_of(ctx: &ShardCtx) -> Option<Rc<RmaState>> {
    ctx.ext::<RmaState>()
}

/// The shard named by a region id.
fn holder_of(region: RegionId) -> ShardId {
    // The id's top 12 bits always fit a u16.
    ShardId::new((region.get() >> SLOT_BITS) as u16)
}

/// The slot named by a region id.
fn slot_of(region: RegionId) -> u32 {
    region.get() & ((1 << SLOT_BITS) - 1)
}

/// The id of `slot` on `shard` (both in range: shards < 4096, slots < 2^20).
fn wire_id(shard: ShardId, slot: u32) -> RegionId {
    RegionId::new((u32::from(shard.get()) << SLOT_BITS) | slot)
}

/// A failure reply.
fn refusal(code: RmaErrorCode) -> Vec<u8> {
    RmaReply::header(Err(code)).to_vec()
}

/// The handler of RMA requests on the shard they arrived on (`state` is its region state):
/// serve here, or forward to the region's shard.
fn on_request(
    ctx: &Rc<ShardCtx>,
    state: &Weak<RmaState>,
    from: NodeId,
    header: &FrameHeader,
    payload: Vec<u8>,
) {
    // Gone: the shard is being torn down, it holds no region any more.
    let state = state.upgrade();
    let expires = if header.ttl_ns == NO_DEADLINE_TTL {
        None
    } else {
        Instant::now().checked_add(Duration::from_nanos(header.ttl_ns))
    };
    let region = RegionId::new(header.id);
    let (kind, holder, header) = (header.kind, holder_of(region), *header);
    if holder == ctx.id() {
        if let Some(reply) = serve(ctx, state.as_deref(), from, kind, region, &payload, expires) {
            send_reply(ctx.clone(), from, header, reply);
        }
        return;
    }
    if let Some(s) = &state {
        s.count(|s| s.forwarded += 1);
    }
    if holder.index() >= ctx.shard_count() {
        send_reply(
            ctx.clone(),
            from,
            header,
            refusal(RmaErrorCode::UnknownRegion),
        );
        return;
    }
    let c = ctx.clone();
    glommio::spawn_local(async move {
        let job = move |t: Rc<ShardCtx>| async move {
            let state = state_of(&t);
            serve(&t, state.as_deref(), from, kind, region, &payload, expires)
        };
        // A holder that stopped means the node is going down: the initiator times out.
        if let Ok(Some(reply)) = c.forward(holder, job).await {
            send_reply(c, from, header, reply);
        }
    })
    .detach();
}

/// Sends `reply` to `request` (from this shard, the owner of `to`); a reply over the size limit
/// becomes a `TooLarge` refusal.
fn send_reply(ctx: Rc<ShardCtx>, to: NodeId, request: FrameHeader, reply: Vec<u8>) {
    glommio::spawn_local(async move {
        let mut r = ctx.reply(to, &request, FrameKind::RmaReply, reply).await;
        if let Err(NetError::TooLarge { .. }) = r {
            let too_large = refusal(RmaErrorCode::TooLarge);
            r = ctx
                .reply(to, &request, FrameKind::RmaReply, too_large)
                .await;
        }
        if r.is_err() {
            if let Some(s) = state_of(&ctx) {
                s.count(|s| s.unanswered += 1);
            }
        }
    })
    .detach();
}

/// Checks and serves one request on the region's shard (`state` is its region state, if any);
/// the reply payload, or `None` to drop the request (its deadline passed, or this is not a
/// request kind).
fn serve(
    ctx: &ShardCtx,
    state: Option<&RmaState>,
    from: NodeId,
    kind: FrameKind,
    region: RegionId,
    payload: &[u8],
    expires: Option<Instant>,
) -> Option<Vec<u8>> {
    let Some(state) = state else {
        // Not installed here (or torn down): this shard holds no region.
        return Some(refusal(RmaErrorCode::UnknownRegion));
    };
    if expires.is_some_and(|e| Instant::now() >= e) {
        state.count(|s| s.expired += 1);
        return None;
    }
    if holder_of(region) != ctx.id() {
        return Some(refusal(RmaErrorCode::UnknownRegion));
    }
    let Ok(mut regions) = state.regions.try_borrow_mut() else {
        // Unreachable: requests are served between tasks, never inside `with_region`.
        return None;
    };
    let served = match kind {
        FrameKind::RmaPut => PutRequest::decode(payload, &UNBOUNDED)
            .map_err(|e| (e.code(), true))
            .and_then(|put| {
                let len = put.data.len() as u64;
                let (slot, range) = regions
                    .check(
                        from,
                        region,
                        (put.generation, put.offset, len),
                        Access::Write,
                    )
                    .map_err(|c| (c, false))?;
                let dst = regions
                    .memory_mut(slot, range)
                    .ok_or((RmaErrorCode::OutOfBounds, false))?;
                dst.copy_from_slice(put.data);
                Ok(RmaReply::header(Ok(())).to_vec())
            }),
        FrameKind::RmaGet => GetRequest::decode(payload, &Limits::default())
            .map_err(|e| (e.code(), true))
            .and_then(|get| {
                let (slot, range) = regions
                    .check(
                        from,
                        region,
                        (get.generation, get.offset, get.len),
                        Access::Read,
                    )
                    .map_err(|c| (c, false))?;
                let src = regions
                    .memory(slot, range)
                    .ok_or((RmaErrorCode::OutOfBounds, false))?;
                let mut out = Vec::with_capacity(RmaReply::HEADER_LEN + src.len());
                out.extend_from_slice(&RmaReply::header(Ok(())));
                out.extend_from_slice(src);
                Ok(out)
            }),
        _ => return None,
    };
    drop(regions);
    Some(match served {
        Ok(reply) => {
            state.count(|s| match kind {
                FrameKind::RmaPut => s.puts += 1,
                _ => s.gets += 1,
            });
            reply
        }
        Err((code, malformed)) => {
            state.count(|s| {
                if malformed {
                    s.malformed += 1
                } else {
                    s.refused += 1
                }
            });
            refusal(code)
        }
    })
}

/// Checks an RMA reply from `region`'s node; its data.
fn reply_data(region: &RemoteRegion, reply: &[u8]) -> Result<usize, RmaOpError> {
    let bad = |reason| RmaOpError::BadReply {
        node: region.node,
        reason,
    };
    let r = RmaReply::decode(reply, &UNBOUNDED).map_err(|_| bad("does not decode"))?;
    match r.status {
        Ok(()) => Ok(r.data.len()),
        Err(code) => Err(RmaOpError::Refused {
            node: region.node,
            region: region.id(),
            code,
        }),
    }
}

impl ShardCtx {
    /// Registers `memory` as a region held by this shard, which remote nodes may access as
    /// `permissions` allow; with a `grantee`, only that node may. Returns the region's
    /// descriptor, to hand to the nodes that will use it.
    ///
    /// Errors, with the memory handed back: [`RmaOpError::NotInstalled`],
    /// [`RmaOpError::TooManyRegions`], [`RmaOpError::Region`] (generations exhausted).
    pub fn register_region(
        &self,
        memory: Vec<u8>,
        permissions: Permissions,
        grantee: Option<NodeId>,
    ) -> Result<RemoteRegion, (RmaOpError, Vec<u8>)> {
        let shard = self.id();
        let Some(state) = state_of(self) else {
            return Err((RmaOpError::NotInstalled { shard }, memory));
        };
        let Ok(mut regions) = state.regions.try_borrow_mut() else {
            return Err((RmaOpError::Reentrant { shard }, memory));
        };
        let slot = match regions.free.pop() {
            Some(slot) => slot,
            None if regions.slots.len() <= MAX_REGIONS_PER_SHARD => {
                regions.slots.push(None);
                // Fits: at most MAX_REGIONS_PER_SHARD < 2^20.
                (regions.slots.len() - 1) as u32
            }
            None => return Err((RmaOpError::TooManyRegions { shard }, memory)),
        };
        let spec = RegionSpec {
            len: memory.len() as u64,
            permissions,
            grantee,
            handle: u64::from(slot),
        };
        let d = match regions.table.register(spec) {
            Ok(d) => d,
            Err(source) => {
                regions.free.push(slot);
                return Err((RmaOpError::Region { source }, memory));
            }
        };
        regions.slots[slot as usize] = Some(Slot {
            table_id: d.id,
            memory,
        });
        Ok(RemoteRegion {
            node: self.node_id(),
            shard,
            region: RegionDescriptor {
                id: wire_id(shard, slot),
                ..d
            },
        })
    }

    /// Revokes every descriptor handed out for `region` (held by this shard): the region moves
    /// to a new generation, and the new descriptor is returned. If no generation is left the
    /// region is shut to all access instead ([`RmaOpError::Region`]).
    pub fn revoke_region(&self, region: RegionId) -> Result<RemoteRegion, RmaOpError> {
        self.with_regions(region, |regions, shard| {
            let table_id = regions
                .slot(region)
                .ok_or(RmaOpError::NotHere { region, shard })?
                .table_id;
            let d = regions
                .table
                .revoke(table_id)
                .map_err(|source| RmaOpError::Region { source })?;
            Ok(RemoteRegion {
                node: self.node_id(),
                shard,
                region: RegionDescriptor { id: region, ..d },
            })
        })
    }

    /// Removes `region` (held by this shard) and gives its memory back; every descriptor of it
    /// is refused from then on ([`RmaErrorCode::UnknownRegion`]).
    pub fn deregister_region(&self, region: RegionId) -> Result<Vec<u8>, RmaOpError> {
        self.with_regions(region, |regions, shard| {
            let slot = slot_of(region);
            let table_id = regions
                .slot(region)
                .ok_or(RmaOpError::NotHere { region, shard })?
                .table_id;
            regions
                .table
                .deregister(table_id)
                .map_err(|source| RmaOpError::Region { source })?;
            let memory = regions.slots[slot as usize]
                .take()
                .map(|s| s.memory)
                .unwrap_or_default();
            regions.free.push(slot);
            Ok(memory)
        })
    }

    /// The current descriptor of `region`, if this shard holds it.
    pub fn region(&self, region: RegionId) -> Option<RemoteRegion> {
        self.with_regions(region, |regions, shard| {
            let slot = regions
                .slot(region)
                .ok_or(RmaOpError::NotHere { region, shard })?;
            let entry = regions
                .table
                .get(slot.table_id)
                .ok_or(RmaOpError::NotHere { region, shard })?;
            Ok(RemoteRegion {
                node: self.node_id(),
                shard,
                region: RegionDescriptor {
                    id: region,
                    ..entry.descriptor
                },
            })
        })
        .ok()
    }

    /// Runs `f` on the memory of `region` (held by this shard). No remote access can happen
    /// while `f` runs; `f` must not call this shard's region API ([`RmaOpError::Reentrant`]).
    pub fn with_region<R>(
        &self,
        region: RegionId,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, RmaOpError> {
        self.with_regions(region, |regions, shard| {
            let slot = regions
                .slot(region)
                .ok_or(RmaOpError::NotHere { region, shard })?;
            Ok(f(&slot.memory))
        })
    }

    /// Runs `f` on the memory of `region` (held by this shard), to write it locally. As
    /// [`ShardCtx::with_region`].
    pub fn with_region_mut<R>(
        &self,
        region: RegionId,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, RmaOpError> {
        self.with_regions(region, |regions, shard| {
            let slot = slot_of(region) as usize;
            let s = regions
                .slots
                .get_mut(slot)
                .and_then(Option::as_mut)
                .ok_or(RmaOpError::NotHere { region, shard })?;
            Ok(f(&mut s.memory))
        })
    }

    /// Number of regions this shard holds.
    pub fn region_count(&self) -> usize {
        state_of(self).map_or(0, |s| s.regions.try_borrow().map_or(0, |r| r.table.len()))
    }

    /// This shard's remote-memory counters.
    pub fn rma_stats(&self) -> RmaStats {
        state_of(self).map_or_else(RmaStats::default, |s| s.stats.get())
    }

    /// Writes `data` at `offset` of `region` on its node, from any shard, and waits for the
    /// holder's answer within `timeout`.
    ///
    /// Errors: [`RmaOpError::Invalid`] (refused by the descriptor, nothing sent);
    /// [`RmaOpError::Refused`] (refused by the holder, with its code; the memory is unchanged);
    /// [`RmaOpError::Net`] ([`NetError::TimedOut`]: no answer in time, and the put may or may
    /// not have been applied; connection errors; [`NetError::TooLarge`]);
    /// [`RmaOpError::BadReply`].
    pub async fn rma_put(
        self: &Rc<Self>,
        region: &RemoteRegion,
        offset: u64,
        data: &[u8],
        timeout: Duration,
    ) -> Result<(), RmaOpError> {
        region
            .check(offset, data.len() as u64, Access::Write)
            .map_err(|source| RmaOpError::Invalid { source })?;
        let put = PutRequest {
            generation: region.generation(),
            offset,
            data,
        };
        let mut payload = Vec::with_capacity(put.encoded_len());
        // Cannot fail: the limit is unbounded and the reply is a success one; the net checks
        // the size against its own limit.
        let _ = put.encode_to_vec(&mut payload, &UNBOUNDED);
        let (_, reply) = self
            .request(
                self.rma_dest(region),
                FrameKind::RmaPut,
                region.id().get(),
                payload,
                timeout,
            )
            .await?;
        match reply_data(region, &reply)? {
            0 => Ok(()),
            _ => Err(RmaOpError::BadReply {
                node: region.node,
                reason: "data in a put reply",
            }),
        }
    }

    /// Reads `len` bytes at `offset` of `region` on its node, from any shard, within
    /// `timeout`. Errors as [`ShardCtx::rma_put`], and [`RmaOpError::TooLarge`] for a reply
    /// over proto's default message size.
    pub async fn rma_get(
        self: &Rc<Self>,
        region: &RemoteRegion,
        offset: u64,
        len: u64,
        timeout: Duration,
    ) -> Result<Vec<u8>, RmaOpError> {
        region
            .check(offset, len, Access::Read)
            .map_err(|source| RmaOpError::Invalid { source })?;
        let get = GetRequest {
            generation: region.generation(),
            offset,
            len,
        };
        let limits = Limits::default();
        let payload = get.to_bytes(&limits).map_err(|_| RmaOpError::TooLarge {
            len: get.reply_len(),
            max: limits.max_message_size,
        })?;
        let (_, mut reply) = self
            .request(
                self.rma_dest(region),
                FrameKind::RmaGet,
                region.id().get(),
                payload.to_vec(),
                timeout,
            )
            .await?;
        if reply_data(region, &reply)? as u64 != len {
            return Err(RmaOpError::BadReply {
                node: region.node,
                reason: "get reply of the wrong length",
            });
        }
        reply.drain(..RmaReply::HEADER_LEN);
        Ok(reply)
    }

    /// Where a request for `region` goes: on the rail to the shard that holds it; to the node
    /// (this shard's default rail) when the node has no such shard, so that the holder side
    /// refuses a forged descriptor with its code, or when the node is not connected yet.
    fn rma_dest(&self, region: &RemoteRegion) -> Dest {
        match self.owner_of_shard(region.node, region.shard) {
            Some(_) => Dest::shard(region.node, region.shard),
            None => Dest::from(region.node),
        }
    }

    /// Runs `f` on this shard's regions if `region` is held here.
    fn with_regions<R>(
        &self,
        region: RegionId,
        f: impl FnOnce(&mut Regions, ShardId) -> Result<R, RmaOpError>,
    ) -> Result<R, RmaOpError> {
        let shard = self.id();
        let state = state_of(self).ok_or(RmaOpError::NotInstalled { shard })?;
        if holder_of(region) != shard {
            return Err(RmaOpError::NotHere { region, shard });
        }
        let mut regions = state
            .regions
            .try_borrow_mut()
            .map_err(|_| RmaOpError::Reentrant { shard })?;
        f(&mut regions, shard)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;

    fn sample() -> RemoteRegion {
        RemoteRegion {
            node: NodeId::new(0x0102_0304_0506_0708),
            shard: ShardId::new(3),
            region: RegionDescriptor {
                id: wire_id(ShardId::new(3), 9),
                generation: Generation::new(0xAABB),
                len: 4096,
                permissions: Permissions::READ,
            },
        }
    }

    #[test]
    fn descriptor_round_trip_and_golden() {
        let d = sample();
        let b = d.to_bytes();
        assert_eq!(&b[0..8], &[8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(&b[8..12], &((3u32 << 20) | 9).to_le_bytes());
        assert_eq!(&b[12..16], &[3, 0, 1, 0]);
        assert_eq!(&b[16..24], &0xAABBu64.to_le_bytes());
        assert_eq!(&b[24..32], &4096u64.to_le_bytes());
        assert_eq!(RemoteRegion::from_bytes(&b), Ok(d));
        assert_eq!(d.shard(), holder_of(d.id()));
        assert_eq!(slot_of(d.id()), 9);
    }

    #[test]
    fn descriptor_decode_refuses_garbage() {
        let b = sample().to_bytes();
        for cut in 0..b.len() {
            assert!(RemoteRegion::from_bytes(&b[..cut]).is_err());
        }
        let mut long = b.to_vec();
        long.push(0);
        assert!(RemoteRegion::from_bytes(&long).is_err());
        let mut perm = b;
        perm[14] = 4;
        assert!(RemoteRegion::from_bytes(&perm).is_err());
        let mut reserved = b;
        reserved[15] = 1;
        assert!(RemoteRegion::from_bytes(&reserved).is_err());
        let mut shard = b;
        shard[12] = 4;
        assert!(RemoteRegion::from_bytes(&shard).is_err());
        let mut zero = b;
        zero[8..12].copy_from_slice(&(3u32 << 20).to_le_bytes());
        assert!(RemoteRegion::from_bytes(&zero).is_err());
    }

    #[test]
    fn ids_name_shard_and_slot() {
        let top = wire_id(ShardId::new(4095), MAX_REGIONS_PER_SHARD as u32);
        assert_eq!(top.get(), u32::MAX);
        assert_eq!(holder_of(top), ShardId::new(4095));
        assert_eq!(slot_of(top) as usize, MAX_REGIONS_PER_SHARD);
        let first = wire_id(ShardId::new(0), 1);
        assert_eq!((holder_of(first), slot_of(first)), (ShardId::new(0), 1));
    }

    #[test]
    fn regions_check_and_copy_ranges() {
        let mut r = Regions::new(Generation::new(10));
        let d = r
            .table
            .register(RegionSpec {
                len: 8,
                permissions: Permissions::READ_WRITE,
                grantee: None,
                handle: 1,
            })
            .unwrap();
        r.slots.push(Some(Slot {
            table_id: d.id,
            memory: vec![0; 8],
        }));
        let id = wire_id(ShardId::new(0), 1);
        let a = NodeId::new(1);
        let (slot, range) = r.check(a, id, (d.generation, 6, 2), Access::Write).unwrap();
        assert_eq!((slot, range.clone()), (1, 6..8));
        r.memory_mut(slot, range).unwrap().copy_from_slice(b"xy");
        assert_eq!(r.memory(1, 0..8).unwrap(), b"\0\0\0\0\0\0xy");
        assert_eq!(
            r.check(a, id, (d.generation, 7, 2), Access::Write),
            Err(RmaErrorCode::OutOfBounds)
        );
        assert_eq!(
            r.check(a, id, (d.generation, u64::MAX, 2), Access::Read),
            Err(RmaErrorCode::OutOfBounds)
        );
        assert_eq!(
            r.check(
                a,
                wire_id(ShardId::new(0), 2),
                (d.generation, 0, 1),
                Access::Read
            ),
            Err(RmaErrorCode::UnknownRegion)
        );
        assert_eq!(
            r.check(a, id, (d.generation.next(), 0, 1), Access::Read),
            Err(RmaErrorCode::StaleGeneration)
        );
    }

    #[test]
    fn errors_report_codes() {
        let e = RmaOpError::Refused {
            node: NodeId::new(1),
            region: RegionId::new(2),
            code: RmaErrorCode::NotGrantee,
        };
        assert_eq!(e.code(), Some(RmaErrorCode::NotGrantee));
        let e = RmaOpError::Invalid {
            source: RmaError::UnknownRegion {
                region: RegionId::new(2),
            },
        };
        assert_eq!(e.code(), Some(RmaErrorCode::UnknownRegion));
        let t = RmaOpError::Net(NetError::TimedOut { what: "request" });
        assert!(t.is_timeout() && t.code().is_none());
    }
}
