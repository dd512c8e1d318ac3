//! Wire format: the frame header, the tag layout and the message size limit.
//!
//! # Frame header
//!
//! Every message between shards starts with a [`FrameHeader`] of [`HEADER_LEN`] = 48 bytes. On
//! UCX it is the active-message header; when a header and its payload share one buffer the
//! payload starts at [`payload_offset`] (48, a multiple of 16, so rkyv can read archived payloads
//! in place). All integers are little-endian.
//!
//! ```text
//! offset size field
//!  0     4    magic          b"SHCX" (0x58434853 as a little-endian u32)
//!  4     1    version        wire version, MIN_WIRE_VERSION..=MAX_WIRE_VERSION
//!  5     1    kind           FrameKind
//!  6     2    flags          FrameFlags; undefined bits must be zero
//!  8     2    src_shard      sending shard
//! 10     2    dst_shard      receiving shard
//! 12     4    id             AmId for Am, FunctionId for Rpc*, RegionId for Rma*, else 0
//! 16     8    req_id         ReqId (0 = none); heartbeat sequence number for Heartbeat*
//! 24     8    incarnation    the sender's Incarnation
//! 32     8    ttl_ns         remaining time-to-live in ns; u64::MAX = no deadline
//! 40     8    payload_len    bytes of payload that follow; at most Limits::max_message_size
//! 48          payload        (payload_offset() = 48)
//! ```
//!
//! Deadlines travel as a remaining time-to-live rather than an absolute time, because clocks of
//! different nodes are not comparable: the sender writes `deadline - now` (saturating at zero, or
//! `u64::MAX` for no deadline), the receiver turns it back into a local deadline with `now + ttl`
//! (saturating). Network delay is not subtracted; deadlines are a budget, not a clock.
//!
//! [`FrameHeader::decode`] checks, in this order and before anything allocates: length, magic,
//! version, kind, reserved flag bits, and `payload_len <= max_message_size`. The decoder itself
//! never allocates; a caller that sizes a buffer from `payload_len` may rely on the limit.
//!
//! # Data header
//!
//! Application frames between connected nodes (UCX active-message id `DATA_AM` of the net
//! layer) carry the same fields in a shorter form, the *data header*: the sender's node id
//! first, no magic (the AM id says what follows), no `payload_len` (UCX delivers the length
//! with the data, and it is checked against the limit), and `req_id` and `ttl_ns` only when set.
//! 28 bytes for an active message, at most [`DATA_HEADER_MAX`] = 44 for a request, against the
//! 64 of the routing part and the frame header before. UCX writes the user header after the
//! payload in a shared-memory FIFO element (about 28 bytes of element header and 8 of AM header
//! first), so what the receiver reads of a small message spans fewer bytes of the second cache
//! line, written by the sender's core, but not none: an 8-byte message ends at byte 72. Fitting
//! the first line would take a header of at most 20 bytes (see the README, "The data header").
//!
//! ```text
//! offset size field
//!  0     8    node           the sending node's id
//!  8     8    incarnation    the sender's Incarnation
//! 16     4    id             as in the frame header
//! 20     2    src_shard      sending shard
//! 22     2    dst_shard      receiving shard
//! 24     1    kind           FrameKind
//! 25     1    flags          FrameFlags (all defined bits fit 8); undefined bits must be zero
//! 26     1    version        wire version, MIN_WIRE_VERSION..=MAX_WIRE_VERSION
//! 27     1    fields         bit 0: req_id follows, bit 1: ttl_ns follows; others zero
//! 28     8    req_id         if bit 0 (else ReqId::NONE)
//! ..     8    ttl_ns         if bit 1 (else no deadline)
//! ```
//!
//! [`FrameHeader::decode_data`] checks length, version, kind, reserved flag and field bits, and
//! the payload length against the limit, before anything allocates.
//!
//! # Tag layout
//!
//! Tag send/recv uses a 64-bit tag:
//!
//! ```text
//! bit 63..60  kind          TagKind (4 bits)
//! bit 59..48  source shard  ShardId (12 bits; MAX_SHARDS = 4096)
//! bit 47..0   user bits     (48 bits)
//! ```
//!
//! [`TagMask::EXACT`] matches all 64 bits, [`TagMask::ANY_SOURCE`] ignores the source shard,
//! [`TagMask::ANY_SOURCE_ANY_USER`] matches on the kind alone.

use crate::ids::{NodeId, ReqId, ShardId};
use crate::time::{duration_to_nanos, Timestamp};
use crate::Incarnation;
use std::time::Duration;
use thiserror::Error;

/// The magic number at offset 0 (`b"SHCX"` read as a little-endian `u32`).
pub const MAGIC: u32 = u32::from_le_bytes(*b"SHCX");
/// Size of an encoded [`FrameHeader`].
pub const HEADER_LEN: usize = 48;
/// Size of a data header without its optional fields (see "Data header" in the module docs).
pub const DATA_HEADER_MIN: usize = 28;
/// Size of a data header with both optional fields, `req_id` and `ttl_ns`.
pub const DATA_HEADER_MAX: usize = DATA_HEADER_MIN + 16;
/// Data header `fields` bit: `req_id` follows.
const DATA_HAS_REQ: u8 = 1 << 0;
/// Data header `fields` bit: `ttl_ns` follows.
const DATA_HAS_TTL: u8 = 1 << 1;
/// Alignment of payloads that follow a header in one buffer (for rkyv).
pub const PAYLOAD_ALIGN: usize = 16;
/// The oldest wire version this build speaks.
pub const MIN_WIRE_VERSION: u8 = 1;
/// The newest wire version this build speaks.
pub const MAX_WIRE_VERSION: u8 = 1;
/// The header version used by handshake frames. The version-1 header layout is frozen: every
/// build, whatever versions it speaks afterwards, must decode it, so that peers with no version
/// in common can still exchange a hello and a version-mismatch rejection.
pub const HANDSHAKE_WIRE_VERSION: u8 = 1;
/// `ttl_ns` value meaning "no deadline".
pub const NO_DEADLINE_TTL: u64 = u64::MAX;

