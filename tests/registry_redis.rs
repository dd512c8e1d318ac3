//! `RedisRegistry` against a real `redis-server`: each test starts its own on a free loopback
//! port (no persistence; killed when the test ends) and runs the registry on a glommio
//! executor; and a collective world made from it. Where `redis-server` is not installed the
//! tests say so and skip (`scripts/setup` installs it).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // A test may panic: a panic is a failure it reports.

use std::future::Future;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use glommio::timer::sleep;
use shardcx::registry::{
    NodeRecord, RedisConfig, RedisRegistry, Registry, RegistryError, Signature,
};
use shardcx::NodeId;

/// Longest any one test may run.
const LIMIT: Duration = Duration::from_secs(60);
/// Operation deadline in these tests.
const TIMEOUT: Duration = Duration::from_millis(1500);
/// Slack on timing assertions (a shared 2-core machine, debug builds).
const SLACK: Duration = Duration::from_millis(1000);

/// A `redis-server` on a loopback port, killed on drop.
struct Server {
    child: Child,
    port: u16,
    password: Option<String>,
}

impl Server {
    /// Starts one on a free port; `None` (after saying why) if `redis-server` is missing.
    fn start(password: Option<&str>) -> Option<Server> {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        Server::start_on(port, password)
    }

    fn start_on(port: u16, password: Option<&str>) -> Option<Server> {
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(p) = password {
            cmd.args(["--requirepass", p]);
        }
        let child = match cmd.spawn() {
            Ok(child) => child,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                eprintln!("skipped: redis-server not found (scripts/setup installs it)");
                return None;
            }
            Err(e) => panic!("starting redis-server: {e}"),
        };
        let mut server = Server {
            child,
            port,
            password: password.map(str::to_string),
        };
        server.wait_ready();
        Some(server)
    }

    /// Waits, bounded, until the server answers PING (or asks for a password).
    fn wait_ready(&mut self) {
        let t0 = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("redis-server on port {} exited: {status}", self.port);
            }
            if let Ok(mut s) = TcpStream::connect(self.addr()) {
                let mut reply = [0u8; 16];
                s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
                if s.write_all(b"*1\r\n$4\r\nPING\r\n").is_ok() {
                    if let Ok(n) = s.read(&mut reply) {
                        if reply[..n].starts_with(b"+PONG") || reply[..n].starts_with(b"-NOAUTH") {
                            return;
                        }
                    }
                }
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "redis-server on port {} did not answer PING within 10 s",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    fn url(&self) -> String {
        match &self.password {
            Some(p) => format!("redis://:{p}@127.0.0.1:{}", self.port),
            None => format!("redis://127.0.0.1:{}", self.port),
        }
    }

    /// Sends `commands` on one fresh connection (after AUTH if needed) and returns the last
    /// reply: a status, error or integer line as text (`+OK`, `:1`), or a bulk string's text.
    fn raw(&self, commands: &[&[&str]]) -> String {
        let mut s = TcpStream::connect(self.addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut all: Vec<Vec<&str>> = Vec::new();
        if let Some(p) = &self.password {
            all.push(vec!["AUTH", p]);
        }
        all.extend(commands.iter().map(|c| c.to_vec()));
        for c in &all {
            let mut out = format!("*{}\r\n", c.len());
            for a in c {
                out.push_str(&format!("${}\r\n{a}\r\n", a.len()));
            }
            s.write_all(out.as_bytes()).unwrap();
        }
        let mut r = BufReader::new(s);
        let mut last = String::new();
        for _ in &all {
            let mut line = String::new();
            r.read_line(&mut line).unwrap();
            let line = line.trim_end().to_string();
            last = match line.strip_prefix('$').map(|n| n.parse::<i64>().unwrap()) {
                Some(n) if n >= 0 => {
                    let mut body = vec![0; n as usize + 2];
                    r.read_exact(&mut body).unwrap();
                    String::from_utf8_lossy(&body[..n as usize]).into_owned()
                }
                _ => line,
            };
        }
        last
    }

    /// Kills it (by its own child handle) and waits for it to exit.
    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Runs `make()`'s future on a glommio executor of its own thread; fails the test if it takes
/// longer than `LIMIT`. `None` (after saying why) if no executor can start here.
fn on_shard<F, Fut>(make: F) -> Option<Fut::Output>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future + 'static,
    Fut::Output: Send + 'static,
{
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let ex = glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
            // Several tests run at once: keep well inside the 8 MiB memlock limit.
            .io_memory(256 << 10)
            .make();
        match ex {
            Ok(ex) => {
                let _ = tx.send(Some(ex.run(make())));
            }
            Err(e) => {
                eprintln!("skipped: no glommio executor here (io_uring or memlock missing): {e}");
                let _ = tx.send(None);
            }
        }
    });
    match rx.recv_timeout(LIMIT) {
        Ok(out) => out,
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("still running after {LIMIT:?}"),
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("the shard's thread panicked (above)"),
    }
}

