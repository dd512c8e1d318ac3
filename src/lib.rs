#![doc = include_str!("../README.md")]

pub use shardcx_shards::{proto, ucx};

/// The runtime inside a core: shards, their progress drivers, pools and cross-shard forwarding.
pub use shardcx_shards as shards;