/// What a frame is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
#[non_exhaustive]
pub enum FrameKind {
    /// Handshake: client hello ([`crate::handshake::Hello`] payload).
    Hello = 1,
    /// Handshake: server welcome ([`crate::handshake::Welcome`] payload).
    Welcome = 2,
    /// Handshake: client confirmation ([`crate::handshake::Confirm`] payload).
    Confirm = 3,
    /// Handshake refused ([`crate::handshake::Reject`] payload).
    Reject = 4,
    /// Liveness probe; `req_id` is a sequence number. No payload.
    Heartbeat = 5,
    /// Answer to a heartbeat, echoing its `req_id`. No payload.
    HeartbeatAck = 6,
    /// Orderly close after draining. No payload.
    Close = 7,
    /// Handshake: a rail joins an authenticated session ([`crate::handshake::Join`] payload).
    Join = 8,
    /// Handshake: the server accepted a join ([`crate::handshake::Joined`] payload).
    Joined = 9,
    /// Active message; `id` is the [`crate::AmId`].
    Am = 16,
    /// RPC request; `id` is the [`crate::FunctionId`], `req_id` the request.
    RpcRequest = 17,
    /// RPC response for `req_id`.
    RpcResponse = 18,
    /// RPC failure for `req_id`.
    RpcError = 19,
    /// Cancels the RPC `req_id`.
    RpcCancel = 20,
    /// Checked remote put into region `id`.
    RmaPut = 32,
    /// Checked remote get from region `id`.
    RmaGet = 33,
    /// Reply to an RMA put or get.
    RmaReply = 34,
}

impl FrameKind {
    /// Every kind, in code order.
    pub const ALL: [FrameKind; 17] = [
        FrameKind::Hello,
        FrameKind::Welcome,
        FrameKind::Confirm,
        FrameKind::Reject,
        FrameKind::Heartbeat,
        FrameKind::HeartbeatAck,
        FrameKind::Close,
        FrameKind::Join,
        FrameKind::Joined,
        FrameKind::Am,
        FrameKind::RpcRequest,
        FrameKind::RpcResponse,
        FrameKind::RpcError,
        FrameKind::RpcCancel,
        FrameKind::RmaPut,
        FrameKind::RmaGet,
        FrameKind::RmaReply,
    ];

    /// The kind for a wire code, if any.
    #[inline]
    pub fn from_u8(code: u8) -> Option<FrameKind> {
        // A match, not a search of `ALL` (every received frame decodes its kind); the unit
        // test `kinds_decode_from_their_codes` holds the two together.
        Some(match code {
            1 => FrameKind::Hello,
            2 => FrameKind::Welcome,
            3 => FrameKind::Confirm,
            4 => FrameKind::Reject,
            5 => FrameKind::Heartbeat,
            6 => FrameKind::HeartbeatAck,
            7 => FrameKind::Close,
            8 => FrameKind::Join,
            9 => FrameKind::Joined,
            16 => FrameKind::Am,
            17 => FrameKind::RpcRequest,
            18 => FrameKind::RpcResponse,
            19 => FrameKind::RpcError,
            20 => FrameKind::RpcCancel,
            32 => FrameKind::RmaPut,
            33 => FrameKind::RmaGet,
            34 => FrameKind::RmaReply,
            _ => return None,
        })
    }

    /// Whether this kind belongs to the handshake (accepted before a connection is ready).
    pub fn is_handshake(self) -> bool {
        matches!(
            self,
            FrameKind::Hello
                | FrameKind::Welcome
                | FrameKind::Confirm
                | FrameKind::Reject
                | FrameKind::Join
                | FrameKind::Joined
        )
    }

    /// Whether this kind is consumed by [`crate::Connection`] itself (handshake, heartbeat,
    /// close) rather than delivered to the application.
    pub fn is_control(self) -> bool {
        (self as u8) < 16
    }

    /// Whether this kind only keeps a connection alive (a heartbeat or its ack): nothing an
    /// application waits on, so it starts no busy-polling window in a shard's driver.
    pub fn is_liveness(self) -> bool {
        matches!(self, FrameKind::Heartbeat | FrameKind::HeartbeatAck)
    }
}

/// Frame flag bits (a `u16` bit set). Bits not named here are reserved and must be zero.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FrameFlags(u16);

impl FrameFlags {
    /// No flags.
    pub const EMPTY: FrameFlags = FrameFlags(0);
    /// The request may be executed more than once (retries allowed beyond the dedup window).
    pub const IDEMPOTENT: FrameFlags = FrameFlags(1 << 0);
    /// No reply is wanted.
    pub const ONE_WAY: FrameFlags = FrameFlags(1 << 1);
    /// The payload is not inline: it follows through UCX rendezvous.
    pub const RNDV: FrameFlags = FrameFlags(1 << 2);
    /// All defined bits.
    pub const ALL: FrameFlags = FrameFlags(0b111);

    /// Flags from raw bits, or `None` if a reserved bit is set.
    pub const fn from_bits(bits: u16) -> Option<FrameFlags> {
        if bits & !Self::ALL.0 == 0 {
            Some(FrameFlags(bits))
        } else {
            None
        }
    }

    /// The raw bits.
    pub const fn bits(self) -> u16 {
        self.0
    }

    /// Whether every bit of `other` is set.
    pub const fn contains(self, other: FrameFlags) -> bool {
        self.0 & other.0 == other.0
    }

    /// The union.
    pub const fn union(self, other: FrameFlags) -> FrameFlags {
        FrameFlags(self.0 | other.0)
    }
}

impl std::ops::BitOr for FrameFlags {
    type Output = FrameFlags;
    fn bitor(self, rhs: FrameFlags) -> FrameFlags {
        self.union(rhs)
    }
}

/// Decoder limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest accepted `payload_len`, checked before any buffer is sized from it.
    pub max_message_size: u64,
}

impl Limits {
    /// 16 MiB, the default maximum message size.
    pub const DEFAULT_MAX_MESSAGE_SIZE: u64 = 16 << 20;
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_message_size: Limits::DEFAULT_MAX_MESSAGE_SIZE,
        }
    }
}

