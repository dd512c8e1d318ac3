//! Trusted-mode remote memory: native UCX RMA with packed remote keys, only when enabled.
//!
//! # Read this first: the target cannot protect itself
//!
//! UCX over TCP and shared memory (tcp, posix, sysv, cma) does **not** enforce remote keys. A
//! peer that holds any remote key of a process can write, and read, **anywhere** in that
//! process's address space, and unmapping the memory revokes nothing. In trusted mode this node
//! hands such keys out. Enable it only between processes that trust each other completely
//! (one cluster, one operator, one failure domain): a buggy or malicious peer can corrupt this
//! process's memory without a trace. Everything below that looks like a check is a check the
//! *initiator* makes on itself, to catch its own bugs; the target checks nothing. The default,
//! checked mode ([`crate::rma`]) keeps every rkey at home and checks every access on the
//! target.
//!
//! ## Enabling it
//!
//! Trusted mode is on when the shards' UCX contexts have `UCP_FEATURE_RMA`
//! ([`crate::ShardsBuilder::features`] with [`crate::ucx::Features::rma`] set; the facade's
//! `NodeBuilder::trusted_rma` does it). Shards start without it
//! ([`crate::ucx::Features::messaging`]); then every call here fails with
//! [`RmaOpError::TrustedOff`] and nothing touches UCX. A node that only initiates needs the mode
//! as much as a node that holds regions (UCX needs the feature on both sides).
//!
//! ## Regions and descriptors
//!
//! [`ShardCtx::register_trusted_region`] lets UCX allocate and map `len` bytes on the calling
//! shard's context (`ucp_mem_map` with `UCP_MEM_MAP_ALLOCATE`: on one host this is shared memory
//! the peer maps and writes with no CPU of ours, and unmapping it takes it out of this
//! process), zeroes them and packs their remote key. The returned [`TrustedRegion`] is `!Send`
//! and owns the mapping; it reads and writes the memory with copies only
//! ([`TrustedRegion::read_at`], [`TrustedRegion::write_at`]), because peers may write it at any
//! moment, so no Rust reference to it may exist. Dropping it unmaps the memory: do that only
//! once no peer will use its descriptor any more (the application's protocol must say when; a
//! peer writing through a stale key over `cma` writes into whatever this process has mapped at
//! that address by then).
//!
//! Its [`TrustedDescriptor`] is `Send + Sync`: node id, the node's incarnation, holding shard,
//! region id, length, permissions, base address, host id, the packed remote key and the holding
//! shard's worker address. [`TrustedDescriptor::to_bytes`] encodes it (layout below) so that an
//! application can hand it to a peer, e.g. in an active message; [`TrustedDescriptor::from_bytes`]
//! checks sizes and fields before anything is used (UCX's own unpacking trusts the sizes inside
//! a key, so the key's layout is checked again by `shardcx-ucx` before it is unpacked).
//!
//! ## A put's or a get's path
//!
//! 1. On the calling shard: trusted mode on, and the access checked against the descriptor
//!    (permission, and `offset + len <= len` without overflow) — a refusal is
//!    [`RmaOpError::Invalid`] and nothing is sent. The permissions are the holder's wish,
//!    enforced only here.
//! 2. The operation runs on the calling shard, with its deadline as an [`Instant`]: every
//!    shard has its own rail to the descriptor's node, and its own RMA endpoints.
//! 3. The shard checks that a session with that node is ready ([`NetError::NotConnected`]
//!    otherwise, which the facade turns into a lazy connect) and that the session's
//!    incarnation is the descriptor's ([`RmaOpError::StaleIncarnation`] otherwise: a key of a
//!    previous run of the peer names memory of a process that is gone, and its addresses mean
//!    something else in the new one).
//! 4. It takes, from its cache, the endpoint to the holding shard's worker and the unpacked
//!    key, making them on first use (and refusing a holder that only tcp reaches,
//!    [`RmaOpError::TrustedTransport`]: see below); then posts `ucp_put_nbx` and flushes the
//!    endpoint (the put resolves once remotely complete), or posts `ucp_get_nbx` into a new
//!    buffer. The operation races its deadline; past it, the future is dropped (the request is
//!    cancelled and its buffer parked until UCX lets go) and the call fails with
//!    [`NetError::TimedOut`] — a
//!    put may or may not have been applied.
//!
//! ## Endpoints and the key cache
//!
//! The session's own endpoint belongs to the net module's sender task, so each shard keeps
//! endpoints of its own for RMA: one per (peer node, holding shard), connected by the worker
//! address in the descriptor, so that the key is unpacked against the very worker whose
//! context mapped the memory. The first operation on a new endpoint waits for its wire-up (a
//! flush) before it is posted.
//!
//! ## Which transports: shared memory or RDMA, never tcp
//!
//! Where an endpoint would go is decided from this shard's transports (as UCX lists them) and
//! the descriptor's host id (a hash of the kernel's boot id, the same for every process of one
//! machine):
//!
//! - The holder runs on this machine and the context has shared-memory transports (posix, sysv,
//!   cma...): the endpoint uses [`ErrorMode::None`], since UCX 1.12's shared-memory transports
//!   have no peer-failure handling and an endpoint asking for it never uses them. UCX then
//!   picks shared memory: the initiator copies straight into the holder's memory.
//! - Otherwise, the context has an RDMA transport (`rc_*`, `dc_*`, `ud_*`, `ugni_*`): the
//!   endpoint uses the net module's rule ([`ErrorMode::Peer`] when `tcp` is also there).
//! - Otherwise only tcp is left, and the operation fails with [`RmaOpError::TrustedTransport`]
//!   before any endpoint is made. Over tcp UCX 1.12 has no RMA: it emulates put and get with
//!   active messages that the target's CPU serves. During development, before tcp was
//!   refused, that measured no faster than checked mode, and UCX's tcp transport sometimes
//!   crashed the *target* process with these endpoints: with [`ErrorMode::None`] in the tcp
//!   test (a null free in `uct_tcp_ep_progress_am_rx`, after `uct_tcp_ep_replace_ep`, called
//!   by the wire-up of the new endpoint, moved away the receive buffer being parsed when the
//!   first operations arrived in the same read as the wire-up request); with
//!   [`ErrorMode::Peer`] in the example (`ucp_put_handler` copying to an unmapped page). Tcp
//!   peers use checked mode instead.
//!
//! Failures are also found above UCX: by the session's heartbeats (step 3 runs before every
//! operation), by the deadline every operation has, and by UCX errors (which drop that
//! endpoint's entry).
//!
//! Unpacked keys are cached per (endpoint, region), and a cached key is used only if its packed
//! bytes equal the descriptor's. The cache of a peer (its endpoints and keys) is dropped when
//! its connection ends ([`ShardCtx::on_peer_lost`], registered when the shard first uses
//! trusted mode; at shut-down it drops everything, before the worker goes), and when an
//! operation finds no session with it or a session of another incarnation. At most
//! [`MAX_CACHED_KEYS`] keys are kept per endpoint. [`TrustedStats`] counts endpoints made,
//! keys unpacked, cache hits and invalidations.
//!
//! ## Encoding of a descriptor
//!
//! Little-endian, [`TrustedDescriptor::HEADER_LEN`] = 64 bytes then the two byte strings:
//!
//! ```text
//!  0 [4] magic "SCXT"        4 u8  version (1)      5 u8  permissions   6 u16 shard
//!  8 u64 node id            16 u64 incarnation     24 u32 region id    28 u32 rkey length
//! 32 u64 base address       40 u64 length          48 u32 worker address length
//! 52 u32 reserved, zero     56 u64 host id         64 rkey bytes, then worker address bytes
//! ```
//!
//! ## Limits
//!
//! - Every node of a trusted cluster must run trusted mode; the handshake does not (yet)
//!   negotiate proto's `Features::TRUSTED_RMA`, so a descriptor is the only sign a peer gives.
//! - Puts copy the caller's bytes into a buffer the operation owns; gets return a new vector.
//! - Operations are ordered only if the caller awaits each one.
//! - "Same machine" is "same boot id": two containers of one host that do not share their IPC
//!   namespace have the same boot id but no shared memory between them, and UCX would then
//!   fall back to tcp under [`ErrorMode::None`] (the crash above). Give such nodes RDMA, or
//!   use checked mode.
//! - The endpoints are each shard's own, not its rail's: one more UCX connection per (local
//!   shard, peer, holding shard). A hook in the net module handing out the session's endpoint would
//!   save them and their wire-up.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_lite::future;
use glommio::timer::sleep;

