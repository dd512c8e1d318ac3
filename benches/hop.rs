//! `cargo bench --bench hop`: the cost of one cross-shard hop in a 2-shard node (the `hop`
//! test of `shardcx bench`, same code), per shard and merged. It still connects to a bench
//! server in this process, as every `shardcx bench` client does.

use std::net::SocketAddr;

use shardcx::bench::client::ClientConfig;
use shardcx::bench::server::ServeConfig;
use shardcx::bench::{report, run_in_process, Memory, Test, Transport, DEFAULT_PSK};

fn main() {
    let serve = ServeConfig {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        shards: 1,
        transport: Transport::Shm,
        psk: DEFAULT_PSK.to_vec(),
        cores: None,
        trusted_rma: false,
        metrics: None,
    };
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let r = run_in_process(serve, |addr| ClientConfig {
        addr,
        shards: 2,
        transport: Transport::Shm,
        tests: vec![Test::Hop],
        sizes: None,
        budget: None,
        warmup: None,
        window: 64,
        cores: Some((0..cpus).collect()),
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
