//! `cargo bench --bench hop`: the cost of one cross-shard hop in a 2-shard node (the `hop`
//! test of `shardcx bench`, same code), per shard and merged. It still connects to a bench
//! server in this process, as every `shardcx bench` client does.

use std::net::SocketAddr;
use std::sync::mpsc;

use shardcx::bench::client::{self, ClientConfig};
use shardcx::bench::server::{self, ServeConfig};
use shardcx::bench::{report, Test, Transport, DEFAULT_PSK};
use shardcx::Shutdown;

fn main() {
    let stop = Shutdown::new();
    let (tx, rx) = mpsc::channel::<SocketAddr>();
    let cfg = ServeConfig {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        shards: 1,
        peers: 2,
        transport: Transport::Shm,
        psk: DEFAULT_PSK.to_vec(),
        cores: None,
    };
    let server_stop = stop.clone();
    let server = std::thread::spawn(move || {
        server::serve(&cfg, &server_stop, |s| {
            let _ = tx.send(s.addr);
        })
    });
    let Ok(addr) = rx.recv() else {
        eprintln!("bench server failed: {:?}", server.join().map(|r| r.err()));
        std::process::exit(1);
    };
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let r = client::run(&ClientConfig {
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
    });
    stop.trigger();
    let _ = server.join();
    match r {
        Ok(results) => print!("{}", report::table(&results)),
        Err(e) => {
            eprintln!("bench failed: {e}");
            std::process::exit(1);
        }
    }
}