use crate::boot::ShardCtx;
use crate::error::NetError;
use crate::net::MAX_REQUEST_TIMEOUT;
use crate::proto::region::{Access, Permissions, RegionDescriptor, RmaError};
use crate::proto::shard_map::MAX_SHARDS;
use crate::proto::{Generation, Incarnation, NodeId, RegionId, ShardId};
use crate::rma::{DescriptorError, RmaOpError};
use crate::ucx::{Endpoint, EpOptions, ErrorMode, MemHandle, PackedRkey, RemoteKey};
use crate::ucx::{Error as UcxError, WorkerAddress};

/// Longest packed remote key a descriptor may carry.
pub const MAX_RKEY_LEN: usize = 4 << 10;
/// Longest worker address a descriptor may carry.
pub const MAX_WORKER_ADDRESS_LEN: usize = 64 << 10;
/// Most unpacked keys cached per endpoint (the cache is emptied when it would grow past this).
pub const MAX_CACHED_KEYS: usize = 1024;

const MAGIC: [u8; 4] = *b"SCXT";
const VERSION: u8 = 1;

/// A trusted region as peers name it: where its memory is and the remote key that reaches it.
/// `Send + Sync`, cheap to clone (the byte strings are shared). Only
/// [`ShardCtx::register_trusted_region`] and [`TrustedDescriptor::from_bytes`] make one.
///
/// Holding one is holding write access to the whole holder process (see the module docs).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct TrustedDescriptor {
    node: NodeId,
    incarnation: Incarnation,
    shard: ShardId,
    id: RegionId,
    permissions: Permissions,
    address: u64,
    len: u64,
    /// The holder's machine ([`host_id`]; zero when unknown).
    host: u64,
    rkey: Arc<[u8]>,
    worker: Arc<[u8]>,
}

/// Memory mapped with UCX on this shard, whose remote key peers may hold. `!Send`: it belongs to
/// the shard that registered it. Dropping it unmaps the memory (see the module docs for when
/// that is safe).
pub struct TrustedRegion {
    memory: MemHandle,
    descriptor: TrustedDescriptor,
}

/// Counters of one shard's trusted-mode operations (those it ran, and the regions it holds).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TrustedStats {
    /// Regions registered on this shard.
    pub regions: u64,
    /// Puts completed (remotely) from this shard.
    pub puts: u64,
    /// Gets completed from this shard.
    pub gets: u64,
    /// Operations that failed in UCX (their endpoint's cache entry was dropped).
    pub failed: u64,
    /// Operations that ran out of time on this shard.
    pub timed_out: u64,
    /// RMA endpoints created.
    pub endpoints: u64,
    /// Remote keys unpacked.
    pub keys_unpacked: u64,
    /// Operations that found their key in the cache.
    pub key_hits: u64,
    /// Cache entries (peers) dropped because their session ended or changed.
    pub invalidated: u64,
}

