//! Size-class allocator over offsets of a fixed arena.
//!
//! Each shard registers a few large memory arenas with UCX once, at start, and carves them into
//! buffers. [`SizeClassPool`] does the carving on *offsets* only: it never touches memory, so it
//! needs no unsafe code and the shard maps `offset..offset + len` onto its registered arena.
//!
//! The size classes are the powers of two from `min_class` to `max_class` (by default 256 B to
//! 4 MiB). Allocation is a binary buddy scheme: a request is rounded up to its class; a free block
//! of that class is used if there is one, otherwise the smallest larger free block is split in
//! halves down to the class. Freeing merges a block with its buddy (`offset ^ size`) while both
//! are free, up to the size of the top-level chunk they came from. The arena is cut into
//! top-level chunks greedily: as many `max_class` chunks as fit, then one chunk of each smaller
//! power of two that still fits, so every byte down to `min_class` is usable.
//!
//! Invariants (checked by the tests): a block of size `s` starts at a multiple of `s` (so at
//! least 64-byte aligned when `min_class >= 64`, relative to the arena base, which the caller
//! aligns to a page); live blocks never overlap; freeing everything restores the initial free
//! space exactly; a block can be freed once ([`PoolError::DoubleFree`] otherwise).

use std::collections::{BTreeMap, BTreeSet};
use thiserror::Error;

/// Pool geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Arena size in bytes.
    pub arena_len: u64,
    /// Smallest class (a power of two, at least 64).
    pub min_class: u64,
    /// Largest class (a power of two, at least `min_class`).
    pub max_class: u64,
}

/// A size class: index 0 is `min_class`, each next one doubles.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SizeClass(u8);

/// An allocated block: `offset..offset + len` of the arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Block {
    /// Offset from the arena base; a multiple of `len`.
    pub offset: u64,
    /// Size of the block (its class size, at least the length requested).
    pub len: u64,
    /// The block's class.
    pub class: SizeClass,
}

/// Per-class counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClassStats {
    /// The class size in bytes.
    pub size: u64,
    /// Blocks of this class allocated now.
    pub in_use: u64,
    /// Free blocks of exactly this size now (splitting can make more).
    pub free: u64,
    /// The most blocks of this class allocated at once.
    pub high_water: u64,
    /// Allocations of this class that failed for lack of space.
    pub failures: u64,
    /// Successful allocations of this class.
    pub allocs: u64,
}

/// Whole-pool counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Per class, smallest first.
    pub classes: Vec<ClassStats>,
    /// Bytes in allocated blocks.
    pub bytes_in_use: u64,
    /// Bytes in free blocks.
    pub bytes_free: u64,
    /// Requests larger than the largest class.
    pub too_large: u64,
}

/// Pool errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum PoolError {
    /// The configuration is not usable.
    #[error("bad pool config: {why}")]
    BadConfig {
        /// What is wrong.
        why: &'static str,
    },
    /// The block is not allocated (freed twice, or never handed out by this pool).
    #[error("block at offset {offset} (len {len}) is not allocated")]
    DoubleFree {
        /// The block's offset.
        offset: u64,
        /// The block's length.
        len: u64,
    },
}

/// A buddy allocator over arena offsets with power-of-two size classes. See the module docs.
#[derive(Clone, Debug)]
pub struct SizeClassPool {
    cfg: PoolConfig,
    min_shift: u32,
    /// Free blocks per class (offsets, sorted for deterministic choice).
    free: Vec<BTreeSet<u64>>,
    /// Allocated blocks: offset → class index.
    allocated: BTreeMap<u64, u8>,
    /// Top-level chunks: offset → class index of the chunk (merging stops there).
    chunks: BTreeMap<u64, u8>,
    stats: Vec<ClassStats>,
    too_large: u64,
    bytes_in_use: u64,
}

impl PoolConfig {
    /// `arena_len` bytes with classes 256 B ..= 4 MiB.
    pub fn new(arena_len: u64) -> PoolConfig {
        PoolConfig {
            arena_len,
            min_class: 256,
            max_class: 4 << 20,
        }
    }
}

impl SizeClass {
    /// The class index (0 = smallest).
    pub fn index(self) -> usize {
        usize::from(self.0)
    }
}

impl Block {
    /// The byte range of the block within the arena.
    pub fn range(&self) -> std::ops::Range<u64> {
        self.offset..self.offset + self.len
    }
}

