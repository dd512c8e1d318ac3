//! Property tests (issue #3, item 9): round trips, and decoders that never panic on any input.

// Tests may unwrap: a panic is a test failure with a message.
#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use shardcx_proto::fuzzing::{self, Inner, RpcOutcome, Sample, Shape};
use shardcx_proto::handshake::{
    accept_join, Confirm, HandshakeError, HandshakeMessage, Hello, Join, JoinAttempt, Joined,
    Reject, RejectReason, Welcome,
};
use shardcx_proto::request::{CreditWindow, PendingTable};
use shardcx_proto::wire::{
    decode_frame, encode_frame, payload_offset, DataTemplate, DATA_HEADER_MAX, HEADER_LEN,
};
use shardcx_proto::{
    decode_error, decode_request, encode_error, encode_request, request_prefix, CallFlags,
    RequestEnvelope, RpcErrorCode, RpcWireError, MAX_ERROR_MESSAGE, REQUEST_PREFIX_LEN,
};
use shardcx_proto::{DedupKey, DedupVerdict, DedupWindow, PoolConfig, Rail, Rails, WireError};
use shardcx_proto::{
    Features, FrameFlags, FrameHeader, FrameKind, Incarnation, Limits, NodeId, ReqId, ShardId,
    SizeClassPool, Tag, TagKind, Timestamp,
};
use std::collections::HashSet;

fn kind() -> impl Strategy<Value = FrameKind> {
    prop::sample::select(FrameKind::ALL.to_vec())
}

fn header() -> impl Strategy<Value = FrameHeader> {
    (
        kind(),
        0u16..8,
        any::<u16>(),
        any::<u16>(),
        any::<u32>(),
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
        0u64..=1 << 24,
    )
        .prop_map(
            |(kind, flags, src, dst, id, req, inc, ttl, len)| FrameHeader {
                version: 1,
                kind,
                flags: FrameFlags::from_bits(flags).unwrap_or_default(),
                src_shard: ShardId::new(src),
                dst_shard: ShardId::new(dst),
                id,
                req_id: ReqId::new(req),
                incarnation: Incarnation::new(inc),
                ttl_ns: ttl,
                payload_len: len,
            },
        )
}

fn nonce() -> impl Strategy<Value = [u8; 32]> {
    prop::array::uniform32(any::<u8>())
}

fn handshake_message() -> impl Strategy<Value = HandshakeMessage> {
    prop_oneof![
        (
            any::<u8>(),
            any::<u8>(),
            any::<u16>(),
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            nonce()
        )
            .prop_map(|(a, b, s, n, i, f, nonce)| HandshakeMessage::Hello(Hello {
                min_version: a,
                max_version: b,
                shard_count: s,
                node_id: NodeId::new(n),
                incarnation: Incarnation::new(i),
                features: Features::from_bits_retain(f),
                nonce,
            })),
        (
            any::<u8>(),
            any::<u16>(),
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            nonce(),
            nonce(),
            nonce()
        )
            .prop_map(
                |(v, s, n, i, f, nonce, echo, proof)| HandshakeMessage::Welcome(Welcome {
                    version: v,
                    shard_count: s,
                    node_id: NodeId::new(n),
                    incarnation: Incarnation::new(i),
                    features: Features::from_bits_retain(f),
                    nonce,
                    echo,
                    proof,
                })
            ),
        (nonce(), nonce())
            .prop_map(|(echo, proof)| HandshakeMessage::Confirm(Confirm { echo, proof })),
        (1u8..=8, any::<u8>(), any::<u8>(), nonce()).prop_map(|(r, a, b, echo)| {
            HandshakeMessage::Reject(Reject {
                reason: RejectReason::from_u8(r),
                min_version: a,
                max_version: b,
                echo,
            })
        }),
        join().prop_map(HandshakeMessage::Join),
        (nonce(), nonce())
            .prop_map(|(echo, proof)| HandshakeMessage::Joined(Joined { echo, proof })),
    ]
}

fn join() -> impl Strategy<Value = Join> {
    (
        any::<u8>(),
        any::<u16>(),
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
        nonce(),
        nonce(),
    )
        .prop_map(|(v, s, n, i, si, nonce, proof)| Join {
            version: v,
            shard_count: s,
            node_id: NodeId::new(n),
            incarnation: Incarnation::new(i),
            server_incarnation: Incarnation::new(si),
            nonce,
            proof,
        })
}

