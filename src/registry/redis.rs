//! [`RedisRegistry`]: node records kept in a Redis server, each with a time-to-live that its
//! node refreshes, so a node that dies disappears within the ttl.
//!
//! # Data model
//!
//! With the key prefix `P` (default `shardcx`), a node `N` (its [`NodeId`], in decimal) of the
//! service `S` with functions named `F…`:
//!
//! | key | type | holds | expires |
//! | --- | --- | --- | --- |
//! | `P:node:S:N` | string | the [`NodeRecord`], encoded as below | after the ttl, unless refreshed |
//! | `P:service:S` | set | the node ids `N` registered under `S` | after the ttl, unless some node of `S` refreshes |
//! | `P:fn:F` | set | members `S:N`, the nodes serving `F` | after the ttl, unless some node serving `F` refreshes |
//!
//! The record is the source of truth; the sets are indexes. [`register`](Registry::register)
//! writes the record (`SET … PX ttl`), adds the node to its service's set and to each
//! function's set, extends those sets' lives to the ttl, and removes the node from the sets of
//! functions its previous record listed and the new one does not; all in one `MULTI`/`EXEC`.
//! Look-ups read a set (`SMEMBERS`), then the records (`MGET`), and keep the records that exist,
//! decode, and match the member they were found by (same service and node, and for
//! [`find_function`](Registry::find_function) a function of that name). Members whose record
//! has expired are removed from the set afterwards by a small Lua script that checks, atomically,
//! that the record is still absent (so a node registering at that moment is not removed).
//! [`deregister`](Registry::deregister) deletes the record and its set members.
//!
//! Every node sharing a prefix should use the same ttl: a set expires when the last node
//! refreshing it stops, so a node with a shorter ttl than the others can make a set expire
//! early, and the others reappear at their next refresh.
//!
//! A record is stored as a short versioned text, readable with `redis-cli GET`:
//!
//! ```text
//! shardcx-node 1
//! service kv
//! node 7
//! addr 10.0.0.7:4100
//! shards 4
//! fn 1 00c0ffee00c0ffee 1 kv.get
//! ```
//!
//! Lines in that order, each ending with `\n`: the header with the format version (1), the
//! service, the node id, the address (`ip:port` or `[ipv6]:port`), the shard count, then one
//! line per function: id, schema hash (16 lowercase hex digits), version, name. Names are
//! escaped: every byte outside `!`..=`~`, and `%`, is written `%XX`. A record that does not
//! decode exactly so (another version, a missing line, bad numbers, over 1 MiB or 4096
//! functions), or that does not match the key it was found by, is skipped and counted in
//! [`RedisRegistry::bad_records`]; it never fails the look-up and never panics.
//!
//! # Staying registered
//!
//! [`RedisRegistry::keep_registered`] registers a record and spawns a task on the current
//! shard that registers it again every period (a third of the ttl is a good choice) for as long
//! as the returned [`Registration`] lives. Drop it, or let the process die, and the record
//! expires within the ttl; [`Registration::stop`] removes it at once.
//!
//! # Connection and deadlines
//!
//! One connection per registry (and a second one briefly when two operations of the same
//! shard overlap), opened on first use from a URL `redis://[[user]:password@]host[:port][/db]`
//! (port 6379 and database 0 by default; the password and user are percent-decoded;
//! `AUTH` and `SELECT` are sent when given). Every operation, connecting included, finishes
//! within [`RedisConfig::timeout`] or fails with [`RegistryError::TimedOut`]; a refused or
//! broken connection is [`RegistryError::Unavailable`]; an error reply from the server is
//! [`RegistryError::Protocol`]. After any failure the connection is closed and the next
//! operation opens a new one; an operation whose reused connection turns out broken (the
//! server restarted) is retried once on a fresh connection, which is safe because every
//! command the registry sends is idempotent. Replies are parsed by a bounded RESP2 parser
//! (bulk strings up to 4 MiB, replies up to 64 MiB, arrays nested at most 4 deep). A host
//! name is resolved with the system resolver, which blocks the shard briefly: prefer an
//! address. One Redis server (or a primary); Redis Cluster is not supported.
//!
//! # Example
//!
//! ```no_run
//! use std::net::SocketAddr;
//!
//! use shardcx::registry::{NodeRecord, RedisConfig, RedisRegistry, Registry, Signature};
//! use shardcx::NodeId;
//!
//! // Inside a shard: `Node::run`'s closure or a glommio `LocalExecutor`.
//! async fn publish_and_find() -> Result<(), shardcx::registry::RegistryError> {
//!     let config = RedisConfig::default();
//!     let every = config.ttl / 3;
//!     let registry = RedisRegistry::connect("redis://:secret@127.0.0.1:6379/0", config).await?;
//!     let me = NodeRecord {
//!         service: "kv".into(),
//!         node: NodeId::new(7),
//!         addr: SocketAddr::from(([10, 0, 0, 7], 4100)),
//!         shards: 4,
//!         functions: vec![Signature {
//!             id: 1,
//!             name: "kv.get".into(),
//!             schema: 0xc0ffee,
//!             version: 1,
//!         }],
//!     };
//!     // Registered, and refreshed every ttl/3, while `registration` lives.
//!     let registration = registry.keep_registered(me, every).await?;
//!     for node in registry.find_function("kv.get").await? {
//!         println!("node {} of {} serves kv.get at {}", node.node, node.service, node.addr);
//!     }
//!     registration.stop().await
//! }
//! ```

