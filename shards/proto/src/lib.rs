//! # shardcx-proto: the sans-IO protocol core of shardcx
//!
//! Everything shardcx says on the wire, and every decision it takes about peers, lives in this
//! crate, which performs no I/O, reads no clock, draws no OS randomness, contains no unsafe code
//! and depends on no runtime (neither glommio nor UCX). It can therefore be tested exactly and
//! deterministically on any machine, including under a simulated network ([`sim`]).
//!
//! ## The model
//!
//! The design follows quinn-proto. Each protocol object is a plain state machine:
//!
//! * **inputs** are method calls `handle_*(now, …)`, made by the owner (a shard) when something
//!   happens: a frame arrived, a timer fired, the transport failed;
//! * **outputs** are pulled with `poll_*()`: frames to send (`poll_transmit`), things to react
//!   to (`poll_event`), entries that expired (`poll_expired`), and `poll_timeout()`, the next
//!   instant at which the owner must call `handle_timeout` (or the equivalent);
//! * **time** is a [`Timestamp`] passed in by the caller (nanoseconds since an epoch of its
//!   choice); deadlines are timestamps and [`Timestamp::MAX`] means none. All time arithmetic
//!   saturates, so a timeout of [`std::time::Duration::MAX`] is simply "never".
//!
//! The calling order is documented on each type ([`Connection`], [`Handshake`],
//! [`PendingTable`]). In short: after every input, drain the outputs, then re-arm the timer.
//!
//! ## What is here
//!
//! * [`ids`] — newtypes for every identifier ([`NodeId`], [`Incarnation`], [`ShardId`], …).
//! * [`time`] — [`Timestamp`].
//! * [`shard_map`] — [`ShardMap`]: which shard owns which peer (rendezvous hashing with a stable,
//!   hand-written SipHash-2-4).
//! * [`rails`] — [`Rails`]: the (local shard, remote shard) pairs that carry traffic between two
//!   nodes, each with its own connection, the same set seen from both sides.
//! * [`wire`] — the 48-byte frame header, the 64-bit tag layout and the message size limit; the
//!   format is specified in that module's documentation.
//! * [`handshake`] — hello / welcome / confirm / reject with version and feature negotiation and
//!   a pre-shared-key proof (HMAC-SHA-256) from both sides, which leaves both with a
//!   [`SessionSecret`]; join / joined, with which the other rails of a node pair join that
//!   authenticated session.
//! * [`conn`] — [`Connection`], one per rail: handshake (primary) or join, heartbeats with
//!   suspicion and death, reconnection with jittered exponential backoff, draining, incarnation
//!   and shard checks.
//! * [`request`] — [`PendingTable`] (deadlines; exactly one completion per request),
//!   [`DedupWindow`] (at-most-once RPC), [`CreditWindow`] (flow control).
//! * [`pool`] — [`SizeClassPool`]: a buddy allocator over offsets of a registered arena.
//! * [`region`] — [`RegionTable`]: checked remote memory (bounds, permissions, generation and
//!   grantee checks for put / get), and the RMA frame payloads.
//! * [`rpc`] — the RPC envelope: request prefix (schema hash, [`CallFlags`]) before the rkyv
//!   argument archive, error bodies ([`RpcErrorCode`], detail, message) and cancel frames.
//! * [`staging`] — [`Staging`]: the scheduler of CUDA's staging pipeline (device memory moved in
//!   1–4 MiB chunks through host bounce buffers, copies overlapped with the network), written
//!   against a [`CopyEngine`] trait.
//! * [`rng`] — [`Rng`], a small seeded generator (xoshiro256**), for jitter and simulation.
//! * [`fuzzing`] — the decoder checks run by the cargo-fuzz targets in `fuzz/` and by the
//!   corpus replay test.
//! * [`sim`] — a deterministic network simulator driving real [`Connection`]s on rails, with a
//!   net layer's session table, used by this crate's tests and available to other crates' tests.
//!
//! ## Invariants
//!
//! * Decoders ([`wire::FrameHeader::decode`], [`handshake::HandshakeMessage::decode`], the
//!   [`region`] payload decoders, the [`rpc`] envelope decoders) accept any byte string and
//!   return a value or a typed error; they never panic and never allocate, and a frame's
//!   announced length (and the reply a get asks for) is checked against
//!   [`wire::Limits::max_message_size`] before any caller could size a buffer from it. Property
//!   tests and fuzz targets check this.
//! * No frame from an incarnation other than the one authenticated in the handshake is delivered.
//! * A connection is ready only after a pre-shared-key handshake, or a join whose proof verifies
//!   under the secret of a session such a handshake made; and it delivers only frames addressed
//!   to its own rail (`src_shard`, `dst_shard`).
//! * A remote put or get is allowed only within a registered region's bounds (checked without
//!   overflow), with its permission, by its grantee, and at its current generation.
//! * A pending request completes exactly once; bytes in flight never exceed a credit window; an
//!   RPC is executed at most once per `(node, incarnation, sending shard, request id)`.
//! * Library code holds no `unwrap` on external input; the few `expect`s state their invariant.
//!
//! ## Send and Sync
//!
//! Every public type is `Send` and `Sync` when its type parameters are: they are plain data
//! (integers, `Vec`, `VecDeque`, `HashMap`, `BTreeMap`, and an `Arc<[u8]>` holding the
//! pre-shared key), with no `Rc`, `Cell` or raw pointers. That lets a shard build its state from
//! a `Send` recipe or move it once into its thread; after that the runtime keeps it on one core
//! and needs no locking, because nothing here is shared. A test asserts these auto traits.
//!
//! ## What the machine needs
//!
//! Nothing: no io_uring, no locked memory, no UCX, no GPU.