proptest! {
    #[test]
    fn header_round_trips(h in header()) {
        let mut buf = [0u8; HEADER_LEN];
        prop_assert_eq!(h.encode(&mut buf), Ok(HEADER_LEN));
        let limits = Limits { max_message_size: 1 << 24 };
        prop_assert_eq!(FrameHeader::decode(&buf, &limits), Ok(h));
    }

    /// A connection's data-header template writes what the header's own encoder writes, for
    /// every kind, id, flag set, request id and deadline (present or not).
    #[test]
    fn data_template_writes_what_encode_data_writes(
        h in header(),
        node in any::<u64>(),
        req in prop_oneof![Just(0u64), any::<u64>()],
        ttl in prop_oneof![Just(u64::MAX), any::<u64>()],
    ) {
        let h = FrameHeader { req_id: ReqId::new(req), ttl_ns: ttl, ..h };
        let node = NodeId::new(node);
        let mut want = [0u8; DATA_HEADER_MAX];
        let n = h.encode_data(node, &mut want).unwrap();
        // The template keeps none of the frame's own fields: made from another kind and id.
        let base = FrameHeader { kind: FrameKind::Heartbeat, id: !h.id, req_id: ReqId::new(3), ..h };
        let t = DataTemplate::new(node, &base);
        prop_assert_eq!(t.dst_shard(), h.dst_shard);
        let mut got = [0xA5u8; DATA_HEADER_MAX];
        let m = t.write(&mut got, (h.kind, h.id, h.flags), h.req_id, h.ttl_ns);
        prop_assert_eq!(m, n);
        prop_assert_eq!(&got[..m], &want[..n]);

    }

    #[test]
    fn frame_round_trips(h in header(), payload in prop::collection::vec(any::<u8>(), 0..512)) {
        let limits = Limits::default();
        let mut buf = vec![0u8; payload_offset() + payload.len()];
        let n = encode_frame(&h, &payload, &mut buf, &limits).unwrap();
        let (h2, p2) = decode_frame(&buf[..n], &limits).unwrap();
        prop_assert_eq!(p2, &payload[..]);
        prop_assert_eq!(h2, FrameHeader { payload_len: payload.len() as u64, ..h });
    }

    #[test]
    fn header_decoder_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..128), max in any::<u64>()) {
        let limits = Limits { max_message_size: max };
        match FrameHeader::decode(&bytes, &limits) {
            Ok(h) => {
                prop_assert!(h.payload_len <= max);
                prop_assert!(bytes.len() >= HEADER_LEN);
                prop_assert_eq!(&h.to_bytes()[..], &bytes[..HEADER_LEN]);
            }
            Err(WireError::Truncated { .. }) => prop_assert!(bytes.len() < HEADER_LEN),
            Err(_) => {}
        }
        let _ = decode_frame(&bytes, &limits);
    }

    #[test]
    fn mutated_valid_header_never_panics(h in header(), pos in 0usize..HEADER_LEN, byte in any::<u8>()) {
        let mut b = h.to_bytes();
        b[pos] = byte;
        let _ = FrameHeader::decode(&b, &Limits::default());
    }

    #[test]
    fn handshake_round_trips(m in handshake_message()) {
        let mut buf = [0u8; 128];
        let n = m.encode(&mut buf).unwrap();
        prop_assert_eq!(HandshakeMessage::decode(m.kind(), &buf[..n]), Ok(m));
    }

    /// Every proper prefix of an encoded message, and the message with a byte more, is refused
    /// as a bad length (for its own kind).
    #[test]
    fn handshake_truncations_are_refused(m in handshake_message(), extra in any::<u8>()) {
        let mut buf = [0u8; 129];
        let n = m.encode(&mut buf).unwrap();
        for cut in 0..n {
            let got = HandshakeMessage::decode(m.kind(), &buf[..cut]);
            let refused = matches!(got, Err(HandshakeError::BadLength { expected, got, .. }) if expected == n && got == cut);
            prop_assert!(refused, "{:?} cut at {}: {:?}", m.kind(), cut, got);
        }
        buf[n] = extra;
        let longer = HandshakeMessage::decode(m.kind(), &buf[..n + 1]);
        prop_assert!(matches!(longer, Err(HandshakeError::BadLength { .. })), "{longer:?}");
    }

    #[test]
    fn handshake_decoder_never_panics(k in kind(), bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        if let Ok(m) = HandshakeMessage::decode(k, &bytes) {
            prop_assert_eq!(m.kind(), k);
            prop_assert_eq!(m.encoded_len(), bytes.len());
        }
    }

    #[test]
    fn tag_round_trips(k in 0u8..4, shard in 0u16..4096, user in 0u64..(1 << 48)) {
        let kind = match k { 0 => TagKind::User, 1 => TagKind::RndvData, 2 => TagKind::Stream, _ => TagKind::Control };
        let t = Tag::new(kind, ShardId::new(shard), user).unwrap();
        prop_assert_eq!(Tag::parse(t.raw()), Ok(t));
        prop_assert_eq!((t.kind(), t.source_shard().get(), t.user()), (kind, shard, user));
    }

    #[test]
    fn tag_parse_never_panics(raw in any::<u64>()) {
        if let Ok(t) = Tag::parse(raw) {
            prop_assert_eq!(t.raw(), raw);
        }
    }

    /// Complete, cancel and expire race in any order: every request ends exactly once.
    #[test]
    fn pending_exactly_once(ops in prop::collection::vec((0u8..4, 0u64..40, 0u64..100), 1..200)) {
        let mut table = PendingTable::new();
        let mut ids = Vec::new();
        let mut finished = HashSet::new();
        let mut now = Timestamp::ZERO;
        for (op, pick, t) in ops {
            match op {
                0 => {
                    let deadline = if t == 99 { Timestamp::MAX } else { Timestamp::from_nanos(now.as_nanos() + t) };
                    let id = table.insert(deadline, ids.len());
                    ids.push(id);
                }
                1 | 2 if !ids.is_empty() => {
                    let id = ids[(pick as usize) % ids.len()];
                    let got = if op == 1 { table.complete(id) } else { table.cancel(id) };
                    if let Some(v) = got {
                        prop_assert!(finished.insert(v), "finished twice");
                    }
                }
                _ => {
                    now = Timestamp::from_nanos(now.as_nanos() + t);
                    while let Some((id, v)) = table.poll_expired(now) {
                        prop_assert_eq!(ids[v], id);
                        prop_assert!(table.deadline(id).is_none());
                        prop_assert!(finished.insert(v), "finished twice");
                    }
                    if let Some(next) = table.poll_timeout() {
                        prop_assert!(next > now);
                    }
                }
            }
        }
        for (_, v) in table.drain() {
            prop_assert!(finished.insert(v), "finished twice");
        }
        prop_assert_eq!(finished.len(), ids.len());
    }

    /// Against a model (a map of live deadlines): whatever the order of deadlines (mostly
    /// increasing, as one timeout gives, sometimes earlier, sometimes never) and of answers,
    /// `poll_expired` returns exactly the live requests due by `now`, and `poll_timeout` the
    /// earliest live finite deadline.
    #[test]
    fn pending_expires_what_is_due(
        preload in 0usize..600,
        ops in prop::collection::vec((0u8..6, 0u64..64, 0u64..50), 1..300),
    ) {
        let mut table = PendingTable::new();
        let mut model: std::collections::BTreeMap<u64, Timestamp> = Default::default();
        let mut ids = Vec::new();
        let mut now = Timestamp::ZERO;
        // Requests entered first, many of them pending long (past the table's ring of 256
        // slots: later ones find their slot taken): every other one never due, the rest due
        // early, in order (the queue), and with an odd count the last one due very late (its
        // deadline at the queue's back sends the later ones to the heap).
        for i in 0..preload {
            let deadline = match i {
                _ if i % 2 == 0 => Timestamp::MAX,
                _ if preload % 2 == 1 && i + 2 >= preload => Timestamp::from_nanos(1 << 40),
                _ => Timestamp::from_nanos(100 + i as u64),
            };
            let id = table.insert(deadline, ids.len());
            model.insert(id.get(), deadline);
            ids.push(id);
        }
        for (op, pick, t) in ops {
            match op {
                // Mostly a deadline at or after the last (one timeout), some earlier, some never.
                0..=2 => {
                    let deadline = match op {
                        0 | 1 => Timestamp::from_nanos(now.as_nanos() + 100 + t),
                        _ if t % 5 == 0 => Timestamp::MAX,
                        _ => Timestamp::from_nanos(now.as_nanos() + t),
                    };
                    let id = table.insert(deadline, ids.len());
                    model.insert(id.get(), deadline);
                    ids.push(id);
                }
                // Answers: the oldest one (in order) or any.
                3 | 4 if !ids.is_empty() => {
                    let id = match (op, model.keys().next()) {
                        (3, Some(&oldest)) => ReqId::new(oldest),
                        _ => ids[(pick as usize) % ids.len()],
                    };
                    let got = table.complete(id).is_some();
                    prop_assert_eq!(got, model.remove(&id.get()).is_some());
                }
                _ => {
                    now = Timestamp::from_nanos(now.as_nanos() + t * 4);
                    let mut expired = Vec::new();
                    let mut last = None;
                    while let Some((id, v)) = table.poll_expired(now) {
                        prop_assert_eq!(ids[v], id);
                        // Earliest deadline first (ties by id).
                        let at = (model[&id.get()], id.get());
                        prop_assert!(last.is_none_or(|l| l <= at), "{:?} after {:?}", at, last);
                        last = Some(at);
                        expired.push(id.get());
                    }
                    expired.sort_unstable();
                    let due: Vec<u64> = model.iter().filter(|(_, d)| **d <= now).map(|(id, _)| *id).collect();
                    prop_assert_eq!(&expired, &due);
                    model.retain(|_, d| *d > now);
                }
            }
            // Not after every step: skipped entries are also left to pile up.
            if pick % 4 == 0 {
                let earliest = model.values().filter(|d| !d.is_never()).min().copied();
                prop_assert_eq!(table.poll_timeout(), earliest);
            }
            prop_assert_eq!(table.len(), model.len());
        }
        // Whatever is left comes out once, in id order, with what `get` saw.
        let left: Vec<u64> = model.keys().copied().collect();
        for &id in &left {
            prop_assert_eq!(table.get(ReqId::new(id)).map(|v| ids[*v].get()), Some(id));
        }
        let drained: Vec<u64> = table.drain().into_iter().map(|(id, _)| id.get()).collect();
        prop_assert_eq!(drained, left);
        prop_assert!(table.is_empty());
    }

    #[test]
    fn credits_never_exceed_window(window in 0u64..10_000, ops in prop::collection::vec((any::<bool>(), 0u64..4_000), 0..200)) {
        let mut c = CreditWindow::new(window);
        let mut held: Vec<u64> = Vec::new();
        for (acquire, n) in ops {
            if acquire {
                if c.try_acquire(n).is_ok() {
                    held.push(n);
                }
            } else if let Some(n) = held.pop() {
                prop_assert!(c.release(n).is_ok());
            }
            prop_assert!(c.in_flight() <= window);
            prop_assert_eq!(c.in_flight(), held.iter().sum::<u64>());
        }
    }

    #[test]
    fn pool_blocks_never_overlap(ops in prop::collection::vec((any::<bool>(), 1u64..20_000, any::<usize>()), 0..300)) {
        let mut pool = SizeClassPool::new(PoolConfig { arena_len: 100_000, min_class: 64, max_class: 16_384 }).unwrap();
        let initial_free = pool.stats().bytes_free;
        let mut live = Vec::new();
        for (alloc, len, pick) in ops {
            if alloc {
                if let Some(b) = pool.alloc(len) {
                    prop_assert!(b.len >= len.max(64));
                    prop_assert_eq!(b.offset % b.len, 0);
                    prop_assert!(b.offset + b.len <= 100_000);
                    for other in &live {
                        let o: &shardcx_proto::Block = other;
                        prop_assert!(b.offset + b.len <= o.offset || o.offset + o.len <= b.offset);
                    }
                    live.push(b);
                }
            } else if !live.is_empty() {
                let b = live.swap_remove(pick % live.len());
                prop_assert!(pool.free(b).is_ok());
                prop_assert!(pool.free(b).is_err());
            }
            let s = pool.stats();
            prop_assert_eq!(s.bytes_in_use + s.bytes_free, initial_free);
        }
        for b in live {
            pool.free(b).unwrap();
        }
        prop_assert_eq!(pool.stats().bytes_free, initial_free);
        prop_assert_eq!(pool.stats().bytes_in_use, 0);
    }
}