use std::cell::{Cell, RefCell};
use std::fmt;
use std::rc::Rc;
use std::time::{Duration, Instant};

use futures_lite::{AsyncReadExt, AsyncWriteExt};
use glommio::net::TcpStream;
use glommio::Task;
use shardcx_shards::proto::NodeId;

use super::record;
use super::resp::{self, Decoder, Limits, Value};
use super::{NodeRecord, Registry, RegistryError};

/// Removes, from the set `KEYS[1]`, each member `ARGV[i]` whose record `KEYS[i + 1]` does not
/// exist, checked and removed atomically; returns how many were removed.
const REMOVE_EXPIRED: &str = "local n = 0 \
for i = 2, #KEYS do \
  if redis.call('EXISTS', KEYS[i]) == 0 then \
    n = n + redis.call('SREM', KEYS[1], ARGV[i - 1]) \
  end \
end \
return n";

/// Bytes read from the socket at a time.
const READ_CHUNK: usize = 16 << 10;

/// How a [`RedisRegistry`] names its keys, how long records live, and how long an operation
/// may take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisConfig {
    /// Prefix of every key (default `"shardcx"`).
    pub key_prefix: String,
    /// How long a record lives unless it is registered again (default 30 s; at least 1 ms).
    pub ttl: Duration,
    /// Deadline of each operation, connecting included (default 2 s). Keep it well under a
    /// third of the ttl so that a slow refresh still lands before the record expires.
    pub timeout: Duration,
}

/// A [`Registry`] kept in a Redis server: see the [module docs](self) for the data model.
///
/// Cheap to clone (the clones share the connection and counters). Not `Send`: it lives on the
/// shard that made it.
#[derive(Clone)]
pub struct RedisRegistry {
    inner: Rc<Inner>,
}

/// Keeps a record registered while it lives: see [`RedisRegistry::keep_registered`].
#[derive(Debug)]
pub struct Registration {
    /// The refresh task; dropping it cancels it.
    task: Task<()>,
    state: Rc<RefreshState>,
    registry: RedisRegistry,
    service: String,
    node: NodeId,
}

/// What the refresh task reports.
#[derive(Debug, Default)]
struct RefreshState {
    refreshes: Cell<u64>,
    failures: Cell<u64>,
    last_error: RefCell<Option<String>>,
}

struct Inner {
    target: Target,
    config: RedisConfig,
    limits: Limits,
    /// The idle connection, if any. Taken for the length of an exchange (never borrowed
    /// across an `.await`), put back when the exchange succeeds.
    conn: RefCell<Option<Conn>>,
    bad_records: Cell<u64>,
}

