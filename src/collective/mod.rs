//! Collectives: barrier, broadcast, reduce, all-reduce, all-gather, reduce-scatter, gather,
//! scatter, all-to-all, scans, and vector variants of gather, scatter, all-gather and
//! all-to-all, over groups of ranks.
//!
//! ## The model
//!
//! A *rank* is one shard of one node ([`Member`]). A [`Communicator`] is a group of ranks as
//! one of them sees it: every rank holds its own, on its own shard (`!Send`), and calls the
//! same operations on it in the same order, each an `async` method with its own deadline.
//! [`Communicator::world`] makes the world of a list of nodes (every shard of every node, ranks
//! numbered node by node in list order, then by shard), [`Communicator::world_from_registry`]
//! the world of the nodes registered under a service name; [`Communicator::split`] (by color and
//! key, with [`Color::UNDEFINED`] to stay out), [`Communicator::dup`],
//! [`Communicator::node_local`] and [`Communicator::leaders`] make new ones from it. Making a
//! communicator is itself collective and has a deadline.
//!
//! ```no_run
//! use std::time::Duration;
//! use shardcx::collective::{Communicator, Sum};
//! use shardcx::{Node, NodeId};
//!
//! # async fn demo(node: Node) -> Result<(), shardcx::collective::CollectiveError> {
//! let t = Duration::from_secs(5);
//! // On every shard of nodes 1 and 2 (connected to each other):
//! let mut world = Communicator::world(&node, &[NodeId::new(1), NodeId::new(2)], t).await?;
//! let sum = world.all_reduce(&[world.rank() as u64, 1], &Sum, t).await?;
//! assert_eq!(sum[1], world.size() as u64);
//! # Ok(()) }
//! ```
//!
//! Elements are [`Element`]s (integers of 8 to 64 bits, `f32`, `f64`, `half::f16`,
//! `half::bf16`, arrays of them, or an application's type); reductions take an [`Operator`]: [`Sum`], [`Prod`],
//! [`Min`], [`Max`], or a [`UserOp`] that says whether it commutes. A non-commutative
//! operator is applied in rank order (`x0 ∘ x1 ∘ … ∘ x(p-1)`).
//!
//! ## Messages
//!
//! Collectives are built from the messages everything else uses, no side channel: between
//! shards of one node the cross-shard mesh (the data moves, no copy), between nodes an active
//! message on the rail to the destination shard (`Peer::shard`; see [`wire`] for the
//! header). Every message carries the communicator id and the operation's sequence number on
//! it, with the sending rank and the step: messages of consecutive operations, or of other
//! communicators, are never taken by mistake, at any rank count, and a message that arrives
//! before its operation starts on the receiving rank waits for it. Messages of an operation
//! that has ended on the receiving rank are dropped ([`CollectiveStats::dropped_stale`]).
//! Communicator ids are hashes of how the communicator was made (the parent's id and the
//! sequence number of the `split`/`dup`, the color; for a world, the node list and how many
//! worlds this shard made from it before), so every rank computes the same id without a
//! message; different communicators get the same id with probability about 2^-64, and a
//! shard refuses an id it already uses.
//!
//! ## Failure
//!
//! An operation ends, on every rank, with a [`CollectiveError`] when its deadline passes
//! ([`CollectiveError::TimedOut`], with the rank it was waiting for), when the node of a rank
//! it waits for loses its connection ([`CollectiveError::RankFailed`]), or when a message to a
//! rank cannot be sent. The rank that fails tells the others at once (an abort message), which
//! then fail with [`CollectiveError::Aborted`] naming it and its cause instead of waiting for
//! their own deadline; dropping an operation's future aborts it the same way. Nothing waits
//! past its deadline.
//!
//! A failure revokes the communicator, on the rank that failed and on every rank its abort
//! reaches (also a rank that has already finished that operation and waits in the next one:
//! the rank that failed will not come; and a rank still in an operation that others have
//! finished: a rank may return while its last messages are on their way to a slower one, so
//! a rank that fails the next operation can fail that one on the slower rank with
//! [`CollectiveError::Revoked`]): from then on every operation on it fails at once
//! with [`CollectiveError::Revoked`] ([`Communicator::revoked`] says by whom and why). The
//! ranks then make a new communicator: [`Communicator::shrink`] (the survivors only, in the
//! same order: the ranks whose nodes have not lost their connection since the communicator
//! was made, agreed through the lowest of them; a failure during the shrink is survived), or
//! a new [`Communicator::world`].
//!
//! ```no_run
//! # use std::time::Duration;
//! # use shardcx::collective::{CollectiveError, Communicator, Sum};
//! # async fn demo(mut world: Communicator) -> Result<(), CollectiveError> {
//! let t = Duration::from_secs(5);
//! let mut comm = match world.all_reduce(&[1u64], &Sum, t).await {
//!     Ok(_) => world,
//!     // A rank's node died (or an abort came): go on with the ranks that are left.
//!     Err(_) => world.shrink(t).await?,
//! };
//! let alive = comm.all_reduce(&[1u64], &Sum, t).await?;
//! assert_eq!(alive[0], comm.size() as u64);
//! # Ok(()) }
//! ```
//!
//! ## Algorithms
//!
//! Chosen by message size and rank count ([`Tuning`]; the table is in [`algorithm`]):
//! dissemination barrier, binomial trees, recursive doubling, Bruck's all-gather, and rings
//! (reduce-scatter + all-gather) for large commutative reductions. Over several nodes,
//! barrier, broadcast, reduce, gather, scatter, all-gather of small blocks, reduce-scatter of
//! small vectors and all-reduce are hierarchical:
//! through the nodes' leaders, or, for a large all-reduce, by slices (each shard all-reducing
//! its slice with its counterparts on the other nodes, on its own rail). What is not here yet:
//! hierarchical forms of the vector variants, all-to-all, the scans and the large
//! reduce-scatter (a ring over every rank). The
//! thresholds are a fixed size by default; [`Tuning::with_costs`] has a cost model with
//! constants measured on the machine ([`Costs`], written by `shardcx bench --test allreduce
//! --save-costs FILE`) choose instead ([`cost`]).
//!
//! ## In place
//!
//! [`Communicator::broadcast`] works in place, and so do the variants named `*_in_place`
//! (MPI's `MPI_IN_PLACE`): [`Communicator::all_reduce_in_place`],
//! [`Communicator::reduce_in_place`], [`Communicator::all_gather_in_place`],
//! [`Communicator::reduce_scatter_in_place`], [`Communicator::scan_in_place`],
//! [`Communicator::exclusive_scan_in_place`], [`Communicator::gather_in_place`] and
//! [`Communicator::scatter_in_place`] (in place at the root), and
//! [`Communicator::all_to_all_in_place`]: each takes a `&mut [T]`, reads its input there and
//! leaves its result there (each method says where).
//!
//! ## Buffers
//!
//! A message to another node that goes by rendezvous in one part (at most
//! [`wire::SEGMENT`]) is handed to UCX as an owned buffer (a per-shard send buffer reused from
//! one operation to the next, or the moved vector), which UCX reads where it is; the
//! receiving shard lands it in its pool or receive cache, and the operation reads it there
//! (reducing straight from the received bytes) and gives the buffer back: beyond the encoding
//! of the elements into their wire bytes, such a message is not copied, nor its buffers
//! allocated afresh, on either side. Recursive doubling encodes the caller's vector for sending
//! and writes the combination straight into the result (the input is not copied first), in chunks
//! of at most 256 KiB, each its own message, so that one is reduced while the next ones move.
//! Longer messages (several parts) are put together in a buffer of their own.

pub mod algorithm;
mod comm;
pub mod cost;
mod deadline;
mod element;
mod error;
mod ops;
mod state;
pub mod wire;

pub use algorithm::{Algorithm, Tuning};
pub use comm::{Color, Communicator, Member};
pub use cost::{Costs, CostsError};
pub use element::{Element, Max, Min, Number, Operator, Prod, Sum, UserOp};
pub use error::{AbortCause, CollectiveError};
pub use state::{CollectiveStats, MAX_BUFFERED_BYTES};

pub(crate) use state::install;
