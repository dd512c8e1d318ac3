//! Entry points shared by the cargo-fuzz targets (`fuzz/`) and the corpus replay test.
//!
//! Each function takes arbitrary bytes, runs a decoder on them, and checks the decoder's
//! contract: a value or a typed error, never a panic, never an oversized length accepted, and
//! whatever decodes re-encodes to the same bytes. A violated contract panics (that is how a fuzzer
//! reports it); these functions are test support, not for production paths.

use crate::conn::{ConnConfig, Connection, Seeds, State};
use crate::handshake::{
    accept_join, Features, Handshake, HandshakeConfig, HandshakeMessage, JoinAttempt, PeerInfo,
    PreSharedKey, RejectReason, SessionSecret,
};
use crate::ids::{Generation, Incarnation, NodeId, RegionId, ShardId};
use crate::rails::{Rail, Rails};
use crate::region::{
    GetRequest, Permissions, PutRequest, RegionSpec, RegionTable, RmaError, RmaReply,
};
use crate::rpc::{decode_error, decode_request, encode_error, encode_request, REQUEST_PREFIX_LEN};
use crate::time::Timestamp;
use crate::wire::{decode_frame, payload_offset, FrameHeader, FrameKind, Limits, HEADER_LEN};

/// The limits the fuzz entry points decode with (64 KiB, so oversized lengths are easy to hit).
pub const FUZZ_LIMITS: Limits = Limits {
    max_message_size: 64 << 10,
};

/// Decodes `data` as a frame header, as a data header and as a whole frame; checks the
/// contract. Returns whether the whole frame decoded.
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
    // The same bytes as a data header (the payload as long as the input).
    if let Ok((node, h, used)) = FrameHeader::decode_data(data, data.len() as u64, &FUZZ_LIMITS) {
        assert!(used <= data.len(), "data header longer than its input");
        assert!(
            h.payload_len <= FUZZ_LIMITS.max_message_size,
            "oversized data length accepted"
        );
        let mut again = vec![0u8; h.data_header_len()];
        assert_eq!(h.encode_data(node, &mut again), Ok(used));
        assert_eq!(&again[..], &data[..used], "data header does not re-encode");
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

/// What [`handshake_outcome`] found in its input.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HandshakeOutcome {
    /// The input decoded as a frame carrying a handshake message.
    pub decoded: bool,
    /// [`join_server`] accepted it: a `Join` that a holder of [`FUZZ_SESSION_SECRET`] made for
    /// the fuzz session, on a rail to the server's shard.
    pub join_accepted: bool,
    /// The reason of the `Reject` [`join_server`] answered it with, if any.
    pub join_refused: Option<RejectReason>,
    /// [`join_client`] accepted it: the `Joined` answering its join.
    pub joined_accepted: bool,
}

/// The fuzz session's secret.
pub const FUZZ_SESSION_SECRET: [u8; 32] = [0x5e; 32];
/// The client node of the fuzz session (4 shards, incarnation 2; the node of the hello seeds).
pub const FUZZ_CLIENT: NodeId = NodeId::new(9);
/// The server node of the fuzz session (2 shards, incarnation 1).
pub const FUZZ_SERVER: NodeId = NodeId::new(1);
/// The rail of [`join_client`], from the client's side: its shard 2 to the server's shard 0.
pub const FUZZ_RAIL: Rail = Rail {
    local: ShardId::new(2),
    remote: ShardId::new(0),
};

fn fuzz_psk() -> Option<PreSharedKey> {
    PreSharedKey::new(b"fuzzing key, sixteen bytes or more").ok()
}

fn fuzz_seeds() -> Seeds {
    Seeds {
        rng: 1,
        nonce: [0x11; 32],
    }
}

/// The configuration of the fuzz session's client node on `shard`.
fn fuzz_client_cfg(psk: PreSharedKey, shard: ShardId) -> ConnConfig {
    let mut cfg = ConnConfig::new(HandshakeConfig::new(
        FUZZ_CLIENT,
        Incarnation::new(2),
        4,
        psk,
    ));
    cfg.local_shard = shard;
    cfg
}

/// The configuration of the fuzz session's server node on `shard`.
fn fuzz_server_cfg(psk: PreSharedKey, shard: ShardId) -> ConnConfig {
    let mut cfg = ConnConfig::new(HandshakeConfig::new(
        FUZZ_SERVER,
        Incarnation::new(1),
        2,
        psk,
    ));
    cfg.local_shard = shard;
    cfg
}

/// The fuzz session as the server knows it: the client node.
pub fn fuzz_client_peer() -> PeerInfo {
    PeerInfo {
        node_id: FUZZ_CLIENT,
        incarnation: Incarnation::new(2),
        shard_count: 4,
        features: Features::RAILS,
        version: 1,
    }
}

/// The fuzz session as the client knows it: the server node.
pub fn fuzz_server_peer() -> PeerInfo {
    PeerInfo {
        node_id: FUZZ_SERVER,
        incarnation: Incarnation::new(1),
        shard_count: 2,
        features: Features::RAILS,
        version: 1,
    }
}

