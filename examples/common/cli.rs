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

/// Whole seconds, e.g. `60`.
pub(crate) fn seconds(s: &str) -> Result<Duration, String> {
    s.parse::<u64>()
        .map(Duration::from_secs)
        .map_err(|_| format!("{s:?} is not a number of seconds"))
}

/// A byte count with an optional k/m/g suffix (powers of 1024), e.g. `8`, `64k`, `1m`.
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