fn call_flags() -> impl Strategy<Value = CallFlags> {
    (0u32..4).prop_map(|bits| CallFlags::from_bits(bits).unwrap())
}

fn error_code() -> impl Strategy<Value = RpcErrorCode> {
    prop::sample::select(RpcErrorCode::ALL.to_vec())
}

fn sample() -> impl Strategy<Value = Sample> {
    let shape = prop_oneof![
        Just(Shape::Empty),
        (any::<u32>(), any::<i64>()).prop_map(|(a, b)| Shape::Pair(a, b)),
        (any::<u16>(), ".{0,20}").prop_map(|(id, label)| Shape::Named { id, label }),
    ];
    let inner = prop::option::of(
        (any::<bool>(), prop::collection::vec(".{0,12}", 0..4))
            .prop_map(|(flag, tags)| Inner { flag, tags }),
    );
    (
        ".{0,24}",
        prop::collection::vec(any::<u64>(), 0..8),
        shape,
        inner,
    )
        .prop_map(|(name, values, shape, inner)| Sample {
            name,
            values,
            shape,
            inner,
        })
}

proptest! {
    #[test]
    fn rpc_request_round_trips(schema in any::<u64>(), flags in call_flags(), args in prop::collection::vec(any::<u8>(), 0..256)) {
        let payload = encode_request(schema, flags, &args);
        prop_assert_eq!(&payload[..REQUEST_PREFIX_LEN], &request_prefix(schema, flags)[..]);
        let env = decode_request(&payload).unwrap();
        prop_assert_eq!(env, RequestEnvelope { schema, flags, args: &args });
    }

    #[test]
    fn rpc_request_decoder_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
        match decode_request(&bytes) {
            Ok(env) => {
                prop_assert_eq!(env.args, &bytes[REQUEST_PREFIX_LEN..]);
                prop_assert!(CallFlags::from_bits(env.flags.bits()).is_some());
                prop_assert_eq!(encode_request(env.schema, env.flags, env.args), bytes);
            }
            Err(RpcWireError::Truncated { need, got }) => {
                prop_assert_eq!((need, got), (REQUEST_PREFIX_LEN, bytes.len()));
            }
            Err(RpcWireError::UnknownFlags(bits)) => prop_assert!(bits > 3),
            Err(e) => prop_assert_eq!(e, RpcWireError::ReservedNonZero),
        }
    }

    #[test]
    fn rpc_error_round_trips(code in error_code(), detail in any::<u64>(), message in ".{0,64}", long in 0usize..3) {
        // `long` > 0 makes the message exceed the limit (by 1 or 2 repetitions of itself).
        let message = if long == 0 {
            message
        } else {
            format!("{}{}", "é".repeat(MAX_ERROR_MESSAGE / 2), message.repeat(long))
        };
        let payload = encode_error(code, detail, &message);
        let body = decode_error(&payload).unwrap();
        prop_assert_eq!(body.code, code);
        prop_assert_eq!(body.detail, detail);
        prop_assert!(body.message.len() <= MAX_ERROR_MESSAGE);
        prop_assert!(message.starts_with(body.message));
        prop_assert!(body.message.len() == message.len() || body.message.len() + 4 > MAX_ERROR_MESSAGE);
    }

    #[test]
    fn rpc_error_decoder_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..64), len in 0u32..70) {
        // Half the inputs get a plausible message length, so later checks are reached.
        let mut bytes = bytes;
        if bytes.len() >= 8 && len % 2 == 0 {
            bytes[2..4].fill(0);
            bytes[4..8].copy_from_slice(&len.to_le_bytes());
        }
        if let Ok(body) = decode_error(&bytes) {
            prop_assert_eq!(encode_error(body.code, body.detail, body.message), bytes);
        }
    }

    #[test]
    fn rpc_sample_travels_in_a_request(s in sample(), schema in any::<u64>(), flags in call_flags()) {
        let args = rkyv::to_bytes::<rkyv::rancor::Error>(&s).unwrap();
        let payload = encode_request(schema, flags, &args);
        prop_assert_eq!(
            fuzzing::rpc_outcome(&payload),
            RpcOutcome { request: true, sample: true, error: false }
        );
        let env = decode_request(&payload).unwrap();
        // A Vec<u8> gives no alignment guarantee: copy the args to an aligned buffer, as a
        // receiver must when its payload is not 16-aligned.
        let mut aligned = rkyv::util::AlignedVec::<16>::new();
        aligned.extend_from_slice(env.args);
        let back = rkyv::from_bytes::<Sample, rkyv::rancor::Error>(&aligned).unwrap();
        prop_assert_eq!(back, s);
    }

    #[test]
    fn rpc_fuzz_entry_never_panics_on_mutated_requests(s in sample(), edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4), cut in any::<prop::sample::Index>()) {
        let args = rkyv::to_bytes::<rkyv::rancor::Error>(&s).unwrap();
        let mut payload = encode_request(1, CallFlags::NONE, &args);
        for (at, byte) in edits {
            let i = at.index(payload.len());
            payload[i] = byte;
        }
        let _ = fuzzing::rpc(&payload);
        let _ = fuzzing::rpc(&payload[..cut.index(payload.len() + 1)]);
    }

    #[test]
    fn rpc_fuzz_entry_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = fuzzing::rpc(&bytes);
    }
}

