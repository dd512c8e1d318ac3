//! The collective message header.
//!
//! Between nodes a collective message is one active message [`COLLECTIVE_AM`] whose AM header
//! is [`HEADER_LEN`] bytes, little-endian:
//!
//! ```text
//!  0  u8   magic 0xC5
//!  1  u8   kind: 1 data, 2 abort
//!  2  u8   abort cause (abort only; `AbortCause`'s wire value)
//!  3  u8   reserved, zero
//!  4  u32  sending rank
//!  8  u64  communicator id
//! 16  u64  sequence number of the operation on that communicator
//! 24  u32  step within the operation
//! 28  u32  reserved, zero
//! 32  u64  total length of the message's data
//! 40  u64  offset of this part's data in it
//! ```
//!
//! and whose payload is one part of the data: data longer than [`SEGMENT`] goes as several
//! parts, put back together by offset on the receiving shard (so a message never meets the
//! connection's size limit, and parts may arrive in any order). Between shards of one node the
//! same header travels, decoded, with the whole data through the cross-shard mesh.
//!
//! A message is identified by (communicator id, sequence number, sending rank, step): nothing
//! is derived by arithmetic that could wrap, so consecutive collectives on a communicator, and
//! collectives on different communicators, never take each other's messages.

use shardcx_shards::proto::AmId;
use shardcx_shards::tag::FIRST_RESERVED_AM_ID;

use super::error::AbortCause;

/// The active-message id of collective messages, in the runtime's reserved range (the tag
/// layer has the first id of it).
pub const COLLECTIVE_AM: AmId = AmId::new(FIRST_RESERVED_AM_ID + 0x10);

/// Bytes of the header.
pub const HEADER_LEN: usize = 48;

/// Largest part of a message sent between nodes in one frame.
pub const SEGMENT: usize = 4 << 20;

const MAGIC: u8 = 0xC5;

/// What a message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Data of one step of an operation.
    Data,
    /// The sender ended the operation with this cause.
    Abort(AbortCause),
}

/// A decoded header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) kind: Kind,
    pub(crate) src: u32,
    pub(crate) comm: u64,
    pub(crate) seq: u64,
    pub(crate) step: u32,
    pub(crate) total: u64,
    pub(crate) offset: u64,
}

impl Header {
    pub(crate) fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = MAGIC;
        match self.kind {
            Kind::Data => b[1] = 1,
            Kind::Abort(c) => {
                b[1] = 2;
                b[2] = c.to_wire();
            }
        }
        b[4..8].copy_from_slice(&self.src.to_le_bytes());
        b[8..16].copy_from_slice(&self.comm.to_le_bytes());
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b[24..28].copy_from_slice(&self.step.to_le_bytes());
        b[32..40].copy_from_slice(&self.total.to_le_bytes());
        b[40..48].copy_from_slice(&self.offset.to_le_bytes());
        b
    }

    /// The header in `b`, or `None` when it is not one (length, magic, kind).
    pub(crate) fn decode(b: &[u8]) -> Option<Header> {
        if b.len() != HEADER_LEN || b[0] != MAGIC {
            return None;
        }
        let u32_at = |i: usize| {
            b.get(i..i + 4)
                .and_then(|s| s.try_into().ok())
                .map(u32::from_le_bytes)
        };
        let u64_at = |i: usize| {
            b.get(i..i + 8)
                .and_then(|s| s.try_into().ok())
                .map(u64::from_le_bytes)
        };
        let kind = match b[1] {
            1 => Kind::Data,
            2 => Kind::Abort(AbortCause::from_wire(b[2])),
            _ => return None,
        };
        Some(Header {
            kind,
            src: u32_at(4)?,
            comm: u64_at(8)?,
            seq: u64_at(16)?,
            step: u32_at(24)?,
            total: u64_at(32)?,
            offset: u64_at(40)?,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_garbage_is_refused() {
        let h = Header {
            kind: Kind::Abort(AbortCause::Cancelled),
            src: 7,
            comm: u64::MAX - 3,
            seq: 1 << 40,
            step: 0x0100_0002,
            total: 16 << 20,
            offset: 4 << 20,
        };
        let b = h.encode();
        assert_eq!(Header::decode(&b), Some(h));
        assert_eq!(Header::decode(&b[..47]), None);
        let mut bad = b;
        bad[0] = 0;
        assert_eq!(Header::decode(&bad), None);
        bad = b;
        bad[1] = 9;
        assert_eq!(Header::decode(&bad), None);
        bad = b;
        bad[2] = 200;
        assert_eq!(
            Header::decode(&bad).map(|h| h.kind),
            Some(Kind::Abort(AbortCause::Other))
        );
    }
}
