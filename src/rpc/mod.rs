//! Typed RPC between nodes: functions with rkyv arguments and replies, per shard, with
//! deadlines, cancellation and at-most-once execution.
//!
//! ## Declaring, serving, calling
//!
//! A function is a marker type implementing [`RpcFunction`]: its argument and reply types
//! (any [`RpcType`]: rkyv 0.8 `Archive + Serialize` types whose archive is validated with
//! bytecheck and deserializes back), a [`FunctionId`], a name unique within the node, a version
//! and whether it is idempotent. [`rpc_function!`](crate::rpc_function) declares one in a line.
//!
//! A server registers a handler per function on the builder: [`NodeBuilder::rpc`] for a plain
//! handler, which runs inline on the shard that received the call and reads the argument archive
//! in place; [`NodeBuilder::rpc_async`] for an async one, run as a task of that shard with the
//! arguments deserialized. Like [`NodeBuilder::on_am`], registration takes a `Send + Sync`
//! factory called once per shard, so the handler itself may hold the shard's `!Send` state. A
//! handler gets an [`RpcContext`]: the calling [`Peer`], this [`Node`], the call's deadline and
//! its cancellation. It answers `Ok(reply)` or `Err(message)` (the caller's
//! [`RpcError::Failed`]).
//!
//! A client calls through [`Rpc`] ([`Node::rpc`], [`Rpc::current`]) from any shard:
//! [`Rpc::call`] returns the deserialized reply, [`Rpc::call_archived`] the validated archive
//! in its receive buffer ([`ArchivedReply`]), [`Rpc::notify`] sends a one-way call, and the
//! `_within` forms take their own deadline. [`Rpc::caller`] makes a [`Caller`], whose calls
//! return once sent and whose replies go to a handler run inline on the calling shard (no task
//! woken per call; see the [`Caller`] docs for what such calls leave out).
//!
//! ```no_run
//! use shardcx::rpc::{Rpc, RpcError};
//! use shardcx::{rpc_function, Node, Peer};
//!
//! #[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
//! pub struct Add {
//!     pub a: u64,
//!     pub b: u64,
//! }
//! rpc_function!(
//!     /// Adds two numbers.
//!     pub Sum: Add => u64, id = 1, name = "math.sum"
//! );
//!
//! // Server: every shard answers `Sum`.
//! let server = Node::builder().rpc::<Sum, _, _>(|| {
//!     |_ctx: &shardcx::rpc::RpcContext, args: &ArchivedAdd| Ok(args.a.to_native() + args.b.to_native())
//! });
//! # let _ = server;
//! // Client, on a shard of a running node:
//! async fn add(peer: Peer) -> Result<u64, RpcError> {
//!     let rpc = Rpc::current().expect("on a shard");
//!     rpc.call::<Sum>(peer, &Add { a: 2, b: 3 }).await
//! }
//! ```
//!
//! ## On the wire
//!
//! A call is one [`FrameKind::RpcRequest`](crate::proto::FrameKind::RpcRequest) application
//! frame of the connection (`shardcx_shards::net`), sent by the caller's owner shard of the
//! peer with [`ShardCtx::request_with_ttl`](crate::shards::ShardCtx::request_with_ttl): the
//! frame header carries the function id, a request id fresh on that connection, the sender's
//! incarnation and the time left (`ttl_ns`); the payload is proto's request envelope
//! (`shardcx_proto::rpc`: schema hash, [`CallFlags`](crate::proto::rpc::CallFlags), then the
//! argument archive, 16-byte aligned). The answer is an `RpcResponse` frame holding the reply's
//! archive, or an `RpcError` frame ([`RpcErrorCode`], a detail word and a message). A one-way
//! call has request id 0 and the `ONE_WAY` flag and is never answered. A call given up by its
//! caller is followed by an `RpcCancel` frame. The archive is written straight after the
//! envelope's prefix into the frame's payload vector (no intermediate copy); the receiver
//! validates it in place (`rkyv::access`, never unchecked), copying it into an aligned buffer
//! only when the received bytes are not 16-byte aligned.
//!
//! ## Semantics
//!
//! - **Checks, in order**: the envelope (else [`RpcError::BadRequest`]); the function id
//!   ([`RpcError::UnknownFunction`]); the schema hash ([`RpcError::SchemaMismatch`], with the
//!   server's hash); the argument size against [`RpcConfig::max_args_size`]
//!   ([`RpcError::TooLarge`]); then the archive's validation, inside the call
//!   ([`RpcError::BadRequest`]). Requests refused by the first four never reach the dedup
//!   window and are counted ([`RpcStats`]).
//! - **At most once**: every answered call goes through a per-shard dedup window keyed by
//!   (node, incarnation, request id) ([`RpcConfig::dedup_entries`],
//!   [`RpcConfig::dedup_max_age`]). A copy of a request that is still running is dropped; a
//!   copy of a finished one gets the first answer again (replies up to
//!   [`RpcConfig::dedup_reply_bytes`] are kept; a longer one's copy gets
//!   [`RpcError::TooOld`]); a request older than the window can vouch for is refused with
//!   [`RpcError::TooOld`] without running. All requests from one node arrive at one shard (its
//!   owner), so one window per shard sees them all.
//! - **Retries**: a call is sent again automatically only when it provably never left (no
//!   session with the peer: it connects on first use, see [`crate::node`]), or when the
//!   function is [`RpcFunction::IDEMPOTENT`] and the connection failed
//!   ([`NetError::PeerDead`](crate::shards::NetError::PeerDead), `Closed`, `Transport`) with
//!   time left before the deadline: it is sent again up to 3 times, each time over a new
//!   connection to the peer's known address, waiting for the peer to come back (connects back
//!   off, see [`crate::node`]) within the deadline. Nothing else is retried: a failed call may
//!   or may not have run.
//! - **Deadlines**: every call has one ([`RpcConfig::default_deadline`], else the node's
//!   default, or the `_within` argument). The server gets slightly less time than the caller
//!   waits (1/16 of it, at most 10 ms less), so that a server whose deadline passes can say so
//!   ([`RpcError::DeadlineExpired`]) before the caller gives up on its own
//!   ([`RpcError::TimedOut`]). A plain handler that finishes past the deadline answers
//!   `DeadlineExpired`; an async one is dropped at the deadline. A request sent with no time
//!   left is dropped on arrival by the net layer
//!   ([`NetStats::dropped_expired`](crate::shards::NetStats::dropped_expired)).
//! - **Cancellation**: dropping a call's future sends `RpcCancel` to the server, also when the
//!   call was forwarded from a shard that does not own the peer. The handler sees it
//!   ([`RpcContext::is_cancelled`], [`RpcContext::cancelled`]); an async handler that has not
//!   finished within [`RpcConfig::cancel_grace`] after that is dropped. The server answers
//!   `Cancelled` (nobody listens any more). A plain handler runs to its end in one go, so a
//!   cancel never finds it running.
//! - **Panics**: a handler that panics answers [`RpcError::Panicked`]; the shard goes on
//!   serving.
//!
//! ## Large arguments
//!
//! A request longer than the caller's rendezvous threshold (8 KiB by default) travels by UCX
//! rendezvous: only its frame header arrives first, and the server's net task pulls the data
//! once a buffer is chosen (`ShardCtx::set_frame_handler_rndv`). Before pulling, the server
//! refuses an unknown function and arguments over [`RpcConfig::max_args_size`] without
//! receiving them; then [`Node::rpc_args_buffer`] lets a function choose the buffer per call
//! ([`RndvBuf`]: a block of the shard's registered pool, aligned host memory, or a vector; GPU
//! memory with CUDA support), else the data lands in a fresh vector. A chooser that declines
//! answers [`RpcError::Busy`]. The envelope and the archive are then checked as for any call,
//! in place in that buffer; [`RpcContext::args_location`] tells the handler where they are.
//! The other way to move bulk data is a region of the caller's exchanged in the call
//! ([`crate::rma`]: the handler `get`s from or `put`s to it); `examples/rpc_large.rs`
//! measures both.
//!
//! ## Discovery
//!
//! Every node serves the built-in [`Discover`] (its functions' [`Signature`]s) and
//! [`Describe`] (its service name, address, shard count and signatures), with ids from
//! [`FIRST_RESERVED_FUNCTION_ID`] up (refused to applications). [`Rpc::discover`] and
//! [`Rpc::lookup`] use them; a client that was not built with a function's types can call it by
//! signature ([`Rpc::call_signature`]). [`ClusterRegistry`] is the embedded
//! [`Registry`](crate::registry::Registry) built on them.
//!
//! ## Schemas
//!
//! [`RpcFunction::schema`] is by default a 64-bit FNV-1a hash of the Rust type names of the
//! argument and reply types (as [`std::any::type_name`] prints them, with their paths), the
//! function's name and its version. It catches a caller and a server built with different types
//! or a different version. It does **not** see inside a type: changing a field of a struct that
//! keeps its name and path needs a [`RpcFunction::VERSION`] bump, or the two sides will fail
//! validation ([`RpcError::BadRequest`], [`RpcError::BadReply`]) or, worse, read fields
//! differently where the layouts happen to validate. Both sides should take the types from one
//! shared crate (a type moved to another module changes its path and so the hash), and
//! `type_name` is not guaranteed stable across compiler versions: pin a hash by overriding
//! `schema` where the two sides may be built by different compilers.
//!
//! ## Errors
//!
//! [`RpcError`] says where a call failed: on the server (the `RpcErrorCode`s), on the way
//! ([`RpcError::Net`]: no connection, connection failed, ...), or on the client
//! ([`RpcError::TimedOut`], [`RpcError::BadReply`], [`RpcError::TooLarge`] before sending).
//!
//! ## Limits
//!
//! - Large replies travel by rendezvous into a vector on the caller; a caller cannot choose
//!   the buffer yet. Argument-buffer choosers are set per shard at run time
//!   ([`Node::rpc_args_buffer`]), not on the builder; an async handler gets its arguments
//!   deserialized, so its buffer is given back before it runs.
//! - A cancel that overtakes its request (a rendezvous request whose data is still being
//!   pulled) finds nothing to cancel, and the request then runs.
//! - There is no per-shard concurrency limit for async handlers (`Busy` is sent only when a
//!   function's argument-buffer chooser declines a large call).

