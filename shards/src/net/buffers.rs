//! Receive buffers for rendezvous data that no handler chose a buffer for.
//!
//! Such data lands in a block of the shard's registered pool ([`crate::ShardPool`]) when one
//! of its size class is free, else in a vector from the shard's receive cache: vectors of
//! power-of-two sizes (4 KiB and up), each allocated and zeroed once, handed out again as soon
//! as the payload holding it is dropped, and reused without being cleared (the pull overwrites
//! the bytes the payload exposes; the rest is never shown). In the steady state of a
//! bandwidth-bound connection no buffer is allocated and no byte is zeroed per message: the
//! counters [`super::NetStats::rndv_pooled`], [`super::NetStats::rndv_recycled`] and
//! [`super::NetStats::rndv_allocated`] say which of the three each transfer took.
//!
//! The cache keeps at most [`super::NetConfig::rndv_cache_bytes`] of idle vectors per shard;
//! a payload dropped when the cache is full frees its vector. A payload kept with
//! [`RecycledBuf::into_vec`] leaves the cache for good (no copy).

use std::cell::RefCell;
use std::rc::{Rc, Weak};

/// Smallest cached vector: 4 KiB (`1 << MIN_SHIFT`).
const MIN_SHIFT: u32 = 12;

/// Idle receive vectors of one shard, by size class.
pub(super) struct RecvCache {
    /// `classes[c]` holds idle vectors of `1 << (MIN_SHIFT + c)` bytes.
    classes: Vec<Vec<Vec<u8>>>,
    /// Bytes of the idle vectors.
    idle: usize,
    /// Most idle bytes kept.
    limit: usize,
}

/// A vector from a shard's receive cache holding `len` bytes of received data; it goes back to
/// the cache when dropped.
pub struct RecycledBuf {
    buf: Vec<u8>,
    len: usize,
    home: Weak<RefCell<RecvCache>>,
}

impl RecvCache {
    pub(super) fn new(limit: usize) -> Rc<RefCell<RecvCache>> {
        Rc::new(RefCell::new(RecvCache {
            classes: Vec::new(),
            idle: 0,
            limit,
        }))
    }

    /// The size class of `len` bytes and its vectors' length.
    fn class_of(len: usize) -> (usize, usize) {
        let size = len.max(1 << MIN_SHIFT).next_power_of_two();
        ((size.trailing_zeros() - MIN_SHIFT) as usize, size)
    }

    /// An idle vector of at least `len` bytes, if one is cached.
    fn take(&mut self, len: usize) -> Option<Vec<u8>> {
        let (class, _) = Self::class_of(len);
        let v = self.classes.get_mut(class)?.pop()?;
        self.idle -= v.len();
        Some(v)
    }

    /// Keeps `v` for a later transfer, unless the cache is full (or `v` is not one of its
    /// vectors: then it is freed).
    fn put(&mut self, v: Vec<u8>) {
        let n = v.len();
        if n < 1 << MIN_SHIFT || !n.is_power_of_two() || self.idle + n > self.limit {
            return;
        }
        let (class, _) = Self::class_of(n);
        if self.classes.len() <= class {
            self.classes.resize_with(class + 1, Vec::new);
        }
        self.idle += n;
        self.classes[class].push(v);
    }
}

/// A receive vector of at least `len` bytes from `cache`: a recycled one (`true`) or a new one
/// of its size class (`false`).
pub(super) fn recv_vec(cache: &Rc<RefCell<RecvCache>>, len: usize) -> (Vec<u8>, bool) {
    match cache.borrow_mut().take(len) {
        Some(v) => (v, true),
        None => (vec![0u8; RecvCache::class_of(len).1], false),
    }
}

impl RecycledBuf {
    /// `len` bytes of data at the start of `buf`, a vector of `cache`.
    pub(super) fn new(buf: Vec<u8>, len: usize, cache: &Rc<RefCell<RecvCache>>) -> RecycledBuf {
        RecycledBuf {
            len: len.min(buf.len()),
            buf,
            home: Rc::downgrade(cache),
        }
    }

    /// The received bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.buf[..self.len]
    }

    /// The received bytes as a vector of their length, without a copy: the vector leaves the
    /// cache.
    pub fn into_vec(mut self) -> Vec<u8> {
        let mut v = std::mem::take(&mut self.buf);
        v.truncate(self.len);
        v
    }

    /// The whole vector (for a pull into it), leaving this buffer empty.
    pub(super) fn take_vec(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.buf)
    }

    /// Puts `v` back after a pull of `len` bytes into it.
    pub(super) fn restore(&mut self, v: Vec<u8>, len: usize) {
        self.len = len.min(v.len());
        self.buf = v;
    }
}

impl Drop for RecycledBuf {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.buf);
        if v.is_empty() {
            return;
        }
        if let Some(home) = self.home.upgrade() {
            if let Ok(mut cache) = home.try_borrow_mut() {
                cache.put(v);
            }
        }
    }
}

impl std::fmt::Debug for RecycledBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RecycledBuf({} of {} bytes)", self.len, self.buf.len())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;

    #[test]
    fn vectors_come_back_by_class_and_within_the_limit() {
        let cache = RecvCache::new((3 << 20) - 1);
        let (v, again) = recv_vec(&cache, 10_000);
        assert!(!again);
        assert_eq!(v.len(), 16 << 10);
        let ptr = v.as_ptr();
        let b = RecycledBuf::new(v, 10_000, &cache);
        assert_eq!(b.as_slice().len(), 10_000);
        drop(b);
        // The same vector again, for any length of its class, not cleared.
        let (v, again) = recv_vec(&cache, 9_000);
        assert!(again);
        assert_eq!(v.as_ptr(), ptr);
        // Another class: a new vector.
        let (w, again) = recv_vec(&cache, 1 << 20);
        assert!(!again);
        assert_eq!(w.len(), 1 << 20);
        // A 1 MiB and a 2 MiB vector do not fit a cache of just under 3 MiB together.
        let (x, _) = recv_vec(&cache, (1 << 20) + 1);
        drop(RecycledBuf::new(w, 1 << 20, &cache));
        drop(RecycledBuf::new(x, 5, &cache));
        assert_eq!(cache.borrow().idle, 1 << 20);
        drop(RecycledBuf::new(v, 1, &cache));
        assert_eq!(cache.borrow().idle, (1 << 20) + (16 << 10));
    }

    #[test]
    fn a_kept_payload_leaves_the_cache_without_a_copy() {
        let cache = RecvCache::new(1 << 20);
        let (mut v, _) = recv_vec(&cache, 5_000);
        v[..3].copy_from_slice(b"abc");
        let ptr = v.as_ptr();
        let kept = RecycledBuf::new(v, 3, &cache).into_vec();
        assert_eq!(kept, b"abc");
        assert_eq!(kept.as_ptr(), ptr);
        assert_eq!(cache.borrow().idle, 0);
        // Small lengths still use the smallest class.
        assert_eq!(RecvCache::class_of(1), (0, 4096));
        assert_eq!(RecvCache::class_of(4097), (1, 8192));
    }
}
