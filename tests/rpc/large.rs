//! Large RPC arguments: by rendezvous into the buffer a function chooses (pool, aligned host
//! memory, a vector by default), a chooser that declines, arguments over the server's limit,
//! and the other way, a region of the caller's that the handler gets from. A server node of two
//! shards and a client node of two shards in one process, over tcp on loopback; the client
//! calls from both shards (owner of the server, and forwarded).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::MutexGuard;

use shardcx::rma::{Permissions, RemoteRegion};
use shardcx::rpc::{ArgsLocation, RndvBuf, RpcConfig, RpcContext, RpcError};
use shardcx::shards::ucx::AlignedBuf;
use shardcx::{rpc_function, Node, NodeBuilder, NodeId, Peer, RpcStats};

use super::pair_with;

const CLIENT: NodeId = NodeId::new(0xC2);
const SERVER: NodeId = NodeId::new(0x5F);
const MIB: usize = 1 << 20;

/// Where a handler found its arguments, as a number (the reply's second field).
fn code(l: ArgsLocation) -> u8 {
    match l {
        ArgsLocation::Inline => 0,
        ArgsLocation::Vec => 1,
        ArgsLocation::Pool => 2,
        ArgsLocation::Host => 3,
        _ => 255,
    }
}

/// A descriptor's bytes and a length.
#[derive(Debug, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
struct RegionRef {
    desc: Vec<u8>,
    len: u64,
}

rpc_function!(
    /// Checksum of the argument and where it landed; chooser: the shard's pool.
    InPool: Vec<u8> => (u64, u8), id = 1, name = "large.pool");
rpc_function!(
    /// Same, chooser: aligned host memory.
    InHost: Vec<u8> => (u64, u8), id = 2, name = "large.host");
rpc_function!(
    /// Same, no chooser (a vector).
    InVec: Vec<u8> => (u64, u8), id = 3, name = "large.vec");
rpc_function!(
    /// Same, a chooser that always declines.
    Declined: Vec<u8> => (u64, u8), id = 4, name = "large.declined");
rpc_function!(
    /// Async: gets the caller's region and checksums it.
    FromRegion: RegionRef => u64, id = 5, name = "large.region");
rpc_function!(
    /// Async, pool chooser: checksum and location of the deserialized argument.
    AsyncPool: Vec<u8> => (u64, u8), id = 6, name = "large.async_pool");

/// Pool blocks handed to a chooser that were not 16-byte aligned.
static MISALIGNED: AtomicU64 = AtomicU64::new(0);
/// Calls the declining chooser saw.
static DECLINES: AtomicU64 = AtomicU64::new(0);

fn serial() -> MutexGuard<'static, ()> {
    let g = super::serial();
    MISALIGNED.store(0, Ordering::SeqCst);
    DECLINES.store(0, Ordering::SeqCst);
    g
}

fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

fn data(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i % 251) as u8 ^ seed.wrapping_mul(31))
        .collect()
}

/// The tests' node, with pool blocks up to 4 MiB: room for a 1 MiB argument and its envelope.
fn node(id: NodeId) -> NodeBuilder {
    super::node(id).with_shards(|s| s.arena_len(4 << 20))
}

/// [`super::pair_with`] with this module's server (settings `cfg`) and client.
fn pair<T, B, Fut>(cfg: RpcConfig, body: B) -> (Vec<T>, RpcStats)
where
    T: Send + 'static,
    B: Fn(Node, Peer) -> Fut + Send + Clone + 'static,
    Fut: std::future::Future<Output = T> + 'static,
{
    pair_with(server(cfg), node(CLIENT), false, body)
}

fn sum_handler() -> impl Fn(&RpcContext, &rkyv::Archived<Vec<u8>>) -> Result<(u64, u8), String> {
    |ctx: &RpcContext, v: &rkyv::Archived<Vec<u8>>| {
        Ok((checksum(v.as_slice()), code(ctx.args_location())))
    }
}

fn pool_chooser(node: &Node, _: Peer, len: usize) -> Option<RndvBuf> {
    let b = node.shard_ctx().pool().alloc(len)?;
    let aligned = b.as_slice().is_some_and(|s| s.as_ptr() as usize % 16 == 0);
    if !aligned {
        MISALIGNED.fetch_add(1, Ordering::SeqCst);
    }
    Some(RndvBuf::Pool(b))
}

fn server(cfg: RpcConfig) -> NodeBuilder {
    node(SERVER)
        .rpc_config(cfg)
        .rpc::<InPool, _, _>(sum_handler)
        .rpc_args_buffer::<InPool>(pool_chooser)
        .rpc_args_buffer::<AsyncPool>(pool_chooser)
        .rpc_args_buffer::<Declined>(|_: &Node, _: Peer, _: usize| {
            DECLINES.fetch_add(1, Ordering::SeqCst);
            None
        })
        .rpc::<InHost, _, _>(sum_handler)
        // Given to the builder: installed on every shard before any call.
        .rpc_args_buffer::<InHost>(|_: &Node, _: Peer, len: usize| {
            AlignedBuf::zeroed(len, 64).ok().map(RndvBuf::Host)
        })
        .rpc::<InVec, _, _>(sum_handler)
        .rpc::<Declined, _, _>(sum_handler)
        .rpc_async::<AsyncPool, _, _, _>(|| {
            |ctx: RpcContext, v: Vec<u8>| async move {
                Ok((checksum(&v), code(ctx.args_location())))
            }
        })
        .rpc_async::<FromRegion, _, _, _>(|| {
            |ctx: RpcContext, r: RegionRef| async move {
                let region = RemoteRegion::from_bytes(&r.desc).map_err(|e| e.to_string())?;
                let got = ctx
                    .caller()
                    .get(&region, 0, r.len)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(checksum(&got))
            }
        })
}