/// Shard counts: mostly small (where the interesting coincidences are), sometimes large.
fn shard_count() -> impl Strategy<Value = u16> {
    prop_oneof![4 => 1u16..=16, 1 => 1u16..=shardcx_proto::shard_map::MAX_SHARDS]
}

proptest! {
    /// The set node B computes (M, N) is node A's (N, M) with every pair mirrored.
    #[test]
    fn rails_are_symmetric(n in shard_count(), m in shard_count()) {
        let a = Rails::new(n, m).unwrap();
        let b = Rails::new(m, n).unwrap();
        prop_assert_eq!(a.mirror(), b);
        let mut ours: Vec<Rail> = a.iter().map(Rail::mirror).collect();
        let mut theirs: Vec<Rail> = b.iter().collect();
        ours.sort();
        theirs.sort();
        prop_assert_eq!(ours, theirs);
        for rail in a.iter() {
            prop_assert!(b.has_rail(rail.remote, rail.local));
        }
    }

    /// max(N, M) distinct rails, and every shard of either node is on at least one.
    #[test]
    fn rails_cover_every_shard(n in shard_count(), m in shard_count()) {
        let r = Rails::new(n, m).unwrap();
        let all: HashSet<Rail> = r.iter().collect();
        prop_assert_eq!(all.len(), usize::from(n.max(m)));
        prop_assert_eq!(r.len(), all.len());
        let locals: HashSet<u16> = all.iter().map(|x| x.local.get()).collect();
        let remotes: HashSet<u16> = all.iter().map(|x| x.remote.get()).collect();
        prop_assert_eq!(locals.len(), usize::from(n));
        prop_assert_eq!(remotes.len(), usize::from(m));
        for rail in &all {
            prop_assert!(rail.local.get() < n && rail.remote.get() < m);
            prop_assert!(r.has_rail(rail.local, rail.remote));
        }
    }

    /// The default rail of a local shard and the owner's rail to a remote shard are rails;
    /// remotes_of and locals_of list exactly the rails of a shard.
    #[test]
    fn default_and_owner_rails_exist(n in shard_count(), m in shard_count(), l in any::<u16>(), j in any::<u16>()) {
        let r = Rails::new(n, m).unwrap();
        let (l, j) = (ShardId::new(l % n), ShardId::new(j % m));
        prop_assert!(r.has_rail(l, r.default_remote(l)));
        prop_assert!(r.has_rail(r.owner_of_remote(j), j));
        prop_assert!(r.remotes_of(l).any(|x| x == r.default_remote(l)));
        prop_assert!(r.locals_of(j).any(|x| x == r.owner_of_remote(j)));
        let expected: Vec<ShardId> = r.iter().filter(|x| x.local == l).map(|x| x.remote).collect();
        let mut listed: Vec<ShardId> = r.remotes_of(l).collect();
        prop_assert!(listed.windows(2).all(|w| w[0] < w[1]), "increasing");
        listed.sort();
        let mut expected = expected;
        expected.sort();
        prop_assert_eq!(listed, expected);
        prop_assert_eq!(r.has_rail(l, j), r.iter().any(|x| x.local == l && x.remote == j));
    }

    /// With equal shard counts, local shard i's default rail is remote shard i, on both sides.
    #[test]
    fn equal_counts_pair_same_index(n in shard_count(), i in any::<u16>()) {
        let r = Rails::new(n, n).unwrap();
        let i = ShardId::new(i % n);
        prop_assert_eq!(r.default_remote(i), i);
        prop_assert_eq!(r.mirror().default_remote(i), i);
        prop_assert_eq!(r.owner_of_remote(i), i);
        prop_assert_eq!(r.remotes_of(i).collect::<Vec<_>>(), vec![i]);
    }
}