impl SizeClassPool {
    /// A pool over `cfg.arena_len` bytes.
    pub fn new(cfg: PoolConfig) -> Result<SizeClassPool, PoolError> {
        if !cfg.min_class.is_power_of_two() || cfg.min_class < 64 {
            return Err(PoolError::BadConfig {
                why: "min_class must be a power of two of at least 64",
            });
        }
        if !cfg.max_class.is_power_of_two() || cfg.max_class < cfg.min_class {
            return Err(PoolError::BadConfig {
                why: "max_class must be a power of two of at least min_class",
            });
        }
        let min_shift = cfg.min_class.trailing_zeros();
        let classes = (cfg.max_class.trailing_zeros() - min_shift + 1) as usize;
        let mut pool = SizeClassPool {
            cfg,
            min_shift,
            free: vec![BTreeSet::new(); classes],
            allocated: BTreeMap::new(),
            chunks: BTreeMap::new(),
            stats: (0..classes)
                .map(|c| ClassStats {
                    size: cfg.min_class << c,
                    ..ClassStats::default()
                })
                .collect(),
            too_large: 0,
            bytes_in_use: 0,
        };
        let mut cursor = 0u64;
        for c in (0..classes).rev() {
            let size = cfg.min_class << c;
            while cfg.arena_len - cursor >= size {
                pool.free[c].insert(cursor);
                pool.chunks.insert(cursor, c as u8);
                cursor += size;
                if c + 1 < classes {
                    // Below the top class, one chunk of each size is all that fits.
                    break;
                }
            }
        }
        Ok(pool)
    }

