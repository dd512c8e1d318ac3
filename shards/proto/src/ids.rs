//! Identifier newtypes.
//!
//! Every id in shardcx is its own type so that a shard id cannot be passed where a request id is
//! expected. Widths are part of the wire format (see [`crate::wire`] and [`crate::handshake`]):
//!
//! | type | width | meaning |
//! | --- | --- | --- |
//! | [`NodeId`] | `u64` | a node's stable identity, configured by the operator; the peer key hashed by [`crate::ShardMap`] |
//! | [`Incarnation`] | `u64` | one start of a node; a restart must pick a larger value (e.g. start time in ns) |
//! | [`ShardId`] | `u16` | index of a shard (core) within a node, `0..shard_count` |
//! | [`ReqId`] | `u64` | request id, unique per sending connection; `0` means "none" |
//! | [`AmId`] | `u32` | active-message handler id |
//! | [`FunctionId`] | `u32` | RPC function id |
//! | [`RegionId`] | `u32` | remote-memory region id within a shard's region table |
//! | [`Generation`] | `u64` | region generation, bumped on revocation |

use std::fmt;

macro_rules! id_newtype {
    ($(#[$meta:meta])* $name:ident($ty:ty)) => {
        $(#[$meta])*
        #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
        pub struct $name($ty);

        impl $name {
            /// Wraps a raw value.
            pub const fn new(raw: $ty) -> Self {
                Self(raw)
            }

            /// The raw value.
            pub const fn get(self) -> $ty {
                self.0
            }
        }

        impl From<$ty> for $name {
            fn from(raw: $ty) -> Self {
                Self(raw)
            }
        }

        impl From<$name> for $ty {
            fn from(id: $name) -> $ty {
                id.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }
    };
}

id_newtype!(
    /// A node's stable identity (64 bits). It is the key [`crate::ShardMap`] hashes.
    NodeId(u64)
);
id_newtype!(
    /// One start of a node. A restarted node must use a strictly larger incarnation, so that
    /// frames and requests from its previous life can be recognised and dropped.
    Incarnation(u64)
);
id_newtype!(
    /// Index of a shard within its node, in `0..shard_count`.
    ShardId(u16)
);
id_newtype!(
    /// A request id, unique per sending connection. `ReqId::NONE` (zero) means "no request".
    ReqId(u64)
);
id_newtype!(
    /// An active-message handler id.
    AmId(u32)
);
id_newtype!(
    /// An RPC function id.
    FunctionId(u32)
);
id_newtype!(
    /// A registered-memory region id within one shard's region table.
    RegionId(u32)
);
id_newtype!(
    /// A region's generation; revoking a region bumps it, invalidating old grants.
    Generation(u64)
);

impl ReqId {
    /// "No request" (used in frames that are not part of a request).
    pub const NONE: ReqId = ReqId(0);
}

impl Incarnation {
    /// The next incarnation (saturating at `u64::MAX`).
    pub const fn next(self) -> Incarnation {
        Incarnation(self.0.saturating_add(1))
    }
}

impl Generation {
    /// The next generation (saturating at `u64::MAX`; 2^64 revocations do not happen).
    pub const fn next(self) -> Generation {
        Generation(self.0.saturating_add(1))
    }
}

impl ShardId {
    /// The shard index as a `usize`, for indexing per-shard tables.
    pub const fn index(self) -> usize {
        self.0 as usize
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;

    #[test]
    fn conversions_round_trip() {
        assert_eq!(NodeId::from(7u64).get(), 7);
        assert_eq!(u16::from(ShardId::new(3)), 3);
        assert_eq!(ShardId::new(3).index(), 3);
        assert_eq!(Incarnation::new(1).next(), Incarnation::new(2));
        assert_eq!(
            Incarnation::new(u64::MAX).next(),
            Incarnation::new(u64::MAX)
        );
        assert_eq!(Generation::new(4).next().get(), 5);
        assert_eq!(ReqId::NONE.get(), 0);
        assert_eq!(AmId::new(9).to_string(), "9");
        assert!(FunctionId::new(1) < FunctionId::new(2));
        assert_eq!(RegionId::default().get(), 0);
    }
}
