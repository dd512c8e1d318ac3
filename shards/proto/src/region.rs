//! Checked remote memory: the region table and the RMA frame payloads.
//!
//! UCX over TCP and shared memory does not enforce remote keys, so by default shardcx does not
//! hand out rkeys at all. A put or a get travels as a message ([`FrameKind::RmaPut`],
//! [`FrameKind::RmaGet`]) to the shard that owns the region, which checks it against its
//! [`RegionTable`] and only then copies bytes; the answer is an [`FrameKind::RmaReply`]. This
//! module is that check and those payloads; it touches no memory. The table maps a region to an
//! opaque `u64` *handle* chosen by the runtime (a slot index, an arena offset…), and a successful
//! check returns the handle and the byte range to copy, as `usize`s that are guaranteed to lie
//! within the registered length.
//!
//! # The checks
//!
//! [`RegionTable::check`] refuses with an [`RmaError`], in this order:
//!
//! 1. [`RmaError::UnknownRegion`]: no region with that id (never registered, or deregistered).
//! 2. [`RmaError::NotGrantee`]: the region was registered for one node and the requester is
//!    another. A node that is not the grantee learns nothing more than that the id exists.
//! 3. [`RmaError::StaleGeneration`]: the generation in the request is not the region's current
//!    one; the descriptor it came from was revoked.
//! 4. [`RmaError::NotPermitted`]: a get on a region without [`Permissions::READ`] or a put on one
//!    without [`Permissions::WRITE`].
//! 5. [`RmaError::OutOfBounds`]: `offset + len` overflows `u64` or exceeds the region's length.
//!    The arithmetic is checked, never wrapping; a zero-length access is in bounds when
//!    `offset <= region_len`.
//!
//! # Generations and revocation
//!
//! A [`RegionDescriptor`] names a region by id *and* generation. The table draws generations from
//! one counter that only grows: a new region and every revocation take the next value. So an
//! `(id, generation)` pair is never valid twice in a table's life, even when a region id is
//! reused after [`RegionTable::deregister`]: revoking ([`RegionTable::revoke`]) or deregistering a
//! region makes every descriptor handed out for it fail for good.
//!
//! A node that restarts builds a new table; descriptors from its previous life must not match the
//! new one. Start the counter at the node's [`crate::Incarnation`] with
//! [`RegionTable::starting_at`]: incarnations are start times in nanoseconds, and a node cannot
//! issue more generations than nanoseconds pass, so the new life's generations are all larger.
//! If the counter ever reached `u64::MAX`, registration would be refused and revocation would
//! fail closed, shutting the region to all access (see [`RegionTable::revoke`]).
//!
//! # Calling order
//!
//! On the owner shard (the target):
//!
//! 1. [`RegionTable::register`] a region's length, permissions, grantee and handle; send the
//!    returned [`RegionDescriptor`] (with the owner's node and shard) to whoever may use it.
//! 2. For each received [`FrameKind::RmaPut`] / [`FrameKind::RmaGet`] frame, decode the payload
//!    with [`PutRequest::decode`] / [`GetRequest::decode`] (the region id is the frame header's
//!    `id`), then call [`RegionTable::check_put`] / [`RegionTable::check_get`] (or
//!    [`RegionTable::check`]) with the peer's [`NodeId`] as authenticated by the handshake.
//! 3. On success copy between the handle's memory at [`CheckedRange::range`] and the request;
//!    answer with [`RmaReply`] (for a get, the data follows the 8-byte reply header: write
//!    [`RmaReply::header`] and copy the bytes behind it). On failure answer with the error's
//!    [`RmaError::code`]; a payload that did not decode is answered with
//!    [`RmaWireError::code`].
//! 4. [`RegionTable::revoke`] to invalidate the descriptors handed out (and hand out the new
//!    one), [`RegionTable::deregister`] before freeing the memory behind the handle. The runtime
//!    must not free memory that a copy in progress still uses; the table does not track copies.
//!
//! On the initiator, [`RegionDescriptor::check`] rejects out-of-bounds and unpermitted accesses
//! before anything is sent (the same bounds rule as the owner's).
//!
//! # Payload layouts (little-endian)
//!
//! ```text
//! RmaPut   (16 + n B): 0 generation u64 | 8 offset u64 | 16 data [n]
//! RmaGet   (24 B):     0 generation u64 | 8 offset u64 | 16 len u64
//! RmaReply (8 + n B):  0 status u8 (0 = ok, else an RmaErrorCode) | 1 reserved [7] = 0
//!                      8 data [n]: the bytes read for a successful get; empty otherwise
//! ```
//!
//! The frame header carries the region id in `id` and the request in `req_id`; the reply echoes
//! the `req_id`. Every payload, and for a get the reply it asks for, must fit
//! [`Limits::max_message_size`]: decoders check that before anyone sizes a buffer from a length
//! in the payload. Decoders accept any byte string and return a value or an [`RmaWireError`];
//! they never panic and never allocate.
//!
//! [`FrameKind::RmaPut`]: crate::FrameKind::RmaPut
//! [`FrameKind::RmaGet`]: crate::FrameKind::RmaGet
//! [`FrameKind::RmaReply`]: crate::FrameKind::RmaReply

use crate::ids::{Generation, NodeId, RegionId};
use crate::wire::{read_u64, Limits};
use std::collections::BTreeMap;
use std::fmt;
use std::num::NonZeroU8;
use std::ops::Range;
use thiserror::Error;

/// What a region allows remote nodes to do (a `u8` bit set).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Permissions(u8);

/// One remote access: what a request wants to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Access {
    /// A get: needs [`Permissions::READ`].
    Read,
    /// A put: needs [`Permissions::WRITE`].
    Write,
}

/// What the owner hands out so that other nodes can name a region: everything about it that does
/// not depend on where it lives. The owner's node and shard travel beside it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RegionDescriptor {
    /// The region's id in its owner shard's table.
    pub id: RegionId,
    /// The generation this descriptor is valid for.
    pub generation: Generation,
    /// Length of the region in bytes.
    pub len: u64,
    /// What remote nodes may do.
    pub permissions: Permissions,
}

/// What [`RegionTable::register`] needs to know about a region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RegionSpec {
    /// Length in bytes; must fit a `usize`.
    pub len: u64,
    /// What remote nodes may do.
    pub permissions: Permissions,
    /// The only node that may access the region, or `None` for any authenticated node.
    pub grantee: Option<NodeId>,
    /// The caller's handle for the memory (opaque to the table), returned by every successful
    /// check and by [`RegionTable::deregister`].
    pub handle: u64,
}

