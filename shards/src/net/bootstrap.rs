//! Bootstrap: the listener, the directory it serves, and connecting to a node by address.
//!
//! The listener is a plain TCP socket on shard 0, not a UCX listener: UCX 1.12's TCP
//! connection manager trusts the length in the first bytes a client sends, and a connection
//! whose bytes announce more than its buffer holds is never read again nor closed (its
//! socket stays in `CLOSE_WAIT` for the worker's lifetime: any port scanner or confused client
//! leaked one file descriptor per connection). Nothing from an unauthenticated client reaches
//! UCX here until it connects to a worker by the address the directory gives.
//!
//! On the wire: the client sends [`BOOTSTRAP_REQUEST`] (8 bytes); the listener answers with
//! the directory's length (`u32`, little-endian) and the directory ([`Directory::encode`]),
//! and closes. A connection whose first bytes are anything else is closed at once
//! ([`NetStats::bootstraps_refused`]); one that has not been answered within
//! [`NetConfig::accept_timeout`] (a silent client, or one dripping bytes) is closed then
//! ([`NetStats::bootstraps_timed_out`]); while [`NetConfig::max_half_open`] connections are
//! being served, or [`NetConfig::max_half_open_per_addr`] from the new one's IP address, a new
//! one is closed as soon as it is accepted ([`NetStats::bootstraps_over_cap`]). The cap per
//! address keeps one flooding host from locking every other client out (RELIABILITY.md R7).
//!
//! [`NetStats::bootstraps_refused`]: super::NetStats::bootstraps_refused
//! [`NetStats::bootstraps_timed_out`]: super::NetStats::bootstraps_timed_out
//! [`NetStats::bootstraps_over_cap`]: super::NetStats::bootstraps_over_cap
//! [`NetConfig::accept_timeout`]: super::NetConfig::accept_timeout
//! [`NetConfig::max_half_open`]: super::NetConfig::max_half_open
//! [`NetConfig::max_half_open_per_addr`]: super::NetConfig::max_half_open_per_addr

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::rc::{Rc, Weak};
use std::time::{Duration, Instant};

use futures_lite::{future, AsyncReadExt, AsyncWriteExt};
use glommio::net::{TcpListener, TcpStream};
use glommio::timer::sleep;

use super::{session, NetError, Reader, RemoteNode, MAX_ADDR_LEN};
use crate::boot::ShardCtx;
use crate::proto::{Incarnation, NodeId, ShardId};
use crate::ucx::WorkerAddress;

/// What a client sends first on a bootstrap connection: magic and version.
pub const BOOTSTRAP_REQUEST: [u8; 8] = *b"SCXB\x01\0\0\0";
/// Longest directory a client accepts (a directory of [`MAX_SHARDS`] workers with addresses of
/// 1 KiB fits).
///
/// [`MAX_SHARDS`]: crate::proto::shard_map::MAX_SHARDS
pub const MAX_DIRECTORY_LEN: usize = 8 << 20;

const DIRECTORY_MAGIC: u32 = u32::from_le_bytes(*b"SCXD");

/// A node's bootstrap directory: who it is and where each of its shards' workers are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Directory {
    /// The node.
    pub node_id: NodeId,
    /// Its incarnation.
    pub incarnation: Incarnation,
    /// Worker address of each of its shards, in shard order (its shard count is the length).
    pub workers: Vec<WorkerAddress>,
}

impl Directory {
    /// The directory as bytes (the listener's reply, after its length).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&DIRECTORY_MAGIC.to_le_bytes());
        out.extend_from_slice(&(self.workers.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.node_id.get().to_le_bytes());
        out.extend_from_slice(&self.incarnation.get().to_le_bytes());
        for w in &self.workers {
            out.extend_from_slice(&(w.as_bytes().len() as u32).to_le_bytes());
            out.extend_from_slice(w.as_bytes());
        }
        out
    }

    /// Parses a directory received from the network; `None` if it is malformed.
    pub fn decode(b: &[u8]) -> Option<Directory> {
        let mut r = Reader(b);
        if r.u32()? != DIRECTORY_MAGIC {
            return None;
        }
        let count = r.u32()?;
        if count == 0 || count > u32::from(crate::proto::shard_map::MAX_SHARDS) {
            return None;
        }
        let node_id = NodeId::new(r.u64()?);
        let incarnation = Incarnation::new(r.u64()?);
        let mut workers = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let len = r.u32()? as usize;
            if len == 0 || len > MAX_ADDR_LEN {
                return None;
            }
            workers.push(WorkerAddress::from_bytes(r.take(len)?.to_vec()));
        }
        if !r.0.is_empty() {
            return None;
        }
        Some(Directory {
            node_id,
            incarnation,
            workers,
        })
    }

    /// The node's shard count.
    pub fn shard_count(&self) -> u16 {
        // The decoder caps the count at MAX_SHARDS, which fits.
        u16::try_from(self.workers.len()).unwrap_or(u16::MAX)
    }
}

