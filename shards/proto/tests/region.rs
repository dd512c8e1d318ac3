//! Property tests for checked remote memory: `RegionTable::check` never panics and accepts
//! exactly the permitted, in-bounds accesses of current descriptors; the RMA payload decoders
//! never panic and round-trip what they decode.

// Tests may unwrap: a panic is a test failure with a message.
#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use shardcx_proto::{
    Access, Generation, GetRequest, Limits, NodeId, Permissions, PutRequest, RegionDescriptor,
    RegionId, RegionSpec, RegionTable, RmaError, RmaErrorCode, RmaReply,
};
use std::collections::BTreeMap;

/// Lengths and offsets that hit the interesting places: small, near a small region's end, and
/// near `u64::MAX` (where `offset + len` overflows).
fn edge_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        0u64..300,
        any::<u64>(),
        (0u64..300).prop_map(|d| u64::MAX - d),
        (0u32..64).prop_map(|s| 1u64 << s),
    ]
}

fn permissions() -> impl Strategy<Value = Permissions> {
    (0u8..4).prop_map(|b| Permissions::from_bits(b).unwrap())
}

fn access() -> impl Strategy<Value = Access> {
    prop_oneof![Just(Access::Read), Just(Access::Write)]
}

fn limits() -> impl Strategy<Value = Limits> {
    prop_oneof![0u64..100, any::<u64>()].prop_map(|max_message_size| Limits { max_message_size })
}

