//! `cargo bench --bench am`: the messaging tests of `shardcx bench` (am-lat, am-rate, am-bw,
//! tag-lat, rpc-lat, rpc-rate, rpc-notify, put-bw, get-bw, put-trusted-bw) with the server in this process, over
//! shared memory, one client shard. The same code as the command (`shardcx::bench`); `shardcx bench` runs the server in
//! a process of its own and has every option.
//!
//! Extra arguments after `--` are test names (e.g. `cargo bench --bench am -- am-lat`).

use std::net::SocketAddr;

use shardcx::bench::client::ClientConfig;
use shardcx::bench::server::ServeConfig;
use shardcx::bench::{report, run_in_process, Memory, Test, Transport, DEFAULT_PSK};

fn main() {
    // `cargo bench` passes `--bench`; anything else names tests.
    let tests: Vec<Test> = std::env::args()
        .skip(1)
        .filter_map(|a| Test::parse(&a))
        .collect();
    let tests = if tests.is_empty() {
        Test::ALL.into_iter().filter(|t| *t != Test::Hop).collect()
    } else {
        tests
    };
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let serve = ServeConfig {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        shards: 1,
        transport: Transport::Shm,
        psk: DEFAULT_PSK.to_vec(),
        // The server on the last CPU, the client on the first.
        cores: (cpus >= 2).then(|| vec![cpus - 1]),
        // Native RMA only when put-trusted-bw runs (the client turns it on then too).
        trusted_rma: tests.contains(&Test::PutTrustedBw),
        metrics: None,
    };
    let r = run_in_process(serve, |addr| ClientConfig {
        addr,
        shards: 1,
        transport: Transport::Shm,
        tests,
        sizes: None,
        budget: None,
        warmup: None,
        window: 64,
        cores: Some(vec![0]),
        psk: DEFAULT_PSK.to_vec(),
        progress: true,
        io_memory: Some(1 << 20),
        memory: Memory::Host,
    });
    match r {
        Ok(results) => print!("{}", report::table(&results)),
        Err(e) => {
            eprintln!("bench failed: {e}");
            std::process::exit(1);
        }
    }
}