/// Where the server is, from the URL.
#[derive(Clone, PartialEq, Eq)]
struct Target {
    host: String,
    port: u16,
    user: Option<String>,
    password: Option<String>,
    db: u32,
}

/// One connection to the server.
struct Conn {
    stream: TcpStream,
    decoder: Decoder,
    chunk: Vec<u8>,
}

/// Commands to send together, and how many replies they will get.
#[derive(Default)]
struct Batch {
    bytes: Vec<u8>,
    count: usize,
}

/// A set member found by a look-up, and the record it points to.
struct Entry {
    member: Vec<u8>,
    key: Vec<u8>,
    service: String,
    node: NodeId,
}

impl Default for RedisConfig {
    fn default() -> Self {
        RedisConfig {
            key_prefix: "shardcx".into(),
            ttl: Duration::from_secs(30),
            timeout: Duration::from_secs(2),
        }
    }
}

impl RedisRegistry {
    /// Connects to the server at `url` (`redis://[[user]:password@]host[:port][/db]`),
    /// authenticates and selects the database if the URL says so, and checks it answers
    /// `PING`. Must run on a shard (a glommio executor).
    ///
    /// Errors: [`RegistryError::Invalid`] for a bad URL or config,
    /// [`RegistryError::Unavailable`] if the server cannot be reached,
    /// [`RegistryError::Protocol`] if it refuses (a wrong password),
    /// [`RegistryError::TimedOut`] after `config.timeout`.
    pub async fn connect(url: &str, config: RedisConfig) -> Result<Self, RegistryError> {
        let target = parse_url(url)?;
        if config.ttl < Duration::from_millis(1) {
            return Err(RegistryError::Invalid("ttl must be at least 1 ms".into()));
        }
        if config.timeout.is_zero() {
            return Err(RegistryError::Invalid("timeout must not be zero".into()));
        }
        let registry = RedisRegistry {
            inner: Rc::new(Inner {
                target,
                config,
                limits: Limits::default(),
                conn: RefCell::new(None),
                bad_records: Cell::new(0),
            }),
        };
        let mut ping = Batch::default();
        ping.push(&[b"PING"]);
        let replies = registry.exchange(registry.deadline(), &ping).await?;
        match replies.first() {
            Some(Value::Simple(s)) if s == b"PONG" => Ok(registry),
            other => Err(unexpected("PING", other)),
        }
    }

    /// The configuration it was made with.
    pub fn config(&self) -> &RedisConfig {
        &self.inner.config
    }

    /// How many stored records look-ups skipped because they did not decode or did not match
    /// the key they were found by, and set members that were not valid node references.
    pub fn bad_records(&self) -> u64 {
        self.inner.bad_records.get()
    }

    /// Registers `record` now, then again every `every` from a task spawned on the current
    /// shard, for as long as the returned [`Registration`] lives. A refresh that fails is
    /// counted ([`Registration::refresh_failures`]) and tried again at the next period.
    ///
    /// `every` must be shorter than the ttl (a third of it leaves room for two failed
    /// refreshes); otherwise [`RegistryError::Invalid`]. The first registration's error is
    /// returned as is.
    pub async fn keep_registered(
        &self,
        record: NodeRecord,
        every: Duration,
    ) -> Result<Registration, RegistryError> {
        if every.is_zero() || every >= self.inner.config.ttl {
            return Err(RegistryError::Invalid(format!(
                "refresh period {every:?} must be non-zero and shorter than the ttl {:?}",
                self.inner.config.ttl
            )));
        }
        self.register(&record).await?;
        let state = Rc::new(RefreshState::default());
        let (service, node) = (record.service.clone(), record.node);
        let task = glommio::spawn_local({
            let registry = self.clone();
            let state = state.clone();
            async move {
                loop {
                    glommio::timer::sleep(every).await;
                    match registry.register(&record).await {
                        Ok(()) => state.refreshes.set(state.refreshes.get() + 1),
                        Err(e) => {
                            state.failures.set(state.failures.get() + 1);
                            *state.last_error.borrow_mut() = Some(e.to_string());
                        }
                    }
                }
            }
        });
        Ok(Registration {
            task,
            state,
            registry: self.clone(),
            service,
            node,
        })
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.inner.config.timeout
    }