/// On shard 0 of a listening node: gathers the directory and starts the listener.
pub(super) async fn listen(ctx: &Rc<ShardCtx>) -> Result<(), crate::BootError> {
    let shard = ctx.id().index();
    let net = ctx.net();
    if shard == 0 {
        if let Some(addr) = net.settings.listen {
            let dir = gather_directory(ctx).await?;
            fn failed(addr: SocketAddr) -> impl Fn(&dyn std::fmt::Display) -> crate::BootError {
                move |e| crate::BootError::Listen {
                    shard: 0,
                    reason: format!("cannot listen on {addr}: {e}"),
                }
            }
            // A port that is taken was refused before the shards started
            // (`ShardsBuilder::run`); glommio binds with SO_REUSEPORT.
            let listener = TcpListener::bind(addr).map_err(|e| failed(addr)(&e))?;
            let local = listener.local_addr().map_err(|e| failed(addr)(&e))?;
            let _ = net.settings.listen_addr.set(local);
            let task = glommio::spawn_local(accept_loop(Rc::downgrade(ctx), listener, dir));
            *net.acceptor.borrow_mut() = Some(task);
        }
    }
    Ok(())
}

async fn gather_directory(ctx: &Rc<ShardCtx>) -> Result<Rc<Vec<u8>>, crate::BootError> {
    let mut workers = Vec::with_capacity(ctx.shard_count());
    for i in 0..ctx.shard_count() {
        // The shard count was checked to fit u16 at boot.
        let to = ShardId::new(u16::try_from(i).unwrap_or(u16::MAX));
        let bytes = ctx
            .forward(to, |c| async move {
                c.worker().address().map(|a| a.as_bytes().to_vec())
            })
            .await
            .map_err(|e| crate::BootError::Listen {
                shard: 0,
                reason: e.to_string(),
            })?
            .map_err(|source| crate::BootError::Ucx { shard: i, source })?;
        workers.push(WorkerAddress::from_bytes(bytes));
    }
    let dir = Directory {
        node_id: ctx.node_id(),
        incarnation: ctx.incarnation(),
        workers,
    }
    .encode();
    // The reply as sent: its length, then the directory.
    let len = u32::try_from(dir.len()).unwrap_or(u32::MAX);
    let mut reply = Vec::with_capacity(4 + dir.len());
    reply.extend_from_slice(&len.to_le_bytes());
    reply.extend_from_slice(&dir);
    Ok(Rc::new(reply))
}

/// How one bootstrap connection ended, on the listening side.
enum Served {
    /// The client closed it (after its directory, if it was answered).
    Closed,
    /// Its first bytes were not [`BOOTSTRAP_REQUEST`]: a foreign client, or garbage.
    Refused,
    /// No request within [`NetConfig::accept_timeout`](super::NetConfig::accept_timeout).
    TimedOut,
}

/// How long the accept loop pauses after a failed `accept` (out of file descriptors, say),
/// so that it does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Bootstrap connections being served (half-open: no directory sent yet), in all and per
/// client IP address.
#[derive(Default)]
struct HalfOpen {
    total: Cell<usize>,
    by_addr: RefCell<HashMap<IpAddr, usize>>,
}

impl HalfOpen {
    /// Takes a place for a connection from `ip` (`None`: its address is unknown), unless
    /// `total` or `per_addr` are reached.
    fn admit(&self, ip: Option<IpAddr>, total: usize, per_addr: usize) -> bool {
        if self.total.get() >= total {
            return false;
        }
        if let Some(ip) = ip {
            let mut by_addr = self.by_addr.borrow_mut();
            let n = by_addr.entry(ip).or_default();
            if *n >= per_addr {
                return false;
            }
            *n += 1;
        }
        self.total.set(self.total.get() + 1);
        true
    }

    /// Gives back the place of a connection from `ip`.
    fn leave(&self, ip: Option<IpAddr>) {
        self.total.set(self.total.get().saturating_sub(1));
        if let Some(ip) = ip {
            let mut by_addr = self.by_addr.borrow_mut();
            if let Some(n) = by_addr.get_mut(&ip) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    by_addr.remove(&ip);
                }
            }
        }
    }
}

