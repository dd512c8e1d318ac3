//! Regression tests for defects found by trying a `shardcx node` as a hostile or unlucky
//! client would (issue 15): each test is named for its defect, spawns the `shardcx` binary,
//! and is bounded in time (every wait has a deadline; a node left behind is killed on drop).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // A test may panic: a panic is a failure it reports.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Stdio;
use std::time::{Duration, Instant};

use shardcx::shards::net::bootstrap::{fetch_directory_blocking, BOOTSTRAP_REQUEST};

mod common;
use common::{shardcx, wait_for, NodeProc};

/// Open file descriptors of the node.
fn fds(node: &NodeProc) -> usize {
    std::fs::read_dir(format!("/proc/{}/fd", node.pid()))
        .unwrap()
        .count()
}

/// The node's fd count once it has been the same for 300 ms (at most 5 s).
fn settled_fds(node: &NodeProc) -> usize {
    let until = Instant::now() + Duration::from_secs(5);
    let mut last = fds(node);
    loop {
        std::thread::sleep(Duration::from_millis(300));
        let now = fds(node);
        if now == last || Instant::now() > until {
            return now;
        }
        last = now;
    }
}

/// Deterministic bytes that look random (xorshift64*).
fn garbage(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 56) as u8
        })
        .collect()
}

/// Defect "fd leak": every TCP connection to the listener's port that sent garbage leaked one
/// file descriptor in the node for good (UCX 1.12's connection manager believed the length in
/// the first bytes and waited forever for the rest, never reading the client's close). Now
/// 20 connections of 64 KiB of garbage leave the node's fd count where it was (±1) within
/// a few seconds, and the node still serves its directory.
#[test]
fn garbage_tcp_connections_leak_no_fds() {
    let node = NodeProc::start(2, &[], false);
    let before = settled_fds(&node);
    for i in 0..20 {
        let mut s = TcpStream::connect(node.addr).unwrap();
        s.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
        // The node may close (or reset) the connection before all is written.
        let _ = s.write_all(&garbage(i + 1, 64 << 10));
        drop(s);
    }
    let start = Instant::now();
    let back = wait_for(Duration::from_secs(10), || fds(&node) <= before + 1);
    let after = fds(&node);
    eprintln!(
        "fds before {before}, after {after}, back in {:?}",
        start.elapsed()
    );
    assert!(back, "fds {before} before, {after} 10 s after the garbage");
    // Garbage connections still in the listener's backlog (not accepted yet, so not in the fd
    // count) take half-open places from this address when accepted: a directory fetch from
    // the same address in between is refused by the per-address cap (by design), so it is
    // tried again while the last of them are served (seen once in a full run: reset at once).
    let until = Instant::now() + Duration::from_secs(5);
    let dir = loop {
        match fetch_directory_blocking(node.addr, Duration::from_secs(5)) {
            Err(e) if Instant::now() < until => {
                eprintln!("directory fetch refused ({e}), trying again");
                std::thread::sleep(Duration::from_millis(100));
            }
            other => break other.expect("directory"),
        }
    };
    assert_eq!(dir.shard_count(), 2);
    // Some leaks show only once the connections are gone for a while.
    std::thread::sleep(Duration::from_millis(500));
    assert!(fds(&node) <= before + 1, "fds {before} -> {}", fds(&node));
}