/// A registered region as the table holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RegionEntry {
    /// The current descriptor (current generation and permissions).
    pub descriptor: RegionDescriptor,
    /// The only node allowed, or `None` for any authenticated node.
    pub grantee: Option<NodeId>,
    /// The caller's handle.
    pub handle: u64,
}

/// An access that passed every check: copy `len` bytes at `start` of the memory behind `handle`.
/// `start + len` never exceeds the region's length (and does not overflow).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CheckedRange {
    /// The region's handle, as registered.
    pub handle: u64,
    /// Offset of the first byte within the region.
    pub start: usize,
    /// Number of bytes.
    pub len: usize,
}

/// The per-shard table of regions that remote nodes may put to and get from. See the module docs
/// for the checks and the calling order.
#[derive(Clone, Debug)]
pub struct RegionTable {
    // A `BTreeMap` rather than a `HashMap`: deterministic, and no OS randomness for a hasher.
    regions: BTreeMap<RegionId, RegionEntry>,
    /// The next region id to try (ids are handed out in increasing order, skipping zero).
    next_id: u32,
    /// The next generation to hand out; `u64::MAX` means none are left.
    next_generation: u64,
}

/// Why a region could not be accessed. Each variant has a stable wire code ([`RmaError::code`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Error)]
#[non_exhaustive]
pub enum RmaError {
    /// No such region (never registered, or deregistered).
    #[error("unknown region {region}")]
    UnknownRegion {
        /// The region id requested.
        region: RegionId,
    },
    /// The region is reserved for another node.
    #[error("region {region} is not granted to node {requester}")]
    NotGrantee {
        /// The region.
        region: RegionId,
        /// The node that asked.
        requester: NodeId,
    },
    /// The generation does not match: the descriptor was revoked.
    #[error("region {region}: generation {generation} is stale")]
    StaleGeneration {
        /// The region.
        region: RegionId,
        /// The generation presented.
        generation: Generation,
    },
    /// The region does not allow this access.
    #[error("region {region} does not permit {access}")]
    NotPermitted {
        /// The region.
        region: RegionId,
        /// The access asked for.
        access: Access,
    },
    /// `offset + len` overflows or exceeds the region's length.
    #[error("region {region}: {len} bytes at offset {offset} exceed its {region_len} bytes")]
    OutOfBounds {
        /// The region.
        region: RegionId,
        /// Requested offset.
        offset: u64,
        /// Requested length.
        len: u64,
        /// The region's length.
        region_len: u64,
    },
}

/// The status of an RMA reply on the wire: why the owner refused. Codes are stable; zero means
/// success and is not a code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Error)]
#[non_exhaustive]
pub enum RmaErrorCode {
    /// 1: [`RmaError::UnknownRegion`].
    #[error("unknown region")]
    UnknownRegion,
    /// 2: [`RmaError::NotGrantee`].
    #[error("region not granted to this node")]
    NotGrantee,
    /// 3: [`RmaError::StaleGeneration`].
    #[error("stale region generation")]
    StaleGeneration,
    /// 4: [`RmaError::NotPermitted`].
    #[error("access not permitted")]
    NotPermitted,
    /// 5: [`RmaError::OutOfBounds`].
    #[error("access out of bounds")]
    OutOfBounds,
    /// 6: the request payload did not decode.
    #[error("malformed request")]
    Malformed,
    /// 7: the request, or the reply it asks for, exceeds the owner's maximum message size.
    #[error("request too large")]
    TooLarge,
    /// A code this build does not know (kept as received).
    #[error("remote memory error code {0}")]
    Other(NonZeroU8),
}

/// Errors from encoding or decoding RMA payloads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Error)]
#[non_exhaustive]
pub enum RmaWireError {
    /// The payload is shorter than its fixed part.
    #[error("truncated {what}: need {needed} bytes, got {got}")]
    Truncated {
        /// What was being decoded.
        what: &'static str,
        /// Bytes required.
        needed: usize,
        /// Bytes available.
        got: usize,
    },
    /// A fixed-size payload, or a failure reply, has bytes after its end.
    #[error("{what} has {extra} trailing bytes")]
    TrailingBytes {
        /// What was being decoded.
        what: &'static str,
        /// Bytes after the end.
        extra: usize,
    },
    /// A reserved byte is not zero.
    #[error("{what}: reserved byte at offset {offset} is not zero")]
    ReservedNonZero {
        /// What was being decoded.
        what: &'static str,
        /// Offset of the byte.
        offset: usize,
    },
    /// The payload, or the reply a get asks for, exceeds the maximum message size.
    #[error("{what} of {len} bytes exceeds the maximum of {max}")]
    TooLarge {
        /// What is too large.
        what: &'static str,
        /// Its length (saturated at `u64::MAX`).
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The output buffer is too small.
    #[error("buffer too small for {what}: need {needed} bytes, got {got}")]
    BufferTooSmall {
        /// What was being encoded.
        what: &'static str,
        /// Bytes required.
        needed: usize,
        /// Bytes available.
        got: usize,
    },
}

/// Registration and revocation failures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Error)]
#[non_exhaustive]
pub enum RegionError {
    /// No such region.
    #[error("unknown region {region}")]
    UnknownRegion {
        /// The region id given.
        region: RegionId,
    },
    /// The length does not fit a `usize` on this machine.
    #[error("region of {len} bytes does not fit the address space")]
    TooLarge {
        /// The length given.
        len: u64,
    },
    /// Every region id is in use.
    #[error("region table full")]
    TableFull,
    /// The generation counter reached `u64::MAX`. From [`RegionTable::revoke`], the region has
    /// been shut to all access instead (its permissions are now empty); deregister it.
    #[error("region generations exhausted")]
    GenerationsExhausted,
}

/// A put request: write `data` at `offset` of the region named by the frame header's `id`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PutRequest<'a> {
    /// The generation of the descriptor used.
    pub generation: Generation,
    /// Where in the region to write.
    pub offset: u64,
    /// The bytes to write.
    pub data: &'a [u8],
}

/// A get request: read `len` bytes at `offset` of the region named by the frame header's `id`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GetRequest {
    /// The generation of the descriptor used.
    pub generation: Generation,
    /// Where in the region to read.
    pub offset: u64,
    /// How many bytes to read.
    pub len: u64,
}

/// The answer to a put or a get.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RmaReply<'a> {
    /// Success, or why the owner refused.
    pub status: Result<(), RmaErrorCode>,
    /// For a successful get, the bytes read; empty otherwise.
    pub data: &'a [u8],
}