mod caller;
mod client;
mod error;
pub(crate) mod latency;
mod registry;
mod server;

use std::any::type_name;

use rkyv::api::high::{HighDeserializer, HighSerializer, HighValidator};
use rkyv::bytecheck::CheckBytes;
use rkyv::rancor;
use rkyv::ser::allocator::ArenaHandle;
use rkyv::{Archive, Deserialize, Serialize};

pub use crate::registry::Signature;
pub use caller::{CallHandle, Caller};
pub use client::{ArchivedReply, Rpc};
pub use error::RpcError;
pub use registry::ClusterRegistry;
pub use server::{ArgsLocation, RpcConfig, RpcContext, RpcStats};
pub use shardcx_shards::net::RndvBuf;
pub use shardcx_shards::proto::rpc::RpcErrorCode;
pub use shardcx_shards::proto::FunctionId;

pub(crate) use server::{install, Registration, RpcSetup, ShardRpc};

#[allow(unused_imports)] // For the links in the module docs.
use crate::{Node, NodeBuilder, Peer};

/// Function ids from this one up belong to the runtime ([`Discover`], [`Describe`]);
/// [`NodeBuilder::run`] refuses applications' handlers for them.
pub const FIRST_RESERVED_FUNCTION_ID: u32 = 0xFFFF_0000;

