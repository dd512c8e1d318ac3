#![doc = include_str!("../README.md")]

pub use shardcx_shards::{proto, ucx};
