//! One byte vector kept on a shard for reuse, so that a stream of small messages (RPC
//! requests, replies) allocates none.

use std::cell::Cell;

/// A vector kept for the next use: [`SpareVec::take`] hands it out cleared,
/// [`SpareVec::give`] keeps whichever of the given and the kept one has more room, up to a
/// capacity bound (a large one is dropped, so that one large message does not keep its
/// memory for good). Per shard (`!Sync`): it lives in the shard's state.
#[derive(Default)]
pub struct SpareVec {
    kept: Cell<Vec<u8>>,
    min_capacity: usize,
    max_capacity: usize,
}

impl SpareVec {
    /// Keeps vectors of at most `max_capacity` bytes of room; [`SpareVec::take`] reserves
    /// `min_capacity` when it has none to give (0: the caller's encoder reserves).
    pub const fn new(min_capacity: usize, max_capacity: usize) -> Self {
        Self {
            kept: Cell::new(Vec::new()),
            min_capacity,
            max_capacity,
        }
    }

    /// The kept vector, cleared, or a new one with `min_capacity` of room.
    #[inline]
    pub fn take(&self) -> Vec<u8> {
        let mut v = self.kept.take();
        v.clear();
        if v.capacity() < self.min_capacity {
            v.reserve(self.min_capacity);
        }
        v
    }

    /// Keeps `v` for the next [`SpareVec::take`] if it has more room than the vector kept and
    /// no more than the bound; else drops it. A small vector (one made for a request forwarded
    /// from another shard, say) so never displaces a roomier one.
    #[inline]
    pub fn give(&self, v: Vec<u8>) {
        let kept = self.kept.take();
        let keep = if v.capacity() <= self.max_capacity && v.capacity() > kept.capacity() {
            v
        } else {
            kept
        };
        self.kept.set(keep);
    }

    /// The room of the vector kept (0 if none).
    pub fn capacity(&self) -> usize {
        let v = self.kept.take();
        let c = v.capacity();
        self.kept.set(v);
        c
    }
}

impl std::fmt::Debug for SpareVec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpareVec")
            .field("capacity", &self.capacity())
            .field("max_capacity", &self.max_capacity)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_roomier_vector_within_its_bound() {
        let s = SpareVec::new(64, 4096);
        let first = s.take();
        assert!(first.is_empty() && first.capacity() >= 64);
        let mut v = Vec::with_capacity(700);
        v.extend_from_slice(b"abc");
        let ptr = v.as_ptr();
        s.give(v);
        assert_eq!(s.capacity(), 700);
        // A smaller one does not displace it, nor does one over the bound.
        s.give(Vec::with_capacity(5));
        s.give(Vec::with_capacity(8192));
        assert_eq!(s.capacity(), 700);
        // It comes back cleared, the same allocation.
        let back = s.take();
        assert_eq!((back.as_ptr(), back.len(), back.capacity()), (ptr, 0, 700));
        assert_eq!(s.capacity(), 0);
        // With nothing kept and no minimum, nothing is reserved.
        let none = SpareVec::new(0, 4096);
        assert_eq!(none.take().capacity(), 0);
    }
}
