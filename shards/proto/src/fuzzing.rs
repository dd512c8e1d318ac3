//! Entry points shared by the cargo-fuzz targets (`fuzz/`) and the corpus replay test.
//!
//! Each function takes arbitrary bytes, runs a decoder on them, and checks the decoder's
//! contract: a value or a typed error, never a panic, never an oversized length accepted, and
//! whatever decodes re-encodes to the same bytes. A violated contract panics (that is how a fuzzer
//! reports it); these functions are test support, not for production paths.

use crate::handshake::{Handshake, HandshakeConfig, HandshakeMessage, PreSharedKey};
use crate::ids::{Generation, Incarnation, NodeId, RegionId};
use crate::region::{
    GetRequest, Permissions, PutRequest, RegionSpec, RegionTable, RmaError, RmaReply,
};
use crate::time::Timestamp;
use crate::wire::{decode_frame, payload_offset, FrameHeader, FrameKind, Limits, HEADER_LEN};

/// The limits the fuzz entry points decode with (64 KiB, so oversized lengths are easy to hit).
pub const FUZZ_LIMITS: Limits = Limits {
    max_message_size: 64 << 10,
};

/// Decodes `data` as a frame header and as a whole frame; checks the contract. Returns whether
/// the whole frame decoded.
pub fn frame(data: &[u8]) -> bool {
    if let Ok(h) = FrameHeader::decode(data, &FUZZ_LIMITS) {
        assert!(
            h.payload_len <= FUZZ_LIMITS.max_message_size,
            "oversized length accepted"
        );
        assert_eq!(
            &h.to_bytes()[..],
            &data[..HEADER_LEN],
            "header does not re-encode"
        );
    }
    match decode_frame(data, &FUZZ_LIMITS) {
        Ok((h, payload)) => {
            assert_eq!(payload.len() as u64, h.payload_len);
            assert_eq!(data.len(), payload_offset() + payload.len());
            true
        }
        Err(_) => false,
    }
}

/// Decodes `data` as a frame carrying a handshake message, checks the contract, and feeds the
/// message to a client and a server [`Handshake`]. Returns whether a handshake message decoded.
pub fn handshake(data: &[u8]) -> bool {
    let Ok((header, payload)) = decode_frame(data, &FUZZ_LIMITS) else {
        return false;
    };
    let Ok(msg) = HandshakeMessage::decode(header.kind, payload) else {
        return false;
    };
    let mut buf = [0u8; crate::handshake::MAX_HANDSHAKE_LEN];
    let n = msg.encode(&mut buf).unwrap_or(0);
    assert_eq!(&buf[..n], payload, "handshake message does not re-encode");
    let Ok(psk) = PreSharedKey::new(b"fuzzing key, sixteen bytes or more") else {
        return true;
    };
    let cfg = HandshakeConfig::new(NodeId::new(1), Incarnation::new(1), 4, psk);
    let now = Timestamp::ZERO;
    for mut hs in [
        Handshake::client(now, cfg.clone(), [7; 32]),
        Handshake::server(now, cfg.clone(), [8; 32]),
    ] {
        hs.handle_message(now, &msg);
        while let Some(out) = hs.poll_transmit() {
            let mut b = [0u8; crate::handshake::MAX_HANDSHAKE_LEN];
            assert!(out.encode(&mut b).is_ok());
        }
        // A forged message never completes a handshake: that needs the key.
        if let Some(Ok(_)) = hs.outcome() {
            panic!("handshake completed from a single unauthenticated message");
        }
    }
    true
}

/// The node [`rma`] checks requests as (the grantee of [`rma_table`]'s second region).
pub const FUZZ_REQUESTER: NodeId = NodeId::new(1);

/// The region table [`rma`] checks requests against: region 1 (64 bytes, read-write, any node,
/// generation 1) and region 2 (16 bytes, read-only, granted to [`FUZZ_REQUESTER`], generation 2).
pub fn rma_table() -> RegionTable {
    let mut table = RegionTable::starting_at(Generation::new(1));
    for (len, permissions, grantee) in [
        (64, Permissions::READ_WRITE, None),
        (16, Permissions::READ, Some(FUZZ_REQUESTER)),
    ] {
        // Two registrations in a fresh table cannot exhaust ids or generations.
        let _ = table.register(RegionSpec {
            len,
            permissions,
            grantee,
            handle: len,
        });
    }
    table
}

/// Decodes `data` as a frame carrying an RMA payload (put, get or reply), checks the contract,
/// and runs decoded requests through [`rma_table`]'s checks, which must return a range inside the
/// region or a refusal. Returns whether an RMA payload decoded.
pub fn rma(data: &[u8]) -> bool {
    let Ok((header, payload)) = decode_frame(data, &FUZZ_LIMITS) else {
        return false;
    };
    let table = rma_table();
    let region = RegionId::new(header.id);
    let checked = match header.kind {
        FrameKind::RmaPut => {
            let Ok(put) = PutRequest::decode(payload, &FUZZ_LIMITS) else {
                return false;
            };
            let mut buf = vec![0u8; payload.len()];
            assert_eq!(put.encode(&mut buf, &FUZZ_LIMITS), Ok(payload.len()));
            assert_eq!(buf, payload, "put request does not re-encode");
            table.check_put(FUZZ_REQUESTER, region, &put)
        }
        FrameKind::RmaGet => {
            let Ok(get) = GetRequest::decode(payload, &FUZZ_LIMITS) else {
                return false;
            };
            assert!(
                get.reply_len() <= FUZZ_LIMITS.max_message_size,
                "oversized get accepted"
            );
            assert_eq!(
                get.to_bytes(&FUZZ_LIMITS).ok().as_ref().map(|b| &b[..]),
                Some(payload)
            );
            table.check_get(FUZZ_REQUESTER, region, &get)
        }
        FrameKind::RmaReply => {
            let Ok(reply) = RmaReply::decode(payload, &FUZZ_LIMITS) else {
                return false;
            };
            let mut out = Vec::new();
            assert!(reply.encode_to_vec(&mut out, &FUZZ_LIMITS).is_ok());
            assert_eq!(out, payload, "reply does not re-encode");
            return true;
        }
        _ => return false,
    };
    match checked {
        Ok(range) => {
            let entry = table.get(region).map(|e| e.descriptor.len);
            let end = range.start.checked_add(range.len).map(|e| e as u64);
            assert!(
                end.is_some() && end <= entry,
                "check accepted a range outside the region"
            );
        }
        Err(RmaError::UnknownRegion { .. }) => assert!(table.get(region).is_none()),
        Err(_) => {}
    }
    true
}
