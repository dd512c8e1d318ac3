//! Compile-time checks of the auto traits of the public types: shard-owned state cannot leave
//! its thread; settings and errors can.

use shardcx_shards::{
    BootError, DriverConfig, ForwardError, MeshConfig, Placement, ShardCtx, ShardPool,
    ShardsBuilder,
};

#[test]
fn shard_state_stays_on_its_thread() {
    trait AmbiguousIfSend<A> {
        fn some_item() {}
    }
    impl<T: ?Sized> AmbiguousIfSend<()> for T {}
    impl<T: ?Sized + Send> AmbiguousIfSend<u8> for T {}
    trait AmbiguousIfSync<A> {
        fn some_item() {}
    }
    impl<T: ?Sized> AmbiguousIfSync<()> for T {}
    impl<T: ?Sized + Sync> AmbiguousIfSync<u8> for T {}
    // Each line compiles only if the type is NOT Send (resp. Sync).
    let _ = <ShardCtx as AmbiguousIfSend<_>>::some_item;
    let _ = <ShardCtx as AmbiguousIfSync<_>>::some_item;
    let _ = <ShardPool as AmbiguousIfSend<_>>::some_item;
    let _ = <ShardPool as AmbiguousIfSync<_>>::some_item;
}

#[test]
fn settings_and_errors_cross_threads() {
    fn send_sync<T: Send + Sync + 'static>() {}
    send_sync::<ShardsBuilder>();
    send_sync::<Placement>();
    send_sync::<DriverConfig>();
    send_sync::<MeshConfig>();
    send_sync::<ForwardError>();
    send_sync::<BootError>();
    send_sync::<shardcx_shards::cuda::ModeRequest>();
    send_sync::<shardcx_shards::cuda::CudaError>();
    // A shard's CUDA state holds process-wide driver handles only (see `CudaDevice`).
    send_sync::<shardcx_shards::cuda::ShardCuda>();
}