/// A join server on the server's shard 0 (`FUZZ_RAIL.remote`) holding the fuzz session, at time
/// zero, before any frame. `None` only if the fixed fuzz key were too short.
pub fn join_server() -> Option<Connection> {
    let cfg = fuzz_server_cfg(fuzz_psk()?, FUZZ_RAIL.remote);
    let secret = SessionSecret::from_bytes(FUZZ_SESSION_SECRET);
    Some(Connection::join_server(
        Timestamp::ZERO,
        cfg,
        fuzz_client_peer(),
        secret,
        fuzz_seeds(),
    ))
}

/// A join client on [`FUZZ_RAIL`] of the fuzz session, connected at time zero: its `Join` is
/// queued (always the same: its nonce comes from fixed seeds).
pub fn join_client() -> Option<Connection> {
    let cfg = fuzz_client_cfg(fuzz_psk()?, FUZZ_RAIL.local);
    let secret = SessionSecret::from_bytes(FUZZ_SESSION_SECRET);
    let mut c = Connection::join_client(
        cfg,
        fuzz_server_peer(),
        secret,
        FUZZ_RAIL.remote,
        fuzz_seeds(),
    );
    // A fresh client connection is Idle, so connect cannot fail.
    let _ = c.connect(Timestamp::ZERO);
    Some(c)
}

/// Decodes `data` as a frame carrying a handshake message and checks the contract (see
/// [`handshake_outcome`]). Returns whether a handshake message decoded.
pub fn handshake(data: &[u8]) -> bool {
    handshake_outcome(data).decoded
}

/// Decodes `data` as a frame carrying a handshake message, checks the contract, and feeds the
/// message to a client and a server [`Handshake`] (which must not complete from one
/// unauthenticated message), to [`join_server`] and to [`join_client`]. The join server must
/// accept exactly the joins that a holder of the session secret makes for the session on one of
/// the server shard's rails, answer every frame back to its sender's shard, and nothing else;
/// the join client must accept exactly the `Joined` that answers its own join.
pub fn handshake_outcome(data: &[u8]) -> HandshakeOutcome {
    let mut outcome = HandshakeOutcome::default();
    let Ok((header, payload)) = decode_frame(data, &FUZZ_LIMITS) else {
        return outcome;
    };
    let Ok(msg) = HandshakeMessage::decode(header.kind, payload) else {
        return outcome;
    };
    outcome.decoded = true;
    let mut buf = [0u8; crate::handshake::MAX_HANDSHAKE_LEN];
    let n = msg.encode(&mut buf).unwrap_or(0);
    assert_eq!(&buf[..n], payload, "handshake message does not re-encode");
    let Some(psk) = fuzz_psk() else {
        return outcome;
    };
    let cfg = HandshakeConfig::new(NodeId::new(1), Incarnation::new(1), 4, psk.clone());
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
    let secret = SessionSecret::from_bytes(FUZZ_SESSION_SECRET);
    let now = Timestamp::ZERO;

    // The server side of a rail.
    if let Some(mut server) = join_server() {
        server.handle_frame(now, &header, payload);
        while let Some(t) = server.poll_transmit() {
            let bytes = t.to_vec();
            assert!(
                decode_frame(&bytes, &FUZZ_LIMITS).is_ok(),
                "reply does not decode"
            );
            assert_eq!(
                (t.header.src_shard, t.header.dst_shard),
                (FUZZ_RAIL.remote, header.src_shard),
                "reply not addressed back"
            );
            if let Ok(HandshakeMessage::Reject(r)) =
                HandshakeMessage::decode(t.header.kind, t.payload())
            {
                outcome.join_refused = Some(r.reason);
            }
        }
        outcome.join_accepted = server.state() == State::Ready;
        // The join a secret holder makes for the session, from the frame's source shard.
        let legitimate = match &msg {
            HandshakeMessage::Join(join) => {
                let rail = Rail {
                    local: header.src_shard,
                    remote: FUZZ_RAIL.remote,
                };
                let on_rail = Rails::new(4, 2).is_ok_and(|r| r.has_rail(rail.local, rail.remote));
                let made = JoinAttempt::new(
                    now,
                    &fuzz_client_cfg(psk.clone(), rail.local).handshake,
                    fuzz_server_peer(),
                    secret.clone(),
                    rail,
                    join.nonce,
                );
                on_rail && made.join() == join && header.dst_shard == FUZZ_RAIL.remote
            }
            _ => false,
        };
        assert_eq!(
            outcome.join_accepted, legitimate,
            "join server accepted a forged join, or refused a legitimate one"
        );
        if outcome.join_accepted {
            assert_eq!(server.peer(), Some(&fuzz_client_peer()));
            assert_eq!(server.remote_shard(), Some(header.src_shard));
        }
    }

    // The client side of a rail.
    if let Some(mut client) = join_client() {
        let own = match client
            .poll_transmit()
            .map(|t| HandshakeMessage::decode(t.header.kind, t.payload()))
        {
            Some(Ok(HandshakeMessage::Join(j))) => Some(j),
            _ => None,
        };
        client.handle_frame(now, &header, payload);
        outcome.joined_accepted = client.state() == State::Ready;
        let expected = own.and_then(|j| {
            let server_cfg = fuzz_server_cfg(psk, FUZZ_RAIL.remote).handshake;
            accept_join(
                &server_cfg,
                &fuzz_client_peer(),
                &secret,
                FUZZ_RAIL.mirror(),
                &j,
            )
            .ok()
        });
        let legitimate = matches!((&msg, expected), (HandshakeMessage::Joined(j), Some(e)) if *j == e)
            && (header.src_shard, header.dst_shard) == (FUZZ_RAIL.remote, FUZZ_RAIL.local);
        assert_eq!(
            outcome.joined_accepted, legitimate,
            "join client accepted a forged joined, or refused the right one"
        );
    }
    outcome
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

/// The argument type [`rpc`] validates request archives as: a string, a vector, an enum with
/// unit, tuple and struct variants, and an optional nested struct, so that validation walks
/// relative pointers, lengths, enum tags and an option.
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Sample {
    /// A string (inline when at most 8 bytes, out of line otherwise).
    pub name: String,
    /// A vector of integers.
    pub values: Vec<u64>,
    /// An enum.
    pub shape: Shape,
    /// An optional nested struct.
    pub inner: Option<Inner>,
}

pub use shape::{ArchivedShape, Shape, ShapeResolver};

mod shape {
    // rkyv 0.8's derive leaves the fields of a struct variant's resolver (`ShapeResolver::Named`)
    // undocumented, and a lint attribute on the enum does not reach the generated items, so the
    // lint is relaxed for this module alone; every item written here is still documented.
    #![allow(missing_docs)]

    /// The enum inside [`Sample`](super::Sample).
    #[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
    pub enum Shape {
        /// A unit variant.
        Empty,
        /// A tuple variant.
        Pair(
            /// An unsigned integer.
            u32,
            /// A signed integer.
            i64,
        ),
        /// A struct variant.
        Named {
            /// An integer.
            id: u16,
            /// A string.
            label: String,
        },
    }
}

/// The nested struct inside [`Sample`].
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Inner {
    /// A boolean (any byte but 0 or 1 is invalid).
    pub flag: bool,
    /// A vector of strings.
    pub tags: Vec<String>,
}

/// What [`rpc_outcome`] found in its input.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RpcOutcome {
    /// The input decoded as a request envelope.
    pub request: bool,
    /// The request's arguments validated as an archived [`Sample`].
    pub sample: bool,
    /// The input decoded as an error body.
    pub error: bool,
}

