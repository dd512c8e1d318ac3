//! Replays the fuzz corpora on stable Rust, and generates / checks the seed corpus.
//!
//! `SHARDCX_WRITE_CORPUS=1 cargo test -p shardcx-proto --test corpus` (re)writes the seeds.

// Tests may unwrap: a panic is a test failure with a message.
#![allow(clippy::unwrap_used)]

use shardcx_proto::fuzzing::{
    self, ArchivedInner, ArchivedSample, HandshakeOutcome, Inner, RpcOutcome, Sample, Shape,
    FUZZ_LIMITS,
};
use shardcx_proto::handshake::{
    Confirm, HandshakeMessage, Hello, Join, Reject, RejectReason, Welcome,
};
use shardcx_proto::wire::decode_frame;
use shardcx_proto::wire::{encode_frame, payload_offset};
use shardcx_proto::{
    encode_error, encode_request, CallFlags, Features, FrameFlags, FrameHeader, FrameKind,
    Generation, GetRequest, Incarnation, NodeId, PutRequest, ReqId, RmaErrorCode, RmaReply,
    RpcErrorCode, ShardId, Timestamp,
};
use std::path::PathBuf;

fn corpus_dir(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target)
}

fn frame(header: FrameHeader, payload: &[u8]) -> Vec<u8> {
    let mut buf = vec![0u8; payload_offset() + payload.len()];
    let n = encode_frame(&header, payload, &mut buf, &FUZZ_LIMITS).unwrap();
    buf.truncate(n);
    buf
}

fn hs_frame(msg: HandshakeMessage) -> Vec<u8> {
    let mut p = [0u8; 128];
    let n = msg.encode(&mut p).unwrap();
    frame(FrameHeader::new(msg.kind()), &p[..n])
}

/// (name, bytes, expected to decode) for each target.
fn seeds() -> Vec<(&'static str, &'static str, Vec<u8>, bool)> {
    let rpc = FrameHeader {
        kind: FrameKind::RpcRequest,
        flags: FrameFlags::IDEMPOTENT,
        src_shard: ShardId::new(2),
        dst_shard: ShardId::new(5),
        id: 77,
        req_id: ReqId::new(12345),
        incarnation: Incarnation::new(3),
        ttl_ns: 1_000_000,
        ..FrameHeader::new(FrameKind::RpcRequest)
    };
    let valid_rpc = frame(rpc, b"payload bytes");
    let mut s = vec![
        (
            "frame",
            "valid-heartbeat",
            frame(FrameHeader::new(FrameKind::Heartbeat), &[]),
            true,
        ),
        ("frame", "valid-rpc-request", valid_rpc.clone(), true),
        (
            "frame",
            "valid-am-empty",
            frame(FrameHeader::new(FrameKind::Am), &[]),
            true,
        ),
        ("frame", "empty", Vec::new(), false),
        ("frame", "truncated-header", valid_rpc[..47].to_vec(), false),
        (
            "frame",
            "truncated-payload",
            valid_rpc[..valid_rpc.len() - 1].to_vec(),
            false,
        ),
    ];
    let mut bad = valid_rpc.clone();
    bad[0] = b'X';
    s.push(("frame", "bad-magic", bad, false));
    let mut bad = valid_rpc.clone();
    bad[4] = 9;
    s.push(("frame", "bad-version", bad, false));
    let mut bad = valid_rpc.clone();
    bad[5] = 200;
    s.push(("frame", "unknown-kind", bad, false));
    let mut bad = valid_rpc.clone();
    bad[7] = 0x80;
    s.push(("frame", "reserved-flags", bad, false));
    let mut bad = valid_rpc.clone();
    bad[40..48].copy_from_slice(&u64::MAX.to_le_bytes());
    s.push(("frame", "huge-length", bad, false));
    let mut bad = valid_rpc.clone();
    bad[40..48].copy_from_slice(&(FUZZ_LIMITS.max_message_size + 1).to_le_bytes());
    s.push(("frame", "length-over-limit", bad, false));

    s.extend(
        handshake_seeds()
            .into_iter()
            .map(|(name, bytes, o)| ("handshake", name, bytes, o.decoded)),
    );
    s.extend(rma_seeds());
    s.extend(
        rpc_seeds()
            .into_iter()
            .map(|(name, bytes, o)| ("rpc", name, bytes, o.request || o.error)),
    );
    s
}