fn config(ttl: Duration) -> RedisConfig {
    RedisConfig {
        ttl,
        timeout: TIMEOUT,
        ..RedisConfig::default()
    }
}

fn sig(id: u32, name: &str) -> Signature {
    Signature {
        id,
        name: name.into(),
        schema: 0xC0FF_EE00 + u64::from(id),
        version: 1,
    }
}

fn record(service: &str, node: u64, functions: &[&str]) -> NodeRecord {
    NodeRecord {
        service: service.into(),
        node: NodeId::new(node),
        addr: SocketAddr::from(([10, 0, 0, node as u8], 4100)),
        shards: 2,
        functions: functions
            .iter()
            .enumerate()
            .map(|(i, f)| sig(i as u32 + 1, f))
            .collect(),
    }
}

fn nodes(records: &[NodeRecord]) -> Vec<u64> {
    records.iter().map(|r| r.node.get()).collect()
}

/// Polls `cond` every 20 ms until it holds; panics after `within`.
async fn eventually<Fut: Future<Output = bool>>(within: Duration, mut cond: impl FnMut() -> Fut) {
    let t0 = Instant::now();
    while !cond().await {
        assert!(t0.elapsed() < within, "condition not met within {within:?}");
        sleep(Duration::from_millis(20)).await;
    }
}

#[test]
fn register_lookup_and_find_function_across_two_services() {
    let Some(server) = Server::start(None) else {
        return;
    };
    let url = server.url();
    let server_raw = move |c: &[&[&str]]| server.raw(c);
    on_shard(move || async move {
        let reg = RedisRegistry::connect(&url, config(Duration::from_secs(30)))
            .await
            .unwrap();
        let kv1 = record("kv", 1, &["kv.get", "kv.put"]);
        let kv2 = record("kv", 2, &["kv.get", "kv.scan"]);
        let auth = record("auth", 3, &["auth.login", "kv.get"]);
        for r in [&kv2, &auth, &kv1] {
            reg.register(r).await.unwrap();
        }
        assert_eq!(
            reg.lookup("kv").await.unwrap(),
            vec![kv1.clone(), kv2.clone()]
        );
        assert_eq!(reg.lookup("auth").await.unwrap(), vec![auth.clone()]);
        assert_eq!(reg.lookup("nothing").await.unwrap(), vec![]);
        // Sorted by service, then node.
        assert_eq!(
            reg.find_function("kv.get").await.unwrap(),
            vec![auth.clone(), kv1.clone(), kv2.clone()]
        );
        assert_eq!(nodes(&reg.find_function("kv.put").await.unwrap()), [1]);
        assert_eq!(nodes(&reg.find_function("auth.login").await.unwrap()), [3]);
        assert!(reg.find_function("kv.delete").await.unwrap().is_empty());
        // The stored layout is the documented one.
        let stored = server_raw(&[&["GET", "shardcx:node:kv:1"]]);
        assert!(
            stored.starts_with("shardcx-node 1\nservice kv\nnode 1\n"),
            "{stored}"
        );
        let pttl: i64 = server_raw(&[&["PTTL", "shardcx:node:kv:1"]])[1..]
            .parse()
            .unwrap();
        assert!(pttl > 25_000 && pttl <= 30_000, "PTTL {pttl}");
        assert_eq!(server_raw(&[&["SCARD", "shardcx:service:kv"]]), ":2");
        assert_eq!(
            server_raw(&[&["SISMEMBER", "shardcx:fn:kv.get", "auth:3"]]),
            ":1"
        );
        assert_eq!(reg.bad_records(), 0);
    });
}