proptest! {
    /// Over random shard counts, rails and secrets: a join verifies on its own rail and its
    /// Joined completes the client; the same join on another rail, under another secret, or
    /// with any byte of its proof changed, is refused.
    #[test]
    fn joins_verify_only_on_their_rail_and_secret(
        n in 1u16..=8,
        m in 1u16..=8,
        k in any::<prop::sample::Index>(),
        other in any::<prop::sample::Index>(),
        secret_bytes in nonce(),
        flip in (0usize..32, 1u8..=255),
        nonce_c in nonce(),
    ) {
        use shardcx_proto::{HandshakeConfig, PeerInfo, PreSharedKey, SessionSecret};
        let psk = PreSharedKey::new(&[1; 32]).unwrap();
        let client_cfg = HandshakeConfig::new(NodeId::new(1), Incarnation::new(10), n, psk.clone());
        let server_cfg = HandshakeConfig::new(NodeId::new(2), Incarnation::new(20), m, psk);
        let server = PeerInfo { node_id: NodeId::new(2), incarnation: Incarnation::new(20), shard_count: m, features: Features::RAILS, version: 1 };
        let client = PeerInfo { node_id: NodeId::new(1), incarnation: Incarnation::new(10), shard_count: n, features: Features::RAILS, version: 1 };
        let secret = SessionSecret::from_bytes(secret_bytes);
        let rails: Vec<Rail> = Rails::new(n, m).unwrap().iter().collect();
        let r = rails[k.index(rails.len())];
        let now = Timestamp::ZERO;
        let mut attempt = JoinAttempt::new(now, &client_cfg, server, secret.clone(), r, nonce_c);
        let Some(HandshakeMessage::Join(join)) = attempt.poll_transmit() else {
            return Err(TestCaseError::fail("no join sent"));
        };
        let joined = accept_join(&server_cfg, &client, &secret, r.mirror(), &join).unwrap();
        attempt.handle_message(now, &HandshakeMessage::Joined(joined));
        prop_assert_eq!(attempt.outcome(), Some(&Ok(server)));
        let o = rails[other.index(rails.len())];
        if o != r {
            prop_assert_eq!(accept_join(&server_cfg, &client, &secret, o.mirror(), &join), Err(HandshakeError::BadProof));
        }
        let tampered = Join { proof: flipped(&join.proof, flip), ..join };
        prop_assert_eq!(accept_join(&server_cfg, &client, &secret, r.mirror(), &tampered), Err(HandshakeError::BadProof));
        let other_secret = SessionSecret::from_bytes(flipped(&secret_bytes, flip));
        prop_assert_eq!(accept_join(&server_cfg, &client, &other_secret, r.mirror(), &join), Err(HandshakeError::BadProof));
        // A tampered joined does not complete a second attempt.
        let mut again = JoinAttempt::new(now, &client_cfg, server, secret.clone(), r, nonce_c);
        let bad = Joined { proof: flipped(&joined.proof, flip), ..joined };
        again.handle_message(now, &HandshakeMessage::Joined(bad));
        prop_assert_eq!(again.outcome(), Some(&Err(HandshakeError::BadProof)));
    }
}