/// (name, frame, expected outcome) for the `handshake` target. The hello seeds come from node 9
/// (the fuzz session's client); the join seeds are the fuzz join client's own join (from its
/// shard 2 to the server's shard 0) and variations, and the joined seeds the fuzz join server's
/// answer to it.
fn handshake_seeds() -> Vec<(&'static str, Vec<u8>, HandshakeOutcome)> {
    let none = HandshakeOutcome::default();
    let decoded = HandshakeOutcome {
        decoded: true,
        ..none
    };
    let refused = |reason| HandshakeOutcome {
        join_refused: Some(reason),
        ..decoded
    };
    let mut s = Vec::new();
    let hello = Hello {
        min_version: 1,
        max_version: 1,
        shard_count: 4,
        node_id: NodeId::new(9),
        incarnation: Incarnation::new(2),
        features: Features::RPC,
        nonce: [3; 32],
    };
    let welcome = Welcome {
        version: 1,
        shard_count: 8,
        node_id: NodeId::new(1),
        incarnation: Incarnation::new(1),
        features: Features::RPC,
        nonce: [4; 32],
        echo: [7; 32],
        proof: [5; 32],
    };
    s.push((
        "valid-hello",
        hs_frame(HandshakeMessage::Hello(hello)),
        decoded,
    ));
    s.push((
        "valid-welcome-bad-proof",
        hs_frame(HandshakeMessage::Welcome(welcome)),
        decoded,
    ));
    s.push((
        "valid-confirm-bad-proof",
        hs_frame(HandshakeMessage::Confirm(Confirm {
            echo: [8; 32],
            proof: [0; 32],
        })),
        decoded,
    ));
    s.push((
        "valid-reject",
        hs_frame(HandshakeMessage::Reject(Reject {
            reason: RejectReason::Busy,
            min_version: 1,
            max_version: 1,
            echo: [7; 32],
        })),
        decoded,
    ));
    s.push((
        "hello-zero-shards",
        hs_frame(HandshakeMessage::Hello(Hello {
            shard_count: 0,
            ..hello
        })),
        HandshakeOutcome {
            join_refused: Some(RejectReason::BadShardCount),
            ..decoded
        },
    ));
    let mut p = hello.to_bytes();
    p[5] = 1;
    s.push((
        "hello-reserved-set",
        frame(FrameHeader::new(FrameKind::Hello), &p),
        none,
    ));
    s.push((
        "hello-short",
        frame(FrameHeader::new(FrameKind::Hello), &p[..63]),
        none,
    ));
    s.push((
        "welcome-as-confirm",
        frame(FrameHeader::new(FrameKind::Confirm), &welcome.to_bytes()),
        none,
    ));
    s.push((
        "not-handshake",
        frame(FrameHeader::new(FrameKind::Am), &p),
        none,
    ));

    // The fuzz join client's join, exactly as it sends it.
    let mut client = fuzzing::join_client().unwrap();
    let valid_join = client.poll_transmit().unwrap().to_vec();
    let (join_header, join_payload) = decode_frame(&valid_join, &FUZZ_LIMITS).unwrap();
    let Ok(HandshakeMessage::Join(join)) = HandshakeMessage::decode(join_header.kind, join_payload)
    else {
        panic!("the join client sends a join");
    };
    let join_frame = |header: FrameHeader, payload: &[u8]| frame(header, payload);
    let rejoin = |j| {
        let mut p = [0u8; 96];
        HandshakeMessage::Join(j).encode(&mut p).unwrap();
        join_frame(join_header, &p)
    };
    // The fuzz join server's answer to it.
    let mut server = fuzzing::join_server().unwrap();
    server.handle_frame(Timestamp::ZERO, &join_header, join_payload);
    let valid_joined = server.poll_transmit().unwrap().to_vec();
    let (joined_header, joined_payload) = decode_frame(&valid_joined, &FUZZ_LIMITS).unwrap();
    let Ok(HandshakeMessage::Joined(joined)) =
        HandshakeMessage::decode(joined_header.kind, joined_payload)
    else {
        panic!("the join server answers a joined");
    };
    s.push((
        "valid-join",
        valid_join.clone(),
        HandshakeOutcome {
            join_accepted: true,
            ..decoded
        },
    ));
    let mut bad_proof = join;
    bad_proof.proof[31] ^= 0x80;
    s.push((
        "join-bad-proof",
        rejoin(bad_proof),
        refused(RejectReason::BadProof),
    ));
    s.push((
        "join-stale-server-incarnation",
        rejoin(Join {
            server_incarnation: Incarnation::new(0),
            ..join
        }),
        refused(RejectReason::UnknownSession),
    ));
    s.push((
        "join-unknown-node",
        rejoin(Join {
            node_id: NodeId::new(10),
            ..join
        }),
        refused(RejectReason::UnknownSession),
    ));
    // From client shard 1: the server's shard 0 has rails to client shards 0 and 2 only.
    s.push((
        "join-off-the-rails",
        join_frame(
            FrameHeader {
                src_shard: ShardId::new(1),
                ..join_header
            },
            join_payload,
        ),
        refused(RejectReason::NoSuchRail),
    ));
    // For the server's shard 1: dropped as misrouted, unanswered.
    s.push((
        "join-misrouted",
        join_frame(
            FrameHeader {
                dst_shard: ShardId::new(1),
                ..join_header
            },
            join_payload,
        ),
        decoded,
    ));
    let mut reserved = join_payload.to_vec();
    reserved[1] = 1;
    s.push((
        "join-reserved-set",
        join_frame(join_header, &reserved),
        none,
    ));
    s.push((
        "join-short",
        join_frame(join_header, &join_payload[..95]),
        none,
    ));
    s.push((
        "valid-joined",
        valid_joined.clone(),
        HandshakeOutcome {
            joined_accepted: true,
            ..decoded
        },
    ));
    let mut bad = joined;
    bad.proof[0] ^= 1;
    let mut p = [0u8; 64];
    HandshakeMessage::Joined(bad).encode(&mut p).unwrap();
    s.push(("joined-bad-proof", frame(joined_header, &p), decoded));
    s.push((
        "joined-as-join",
        frame(
            FrameHeader {
                kind: FrameKind::Join,
                ..joined_header
            },
            joined_payload,
        ),
        none,
    ));
    let reject = HandshakeMessage::Reject(Reject {
        reason: RejectReason::UnknownSession,
        min_version: 1,
        max_version: 1,
        echo: join.nonce,
    });
    let mut p = [0u8; 40];
    reject.encode(&mut p).unwrap();
    s.push((
        "reject-unknown-session",
        frame(
            FrameHeader {
                kind: FrameKind::Reject,
                ..joined_header
            },
            &p,
        ),
        decoded,
    ));
    s
}

