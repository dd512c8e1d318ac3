//! A shard's registered memory pool: one arena registered with UCX once, carved by proto's
//! [`SizeClassPool`] into [`PoolBuf`]s.
//!
//! A [`PoolBuf`] is an exclusive lease on a block of the arena ([`MemSlice`]): it carries the
//! arena's registration, so operations on it need no registration of their own, and it can be
//! handed to any operation as an owned buffer. Its block goes back to the allocator only when the
//! lease ends: when the buffer is dropped, or, if an operation owning it was cancelled, when UCX
//! has completed that operation. A block is therefore never handed out twice while UCX may still
//! write it.

use std::cell::RefCell;
use std::rc::Rc;

use crate::proto::pool::{PoolConfig, PoolError, PoolStats, SizeClassPool};
use crate::ucx::{Context, MemHandle, MemSlice};

/// A buffer from a shard's registered pool: a [`MemSlice`] whose block returns to the pool when
/// the lease ends. Use it wherever an operation takes a buffer (`IoBuf`/`IoBufMut`).
pub type PoolBuf = MemSlice;

/// One registered arena and its allocator. `!Send`: it belongs to its shard.
pub struct ShardPool {
    mem: Rc<MemHandle>,
    carve: Rc<RefCell<SizeClassPool>>,
}

impl ShardPool {
    /// Allocate and register `arena_len` bytes with `context`, carved with proto's default
    /// size classes (256 B ..= 4 MiB, capped to the arena).
    pub fn new(context: &Context, arena_len: usize) -> Result<Self, PoolNewError> {
        let mem = MemHandle::allocate(context, arena_len).map_err(PoolNewError::Ucx)?;
        let mut cfg = PoolConfig::new(arena_len as u64);
        // The largest class must fit the arena: round the arena down to a power of two.
        let top = if arena_len.is_power_of_two() {
            arena_len as u64
        } else {
            (arena_len.next_power_of_two() / 2) as u64
        };
        cfg.max_class = cfg.max_class.min(top).max(cfg.min_class);
        let carve = SizeClassPool::new(cfg).map_err(PoolNewError::Pool)?;
        Ok(Self {
            mem: Rc::new(mem),
            carve: Rc::new(RefCell::new(carve)),
        })
    }

    /// The registered arena.
    pub fn memory(&self) -> &Rc<MemHandle> {
        &self.mem
    }

    /// A buffer of exactly `len` bytes (from a block of its size class), or `None` when `len`
    /// is zero, larger than the largest class, or no block of its class is free.
    pub fn alloc(&self, len: usize) -> Option<PoolBuf> {
        if len == 0 {
            return None;
        }
        let block = self.carve.borrow_mut().alloc(len as u64)?;
        let offset = usize::try_from(block.offset).ok();
        let slice = offset.and_then(|off| self.mem.slice(off, len).ok());
        let Some(slice) = slice else {
            // Cannot happen (blocks lie inside the arena and are never leased twice); give the
            // block back rather than lose it.
            let _ = self.carve.borrow_mut().free(block);
            return None;
        };
        let carve = Rc::downgrade(&self.carve);
        Some(slice.on_release(move || {
            // The pool may be gone already (shard shutdown): then so is its arena's allocator.
            if let Some(carve) = carve.upgrade() {
                if let Ok(mut carve) = carve.try_borrow_mut() {
                    let _ = carve.free(block);
                }
            }
        }))
    }

    /// Bytes of blocks handed out and not yet returned.
    pub fn bytes_in_use(&self) -> u64 {
        self.carve.borrow().bytes_in_use()
    }

    /// Per-class counters of the allocator.
    pub fn stats(&self) -> PoolStats {
        self.carve.borrow().stats()
    }
}

/// Why a pool could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PoolNewError {
    /// UCX refused the memory.
    #[error("ucx: {0}")]
    Ucx(#[source] crate::ucx::Error),
    /// The allocator refused the geometry.
    #[error("pool: {0}")]
    Pool(#[source] PoolError),
}
