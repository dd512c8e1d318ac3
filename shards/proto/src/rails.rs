//! The rails between two nodes: which local shard talks to which remote shard.
//!
//! Between a node with `N` shards (this one, "local") and a node with `M` shards ("remote")
//! there is a set of *rails*. A rail is a pair (local shard, remote shard) with its own UCX
//! endpoints and its own [`crate::Connection`]. The set is
//!
//! ```text
//! rails(N, M) = { (k mod N, k mod M) : k in 0..max(N, M) }
//! ```
//!
//! so there are exactly `max(N, M)` rails, every shard of either node is on at least one, and
//! the shards of the node with fewer shards carry `ceil` or `floor` of `max / min` rails each.
//! For `N == M` the rails are the same-index pairs `(i, i)`.
//!
//! * [`Rails::default_remote`]`(l) = l mod M` is the remote shard a call made on local shard `l`
//!   goes to when it names no target: `(l, l mod M)` is always a rail, so such a call needs no
//!   cross-shard hop on the sending side.
//! * [`Rails::owner_of_remote`]`(r) = r mod N` is the local shard that holds a rail to remote
//!   shard `r`: a call addressed to shard `r` of the peer from any other local shard is forwarded
//!   there (at most one hop, on the sending side only).
//!
//! # Why not rendezvous hashing
//!
//! [`crate::ShardMap`] spreads *peers* over shards with rendezvous hashing, and each node
//! computes it alone from its own shard count. That cannot define rails: a rail must be owned
//! by the same pair of shards **on both sides**, so that a request arriving on remote shard `r`
//! from local shard `l` is answered by `r` on the rail back to `l`, with no hop on either side.
//! Two independent hashes would pair `l` with `r` on one node and `r` with some other `l'` on the
//! other; replies would then need a forward. The modular construction is symmetric by
//! definition: the set node B computes with `Rails::new(M, N)` is the mirror image of node A's
//! ([`Rails::mirror`]), with no hashing, no state and no communication beyond the two shard
//! counts that the handshake carries. It also balances exactly (rendezvous hashing is balanced
//! only statistically, which matters when there are 4 shards and not 10,000 peers).
//!
//! Shard indices given to the functions here are expected to be in range (`local <
//! local_count`, `remote < remote_count`); [`Rails::has_rail`] answers `false` for any index out
//! of range, and the other functions compute their formula regardless (their result is then no
//! rail). A shard index that came from the network or from a user must be checked first.

use crate::ids::ShardId;
use crate::shard_map::{ShardCountError, MAX_SHARDS};

/// The rails between a local node of `local_count` shards and a remote node of `remote_count`
/// shards. See the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rails {
    local_count: u16,
    remote_count: u16,
}

/// One rail: a local shard and the remote shard it is paired with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Rail {
    /// The shard on this node.
    pub local: ShardId,
    /// The shard on the peer node.
    pub remote: ShardId,
}

impl Rails {
    /// The rails between `local_count` local shards and `remote_count` remote shards (both in
    /// `1..=MAX_SHARDS`).
    pub fn new(local_count: u16, remote_count: u16) -> Result<Rails, ShardCountError> {
        for count in [local_count, remote_count] {
            if count == 0 || count > MAX_SHARDS {
                return Err(ShardCountError {
                    shard_count: u32::from(count),
                });
            }
        }
        Ok(Rails {
            local_count,
            remote_count,
        })
    }

    /// The local node's shard count (`N`).
    pub fn local_count(&self) -> u16 {
        self.local_count
    }

    /// The remote node's shard count (`M`).
    pub fn remote_count(&self) -> u16 {
        self.remote_count
    }

    /// The number of rails, `max(N, M)`.
    pub fn len(&self) -> usize {
        usize::from(self.local_count.max(self.remote_count))
    }

    /// Always `false`: both shard counts are at least 1, so there is at least one rail.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Every rail, as `(k mod N, k mod M)` for `k` in `0..max(N, M)`.
    pub fn iter(&self) -> impl Iterator<Item = Rail> + Clone {
        let (n, m) = (self.local_count, self.remote_count);
        (0..n.max(m)).map(move |k| Rail {
            local: ShardId::new(k % n),
            remote: ShardId::new(k % m),
        })
    }

    /// The remote shard that a call made on `local` with no explicit target goes to:
    /// `local mod M`. `(local, default_remote(local))` is a rail.
    pub fn default_remote(&self, local: ShardId) -> ShardId {
        ShardId::new(local.get() % self.remote_count)
    }

    /// The local shard that holds a rail to `remote`: `remote mod N`, where a call addressed to
    /// that remote shard is forwarded from any other local shard. `(owner_of_remote(remote),
    /// remote)` is a rail.
    pub fn owner_of_remote(&self, remote: ShardId) -> ShardId {
        ShardId::new(remote.get() % self.local_count)
    }

    /// Whether `(local, remote)` is a rail. Out-of-range indices are no rail.
    pub fn has_rail(&self, local: ShardId, remote: ShardId) -> bool {
        let (l, r) = (local.get(), remote.get());
        let (n, m) = (self.local_count, self.remote_count);
        if l >= n || r >= m {
            return false;
        }
        // k runs over 0..max(n, m). When n >= m, k mod n == k, so the only candidate is k = l;
        // otherwise k mod m == k and the only candidate is k = r.
        if n >= m {
            l % m == r
        } else {
            r % n == l
        }
    }

