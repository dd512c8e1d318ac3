//! # shardcx-shards: the runtime inside a core
//!
//! This crate is where glommio, the sans-IO protocol core ([`proto`]) and the safe UCX layer
//! ([`ucx`]) meet: every shard is one glommio executor (one thread, pinned to a core by
//! default) that alone owns a UCX context and worker, a registered-memory pool and a progress
//! driver. The facade crate reaches UCX only through the re-exports below.
//!
//! ## The model
//!
//! [`ShardsBuilder`] is a `Send` recipe (shard count, [`Placement`], UCX transports and
//! features, pool size, [`DriverConfig`]). [`ShardsBuilder::run`] starts one executor thread per
//! shard; inside it, the shard builds its [`ShardCtx`] — its own UCX [`ucx::Context`] (one per
//! shard, never shared: a shared context serialises registration-cache locks across cores), its
//! own [`ucx::Worker`] (`UCS_THREAD_MODE_SINGLE`), a [`ShardPool`] (one arena registered with
//! UCX once and carved by proto's size-class allocator) and its progress driver — then runs the
//! caller's future with an `Rc<ShardCtx>`. When that future ends, the driver and its waker
//! thread stop and the shard's state is destroyed on its own thread.
//!
//! ## Progress
//!
//! UCX advances only when the worker is progressed on its thread. The [`driver`] is one task per
//! shard: it progresses in a loop, dispatching received frames to their handlers right after
//! each `progress` and yielding once a round found work, while events come and for a spin
//! window after the last one, then arms the worker and sleeps
//! until the worker's event fd is readable (through a small waker thread; see the module docs
//! for why). An idle shard therefore costs no CPU, and a busy one never sleeps.
//!
//! ## Nodes
//!
//! A shard set is one *node*, with a [`proto::NodeId`] ([`ShardsBuilder::node_id`], random by
//! default), an incarnation fresh for every run, and a pre-shared key ([`ShardsBuilder::psk`]).
//! A node may listen ([`ShardsBuilder::listen`]); any shard may [`ShardCtx::connect`] to
//! another node's listener. Every shard then has its own rails to the other node's shards,
//! authenticated by one proto handshake per node pair, with heartbeats per rail; a call for a
//! rail another local shard holds is forwarded to it through the mesh ([`ShardCtx::send_am`],
//! [`ShardCtx::set_net_handler`]). See [`net`].
//!
//! ## Per-shard state of subsystems
//!
//! Subsystems built on a shard ([`tag`], [`rma`], [`rma_trusted`], and the facade's node and
//! RPC state) keep their state in the shard's *extension slot*: a small map from a type to one
//! `Rc` of it, owned by the [`ShardCtx`] ([`ShardCtx::ext`], [`ShardCtx::ext_or_insert_with`];
//! see [`boot`], "Extensions"). Not in thread-locals: a shard's state cannot outlive it or be
//! found by another run on the same thread, and it is torn down at a defined point of the
//! shard's shutdown, newest first. The one thread-local of this crate is the mesh's nesting
//! depth (see [`mesh`]), which describes the code being polled, not the shard.
//!
//! ## Invariants
//!
//! - A [`ShardCtx`] is built inside its thread and never leaves it; UCX handles are never shared
//!   between shards.
//! - The driver is the only caller of `progress`, `arm` and of the sleep; it never blocks the
//!   executor (it awaits a socket).
//! - Shutdown leaves no thread blocked forever: the waker thread waits on the event fd with a
//!   timeout and exits when the driver's socket closes.
//! - A shard's extension slot is emptied, newest value first, once its connections are closed
//!   and its driver has stopped, and before its UCX worker, pool and context are destroyed;
//!   from then on it keeps nothing.
//!
//! ## What is `Send`, and why
//!
//! [`ShardsBuilder`], [`Placement`], [`DriverConfig`], [`NetConfig`], [`BootError`],
//! [`NetError`], [`RemoteNode`] and [`Directory`] are `Send`: they are settings, handles and
//! results that cross threads. [`ShardCtx`] and [`ShardPool`] are `!Send`: they
//! hold UCX handles made for one thread, and `Rc`/`RefCell` state. A shard's
//! [`cuda::ShardCuda`] (its CUDA mode, probe and device) holds process-wide driver handles only
//! and is `Send + Sync`.
//!
//! ## What the machine needs
//!
//! - io_uring (Linux 5.8 or later, not disabled by seccomp or `io_uring_disabled`): glommio
//!   needs it; without it [`ShardsBuilder::run`] returns [`BootError::Executor`].
//! - Locked memory: each executor locks its io memory. The builder reads `RLIMIT_MEMLOCK` from
//!   `/proc/self/limits` and gives each executor `(limit - 1 MiB) / shards` (at most 2 MiB, at
//!   least 64 KiB), or fails with [`BootError::MemlockTooSmall`] naming the limit and the need.
//!   Several sets in one process (tests, the `two_nodes` example) set it themselves with
//!   [`ShardsBuilder::io_memory`].
//! - Connections between nodes: the `tcp` transport for the listener and socket-address
//!   connects (UCX 1.12), and `/dev/urandom` for node ids and handshake nonces.
//! - UCX with `UCP_FEATURE_WAKEUP` (always requested) and the transports asked for.
//! - CUDA is optional: each shard probes at start ([`cuda`]); without `libcuda` or a device it
//!   runs with CUDA off and says why.

pub mod boot;
pub mod cuda;
pub mod driver;
mod error;
pub mod mesh;
pub mod net;
pub mod pool;
pub mod rma;
pub mod rma_trusted;
mod spare;
pub mod stall;
pub mod tag;

pub use boot::{
    memlock_limit, Placement, ShardCtx, ShardsBuilder, MM_FIFO_ELEM_ENV, MM_FIFO_ELEM_SIZE,
    PREEMPT_TIMER, TCP_CONN_NB, TCP_CONN_NB_ENV,
};
pub use driver::DriverConfig;
pub use error::{BootError, ForwardError, NetError};
pub use mesh::{MeshConfig, MeshStats};
pub use net::{Directory, NetConfig, NetStats, RailStates, RemoteNode, Traffic};
pub use pool::{PoolBuf, ShardPool};
pub use rma::{RemoteRegion, RmaOpError, RmaStats};
pub use shardcx_ucx::{SendBuf, SharedElems};
pub use spare::SpareVec;
pub use tag::{TagConfig, TagStats};

pub use shardcx_proto as proto;
pub use shardcx_ucx as ucx;
