//! # shardcx-shards: the runtime inside a core
//!
//! This crate is where glommio, the sans-IO protocol core ([`proto`]) and the safe UCX layer
//! ([`ucx`]) meet: every core runs one pinned glommio executor that alone owns a UCX worker, a
//! connection table and a registered-memory pool, with peers hashed to shards by
//! [`proto::shard_map::ShardMap`] and requests for another shard's peers forwarded to it.
//!
//! Today it carries the two layers it is built on, re-exported so that the facade crate
//! reaches UCX only through them (the facade never calls ucx1-sys). The shard runtime itself
//! (boot, progress driver, connections, cross-shard lanes) is the next piece of work; see
//! `DESIGN.md`.

pub use shardcx_proto as proto;
pub use shardcx_ucx as ucx;