/// The fixed-size header in front of every message. See the module docs for the layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FrameHeader {
    /// Wire version of this frame.
    pub version: u8,
    /// What the frame is.
    pub kind: FrameKind,
    /// Flag bits.
    pub flags: FrameFlags,
    /// Sending shard.
    pub src_shard: ShardId,
    /// Receiving shard.
    pub dst_shard: ShardId,
    /// AM id, function id or region id, depending on `kind`; zero otherwise.
    pub id: u32,
    /// Request id or heartbeat sequence number; [`ReqId::NONE`] otherwise.
    pub req_id: ReqId,
    /// The sender's incarnation.
    pub incarnation: Incarnation,
    /// Remaining time-to-live in nanoseconds; [`NO_DEADLINE_TTL`] for none.
    pub ttl_ns: u64,
    /// Length of the payload that follows.
    pub payload_len: u64,
}

/// Errors from encoding or decoding frames and tags.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum WireError {
    /// The input is shorter than the structure being decoded.
    #[error("truncated {what}: need {needed} bytes, got {got}")]
    Truncated {
        /// What was being decoded.
        what: &'static str,
        /// Bytes required.
        needed: usize,
        /// Bytes available.
        got: usize,
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
    /// The magic number is wrong (not a shardcx frame).
    #[error("bad magic {found:#010x}")]
    BadMagic {
        /// The value found.
        found: u32,
    },
    /// The wire version is outside what this build speaks.
    #[error("unsupported wire version {found} (supported {min}..={max})")]
    UnsupportedVersion {
        /// The version found.
        found: u8,
        /// Oldest supported.
        min: u8,
        /// Newest supported.
        max: u8,
    },
    /// The frame kind code is unknown.
    #[error("unknown frame kind {found}")]
    UnknownKind {
        /// The code found.
        found: u8,
    },
    /// Reserved flag bits are set.
    #[error("reserved flag bits set: {bits:#06x}")]
    ReservedFlags {
        /// The flag word found.
        bits: u16,
    },
    /// `payload_len` exceeds the configured maximum.
    #[error("message of {len} bytes exceeds the maximum of {max}")]
    MessageTooLarge {
        /// The announced length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The payload present does not match `payload_len`.
    #[error("payload length mismatch: header says {declared}, frame has {actual}")]
    LengthMismatch {
        /// Length in the header.
        declared: u64,
        /// Length present.
        actual: u64,
    },
    /// A tag field does not fit its bits.
    #[error("tag {field} value {value} does not fit {bits} bits")]
    TagFieldOverflow {
        /// Which field.
        field: &'static str,
        /// The value given.
        value: u64,
        /// Width of the field.
        bits: u32,
    },
    /// The tag kind is unknown.
    #[error("non-canonical data header: {what}")]
    NonCanonical {
        /// What was written in a form the encoder never writes.
        what: &'static str,
    },
    /// The tag kind is unknown.
    #[error("unknown tag kind {found}")]
    UnknownTagKind {
        /// The code found.
        found: u8,
    },
}

impl FrameHeader {
    /// A header for `kind` at the newest wire version, with every other field zero / empty and no
    /// deadline. Fill in the rest with struct update syntax or the `with_*` methods.
    pub fn new(kind: FrameKind) -> FrameHeader {
        FrameHeader {
            version: MAX_WIRE_VERSION,
            kind,
            flags: FrameFlags::EMPTY,
            src_shard: ShardId::new(0),
            dst_shard: ShardId::new(0),
            id: 0,
            req_id: ReqId::NONE,
            incarnation: Incarnation::new(0),
            ttl_ns: NO_DEADLINE_TTL,
            payload_len: 0,
        }
    }

    /// Sets `ttl_ns` from an absolute local `deadline` at time `now` (saturating; a deadline of
    /// [`Timestamp::MAX`] means none).
    pub fn with_deadline(mut self, now: Timestamp, deadline: Timestamp) -> FrameHeader {
        self.ttl_ns = ttl_from_deadline(now, deadline);
        self
    }

    /// The receiver-local deadline of this frame received at `now`: `now + ttl` (saturating), or
    /// [`Timestamp::MAX`] when the frame has none.
    pub fn deadline_at(&self, now: Timestamp) -> Timestamp {
        if self.ttl_ns == NO_DEADLINE_TTL {
            Timestamp::MAX
        } else {
            Timestamp::from_nanos(now.as_nanos().saturating_add(self.ttl_ns))
        }
    }

    /// Writes the header into the first [`HEADER_LEN`] bytes of `buf`; returns [`HEADER_LEN`].
    pub fn encode(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        let Some(out) = buf.get_mut(..HEADER_LEN) else {
            return Err(WireError::BufferTooSmall {
                what: "frame header",
                needed: HEADER_LEN,
                got: buf.len(),
            });
        };
        out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        out[4] = self.version;
        out[5] = self.kind as u8;
        out[6..8].copy_from_slice(&self.flags.bits().to_le_bytes());
        out[8..10].copy_from_slice(&self.src_shard.get().to_le_bytes());
        out[10..12].copy_from_slice(&self.dst_shard.get().to_le_bytes());
        out[12..16].copy_from_slice(&self.id.to_le_bytes());
        out[16..24].copy_from_slice(&self.req_id.get().to_le_bytes());
        out[24..32].copy_from_slice(&self.incarnation.get().to_le_bytes());
        out[32..40].copy_from_slice(&self.ttl_ns.to_le_bytes());
        out[40..48].copy_from_slice(&self.payload_len.to_le_bytes());
        Ok(HEADER_LEN)
    }

    /// The encoded header as an array.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        // Cannot fail: `out` is exactly HEADER_LEN bytes.
        let _ = self.encode(&mut out);
        out
    }

    /// Decodes a header from the first [`HEADER_LEN`] bytes of `buf` (trailing bytes are
    /// ignored). Validates magic, version, kind, reserved flags and the size limit; allocates
    /// nothing.
    pub fn decode(buf: &[u8], limits: &Limits) -> Result<FrameHeader, WireError> {
        let Some(b) = buf.get(..HEADER_LEN) else {
            return Err(WireError::Truncated {
                what: "frame header",
                needed: HEADER_LEN,
                got: buf.len(),
            });
        };
        let magic = le_u32(&b[0..4]);
        if magic != MAGIC {
            return Err(WireError::BadMagic { found: magic });
        }
        let version = b[4];
        if !(MIN_WIRE_VERSION..=MAX_WIRE_VERSION).contains(&version) {
            return Err(WireError::UnsupportedVersion {
                found: version,
                min: MIN_WIRE_VERSION,
                max: MAX_WIRE_VERSION,
            });
        }
        let kind = FrameKind::from_u8(b[5]).ok_or(WireError::UnknownKind { found: b[5] })?;
        let raw_flags = le_u16(&b[6..8]);
        let flags =
            FrameFlags::from_bits(raw_flags).ok_or(WireError::ReservedFlags { bits: raw_flags })?;
        let payload_len = le_u64(&b[40..48]);
        if payload_len > limits.max_message_size {
            return Err(WireError::MessageTooLarge {
                len: payload_len,
                max: limits.max_message_size,
            });
        }
        Ok(FrameHeader {
            version,
            kind,
            flags,
            src_shard: ShardId::new(le_u16(&b[8..10])),
            dst_shard: ShardId::new(le_u16(&b[10..12])),
            id: le_u32(&b[12..16]),
            req_id: ReqId::new(le_u64(&b[16..24])),
            incarnation: Incarnation::new(le_u64(&b[24..32])),
            ttl_ns: le_u64(&b[32..40]),
            payload_len,
        })
    }
}

