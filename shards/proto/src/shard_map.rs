//! Peer → owning shard, by rendezvous hashing.
//!
//! Each node runs `shard_count` shards and every peer node is owned by exactly one of them: the
//! shard that holds the UCX endpoint and connection state for that peer. Ownership is computed by
//! rendezvous (highest-random-weight) hashing:
//!
//! ```text
//! owner_of(peer) = argmax over s in 0..shard_count of weight(peer, s)
//! weight(peer, s) = SipHash-2-4(k0, k1, peer.to_le_bytes() ‖ (s as u64).to_le_bytes())
//! k0 = 0x7368_6172_6463_7830 ("shardcx0" big-endian), k1 = 0x7368_6172_642d_6d61 ("shard-ma")
//! ```
//!
//! Ties (two equal 64-bit weights) go to the lower shard index. The hash is SipHash-2-4
//! implemented in this module (not `std`'s `DefaultHasher`, whose algorithm may change), so the
//! owner is identical across processes, builds, Rust versions and platforms; golden values in the
//! tests pin it.
//!
//! # Both sides of a pair
//!
//! On node A, the owner of peer B is `ShardMap::new(A's shard count).owner_of(B)`: B's id, A's
//! shard count. Node B computes the owner of A from A's id and B's shard count. When a shard of A
//! sends to B it addresses the shard of B that owns A, which it computes with
//! `ShardMap::new(B's shard count).owner_of(A)`; B's shard count arrives in the handshake.
//!
//! Connections between nodes no longer follow this map: they are per *rail*, a pair of shards
//! both sides agree on, given by [`crate::Rails`] (whose docs say why rendezvous hashing cannot
//! define them). `ShardMap` remains for what needs a stable, balanced owner per node.
//!
//! # Measured properties
//!
//! `tests/shard_map.rs` measures, over 10,000 peers, for every shard count 1..=64:
//!
//! * balance: the largest shard holds at most 1.19 × the mean (1.18 × at 64 shards, 1.07 × at
//!   16, 1.02 × at 8), and the spread of loads is that of uniform random placement (standard
//!   deviation 0.8–1.25 × the binomial one);
//! * movement: going from `n` to `n + 1` shards moves on average 1.001 × the ideal `1/(n+1)` of
//!   the peers (worst single step off by 0.97 percentage points, within binomial noise); every
//!   moved peer moves to the new shard and none moves between old shards, and shrinking by one
//!   moves only the removed shard's peers.

use crate::ids::{NodeId, ShardId};
use thiserror::Error;

/// The largest shard count: shard ids must fit the 12-bit field of [`crate::wire::Tag`].
pub const MAX_SHARDS: u16 = 4096;

const K0: u64 = 0x7368_6172_6463_7830;
const K1: u64 = 0x7368_6172_642d_6d61;

/// Maps peers to the shard that owns them on this node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ShardMap {
    shard_count: u16,
}

/// A shard count outside `1..=MAX_SHARDS`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
#[non_exhaustive]
#[error("shard count {shard_count} outside 1..={max}", max = MAX_SHARDS)]
pub struct ShardCountError {
    /// The rejected count.
    pub shard_count: u32,
}

impl ShardMap {
    /// A map over `shard_count` shards (`1..=MAX_SHARDS`).
    pub fn new(shard_count: u16) -> Result<ShardMap, ShardCountError> {
        if shard_count == 0 || shard_count > MAX_SHARDS {
            return Err(ShardCountError {
                shard_count: u32::from(shard_count),
            });
        }
        Ok(ShardMap { shard_count })
    }

    /// The number of shards.
    pub fn shard_count(&self) -> u16 {
        self.shard_count
    }

    /// The shard that owns `peer` on a node with this map's shard count.
    pub fn owner_of(&self, peer: NodeId) -> ShardId {
        let mut best = 0u16;
        let mut best_weight = weight(peer, ShardId::new(0));
        for s in 1..self.shard_count {
            let w = weight(peer, ShardId::new(s));
            if w > best_weight {
                best = s;
                best_weight = w;
            }
        }
        ShardId::new(best)
    }
}

/// The rendezvous weight of `shard` for `peer` (see the module docs for the exact definition).
pub fn weight(peer: NodeId, shard: ShardId) -> u64 {
    let mut msg = [0u8; 16];
    msg[..8].copy_from_slice(&peer.get().to_le_bytes());
    msg[8..].copy_from_slice(&u64::from(shard.get()).to_le_bytes());
    siphash24(K0, K1, &msg)
}