impl Permissions {
    /// Nothing allowed.
    pub const NONE: Permissions = Permissions(0);
    /// Remote gets allowed.
    pub const READ: Permissions = Permissions(1 << 0);
    /// Remote puts allowed.
    pub const WRITE: Permissions = Permissions(1 << 1);
    /// Gets and puts allowed.
    pub const READ_WRITE: Permissions = Permissions(0b11);

    /// Permissions from raw bits, or `None` if an undefined bit is set.
    pub const fn from_bits(bits: u8) -> Option<Permissions> {
        if bits & !Self::READ_WRITE.0 == 0 {
            Some(Permissions(bits))
        } else {
            None
        }
    }

    /// The raw bits.
    pub const fn bits(self) -> u8 {
        self.0
    }

    /// Whether every bit of `other` is set.
    pub const fn contains(self, other: Permissions) -> bool {
        self.0 & other.0 == other.0
    }

    /// Whether no bit is set.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The union.
    pub const fn union(self, other: Permissions) -> Permissions {
        Permissions(self.0 | other.0)
    }

    /// Whether `access` is allowed.
    pub const fn allows(self, access: Access) -> bool {
        self.contains(access.required())
    }
}

impl Access {
    /// The permission this access needs.
    pub const fn required(self) -> Permissions {
        match self {
            Access::Read => Permissions::READ,
            Access::Write => Permissions::WRITE,
        }
    }
}

impl RegionDescriptor {
    /// The initiator-side check: whether `len` bytes at `offset` are within the region and
    /// `access` is permitted. Same bounds rule as [`RegionTable::check`]; the owner checks again
    /// (and also the generation and grantee), so this only saves a round trip.
    pub fn check(&self, offset: u64, len: u64, access: Access) -> Result<(), RmaError> {
        if !self.permissions.allows(access) {
            return Err(RmaError::NotPermitted {
                region: self.id,
                access,
            });
        }
        in_bounds(self.id, self.len, offset, len).map(|_| ())
    }
}

impl CheckedRange {
    /// The byte range within the region.
    pub fn range(&self) -> Range<usize> {
        // `start + len <= region len`, which fits a `usize` (checked at registration).
        self.start..self.start.saturating_add(self.len)
    }
}

impl RegionTable {
    /// An empty table whose first generation is 1. Prefer [`RegionTable::starting_at`] with the
    /// node's incarnation (see the module docs).
    pub fn new() -> RegionTable {
        RegionTable::starting_at(Generation::new(1))
    }

    /// An empty table whose first generation is `first`.
    pub fn starting_at(first: Generation) -> RegionTable {
        RegionTable {
            regions: BTreeMap::new(),
            next_id: 1,
            next_generation: first.get(),
        }
    }

    /// Number of registered regions.
    pub fn len(&self) -> usize {
        self.regions.len()
    }

    /// Whether no region is registered.
    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }

    /// Registers a region and returns its descriptor: a fresh id (never zero) and a generation
    /// never used before in this table.
    pub fn register(&mut self, spec: RegionSpec) -> Result<RegionDescriptor, RegionError> {
        if usize::try_from(spec.len).is_err() {
            return Err(RegionError::TooLarge { len: spec.len });
        }
        let id = self.free_id().ok_or(RegionError::TableFull)?;
        let generation = self.take_generation()?;
        let descriptor = RegionDescriptor {
            id,
            generation,
            len: spec.len,
            permissions: spec.permissions,
        };
        self.regions.insert(
            id,
            RegionEntry {
                descriptor,
                grantee: spec.grantee,
                handle: spec.handle,
            },
        );
        self.next_id = id.get().wrapping_add(1);
        Ok(descriptor)
    }

    /// Revokes every descriptor handed out for `region` by moving it to a new generation; the
    /// region stays registered and the new descriptor is returned, to be handed out again.
    ///
    /// Fails closed: if no generation is left ([`RegionError::GenerationsExhausted`]), the
    /// region's permissions are cleared so that every access is refused, and it stays registered
    /// until [`RegionTable::deregister`].
    pub fn revoke(&mut self, region: RegionId) -> Result<RegionDescriptor, RegionError> {
        if !self.regions.contains_key(&region) {
            return Err(RegionError::UnknownRegion { region });
        }
        let taken = self.take_generation();
        let entry = self
            .regions
            .get_mut(&region)
            .ok_or(RegionError::UnknownRegion { region })?;
        match taken {
            Ok(generation) => {
                entry.descriptor.generation = generation;
                Ok(entry.descriptor)
            }
            Err(e) => {
                entry.descriptor.permissions = Permissions::NONE;
                Err(e)
            }
        }
    }

    /// Removes `region` and returns its handle; every descriptor for it then fails with
    /// [`RmaError::UnknownRegion`] (and, should the id be reused, with
    /// [`RmaError::StaleGeneration`]).
    pub fn deregister(&mut self, region: RegionId) -> Result<u64, RegionError> {
        self.regions
            .remove(&region)
            .map(|e| e.handle)
            .ok_or(RegionError::UnknownRegion { region })
    }

    /// The region's entry, if registered.
    pub fn get(&self, region: RegionId) -> Option<&RegionEntry> {
        self.regions.get(&region)
    }

    /// Every registered region, in id order (for example to deregister all at shutdown).
    pub fn iter(&self) -> impl Iterator<Item = &RegionEntry> + '_ {
        self.regions.values()
    }

    /// Checks a remote access; see the module docs for the checks and their order. `requester`
    /// must be the node authenticated by the handshake, never a value taken from the payload.
    pub fn check(
        &self,
        requester: NodeId,
        region: RegionId,
        generation: Generation,
        offset: u64,
        len: u64,
        access: Access,
    ) -> Result<CheckedRange, RmaError> {
        let entry = self
            .regions
            .get(&region)
            .ok_or(RmaError::UnknownRegion { region })?;
        if entry.grantee.is_some_and(|g| g != requester) {
            return Err(RmaError::NotGrantee { region, requester });
        }
        let d = &entry.descriptor;
        if d.generation != generation {
            return Err(RmaError::StaleGeneration { region, generation });
        }
        if !d.permissions.allows(access) {
            return Err(RmaError::NotPermitted { region, access });
        }
        let (start, len) = in_bounds(region, d.len, offset, len)?;
        Ok(CheckedRange {
            handle: entry.handle,
            start,
            len,
        })
    }

    /// [`RegionTable::check`] for a decoded put request to `region` (the frame header's `id`).
    pub fn check_put(
        &self,
        requester: NodeId,
        region: RegionId,
        put: &PutRequest<'_>,
    ) -> Result<CheckedRange, RmaError> {
        // A slice length always fits a u64 on the platforms Rust supports (usize <= 64 bits).
        let len = u64::try_from(put.data.len()).unwrap_or(u64::MAX);
        self.check(
            requester,
            region,
            put.generation,
            put.offset,
            len,
            Access::Write,
        )
    }

    /// [`RegionTable::check`] for a decoded get request to `region` (the frame header's `id`).
    pub fn check_get(
        &self,
        requester: NodeId,
        region: RegionId,
        get: &GetRequest,
    ) -> Result<CheckedRange, RmaError> {
        self.check(
            requester,
            region,
            get.generation,
            get.offset,
            get.len,
            Access::Read,
        )
    }

    /// The lowest free id at or after `next_id`, wrapping and skipping zero.
    fn free_id(&self) -> Option<RegionId> {
        if self.regions.len() >= u32::MAX as usize {
            return None; // ids 1..=u32::MAX are all taken.
        }
        let mut id = self.next_id;
        loop {
            if id != 0 && !self.regions.contains_key(&RegionId::new(id)) {
                return Some(RegionId::new(id));
            }
            id = id.wrapping_add(1);
        }
    }

    fn take_generation(&mut self) -> Result<Generation, RegionError> {
        let g = self.next_generation;
        self.next_generation = g.checked_add(1).ok_or(RegionError::GenerationsExhausted)?;
        Ok(Generation::new(g))
    }
}