impl FrameHeader {
    /// Length of this header as a data header (see "Data header" in the module docs).
    #[inline]
    pub fn data_header_len(&self) -> usize {
        let mut n = DATA_HEADER_MIN;
        if self.req_id != ReqId::NONE {
            n += 8;
        }
        if self.ttl_ns != NO_DEADLINE_TTL {
            n += 8;
        }
        n
    }

    /// Writes this header as a data header from `node` at the start of `buf`; returns its
    /// length ([`FrameHeader::data_header_len`]). `payload_len` is not written: the receiver
    /// takes the length UCX delivers.
    #[inline]
    pub fn encode_data(&self, node: NodeId, buf: &mut [u8]) -> Result<usize, WireError> {
        let len = self.data_header_len();
        let Some(out) = buf.get_mut(..len) else {
            return Err(WireError::BufferTooSmall {
                what: "data header",
                needed: len,
                got: buf.len(),
            });
        };
        out[0..8].copy_from_slice(&node.get().to_le_bytes());
        out[8..16].copy_from_slice(&self.incarnation.get().to_le_bytes());
        out[16..20].copy_from_slice(&self.id.to_le_bytes());
        out[20..22].copy_from_slice(&self.src_shard.get().to_le_bytes());
        out[22..24].copy_from_slice(&self.dst_shard.get().to_le_bytes());
        out[24] = self.kind as u8;
        // Every defined flag is in the low byte (FrameFlags::ALL); `from_bits` refuses the rest.
        out[25] = self.flags.bits() as u8;
        out[26] = self.version;
        let mut fields = 0;
        let mut at = DATA_HEADER_MIN;
        if self.req_id != ReqId::NONE {
            fields |= DATA_HAS_REQ;
            out[at..at + 8].copy_from_slice(&self.req_id.get().to_le_bytes());
            at += 8;
        }
        if self.ttl_ns != NO_DEADLINE_TTL {
            fields |= DATA_HAS_TTL;
            out[at..at + 8].copy_from_slice(&self.ttl_ns.to_le_bytes());
        }
        out[27] = fields;
        Ok(len)
    }

    /// Decodes a data header at the start of `buf`, of a frame whose payload UCX delivered with
    /// `payload_len` bytes: the sender, the header (its `payload_len` set), and the data
    /// header's length (the user header follows it). Validates length, version, kind, reserved
    /// flag and field bits and the size limit; allocates nothing.
    #[inline]
    pub fn decode_data(
        buf: &[u8],
        payload_len: u64,
        limits: &Limits,
    ) -> Result<(NodeId, FrameHeader, usize), WireError> {
        let truncated = |needed| WireError::Truncated {
            what: "data header",
            needed,
            got: buf.len(),
        };
        let Some(b) = buf.get(..DATA_HEADER_MIN) else {
            return Err(truncated(DATA_HEADER_MIN));
        };
        let version = b[26];
        if !(MIN_WIRE_VERSION..=MAX_WIRE_VERSION).contains(&version) {
            return Err(WireError::UnsupportedVersion {
                found: version,
                min: MIN_WIRE_VERSION,
                max: MAX_WIRE_VERSION,
            });
        }
        let kind = FrameKind::from_u8(b[24]).ok_or(WireError::UnknownKind { found: b[24] })?;
        let flags = FrameFlags::from_bits(u16::from(b[25])).ok_or(WireError::ReservedFlags {
            bits: u16::from(b[25]),
        })?;
        let fields = b[27];
        if fields & !(DATA_HAS_REQ | DATA_HAS_TTL) != 0 {
            return Err(WireError::ReservedFlags {
                bits: u16::from(fields) << 8,
            });
        }
        if payload_len > limits.max_message_size {
            return Err(WireError::MessageTooLarge {
                len: payload_len,
                max: limits.max_message_size,
            });
        }
        let mut at = DATA_HEADER_MIN;
        let mut optional = |present: bool, absent: u64| -> Result<u64, WireError> {
            if !present {
                return Ok(absent);
            }
            let v = buf.get(at..at + 8).ok_or_else(|| truncated(at + 8))?;
            at += 8;
            Ok(le_u64(v))
        };
        let req_id = optional(fields & DATA_HAS_REQ != 0, ReqId::NONE.get())?;
        let ttl_ns = optional(fields & DATA_HAS_TTL != 0, NO_DEADLINE_TTL)?;
        // One encoding per header: a field is present exactly when it is set.
        if fields & DATA_HAS_REQ != 0 && req_id == ReqId::NONE.get() {
            return Err(WireError::NonCanonical {
                what: "a request id of none written out",
            });
        }
        if fields & DATA_HAS_TTL != 0 && ttl_ns == NO_DEADLINE_TTL {
            return Err(WireError::NonCanonical {
                what: "no deadline written out",
            });
        }
        let header = FrameHeader {
            version,
            kind,
            flags,
            src_shard: ShardId::new(le_u16(&b[20..22])),
            dst_shard: ShardId::new(le_u16(&b[22..24])),
            id: le_u32(&b[16..20]),
            req_id: ReqId::new(req_id),
            incarnation: Incarnation::new(le_u64(&b[8..16])),
            ttl_ns,
            payload_len,
        };
        Ok((NodeId::new(le_u64(&b[0..8])), header, at))
    }
}