#[test]
fn handshake_seeds_have_expected_outcomes() {
    for (name, bytes, expected) in handshake_seeds() {
        assert_eq!(
            fuzzing::handshake_outcome(&bytes),
            expected,
            "handshake/{name}"
        );
    }
}

fn rma_seeds() -> Vec<(&'static str, &'static str, Vec<u8>, bool)> {
    let rma = |kind, region: u32| FrameHeader {
        id: region,
        req_id: ReqId::new(5),
        ..FrameHeader::new(kind)
    };
    let put = |generation: u64, offset: u64, data: &[u8]| {
        let mut p = Vec::new();
        PutRequest {
            generation: Generation::new(generation),
            offset,
            data,
        }
        .encode_to_vec(&mut p, &FUZZ_LIMITS)
        .unwrap();
        p
    };
    let get = |generation: u64, offset: u64, len: u64| {
        GetRequest {
            generation: Generation::new(generation),
            offset,
            len,
        }
        .to_bytes(&FUZZ_LIMITS)
        .unwrap()
        .to_vec()
    };
    let reply = |r: RmaReply<'_>| {
        let mut p = Vec::new();
        r.encode_to_vec(&mut p, &FUZZ_LIMITS).unwrap();
        p
    };
    let put_frame = |region, p: &[u8]| frame(rma(FrameKind::RmaPut, region), p);
    let get_frame = |region, p: &[u8]| frame(rma(FrameKind::RmaGet, region), p);
    let reply_frame = |p: &[u8]| frame(rma(FrameKind::RmaReply, 0), p);
    let valid_put = put(1, 60, b"abcd");
    let valid_get = get(2, 0, 16);
    let mut huge_get = valid_get.clone();
    huge_get[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    let mut padded_reply = reply(RmaReply::ok(b""));
    padded_reply[7] = 1;
    let mut error_with_data = reply(RmaReply::err(RmaErrorCode::OutOfBounds));
    error_with_data.push(0);
    vec![
        ("rma", "valid-put", put_frame(1, &valid_put), true),
        (
            "rma",
            "put-out-of-bounds",
            put_frame(1, &put(1, 61, b"abcd")),
            true,
        ),
        (
            "rma",
            "put-offset-overflow",
            put_frame(1, &put(1, u64::MAX, b"a")),
            true,
        ),
        ("rma", "put-read-only", put_frame(2, &put(2, 0, b"a")), true),
        (
            "rma",
            "put-stale-generation",
            put_frame(1, &put(9, 0, b"a")),
            true,
        ),
        ("rma", "put-unknown-region", put_frame(7, &valid_put), true),
        (
            "rma",
            "put-truncated",
            put_frame(1, &valid_put[..15]),
            false,
        ),
        ("rma", "valid-get", get_frame(2, &valid_get), true),
        (
            "rma",
            "get-offset-overflow",
            get_frame(2, &get(2, u64::MAX, 8)),
            true,
        ),
        ("rma", "get-reply-too-large", get_frame(2, &huge_get), false),
        (
            "rma",
            "get-trailing",
            get_frame(2, &[&valid_get[..], &[0]].concat()),
            false,
        ),
        (
            "rma",
            "valid-reply-data",
            reply_frame(&reply(RmaReply::ok(b"data"))),
            true,
        ),
        (
            "rma",
            "valid-reply-error",
            reply_frame(&reply(RmaReply::err(RmaErrorCode::StaleGeneration))),
            true,
        ),
        (
            "rma",
            "reply-unknown-code",
            reply_frame(&[200, 0, 0, 0, 0, 0, 0, 0]),
            true,
        ),
        (
            "rma",
            "reply-padding-set",
            reply_frame(&padded_reply),
            false,
        ),
        (
            "rma",
            "reply-error-with-data",
            reply_frame(&error_with_data),
            false,
        ),
        (
            "rma",
            "not-rma",
            frame(FrameHeader::new(FrameKind::Am), &valid_put),
            false,
        ),
    ]
}