#[test]
fn register_again_refreshes_the_ttl_and_the_function_sets() {
    let Some(server) = Server::start(None) else {
        return;
    };
    let url = server.url();
    on_shard(move || async move {
        let pttl = |key: &str| -> i64 { server.raw(&[&["PTTL", key]])[1..].parse().unwrap() };
        let reg = RedisRegistry::connect(&url, config(Duration::from_secs(3)))
            .await
            .unwrap();
        reg.register(&record("kv", 1, &["kv.get", "kv.put"]))
            .await
            .unwrap();
        sleep(Duration::from_millis(1200)).await;
        let before = pttl("shardcx:node:kv:1");
        assert!(before < 2000, "PTTL {before} after 1.2 s of a 3 s ttl");
        let newer = record("kv", 1, &["kv.get", "kv.scan"]);
        reg.register(&newer).await.unwrap();
        let after = pttl("shardcx:node:kv:1");
        assert!(after > 2500, "PTTL {after} right after a refresh");
        assert!(pttl("shardcx:service:kv") > 2500);
        assert_eq!(reg.lookup("kv").await.unwrap(), vec![newer.clone()]);
        assert_eq!(nodes(&reg.find_function("kv.scan").await.unwrap()), [1]);
        // The function it no longer serves: gone from the look-up and from the index.
        assert!(reg.find_function("kv.put").await.unwrap().is_empty());
        assert_eq!(
            server.raw(&[&["SISMEMBER", "shardcx:fn:kv.put", "kv:1"]]),
            ":0"
        );
    });
}

#[test]
fn records_expire_after_the_ttl_and_keep_registered_keeps_them() {
    let Some(server) = Server::start(None) else {
        return;
    };
    let url = server.url();
    on_shard(move || async move {
        let ttl = Duration::from_millis(600);
        let reg = RedisRegistry::connect(&url, config(ttl)).await.unwrap();
        // Node 1 registers once; node 2 stays registered with a refresh every ttl/3.
        let t0 = Instant::now();
        reg.register(&record("kv", 1, &["kv.get"])).await.unwrap();
        let kept = reg
            .keep_registered(record("kv", 2, &["kv.get"]), ttl / 3)
            .await
            .unwrap();
        assert_eq!(nodes(&reg.lookup("kv").await.unwrap()), [1, 2]);
        let r = &reg;
        eventually(ttl + SLACK, || async move {
            nodes(&r.lookup("kv").await.unwrap()) == [2]
        })
        .await;
        assert!(
            t0.elapsed() >= ttl - Duration::from_millis(50),
            "expired early"
        );
        // The look-up removed the expired member from the sets (node 2 kept them alive).
        assert_eq!(
            server.raw(&[&["SISMEMBER", "shardcx:service:kv", "1"]]),
            ":0"
        );
        assert_eq!(nodes(&reg.find_function("kv.get").await.unwrap()), [2]);
        assert_eq!(
            server.raw(&[&["SISMEMBER", "shardcx:fn:kv.get", "kv:1"]]),
            ":0"
        );
        // Node 2 outlives several ttls while its registration lives.
        sleep(ttl * 3).await;
        assert_eq!(nodes(&reg.lookup("kv").await.unwrap()), [2]);
        assert!(kept.refreshes() >= 5, "{} refreshes", kept.refreshes());
        assert_eq!(kept.refresh_failures(), 0);
        // Dropped: it disappears within the ttl, and so do the sets.
        let dropped = Instant::now();
        drop(kept);
        eventually(ttl + SLACK, || async move {
            r.lookup("kv").await.unwrap().is_empty()
        })
        .await;
        assert!(dropped.elapsed() <= ttl + SLACK);
        let srv = &server;
        eventually(SLACK, || async move {
            srv.raw(&[&["EXISTS", "shardcx:service:kv", "shardcx:fn:kv.get"]]) == ":0"
        })
        .await;
        let invalid = reg
            .keep_registered(record("kv", 3, &[]), ttl)
            .await
            .unwrap_err();
        assert!(matches!(invalid, RegistryError::Invalid(_)), "{invalid}");
    });
}