/// The part of a data header that is the same for every frame one connection sends: the
/// sender's node id and incarnation, both shards and the wire version, encoded once when the
/// connection becomes ready ([`DataTemplate::new`]), so that a send writes only the frame's
/// own fields ([`DataTemplate::write`]: kind, id, flags, and the request id and deadline when
/// set). What it writes is byte for byte what [`FrameHeader::encode_data`] writes for the same
/// header (a property test holds the two together).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataTemplate([u8; DATA_HEADER_MIN]);

impl DataTemplate {
    /// The template of the frames `node` sends with `base`'s version, shards and incarnation
    /// (its kind, id, flags, request id and deadline are not kept).
    pub fn new(node: NodeId, base: &FrameHeader) -> DataTemplate {
        let mut t = [0u8; DATA_HEADER_MIN];
        t[0..8].copy_from_slice(&node.get().to_le_bytes());
        t[8..16].copy_from_slice(&base.incarnation.get().to_le_bytes());
        t[20..22].copy_from_slice(&base.src_shard.get().to_le_bytes());
        t[22..24].copy_from_slice(&base.dst_shard.get().to_le_bytes());
        t[26] = base.version;
        DataTemplate(t)
    }

    /// The receiving shard the template names.
    pub fn dst_shard(&self) -> ShardId {
        ShardId::new(le_u16(&self.0[22..24]))
    }

    /// Writes the data header of a frame of `kind` with `id`, `flags`, `req_id` and `ttl_ns`
    /// at the start of `out` (an array of at least [`DATA_HEADER_MAX`] bytes, checked when it
    /// compiles); returns its length (as [`FrameHeader::data_header_len`]).
    #[inline]
    pub fn write<const N: usize>(
        &self,
        out: &mut [u8; N],
        (kind, id, flags): (FrameKind, u32, FrameFlags),
        req_id: ReqId,
        ttl_ns: u64,
    ) -> usize {
        const { assert!(N >= DATA_HEADER_MAX) };
        out[..DATA_HEADER_MIN].copy_from_slice(&self.0);
        out[16..20].copy_from_slice(&id.to_le_bytes());
        out[24] = kind as u8;
        // Every defined flag is in the low byte (FrameFlags::ALL).
        out[25] = flags.bits() as u8;
        let mut fields = 0;
        let mut at = DATA_HEADER_MIN;
        if req_id != ReqId::NONE {
            fields |= DATA_HAS_REQ;
            out[at..at + 8].copy_from_slice(&req_id.get().to_le_bytes());
            at += 8;
        }
        if ttl_ns != NO_DEADLINE_TTL {
            fields |= DATA_HAS_TTL;
            out[at..at + 8].copy_from_slice(&ttl_ns.to_le_bytes());
            at += 8;
        }
        out[27] = fields;
        at
    }
}

/// Remaining time-to-live from `now` until `deadline`, for the `ttl_ns` field: zero when already
/// past, [`NO_DEADLINE_TTL`] when `deadline` is [`Timestamp::MAX`]. A finite deadline never maps
/// to `NO_DEADLINE_TTL` (it is clamped one below).
pub fn ttl_from_deadline(now: Timestamp, deadline: Timestamp) -> u64 {
    if deadline.is_never() {
        NO_DEADLINE_TTL
    } else {
        duration_to_nanos(deadline.saturating_duration_since(now)).min(NO_DEADLINE_TTL - 1)
    }
}

/// Offset of the payload when header and payload share one buffer: [`HEADER_LEN`] rounded up to
/// [`PAYLOAD_ALIGN`] (48). The buffer itself must start 16-byte aligned for the payload to be.
pub const fn payload_offset() -> usize {
    HEADER_LEN.div_ceil(PAYLOAD_ALIGN) * PAYLOAD_ALIGN
}

/// Total length of a frame with `payload_len` payload bytes in one buffer, or an error when it is
/// above `limits` (or does not fit a `usize`).
pub fn frame_len(payload_len: u64, limits: &Limits) -> Result<usize, WireError> {
    if payload_len > limits.max_message_size {
        return Err(WireError::MessageTooLarge {
            len: payload_len,
            max: limits.max_message_size,
        });
    }
    usize::try_from(payload_len)
        .ok()
        .and_then(|p| p.checked_add(payload_offset()))
        .ok_or(WireError::MessageTooLarge {
            len: payload_len,
            max: limits.max_message_size,
        })
}

/// Writes `header` (with `payload_len` set from `payload`) and `payload` into `buf` at
/// [`payload_offset`]; returns the frame length. Padding bytes between them are zeroed.
pub fn encode_frame(
    header: &FrameHeader,
    payload: &[u8],
    buf: &mut [u8],
    limits: &Limits,
) -> Result<usize, WireError> {
    let len = frame_len(payload.len() as u64, limits)?;
    let Some(out) = buf.get_mut(..len) else {
        return Err(WireError::BufferTooSmall {
            what: "frame",
            needed: len,
            got: buf.len(),
        });
    };
    let header = FrameHeader {
        payload_len: payload.len() as u64,
        ..*header
    };
    header.encode(out)?;
    out[HEADER_LEN..payload_offset()].fill(0);
    out[payload_offset()..].copy_from_slice(payload);
    Ok(len)
}

