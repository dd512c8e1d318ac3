//! Errors of booting and running shards.

use thiserror::Error;

/// Why shards could not start or run.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum BootError {
    /// The executors' io memory does not fit the locked-memory limit.
    #[error(
        "locked memory too small: RLIMIT_MEMLOCK is {limit} bytes, {shard_count} shards need \
         {need} bytes (raise it with `ulimit -l` or use fewer shards)"
    )]
    MemlockTooSmall {
        /// The limit read from `/proc/self/limits`, in bytes.
        limit: u64,
        /// Bytes needed for all shards.
        need: u64,
        /// Number of shards asked for.
        shard_count: usize,
    },
    /// A glommio executor could not be created (io_uring missing or refused, a bad CPU).
    #[error("shard {shard}: cannot create its executor (is io_uring available?): {reason}")]
    Executor {
        /// The shard's index.
        shard: usize,
        /// glommio's error, as text (glommio's error type is not `Send`).
        reason: String,
    },
    /// UCX refused to create a shard's context, worker or memory.
    #[error("shard {shard}: ucx: {source}")]
    Ucx {
        /// The shard's index.
        shard: usize,
        /// The UCX error.
        #[source]
        source: crate::ucx::Error,
    },
    /// The memory pool's geometry was refused.
    #[error("shard {shard}: memory pool: {source}")]
    Pool {
        /// The shard's index.
        shard: usize,
        /// The pool error.
        #[source]
        source: crate::proto::pool::PoolError,
    },
    /// The progress driver's waker could not be set up.
    #[error("shard {shard}: progress driver: {source}")]
    Driver {
        /// The shard's index.
        shard: usize,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A setting was invalid.
    #[error("invalid setting: {0}")]
    Config(&'static str),
    /// A shard's thread panicked.
    #[error("shard {shard} panicked")]
    Panicked {
        /// The shard's index.
        shard: usize,
    },
}