/// SipHash-2-4 of `data` under the 128-bit key `(k0, k1)`, as specified by Aumasson and
/// Bernstein (2012). Stable by construction: no platform- or build-dependent input.
pub fn siphash24(k0: u64, k1: u64, data: &[u8]) -> u64 {
    let mut v = [
        k0 ^ 0x736f_6d65_7073_6575,
        k1 ^ 0x646f_7261_6e64_6f6d,
        k0 ^ 0x6c79_6765_6e65_7261,
        k1 ^ 0x7465_6462_7974_6573,
    ];
    let mut chunks = data.chunks_exact(8);
    for chunk in &mut chunks {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        let m = u64::from_le_bytes(word);
        v[3] ^= m;
        sip_round(&mut v);
        sip_round(&mut v);
        v[0] ^= m;
    }
    let rest = chunks.remainder();
    let mut last = [0u8; 8];
    last[..rest.len()].copy_from_slice(rest);
    // The length's low byte goes into the top byte of the final word (wrapping is the spec).
    last[7] = data.len() as u8;
    let m = u64::from_le_bytes(last);
    v[3] ^= m;
    sip_round(&mut v);
    sip_round(&mut v);
    v[0] ^= m;
    v[2] ^= 0xff;
    for _ in 0..4 {
        sip_round(&mut v);
    }
    v[0] ^ v[1] ^ v[2] ^ v[3]
}

fn sip_round(v: &mut [u64; 4]) {
    v[0] = v[0].wrapping_add(v[1]);
    v[1] = v[1].rotate_left(13);
    v[1] ^= v[0];
    v[0] = v[0].rotate_left(32);
    v[2] = v[2].wrapping_add(v[3]);
    v[3] = v[3].rotate_left(16);
    v[3] ^= v[2];
    v[0] = v[0].wrapping_add(v[3]);
    v[3] = v[3].rotate_left(21);
    v[3] ^= v[0];
    v[2] = v[2].wrapping_add(v[1]);
    v[1] = v[1].rotate_left(17);
    v[1] ^= v[2];
    v[2] = v[2].rotate_left(32);
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;

    #[test]
    fn siphash_reference_vector() {
        // From the SipHash paper, appendix A: key 00..0f, message 00..0e.
        let k0 = u64::from_le_bytes([0, 1, 2, 3, 4, 5, 6, 7]);
        let k1 = u64::from_le_bytes([8, 9, 10, 11, 12, 13, 14, 15]);
        let msg: Vec<u8> = (0u8..15).collect();
        assert_eq!(siphash24(k0, k1, &msg), 0xa129_ca61_49be_45e5);
        // And the empty message (first entry of the reference vectors.h: 310e0edd47db6f72).
        assert_eq!(
            siphash24(k0, k1, &[]),
            u64::from_le_bytes([0x31, 0x0e, 0x0e, 0xdd, 0x47, 0xdb, 0x6f, 0x72])
        );
    }

    #[test]
    #[allow(deprecated)] // std's SipHasher is deprecated but still SipHash-2-4: a second oracle.
    fn siphash_matches_std_for_all_lengths() {
        use std::hash::Hasher;
        let data: Vec<u8> = (0u8..=70).map(|i| i.wrapping_mul(37)).collect();
        for len in 0..data.len() {
            let mut h = std::hash::SipHasher::new_with_keys(K0, K1);
            h.write(&data[..len]);
            assert_eq!(siphash24(K0, K1, &data[..len]), h.finish(), "len {len}");
        }
    }

    #[test]
    fn rejects_bad_counts() {
        assert!(ShardMap::new(0).is_err());
        assert!(ShardMap::new(MAX_SHARDS + 1).is_err());
        assert_eq!(
            ShardMap::new(MAX_SHARDS).map(|m| m.shard_count()),
            Ok(MAX_SHARDS)
        );
        assert_eq!(
            ShardMap::new(0).unwrap_err().to_string(),
            "shard count 0 outside 1..=4096"
        );
    }

    #[test]
    fn one_shard_owns_everything() {
        let m = ShardMap::new(1).unwrap();
        for p in 0..100 {
            assert_eq!(m.owner_of(NodeId::new(p)), ShardId::new(0));
        }
    }
}