    fn node_key(&self, service: &str, node: NodeId) -> Vec<u8> {
        format!(
            "{}:node:{service}:{}",
            self.inner.config.key_prefix,
            node.get()
        )
        .into_bytes()
    }

    fn service_key(&self, service: &str) -> Vec<u8> {
        format!("{}:service:{service}", self.inner.config.key_prefix).into_bytes()
    }

    fn fn_key(&self, function: &str) -> Vec<u8> {
        format!("{}:fn:{function}", self.inner.config.key_prefix).into_bytes()
    }

    fn ttl_ms(&self) -> Vec<u8> {
        self.inner.config.ttl.as_millis().to_string().into_bytes()
    }

    fn count_bad(&self, n: usize) {
        let inner = &self.inner;
        inner.bad_records.set(inner.bad_records.get() + n as u64);
    }

    /// Sends `batch` and reads its replies, by `deadline`.
    async fn exchange(
        &self,
        deadline: Instant,
        batch: &Batch,
    ) -> Result<Vec<Value>, RegistryError> {
        let timeout = self.inner.config.timeout;
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(RegistryError::TimedOut(timeout));
        }
        // Dropping the exchange at the deadline drops the connection it holds (a half-read
        // reply would put it out of step), so the next operation reconnects.
        futures_lite::future::or(self.exchange_now(batch), async {
            glommio::timer::sleep(left).await;
            Err(RegistryError::TimedOut(timeout))
        })
        .await
    }

    async fn exchange_now(&self, batch: &Batch) -> Result<Vec<Value>, RegistryError> {
        let idle = self.inner.conn.borrow_mut().take();
        let reused = idle.is_some();
        let mut conn = match idle {
            Some(conn) => conn,
            None => Conn::open(&self.inner.target, self.inner.limits).await?,
        };
        let replies = match conn.exchange(batch).await {
            Ok(replies) => replies,
            // The idle connection broke while it was idle (a server restart): once more on a
            // fresh one. Every command we send is idempotent.
            Err(RegistryError::Unavailable(_)) if reused => {
                conn = Conn::open(&self.inner.target, self.inner.limits).await?;
                conn.exchange(batch).await?
            }
            Err(e) => return Err(e),
        };
        let mut slot = self.inner.conn.borrow_mut();
        if slot.is_none() {
            *slot = Some(conn);
        }
        Ok(replies)
    }

    /// `GET key`.
    async fn get(&self, deadline: Instant, key: &[u8]) -> Result<Option<Vec<u8>>, RegistryError> {
        let mut batch = Batch::default();
        batch.push(&[b"GET", key]);
        match self.exchange(deadline, &batch).await?.pop() {
            Some(Value::Bulk(b)) => Ok(Some(b)),
            Some(Value::Nil) => Ok(None),
            other => Err(unexpected("GET", other.as_ref())),
        }
    }

    /// `SMEMBERS key`.
    async fn members(&self, deadline: Instant, key: &[u8]) -> Result<Vec<Vec<u8>>, RegistryError> {
        let mut batch = Batch::default();
        batch.push(&[b"SMEMBERS", key]);
        match self.exchange(deadline, &batch).await?.pop() {
            Some(Value::Array(items)) => items
                .into_iter()
                .map(|v| match v {
                    Value::Bulk(b) => Ok(b),
                    other => Err(unexpected("SMEMBERS", Some(&other))),
                })
                .collect(),
            other => Err(unexpected("SMEMBERS", other.as_ref())),
        }
    }

    /// The valid records of `entries` (members of `set`) that `keep` accepts, sorted by
    /// service and node. Members in `junk` (not node references) and members whose record
    /// has expired are removed from `set` afterwards, best effort.
    async fn collect(
        &self,
        deadline: Instant,
        set: &[u8],
        entries: Vec<Entry>,
        junk: Vec<Vec<u8>>,
        keep: impl Fn(&NodeRecord) -> bool,
    ) -> Result<Vec<NodeRecord>, RegistryError> {
        self.count_bad(junk.len());
        let mut found = Vec::new();
        let mut expired = Vec::new();
        if !entries.is_empty() {
            let mut mget = Batch::default();
            let mut args: Vec<&[u8]> = vec![b"MGET"];
            args.extend(entries.iter().map(|e| e.key.as_slice()));
            mget.push(&args);
            let values = match self.exchange(deadline, &mget).await?.pop() {
                Some(Value::Array(values)) if values.len() == entries.len() => values,
                other => return Err(unexpected("MGET", other.as_ref())),
            };
            for (entry, value) in entries.into_iter().zip(values) {
                match value {
                    Value::Nil => expired.push(entry),
                    Value::Bulk(bytes) => match record::decode(&bytes) {
                        Ok(r) if r.service == entry.service && r.node == entry.node => {
                            if keep(&r) {
                                found.push(r);
                            }
                        }
                        _ => self.count_bad(1),
                    },
                    other => return Err(unexpected("MGET", Some(&other))),
                }
            }
        }
        if !junk.is_empty() || !expired.is_empty() {
            let mut cleanup = Batch::default();
            if !junk.is_empty() {
                let mut args: Vec<&[u8]> = vec![b"SREM", set];
                args.extend(junk.iter().map(Vec::as_slice));
                cleanup.push(&args);
            }
            if !expired.is_empty() {
                let keys = (expired.len() + 1).to_string();
                let mut args: Vec<&[u8]> =
                    vec![b"EVAL", REMOVE_EXPIRED.as_bytes(), keys.as_bytes()];
                args.push(set);
                args.extend(expired.iter().map(|e| e.key.as_slice()));
                args.extend(expired.iter().map(|e| e.member.as_slice()));
                cleanup.push(&args);
            }
            // Best effort: the look-up's answer stands even if the clean-up fails, and a
            // later look-up tries again.
            let _ = self.exchange(deadline, &cleanup).await;
        }
        found.sort_by(|a, b| (&a.service, a.node).cmp(&(&b.service, b.node)));
        Ok(found)
    }
}