#[test]
fn large_arguments_land_in_the_chosen_buffer() {
    let _g = serial();
    let (_, stats) = pair(RpcConfig::default(), |node: Node, peer: Peer| async move {
        let rpc = node.rpc();
        let seed = node.shard().index() as u8;
        let big = data(MIB, seed);
        let want = checksum(&big);
        let at = |r: Result<(u64, u8), RpcError>, what: &str| {
            let (sum, loc) = r.unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(sum, want, "{what}: checksum");
            loc
        };
        assert_eq!(at(rpc.call::<InPool>(peer, &big).await, "pool"), 2);
        assert_eq!(at(rpc.call::<InHost>(peer, &big).await, "host"), 3);
        assert_eq!(at(rpc.call::<InVec>(peer, &big).await, "vec"), 1);
        assert_eq!(at(rpc.call::<AsyncPool>(peer, &big).await, "async"), 2);
        // A small argument comes in the frame, whatever the chooser.
        let small = data(100, seed);
        let (sum, loc) = rpc.call::<InPool>(peer, &small).await.expect("small");
        assert_eq!((sum, loc), (checksum(&small), 0));
        // Pool blocks go back: many more calls than the pool has 2 MiB blocks.
        for i in 0..8u8 {
            let d = data(MIB, i);
            let (sum, loc) = rpc.call::<InPool>(peer, &d).await.expect("again");
            assert_eq!((sum, loc), (checksum(&d), 2));
        }
    });
    assert_eq!(stats.served, 2 * 13);
    assert_eq!(stats.failed, 0);
    assert_eq!(
        MISALIGNED.load(Ordering::SeqCst),
        0,
        "pool blocks 16-aligned"
    );
}

#[test]
fn declined_and_oversized_arguments_get_typed_errors() {
    let _g = serial();
    let cfg = RpcConfig {
        max_args_size: Some(256 << 10),
        ..RpcConfig::default()
    };
    let (_, stats) = pair(cfg, |node: Node, peer: Peer| async move {
        let rpc = node.rpc();
        // Under the limit, over the rendezvous threshold: the chooser sees it and declines.
        let mid = data(128 << 10, 1);
        match rpc.call::<Declined>(peer, &mid).await {
            Err(RpcError::Busy) => {}
            other => panic!("declined: {other:?}"),
        }
        // Over the limit: refused before any chooser runs.
        let big = data(MIB, 1);
        match rpc.call::<Declined>(peer, &big).await {
            Err(RpcError::TooLarge { .. }) => {}
            other => panic!("declined and over the limit: {other:?}"),
        }
        match rpc.call::<InPool>(peer, &big).await {
            Err(RpcError::TooLarge { len, max }) => {
                assert_eq!(max, 256 << 10);
                assert!(len > MIB as u64, "len {len}");
            }
            other => panic!("over the limit: {other:?}"),
        }
        // The server keeps serving, large and small.
        let ok = data(128 << 10, 2);
        let (sum, loc) = rpc.call::<InPool>(peer, &ok).await.expect("after");
        assert_eq!((sum, loc), (checksum(&ok), 2));
        let (sum, _) = rpc
            .call::<Declined>(peer, &[7u8; 10].to_vec())
            .await
            .expect("small");
        assert_eq!(sum, checksum(&[7u8; 10]));
    });
    assert_eq!(
        DECLINES.load(Ordering::SeqCst),
        2,
        "one decline per client shard"
    );
    assert_eq!(stats.too_large, 4);
    assert_eq!(stats.served, 4);
}

#[test]
fn a_handler_gets_large_arguments_from_a_region_of_the_caller() {
    let _g = serial();
    let (_, stats) = pair(RpcConfig::default(), |node: Node, peer: Peer| async move {
        let rpc = node.rpc();
        let len = MIB + 3;
        let region = node
            .register_region(data(len, 5), Permissions::READ, Some(peer))
            .expect("region");
        let args = RegionRef {
            desc: region.descriptor().to_bytes().to_vec(),
            len: len as u64,
        };
        for i in 0..3u8 {
            let want = region
                .write(|m| {
                    m[..8].fill(i);
                    checksum(m)
                })
                .unwrap();
            let got = rpc.call::<FromRegion>(peer, &args).await.expect("region");
            assert_eq!(got, want);
        }
        // Past the end: the get is refused, the call fails with the reason.
        let past = RegionRef {
            len: len as u64 + 1,
            ..args
        };
        match rpc.call::<FromRegion>(peer, &past).await {
            Err(RpcError::Failed(m)) => assert!(!m.is_empty()),
            other => panic!("past the end: {other:?}"),
        }
    });
    assert_eq!(stats.served, 6);
    assert_eq!(stats.failed, 2);
}