/// What an argument or a reply can be: an rkyv 0.8 type that serializes into a byte vector,
/// whose archive is validated (bytecheck) before use and deserializes back. Implemented for
/// every such type: `#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]` is enough,
/// and `()`, integers, `String`, `Vec<T>`, `Option<T>`, tuples... are ones already.
pub trait RpcType:
    Sized
    + Archive<
        Archived: for<'a> CheckBytes<HighValidator<'a, rancor::Error>>
                      + Deserialize<Self, HighDeserializer<rancor::Error>>,
    > + for<'a> Serialize<HighSerializer<Vec<u8>, ArenaHandle<'a>, rancor::Error>>
    + 'static
{
}

impl<T> RpcType for T where
    T: Archive<
            Archived: for<'a> CheckBytes<HighValidator<'a, rancor::Error>>
                          + Deserialize<T, HighDeserializer<rancor::Error>>,
        > + for<'a> Serialize<HighSerializer<Vec<u8>, ArenaHandle<'a>, rancor::Error>>
        + 'static
{
}

/// Archives `value` after the bytes already in `into` (rkyv's `to_bytes_in`), with this
/// thread's serializer arena kept between calls: rkyv's own `to_bytes_in` takes a thread-local
/// arena out and puts it back (shrunk) on every call, about 25 instructions per archive on
/// each side of an 8-byte call (`scripts/count-instructions --test rpc-lat`). The arena is only
/// scratch for the serializer; one that grew past [`MAX_KEPT_ARENA`] is shrunk after use.
pub(crate) fn archive_into<T: RpcType>(value: &T, into: Vec<u8>) -> Result<Vec<u8>, rancor::Error> {
    let mut arena = ARENA.take().unwrap_or_default();
    let out = rkyv::api::high::to_bytes_in_with_alloc::<_, _, rancor::Error>(
        value,
        into,
        arena.acquire(),
    );
    if arena.capacity() > MAX_KEPT_ARENA {
        arena.shrink();
    }
    ARENA.set(Some(arena));
    out
}