impl Registration {
    /// The record's service.
    pub fn service(&self) -> &str {
        &self.service
    }

    /// The record's node.
    pub fn node(&self) -> NodeId {
        self.node
    }

    /// Refreshes that succeeded (the first registration not counted).
    pub fn refreshes(&self) -> u64 {
        self.state.refreshes.get()
    }

    /// Refreshes that failed.
    pub fn refresh_failures(&self) -> u64 {
        self.state.failures.get()
    }

    /// The last refresh failure, as text.
    pub fn last_error(&self) -> Option<String> {
        self.state.last_error.borrow().clone()
    }

    /// Stops refreshing and removes the record now.
    pub async fn stop(self) -> Result<(), RegistryError> {
        drop(self.task);
        self.registry.deregister(&self.service, self.node).await
    }
}

impl Conn {
    async fn open(target: &Target, limits: Limits) -> Result<Conn, RegistryError> {
        let stream = TcpStream::connect((target.host.as_str(), target.port))
            .await
            .map_err(|e| {
                RegistryError::Unavailable(format!(
                    "connecting to {}:{}: {e}",
                    target.host, target.port
                ))
            })?;
        // Commands are small and each batch is one write: no reason to wait for more.
        stream
            .set_nodelay(true)
            .map_err(|e| RegistryError::Unavailable(format!("setting TCP_NODELAY: {e}")))?;
        let mut conn = Conn {
            stream,
            decoder: Decoder::new(limits),
            chunk: vec![0; READ_CHUNK],
        };
        let mut hello = Batch::default();
        if let Some(password) = &target.password {
            match &target.user {
                Some(user) => hello.push(&[b"AUTH", user.as_bytes(), password.as_bytes()]),
                None => hello.push(&[b"AUTH", password.as_bytes()]),
            }
        }
        if target.db != 0 {
            hello.push(&[b"SELECT", target.db.to_string().as_bytes()]);
        }
        if hello.count > 0 {
            for reply in conn.exchange(&hello).await? {
                expect_ok("AUTH/SELECT", &reply)?;
            }
        }
        Ok(conn)
    }