#[test]
fn deregister_removes_the_record_and_its_index_entries() {
    let Some(server) = Server::start(None) else {
        return;
    };
    let url = server.url();
    on_shard(move || async move {
        let reg = RedisRegistry::connect(&url, config(Duration::from_secs(30)))
            .await
            .unwrap();
        reg.register(&record("kv", 1, &["kv.get", "kv.put"]))
            .await
            .unwrap();
        reg.register(&record("kv", 2, &["kv.get"])).await.unwrap();
        reg.deregister("kv", NodeId::new(1)).await.unwrap();
        assert_eq!(nodes(&reg.lookup("kv").await.unwrap()), [2]);
        assert_eq!(nodes(&reg.find_function("kv.get").await.unwrap()), [2]);
        assert!(reg.find_function("kv.put").await.unwrap().is_empty());
        assert_eq!(server.raw(&[&["EXISTS", "shardcx:node:kv:1"]]), ":0");
        assert_eq!(server.raw(&[&["EXISTS", "shardcx:fn:kv.put"]]), ":0");
        assert_eq!(server.raw(&[&["SCARD", "shardcx:service:kv"]]), ":1");
        // Again, and a node never registered: no error.
        reg.deregister("kv", NodeId::new(1)).await.unwrap();
        reg.deregister("other", NodeId::new(9)).await.unwrap();
        // Through a registration's stop.
        let kept = reg
            .keep_registered(record("kv", 3, &["kv.get"]), Duration::from_secs(10))
            .await
            .unwrap();
        assert_eq!(nodes(&reg.lookup("kv").await.unwrap()), [2, 3]);
        kept.stop().await.unwrap();
        assert_eq!(nodes(&reg.lookup("kv").await.unwrap()), [2]);
    });
}

#[test]
fn corrupt_records_and_members_are_skipped_and_counted() {
    let Some(server) = Server::start(None) else {
        return;
    };
    let url = server.url();
    on_shard(move || async move {
        let reg = RedisRegistry::connect(&url, config(Duration::from_secs(30)))
            .await
            .unwrap();
        let good = record("kv", 1, &["kv.get"]);
        reg.register(&good).await.unwrap();
        // Garbage under a node key, a valid record of node 1 under node 8's key, and set
        // members that name no node.
        let copied = server.raw(&[&["GET", "shardcx:node:kv:1"]]);
        server.raw(&[
            &[
                "SET",
                "shardcx:node:kv:9",
                "shardcx-node 1\nservice kv\nnode x\n",
            ],
            &["SET", "shardcx:node:kv:8", &copied],
            &["SADD", "shardcx:service:kv", "9", "8", "not-a-node"],
            &["SADD", "shardcx:fn:kv.get", "kv:9", "kv:8", "no-colon"],
        ]);
        assert_eq!(reg.lookup("kv").await.unwrap(), vec![good.clone()]);
        assert_eq!(reg.bad_records(), 3, "two bad records, one bad member");
        assert_eq!(
            reg.find_function("kv.get").await.unwrap(),
            vec![good.clone()]
        );
        assert_eq!(reg.bad_records(), 6);
        // Bad members are removed; bad records stay (an operator's business) and keep
        // being skipped.
        assert_eq!(
            server.raw(&[&["SISMEMBER", "shardcx:service:kv", "not-a-node"]]),
            ":0"
        );
        assert_eq!(reg.lookup("kv").await.unwrap(), vec![good]);
        assert_eq!(reg.bad_records(), 8);
        // A wrong type under a key the registry uses is the server's refusal, not a panic.
        server.raw(&[&["SET", "shardcx:service:broken", "x"]]);
        let e = reg.lookup("broken").await.unwrap_err();
        assert!(
            matches!(&e, RegistryError::Protocol(m) if m.contains("WRONGTYPE")),
            "{e}"
        );
        // ...and the connection still works afterwards.
        assert_eq!(nodes(&reg.lookup("kv").await.unwrap()), [1]);
    });
}