/// The RMA endpoint to one holding shard of a peer, and the keys unpacked on it.
struct HolderCache {
    worker: Arc<[u8]>,
    ep: Rc<Endpoint>,
    /// Set once a flush of the new endpoint completed, i.e. its wire-up is done (see
    /// [`wired`]).
    wired: Rc<Cell<bool>>,
    keys: HashMap<RegionId, (Arc<[u8]>, Rc<RemoteKey>)>,
}

/// Which kinds of transports a context has (from `Context::info`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Transports {
    tcp: bool,
    shared_memory: bool,
    rdma: bool,
}

/// What an operation needs from the cache: the endpoint, whether its wire-up is known to be
/// done, and the unpacked key.
struct Route {
    ep: Rc<Endpoint>,
    wired: Rc<Cell<bool>>,
    key: Rc<RemoteKey>,
}

/// What a shard keeps for one peer node.
struct PeerCache {
    incarnation: Incarnation,
    holders: HashMap<ShardId, HolderCache>,
}

/// One shard's trusted-mode state (in the shard's extension slot, [`ShardCtx::ext`]; its
/// endpoints and unpacked keys are released at the shard's teardown).
struct TrustedState {
    /// This shard's worker address, once asked for.
    worker: RefCell<Option<Arc<[u8]>>>,
    /// This shard's transports, once asked for.
    transports: Cell<Option<Transports>>,
    next_id: Cell<u32>,
    peers: RefCell<HashMap<NodeId, PeerCache>>,
    stats: Cell<TrustedStats>,
}

impl TrustedDescriptor {
    /// Bytes before the remote key in [`TrustedDescriptor::to_bytes`].
    pub const HEADER_LEN: usize = 64;

    /// The node holding the region.
    pub fn node(&self) -> NodeId {
        self.node
    }

    /// The incarnation of that node the region belongs to.
    pub fn incarnation(&self) -> Incarnation {
        self.incarnation
    }

    /// The shard of that node holding the memory.
    pub fn shard(&self) -> ShardId {
        self.shard
    }

    /// The region's id on its shard (unique among the shard's live regions).
    pub fn id(&self) -> RegionId {
        self.id
    }

    /// The region's length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the region is empty (never: empty regions are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// What the holder allows, checked by initiators only.
    pub fn permissions(&self) -> Permissions {
        self.permissions
    }

    /// The region's base address in the holder's process.
    pub fn address(&self) -> u64 {
        self.address
    }

    /// The holder's machine: a hash of its kernel's boot id, zero when unknown (see the module
    /// docs for what it decides).
    pub fn host(&self) -> u64 {
        self.host
    }

    /// Bytes of [`TrustedDescriptor::to_bytes`].
    pub fn encoded_len(&self) -> usize {
        Self::HEADER_LEN + self.rkey.len() + self.worker.len()
    }

    /// The descriptor as bytes (see the module docs for the layout).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(self.encoded_len());
        b.extend_from_slice(&MAGIC);
        b.push(VERSION);
        b.push(self.permissions.bits());
        b.extend_from_slice(&self.shard.get().to_le_bytes());
        b.extend_from_slice(&self.node.get().to_le_bytes());
        b.extend_from_slice(&self.incarnation.get().to_le_bytes());
        b.extend_from_slice(&self.id.get().to_le_bytes());
        // Both lengths fit a u32: bounded by MAX_RKEY_LEN and MAX_WORKER_ADDRESS_LEN.
        b.extend_from_slice(&(self.rkey.len() as u32).to_le_bytes());
        b.extend_from_slice(&self.address.to_le_bytes());
        b.extend_from_slice(&self.len.to_le_bytes());
        b.extend_from_slice(&(self.worker.len() as u32).to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&self.host.to_le_bytes());
        b.extend_from_slice(&self.rkey);
        b.extend_from_slice(&self.worker);
        b
    }

    /// A descriptor from bytes made by [`TrustedDescriptor::to_bytes`]. Checks the magic, the
    /// version, every field's range (a known permission set, a shard below 4096, a non-zero
    /// id and length, `address + len` without overflow, key and address lengths within
    /// [`MAX_RKEY_LEN`] and [`MAX_WORKER_ADDRESS_LEN`]) and that the length is exact.
    pub fn from_bytes(b: &[u8]) -> Result<Self, DescriptorError> {
        let bad = |reason| DescriptorError { reason };
        if b.len() < Self::HEADER_LEN {
            return Err(bad("shorter than a trusted descriptor's header"));
        }
        // In bounds: the header is HEADER_LEN bytes, checked above.
        let u16_at = |at: usize| u16::from_le_bytes([b[at], b[at + 1]]);
        let u32_at = |at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        let u64_at = |at: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[at..at + 8]);
            u64::from_le_bytes(x)
        };
        if b[..4] != MAGIC {
            return Err(bad("not a trusted descriptor (magic)"));
        }
        if b[4] != VERSION {
            return Err(bad("unknown trusted descriptor version"));
        }
        let permissions = Permissions::from_bits(b[5]).ok_or(bad("unknown permission bits"))?;
        let shard = u16_at(6);
        if shard >= MAX_SHARDS {
            return Err(bad("shard out of range"));
        }
        let id = u32_at(24);
        if id == 0 {
            return Err(bad("zero region id"));
        }
        let (address, len) = (u64_at(32), u64_at(40));
        if len == 0 {
            return Err(bad("empty region"));
        }
        if address.checked_add(len).is_none() {
            return Err(bad("region wraps the address space"));
        }
        if u32_at(52) != 0 {
            return Err(bad("reserved bytes not zero"));
        }
        let rkey_len = u32_at(28) as usize;
        let worker_len = u32_at(48) as usize;
        if rkey_len == 0 || rkey_len > MAX_RKEY_LEN {
            return Err(bad("remote key length out of range"));
        }
        if worker_len == 0 || worker_len > MAX_WORKER_ADDRESS_LEN {
            return Err(bad("worker address length out of range"));
        }
        // No overflow: both lengths are bounded above.
        let rkey_end = Self::HEADER_LEN + rkey_len;
        if b.len() != rkey_end + worker_len {
            return Err(bad("length does not match the key and address lengths"));
        }
        Ok(Self {
            node: NodeId::new(u64_at(8)),
            incarnation: Incarnation::new(u64_at(16)),
            shard: ShardId::new(shard),
            id: RegionId::new(id),
            permissions,
            address,
            len,
            host: u64_at(56),
            rkey: Arc::from(&b[Self::HEADER_LEN..rkey_end]),
            worker: Arc::from(&b[rkey_end..]),
        })
    }

    /// The initiator's check of an access (see the module docs): permission and bounds.
    pub fn check(&self, offset: u64, len: u64, access: Access) -> Result<(), RmaError> {
        RegionDescriptor {
            id: self.id,
            generation: Generation::new(0),
            len: self.len,
            permissions: self.permissions,
        }
        .check(offset, len, access)
    }

    /// The remote address of `offset`, once [`TrustedDescriptor::check`] passed.
    fn remote(&self, offset: u64) -> u64 {
        // No overflow: offset <= len (checked) and address + len does not overflow (checked
        // when the descriptor was made).
        self.address + offset
    }
}