impl RmaError {
    /// The status code that reports this refusal on the wire.
    pub const fn code(&self) -> RmaErrorCode {
        match self {
            RmaError::UnknownRegion { .. } => RmaErrorCode::UnknownRegion,
            RmaError::NotGrantee { .. } => RmaErrorCode::NotGrantee,
            RmaError::StaleGeneration { .. } => RmaErrorCode::StaleGeneration,
            RmaError::NotPermitted { .. } => RmaErrorCode::NotPermitted,
            RmaError::OutOfBounds { .. } => RmaErrorCode::OutOfBounds,
        }
    }
}

impl RmaErrorCode {
    /// The wire code (never zero).
    pub const fn to_u8(self) -> u8 {
        match self {
            RmaErrorCode::UnknownRegion => 1,
            RmaErrorCode::NotGrantee => 2,
            RmaErrorCode::StaleGeneration => 3,
            RmaErrorCode::NotPermitted => 4,
            RmaErrorCode::OutOfBounds => 5,
            RmaErrorCode::Malformed => 6,
            RmaErrorCode::TooLarge => 7,
            RmaErrorCode::Other(code) => code.get(),
        }
    }

    /// From a wire code: `None` for zero (success); unknown codes become
    /// [`RmaErrorCode::Other`].
    pub const fn from_u8(code: u8) -> Option<RmaErrorCode> {
        Some(match code {
            1 => RmaErrorCode::UnknownRegion,
            2 => RmaErrorCode::NotGrantee,
            3 => RmaErrorCode::StaleGeneration,
            4 => RmaErrorCode::NotPermitted,
            5 => RmaErrorCode::OutOfBounds,
            6 => RmaErrorCode::Malformed,
            7 => RmaErrorCode::TooLarge,
            other => match NonZeroU8::new(other) {
                Some(nz) => RmaErrorCode::Other(nz),
                None => return None,
            },
        })
    }
}

impl RmaWireError {
    /// The status code an owner answers a request that failed to decode with.
    pub const fn code(&self) -> RmaErrorCode {
        match self {
            RmaWireError::TooLarge { .. } => RmaErrorCode::TooLarge,
            _ => RmaErrorCode::Malformed,
        }
    }
}

impl<'a> PutRequest<'a> {
    /// Length of the fixed part before the data.
    pub const HEADER_LEN: usize = 16;

    /// Length of the encoded payload.
    pub fn encoded_len(&self) -> usize {
        Self::HEADER_LEN.saturating_add(self.data.len())
    }

    /// Writes the payload into the start of `buf`; returns its length. Fails when it exceeds
    /// `limits` or `buf`.
    pub fn encode(&self, buf: &mut [u8], limits: &Limits) -> Result<usize, RmaWireError> {
        let n = fit("put request", self.encoded_len(), limits)?;
        let out = out_buf("put request", buf, n)?;
        out[0..8].copy_from_slice(&self.generation.get().to_le_bytes());
        out[8..16].copy_from_slice(&self.offset.to_le_bytes());
        out[16..].copy_from_slice(self.data);
        Ok(n)
    }

    /// Appends the payload to `out`. Fails (appending nothing) when it exceeds `limits`.
    pub fn encode_to_vec(&self, out: &mut Vec<u8>, limits: &Limits) -> Result<(), RmaWireError> {
        fit("put request", self.encoded_len(), limits)?;
        out.extend_from_slice(&self.generation.get().to_le_bytes());
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(self.data);
        Ok(())
    }

    /// Decodes a put payload; `data` borrows from `payload`. Checks the length against `limits`.
    pub fn decode(payload: &'a [u8], limits: &Limits) -> Result<PutRequest<'a>, RmaWireError> {
        fit("put request", payload.len(), limits)?;
        let fixed = fixed("put request", payload, Self::HEADER_LEN)?;
        Ok(PutRequest {
            generation: Generation::new(read_u64(fixed, 0)),
            offset: read_u64(fixed, 8),
            data: payload.get(Self::HEADER_LEN..).unwrap_or(&[]),
        })
    }
}

impl GetRequest {
    /// Length of the encoded payload.
    pub const LEN: usize = 24;

    /// Length of the reply this request asks for (reply header plus `len`), saturating.
    pub fn reply_len(&self) -> u64 {
        self.len.saturating_add(RmaReply::HEADER_LEN as u64)
    }

    /// The encoded payload, after checking that the reply it asks for fits `limits`.
    pub fn to_bytes(&self, limits: &Limits) -> Result<[u8; GetRequest::LEN], RmaWireError> {
        self.check_reply_fits(limits)?;
        let mut out = [0u8; GetRequest::LEN];
        out[0..8].copy_from_slice(&self.generation.get().to_le_bytes());
        out[8..16].copy_from_slice(&self.offset.to_le_bytes());
        out[16..24].copy_from_slice(&self.len.to_le_bytes());
        Ok(out)
    }

    /// Writes the payload into the start of `buf`; returns [`GetRequest::LEN`].
    pub fn encode(&self, buf: &mut [u8], limits: &Limits) -> Result<usize, RmaWireError> {
        let bytes = self.to_bytes(limits)?;
        out_buf("get request", buf, Self::LEN)?.copy_from_slice(&bytes);
        Ok(Self::LEN)
    }