/// `bytes` with byte `flip.0` xored with `flip.1` (non-zero).
fn flipped(bytes: &[u8; 32], flip: (usize, u8)) -> [u8; 32] {
    let mut out = *bytes;
    out[flip.0] ^= flip.1;
    out
}

proptest! {
    /// The handshake fuzz entry (and its join oracle: a join or joined is accepted exactly when
    /// it is the legitimate one) on the fuzz join client's join and the server's joined, with a
    /// few bytes changed and cut anywhere.
    #[test]
    fn handshake_fuzz_entry_holds_on_mutated_joins(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        cut in any::<prop::sample::Index>(),
        joined in any::<bool>(),
    ) {
        let mut client = fuzzing::join_client().unwrap();
        let mut bytes = client.poll_transmit().unwrap().to_vec();
        if joined {
            let (h, p) = decode_frame(&bytes, &fuzzing::FUZZ_LIMITS).unwrap();
            let mut server = fuzzing::join_server().unwrap();
            server.handle_frame(Timestamp::ZERO, &h, p);
            bytes = server.poll_transmit().unwrap().to_vec();
        }
        let pristine = edits.iter().all(|(at, b)| bytes[at.index(bytes.len())] == *b);
        for (at, byte) in &edits {
            let i = at.index(bytes.len());
            bytes[i] = *byte;
        }
        let o = fuzzing::handshake_outcome(&bytes);
        let accepted = if joined { o.joined_accepted } else { o.join_accepted };
        prop_assert!(accepted || !pristine, "the unchanged frame is accepted");
        let _ = fuzzing::handshake_outcome(&bytes[..cut.index(bytes.len() + 1)]);
    }
}