async fn accept_loop(ctx: Weak<ShardCtx>, listener: TcpListener, reply: Rc<Vec<u8>>) {
    let live = Rc::new(HalfOpen::default());
    loop {
        let accepted = listener.accept().await;
        let Some(c) = ctx.upgrade() else { return };
        let stream = match accepted {
            Ok(s) => s,
            Err(_) => {
                drop(c);
                sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let net = c.net();
        let ip = stream.peer_addr().ok().map(|a| a.ip());
        let cfg = &net.settings.cfg;
        if !live.admit(ip, cfg.max_half_open, cfg.max_half_open_per_addr.max(1)) {
            // Closed at once, before anything is read.
            net.count(|s| s.bootstraps_over_cap += 1);
            drop(stream);
            continue;
        }
        let deadline = net.settings.cfg.accept_timeout;
        let (weak, live, reply) = (ctx.clone(), live.clone(), reply.clone());
        drop(c);
        glommio::spawn_local(async move {
            let mut stream = stream;
            let answered = Cell::new(false);
            let outcome = future::or(serve_one(&mut stream, &reply, &answered), async {
                sleep(deadline).await;
                Served::TimedOut
            })
            .await;
            if !matches!(outcome, Served::Closed) {
                // This side closes first: with a reset, so that no TIME_WAIT holds the port
                // (a node restarting on it could not bind it for a minute).
                let _ = socket2::SockRef::from(&stream).set_linger(Some(Duration::ZERO));
            }
            drop(stream);
            live.leave(ip);
            if let Some(c) = weak.upgrade() {
                c.net().count(|s| match outcome {
                    _ if answered.get() => s.bootstraps_served += 1,
                    Served::Refused | Served::Closed => s.bootstraps_refused += 1,
                    Served::TimedOut => s.bootstraps_timed_out += 1,
                });
            }
        })
        .detach();
    }
}

/// Reads the client's request, answers it with the directory (then sets `answered`), and
/// waits for the client to close first.
async fn serve_one(stream: &mut TcpStream, reply: &[u8], answered: &Cell<bool>) -> Served {
    let mut request = [0u8; BOOTSTRAP_REQUEST.len()];
    if stream.read_exact(&mut request).await.is_err() || request != BOOTSTRAP_REQUEST {
        return Served::Refused;
    }
    if stream.write_all(reply).await.is_err() || stream.flush().await.is_err() {
        return Served::Refused;
    }
    answered.set(true);
    let mut rest = [0u8; 64];
    loop {
        match stream.read(&mut rest).await {
            Ok(0) | Err(_) => return Served::Closed,
            // Nothing more is expected: whatever comes is read and dropped.
            Ok(_) => {}
        }
    }
}

impl ShardCtx {
    /// Fetches the directory of the node listening at `addr`, from this shard (see the module
    /// docs). Bounded by [`NetConfig::connect_timeout`]; a connection the listener closes
    /// unanswered (it is at its cap of half-open connections) is tried again within it, while
    /// nothing listening at `addr` fails at once ([`NetError::Unreachable`]).
    ///
    /// [`NetConfig::connect_timeout`]: super::NetConfig::connect_timeout
    pub async fn bootstrap(&self, addr: SocketAddr) -> Result<Directory, NetError> {
        let timeout = self.net().settings.cfg.connect_timeout;
        future::or(fetch_until_answered(addr), async {
            sleep(timeout).await;
            Err(NetError::TimedOut { what: "bootstrap" })
        })
        .await
    }

    /// Connects this node to the node listening at `addr`, from any shard: bootstraps from this
    /// shard, then has local shard 0 establish the node pair (one handshake per node pair,
    /// then every rail of every local shard joined; see `session`), and resolves with this
    /// shard's default rail once every local shard has its rails. Connecting again finds them
    /// up: it costs the bootstrap and one look per shard.
    pub async fn connect(self: &Rc<Self>, addr: SocketAddr) -> Result<RemoteNode, NetError> {
        if self.net().settings.psk.is_none() {
            return Err(NetError::NoKey);
        }
        let dir = self.bootstrap(addr).await?;
        if dir.node_id == self.node_id() {
            return Err(NetError::SelfConnect);
        }
        if dir.workers.is_empty() {
            return Err(NetError::BadDirectory { addr });
        }
        let node = dir.node_id;
        // Always through shard 0's establishment, also when this shard's default rail is up
        // already: another shard's connect may be establishing the node pair right now, its
        // primary done and its joins still under way, and this connect must not return before
        // every local shard has its rails (a call from here for a remote shard goes on another
        // local shard's rail). With the session and every rail up, establishing again costs one
        // look per shard and opens nothing.
        let coordinator = ShardId::new(0);
        if self.id() == coordinator {
            session::establish(self, dir).await?;
        } else {
            self.forward(coordinator, move |c| async move {
                session::establish(&c, dir).await
            })
            .await??;
        }
        self.session(node).ok_or(NetError::NotConnected { node })
    }
}

/// Whether a fetch failed because the listener closed the connection without answering: it
/// does so at once when it is serving as many connections as it may (in all, or from this
/// client's address), so a client whose shards all connect at once may meet it.
fn closed_unanswered(e: &NetError) -> bool {
    use std::io::ErrorKind;
    matches!(
        e,
        NetError::Unreachable {
            kind: ErrorKind::ConnectionReset
                | ErrorKind::ConnectionAborted
                | ErrorKind::UnexpectedEof
                | ErrorKind::BrokenPipe,
            ..
        }
    )
}

/// Fetches until the listener answers: a connection it closed unanswered is tried again after a
/// pause (5 ms, doubling up to 200 ms); any other failure (nothing listening, say) ends it at
/// once. Unbounded in time: [`ShardCtx::bootstrap`] bounds it.
async fn fetch_until_answered(addr: SocketAddr) -> Result<Directory, NetError> {
    let mut pause = Duration::from_millis(5);
    loop {
        match fetch(addr).await {
            Err(e) if closed_unanswered(&e) => {
                sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(200));
            }
            r => return r,
        }
    }
}

/// One bootstrap from this shard (unbounded in time: [`ShardCtx::bootstrap`] bounds it).
async fn fetch(addr: SocketAddr) -> Result<Directory, NetError> {
    let unreachable = |e: std::io::Error| NetError::Unreachable {
        addr,
        kind: e.kind(),
    };
    let mut stream = TcpStream::connect(addr)
        .await
        .map_err(|e| unreachable(e.into()))?;
    stream
        .write_all(&BOOTSTRAP_REQUEST)
        .await
        .map_err(unreachable)?;
    stream.flush().await.map_err(unreachable)?;
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).await.map_err(unreachable)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_DIRECTORY_LEN {
        return Err(NetError::BadDirectory { addr });
    }
    let mut bytes = vec![0u8; len];
    stream.read_exact(&mut bytes).await.map_err(unreachable)?;
    Directory::decode(&bytes).ok_or(NetError::BadDirectory { addr })
}

