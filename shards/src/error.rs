//! Errors of booting and running shards, and of forwarding work between them.

use thiserror::Error;

use crate::proto::ids::ShardId;

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

/// Why a forwarded call ([`crate::ShardCtx::forward`]) failed.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ForwardError {
    /// The target is not a shard of this set.
    #[error("forward from shard {from} to shard {to}: no such shard ({shard_count} shards)")]
    NoSuchShard {
        /// The calling shard.
        from: ShardId,
        /// The shard asked for.
        to: ShardId,
        /// Number of shards in the set.
        shard_count: usize,
    },
    /// The target shard has failed or left the set (its lanes are closed); the job may or may
    /// not have run.
    #[error("forward from shard {from} to shard {to}: target shard stopped")]
    ShardStopped {
        /// The calling shard.
        from: ShardId,
        /// The target shard.
        to: ShardId,
    },
    /// The calling shard's user future has ended: tasks it left behind may not start new
    /// forwards (forwarded jobs still may).
    #[error("forward from shard {from} to shard {to}: shard {from} is shutting down")]
    ShuttingDown {
        /// The calling shard.
        from: ShardId,
        /// The target shard.
        to: ShardId,
    },
    /// The call comes from a job nested as deep as the mesh allows.
    #[error("forward from shard {from} to shard {to}: nesting depth {depth} is the limit")]
    TooDeep {
        /// The calling shard.
        from: ShardId,
        /// The target shard.
        to: ShardId,
        /// The caller's nesting depth.
        depth: usize,
    },
    /// The job panicked on the target shard (the target keeps running).
    #[error("forwarded job panicked on shard {shard}: {message}")]
    JobPanicked {
        /// The shard the job ran on.
        shard: ShardId,
        /// The panic message, when it was a string.
        message: String,
    },
}