/// A plain model of the dedup window's documented rules (`DedupWindow`'s docs): entries in
/// arrival order, at most `max` of them (a full window evicts its oldest `max / 16`, at least
/// one, before the next request), none older than `max_age`; per node its newest incarnation
/// and per sending shard the floor of evicted request ids.
struct DedupModel {
    max: usize,
    max_age: std::time::Duration,
    entries: Vec<(Timestamp, DedupKey, Option<u64>)>,
    nodes: Vec<ModelNode>,
    evicted: u64,
}

/// A node of [`DedupModel`]: its newest incarnation, and its sending shards' floors.
type ModelNode = (NodeId, Incarnation, Vec<(ShardId, ReqId)>);

/// What the model says about a request (`DedupVerdict` without the borrow).
#[derive(Debug, PartialEq, Eq)]
enum Said {
    Fresh,
    InProgress,
    Done(u64),
    TooOld,
}

impl DedupModel {
    fn evict_oldest(&mut self) {
        let (_, k, _) = self.entries.remove(0);
        self.evicted += 1;
        if let Some((_, inc, floors)) = self.nodes.iter_mut().find(|n| n.0 == k.node) {
            if *inc == k.incarnation {
                match floors.iter_mut().find(|f| f.0 == k.shard) {
                    Some(f) => f.1 = f.1.max(k.req_id),
                    None => floors.push((k.shard, k.req_id)),
                }
            }
        }
    }

