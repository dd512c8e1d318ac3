//! Command-line pieces the examples share (clap derive): where an example runs, and value
//! parsers. Included by each example with `#[path = "common/cli.rs"] mod cli;` (cargo does not
//! take this folder for an example of its own).

#![allow(dead_code)] // Each example uses the parts it needs.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

/// Where the example runs: both nodes in this process (neither flag), the server alone
/// (`--listen`), or the client alone (`--connect`).
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct Role {
    /// Run the server alone, listening at ADDR.
    #[arg(long, value_name = "ADDR", conflicts_with = "connect")]
    pub(crate) listen: Option<SocketAddr>,
    /// Run the client alone, against the server at ADDR.
    #[arg(long, value_name = "ADDR")]
    pub(crate) connect: Option<SocketAddr>,
}

/// The options of the exchange examples (`am_echo`, `tag_pingpong`): a role, then the
/// workload of each client shard and the nodes' shape.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct Exchange {
    #[command(flatten)]
    pub(crate) role: Role,
    /// How long the server (--listen) serves, in seconds.
    #[arg(long = "for", value_name = "SECS", default_value = "60", value_parser = seconds)]
    pub(crate) serve_for: Duration,
    /// Messages per client shard.
    #[arg(long, value_name = "N", default_value_t = 20_000)]
    pub(crate) count: u32,
    /// Payload bytes (e.g. 8, 4k).
    #[arg(long, value_name = "B", default_value = "8", value_parser = size)]
    pub(crate) size: usize,
    /// Shards per node.
    #[arg(long, value_name = "N", default_value = "2", value_parser = positive)]
    pub(crate) shards: usize,
    /// UCX transports (listening and connecting need tcp in UCX 1.12).
    #[arg(long, value_name = "LIST", default_value = "tcp")]
    pub(crate) tls: String,
}

/// Whole seconds, e.g. `60`.
pub(crate) fn seconds(s: &str) -> Result<Duration, String> {
    s.parse::<u64>()
        .map(Duration::from_secs)
        .map_err(|_| format!("{s:?} is not a number of seconds"))
}

/// A byte count with an optional k or m suffix (powers of 1024), e.g. `8`, `64k`, `1m`.
pub(crate) fn size(s: &str) -> Result<usize, String> {
    shardcx::bench::parse_size(s).ok_or_else(|| format!("cannot read size {s:?} (e.g. 8, 64k, 1m)"))
}

/// A count of at least 1.
pub(crate) fn positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        Ok(_) => Err("must be at least 1".into()),
        Err(_) => Err(format!("{s:?} is not a count")),
    }
}

/// Runs an example in its role. Server alone (`--listen`): `serve` on a thread, its bound
/// address printed once it listens (for `serve_for`), until `serve` returns. Client alone
/// (`--connect`): `client`. Neither: both here, the server on port 0, stopped (its flag set)
/// once the client is done. `serve(addr, bound, stop)` sends the address it listens on to
/// `bound` and returns once `stop` is set or its time is up.
pub(crate) fn run_role<S, C>(role: &Role, serve_for: Duration, serve: S, client: C)
where
    S: Fn(SocketAddr, mpsc::Sender<SocketAddr>, Arc<AtomicBool>) + Sync,
    C: Fn(SocketAddr),
{
    let (tx, rx) = mpsc::channel();
    let stop = Arc::new(AtomicBool::new(false));
    match (role.listen, role.connect) {
        (Some(addr), None) => std::thread::scope(|s| {
            s.spawn(|| serve(addr, tx, stop.clone()));
            if let Ok(a) = rx.recv_timeout(Duration::from_secs(30)) {
                println!("listening on {a} for {serve_for:?}");
            }
        }),
        (None, Some(addr)) => client(addr),
        (None, None) => std::thread::scope(|s| {
            let server_stop = stop.clone();
            let serve = &serve;
            s.spawn(move || serve(SocketAddr::from(([127, 0, 0, 1], 0)), tx, server_stop));
            match rx.recv_timeout(Duration::from_secs(30)) {
                Ok(addr) => client(addr),
                Err(_) => eprintln!("the server did not start within 30 s"),
            }
            stop.store(true, Ordering::Release);
        }),
        (Some(_), Some(_)) => unreachable!("clap refuses --listen with --connect"),
    }
}