/// Defect "bench hang on SIGSTOPped peer": a `shardcx bench --connect` client whose node was
/// stopped with SIGSTOP hung until the bench's own 30 s answer timeout, although heartbeats
/// declared the node dead after about a second. Now the bench says the server is gone and
/// exits with a failure within a few seconds of the stop.
#[test]
fn bench_fails_promptly_when_its_peer_is_stopped() {
    let node = NodeProc::start(2, &[], false);
    let mut bench = shardcx()
        .args(["bench", "--connect", &node.addr.to_string()])
        .args(["--test", "am-lat", "--size", "8", "--duration", "20"])
        .args(["--shards", "1", "--transport", "tcp"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Let it connect and measure for a while.
    std::thread::sleep(Duration::from_millis(2000));
    assert!(
        bench.try_wait().unwrap().is_none(),
        "the bench ended before the stop"
    );
    node.signal("-STOP");
    let stopped = Instant::now();
    let ended = wait_for(Duration::from_secs(15), || {
        bench.try_wait().unwrap().is_some()
    });
    let took = stopped.elapsed();
    if !ended {
        let _ = bench.kill();
    }
    let status = bench.wait().unwrap();
    let mut out = String::new();
    bench
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    bench
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    eprintln!("the bench ended {took:?} after the stop: {status}");
    assert!(
        ended,
        "the bench still ran 15 s after its peer was stopped:\n{out}"
    );
    assert!(!status.success(), "{status}\n{out}");
    assert!(out.contains("is gone"), "no word of the peer:\n{out}");
    assert!(took < Duration::from_secs(5), "took {took:?}:\n{out}");
    node.signal("-CONT");
}

/// A directory fetch from the loopback address `from` (a second client host on one machine),
/// within 2 s; its time.
fn fetch_from(from: [u8; 4], node: std::net::SocketAddr) -> Result<Duration, String> {
    use socket2::{Domain, Socket, Type};
    let t0 = Instant::now();
    let s = Socket::new(Domain::IPV4, Type::STREAM, None).map_err(|e| e.to_string())?;
    s.bind(&std::net::SocketAddr::from((from, 0)).into())
        .map_err(|e| format!("bind: {e}"))?;
    s.connect_timeout(&node.into(), Duration::from_secs(2))
        .map_err(|e| format!("connect: {e}"))?;
    let mut s: TcpStream = s.into();
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    s.write_all(&BOOTSTRAP_REQUEST)
        .map_err(|e| format!("write: {e}"))?;
    let mut len = [0u8; 4];
    s.read_exact(&mut len).map_err(|e| format!("read: {e}"))?;
    let mut dir = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut dir).map_err(|e| format!("read: {e}"))?;
    Ok(t0.elapsed())
}

/// Defect "one host's flood locks every client out of the listener" (found by the reliability
/// suite's R7): 200 silent connections from one address, reopened as the listener closed them,
/// filled its 64 half-open places, and every legitimate directory fetch from another host was
/// closed at once for as long as the flood lasted. Now one address holds at most 16 places:
/// while 100 silent connections from 127.0.0.1 are open, fetches from 127.0.0.2 are answered
/// promptly, and the node's fds are back once the flood is gone.
#[test]
fn a_flood_from_one_address_keeps_no_other_client_out_of_the_listener() {
    let node = NodeProc::start(1, &[], false);
    let before = settled_fds(&node);
    let flood: Vec<TcpStream> = (0..100)
        .filter_map(|_| TcpStream::connect(node.addr).ok())
        .collect();
    assert!(flood.len() >= 50, "only {} flood connections", flood.len());
    let mut took = Vec::new();
    for _ in 0..10 {
        match fetch_from([127, 0, 0, 2], node.addr) {
            Ok(t) => took.push(t),
            Err(e) => panic!("a fetch from another address failed during the flood: {e}"),
        }
    }
    eprintln!("fetches from 127.0.0.2 during the flood: {took:?}");
    assert!(
        took.iter().all(|t| *t < Duration::from_millis(500)),
        "{took:?}"
    );
    drop(flood);
    assert!(
        wait_for(Duration::from_secs(10), || fds(&node) <= before + 1),
        "fds {before} before, {} after the flood",
        fds(&node)
    );
}

/// Defect "a client's shards connecting at once are refused by the listener's cap" (found by
/// the reliability suite's R8): the listener closes a bootstrap connection unanswered when it
/// serves as many as it may (16 from one address), and a client of 32 shards connecting at
/// once failed with "connection reset". Now the bootstrap tries again within its deadline:
/// against a listener that closes the first three connections unanswered, a shard still gets
/// the directory, while an address where nothing listens fails at once.
#[test]
fn a_bootstrap_closed_unanswered_is_tried_again() {
    use shardcx::shards::net::bootstrap::Directory;
    use shardcx::shards::ucx::WorkerAddress;
    use shardcx::shards::NetError;
    use shardcx::NodeId;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let dir = Directory {
        node_id: NodeId::new(77),
        incarnation: shardcx::proto::Incarnation::new(1),
        workers: vec![WorkerAddress::from_bytes(vec![1, 2, 3])],
    };
    let bytes = dir.encode();
    // Bounded: a client that does not come back leaves it after 5 s.
    listener.set_nonblocking(true).unwrap();
    let server = std::thread::spawn(move || {
        let until = Instant::now() + Duration::from_secs(5);
        for i in 0..4 {
            let mut s = loop {
                match listener.accept() {
                    Ok((s, _)) => break s,
                    Err(_) if Instant::now() < until => {
                        std::thread::sleep(Duration::from_millis(5))
                    }
                    Err(e) => panic!("no connection {i} within 5 s: {e}"),
                }
            };
            s.set_nonblocking(false).unwrap();
            let mut req = [0u8; 8];
            s.read_exact(&mut req).unwrap();
            if i < 3 {
                // As the listener at its cap does: closed with a reset, unanswered.
                socket2::SockRef::from(&s)
                    .set_linger(Some(Duration::ZERO))
                    .unwrap();
                continue;
            }
            s.write_all(&(bytes.len() as u32).to_le_bytes()).unwrap();
            s.write_all(&bytes).unwrap();
            let _ = s.read(&mut req);
        }
    });
    // A port nothing listens on: bound, then closed.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let out = common::two_shard_node(NodeId::new(78), b"a key of sixteen bytes or more")
        .shards(1)
        .run(move |node: shardcx::Node| async move {
            let ctx = node.shard_ctx();
            let got = ctx.bootstrap(addr).await;
            let t0 = Instant::now();
            let refused = ctx.bootstrap(dead).await;
            (got, refused, t0.elapsed())
        })
        .unwrap();
    let (got, refused, took) = out.into_iter().next().unwrap();
    assert_eq!(
        got.expect("the directory after three closed connections"),
        dir
    );
    server.join().unwrap();
    assert!(
        matches!(refused, Err(NetError::Unreachable { .. })),
        "{refused:?}"
    );
    assert!(
        took < Duration::from_secs(1),
        "a refused connect took {took:?}"
    );
}

/// Defect "a connect given up half-way blocks every later connect to that node" (found by the
/// reliability suite's R13): a connect cut short by its deadline while its handshake was under
/// way left shard 0's "establishing" entry behind, and every later connect to that node waited
/// on it until its own deadline, for good: a client never got back to a restarted server. Here
/// the node's directory is served by a listener of the test while the node is stopped
/// (SIGSTOP), so that the first connect's handshake cannot finish within its 300 ms; the node is
/// continued and a second connect must succeed well within its 5 s.
#[test]
fn a_connect_given_up_midway_leaves_no_one_waiting_for_it() {
    use shardcx::bench::DEFAULT_PSK;
    use shardcx::NodeId;
    let node = NodeProc::start(1, &[], false);
    let dir = fetch_directory_blocking(node.addr, Duration::from_secs(5)).expect("directory");
    let bytes = dir.encode();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let fake = listener.local_addr().unwrap();
    listener.set_nonblocking(true).unwrap();
    // Serves the node's directory to every bootstrap for 20 s at most.
    std::thread::spawn(move || {
        let until = Instant::now() + Duration::from_secs(20);
        while Instant::now() < until {
            let Ok((mut s, _)) = listener.accept() else {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            };
            s.set_nonblocking(false).unwrap();
            let mut req = [0u8; 8];
            if s.read_exact(&mut req).is_ok() {
                let _ = s.write_all(&(bytes.len() as u32).to_le_bytes());
                let _ = s.write_all(&bytes);
            }
        }
    });
    node.signal("-STOP");
    let pid = node.pid().to_string();
    let out = common::two_shard_node(NodeId::new(79), DEFAULT_PSK)
        .shards(1)
        .run(move |n: shardcx::Node| {
            let pid = pid.clone();
            async move {
                let first = n.connect_within(fake, Duration::from_millis(300)).await;
                std::process::Command::new("kill")
                    .args(["-CONT", &pid])
                    .status()
                    .unwrap();
                let t0 = Instant::now();
                let second = n.connect_within(fake, Duration::from_secs(5)).await;
                (
                    first.map(|_| ()).map_err(|e| e.to_string()),
                    second.map(|_| ()).map_err(|e| e.to_string()),
                    t0.elapsed(),
                )
            }
        })
        .unwrap();
    let (first, second, took) = out.into_iter().next().unwrap();
    eprintln!("first {first:?}, second {second:?} after {took:?}");
    assert!(
        first.is_err(),
        "the first connect was not cut short: {first:?}"
    );
    assert!(second.is_ok(), "the second connect failed: {second:?}");
    assert!(
        took < Duration::from_secs(3),
        "the second connect took {took:?}"
    );
}