/// Splits a one-buffer frame into its header and payload, checking that exactly `payload_len`
/// bytes follow at [`payload_offset`].
pub fn decode_frame<'a>(
    buf: &'a [u8],
    limits: &Limits,
) -> Result<(FrameHeader, &'a [u8]), WireError> {
    let header = FrameHeader::decode(buf, limits)?;
    let rest = buf.get(payload_offset()..).unwrap_or(&[]);
    if rest.len() as u64 != header.payload_len {
        return Err(WireError::LengthMismatch {
            declared: header.payload_len,
            actual: rest.len() as u64,
        });
    }
    Ok((header, rest))
}

// `b` has exactly the right length at every call site above; the fallbacks are unreachable.
fn le_u16(b: &[u8]) -> u16 {
    u16::from_le_bytes(b.try_into().unwrap_or([0; 2]))
}
fn le_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes(b.try_into().unwrap_or([0; 4]))
}
fn le_u64(b: &[u8]) -> u64 {
    u64::from_le_bytes(b.try_into().unwrap_or([0; 8]))
}

pub(crate) fn read_u16(b: &[u8], at: usize) -> u16 {
    le_u16(&b[at..at + 2])
}
pub(crate) fn read_u64(b: &[u8], at: usize) -> u64 {
    le_u64(&b[at..at + 8])
}

/// What a tag carries (the top 4 bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
#[non_exhaustive]
pub enum TagKind {
    /// Application tag send/recv.
    User = 0,
    /// Rendezvous data for a frame whose header said [`FrameFlags::RNDV`].
    RndvData = 1,
    /// Stream-style transfers.
    Stream = 2,
    /// Runtime-internal control traffic.
    Control = 3,
}

impl TagKind {
    /// The kind for a 4-bit code, if defined.
    pub fn from_u8(code: u8) -> Option<TagKind> {
        match code {
            0 => Some(TagKind::User),
            1 => Some(TagKind::RndvData),
            2 => Some(TagKind::Stream),
            3 => Some(TagKind::Control),
            _ => None,
        }
    }
}

/// A 64-bit UCX tag: kind (4 bits) | source shard (12 bits) | user bits (48 bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tag(u64);

/// A UCX tag mask: bits set to one must match.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TagMask(u64);

/// Bit positions and masks of the tag layout.
#[derive(Clone, Copy, Debug)]
pub struct TagLayout;

impl TagLayout {
    /// Width of the kind field.
    pub const KIND_BITS: u32 = 4;
    /// Width of the source-shard field.
    pub const SHARD_BITS: u32 = 12;
    /// Width of the user field.
    pub const USER_BITS: u32 = 48;
    /// Shift of the kind field.
    pub const KIND_SHIFT: u32 = 60;
    /// Shift of the source-shard field.
    pub const SHARD_SHIFT: u32 = 48;
    /// Bits of the kind field.
    pub const KIND_MASK: u64 = 0xF << 60;
    /// Bits of the source-shard field.
    pub const SHARD_MASK: u64 = 0xFFF << 48;
    /// Bits of the user field.
    pub const USER_MASK: u64 = (1 << 48) - 1;
}

impl Tag {
    /// Builds a tag; errors when the shard does not fit 12 bits or `user` does not fit 48.
    pub fn new(kind: TagKind, source: ShardId, user: u64) -> Result<Tag, WireError> {
        if u64::from(source.get()) >= 1 << TagLayout::SHARD_BITS {
            return Err(WireError::TagFieldOverflow {
                field: "source shard",
                value: u64::from(source.get()),
                bits: TagLayout::SHARD_BITS,
            });
        }
        if user > TagLayout::USER_MASK {
            return Err(WireError::TagFieldOverflow {
                field: "user",
                value: user,
                bits: TagLayout::USER_BITS,
            });
        }
        Ok(Tag((u64::from(kind as u8) << TagLayout::KIND_SHIFT)
            | (u64::from(source.get()) << TagLayout::SHARD_SHIFT)
            | user))
    }

    /// Parses a raw tag received from UCX; errors on an unknown kind.
    pub fn parse(raw: u64) -> Result<Tag, WireError> {
        let code = (raw >> TagLayout::KIND_SHIFT) as u8;
        TagKind::from_u8(code).ok_or(WireError::UnknownTagKind { found: code })?;
        Ok(Tag(raw))
    }

    /// The raw 64-bit value handed to UCX.
    pub fn raw(self) -> u64 {
        self.0
    }

    /// The kind field.
    pub fn kind(self) -> TagKind {
        // Tags are only built by `new` or `parse`, which both check the kind.
        TagKind::from_u8((self.0 >> TagLayout::KIND_SHIFT) as u8).unwrap_or(TagKind::User)
    }

    /// The source-shard field.
    pub fn source_shard(self) -> ShardId {
        ShardId::new(((self.0 & TagLayout::SHARD_MASK) >> TagLayout::SHARD_SHIFT) as u16)
    }

    /// The user field.
    pub fn user(self) -> u64 {
        self.0 & TagLayout::USER_MASK
    }

    /// Whether `self` matches `pattern` under `mask` (the UCX rule: `(self ^ pattern) & mask == 0`).
    pub fn matches(self, pattern: Tag, mask: TagMask) -> bool {
        (self.0 ^ pattern.0) & mask.0 == 0
    }
}

impl TagMask {
    /// Match every bit.
    pub const EXACT: TagMask = TagMask(u64::MAX);
    /// Match kind and user bits, any source shard.
    pub const ANY_SOURCE: TagMask = TagMask(!TagLayout::SHARD_MASK);
    /// Match the kind only.
    pub const ANY_SOURCE_ANY_USER: TagMask = TagMask(TagLayout::KIND_MASK);

    /// A mask from raw bits.
    pub const fn from_raw(raw: u64) -> TagMask {
        TagMask(raw)
    }

    /// The raw mask handed to UCX.
    pub const fn raw(self) -> u64 {
        self.0
    }
}

impl Default for FrameHeader {
    fn default() -> FrameHeader {
        FrameHeader::new(FrameKind::Am)
    }
}