/// Fetches the directory of the node listening at `addr` with blocking socket calls, within
/// `timeout` (for tools and tests outside a shard: the node does the same from a shard with
/// [`ShardCtx::bootstrap`]).
pub fn fetch_directory_blocking(
    addr: SocketAddr,
    timeout: Duration,
) -> Result<Directory, NetError> {
    use std::io::{Read, Write};
    let deadline = Instant::now() + timeout;
    let unreachable = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            NetError::TimedOut { what: "bootstrap" }
        }
        kind => NetError::Unreachable { addr, kind },
    };
    let left = || {
        deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or(NetError::TimedOut { what: "bootstrap" })
    };
    let mut s = std::net::TcpStream::connect_timeout(&addr, left()?).map_err(unreachable)?;
    s.set_write_timeout(Some(left()?)).map_err(unreachable)?;
    s.write_all(&BOOTSTRAP_REQUEST).map_err(unreachable)?;
    let mut len = [0u8; 4];
    s.set_read_timeout(Some(left()?)).map_err(unreachable)?;
    s.read_exact(&mut len).map_err(unreachable)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_DIRECTORY_LEN {
        return Err(NetError::BadDirectory { addr });
    }
    let mut bytes = vec![0u8; len];
    s.set_read_timeout(Some(left()?)).map_err(unreachable)?;
    s.read_exact(&mut bytes).map_err(unreachable)?;
    Directory::decode(&bytes).ok_or(NetError::BadDirectory { addr })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directory_round_trip_and_rejects_garbage() {
        let d = Directory {
            node_id: NodeId::new(7),
            incarnation: Incarnation::new(9),
            workers: vec![
                WorkerAddress::from_bytes(vec![1, 2, 3]),
                WorkerAddress::from_bytes(vec![4]),
            ],
        };
        let b = d.encode();
        assert_eq!(Directory::decode(&b), Some(d));
        for cut in 0..b.len() {
            assert_eq!(Directory::decode(&b[..cut]), None);
        }
        let mut long = b.clone();
        long.push(0);
        assert_eq!(Directory::decode(&long), None);
    }

    #[test]
    fn half_open_places_are_capped_per_address_and_in_all() {
        let h = HalfOpen::default();
        let (a, b, c) = (
            Some(IpAddr::from([10, 0, 0, 1])),
            Some(IpAddr::from([10, 0, 0, 2])),
            Some(IpAddr::from([10, 0, 0, 3])),
        );
        for _ in 0..3 {
            assert!(h.admit(a, 5, 3));
        }
        assert!(!h.admit(a, 5, 3), "a fourth from one address");
        assert!(h.admit(b, 5, 3), "another address still gets in");
        assert!(h.admit(None, 5, 3), "an unknown address counts in all only");
        assert!(!h.admit(c, 5, 3), "the total is reached");
        h.leave(a);
        assert!(h.admit(a, 5, 3), "a place given back is taken again");
        h.leave(None);
        h.leave(b);
        for _ in 0..3 {
            h.leave(a);
        }
        assert_eq!(h.total.get(), 0);
        assert!(
            h.by_addr.borrow().is_empty(),
            "no address is kept once it has no place"
        );
    }
}