thread_local! {
    /// The serializer arena of [`archive_into`] (taken while in use: a nested call makes its
    /// own).
    static ARENA: std::cell::Cell<Option<rkyv::ser::allocator::Arena>> =
        const { std::cell::Cell::new(None) };
}

/// A serializer arena larger than this is shrunk after use.
const MAX_KEPT_ARENA: usize = 64 << 10;

/// A remote function, declared on a marker type (see [`rpc_function!`](crate::rpc_function)).
pub trait RpcFunction: 'static {
    /// The argument.
    type Args: RpcType;
    /// The reply.
    type Reply: RpcType;
    /// Its id, unique within a node; below [`FIRST_RESERVED_FUNCTION_ID`].
    const ID: FunctionId;
    /// Its name, unique within a node (e.g. `"kv.get"`).
    const NAME: &'static str;
    /// Its version: bump it when the argument or reply changes but their type names do not.
    const VERSION: u32 = 1;
    /// Whether running it twice does no harm: a call that failed with its connection is then
    /// sent again (within its deadline).
    const IDEMPOTENT: bool = false;

    /// The hash both sides compare on every call (see the module docs, "Schemas").
    fn schema() -> u64 {
        schema_hash(
            type_name::<Self::Args>(),
            type_name::<Self::Reply>(),
            Self::NAME,
            Self::VERSION,
        )
    }

    /// What a node publishes about this function.
    fn signature() -> Signature {
        Signature {
            id: Self::ID.get(),
            name: Self::NAME.to_owned(),
            schema: Self::schema(),
            version: Self::VERSION,
        }
    }
}

/// A node's description, as the built-in [`Describe`] returns it.
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct NodeInfo {
    /// The service it registered under ([`ClusterRegistry`]), if any.
    pub service: Option<String>,
    /// Where it listens (`ip:port`), if it listens.
    pub addr: Option<String>,
    /// Its shard count.
    pub shards: u16,
    /// Its functions, built-ins included.
    pub functions: Vec<Signature>,
}

/// Built-in: the signatures of the functions a node serves (built-ins included).
#[derive(Debug, Clone, Copy)]
pub struct Discover;

impl RpcFunction for Discover {
    type Args = ();
    type Reply = Vec<Signature>;
    const ID: FunctionId = FunctionId::new(FIRST_RESERVED_FUNCTION_ID);
    const NAME: &'static str = "shardcx.discover";
    const IDEMPOTENT: bool = true;
}

/// Built-in: a node's [`NodeInfo`] (for [`ClusterRegistry`]).
#[derive(Debug, Clone, Copy)]
pub struct Describe;

impl RpcFunction for Describe {
    type Args = ();
    type Reply = NodeInfo;
    const ID: FunctionId = FunctionId::new(FIRST_RESERVED_FUNCTION_ID + 1);
    const NAME: &'static str = "shardcx.describe";
    const IDEMPOTENT: bool = true;
}

/// The default schema hash: 64-bit FNV-1a over a domain tag, the two type names, the function's
/// name (each followed by a zero byte) and the version (little-endian). Stable across runs and
/// machines (not std's randomly keyed hasher).
pub fn schema_hash(args_type: &str, reply_type: &str, name: &str, version: u32) -> u64 {
    let mut h = Fnv1a::new();
    for part in ["shardcx-rpc-schema", args_type, reply_type, name] {
        h.write(part.as_bytes());
        h.write(&[0]);
    }
    h.write(&version.to_le_bytes());
    h.0
}