    /// Decodes a get payload (exactly [`GetRequest::LEN`] bytes) and checks that the reply it
    /// asks for fits `limits`, so the owner may size the reply buffer from `len`.
    pub fn decode(payload: &[u8], limits: &Limits) -> Result<GetRequest, RmaWireError> {
        let fixed = fixed("get request", payload, Self::LEN)?;
        if payload.len() > Self::LEN {
            return Err(RmaWireError::TrailingBytes {
                what: "get request",
                extra: payload.len() - Self::LEN,
            });
        }
        let req = GetRequest {
            generation: Generation::new(read_u64(fixed, 0)),
            offset: read_u64(fixed, 8),
            len: read_u64(fixed, 16),
        };
        req.check_reply_fits(limits)?;
        Ok(req)
    }

    fn check_reply_fits(&self, limits: &Limits) -> Result<(), RmaWireError> {
        let len = self.reply_len();
        if len > limits.max_message_size {
            return Err(RmaWireError::TooLarge {
                what: "get reply",
                len,
                max: limits.max_message_size,
            });
        }
        Ok(())
    }
}

impl<'a> RmaReply<'a> {
    /// Length of the fixed part before the data.
    pub const HEADER_LEN: usize = 8;

    /// A success reply carrying `data` (empty for a put).
    pub fn ok(data: &'a [u8]) -> RmaReply<'a> {
        RmaReply {
            status: Ok(()),
            data,
        }
    }

    /// A failure reply.
    pub fn err(code: RmaErrorCode) -> RmaReply<'static> {
        RmaReply {
            status: Err(code),
            data: &[],
        }
    }

    /// The 8-byte reply header for `status`. A get reply can be built in place: write this
    /// header, then copy the region's bytes right behind it.
    pub fn header(status: Result<(), RmaErrorCode>) -> [u8; RmaReply::HEADER_LEN] {
        let mut out = [0u8; RmaReply::HEADER_LEN];
        out[0] = match status {
            Ok(()) => 0,
            Err(code) => code.to_u8(),
        };
        out
    }

    /// Length of the encoded payload.
    pub fn encoded_len(&self) -> usize {
        Self::HEADER_LEN.saturating_add(self.data.len())
    }

    /// Writes the payload into the start of `buf`; returns its length. Fails when it exceeds
    /// `limits` or `buf`, or when a failure reply carries data.
    pub fn encode(&self, buf: &mut [u8], limits: &Limits) -> Result<usize, RmaWireError> {
        self.check_encodable()?;
        let n = fit("reply", self.encoded_len(), limits)?;
        let out = out_buf("reply", buf, n)?;
        out[..Self::HEADER_LEN].copy_from_slice(&Self::header(self.status));
        out[Self::HEADER_LEN..].copy_from_slice(self.data);
        Ok(n)
    }

    /// Appends the payload to `out`. Fails (appending nothing) as [`RmaReply::encode`] does.
    pub fn encode_to_vec(&self, out: &mut Vec<u8>, limits: &Limits) -> Result<(), RmaWireError> {
        self.check_encodable()?;
        fit("reply", self.encoded_len(), limits)?;
        out.extend_from_slice(&Self::header(self.status));
        out.extend_from_slice(self.data);
        Ok(())
    }

    /// Decodes a reply payload; `data` borrows from `payload`. A failure reply must carry no
    /// data. The caller checks `data.len()` against what it asked for (the length of a get,
    /// zero for a put).
    pub fn decode(payload: &'a [u8], limits: &Limits) -> Result<RmaReply<'a>, RmaWireError> {
        fit("reply", payload.len(), limits)?;
        let fixed = fixed("reply", payload, Self::HEADER_LEN)?;
        if let Some(offset) = (1..Self::HEADER_LEN).find(|&i| fixed[i] != 0) {
            return Err(RmaWireError::ReservedNonZero {
                what: "reply",
                offset,
            });
        }
        let data = payload.get(Self::HEADER_LEN..).unwrap_or(&[]);
        let status = match RmaErrorCode::from_u8(fixed[0]) {
            None => Ok(()),
            Some(code) if data.is_empty() => Err(code),
            Some(_) => {
                return Err(RmaWireError::TrailingBytes {
                    what: "failure reply",
                    extra: data.len(),
                })
            }
        };
        Ok(RmaReply { status, data })
    }

    fn check_encodable(&self) -> Result<(), RmaWireError> {
        if self.status.is_err() && !self.data.is_empty() {
            return Err(RmaWireError::TrailingBytes {
                what: "failure reply",
                extra: self.data.len(),
            });
        }
        Ok(())
    }
}

impl Default for RegionTable {
    fn default() -> RegionTable {
        RegionTable::new()
    }
}

impl std::ops::BitOr for Permissions {
    type Output = Permissions;
    fn bitor(self, rhs: Permissions) -> Permissions {
        self.union(rhs)
    }
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Access::Read => "read",
            Access::Write => "write",
        })
    }
}

/// The bounds rule: `offset + len` must not overflow and must be at most `region_len`, which the
/// table guarantees fits a `usize`. Returns `(start, len)` as `usize`s.
fn in_bounds(
    region: RegionId,
    region_len: u64,
    offset: u64,
    len: u64,
) -> Result<(usize, usize), RmaError> {
    let out = RmaError::OutOfBounds {
        region,
        offset,
        len,
        region_len,
    };
    match offset.checked_add(len) {
        Some(end) if end <= region_len => {
            // Both are at most `region_len`; a descriptor built by hand may claim a length that
            // does not fit a `usize`, so convert checked rather than cast.
            let start = usize::try_from(offset).map_err(|_| out)?;
            let len = usize::try_from(len).map_err(|_| out)?;
            Ok((start, len))
        }
        _ => Err(out),
    }
}

/// Checks an encoded length against the message size limit.
fn fit(what: &'static str, len: usize, limits: &Limits) -> Result<usize, RmaWireError> {
    let len64 = u64::try_from(len).unwrap_or(u64::MAX);
    if len64 > limits.max_message_size {
        return Err(RmaWireError::TooLarge {
            what,
            len: len64,
            max: limits.max_message_size,
        });
    }
    Ok(len)
}

fn out_buf<'b>(
    what: &'static str,
    buf: &'b mut [u8],
    n: usize,
) -> Result<&'b mut [u8], RmaWireError> {
    let got = buf.len();
    buf.get_mut(..n).ok_or(RmaWireError::BufferTooSmall {
        what,
        needed: n,
        got,
    })
}