    /// The remote shards that `local` has rails to, in increasing order: `local mod M` alone
    /// when `N >= M`, else `local, local + N, local + 2N, …` below `M`. Empty if `local` is out
    /// of range.
    pub fn remotes_of(&self, local: ShardId) -> impl Iterator<Item = ShardId> + Clone {
        let (n, m) = (self.local_count, self.remote_count);
        let l = local.get();
        let (start, step, end) = if l >= n {
            (0, 1, 0)
        } else if n >= m {
            let r = l % m;
            (r, 1, r + 1)
        } else {
            (l, n, m)
        };
        (start..end).step_by(usize::from(step)).map(ShardId::new)
    }

    /// The local shards that have rails to `remote` (the mirror of [`Rails::remotes_of`]).
    pub fn locals_of(&self, remote: ShardId) -> impl Iterator<Item = ShardId> + Clone {
        self.mirror().remotes_of(remote)
    }

    /// The same rails as the peer node sees them (`N` and `M` swapped); its rails are this
    /// set's, each with local and remote swapped.
    pub fn mirror(&self) -> Rails {
        Rails {
            local_count: self.remote_count,
            remote_count: self.local_count,
        }
    }
}

impl Rail {
    /// The rail as the peer node sees it (local and remote swapped).
    pub fn mirror(self) -> Rail {
        Rail {
            local: self.remote,
            remote: self.local,
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;

    fn s(i: u16) -> ShardId {
        ShardId::new(i)
    }

    fn pairs(r: &Rails) -> Vec<(u16, u16)> {
        r.iter().map(|x| (x.local.get(), x.remote.get())).collect()
    }

    #[test]
    fn counts_are_checked() {
        assert!(Rails::new(0, 1).is_err());
        assert!(Rails::new(1, 0).is_err());
        assert!(Rails::new(MAX_SHARDS + 1, 1).is_err());
        assert_eq!(
            Rails::new(2, MAX_SHARDS + 1).unwrap_err().shard_count,
            u32::from(MAX_SHARDS) + 1
        );
        let r = Rails::new(MAX_SHARDS, 1).unwrap();
        assert_eq!((r.local_count(), r.remote_count()), (MAX_SHARDS, 1));
        assert_eq!(r.len(), usize::from(MAX_SHARDS));
        assert!(!r.is_empty());
    }

    #[test]
    fn two_by_three() {
        let r = Rails::new(2, 3).unwrap();
        assert_eq!(pairs(&r), vec![(0, 0), (1, 1), (0, 2)]);
        assert_eq!(pairs(&r.mirror()), vec![(0, 0), (1, 1), (2, 0)]);
        assert_eq!(r.remotes_of(s(0)).collect::<Vec<_>>(), vec![s(0), s(2)]);
        assert_eq!(r.remotes_of(s(1)).collect::<Vec<_>>(), vec![s(1)]);
        assert_eq!(r.remotes_of(s(2)).count(), 0, "out of range");
        assert_eq!(r.locals_of(s(2)).collect::<Vec<_>>(), vec![s(0)]);
        assert_eq!(r.default_remote(s(1)), s(1));
        assert_eq!(r.owner_of_remote(s(2)), s(0));
        assert!(r.has_rail(s(0), s(2)));
        assert!(!r.has_rail(s(1), s(2)));
        assert!(!r.has_rail(s(2), s(0)), "local out of range");
        assert!(!r.has_rail(s(0), s(3)), "remote out of range");
        let b = r.mirror();
        assert_eq!(b.default_remote(s(2)), s(0));
        assert_eq!(b.owner_of_remote(s(1)), s(1));
        assert_eq!(b.remotes_of(s(0)).collect::<Vec<_>>(), vec![s(0)]);
        assert_eq!(b.remotes_of(s(2)).collect::<Vec<_>>(), vec![s(0)]);
    }

    #[test]
    fn same_counts_pair_equal_indices() {
        let r = Rails::new(4, 4).unwrap();
        assert_eq!(pairs(&r), vec![(0, 0), (1, 1), (2, 2), (3, 3)]);
        for i in 0..4 {
            assert_eq!(r.default_remote(s(i)), s(i));
            assert_eq!(r.owner_of_remote(s(i)), s(i));
            assert_eq!(r.remotes_of(s(i)).collect::<Vec<_>>(), vec![s(i)]);
        }
        assert_eq!(pairs(&Rails::new(1, 1).unwrap()), vec![(0, 0)]);
    }

    #[test]
    fn one_shard_against_many() {
        let r = Rails::new(1, 5).unwrap();
        assert_eq!(r.len(), 5);
        assert_eq!(r.remotes_of(s(0)).count(), 5);
        assert!((0..5).all(|j| r.owner_of_remote(s(j)) == s(0)));
        assert_eq!(r.default_remote(s(0)), s(0));
        let r = r.mirror();
        assert!((0..5).all(|i| r.default_remote(s(i)) == s(0)));
        assert_eq!(
            Rail {
                local: s(3),
                remote: s(0)
            }
            .mirror(),
            Rail {
                local: s(0),
                remote: s(3)
            }
        );
    }

    #[test]
    fn has_rail_agrees_with_iter_for_small_counts() {
        for n in 1..=9 {
            for m in 1..=9 {
                let r = Rails::new(n, m).unwrap();
                let set: std::collections::HashSet<(u16, u16)> = pairs(&r).into_iter().collect();
                assert_eq!(set.len(), r.len(), "{n}x{m}: rails are distinct");
                for l in 0..n + 1 {
                    let remotes: Vec<u16> = r.remotes_of(s(l)).map(ShardId::get).collect();
                    for j in 0..m + 1 {
                        let want = set.contains(&(l, j));
                        assert_eq!(r.has_rail(s(l), s(j)), want, "{n}x{m} ({l},{j})");
                        assert_eq!(remotes.contains(&j), want, "{n}x{m} remotes_of {l}");
                    }
                }
            }
        }
    }
}