#[test]
fn server_down_is_unavailable_in_time_and_a_restart_is_picked_up() {
    let Some(mut server) = Server::start(None) else {
        return;
    };
    let (url, port) = (server.url(), server.port);
    /// What the shard asks the controlling thread to do with the server.
    #[derive(Clone, Copy)]
    enum Ask {
        Stop,
        Start,
        Restart,
        Done,
    }
    let (ask, asked) = mpsc::channel::<Ask>();
    let (done, wait_done) = mpsc::channel::<()>();
    let controller = std::thread::spawn(move || {
        for a in asked {
            match a {
                Ask::Stop => server.stop(),
                Ask::Start => server = Server::start_on(port, None).expect("it was there"),
                Ask::Restart => {
                    server.stop();
                    server = Server::start_on(port, None).expect("it was there");
                }
                Ask::Done => break,
            }
            done.send(()).unwrap();
        }
    });
    let control = move |a: Ask| {
        ask.send(a).unwrap();
        if !matches!(a, Ask::Done) {
            wait_done.recv().unwrap();
        }
    };
    on_shard(move || async move {
        let reg = RedisRegistry::connect(&url, config(Duration::from_secs(30)))
            .await
            .unwrap();
        reg.register(&record("kv", 1, &["kv.get"])).await.unwrap();
        control(Ask::Stop);
        for _ in 0..2 {
            let t0 = Instant::now();
            let e = reg.lookup("kv").await.unwrap_err();
            assert!(matches!(e, RegistryError::Unavailable(_)), "{e}");
            assert!(t0.elapsed() <= TIMEOUT + SLACK, "took {:?}", t0.elapsed());
        }
        control(Ask::Start);
        // Same port, empty server: the next operation connects again.
        assert!(reg.lookup("kv").await.unwrap().is_empty());
        reg.register(&record("kv", 1, &["kv.get"])).await.unwrap();
        assert_eq!(nodes(&reg.lookup("kv").await.unwrap()), [1]);
        // A restart between two operations: the idle connection is broken, and the next
        // operation succeeds anyway (retried once on a fresh connection).
        control(Ask::Restart);
        reg.register(&record("kv", 2, &["kv.get"])).await.unwrap();
        assert_eq!(nodes(&reg.lookup("kv").await.unwrap()), [2]);
        control(Ask::Done);
    });
    controller.join().unwrap();
}

#[test]
fn a_silent_server_times_out_and_a_dead_port_is_unavailable() {
    // A listening socket that never accepts: the kernel completes the connection, nobody
    // answers.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_url = format!("redis://{}", silent.local_addr().unwrap());
    let dead = TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_url = format!("redis://{}", dead.local_addr().unwrap());
    drop(dead);
    on_shard(move || async move {
        let t0 = Instant::now();
        let e = RedisRegistry::connect(&silent_url, config(Duration::from_secs(30)))
            .await
            .unwrap_err();
        assert!(
            matches!(e, RegistryError::TimedOut(t) if t == TIMEOUT),
            "{e}"
        );
        let took = t0.elapsed();
        assert!(took >= TIMEOUT && took <= TIMEOUT + SLACK, "took {took:?}");
        let e = RedisRegistry::connect(&dead_url, config(Duration::from_secs(30)))
            .await
            .unwrap_err();
        assert!(matches!(e, RegistryError::Unavailable(_)), "{e}");
        let e = RedisRegistry::connect("redis://127.0.0.1:1/x", RedisConfig::default())
            .await
            .unwrap_err();
        assert!(matches!(e, RegistryError::Invalid(_)), "{e}");
    });
    drop(silent);
}