impl fmt::Debug for TrustedDescriptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TrustedDescriptor")
            .field("node", &self.node)
            .field("incarnation", &self.incarnation)
            .field("shard", &self.shard)
            .field("id", &self.id)
            .field("permissions", &self.permissions)
            .field("address", &format_args!("{:#x}", self.address))
            .field("len", &self.len)
            .field("host", &format_args!("{:#x}", self.host))
            .field("rkey_len", &self.rkey.len())
            .field("worker_address_len", &self.worker.len())
            .finish()
    }
}

impl TrustedRegion {
    /// The descriptor to hand to peers (clone it to send it; it is `Send`).
    pub fn descriptor(&self) -> &TrustedDescriptor {
        &self.descriptor
    }

    /// The region's id.
    pub fn id(&self) -> RegionId {
        self.descriptor.id
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.memory.len()
    }

    /// Whether the region is empty (never: empty regions are refused).
    pub fn is_empty(&self) -> bool {
        self.memory.is_empty()
    }

    /// Copies bytes at `offset` into `out`. Peers may be writing the same bytes at the same time:
    /// nothing orders a local read with remote writes but the application's own protocol.
    pub fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<(), RmaOpError> {
        let at = self.local_range(offset, out.len())?;
        self.memory
            .read_at(at, out)
            .map_err(|source| RmaOpError::Ucx { op: "read", source })
    }

    /// Copies `data` into the region at `offset` (as [`TrustedRegion::read_at`]).
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), RmaOpError> {
        let at = self.local_range(offset, data.len())?;
        self.memory
            .write_at(at, data)
            .map_err(|source| RmaOpError::Ucx {
                op: "write",
                source,
            })
    }

    /// A copy of the whole region.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len()];
        // Cannot fail: the range is the whole region.
        let _ = self.memory.read_at(0, &mut out);
        out
    }

    /// `offset` as a local index, if `len` bytes from it lie in the region.
    fn local_range(&self, offset: u64, len: usize) -> Result<usize, RmaOpError> {
        let d = &self.descriptor;
        let out = || RmaOpError::Invalid {
            source: RmaError::OutOfBounds {
                region: d.id,
                offset,
                len: len as u64,
                region_len: d.len,
            },
        };
        match offset.checked_add(len as u64) {
            Some(end) if end <= d.len => usize::try_from(offset).map_err(|_| out()),
            _ => Err(out()),
        }
    }
}

impl fmt::Debug for TrustedRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TrustedRegion")
            .field("descriptor", &self.descriptor)
            .finish()
    }
}

impl TrustedState {
    fn count(&self, f: impl FnOnce(&mut TrustedStats)) {
        let mut s = self.stats.get();
        f(&mut s);
        self.stats.set(s);
    }

    /// This shard's worker address (asked of UCX once).
    fn worker_address(&self, ctx: &ShardCtx) -> Result<Arc<[u8]>, RmaOpError> {
        if let Some(a) = self.worker.borrow().as_ref() {
            return Ok(a.clone());
        }
        let a: Arc<[u8]> = ctx
            .worker()
            .address()
            .map_err(|source| RmaOpError::Ucx {
                op: "worker address",
                source,
            })?
            .as_bytes()
            .into();
        if a.len() > MAX_WORKER_ADDRESS_LEN {
            return Err(RmaOpError::Ucx {
                op: "worker address",
                source: UcxError::InvalidArgument("worker address too long for a descriptor"),
            });
        }
        *self.worker.borrow_mut() = Some(a.clone());
        Ok(a)
    }