/// A helper for the deadline carried by request frames: the remaining time as a [`Duration`], or
/// `None` when there is no deadline.
pub fn ttl_duration(ttl_ns: u64) -> Option<Duration> {
    (ttl_ns != NO_DEADLINE_TTL).then(|| Duration::from_nanos(ttl_ns))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;

    fn sample() -> FrameHeader {
        FrameHeader {
            version: 1,
            kind: FrameKind::RpcRequest,
            flags: FrameFlags::IDEMPOTENT | FrameFlags::RNDV,
            src_shard: ShardId::new(3),
            dst_shard: ShardId::new(0x0102),
            id: 0xAABB_CCDD,
            req_id: ReqId::new(0x1122_3344_5566_7788),
            incarnation: Incarnation::new(9),
            ttl_ns: 1_000,
            payload_len: 5,
        }
    }

    #[test]
    fn kinds_decode_from_their_codes() {
        for code in 0..=u8::MAX {
            let want = FrameKind::ALL.iter().copied().find(|k| *k as u8 == code);
            assert_eq!(FrameKind::from_u8(code), want, "code {code}");
        }
    }

    #[test]
    fn data_header_golden_encoding() {
        let mut out = [0u8; DATA_HEADER_MAX];
        let n = sample()
            .encode_data(NodeId::new(0x0807_0605_0403_0201), &mut out)
            .unwrap();
        let expected: [u8; DATA_HEADER_MAX] = [
            1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 0, 0, 0, 0, 0, 0, 0xDD, 0xCC, 0xBB, 0xAA, 3, 0, 0x02,
            0x01, 17, 0b101, 1, 0b11, 0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11, 0xE8, 0x03,
            0, 0, 0, 0, 0, 0,
        ];
        assert_eq!(n, DATA_HEADER_MAX);
        assert_eq!(out, expected);
        // A plain active message: no request id, no deadline.
        let am = FrameHeader {
            id: 7,
            ..FrameHeader::new(FrameKind::Am)
        };
        assert_eq!(am.data_header_len(), DATA_HEADER_MIN);
        assert_eq!(
            am.encode_data(NodeId::new(1), &mut out).unwrap(),
            DATA_HEADER_MIN
        );
        assert_eq!(out[27], 0);
    }

    #[test]
    fn data_header_round_trips_with_and_without_optional_fields() {
        let limits = Limits::default();
        for (req, ttl) in [(0, NO_DEADLINE_TTL), (5, NO_DEADLINE_TTL), (0, 0), (5, 77)] {
            let h = FrameHeader {
                req_id: ReqId::new(req),
                ttl_ns: ttl,
                payload_len: 123,
                ..sample()
            };
            let mut buf = vec![0u8; h.data_header_len() + 3];
            let n = h.encode_data(NodeId::new(42), &mut buf).unwrap();
            assert_eq!(n, h.data_header_len());
            let (node, back, used) = FrameHeader::decode_data(&buf, 123, &limits).unwrap();
            assert_eq!((node, back, used), (NodeId::new(42), h, n));
        }
    }

    #[test]
    fn data_header_refuses_what_it_cannot_trust() {
        let limits = Limits::default();
        let mut buf = [0u8; DATA_HEADER_MAX];
        sample().encode_data(NodeId::new(1), &mut buf).unwrap();
        let decode = |b: &[u8], len| FrameHeader::decode_data(b, len, &limits).map(|_| ());
        assert!(matches!(
            decode(&buf[..DATA_HEADER_MIN - 1], 0),
            Err(WireError::Truncated { .. })
        ));
        // The fields byte promises a request id and a deadline that are not there.
        assert!(matches!(
            decode(&buf[..DATA_HEADER_MIN + 8], 0),
            Err(WireError::Truncated { .. })
        ));
        assert!(matches!(
            decode(&buf, limits.max_message_size + 1),
            Err(WireError::MessageTooLarge { .. })
        ));
        for (at, value) in [
            (26, 0),
            (26, MAX_WIRE_VERSION + 1),
            (24, 0xEE),
            (25, 0x80),
            (27, 4),
        ] {
            let mut bad = buf;
            bad[at] = value;
            assert!(decode(&bad, 0).is_err(), "byte {at} = {value}");
        }
        assert!(sample()
            .encode_data(NodeId::new(1), &mut [0u8; 30])
            .is_err());
        // A field written out with its "absent" value: the encoder never does that.
        let mut zero_req = buf;
        zero_req[28..36].fill(0);
        assert!(matches!(
            decode(&zero_req, 0),
            Err(WireError::NonCanonical { .. })
        ));
        let mut no_ttl = buf;
        no_ttl[36..44].fill(0xFF);
        assert!(matches!(
            decode(&no_ttl, 0),
            Err(WireError::NonCanonical { .. })
        ));
    }

    #[test]
    fn golden_encoding() {
        let bytes = sample().to_bytes();
        let expected: [u8; 48] = [
            b'S', b'H', b'C', b'X', 1, 17, 0b101, 0, 3, 0, 0x02, 0x01, 0xDD, 0xCC, 0xBB, 0xAA,
            0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11, 9, 0, 0, 0, 0, 0, 0, 0, 0xE8, 0x03, 0,
            0, 0, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0,
        ];
        assert_eq!(bytes, expected);
        assert_eq!(
            FrameHeader::decode(&bytes, &Limits::default()),
            Ok(sample())
        );
    }

    #[test]
    fn decode_errors_in_order() {
        let limits = Limits {
            max_message_size: 4,
        };
        let good = sample().to_bytes();
        assert!(matches!(
            FrameHeader::decode(&good[..47], &limits),
            Err(WireError::Truncated {
                needed: 48,
                got: 47,
                ..
            })
        ));
        let mut b = good;
        b[0] = b'X';
        assert!(matches!(
            FrameHeader::decode(&b, &limits),
            Err(WireError::BadMagic { .. })
        ));
        let mut b = good;
        b[4] = 2;
        assert_eq!(
            FrameHeader::decode(&b, &limits),
            Err(WireError::UnsupportedVersion {
                found: 2,
                min: 1,
                max: 1
            })
        );
        let mut b = good;
        b[5] = 99;
        assert_eq!(
            FrameHeader::decode(&b, &limits),
            Err(WireError::UnknownKind { found: 99 })
        );
        let mut b = good;
        b[7] = 0x80;
        assert_eq!(
            FrameHeader::decode(&b, &limits),
            Err(WireError::ReservedFlags { bits: 0x8005 })
        );
        assert_eq!(
            FrameHeader::decode(&good, &limits),
            Err(WireError::MessageTooLarge { len: 5, max: 4 })
        );
        let mut b = good;
        b[40..48].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            FrameHeader::decode(&b, &Limits::default()),
            Err(WireError::MessageTooLarge { len: u64::MAX, .. })
        ));
    }

    #[test]
    fn encode_into_small_buffer_fails() {
        let mut small = [0u8; 47];
        assert!(matches!(
            sample().encode(&mut small),
            Err(WireError::BufferTooSmall { needed: 48, .. })
        ));
    }

    #[test]
    fn frame_round_trip_and_alignment() {
        assert_eq!(payload_offset() % PAYLOAD_ALIGN, 0);
        assert!(payload_offset() >= HEADER_LEN);
        let limits = Limits::default();
        let mut buf = [0xFFu8; 64];
        let n = encode_frame(&sample(), b"hello", &mut buf, &limits).unwrap();
        assert_eq!(n, payload_offset() + 5);
        let (h, p) = decode_frame(&buf[..n], &limits).unwrap();
        assert_eq!(p, b"hello");
        assert_eq!(h, sample());
        assert!(matches!(
            decode_frame(&buf[..n - 1], &limits),
            Err(WireError::LengthMismatch {
                declared: 5,
                actual: 4
            })
        ));
        assert!(matches!(
            encode_frame(&sample(), b"hello", &mut buf[..50], &limits),
            Err(WireError::BufferTooSmall { .. })
        ));
        assert!(matches!(
            frame_len(limits.max_message_size + 1, &limits),
            Err(WireError::MessageTooLarge { .. })
        ));
    }

    #[test]
    fn deadlines_as_ttl() {
        let now = Timestamp::from_nanos(1_000);
        let h = FrameHeader::new(FrameKind::Am).with_deadline(now, Timestamp::from_nanos(1_500));
        assert_eq!(h.ttl_ns, 500);
        assert_eq!(
            h.deadline_at(Timestamp::from_nanos(10)),
            Timestamp::from_nanos(510)
        );
        let past = FrameHeader::new(FrameKind::Am).with_deadline(now, Timestamp::from_nanos(1));
        assert_eq!(past.ttl_ns, 0);
        let none = FrameHeader::new(FrameKind::Am).with_deadline(now, Timestamp::MAX);
        assert_eq!(none.ttl_ns, NO_DEADLINE_TTL);
        assert_eq!(none.deadline_at(now), Timestamp::MAX);
        assert_eq!(ttl_duration(none.ttl_ns), None);
        assert_eq!(ttl_duration(5), Some(Duration::from_nanos(5)));
        // A huge but finite deadline never turns into "none".
        let far = FrameHeader::new(FrameKind::Am)
            .with_deadline(Timestamp::ZERO, Timestamp::from_nanos(u64::MAX - 1));
        assert_eq!(far.ttl_ns, u64::MAX - 1);
        assert_eq!(
            FrameHeader {
                ttl_ns: u64::MAX - 1,
                ..far
            }
            .deadline_at(Timestamp::from_nanos(5)),
            Timestamp::from_nanos(u64::MAX)
        );
    }

    #[test]
    fn kinds_round_trip() {
        for k in FrameKind::ALL {
            assert_eq!(FrameKind::from_u8(k as u8), Some(k));
            assert_eq!(k.is_control(), (k as u8) < 16);
        }
        assert_eq!(FrameKind::from_u8(0), None);
        assert!(FrameKind::Hello.is_handshake());
        assert!(!FrameKind::Heartbeat.is_handshake());
        for k in [FrameKind::Join, FrameKind::Joined] {
            assert!(k.is_handshake() && k.is_control(), "{k:?}");
        }
        assert_eq!(FrameKind::from_u8(8), Some(FrameKind::Join));
        assert_eq!(FrameKind::from_u8(9), Some(FrameKind::Joined));
        assert_eq!(FrameKind::from_u8(10), None);
        assert!(FrameFlags::ALL.contains(FrameFlags::ONE_WAY));
        assert_eq!(FrameFlags::from_bits(8), None);
    }

    #[test]
    fn tag_layout() {
        let t = Tag::new(TagKind::Stream, ShardId::new(0xABC), 0x1234_5678_9ABC).unwrap();
        assert_eq!(t.raw(), 0x2ABC_1234_5678_9ABC);
        assert_eq!(t.kind(), TagKind::Stream);
        assert_eq!(t.source_shard(), ShardId::new(0xABC));
        assert_eq!(t.user(), 0x1234_5678_9ABC);
        assert_eq!(Tag::parse(t.raw()), Ok(t));
        assert_eq!(
            Tag::parse(0xF000_0000_0000_0000),
            Err(WireError::UnknownTagKind { found: 15 })
        );
        assert!(Tag::new(TagKind::User, ShardId::new(4096), 0).is_err());
        assert!(Tag::new(TagKind::User, ShardId::new(0), 1 << 48).is_err());
        let other_src = Tag::new(TagKind::Stream, ShardId::new(1), 0x1234_5678_9ABC).unwrap();
        assert!(other_src.matches(t, TagMask::ANY_SOURCE));
        assert!(!other_src.matches(t, TagMask::EXACT));
        let other_user = Tag::new(TagKind::Stream, ShardId::new(1), 7).unwrap();
        assert!(!other_user.matches(t, TagMask::ANY_SOURCE));
        assert!(other_user.matches(t, TagMask::ANY_SOURCE_ANY_USER));
        let other_kind = Tag::new(TagKind::User, ShardId::new(1), 7).unwrap();
        assert!(!other_kind.matches(t, TagMask::ANY_SOURCE_ANY_USER));
        assert_eq!(
            TagLayout::KIND_MASK | TagLayout::SHARD_MASK | TagLayout::USER_MASK,
            u64::MAX
        );
        assert_eq!(TagMask::from_raw(5).raw(), 5);
    }
}