/// Decodes `data` as an RPC request payload and as an error payload, checks the contract, and
/// returns whether either decoded (see [`rpc_outcome`]).
pub fn rpc(data: &[u8]) -> bool {
    let outcome = rpc_outcome(data);
    outcome.request || outcome.error
}

/// Decodes `data` as an RPC request payload and, when that succeeds, validates its arguments
/// with `rkyv::access` as an archived [`Sample`] (after copying them into an aligned buffer, as
/// a receiver must when the payload is not 16-aligned); decodes `data` as an error payload too.
/// Whatever decodes must re-encode to the same bytes, and a validated sample must deserialize
/// and survive a serialize / access / deserialize round trip.
pub fn rpc_outcome(data: &[u8]) -> RpcOutcome {
    let mut outcome = RpcOutcome::default();
    if let Ok(env) = decode_request(data) {
        outcome.request = true;
        assert_eq!(REQUEST_PREFIX_LEN + env.args.len(), data.len());
        assert_eq!(
            encode_request(env.schema, env.flags, env.args),
            data,
            "request does not re-encode"
        );
        let mut aligned = rkyv::util::AlignedVec::<16>::with_capacity(env.args.len());
        aligned.extend_from_slice(env.args);
        if let Ok(archived) = rkyv::access::<ArchivedSample, rkyv::rancor::Error>(&aligned) {
            outcome.sample = true;
            let sample = rkyv::deserialize::<Sample, rkyv::rancor::Error>(archived)
                .unwrap_or_else(|e| panic!("validated archive does not deserialize: {e}"));
            let bytes = rkyv::to_bytes::<rkyv::rancor::Error>(&sample)
                .unwrap_or_else(|e| panic!("sample does not serialize: {e}"));
            let again = rkyv::from_bytes::<Sample, rkyv::rancor::Error>(&bytes)
                .unwrap_or_else(|e| panic!("re-serialized sample does not validate: {e}"));
            assert_eq!(again, sample, "sample does not round-trip");
        }
    }
    if let Ok(body) = decode_error(data) {
        outcome.error = true;
        assert_eq!(
            encode_error(body.code, body.detail, body.message),
            data,
            "error body does not re-encode"
        );
    }
    outcome
}