fn archive(sample: &Sample) -> Vec<u8> {
    rkyv::to_bytes::<rkyv::rancor::Error>(sample)
        .unwrap()
        .to_vec()
}

/// (name, payload, expected outcome) for the `rpc` target. Every payload is an RPC frame's
/// payload (the envelope), not a whole frame.
fn rpc_seeds() -> Vec<(&'static str, Vec<u8>, RpcOutcome)> {
    const SCHEMA: u64 = 0x5eed_c0de_1234_5678;
    let full = Sample {
        name: "a name longer than eight bytes".into(),
        values: vec![1, 2, u64::MAX],
        shape: Shape::Named {
            id: 7,
            label: "label, out of line".into(),
        },
        inner: Some(Inner {
            flag: true,
            tags: vec!["x".into(), "a longer tag string".into()],
        }),
    };
    let small = Sample {
        name: "short".into(),
        values: Vec::new(),
        shape: Shape::Pair(3, -4),
        inner: None,
    };
    let unit = Sample {
        name: String::new(),
        values: vec![42],
        shape: Shape::Empty,
        inner: Some(Inner {
            flag: false,
            tags: Vec::new(),
        }),
    };
    let full_args = archive(&full);
    let request = |flags, args: &[u8]| encode_request(SCHEMA, flags, args);
    let valid = request(CallFlags::NONE, &full_args);

    // The archive's root is its last bytes; `values` is a relative pointer (i32 offset from
    // itself) followed by a u32 length.
    let root = full_args.len() - size_of::<ArchivedSample>();
    let values = root + std::mem::offset_of!(ArchivedSample, values);
    let mut bad_ptr = full_args.clone();
    bad_ptr[values..values + 4].copy_from_slice(&0x4000_0000i32.to_le_bytes());
    let mut bad_len = full_args.clone();
    bad_len[values + 4..values + 8].copy_from_slice(&0x0fff_ffffu32.to_le_bytes());
    let mut bad_bool = archive(&unit);
    // `inner` is an `ArchivedOption` (a `repr(u8)` enum: tag, then the `repr(C)` `ArchivedInner`
    // at its alignment, whose first field is `flag`). Any value but 0 or 1 is an invalid bool.
    let flag_pos = bad_bool.len() - size_of::<ArchivedSample>()
        + std::mem::offset_of!(ArchivedSample, inner)
        + align_of::<ArchivedInner>();
    assert_eq!(
        bad_bool[flag_pos], 0,
        "layout assumption broken: flag is false"
    );
    bad_bool[flag_pos] = 2;

    let mut unknown_flags = valid.clone();
    unknown_flags[8] = 0x04;
    let mut reserved = valid.clone();
    reserved[12] = 1;

    let error = encode_error(
        RpcErrorCode::SchemaMismatch,
        SCHEMA,
        "schema mismatch: héllo",
    );
    let mut bad_utf8 = encode_error(RpcErrorCode::Failed, u64::MAX, "bad \u{e9} here");
    let e = bad_utf8.len() - " here".len() - 1;
    bad_utf8[e] = 0xff; // the continuation byte of é becomes invalid
    let mut too_long = encode_error(RpcErrorCode::Failed, u64::MAX, "message");
    too_long[4..8].copy_from_slice(&4097u32.to_le_bytes());
    let mut short_message = encode_error(RpcErrorCode::Failed, u64::MAX, "message");
    short_message.truncate(short_message.len() - 1);
    let mut trailing = encode_error(RpcErrorCode::Busy, u64::MAX, "");
    trailing.push(0);
    let mut unknown_code = encode_error(RpcErrorCode::Busy, u64::MAX, "");
    unknown_code[0..2].copy_from_slice(&999u16.to_le_bytes());
    let mut error_reserved = encode_error(RpcErrorCode::Busy, u64::MAX, "");
    error_reserved[2] = 1;
    let long_message = encode_error(RpcErrorCode::Failed, u64::MAX, &"€".repeat(2000));

    let ok = |sample| RpcOutcome {
        request: true,
        sample,
        error: false,
    };
    let err_ok = RpcOutcome {
        request: false,
        sample: false,
        error: true,
    };
    let none = RpcOutcome::default();
    vec![
        ("valid-request-full", valid.clone(), ok(true)),
        (
            "valid-request-pair-one-way",
            request(CallFlags::ONE_WAY, &archive(&small)),
            ok(true),
        ),
        (
            "valid-request-unit-idempotent",
            request(CallFlags::ONE_WAY | CallFlags::IDEMPOTENT, &archive(&unit)),
            ok(true),
        ),
        (
            "valid-request-empty-args",
            request(CallFlags::NONE, &[]),
            ok(false),
        ),
        ("request-empty", Vec::new(), none),
        ("request-truncated-prefix", valid[..15].to_vec(), none),
        ("request-unknown-flags", unknown_flags, none),
        ("request-reserved-set", reserved, none),
        (
            "request-garbage-archive",
            request(CallFlags::NONE, &[0xab; 64]),
            ok(false),
        ),
        (
            "request-truncated-archive",
            valid[..valid.len() - 3].to_vec(),
            ok(false),
        ),
        (
            "request-out-of-bounds-pointer",
            request(CallFlags::NONE, &bad_ptr),
            ok(false),
        ),
        (
            "request-out-of-bounds-length",
            request(CallFlags::NONE, &bad_len),
            ok(false),
        ),
        (
            "request-invalid-bool",
            request(CallFlags::NONE, &bad_bool),
            ok(false),
        ),
        ("valid-error", error, err_ok),
        ("valid-error-long-message", long_message, err_ok),
        ("error-bad-utf8", bad_utf8, none),
        ("error-message-over-limit", too_long, none),
        ("error-message-truncated", short_message, none),
        ("error-trailing-bytes", trailing, none),
        ("error-unknown-code", unknown_code, none),
        ("error-reserved-set", error_reserved, none),
    ]
}

