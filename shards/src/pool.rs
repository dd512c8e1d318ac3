//! A shard's registered memory pool: one arena registered with UCX once, carved by proto's
//! [`SizeClassPool`].

use std::cell::RefCell;
use std::rc::Rc;

use crate::proto::pool::{Block, PoolConfig, PoolError, SizeClassPool};
use crate::ucx::{Context, MemHandle};

/// One registered arena and its allocator. `!Send`: it belongs to its shard.
pub struct ShardPool {
    mem: Rc<MemHandle>,
    carve: RefCell<SizeClassPool>,
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
            carve: RefCell::new(carve),
        })
    }

    /// The registered arena.
    pub fn memory(&self) -> &Rc<MemHandle> {
        &self.mem
    }

    /// A block of at least `len` bytes, or `None` when the pool has none free.
    pub fn alloc(&self, len: usize) -> Option<Block> {
        self.carve.borrow_mut().alloc(len as u64)
    }

    /// Give `block` back.
    pub fn free(&self, block: Block) -> Result<(), PoolError> {
        self.carve.borrow_mut().free(block)
    }

    /// Bytes handed out and not yet freed.
    pub fn bytes_in_use(&self) -> u64 {
        self.carve.borrow().bytes_in_use()
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