/// 64-bit FNV-1a.
struct Fnv1a(u64);

impl Fnv1a {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;

    fn new() -> Self {
        Self(Self::OFFSET)
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(Self::PRIME);
        }
    }
}

/// Declares an [`RpcFunction`] on a new unit struct, in a line:
///
/// ```
/// shardcx::rpc_function!(
///     /// Reads a key.
///     pub Get: String => Option<Vec<u8>>, id = 7, name = "kv.get"
/// );
/// shardcx::rpc_function!(pub Put: (String, Vec<u8>) => (), id = 8, name = "kv.put", version = 2);
/// shardcx::rpc_function!(pub Len: () => u64, id = 9, name = "kv.len", idempotent = true);
/// use shardcx::rpc::RpcFunction;
/// assert_eq!((Get::ID.get(), Put::VERSION, Len::IDEMPOTENT), (7, 2, true));
/// assert_ne!(Get::schema(), Put::schema());
/// ```
#[macro_export]
macro_rules! rpc_function {
    (
        $(#[$meta:meta])* $vis:vis $name:ident : $args:ty => $reply:ty,
        id = $id:expr, name = $fname:expr
        $(, version = $version:expr)? $(, idempotent = $idem:expr)? $(,)?
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy)]
        $vis struct $name;
        impl $crate::rpc::RpcFunction for $name {
            type Args = $args;
            type Reply = $reply;
            const ID: $crate::rpc::FunctionId = $crate::rpc::FunctionId::new($id);
            const NAME: &'static str = $fname;
            $(const VERSION: u32 = $version;)?
            $(const IDEMPOTENT: bool = $idem;)?

            // The default hash, computed once: it is sent and checked on every call.
            fn schema() -> u64 {
                static SCHEMA: ::std::sync::OnceLock<u64> = ::std::sync::OnceLock::new();
                *SCHEMA.get_or_init(|| {
                    $crate::rpc::schema_hash(
                        ::std::any::type_name::<$args>(),
                        ::std::any::type_name::<$reply>(),
                        <Self as $crate::rpc::RpcFunction>::NAME,
                        <Self as $crate::rpc::RpcFunction>::VERSION,
                    )
                })
            }
        }
    };
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;

    #[test]
    fn fnv1a_matches_the_reference_vectors() {
        let mut h = Fnv1a::new();
        h.write(b"");
        assert_eq!(h.0, 0xcbf2_9ce4_8422_2325);
        let mut h = Fnv1a::new();
        h.write(b"a");
        assert_eq!(h.0, 0xaf63_dc4c_8601_ec8c);
        let mut h = Fnv1a::new();
        h.write(b"foobar");
        assert_eq!(h.0, 0x8594_4171_f739_67e8);
    }

    #[test]
    fn schema_hash_sees_every_part() {
        let base = schema_hash("A", "B", "f", 1);
        assert_eq!(base, schema_hash("A", "B", "f", 1));
        for other in [
            schema_hash("A2", "B", "f", 1),
            schema_hash("A", "B2", "f", 1),
            schema_hash("A", "B", "g", 1),
            schema_hash("A", "B", "f", 2),
            // The separators keep parts from running into each other.
            schema_hash("AB", "", "f", 1),
        ] {
            assert_ne!(base, other);
        }
    }

    crate::rpc_function!(Cached: (String, u8) => Vec<u64>, id = 5, name = "t.cached", version = 3);

    #[test]
    fn the_macro_caches_the_default_schema() {
        let want = schema_hash(
            type_name::<(String, u8)>(),
            type_name::<Vec<u64>>(),
            "t.cached",
            3,
        );
        assert_eq!(Cached::schema(), want);
        assert_eq!(Cached::schema(), want, "the cached value");
        assert_eq!(Cached::signature().schema, want);
    }

    #[test]
    fn builtins_are_reserved_and_distinct() {
        assert!(Discover::ID.get() >= FIRST_RESERVED_FUNCTION_ID);
        assert!(Describe::ID.get() >= FIRST_RESERVED_FUNCTION_ID);
        assert_ne!(Discover::schema(), Describe::schema());
        assert_eq!(Discover::signature().name, "shardcx.discover");
    }
}