    /// The endpoint and unpacked key for `d`, on this shard: checks the session, then
    /// the cache (see the module docs).
    fn route(&self, ctx: &ShardCtx, d: &TrustedDescriptor) -> Result<Route, RmaOpError> {
        let mut peers = self.peers.borrow_mut();
        let Some(session) = ctx.session(d.node).map(|r| r.incarnation) else {
            if peers.remove(&d.node).is_some() {
                self.count(|s| s.invalidated += 1);
            }
            return Err(RmaOpError::Net(NetError::NotConnected { node: d.node }));
        };
        if peers.get(&d.node).is_some_and(|p| p.incarnation != session) {
            peers.remove(&d.node);
            self.count(|s| s.invalidated += 1);
        }
        if session != d.incarnation {
            return Err(RmaOpError::StaleIncarnation {
                node: d.node,
                descriptor: d.incarnation,
                session,
            });
        }
        let peer = peers.entry(d.node).or_insert_with(|| PeerCache {
            incarnation: session,
            holders: HashMap::new(),
        });
        if peer
            .holders
            .get(&d.shard)
            .is_some_and(|h| !same_bytes(&h.worker, &d.worker))
        {
            // Another worker address for the same shard of the same run: a forged or corrupt
            // descriptor, or a bug; do not mix keys of the two.
            peer.holders.remove(&d.shard);
        }
        let holder = match peer.holders.entry(d.shard) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let address = WorkerAddress::from_bytes(d.worker.to_vec());
                let opts = EpOptions {
                    error_mode: self.error_mode(ctx, d)?,
                };
                let ep = Endpoint::connect_to_worker(ctx.worker(), &address, opts).map_err(
                    |source| RmaOpError::Ucx {
                        op: "connect",
                        source,
                    },
                )?;
                self.count(|s| s.endpoints += 1);
                e.insert(HolderCache {
                    worker: d.worker.clone(),
                    ep: Rc::new(ep),
                    wired: Rc::new(Cell::new(false)),
                    keys: HashMap::new(),
                })
            }
        };
        let (ep, wired) = (holder.ep.clone(), holder.wired.clone());
        if let Some((bytes, key)) = holder.keys.get(&d.id) {
            if same_bytes(bytes, &d.rkey) {
                self.count(|s| s.key_hits += 1);
                let key = key.clone();
                return Ok(Route { ep, wired, key });
            }
        }
        let packed = PackedRkey::from_bytes(d.rkey.to_vec());
        let key = Rc::new(
            RemoteKey::unpack(&ep, &packed).map_err(|source| RmaOpError::Ucx {
                op: "unpack remote key",
                source,
            })?,
        );
        self.count(|s| s.keys_unpacked += 1);
        if holder.keys.len() >= MAX_CACHED_KEYS {
            holder.keys.clear();
        }
        holder.keys.insert(d.id, (d.rkey.clone(), key.clone()));
        Ok(Route { ep, wired, key })
    }

    /// The error mode of a new endpoint to `d`'s holder, or why there is none (only tcp
    /// would reach it; see the module docs).
    fn error_mode(&self, ctx: &ShardCtx, d: &TrustedDescriptor) -> Result<ErrorMode, RmaOpError> {
        let t = self.transports.get().unwrap_or_else(|| {
            let t = transports_of(&ctx.context().info());
            self.transports.set(Some(t));
            t
        });
        let here = host_id();
        if t.shared_memory && here != 0 && d.host == here {
            Ok(ErrorMode::None)
        } else if t.rdma {
            Ok(if t.tcp {
                ErrorMode::Peer
            } else {
                ErrorMode::None
            })
        } else {
            Err(RmaOpError::TrustedTransport { node: d.node })
        }
    }

    /// The connection to `node` ended (`None`: every node, at shut-down): drops its endpoints
    /// and keys.
    fn on_peer_lost(&self, node: Option<NodeId>) {
        // Never fails: `peers` is borrowed only inside `route` and `forget`, which do not await
        // and call nothing that runs this hook (the net task and shut-down run it).
        let Ok(mut peers) = self.peers.try_borrow_mut() else {
            return;
        };
        let n = match node {
            Some(node) => u64::from(peers.remove(&node).is_some()),
            None => {
                let n = peers.len() as u64;
                peers.clear();
                n
            }
        };
        self.count(|s| s.invalidated += n);
    }

    /// Drops the endpoint used for `d` (after a UCX error on it).
    fn forget(&self, d: &TrustedDescriptor) {
        if let Some(p) = self.peers.borrow_mut().get_mut(&d.node) {
            p.holders.remove(&d.shard);
        }
    }
}

/// The trusted-mode state of `ctx`'s shard, made on first use (which also registers its
/// connection-lost hook).
fn state(ctx: &Rc<ShardCtx>) -> Rc<TrustedState> {
    if let Some(st) = existing_state(ctx) {
        return st;
    }
    let st = ctx.ext_or_insert_with(|| TrustedState {
        worker: RefCell::new(None),
        transports: Cell::new(None),
        next_id: Cell::new(1),
        peers: RefCell::new(HashMap::new()),
        stats: Cell::new(TrustedStats::default()),
    });
    // Weak: the hook lives in the shard's net state, and must not keep this state alive.
    let weak = Rc::downgrade(&st);
    ctx.on_peer_lost(move |node, _err| {
        if let Some(st) = weak.upgrade() {
            st.on_peer_lost(node);
        }
    });
    st
}

/// The state of `ctx`'s shard, if it has one (for counters; makes none).
fn existing_state(ctx: &ShardCtx) -> Option<Rc<TrustedState>> {
    ctx.ext::<TrustedState>()
}