    /// Writes the batch and reads one reply per command.
    async fn exchange(&mut self, batch: &Batch) -> Result<Vec<Value>, RegistryError> {
        let io = |e: std::io::Error| RegistryError::Unavailable(format!("connection failed: {e}"));
        self.stream.write_all(&batch.bytes).await.map_err(io)?;
        self.stream.flush().await.map_err(io)?;
        let mut replies = Vec::with_capacity(batch.count);
        while replies.len() < batch.count {
            let next = self
                .decoder
                .next_reply()
                .map_err(|e| RegistryError::Protocol(format!("bad reply from the server: {e}")))?;
            match next {
                Some(reply) => replies.push(reply),
                None => {
                    let n = self.stream.read(&mut self.chunk).await.map_err(io)?;
                    if n == 0 {
                        return Err(RegistryError::Unavailable(
                            "connection closed by the server".into(),
                        ));
                    }
                    self.decoder.feed(&self.chunk[..n]);
                }
            }
        }
        Ok(replies)
    }
}

impl Batch {
    fn push(&mut self, args: &[&[u8]]) {
        resp::encode(args, &mut self.bytes);
        self.count += 1;
    }
}

impl Registry for RedisRegistry {
    async fn register(&self, record: &NodeRecord) -> Result<(), RegistryError> {
        let deadline = self.deadline();
        let key = self.node_key(&record.service, record.node);
        let member = format!("{}:{}", record.service, record.node.get());
        // Functions the previous record listed and this one does not: leave their sets.
        let dropped: Vec<String> = match self.get(deadline, &key).await? {
            Some(bytes) => match record::decode(&bytes) {
                Ok(old) => old
                    .functions
                    .into_iter()
                    .filter(|f| record.function(&f.name).is_none())
                    .map(|f| f.name)
                    .collect(),
                Err(_) => Vec::new(),
            },
            None => Vec::new(),
        };
        let (ttl, id) = (self.ttl_ms(), record.node.get().to_string());
        let service_key = self.service_key(&record.service);
        let mut batch = Batch::default();
        batch.push(&[b"MULTI"]);
        batch.push(&[b"SET", &key, &record::encode(record), b"PX", &ttl]);
        batch.push(&[b"SADD", &service_key, id.as_bytes()]);
        batch.push(&[b"PEXPIRE", &service_key, &ttl]);
        for f in &record.functions {
            let fn_key = self.fn_key(&f.name);
            batch.push(&[b"SADD", &fn_key, member.as_bytes()]);
            batch.push(&[b"PEXPIRE", &fn_key, &ttl]);
        }
        for name in &dropped {
            batch.push(&[b"SREM", &self.fn_key(name), member.as_bytes()]);
        }
        batch.push(&[b"EXEC"]);
        check_transaction(&self.exchange(deadline, &batch).await?)
    }

    async fn deregister(&self, service: &str, node: NodeId) -> Result<(), RegistryError> {
        let deadline = self.deadline();
        let key = self.node_key(service, node);
        let member = format!("{service}:{}", node.get());
        let functions = match self.get(deadline, &key).await? {
            Some(bytes) => record::decode(&bytes)
                .map(|r| r.functions)
                .unwrap_or_default(),
            None => Vec::new(),
        };
        let id = node.get().to_string();
        let mut batch = Batch::default();
        batch.push(&[b"MULTI"]);
        batch.push(&[b"DEL", &key]);
        batch.push(&[b"SREM", &self.service_key(service), id.as_bytes()]);
        for f in &functions {
            batch.push(&[b"SREM", &self.fn_key(&f.name), member.as_bytes()]);
        }
        batch.push(&[b"EXEC"]);
        check_transaction(&self.exchange(deadline, &batch).await?)
    }

    async fn lookup(&self, service: &str) -> Result<Vec<NodeRecord>, RegistryError> {
        let deadline = self.deadline();
        let set = self.service_key(service);
        let (mut entries, mut junk) = (Vec::new(), Vec::new());
        for member in self.members(deadline, &set).await? {
            let id = std::str::from_utf8(&member).ok().and_then(decimal);
            match id {
                Some(id) => entries.push(Entry {
                    key: self.node_key(service, NodeId::new(id)),
                    member,
                    service: service.to_string(),
                    node: NodeId::new(id),
                }),
                None => junk.push(member),
            }
        }
        self.collect(deadline, &set, entries, junk, |_| true).await
    }

