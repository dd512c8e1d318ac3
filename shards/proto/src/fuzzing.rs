//! Entry points shared by the cargo-fuzz targets (`fuzz/`) and the corpus replay test.
//!
//! Each function takes arbitrary bytes, runs a decoder on them, and checks the decoder's
//! contract: a value or a typed error, never a panic, never an oversized length accepted, and
//! whatever decodes re-encodes to the same bytes. A violated contract panics (that is how a fuzzer
//! reports it); these functions are test support, not for production paths.

use crate::handshake::{Handshake, HandshakeConfig, HandshakeMessage, PreSharedKey};
use crate::ids::{Incarnation, NodeId};
use crate::time::Timestamp;
use crate::wire::{decode_frame, payload_offset, FrameHeader, Limits, HEADER_LEN};

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