#![forbid(unsafe_code)]

pub mod conn;
pub mod fuzzing;
pub mod handshake;
pub mod ids;
pub mod pool;
pub mod rails;
pub mod region;
pub mod request;
pub mod rng;
pub mod rpc;
pub mod shard_map;
pub mod sim;
pub mod staging;
pub mod time;
pub mod wire;

pub use conn::{ConnConfig, Connection, DataLane, Event, Seeds, State, Transmit};
pub use handshake::{
    Features, Handshake, HandshakeConfig, JoinAttempt, PeerInfo, PreSharedKey, SessionSecret,
};
pub use ids::{AmId, FunctionId, Generation, Incarnation, NodeId, RegionId, ReqId, ShardId};
pub use pool::{Block, PoolConfig, SizeClassPool};
pub use rails::{Rail, Rails};
pub use region::{
    Access, CheckedRange, GetRequest, Permissions, PutRequest, RegionDescriptor, RegionEntry,
    RegionError, RegionSpec, RegionTable, RmaError, RmaErrorCode, RmaReply, RmaWireError,
};
pub use request::{CreditWindow, DedupKey, DedupVerdict, DedupWindow, PendingTable};
pub use rng::Rng;
pub use rpc::{
    decode_error, decode_request, encode_error, encode_request, request_prefix, CallFlags,
    ErrorBody, RequestEnvelope, RpcErrorCode, RpcWireError, MAX_ERROR_MESSAGE, REQUEST_PREFIX_LEN,
};
pub use shard_map::{ShardCountError, ShardMap};
pub use staging::{CopyEngine, Staging, StagingConfig};
pub use time::Timestamp;
pub use wire::{FrameFlags, FrameHeader, FrameKind, Limits, Tag, TagKind, TagMask, WireError};

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn public_types_are_send_and_sync() {
        assert_send_sync::<Connection>();
        assert_send_sync::<Handshake>();
        assert_send_sync::<JoinAttempt>();
        assert_send_sync::<SessionSecret>();
        assert_send_sync::<PendingTable<Vec<u8>>>();
        assert_send_sync::<DedupWindow<Vec<u8>>>();
        assert_send_sync::<CreditWindow>();
        assert_send_sync::<Staging>();
        assert_send_sync::<SizeClassPool>();
        assert_send_sync::<ShardMap>();
        assert_send_sync::<Rails>();
        assert_send_sync::<Rail>();
        assert_send_sync::<FrameHeader>();
        assert_send_sync::<Transmit>();
        assert_send_sync::<Event>();
        assert_send_sync::<Rng>();
        assert_send_sync::<sim::Sim>();
        assert_send_sync::<WireError>();
        assert_send_sync::<handshake::HandshakeError>();
        assert_send_sync::<RegionTable>();
        assert_send_sync::<RegionDescriptor>();
        assert_send_sync::<PutRequest<'static>>();
        assert_send_sync::<RmaReply<'static>>();
        assert_send_sync::<RmaError>();
        assert_send_sync::<RmaWireError>();
        assert_send_sync::<RegionError>();
        assert_send_sync::<RequestEnvelope<'static>>();
        assert_send_sync::<ErrorBody<'static>>();
        assert_send_sync::<RpcWireError>();
    }
}