    async fn find_function(&self, function: &str) -> Result<Vec<NodeRecord>, RegistryError> {
        let deadline = self.deadline();
        let set = self.fn_key(function);
        let (mut entries, mut junk) = (Vec::new(), Vec::new());
        for member in self.members(deadline, &set).await? {
            let parsed = std::str::from_utf8(&member)
                .ok()
                .and_then(|m| m.rsplit_once(':'))
                .and_then(|(service, id)| Some((service.to_string(), decimal(id)?)));
            match parsed {
                Some((service, id)) => entries.push(Entry {
                    key: self.node_key(&service, NodeId::new(id)),
                    member,
                    service,
                    node: NodeId::new(id),
                }),
                None => junk.push(member),
            }
        }
        self.collect(deadline, &set, entries, junk, |r| {
            r.function(function).is_some()
        })
        .await
    }
}

impl fmt::Debug for RedisRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisRegistry")
            .field("target", &self.inner.target)
            .field("config", &self.inner.config)
            .field("bad_records", &self.inner.bad_records.get())
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for Target {
    /// Never prints the password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Target")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("db", &self.db)
            .finish()
    }
}

/// `redis://[[user]:password@]host[:port][/db]`.
fn parse_url(url: &str) -> Result<Target, RegistryError> {
    let bad = |why: &str| RegistryError::Invalid(format!("bad Redis URL: {why}"));
    let rest = url
        .strip_prefix("redis://")
        .ok_or_else(|| bad("expected redis://[[user]:password@]host[:port][/db] (no TLS)"))?;
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let db = match path {
        "" => 0,
        p => decimal(p).ok_or_else(|| bad("the database must be a number"))?,
    };
    let (user, password, hostport) = match authority.rsplit_once('@') {
        Some((userinfo, hostport)) => {
            let (user, password) = userinfo
                .split_once(':')
                .ok_or_else(|| bad("a user name needs a password (user:password@)"))?;
            let user = percent_decode(user).ok_or_else(|| bad("bad %-escape in the user"))?;
            let password =
                percent_decode(password).ok_or_else(|| bad("bad %-escape in the password"))?;
            ((!user.is_empty()).then_some(user), Some(password), hostport)
        }
        None => (None, None, authority),
    };
    let (host, port) = if let Some(v6) = hostport.strip_prefix('[') {
        let (host, after) = v6
            .split_once(']')
            .ok_or_else(|| bad("unclosed [ in the host"))?;
        match after {
            "" => (host, None),
            p => (
                host,
                Some(p.strip_prefix(':').ok_or_else(|| bad("junk after ]"))?),
            ),
        }
    } else {
        match hostport.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (hostport, None),
        }
    };
    let port = match port {
        None => 6379,
        Some(p) => decimal(p)
            .filter(|&p| p != 0)
            .ok_or_else(|| bad("the port must be a number from 1 to 65535"))?,
    };
    if host.is_empty() || host.contains(['@', '/', '?', '#', ' ']) {
        return Err(bad("missing or invalid host"));
    }
    Ok(Target {
        host: host.to_string(),
        port,
        user,
        password,
        db,
    })
}

/// `%XX` escapes decoded; the result must be UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let mut out = Vec::with_capacity(s.len());
    let mut bytes = s.bytes();
    while let Some(b) = bytes.next() {
        if b == b'%' {
            let hex = [bytes.next()?, bytes.next()?];
            let hex = std::str::from_utf8(&hex).ok()?;
            if !hex.bytes().all(|h| h.is_ascii_hexdigit()) {
                return None;
            }
            out.push(u8::from_str_radix(hex, 16).ok()?);
        } else {
            out.push(b);
        }
    }
    String::from_utf8(out).ok()
}

/// A decimal number: digits only, in range.
fn decimal<T: std::str::FromStr>(s: &str) -> Option<T> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

