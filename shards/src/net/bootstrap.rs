//! Bootstrap: the listener, the directory it serves, and connecting to a node by address.

use std::net::SocketAddr;
use std::rc::{Rc, Weak};

use futures_lite::future;
use glommio::timer::sleep;

use super::{session, NetError, Reader, RemoteNode, DIRECTORY_AM, MAX_ADDR_LEN};
use crate::boot::ShardCtx;
use crate::proto::{Incarnation, NodeId, ShardId};
use crate::ucx::{AmProto, Endpoint, EpOptions, ErrorMode, Listener, WorkerAddress};

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
    /// The directory as bytes (the payload of [`DIRECTORY_AM`]).
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
    let ucx = |source| crate::BootError::Ucx { shard, source };
    let net = ctx.net();
    if shard == 0 {
        if let Some(addr) = net.settings.listen {
            let dir = gather_directory(ctx).await?;
            let listener = Listener::bind(ctx.worker(), addr).map_err(ucx)?;
            let local = listener.local_addr().map_err(ucx)?;
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
    };
    Ok(Rc::new(dir.encode()))
}

async fn accept_loop(ctx: Weak<ShardCtx>, listener: Listener, dir: Rc<Vec<u8>>) {
    loop {
        let request = listener.accept().await;
        let Some(c) = ctx.upgrade() else { return };
        let linger = c.net().settings.cfg.connect_timeout;
        let opts = EpOptions {
            error_mode: ErrorMode::Peer,
        };
        let Ok(ep) = Endpoint::accept(c.worker(), request, opts) else {
            continue;
        };
        let payload = dir.as_ref().clone();
        let weak = ctx.clone();
        drop(c);
        glommio::spawn_local(async move {
            let send = ep.am_send(DIRECTORY_AM, &[], payload, AmProto::Eager);
            if let Some(c) = weak.upgrade() {
                c.wake_driver();
            }
            let (res, _payload) = send.await;
            if res.is_ok() {
                let _ = future::or(ep.flush(), async {
                    sleep(linger).await;
                    Ok(())
                })
                .await;
                // Keep the endpoint until the client leaves (or the timeout), so that a close
                // from this side cannot overtake the directory.
                future::or(
                    async {
                        ep.failed().await;
                    },
                    sleep(linger),
                )
                .await;
            }
        })
        .detach();
    }
}

impl ShardCtx {
    /// Fetches the directory of the node listening at `addr`, from this shard (see the module
    /// docs). Bounded by [`NetConfig::connect_timeout`].
    ///
    /// [`NetConfig::connect_timeout`]: super::NetConfig::connect_timeout
    pub async fn bootstrap(&self, addr: SocketAddr) -> Result<Directory, NetError> {
        let net = self.net();
        let _permit = net
            .bootstrap_lock
            .acquire_permit(1)
            .await
            .map_err(|_| NetError::ShuttingDown)?;
        while net.directories.try_next().is_some() {}
        let opts = EpOptions {
            error_mode: ErrorMode::Peer,
        };
        let ep = Endpoint::connect(self.worker(), addr, opts)
            .map_err(|source| NetError::Unreachable { addr, source })?;
        self.wake_driver();
        enum Outcome {
            Dir(Option<Vec<u8>>),
            Failed(crate::ucx::Error),
            Timeout,
        }
        let timeout = net.settings.cfg.connect_timeout;
        let outcome = future::or(
            async { Outcome::Dir(net.directories.next().await) },
            future::or(async { Outcome::Failed(ep.failed().await) }, async {
                sleep(timeout).await;
                Outcome::Timeout
            }),
        )
        .await;
        drop(ep);
        match outcome {
            Outcome::Dir(Some(bytes)) => {
                Directory::decode(&bytes).ok_or(NetError::BadDirectory { addr })
            }
            Outcome::Dir(None) => Err(NetError::ShuttingDown),
            Outcome::Failed(source) => Err(NetError::Unreachable { addr, source }),
            Outcome::Timeout => Err(NetError::TimedOut { what: "bootstrap" }),
        }
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
}