#[test]
fn rpc_seeds_have_expected_outcomes() {
    for (name, bytes, expected) in rpc_seeds() {
        assert_eq!(fuzzing::rpc_outcome(&bytes), expected, "rpc/{name}");
    }
}

#[test]
fn seed_corpus_matches_generator() {
    let write = std::env::var_os("SHARDCX_WRITE_CORPUS").is_some();
    for (target, name, bytes, _) in seeds() {
        let path = corpus_dir(target).join(name);
        if write {
            std::fs::create_dir_all(corpus_dir(target)).unwrap();
            std::fs::write(&path, &bytes).unwrap();
        } else {
            let on_disk = std::fs::read(&path).unwrap_or_else(|e| {
                panic!(
                    "{}: {e} (regenerate with SHARDCX_WRITE_CORPUS=1)",
                    path.display()
                )
            });
            assert_eq!(on_disk, bytes, "{} is stale", path.display());
        }
    }
}

#[test]
fn seeds_decode_as_expected() {
    for (target, name, bytes, ok) in seeds() {
        let decoded = match target {
            "frame" => fuzzing::frame(&bytes),
            "rma" => fuzzing::rma(&bytes),
            "rpc" => fuzzing::rpc(&bytes),
            _ => fuzzing::handshake(&bytes),
        };
        assert_eq!(decoded, ok, "{target}/{name}");
    }
}

#[test]
fn replay_every_corpus_file() {
    for (target, run) in [
        ("frame", fuzzing::frame as fn(&[u8]) -> bool),
        ("handshake", fuzzing::handshake),
        ("rma", fuzzing::rma),
        ("rpc", fuzzing::rpc),
    ] {
        let dir = corpus_dir(target);
        let mut count = 0;
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.unwrap().path();
            if path.is_file() {
                let bytes = std::fs::read(&path).unwrap();
                // Every file must not panic; other targets' files are fed too, for breadth.
                let _ = fuzzing::frame(&bytes);
                let _ = fuzzing::handshake(&bytes);
                let _ = fuzzing::rma(&bytes);
                let _ = fuzzing::rpc(&bytes);
                let _ = run(&bytes);
                count += 1;
            }
        }
        assert!(count >= 9, "{target}: only {count} corpus files");
    }
}