/// Which kinds of transports a context's resources include (as `Context::info` lists them:
/// `# resource N : md M dev D flags -- tl/device`).
fn transports_of(info: &str) -> Transports {
    const SHARED_MEMORY: [&str; 5] = ["posix/", "sysv/", "cma/", "xpmem/", "knem/"];
    const RDMA: [&str; 4] = ["rc_", "dc_", "ud_", "ugni_"];
    let tls: Vec<&str> = info
        .lines()
        .filter(|l| {
            l.trim_start_matches('#')
                .trim_start()
                .starts_with("resource")
        })
        .filter_map(|l| l.split_whitespace().last())
        .collect();
    let any = |prefixes: &[&str]| {
        tls.iter()
            .any(|t| prefixes.iter().any(|p| t.starts_with(p)))
    };
    Transports {
        tcp: any(&["tcp/"]),
        shared_memory: any(&SHARED_MEMORY),
        rdma: any(&RDMA),
    }
}

/// This machine's id: a hash (FNV-1a) of the kernel's boot id, the same for every process of
/// one boot of one machine; zero when it cannot be read.
pub fn host_id() -> u64 {
    static ID: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *ID.get_or_init(|| {
        let Ok(boot) = std::fs::read_to_string("/proc/sys/kernel/random/boot_id") else {
            return 0;
        };
        let h = boot.trim().bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        // Zero means "unknown".
        h.max(1)
    })
}

/// `now + timeout`, with the timeout capped (at [`MAX_REQUEST_TIMEOUT`], as requests are) so
/// that it cannot overflow.
fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout.min(MAX_REQUEST_TIMEOUT))
        .unwrap_or(now)
}

/// Runs `op` until `deadline`; `None` if the deadline came first (then `op` is dropped, which
/// cancels what it had posted and parks its buffers until UCX lets go of them).
async fn before<T>(deadline: Instant, op: impl Future<Output = T>) -> Option<T> {
    future::or(async { Some(op.await) }, async {
        sleep(deadline.saturating_duration_since(Instant::now())).await;
        None
    })
    .await
}

/// A zeroed buffer of `len` bytes for a get, or [`RmaOpError::TooLarge`] when this process
/// cannot allocate it: the length comes from a descriptor, and may be anything up to the
/// holder's address space (an allocation failure must not abort the process).
fn zeroed(len: u64) -> Result<Vec<u8>, RmaOpError> {
    let too_large = || RmaOpError::TooLarge {
        len,
        max: usize::MAX as u64,
    };
    let n = usize::try_from(len).map_err(|_| too_large())?;
    let mut buf = Vec::new();
    buf.try_reserve_exact(n).map_err(|_| too_large())?;
    buf.resize(n, 0);
    Ok(buf)
}

/// Whether two byte strings are equal: the same allocation (a descriptor used again, or its
/// clone), or else byte by byte.
fn same_bytes(a: &Arc<[u8]>, b: &Arc<[u8]>) -> bool {
    Arc::ptr_eq(a, b) || a == b
}

fn timed_out(what: &'static str) -> RmaOpError {
    RmaOpError::Net(NetError::TimedOut { what })
}

/// Waits, once per endpoint, for its wire-up before the first operation is posted (a flush of
/// a UCX endpoint completes only once its lanes are connected), so that the first operation's
/// deadline covers the connection and operations do not queue behind it inside UCX. (This alone
/// did not prevent UCX 1.12's tcp crash described in the module docs; keeping off tcp does.)
async fn wired(ep: &Endpoint, wired: &Cell<bool>) -> Result<(), UcxError> {
    if !wired.get() {
        ep.flush().await?;
        wired.set(true);
    }
    Ok(())
}

/// The put, on the calling shard.
async fn put_here(
    ctx: &Rc<ShardCtx>,
    d: &TrustedDescriptor,
    offset: u64,
    data: Vec<u8>,
    deadline: Instant,
) -> Result<(), RmaOpError> {
    let state = state(ctx);
    if Instant::now() >= deadline {
        state.count(|s| s.timed_out += 1);
        return Err(timed_out("put"));
    }
    let Route { ep, wired: w, key } = state.route(ctx, d)?;
    let remote = d.remote(offset);
    ctx.wake_driver();
    let done = before(deadline, async {
        wired(&ep, &w).await?;
        let (r, _data) = ep.put(data, remote, &key).await;
        r?;
        ep.flush().await
    })
    .await;
    match done {
        Some(Ok(())) => {
            state.count(|s| s.puts += 1);
            Ok(())
        }
        Some(Err(source)) => {
            state.count(|s| s.failed += 1);
            state.forget(d);
            Err(RmaOpError::Ucx { op: "put", source })
        }
        None => {
            state.count(|s| s.timed_out += 1);
            Err(timed_out("put"))
        }
    }
}

/// The get, on the calling shard.
async fn get_here(
    ctx: &Rc<ShardCtx>,
    d: &TrustedDescriptor,
    offset: u64,
    len: u64,
    deadline: Instant,
) -> Result<Vec<u8>, RmaOpError> {
    let state = state(ctx);
    if Instant::now() >= deadline {
        state.count(|s| s.timed_out += 1);
        return Err(timed_out("get"));
    }
    let buf = zeroed(len)?;
    let Route { ep, wired: w, key } = state.route(ctx, d)?;
    let remote = d.remote(offset);
    ctx.wake_driver();
    let done = before(deadline, async {
        wired(&ep, &w).await?;
        match ep.get(buf, remote, &key).await {
            (Ok(()), data) => Ok(data),
            (Err(e), _) => Err(e),
        }
    })
    .await;
    match done {
        Some(Ok(data)) => {
            state.count(|s| s.gets += 1);
            Ok(data)
        }
        Some(Err(source)) => {
            state.count(|s| s.failed += 1);
            state.forget(d);
            Err(RmaOpError::Ucx { op: "get", source })
        }
        None => {
            state.count(|s| s.timed_out += 1);
            Err(timed_out("get"))
        }
    }
}