fn unexpected(command: &str, reply: Option<&Value>) -> RegistryError {
    match reply {
        Some(Value::Error(e)) => RegistryError::Protocol(format!("{command} refused: {e}")),
        other => RegistryError::Protocol(format!("unexpected reply to {command}: {other:?}")),
    }
}

fn expect_ok(command: &str, reply: &Value) -> Result<(), RegistryError> {
    match reply {
        Value::Simple(s) if s == b"OK" => Ok(()),
        other => Err(unexpected(command, Some(other))),
    }
}

/// Checks the replies to `MULTI`, the queued commands and `EXEC`.
fn check_transaction(replies: &[Value]) -> Result<(), RegistryError> {
    let Some((exec, queued)) = replies.split_last() else {
        return Err(unexpected("EXEC", None));
    };
    let Some((multi, queued)) = queued.split_first() else {
        return Err(unexpected("EXEC", None));
    };
    expect_ok("MULTI", multi)?;
    for q in queued {
        match q {
            Value::Simple(s) if s == b"QUEUED" => {}
            other => return Err(unexpected("a queued command", Some(other))),
        }
    }
    match exec {
        Value::Array(results) => match results.iter().find(|r| matches!(r, Value::Error(_))) {
            Some(e) => Err(unexpected("a command in MULTI", Some(e))),
            None if results.len() == queued.len() => Ok(()),
            None => Err(unexpected("EXEC", Some(exec))),
        },
        other => Err(unexpected("EXEC", Some(other))),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // A test may panic: a panic is a failure it reports.

    use super::*;

    #[test]
    fn parses_urls() {
        let t = parse_url("redis://127.0.0.1:6380").unwrap();
        assert_eq!((t.host.as_str(), t.port, t.db), ("127.0.0.1", 6380, 0));
        assert_eq!((t.user, t.password), (None, None));
        let t = parse_url("redis://:p%40ss:w@localhost/3").unwrap();
        assert_eq!((t.host.as_str(), t.port, t.db), ("localhost", 6379, 3));
        assert_eq!((t.user, t.password.as_deref()), (None, Some("p@ss:w")));
        let t = parse_url("redis://alice:pw@[::1]:7000/").unwrap();
        assert_eq!((t.host.as_str(), t.port, t.db), ("::1", 7000, 0));
        assert_eq!(t.user.as_deref(), Some("alice"));
        assert!(!format!("{t:?}").contains("pw"), "Debug hides the password");
        for bad in [
            "",
            "rediss://h:1",
            "http://h:1",
            "redis://",
            "redis://:6379",
            "redis://h:0",
            "redis://h:65536",
            "redis://h:x",
            "redis://h:+1",
            "redis://h:1/x",
            "redis://h:1/1/2",
            "redis://pw@h:1",
            "redis://:%zz@h:1",
            "redis://[::1:1",
            "redis://[::1]x",
            "redis://h?x:1",
        ] {
            assert!(
                matches!(parse_url(bad), Err(RegistryError::Invalid(_))),
                "accepted {bad:?}"
            );
        }
    }

    #[test]
    fn checks_transactions() {
        let ok = Value::Simple(b"OK".to_vec());
        let queued = Value::Simple(b"QUEUED".to_vec());
        let good = [
            ok.clone(),
            queued.clone(),
            Value::Array(vec![Value::Integer(1)]),
        ];
        check_transaction(&good).unwrap();
        let failed = [
            ok.clone(),
            queued.clone(),
            Value::Array(vec![Value::Error("WRONGTYPE".into())]),
        ];
        assert!(matches!(
            check_transaction(&failed),
            Err(RegistryError::Protocol(e)) if e.contains("WRONGTYPE")
        ));
        let aborted = [ok.clone(), queued, Value::Error("EXECABORT".into())];
        assert!(check_transaction(&aborted).is_err());
        assert!(check_transaction(&[ok.clone(), Value::Array(vec![Value::Nil])]).is_err());
        assert!(check_transaction(&[ok]).is_err());
        assert!(check_transaction(&[]).is_err());
    }
}