    fn check(&mut self, now: Timestamp, key: DedupKey) -> Said {
        while self
            .entries
            .first()
            .is_some_and(|e| now.saturating_duration_since(e.0) >= self.max_age)
        {
            self.evict_oldest();
        }
        if self.entries.len() >= self.max {
            for _ in 0..(self.max / 16).max(1) {
                if self.entries.is_empty() {
                    break;
                }
                self.evict_oldest();
            }
        }
        match self.nodes.iter_mut().find(|n| n.0 == key.node) {
            Some(n) if key.incarnation < n.1 => return Said::TooOld,
            Some(n) if key.incarnation == n.1 => {
                if n.2.iter().any(|f| f.0 == key.shard && key.req_id <= f.1) {
                    return Said::TooOld;
                }
            }
            Some(n) => {
                *n = (key.node, key.incarnation, Vec::new());
                self.entries.retain(|e| e.1.node != key.node);
            }
            None => self.nodes.push((key.node, key.incarnation, Vec::new())),
        }
        match self.entries.iter().find(|e| e.1 == key) {
            Some((_, _, Some(r))) => Said::Done(*r),
            Some((_, _, None)) => Said::InProgress,
            None => {
                self.entries.push((now, key, None));
                Said::Fresh
            }
        }
    }

    fn complete(&mut self, key: DedupKey, reply: u64) -> bool {
        match self.entries.iter_mut().find(|e| e.1 == key) {
            Some(e) => {
                e.2 = Some(reply);
                true
            }
            None => false,
        }
    }
}

proptest! {
    /// The dedup window (entries kept per sending shard in arrival order, the last source
    /// remembered, fresh ids recognised by the largest one recorded) says what the plain model
    /// of its rules says, request by request: keys from
    /// two nodes of three incarnations and two shards each, time moving on by up to 20 ms a
    /// step against a 50 ms window, windows of 1 to 79 entries (evicted up to 4 at a time).
    #[test]
    fn dedup_window_follows_its_model(
        max in 1usize..80,
        ops in prop::collection::vec(
            (any::<bool>(), 1u64..3, 1u64..4, 0u16..2, 1u64..24, 0u64..20),
            1..300,
        ),
    ) {
        let max_age = std::time::Duration::from_millis(50);
        let mut w: DedupWindow<u64> = DedupWindow::new(max, max_age);
        let mut m = DedupModel { max, max_age, entries: Vec::new(), nodes: Vec::new(), evicted: 0 };
        let mut now = 0u64;
        for (i, (complete, node, inc, shard, req, dt)) in ops.into_iter().enumerate() {
            now += dt * 1_000_000;
            let t = Timestamp::from_nanos(now);
            let key = DedupKey {
                node: NodeId::new(node),
                incarnation: Incarnation::new(inc),
                shard: ShardId::new(shard),
                req_id: ReqId::new(req),
            };
            if complete {
                prop_assert_eq!(w.complete(key, i as u64), m.complete(key, i as u64), "op {}", i);
                continue;
            }
            let said = match w.check_and_insert(t, key) {
                DedupVerdict::Fresh => Said::Fresh,
                DedupVerdict::InProgress => Said::InProgress,
                DedupVerdict::Done(r) => Said::Done(*r),
                DedupVerdict::TooOld => Said::TooOld,
            };
            prop_assert_eq!(said, m.check(t, key), "op {} {:?}", i, key);
            prop_assert_eq!(w.len(), m.entries.len(), "op {}", i);
            prop_assert_eq!(w.evicted(), m.evicted, "op {}", i);
        }
    }
}