fn fixed<'b>(what: &'static str, payload: &'b [u8], n: usize) -> Result<&'b [u8], RmaWireError> {
    payload.get(..n).ok_or(RmaWireError::Truncated {
        what,
        needed: n,
        got: payload.len(),
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;

    const A: NodeId = NodeId::new(10);
    const B: NodeId = NodeId::new(20);

    fn spec(len: u64, permissions: Permissions, grantee: Option<NodeId>) -> RegionSpec {
        RegionSpec {
            len,
            permissions,
            grantee,
            handle: 77,
        }
    }

    fn table_with(
        len: u64,
        p: Permissions,
        grantee: Option<NodeId>,
    ) -> (RegionTable, RegionDescriptor) {
        let mut t = RegionTable::new();
        let d = t.register(spec(len, p, grantee)).unwrap();
        (t, d)
    }

    fn get(
        t: &RegionTable,
        d: &RegionDescriptor,
        offset: u64,
        len: u64,
    ) -> Result<CheckedRange, RmaError> {
        t.check(A, d.id, d.generation, offset, len, Access::Read)
    }

    #[test]
    fn accepts_in_bounds() {
        let (t, d) = table_with(100, Permissions::READ_WRITE, None);
        assert_eq!(d.len, 100);
        assert_ne!(d.id.get(), 0);
        let r = get(&t, &d, 10, 90).unwrap();
        assert_eq!(
            r,
            CheckedRange {
                handle: 77,
                start: 10,
                len: 90
            }
        );
        assert_eq!(r.range(), 10..100);
        assert_eq!(get(&t, &d, 0, 100).unwrap().range(), 0..100);
        // Empty accesses are in bounds up to and including the end.
        assert_eq!(get(&t, &d, 100, 0).unwrap().range(), 100..100);
        assert_eq!(
            t.check(B, d.id, d.generation, 0, 1, Access::Write)
                .unwrap()
                .len,
            1
        );
    }

    #[test]
    fn refuses_out_of_bounds() {
        let (t, d) = table_with(100, Permissions::READ_WRITE, None);
        for (offset, len) in [
            (0, 101),
            (1, 100),
            (100, 1),
            (101, 0),
            (u64::MAX, 0),
            (u64::MAX, 1),
            (1, u64::MAX),
            (u64::MAX, u64::MAX),
            (u64::MAX - 5, 10),  // wraps to 4: must not be taken for in bounds
            (50, u64::MAX - 49), // wraps to 0
        ] {
            assert_eq!(
                get(&t, &d, offset, len),
                Err(RmaError::OutOfBounds {
                    region: d.id,
                    offset,
                    len,
                    region_len: 100
                }),
                "{offset} + {len}"
            );
            assert_eq!(
                get(&t, &d, offset, len).unwrap_err().code(),
                RmaErrorCode::OutOfBounds
            );
            assert!(d.check(offset, len, Access::Read).is_err());
        }
        let (t0, d0) = table_with(0, Permissions::READ, None);
        assert_eq!(get(&t0, &d0, 0, 0).unwrap().range(), 0..0);
        assert!(get(&t0, &d0, 0, 1).is_err());
        assert!(get(&t0, &d0, 1, 0).is_err());
    }

    #[test]
    fn refuses_unpermitted() {
        let (t, d) = table_with(100, Permissions::READ, None);
        assert!(get(&t, &d, 0, 1).is_ok());
        assert_eq!(
            t.check(A, d.id, d.generation, 0, 1, Access::Write),
            Err(RmaError::NotPermitted {
                region: d.id,
                access: Access::Write
            })
        );
        let (t, d) = table_with(100, Permissions::WRITE, None);
        assert!(t.check(A, d.id, d.generation, 0, 1, Access::Write).is_ok());
        let e = get(&t, &d, 0, 1).unwrap_err();
        assert_eq!(
            e,
            RmaError::NotPermitted {
                region: d.id,
                access: Access::Read
            }
        );
        assert_eq!(e.code().to_u8(), 4);
        assert_eq!(
            e.to_string(),
            format!("region {} does not permit read", d.id)
        );
        let (t, d) = table_with(100, Permissions::NONE, None);
        assert!(get(&t, &d, 0, 0).is_err());
        assert_eq!(
            d.check(0, 1, Access::Read).unwrap_err().code(),
            RmaErrorCode::NotPermitted
        );
        // Permission is checked before bounds.
        assert!(matches!(
            get(&t, &d, u64::MAX, 1),
            Err(RmaError::NotPermitted { .. })
        ));
    }

    #[test]
    fn refuses_revoked_and_stale() {
        let (mut t, d) = table_with(100, Permissions::READ_WRITE, None);
        let d2 = t.revoke(d.id).unwrap();
        assert_eq!(d2.id, d.id);
        assert!(d2.generation > d.generation);
        assert_eq!(
            get(&t, &d, 0, 1),
            Err(RmaError::StaleGeneration {
                region: d.id,
                generation: d.generation
            })
        );
        assert!(get(&t, &d2, 0, 1).is_ok());
        // A generation from the future is as stale as one from the past.
        assert!(t
            .check(A, d.id, d2.generation.next(), 0, 1, Access::Read)
            .is_err());
        assert_eq!(
            t.revoke(RegionId::new(999)),
            Err(RegionError::UnknownRegion {
                region: RegionId::new(999)
            })
        );
    }

    #[test]
    fn refuses_wrong_grantee() {
        let (t, d) = table_with(100, Permissions::READ_WRITE, Some(A));
        assert!(get(&t, &d, 0, 1).is_ok());
        let e = t.check(B, d.id, d.generation, 0, 1, Access::Read);
        assert_eq!(
            e,
            Err(RmaError::NotGrantee {
                region: d.id,
                requester: B
            })
        );
        // A non-grantee learns nothing about generation, permissions or length.
        assert!(matches!(
            t.check(B, d.id, Generation::new(0), u64::MAX, 1, Access::Write),
            Err(RmaError::NotGrantee { .. })
        ));
    }

    #[test]
    fn refuses_unknown_and_deregistered() {
        let (mut t, d) = table_with(100, Permissions::READ_WRITE, None);
        let unknown = RegionId::new(d.id.get() + 1);
        assert_eq!(
            t.check(A, unknown, d.generation, 0, 0, Access::Read),
            Err(RmaError::UnknownRegion { region: unknown })
        );
        assert_eq!(t.deregister(d.id), Ok(77));
        assert!(t.is_empty());
        assert_eq!(
            get(&t, &d, 0, 1),
            Err(RmaError::UnknownRegion { region: d.id })
        );
        assert_eq!(
            t.deregister(d.id),
            Err(RegionError::UnknownRegion { region: d.id })
        );
    }

    #[test]
    fn reused_ids_get_fresh_generations() {
        let mut t = RegionTable::new();
        let first = t.register(spec(8, Permissions::READ, None)).unwrap();
        // Force the next id to be the one just freed.
        t.deregister(first.id).unwrap();
        t.next_id = first.id.get();
        let again = t.register(spec(8, Permissions::READ, None)).unwrap();
        assert_eq!(again.id, first.id);
        assert_ne!(again.generation, first.generation);
        assert!(matches!(
            get(&t, &first, 0, 1),
            Err(RmaError::StaleGeneration { .. })
        ));
    }

    #[test]
    fn ids_skip_zero_and_taken() {
        let mut t = RegionTable::new();
        t.next_id = u32::MAX;
        let a = t.register(spec(1, Permissions::READ, None)).unwrap();
        let b = t.register(spec(1, Permissions::READ, None)).unwrap();
        assert_eq!((a.id.get(), b.id.get()), (u32::MAX, 1));
        t.next_id = u32::MAX;
        let c = t.register(spec(1, Permissions::READ, None)).unwrap();
        assert_eq!(c.id.get(), 2);
        assert_eq!(t.len(), 3);
        assert_eq!(
            t.iter().map(|e| e.descriptor.id.get()).collect::<Vec<_>>(),
            [1, 2, u32::MAX]
        );
        assert_eq!(t.get(c.id).unwrap().handle, 77);
    }

    #[test]
    fn generations_exhausted_fail_closed() {
        let mut t = RegionTable::starting_at(Generation::new(u64::MAX - 1));
        let d = t.register(spec(8, Permissions::READ_WRITE, None)).unwrap();
        assert_eq!(d.generation.get(), u64::MAX - 1);
        assert_eq!(
            t.register(spec(8, Permissions::READ, None)),
            Err(RegionError::GenerationsExhausted)
        );
        assert_eq!(t.len(), 1);
        assert_eq!(t.revoke(d.id), Err(RegionError::GenerationsExhausted));
        assert!(matches!(
            get(&t, &d, 0, 1),
            Err(RmaError::NotPermitted { .. })
        ));
        assert!(t.check(A, d.id, d.generation, 0, 1, Access::Write).is_err());
        assert_eq!(
            t.get(d.id).unwrap().descriptor.permissions,
            Permissions::NONE
        );
        assert_eq!(t.deregister(d.id), Ok(77));
    }

    #[test]
    fn permissions_bits() {
        assert_eq!(
            Permissions::READ | Permissions::WRITE,
            Permissions::READ_WRITE
        );
        assert_eq!(Permissions::from_bits(3), Some(Permissions::READ_WRITE));
        assert_eq!(Permissions::from_bits(4), None);
        assert!(Permissions::NONE.is_empty());
        assert!(Permissions::READ_WRITE.allows(Access::Read));
        assert!(!Permissions::READ.allows(Access::Write));
        assert_eq!(Permissions::WRITE.bits(), 2);
        assert_eq!(Permissions::default(), Permissions::NONE);
    }

    #[test]
    fn error_codes_are_stable() {
        let r = RegionId::new(1);
        let errors = [
            (RmaError::UnknownRegion { region: r }, 1),
            (
                RmaError::NotGrantee {
                    region: r,
                    requester: A,
                },
                2,
            ),
            (
                RmaError::StaleGeneration {
                    region: r,
                    generation: Generation::new(1),
                },
                3,
            ),
            (
                RmaError::NotPermitted {
                    region: r,
                    access: Access::Read,
                },
                4,
            ),
            (
                RmaError::OutOfBounds {
                    region: r,
                    offset: 0,
                    len: 0,
                    region_len: 0,
                },
                5,
            ),
        ];
        for (e, code) in errors {
            assert_eq!(e.code().to_u8(), code);
            assert_eq!(RmaErrorCode::from_u8(code), Some(e.code()));
        }
        assert_eq!(RmaErrorCode::Malformed.to_u8(), 6);
        assert_eq!(RmaErrorCode::TooLarge.to_u8(), 7);
        assert_eq!(RmaErrorCode::from_u8(0), None);
        for c in 1..=u8::MAX {
            assert_eq!(RmaErrorCode::from_u8(c).unwrap().to_u8(), c);
        }
        assert!(matches!(
            RmaErrorCode::from_u8(200),
            Some(RmaErrorCode::Other(_))
        ));
        let truncated = RmaWireError::Truncated {
            what: "x",
            needed: 1,
            got: 0,
        };
        assert_eq!(truncated.code(), RmaErrorCode::Malformed);
        let large = RmaWireError::TooLarge {
            what: "x",
            len: 1,
            max: 0,
        };
        assert_eq!(large.code(), RmaErrorCode::TooLarge);
    }

    #[test]
    fn huge_regions() {
        let mut t = RegionTable::new();
        if usize::BITS < 64 {
            assert_eq!(
                t.register(spec(u64::MAX, Permissions::READ, None)),
                Err(RegionError::TooLarge { len: u64::MAX })
            );
            return;
        }
        // On 64-bit targets every u64 length is registrable; the bounds rule still holds at the
        // very top of the range.
        let d = t.register(spec(u64::MAX, Permissions::READ, None)).unwrap();
        assert_eq!(get(&t, &d, u64::MAX - 1, 1).unwrap().start, usize::MAX - 1);
        assert_eq!(get(&t, &d, 0, u64::MAX).unwrap().len, usize::MAX);
        assert!(get(&t, &d, u64::MAX, 0).is_ok());
        assert!(get(&t, &d, u64::MAX, 1).is_err());
        assert!(get(&t, &d, 1, u64::MAX).is_err());
    }

    const LIMITS: Limits = Limits {
        max_message_size: 64,
    };

    #[test]
    fn put_golden_and_round_trip() {
        let put = PutRequest {
            generation: Generation::new(0x0102),
            offset: 0x0A0B,
            data: b"xyz",
        };
        let mut buf = [0xFFu8; 32];
        let n = put.encode(&mut buf, &LIMITS).unwrap();
        assert_eq!(n, 19);
        assert_eq!(
            &buf[..n],
            &[2, 1, 0, 0, 0, 0, 0, 0, 0x0B, 0x0A, 0, 0, 0, 0, 0, 0, b'x', b'y', b'z']
        );
        let mut v = vec![9];
        put.encode_to_vec(&mut v, &LIMITS).unwrap();
        assert_eq!(&v[1..], &buf[..n]);
        assert_eq!(PutRequest::decode(&buf[..n], &LIMITS), Ok(put));
        assert_eq!(PutRequest::decode(&buf[..16], &LIMITS).unwrap().data, b"");
        assert_eq!(
            PutRequest::decode(&buf[..15], &LIMITS),
            Err(RmaWireError::Truncated {
                what: "put request",
                needed: 16,
                got: 15
            })
        );
        assert!(matches!(
            put.encode(&mut buf[..18], &LIMITS),
            Err(RmaWireError::BufferTooSmall {
                needed: 19,
                got: 18,
                ..
            })
        ));
        let big = PutRequest {
            data: &[0; 49],
            ..put
        };
        assert!(matches!(
            big.encode(&mut [0; 128], &LIMITS),
            Err(RmaWireError::TooLarge {
                len: 65,
                max: 64,
                ..
            })
        ));
        let mut v = Vec::new();
        assert!(big.encode_to_vec(&mut v, &LIMITS).is_err());
        assert!(v.is_empty());
        assert!(matches!(
            PutRequest::decode(&[0; 65], &LIMITS),
            Err(RmaWireError::TooLarge { .. })
        ));
    }

    #[test]
    fn get_golden_and_limits() {
        let get = GetRequest {
            generation: Generation::new(3),
            offset: 4,
            len: 56,
        };
        let b = get.to_bytes(&LIMITS).unwrap();
        let mut expected = [0u8; 24];
        expected[0] = 3;
        expected[8] = 4;
        expected[16] = 56;
        assert_eq!(b, expected);
        assert_eq!(GetRequest::decode(&b, &LIMITS), Ok(get));
        let mut buf = [0u8; 24];
        assert_eq!(get.encode(&mut buf, &LIMITS), Ok(24));
        assert!(get.encode(&mut buf[..23], &LIMITS).is_err());
        assert_eq!(
            GetRequest::decode(&b[..23], &LIMITS),
            Err(RmaWireError::Truncated {
                what: "get request",
                needed: 24,
                got: 23
            })
        );
        let mut long = [0u8; 25];
        long[..24].copy_from_slice(&b);
        assert_eq!(
            GetRequest::decode(&long, &LIMITS),
            Err(RmaWireError::TrailingBytes {
                what: "get request",
                extra: 1
            })
        );
        // The reply (8 + len) must fit: 57 bytes does not, nor does u64::MAX (saturating).
        for len in [57, u64::MAX - 7, u64::MAX] {
            let big = GetRequest { len, ..get };
            assert!(matches!(
                big.to_bytes(&LIMITS),
                Err(RmaWireError::TooLarge { .. })
            ));
            let mut raw = b;
            raw[16..24].copy_from_slice(&len.to_le_bytes());
            let e = GetRequest::decode(&raw, &LIMITS).unwrap_err();
            assert_eq!(e.code(), RmaErrorCode::TooLarge);
        }
    }

    #[test]
    fn reply_golden_and_errors() {
        let mut buf = [0xFFu8; 16];
        let ok = RmaReply::ok(b"ab");
        assert_eq!(ok.encode(&mut buf, &LIMITS), Ok(10));
        assert_eq!(&buf[..10], &[0, 0, 0, 0, 0, 0, 0, 0, b'a', b'b']);
        assert_eq!(RmaReply::decode(&buf[..10], &LIMITS), Ok(ok));
        let err = RmaReply::err(RmaErrorCode::StaleGeneration);
        assert_eq!(err.encode(&mut buf, &LIMITS), Ok(8));
        assert_eq!(&buf[..8], &[3, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(RmaReply::decode(&buf[..8], &LIMITS), Ok(err));
        let mut v = Vec::new();
        err.encode_to_vec(&mut v, &LIMITS).unwrap();
        assert_eq!(v, &buf[..8]);
        assert_eq!(RmaReply::header(Err(RmaErrorCode::OutOfBounds))[0], 5);
        // Failure replies carry no data, in either direction.
        let bad = RmaReply {
            status: Err(RmaErrorCode::Malformed),
            data: b"x",
        };
        assert!(matches!(
            bad.encode(&mut buf, &LIMITS),
            Err(RmaWireError::TrailingBytes { .. })
        ));
        assert!(bad.encode_to_vec(&mut Vec::new(), &LIMITS).is_err());
        assert_eq!(
            RmaReply::decode(&[1, 0, 0, 0, 0, 0, 0, 0, 9], &LIMITS),
            Err(RmaWireError::TrailingBytes {
                what: "failure reply",
                extra: 1
            })
        );
        assert_eq!(
            RmaReply::decode(&[0, 0, 0, 1, 0, 0, 0, 0], &LIMITS),
            Err(RmaWireError::ReservedNonZero {
                what: "reply",
                offset: 3
            })
        );
        assert!(matches!(
            RmaReply::decode(&[0; 7], &LIMITS),
            Err(RmaWireError::Truncated { .. })
        ));
        assert!(matches!(
            RmaReply::decode(&[0; 65], &LIMITS),
            Err(RmaWireError::TooLarge { .. })
        ));
        // Unknown codes are kept.
        let r = RmaReply::decode(&[99, 0, 0, 0, 0, 0, 0, 0], &LIMITS).unwrap();
        assert_eq!(r.status.unwrap_err().to_u8(), 99);
    }

    #[test]
    fn decoded_requests_feed_the_table() {
        let (t, d) = table_with(16, Permissions::READ_WRITE, Some(A));
        let mut buf = [0u8; 64];
        let put = PutRequest {
            generation: d.generation,
            offset: 12,
            data: b"abcd",
        };
        let n = put.encode(&mut buf, &LIMITS).unwrap();
        let decoded = PutRequest::decode(&buf[..n], &LIMITS).unwrap();
        assert_eq!(t.check_put(A, d.id, &decoded).unwrap().range(), 12..16);
        let over = PutRequest {
            offset: 13,
            ..decoded
        };
        assert_eq!(
            t.check_put(A, d.id, &over).unwrap_err().code(),
            RmaErrorCode::OutOfBounds
        );
        let get = GetRequest {
            generation: d.generation,
            offset: 0,
            len: 16,
        };
        let decoded = GetRequest::decode(&get.to_bytes(&LIMITS).unwrap(), &LIMITS).unwrap();
        assert_eq!(t.check_get(A, d.id, &decoded).unwrap().range(), 0..16);
        assert!(t.check_get(B, d.id, &decoded).is_err());
    }
}
