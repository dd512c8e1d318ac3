//! UCX's async thread, started from a pinned thread, must not stay pinned to that core.
//!
//! Its own test binary: the async thread is process-wide and started by its first user, so no
//! other test may have started it first.

mod common;

use std::net::SocketAddr;

use common::context;
use shardcx_ucx::{thread_cpus, threads_named, Endpoint, EpOptions, Features, Listener, Worker};

#[test]
fn async_thread_started_by_a_pinned_thread_gets_the_process_cpus() {
    let main_cpus = thread_cpus(0).expect("main thread affinity");
    if main_cpus.len() < 2 {
        eprintln!("skipped: this process may use only CPUs {main_cpus:?}; nothing to release");
        return;
    }
    let pin = main_cpus[0];
    let seen = std::thread::spawn(move || {
        assert!(core_affinity::set_for_current(core_affinity::CoreId {
            id: pin
        }));
        assert_eq!(thread_cpus(0).expect("pinned affinity"), vec![pin]);
        // TCP and a listener make UCX start its async thread from this pinned thread.
        let ctx = context("tcp", Features::messaging());
        let worker = Worker::new(&ctx).expect("worker");
        let listener =
            Listener::bind(&worker, "127.0.0.1:0".parse().expect("addr")).expect("listen");
        let addr: SocketAddr = listener.local_addr().expect("addr");
        let _ep = Endpoint::connect(&worker, addr, EpOptions::default()).expect("connect");
        let tids = threads_named("async").expect("list threads");
        let cpus: Vec<Vec<usize>> = tids
            .iter()
            .map(|&t| thread_cpus(t).expect("async thread affinity"))
            .collect();
        (tids, cpus)
    })
    .join()
    .expect("pinned thread");
    let (tids, cpus) = seen;
    assert!(!tids.is_empty(), "UCX started no async thread");
    for c in cpus {
        assert_eq!(
            c, main_cpus,
            "UCX's async thread kept the pinned creator's CPUs"
        );
    }
}