/// The bounds rule computed without any chance of overflow.
fn in_bounds(region_len: u64, offset: u64, len: u64) -> bool {
    u128::from(offset) + u128::from(len) <= u128::from(region_len)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    /// For a valid descriptor, exactly the in-bounds ranges are accepted, and as asked.
    #[test]
    fn check_accepts_exactly_in_bounds(region_len in edge_u64(), offset in edge_u64(), len in edge_u64(), acc in access()) {
        let mut t = RegionTable::new();
        let d = t.register(RegionSpec { len: region_len, permissions: Permissions::READ_WRITE, grantee: None, handle: 9 }).unwrap();
        let got = t.check(NodeId::new(1), d.id, d.generation, offset, len, acc);
        let initiator = d.check(offset, len, acc);
        if in_bounds(region_len, offset, len) {
            let r = got.unwrap();
            prop_assert_eq!((r.handle, r.start as u64, r.len as u64), (9, offset, len));
            prop_assert!(r.range().end as u64 <= region_len);
            prop_assert_eq!(initiator, Ok(()));
        } else {
            let refused = RmaError::OutOfBounds { region: d.id, offset, len, region_len };
            prop_assert_eq!(got, Err(refused));
            prop_assert_eq!(initiator, Err(refused));
        }
    }

    /// Any combination of requester, region, generation, permission and range: never a panic,
    /// and the answer is the first failing check in the documented order.
    #[test]
    fn check_follows_documented_order(
        region_len in edge_u64(),
        perms in permissions(),
        grantee in prop::option::of(0u64..3),
        requester in 0u64..3,
        id_delta in 0u32..2,
        generation_delta in 0u64..2,
        offset in edge_u64(),
        len in edge_u64(),
        acc in access(),
    ) {
        let mut t = RegionTable::starting_at(Generation::new(100));
        let d = t.register(RegionSpec { len: region_len, permissions: perms, grantee: grantee.map(NodeId::new), handle: 1 }).unwrap();
        let region = RegionId::new(d.id.get() + id_delta);
        let generation = Generation::new(d.generation.get() + generation_delta);
        let requester = NodeId::new(requester);
        let got = t.check(requester, region, generation, offset, len, acc);
        let expected = if id_delta != 0 {
            Err(RmaError::UnknownRegion { region })
        } else if grantee.is_some_and(|g| g != requester.get()) {
            Err(RmaError::NotGrantee { region, requester })
        } else if generation_delta != 0 {
            Err(RmaError::StaleGeneration { region, generation })
        } else if !perms.allows(acc) {
            Err(RmaError::NotPermitted { region, access: acc })
        } else if !in_bounds(region_len, offset, len) {
            Err(RmaError::OutOfBounds { region, offset, len, region_len })
        } else {
            Ok((offset, len))
        };
        prop_assert_eq!(got.map(|r| (r.start as u64, r.len as u64)), expected);
    }

    /// Under any sequence of register / revoke / deregister, a descriptor is accepted only while
    /// it is the current one of a registered region: revoked and deregistered ones never again.
    #[test]
    fn only_current_descriptors_are_accepted(ops in prop::collection::vec((0u8..3, any::<usize>()), 1..100)) {
        let mut t = RegionTable::new();
        let mut current: BTreeMap<RegionId, RegionDescriptor> = BTreeMap::new();
        let mut issued: Vec<RegionDescriptor> = Vec::new();
        for (op, pick) in ops {
            let live: Vec<RegionId> = current.keys().copied().collect();
            match op {
                0 => {
                    let d = t.register(RegionSpec { len: 8, permissions: Permissions::READ, grantee: None, handle: issued.len() as u64 }).unwrap();
                    prop_assert!(current.insert(d.id, d).is_none());
                    issued.push(d);
                }
                1 if !live.is_empty() => {
                    let id = live[pick % live.len()];
                    let d = t.revoke(id).unwrap();
                    prop_assert!(d.generation > current[&id].generation);
                    current.insert(id, d);
                    issued.push(d);
                }
                2 if !live.is_empty() => {
                    let id = live[pick % live.len()];
                    t.deregister(id).unwrap();
                    current.remove(&id);
                }
                _ => {}
            }
            prop_assert_eq!(t.len(), current.len());
            for d in &issued {
                let ok = t.check(NodeId::new(1), d.id, d.generation, 0, 8, Access::Read).is_ok();
                prop_assert_eq!(ok, current.get(&d.id) == Some(d));
            }
        }
        // No (id, generation) pair was ever issued twice.
        let mut pairs: Vec<_> = issued.iter().map(|d| (d.id, d.generation)).collect();
        pairs.sort();
        pairs.dedup();
        prop_assert_eq!(pairs.len(), issued.len());
    }

    #[test]
    fn put_decoder_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..200), limits in limits()) {
        if let Ok(put) = PutRequest::decode(&bytes, &limits) {
            prop_assert!(bytes.len() as u64 <= limits.max_message_size);
            let mut out = Vec::new();
            put.encode_to_vec(&mut out, &limits).unwrap();
            prop_assert_eq!(out, bytes);
        }
    }

    #[test]
    fn get_decoder_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..40), limits in limits()) {
        if let Ok(get) = GetRequest::decode(&bytes, &limits) {
            prop_assert!(get.reply_len() <= limits.max_message_size);
            prop_assert!(get.len < limits.max_message_size);
            prop_assert_eq!(&get.to_bytes(&limits).unwrap()[..], &bytes[..]);
        }
    }

    #[test]
    fn reply_decoder_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..64), limits in limits()) {
        if let Ok(reply) = RmaReply::decode(&bytes, &limits) {
            let mut out = vec![0u8; bytes.len()];
            prop_assert_eq!(reply.encode(&mut out, &limits), Ok(bytes.len()));
            prop_assert_eq!(out, bytes);
        }
    }

    #[test]
    fn mutated_reply_header_never_panics(code in any::<u8>(), pos in 0usize..8, byte in any::<u8>(), data in prop::collection::vec(any::<u8>(), 0..16)) {
        let mut bytes = vec![code, 0, 0, 0, 0, 0, 0, 0];
        bytes[pos] = byte;
        bytes.extend_from_slice(&data);
        let _ = RmaReply::decode(&bytes, &Limits::default());
    }

    #[test]
    fn payloads_round_trip(generation in any::<u64>(), offset in any::<u64>(), len in 0u64..1 << 20, data in prop::collection::vec(any::<u8>(), 0..256), code in 0u8..=255) {
        let limits = Limits::default();
        let put = PutRequest { generation: Generation::new(generation), offset, data: &data };
        let mut buf = vec![0u8; put.encoded_len()];
        prop_assert_eq!(put.encode(&mut buf, &limits), Ok(buf.len()));
        prop_assert_eq!(PutRequest::decode(&buf, &limits), Ok(put));

        let get = GetRequest { generation: Generation::new(generation), offset, len };
        prop_assert_eq!(GetRequest::decode(&get.to_bytes(&limits).unwrap(), &limits), Ok(get));

        let reply = match RmaErrorCode::from_u8(code) {
            None => RmaReply::ok(&data),
            Some(c) => RmaReply::err(c),
        };
        let mut out = Vec::new();
        reply.encode_to_vec(&mut out, &limits).unwrap();
        prop_assert_eq!(out[0], code);
        prop_assert_eq!(RmaReply::decode(&out, &limits), Ok(reply));
    }
}