    /// The configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.cfg
    }

    /// The number of size classes.
    pub fn class_count(&self) -> usize {
        self.free.len()
    }

    /// The class that serves `len` bytes, or `None` if it is above `max_class`.
    pub fn class_for(&self, len: u64) -> Option<SizeClass> {
        if len > self.cfg.max_class {
            return None;
        }
        let size = len.max(self.cfg.min_class).next_power_of_two();
        Some(SizeClass((size.trailing_zeros() - self.min_shift) as u8))
    }

    /// The size of `class`.
    pub fn class_size(&self, class: SizeClass) -> u64 {
        self.cfg.min_class << class.0
    }

    /// Allocates a block of at least `len` bytes, or `None` when no space is left in that class
    /// (counted in [`ClassStats::failures`]) or `len` is above `max_class`.
    pub fn alloc(&mut self, len: u64) -> Option<Block> {
        let Some(class) = self.class_for(len) else {
            self.too_large += 1;
            return None;
        };
        let want = class.index();
        let Some(from) = (want..self.free.len()).find(|&c| !self.free[c].is_empty()) else {
            self.stats[want].failures += 1;
            return None;
        };
        let offset = self.free[from].pop_first()?;
        // Split down to the wanted class, keeping the lower half and freeing the upper.
        for c in (want..from).rev() {
            self.free[c].insert(offset + (self.cfg.min_class << c));
        }
        self.allocated.insert(offset, class.0);
        let s = &mut self.stats[want];
        s.in_use += 1;
        s.allocs += 1;
        s.high_water = s.high_water.max(s.in_use);
        self.bytes_in_use += self.class_size(class);
        Some(Block {
            offset,
            len: self.class_size(class),
            class,
        })
    }

    /// Returns a block. Fails, changing nothing, if it is not currently allocated as given.
    pub fn free(&mut self, block: Block) -> Result<(), PoolError> {
        match self.allocated.get(&block.offset) {
            Some(&c) if c == block.class.0 && self.class_size(block.class) == block.len => {}
            _ => {
                return Err(PoolError::DoubleFree {
                    offset: block.offset,
                    len: block.len,
                })
            }
        }
        self.allocated.remove(&block.offset);
        let class = block.class.index();
        self.stats[class].in_use -= 1;
        self.bytes_in_use -= block.len;
        let mut offset = block.offset;
        let mut c = class;
        loop {
            let chunk_class = self.chunk_class_of(offset);
            if c >= chunk_class {
                break;
            }
            let size = self.cfg.min_class << c;
            let buddy = offset ^ size;
            if !self.free[c].remove(&buddy) {
                break;
            }
            offset = offset.min(buddy);
            c += 1;
        }
        self.free[c].insert(offset);
        Ok(())
    }

    /// Counters.
    pub fn stats(&self) -> PoolStats {
        let mut classes = self.stats.clone();
        let mut bytes_free = 0;
        for (c, s) in classes.iter_mut().enumerate() {
            s.free = self.free[c].len() as u64;
            bytes_free += s.free * s.size;
        }
        PoolStats {
            classes,
            bytes_in_use: self.bytes_in_use,
            bytes_free,
            too_large: self.too_large,
        }
    }

    /// Bytes in allocated blocks.
    pub fn bytes_in_use(&self) -> u64 {
        self.bytes_in_use
    }

    /// The class index of the top-level chunk containing `offset`.
    fn chunk_class_of(&self, offset: u64) -> usize {
        self.chunks
            .range(..=offset)
            .next_back()
            .map_or(0, |(_, &c)| usize::from(c))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;

    fn small() -> SizeClassPool {
        SizeClassPool::new(PoolConfig {
            arena_len: 4096 + 1024 + 256 + 100,
            min_class: 256,
            max_class: 4096,
        })
        .unwrap()
    }

    #[test]
    fn config_is_validated() {
        let bad = |min, max| {
            SizeClassPool::new(PoolConfig {
                arena_len: 1 << 20,
                min_class: min,
                max_class: max,
            })
        };
        assert!(bad(32, 4096).is_err());
        assert!(bad(300, 4096).is_err());
        assert!(bad(4096, 256).is_err());
        assert!(bad(256, 256).is_ok());
        assert_eq!(
            SizeClassPool::new(PoolConfig::new(0)).unwrap().alloc(1),
            None
        );
    }

    #[test]
    fn carving_uses_the_whole_arena() {
        let p = small();
        let s = p.stats();
        assert_eq!(s.bytes_free, 4096 + 1024 + 256);
        assert_eq!(p.class_count(), 5);
        assert_eq!(s.classes[4].free, 1);
        assert_eq!(s.classes[2].free, 1);
        assert_eq!(s.classes[0].free, 1);
    }

    #[test]
    fn classes_round_up() {
        let p = small();
        assert_eq!(p.class_for(1), Some(SizeClass(0)));
        assert_eq!(p.class_for(256), Some(SizeClass(0)));
        assert_eq!(p.class_for(257), Some(SizeClass(1)));
        assert_eq!(p.class_for(4096), Some(SizeClass(4)));
        assert_eq!(p.class_for(4097), None);
        assert_eq!(p.class_size(SizeClass(3)), 2048);
    }

    #[test]
    fn alloc_split_merge_and_double_free() {
        let mut p = small();
        let blocks: Vec<Block> = (0..22).map_while(|_| p.alloc(256)).collect();
        // 4096/256 + 1024/256 + 1 = 21 blocks of 256.
        assert_eq!(blocks.len(), 21);
        assert_eq!(p.stats().classes[0].failures, 1);
        let mut ranges: Vec<_> = blocks.iter().map(Block::range).collect();
        ranges.sort_by_key(|r| r.start);
        for w in ranges.windows(2) {
            assert!(w[0].end <= w[1].start, "overlap");
        }
        for b in &blocks {
            assert_eq!(b.offset % b.len, 0);
            assert_eq!(b.offset % 64, 0);
        }
        for b in &blocks {
            p.free(*b).unwrap();
        }
        assert_eq!(
            p.free(blocks[0]),
            Err(PoolError::DoubleFree {
                offset: blocks[0].offset,
                len: 256
            })
        );
        let s = p.stats();
        assert_eq!(s.bytes_in_use, 0);
        assert_eq!(s.bytes_free, 4096 + 1024 + 256);
        assert_eq!(s.classes[4].free, 1, "buddies merged back to the top chunk");
        assert_eq!(s.classes[0].high_water, 21);
        assert!(p.alloc(4096).is_some());
    }

    #[test]
    fn wrong_class_or_unknown_offset_is_rejected() {
        let mut p = small();
        let b = p.alloc(300).unwrap();
        assert_eq!(b.len, 512);
        assert!(p
            .free(Block {
                len: 256,
                class: SizeClass(0),
                ..b
            })
            .is_err());
        assert!(p
            .free(Block {
                offset: b.offset + 512,
                ..b
            })
            .is_err());
        assert_eq!(p.bytes_in_use(), 512);
        p.free(b).unwrap();
        assert_eq!(p.alloc(1 << 20), None);
        assert_eq!(p.stats().too_large, 1);
    }
}