impl ShardCtx {
    /// Whether trusted mode is on: this shard's UCX context has `UCP_FEATURE_RMA`.
    pub fn trusted_rma_enabled(&self) -> bool {
        self.context().features().rma
    }

    /// Maps `len` zeroed bytes with UCX on this shard and packs their remote key; the region's
    /// [`TrustedRegion::descriptor`] lets peers read and write it with native RMA, as
    /// `permissions` ask (enforced by initiators only: see the module docs).
    ///
    /// Errors: [`RmaOpError::TrustedOff`]; [`RmaOpError::Ucx`] (an empty region, UCX out of
    /// memory, a key or worker address that cannot be packed).
    pub fn register_trusted_region(
        self: &Rc<Self>,
        len: usize,
        permissions: Permissions,
    ) -> Result<TrustedRegion, RmaOpError> {
        self.trusted_on()?;
        let state = state(self);
        let worker = state.worker_address(self)?;
        let ucx = |op| move |source| RmaOpError::Ucx { op, source };
        let memory = MemHandle::allocate(self.context(), len).map_err(ucx("map"))?;
        // UCX may allocate from the heap, which is not zeroed.
        const ZEROS: [u8; 4096] = [0; 4096];
        let mut at = 0;
        while at < memory.len() {
            let n = ZEROS.len().min(memory.len() - at);
            memory.write_at(at, &ZEROS[..n]).map_err(ucx("zero"))?;
            at += n;
        }
        let rkey = memory.pack_rkey().map_err(ucx("pack remote key"))?;
        if rkey.as_bytes().is_empty() || rkey.as_bytes().len() > MAX_RKEY_LEN {
            return Err(RmaOpError::Ucx {
                op: "pack remote key",
                source: UcxError::InvalidArgument("remote key size out of range"),
            });
        }
        let id = state.next_id.get();
        // Ids wrap after 2^32 - 1 regions and skip zero; a reused id is harmless: keys are
        // cached with their bytes.
        state.next_id.set(id.checked_add(1).unwrap_or(1));
        state.count(|s| s.regions += 1);
        let descriptor = TrustedDescriptor {
            node: self.node_id(),
            incarnation: self.incarnation(),
            shard: self.id(),
            id: RegionId::new(id),
            permissions,
            address: memory.address(),
            len: memory.len() as u64,
            host: host_id(),
            rkey: rkey.as_bytes().into(),
            worker,
        };
        Ok(TrustedRegion { memory, descriptor })
    }

    /// Writes `data` at `offset` of the region `d` names, with native RMA, from the calling
    /// shard (each has its own rail and RMA endpoints), within `timeout`; resolves once the
    /// data is remotely complete (the endpoint was flushed).
    ///
    /// Errors: [`RmaOpError::TrustedOff`]; [`RmaOpError::Invalid`] (permission or bounds,
    /// nothing sent); [`RmaOpError::StaleIncarnation`]; [`RmaOpError::TrustedTransport`] (only
    /// tcp reaches the holder); [`RmaOpError::Net`]
    /// ([`NetError::NotConnected`], [`NetError::TimedOut`] — the put may or may not have been
    /// applied); [`RmaOpError::Ucx`].
    pub async fn trusted_put(
        self: &Rc<Self>,
        d: &TrustedDescriptor,
        offset: u64,
        data: &[u8],
        timeout: Duration,
    ) -> Result<(), RmaOpError> {
        self.trusted_on()?;
        d.check(offset, data.len() as u64, Access::Write)
            .map_err(|source| RmaOpError::Invalid { source })?;
        let deadline = deadline_after(timeout);
        // Copied: the put owns its buffer until UCX is done with it, also past a deadline.
        put_here(self, d, offset, data.to_vec(), deadline).await
    }

    /// Reads `len` bytes at `offset` of the region `d` names, with native RMA, from any shard,
    /// within `timeout`. Errors as [`ShardCtx::trusted_put`], and [`RmaOpError::TooLarge`]
    /// when this shard cannot allocate `len` bytes.
    pub async fn trusted_get(
        self: &Rc<Self>,
        d: &TrustedDescriptor,
        offset: u64,
        len: u64,
        timeout: Duration,
    ) -> Result<Vec<u8>, RmaOpError> {
        self.trusted_on()?;
        d.check(offset, len, Access::Read)
            .map_err(|source| RmaOpError::Invalid { source })?;
        let deadline = deadline_after(timeout);
        get_here(self, d, offset, len, deadline).await
    }

    /// This shard's trusted-mode counters.
    pub fn trusted_rma_stats(&self) -> TrustedStats {
        existing_state(self).map_or_else(TrustedStats::default, |s| s.stats.get())
    }