#[test]
fn password_and_database_from_the_url() {
    let Some(server) = Server::start(Some("s3cret")) else {
        return;
    };
    let port = server.port;
    on_shard(move || async move {
        let url = format!("redis://:s3cret@127.0.0.1:{port}/2");
        let reg = RedisRegistry::connect(&url, config(Duration::from_secs(30)))
            .await
            .unwrap();
        reg.register(&record("kv", 1, &["kv.get"])).await.unwrap();
        assert_eq!(nodes(&reg.lookup("kv").await.unwrap()), [1]);
        // In database 2, not 0.
        assert_eq!(
            server.raw(&[&["SELECT", "2"], &["EXISTS", "shardcx:node:kv:1"]]),
            ":1"
        );
        assert_eq!(server.raw(&[&["EXISTS", "shardcx:node:kv:1"]]), ":0");
        for url in [
            format!("redis://:wrong@127.0.0.1:{port}"),
            format!("redis://127.0.0.1:{port}"),
        ] {
            let e = RedisRegistry::connect(&url, config(Duration::from_secs(30)))
                .await
                .unwrap_err();
            assert!(matches!(e, RegistryError::Protocol(_)), "{url}: {e}");
        }
    });
}

/// Runs node `i` of a world made from the registry at `url`: `shards` shards, id `id`; its
/// shard 0 registers it under `service`, every shard makes the world of `count` nodes from
/// the registry and all-reduces `rank + 1`. Returns (rank, size, sum, the rank's node) per
/// shard.
fn registry_world_node(
    url: String,
    service: &'static str,
    id: u64,
    shards: usize,
    count: usize,
) -> std::thread::JoinHandle<Vec<(usize, usize, u64, NodeId)>> {
    use shardcx::collective::{Communicator, Sum};
    use shardcx::shards::Placement;
    use shardcx::Node;
    const T: Duration = Duration::from_secs(20);
    std::thread::spawn(move || {
        Node::builder()
            .shards(shards)
            .placement(Placement::Unpinned)
            .transports("tcp")
            .io_memory(256 << 10)
            .node_id(NodeId::new(id))
            .psk(b"registry world test key, 16+ bytes")
            .listen("127.0.0.1:0".parse().unwrap())
            .run(move |node: Node| {
                let url = url.clone();
                async move {
                    let reg = RedisRegistry::connect(&url, config(Duration::from_secs(30)))
                        .await
                        .expect("registry");
                    if node.shard().get() == 0 {
                        let me = NodeRecord {
                            service: service.into(),
                            node: node.id(),
                            addr: node.listen_addr().expect("listening"),
                            shards: node.shard_count() as u16,
                            functions: Vec::new(),
                        };
                        reg.register(&me).await.expect("register");
                    }
                    let mut c = Communicator::world_from_registry(&node, &reg, service, count, T)
                        .await
                        .expect("world from the registry");
                    let sum = c
                        .all_reduce(&[c.rank() as u64 + 1], &Sum, T)
                        .await
                        .expect("all_reduce");
                    (c.rank(), c.size(), sum[0], c.members()[c.rank()].node)
                }
            })
            .expect("node")
    })
}