    /// [`RmaOpError::TrustedOff`] unless trusted mode is on.
    fn trusted_on(&self) -> Result<(), RmaOpError> {
        if self.trusted_rma_enabled() {
            Ok(())
        } else {
            Err(RmaOpError::TrustedOff { shard: self.id() })
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;
    use crate::proto::region::RmaErrorCode;

    fn sample() -> TrustedDescriptor {
        TrustedDescriptor {
            node: NodeId::new(0x0102_0304_0506_0708),
            incarnation: Incarnation::new(77),
            shard: ShardId::new(3),
            id: RegionId::new(9),
            permissions: Permissions::READ_WRITE,
            address: 0x7f00_0000_1000,
            len: 4096,
            host: 0x1122_3344_5566_7788,
            rkey: Arc::from(&[1u8, 2, 3][..]),
            worker: Arc::from(&[4u8, 5, 6, 7, 8][..]),
        }
    }

    #[test]
    fn descriptor_round_trip_and_golden() {
        let d = sample();
        let b = d.to_bytes();
        assert_eq!(b.len(), TrustedDescriptor::HEADER_LEN + 3 + 5);
        assert_eq!(b.len(), d.encoded_len());
        assert_eq!(&b[0..6], b"SCXT\x01\x03");
        assert_eq!(&b[6..8], &3u16.to_le_bytes());
        assert_eq!(&b[8..16], &[8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(&b[16..24], &77u64.to_le_bytes());
        assert_eq!(&b[24..28], &9u32.to_le_bytes());
        assert_eq!(&b[28..32], &3u32.to_le_bytes());
        assert_eq!(&b[32..40], &0x7f00_0000_1000u64.to_le_bytes());
        assert_eq!(&b[40..48], &4096u64.to_le_bytes());
        assert_eq!(&b[48..52], &5u32.to_le_bytes());
        assert_eq!(&b[52..56], &[0; 4]);
        assert_eq!(&b[56..64], &0x1122_3344_5566_7788u64.to_le_bytes());
        assert_eq!(&b[64..], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(TrustedDescriptor::from_bytes(&b), Ok(d));
    }

    #[test]
    fn descriptor_decode_refuses_garbage() {
        let b = sample().to_bytes();
        for cut in 0..b.len() {
            assert!(
                TrustedDescriptor::from_bytes(&b[..cut]).is_err(),
                "cut {cut}"
            );
        }
        let mut long = b.clone();
        long.push(0);
        assert!(TrustedDescriptor::from_bytes(&long).is_err());
        let edit = |at: usize, bytes: &[u8]| {
            let mut x = b.clone();
            x[at..at + bytes.len()].copy_from_slice(bytes);
            TrustedDescriptor::from_bytes(&x)
        };
        assert!(edit(0, b"SCXD").is_err(), "magic");
        assert!(edit(4, &[2]).is_err(), "version");
        assert!(edit(5, &[4]).is_err(), "permissions");
        assert!(edit(6, &4096u16.to_le_bytes()).is_err(), "shard");
        assert!(edit(24, &[0; 4]).is_err(), "zero id");
        assert!(edit(40, &[0; 8]).is_err(), "empty");
        assert!(edit(32, &u64::MAX.to_le_bytes()).is_err(), "wraps");
        assert!(edit(52, &[1, 0, 0, 0]).is_err(), "reserved");
        assert!(edit(28, &[0; 4]).is_err(), "no key");
        assert!(
            edit(28, &4u32.to_le_bytes()).is_err(),
            "key length mismatch"
        );
        assert!(edit(28, &u32::MAX.to_le_bytes()).is_err(), "huge key");
        assert!(edit(48, &u32::MAX.to_le_bytes()).is_err(), "huge address");
        assert!(edit(48, &[0; 4]).is_err(), "no address");
    }

    #[test]
    fn transports_and_host() {
        let t = |tcp, shared_memory, rdma| Transports {
            tcp,
            shared_memory,
            rdma,
        };
        let info = "# UCP context\n#\n#     resource 0  :  md 0  dev 0  flags -- posix/memory\n\
                    #     resource 1  :  md 2  dev 1  flags -- tcp/lo\n";
        assert_eq!(transports_of(info), t(true, true, false));
        let rc = "#  resource 0 : md 0 dev 0 flags -- rc_mlx5/mlx5_0:1";
        assert_eq!(transports_of(rc), t(false, false, true));
        let tcp = "#  resource 0 : md 0 dev 0 flags -- tcp/eth0";
        assert_eq!(transports_of(tcp), t(true, false, false));
        let cma = "#  resource 0 : md 0 dev 0 flags -- cma/memory";
        assert_eq!(transports_of(cma), t(false, true, false));
        assert_eq!(
            transports_of("# tcp/lo mentioned elsewhere"),
            t(false, false, false)
        );
        // Known on Linux.
        assert_ne!(host_id(), 0);
    }

    #[test]
    fn initiator_check_is_overflow_safe() {
        let d = sample();
        assert!(d.check(0, 4096, Access::Write).is_ok());
        assert!(d.check(4096, 0, Access::Read).is_ok());
        for (offset, len) in [(4090, 7), (4097, 0), (u64::MAX, 2), (1, u64::MAX)] {
            let e = d.check(offset, len, Access::Write).unwrap_err();
            assert_eq!(e.code(), RmaErrorCode::OutOfBounds, "{offset} {len}");
        }
        let ro = TrustedDescriptor {
            permissions: Permissions::READ,
            ..sample()
        };
        let e = ro.check(0, 1, Access::Write).unwrap_err();
        assert_eq!(e.code(), RmaErrorCode::NotPermitted);
        assert_eq!(d.remote(4096), 0x7f00_0000_1000 + 4096);
    }

    #[test]
    fn get_buffers_are_zeroed_or_refused() {
        assert_eq!(zeroed(3).unwrap(), [0; 3]);
        assert!(zeroed(0).unwrap().is_empty());
        // Past what a vector may hold, and past any address space: refused, not an abort.
        for len in [u64::MAX, 1 << 62] {
            assert!(
                matches!(zeroed(len), Err(RmaOpError::TooLarge { len: l, .. }) if l == len),
                "{len}"
            );
        }
    }
}