/// Three nodes that know nothing of each other but the registry (started in an order other
/// than their ids, with 2, 1 and 1 shards): each registers itself, every shard makes the
/// world from the registry, ranks numbered by node id, and an all-reduce checks every rank.
#[test]
fn a_world_of_the_nodes_of_a_service() {
    let Some(server) = Server::start(None) else {
        return;
    };
    let layout = [(0x33, 1), (0x31, 2), (0x32, 1)];
    let threads: Vec<_> = layout
        .iter()
        .map(|&(id, shards)| registry_world_node(server.url(), "world", id, shards, 3))
        .collect();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let all: Vec<_> = threads.into_iter().map(|t| t.join()).collect();
        let _ = tx.send(all);
    });
    let mut ranks: Vec<(usize, usize, u64, NodeId)> = rx
        .recv_timeout(LIMIT)
        .expect("nodes still running after LIMIT")
        .into_iter()
        .flat_map(|r| r.expect("a node panicked (above)"))
        .collect();
    ranks.sort();
    let want: Vec<(usize, usize, u64, NodeId)> = [0x31, 0x31, 0x32, 0x33]
        .into_iter()
        .enumerate()
        .map(|(r, n)| (r, 4, 10, NodeId::new(n)))
        .collect();
    assert_eq!(ranks, want);
}

/// Refusals of `world_from_registry`: more nodes under the service than asked for, a count
/// this node is not among, too few nodes by the deadline (a `Discovery` error in time), a
/// world of no nodes.
#[test]
fn a_world_from_the_registry_refuses_what_it_cannot_make() {
    use shardcx::collective::{CollectiveError, Communicator};
    use shardcx::shards::Placement;
    use shardcx::Node;
    let Some(mut server) = Server::start(None) else {
        return;
    };
    let url = server.url();
    let out = Node::builder()
        .shards(1)
        .placement(Placement::Unpinned)
        .transports("tcp")
        .io_memory(256 << 10)
        .node_id(NodeId::new(0x41))
        .psk(b"registry world test key, 16+ bytes")
        .listen("127.0.0.1:0".parse().unwrap())
        .run(move |node: Node| {
            let url = url.clone();
            async move {
                let reg = RedisRegistry::connect(&url, config(Duration::from_secs(30)))
                    .await
                    .expect("registry");
                let mut me = record("solo", 0x41, &[]);
                me.addr = node.listen_addr().unwrap();
                reg.register(&me).await.expect("register");
                let t = Duration::from_millis(400);
                let t0 = Instant::now();
                let few = Communicator::world_from_registry(&node, &reg, "solo", 2, t).await;
                let few_took = t0.elapsed();
                reg.register(&record("solo", 0x40, &[])).await.unwrap();
                let many = Communicator::world_from_registry(&node, &reg, "solo", 1, t).await;
                let other = Communicator::world_from_registry(&node, &reg, "other", 0, t).await;
                reg.register(&record("pair", 0x50, &[])).await.unwrap();
                let not_me = Communicator::world_from_registry(&node, &reg, "pair", 1, t).await;
                let gone = |r: Result<Communicator, CollectiveError>| r.map(|_| ());
                (gone(few), few_took, gone(many), gone(other), gone(not_me))
            }
        })
        .expect("node");
    let (few, few_took, many, other, not_me) = out.into_iter().next().unwrap();
    assert!(
        matches!(&few, Err(CollectiveError::Discovery { cause, .. }) if cause.contains("1 of 2")),
        "{few:?}"
    );
    assert!(
        few_took >= Duration::from_millis(400) && few_took < Duration::from_millis(400) + SLACK,
        "too few nodes failed after {few_took:?}"
    );
    assert!(
        matches!(&many, Err(CollectiveError::InvalidArgument { what, .. }) if what.contains("more than 1")),
        "{many:?}"
    );
    assert!(
        matches!(other, Err(CollectiveError::InvalidArgument { .. })),
        "{other:?}"
    );
    assert!(
        matches!(&not_me, Err(CollectiveError::InvalidArgument { what, .. }) if what.contains("not among")),
        "{not_me:?}"
    );
    server.stop();
}
