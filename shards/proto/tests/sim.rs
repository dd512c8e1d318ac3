//! Deterministic simulation scenarios (issue #3, item 8), and of rails: a primary handshake per
//! node pair, the other rails joining its session.

// Tests may unwrap: a panic is a test failure with a message.
#![allow(clippy::unwrap_used)]

use shardcx_proto::conn::{CloseReason, FailReason, State};
use shardcx_proto::handshake::{HandshakeError, RejectReason};
use shardcx_proto::sim::{NetConfig, RpcConfig, RpcOutcome, RpcResult, Sim, SimError};
use shardcx_proto::{
    ConnConfig, Connection, Event, Features, FrameHeader, FrameKind, HandshakeConfig, Incarnation,
    Limits, NodeId, PeerInfo, PreSharedKey, Rail, Rails, Seeds, SessionSecret, ShardId, Timestamp,
};
use std::collections::HashMap;
use std::time::Duration;

const KEY: &[u8] = b"the cluster key, 32 bytes long!!";

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn cfg(node: u64, key: &[u8]) -> ConnConfig {
    let psk = PreSharedKey::new(key).unwrap();
    let mut hs = HandshakeConfig::new(NodeId::new(node), Incarnation::new(1), 4, psk);
    hs.timeout = ms(200);
    let mut c = ConnConfig::new(hs);
    c.heartbeat_interval = ms(10);
    c.suspect_after = 3;
    c.dead_after = 5;
    c.backoff_initial = ms(20);
    c.backoff_max = ms(200);
    c
}

fn pair(seed: u64, net: NetConfig, rpc: RpcConfig) -> Sim {
    let mut sim = Sim::new(seed, net, rpc);
    let a = sim.add_node(cfg(101, KEY));
    let b = sim.add_node(cfg(202, KEY));
    sim.connect(a, b).unwrap();
    sim
}

fn events_of(sim: &Sim, node: usize) -> Vec<(Timestamp, Event)> {
    sim.events()
        .iter()
        .filter(|e| e.node == node)
        .map(|e| (e.at, e.event.clone()))
        .collect()
}

fn connected_count(sim: &Sim, node: usize) -> usize {
    events_of(sim, node)
        .iter()
        .filter(|(_, e)| matches!(e, Event::Connected(_)))
        .count()
}

/// Every call issued has exactly one outcome, and outcomes respect deadlines.
fn check_outcomes(
    sim: &Sim,
    issued: &[(usize, shardcx_proto::ReqId, u64)],
) -> HashMap<u64, RpcOutcome> {
    let mut by_arg = HashMap::new();
    for o in sim.outcomes() {
        assert!(
            by_arg.insert(o.arg, *o).is_none(),
            "two outcomes for call {}",
            o.arg
        );
    }
    assert_eq!(by_arg.len(), issued.len(), "a call has no outcome");
    for (node, id, arg) in issued {
        let o = &by_arg[arg];
        assert_eq!((o.node, o.req_id), (*node, *id));
        match o.result {
            RpcResult::Reply(r) => {
                assert_eq!(r, arg * 2 + 1);
                assert!(o.at <= o.deadline, "reply after deadline: {o:?}");
            }
            RpcResult::Expired => assert_eq!(o.at, o.deadline, "expired late: {o:?}"),
            RpcResult::Refused | RpcResult::ConnectionLost => assert!(o.at <= o.deadline),
        }
    }
    by_arg
}

#[test]
fn handshake_connects_both_sides() {
    let mut sim = pair(1, NetConfig::default(), RpcConfig::default());
    sim.run_for(ms(5)).unwrap();
    for (node, peer) in [(0, 1), (1, 0)] {
        let conn = sim.node(node).conn(peer).unwrap();
        assert_eq!(conn.state(), State::Ready, "node {node}");
        let info = conn.peer().unwrap();
        assert_eq!(info.node_id, sim.node(peer).id());
        assert_eq!(info.incarnation, Incarnation::new(1));
        assert_eq!(info.shard_count, 4);
        assert_eq!(connected_count(&sim, node), 1);
    }
    // Heartbeats keep it up, with no suspicion on a clean network.
    sim.run_for(Duration::from_secs(1)).unwrap();
    assert_eq!(sim.node(0).conn(1).unwrap().state(), State::Ready);
    assert!(sim.node(0).conn(1).unwrap().stats().heartbeat_acks >= 90);
    assert!(!sim
        .events()
        .iter()
        .any(|e| matches!(e.event, Event::PeerSuspect)));
}

#[test]
fn wrong_key_is_rejected_with_reason() {
    let mut sim = Sim::new(2, NetConfig::default(), RpcConfig::default());
    let mut client_cfg = cfg(101, KEY);
    client_cfg.max_reconnect_attempts = Some(2);
    let a = sim.add_node(client_cfg);
    let b = sim.add_node(cfg(202, b"another key entirely, 32 bytes!!"));
    sim.connect(a, b).unwrap();
    sim.run_for(Duration::from_secs(2)).unwrap();
    assert_eq!(connected_count(&sim, a) + connected_count(&sim, b), 0);
    let client_failures: Vec<_> = events_of(&sim, a)
        .into_iter()
        .filter(|(_, e)| matches!(e, Event::Failed { .. }))
        .collect();
    assert_eq!(client_failures.len(), 3, "first attempt plus two retries");
    for (_, e) in &client_failures {
        assert_eq!(
            *e,
            Event::Failed {
                reason: FailReason::Handshake(HandshakeError::BadProof)
            }
        );
    }
    assert!(events_of(&sim, b).iter().any(|(_, e)| *e
        == Event::Failed {
            reason: FailReason::Handshake(HandshakeError::Rejected {
                reason: RejectReason::BadProof
            })
        }));
    assert_eq!(sim.node(a).conn(b).unwrap().state(), State::Failed);
}

#[test]
fn version_mismatch_is_rejected() {
    let mut sim = Sim::new(3, NetConfig::default(), RpcConfig::default());
    let mut client_cfg = cfg(101, KEY);
    client_cfg.handshake.min_version = 2;
    client_cfg.handshake.max_version = 3;
    client_cfg.max_reconnect_attempts = Some(0);
    let a = sim.add_node(client_cfg);
    let b = sim.add_node(cfg(202, KEY));
    sim.connect(a, b).unwrap();
    sim.run_for(ms(100)).unwrap();
    assert_eq!(
        events_of(&sim, a),
        vec![(
            events_of(&sim, a)[0].0,
            Event::Failed {
                reason: FailReason::Handshake(HandshakeError::Rejected {
                    reason: RejectReason::VersionMismatch
                })
            }
        )]
    );
    assert_eq!(sim.node(a).conn(b).unwrap().state(), State::Failed);
}

#[test]
fn partition_is_detected_within_bound_and_heals() {
    let net = NetConfig::default();
    let mut sim = pair(4, net, RpcConfig::default());
    sim.run_for(ms(100)).unwrap();
    let t0 = sim.now();
    sim.partition(0, 1);
    sim.run_for(ms(500)).unwrap();
    let c = cfg(0, KEY);
    let bound = c.failure_detection_bound();
    for node in [0, 1] {
        let ev = events_of(&sim, node);
        let suspect = ev
            .iter()
            .find(|(_, e)| *e == Event::PeerSuspect)
            .map(|(t, _)| *t);
        let dead = ev
            .iter()
            .find(|(_, e)| *e == Event::PeerDead)
            .map(|(t, _)| *t);
        let (suspect, dead) = (suspect.expect("suspect"), dead.expect("dead"));
        assert!(suspect < dead);
        // Never later than the bound after the partition...
        assert!(
            dead <= t0 + bound,
            "node {node}: dead at {dead:?}, bound {:?}",
            t0 + bound
        );
        // ...and not much earlier: the last frame heard was at most one interval plus one latency
        // before the cut.
        let earliest = t0 + bound - c.heartbeat_interval - net.latency_max;
        assert!(dead >= earliest, "node {node}: dead too early at {dead:?}");
        assert!(ev.iter().any(|(_, e)| *e
            == Event::Failed {
                reason: FailReason::PeerDead
            }));
    }
    // The client keeps retrying with backoff during the partition, then reconnects after it heals.
    assert!(events_of(&sim, 0)
        .iter()
        .any(|(_, e)| matches!(e, Event::Reconnecting { .. })));
    sim.heal(0, 1);
    sim.run_for(Duration::from_secs(1)).unwrap();
    assert_eq!(sim.node(0).conn(1).unwrap().state(), State::Ready);
    assert_eq!(sim.node(1).conn(0).unwrap().state(), State::Ready);
    assert_eq!(connected_count(&sim, 0), 2);
    assert_eq!(connected_count(&sim, 1), 2);
}

#[test]
fn restart_reconnects_with_new_incarnation_and_drops_old_frames() {
    let mut sim = pair(5, NetConfig::default(), RpcConfig::default());
    sim.run_for(ms(20)).unwrap();
    // Make frames slow and reordered, issue calls, then restart the client node while they are
    // still in flight.
    sim.set_net(NetConfig {
        reorder: 1.0,
        reorder_delay: ms(60),
        latency_min: ms(20),
        latency_max: ms(20),
        ..NetConfig::default()
    });
    for arg in 0..20 {
        sim.call(0, 1, arg, ms(500)).unwrap();
    }
    sim.run_for(ms(1)).unwrap();
    sim.set_net(NetConfig::default());
    sim.restart(0).unwrap();
    assert_eq!(sim.node(0).incarnation(), Incarnation::new(2));
    sim.run_for(ms(300)).unwrap();

    // The server saw the new hello, replaced the session and learned the new incarnation.
    let server = events_of(&sim, 1);
    assert!(server.iter().any(|(_, e)| *e
        == Event::Failed {
            reason: FailReason::SessionReplaced
        }));
    assert!(server.iter().any(|(_, e)| *e
        == Event::PeerRestarted {
            old: Incarnation::new(1),
            new: Incarnation::new(2)
        }));
    // It did so beside the ready connection, which the new one replaced once ready.
    assert_eq!(sim.net_stats().pending_opened, 1, "{:?}", sim.net_stats());
    assert_eq!(sim.net_stats().pending_failed, 0, "{:?}", sim.net_stats());
    let conn = sim.node(1).conn(0).unwrap();
    assert_eq!(conn.state(), State::Ready);
    assert_eq!(conn.peer().unwrap().incarnation, Incarnation::new(2));
    assert!(
        conn.stats().dropped_stale > 0,
        "old-incarnation frames dropped: {:?}",
        conn.stats()
    );
    // None of the old incarnation's requests executed after the new session began.
    let executed_old: u32 = sim
        .node(1)
        .executions()
        .iter()
        .filter(|(k, _)| k.incarnation == Incarnation::new(1))
        .map(|(_, n)| *n)
        .sum();
    assert_eq!(
        executed_old, 0,
        "old requests were all still in flight at the restart"
    );
    // New calls work.
    let id = sim.call(0, 1, 1_000, ms(100)).unwrap();
    sim.run_for(ms(50)).unwrap();
    let o = sim
        .outcomes()
        .iter()
        .find(|o| o.req_id == id && o.incarnation == Incarnation::new(2));
    assert_eq!(o.map(|o| o.result), Some(RpcResult::Reply(2_001)));

    // Now restart the server: the client notices (dead peer), backs off, reconnects, and sees
    // the server's new incarnation.
    sim.restart(1).unwrap();
    sim.run_for(Duration::from_secs(1)).unwrap();
    let client = events_of(&sim, 0);
    assert!(client.iter().any(|(_, e)| *e
        == Event::PeerRestarted {
            old: Incarnation::new(1),
            new: Incarnation::new(2)
        }));
    assert_eq!(sim.node(0).conn(1).unwrap().state(), State::Ready);
}

/// A `Hello` naming the client node, from a newer incarnation but without the key, reaches the
/// server's ready primary: the session carries on (calls issued before, during and after it
/// are answered), the `Hello` gets a pending opening of its own, which fails at its handshake
/// deadline; the server reports no failure, restart or new session.
#[test]
fn a_forged_hello_leaves_the_ready_session_alone() {
    let mut sim = pair(17, NetConfig::default(), RpcConfig::default());
    sim.run_for(ms(20)).unwrap();
    let before = sim.call(0, 1, 1, ms(100)).unwrap();
    let mut forged = cfg(101, b"not the cluster's key, 32 bytes!");
    forged.handshake.incarnation = Incarnation::new(9);
    let mut forger = Connection::client(
        forged,
        NodeId::new(202),
        ShardId::new(0),
        Seeds {
            rng: 3,
            nonce: [3; 32],
        },
    );
    forger.connect(sim.now()).unwrap();
    let hello = forger.poll_transmit().unwrap();
    assert_eq!(hello.header.kind, FrameKind::Hello);
    let primary = Rail {
        local: ShardId::new(0),
        remote: ShardId::new(0),
    };
    let server_events = events_of(&sim, 1).len();
    sim.inject(0, 1, primary, hello.to_vec());
    sim.run_for(ms(1)).unwrap();
    assert!(sim.node(1).pending_opening(0, primary).is_some());
    let during = sim.call(0, 1, 2, ms(100)).unwrap();
    // Past the pending opening's handshake deadline (200 ms).
    sim.run_for(ms(300)).unwrap();
    let after = sim.call(0, 1, 3, ms(100)).unwrap();
    sim.run_for(ms(50)).unwrap();
    for (id, arg) in [(before, 1), (during, 2), (after, 3)] {
        let o = sim
            .outcomes()
            .iter()
            .find(|o| o.node == 0 && o.req_id == id);
        assert_eq!(o.map(|o| o.result), Some(RpcResult::Reply(arg * 2 + 1)));
    }
    let stats = sim.net_stats();
    assert_eq!(
        (stats.pending_opened, stats.pending_failed),
        (1, 1),
        "{stats:?}"
    );
    assert!(sim.node(1).pending_opening(0, primary).is_none());
    let conn = sim.node(1).conn(0).unwrap();
    assert_eq!(conn.state(), State::Ready);
    assert_eq!(conn.peer().unwrap().incarnation, Incarnation::new(1));
    // What the server reported since: the pending opening's failure, nothing of the session.
    let since: Vec<Event> = events_of(&sim, 1)[server_events..]
        .iter()
        .map(|(_, e)| e.clone())
        .collect();
    assert_eq!(
        since,
        vec![Event::Failed {
            reason: FailReason::Handshake(HandshakeError::Timeout)
        }],
        "{since:?}"
    );
}

#[test]
fn requests_under_loss_meet_their_deadlines() {
    let net = NetConfig {
        loss: 0.2,
        duplicate: 0.05,
        reorder: 0.1,
        reorder_delay: ms(2),
        ..NetConfig::default()
    };
    let rpc = RpcConfig {
        retry_interval: ms(5),
        ..RpcConfig::default()
    };
    let mut sim = pair(6, net, rpc);
    while sim.node(0).conn(1).unwrap().state() != State::Ready
        || sim.node(1).conn(0).unwrap().state() != State::Ready
    {
        sim.run_for(ms(10)).unwrap();
        assert!(
            sim.now() < Timestamp::ZERO + Duration::from_secs(10),
            "never connected"
        );
    }
    let mut issued = Vec::new();
    for arg in 0..300 {
        // Mix short deadlines (some will expire) and generous ones.
        let timeout = if arg % 10 == 0 { ms(3) } else { ms(100) };
        if let Some(id) = sim.call(0, 1, arg, timeout) {
            issued.push((0, id, arg));
        }
        sim.run_for(ms(1)).unwrap();
    }
    assert!(
        issued.len() >= 290,
        "connection stayed up: {}",
        issued.len()
    );
    sim.run_for(Duration::from_secs(1)).unwrap();
    assert_eq!(sim.node(0).pending_calls(), 0);
    let outcomes = check_outcomes(&sim, &issued);
    let replies = outcomes
        .values()
        .filter(|o| matches!(o.result, RpcResult::Reply(_)))
        .count();
    let expired = outcomes
        .values()
        .filter(|o| o.result == RpcResult::Expired)
        .count();
    let generous_ok = outcomes
        .values()
        .filter(|o| o.arg % 10 != 0 && matches!(o.result, RpcResult::Reply(_)))
        .count();
    let generous = issued.iter().filter(|(_, _, a)| a % 10 != 0).count();
    println!(
        "loss 20%: {replies} replies, {expired} expired of {} calls; {:?}",
        issued.len(),
        sim.net_stats()
    );
    assert!(sim.net_stats().lost > 100, "loss happened");
    assert!(
        generous_ok * 100 >= generous * 99,
        "{generous_ok}/{generous} generous calls answered"
    );
    assert!(expired > 0, "some 3 ms calls expired");
}

#[test]
fn no_duplicate_execution_through_dedup_window() {
    let net = NetConfig {
        loss: 0.1,
        duplicate: 0.5,
        reorder: 0.3,
        reorder_delay: ms(3),
        ..NetConfig::default()
    };
    let rpc = RpcConfig {
        // Retransmit faster than the round trip so most calls are sent several times.
        retry_interval: Duration::from_micros(150),
        ..RpcConfig::default()
    };
    let mut sim = pair(7, net, rpc);
    while sim.node(0).conn(1).unwrap().state() != State::Ready
        || sim.node(1).conn(0).unwrap().state() != State::Ready
    {
        sim.run_for(ms(10)).unwrap();
    }
    let mut issued = Vec::new();
    for arg in 0..300 {
        if let Some(id) = sim.call(0, 1, arg, ms(200)) {
            issued.push((0, id, arg));
        }
        sim.run_for(Duration::from_micros(200)).unwrap();
    }
    sim.run_for(Duration::from_secs(1)).unwrap();
    check_outcomes(&sim, &issued);
    let executions = sim.node(1).executions();
    let total: u32 = executions.values().sum();
    assert!(
        executions.values().all(|&n| n == 1),
        "a request executed twice"
    );
    let delivered = sim.node(1).conn(0).unwrap().stats().delivered;
    println!(
        "{} executions from {delivered} request frames delivered",
        total
    );
    assert!(
        delivered > 2 * u64::from(total),
        "duplicates really arrived"
    );
    assert!(total as usize >= issued.len() * 95 / 100);
}

#[test]
fn same_seed_same_run() {
    let run = |seed| {
        let net = NetConfig {
            loss: 0.1,
            duplicate: 0.1,
            reorder: 0.2,
            ..NetConfig::default()
        };
        let mut sim = pair(seed, net, RpcConfig::default());
        sim.run_for(ms(50)).unwrap();
        for arg in 0..50 {
            sim.call(0, 1, arg, ms(30));
            sim.run_for(ms(1)).unwrap();
        }
        sim.partition(0, 1);
        sim.run_for(ms(200)).unwrap();
        sim.heal(0, 1);
        sim.run_for(ms(500)).unwrap();
        (
            sim.events().to_vec(),
            sim.outcomes().to_vec(),
            sim.net_stats(),
        )
    };
    assert_eq!(run(11), run(11));
    assert_ne!(run(11).2, run(12).2);
}

// ---- Rails: a primary handshake per node pair, the other rails join its session. ----

fn rail(local: u16, remote: u16) -> Rail {
    Rail {
        local: ShardId::new(local),
        remote: ShardId::new(remote),
    }
}

const PRIMARY: Rail = Rail {
    local: ShardId::new(0),
    remote: ShardId::new(0),
};

/// Node 0 (id 101, `a` shards) dials node 1 (id 202, `b` shards); runs until the primary is up.
fn rail_pair(seed: u64, a: u16, b: u16) -> Sim {
    let mut sim = Sim::new(seed, NetConfig::default(), RpcConfig::default());
    let mut ca = cfg(101, KEY);
    ca.handshake.shard_count = a;
    let mut cb = cfg(202, KEY);
    cb.handshake.shard_count = b;
    let (na, nb) = (sim.add_node(ca), sim.add_node(cb));
    sim.connect(na, nb).unwrap();
    sim.run_for(ms(5)).unwrap();
    assert_eq!(sim.node(na).conn(nb).unwrap().state(), State::Ready);
    assert_eq!(sim.node(nb).conn(na).unwrap().state(), State::Ready);
    sim
}

fn rail_events(sim: &Sim, node: usize, r: Rail) -> Vec<Event> {
    sim.events()
        .iter()
        .filter(|e| e.node == node && e.rail == r)
        .map(|e| e.event.clone())
        .collect()
}

fn failed(reason: FailReason) -> Event {
    Event::Failed { reason }
}

fn rejected(reason: RejectReason) -> Event {
    failed(FailReason::Handshake(HandshakeError::Rejected { reason }))
}

/// The primary, then a join of every other rail; every rail ready on both sides, and calls in
/// both directions on every rail answered on the rail they came in on.
fn join_every_rail(a: u16, b: u16) {
    let mut sim = rail_pair(21, a, b);
    let (ida, idb) = (sim.node(0).id(), sim.node(1).id());
    // Both sides hold the same session secret; each knows the other.
    let (peer_b, secret_a) = sim.node(0).session(idb).cloned().unwrap();
    let (peer_a, secret_b) = sim.node(1).session(ida).cloned().unwrap();
    assert_eq!(secret_a, secret_b);
    assert_eq!((peer_b.node_id, peer_b.shard_count), (idb, b));
    assert_eq!((peer_a.node_id, peer_a.shard_count), (ida, a));
    assert!(peer_a.features.contains(Features::RAILS));
    let rails = Rails::new(a, b).unwrap();
    for r in rails.iter().filter(|r| *r != PRIMARY) {
        sim.join(0, 1, r).unwrap();
    }
    sim.run_for(ms(5)).unwrap();
    assert_eq!(sim.node(0).rails(1).count(), rails.len());
    assert_eq!(sim.node(1).rails(0).count(), rails.len());
    for r in rails.iter() {
        let (ours, theirs) = (
            sim.node(0).rail(1, r).unwrap(),
            sim.node(1).rail(0, r.mirror()).unwrap(),
        );
        assert_eq!(
            (ours.state(), theirs.state()),
            (State::Ready, State::Ready),
            "{r:?}"
        );
        assert_eq!((ours.rail(), theirs.rail()), (Some(r), Some(r.mirror())));
        assert_eq!(ours.peer(), Some(&peer_b));
        assert_eq!(theirs.peer(), Some(&peer_a));
        let joined = r != PRIMARY;
        assert_eq!(
            (ours.is_join(), theirs.is_join()),
            (joined, joined),
            "{r:?}"
        );
        assert_eq!(ours.stats().joins, u64::from(joined));
        assert_eq!(theirs.stats().joins, u64::from(joined));
        if joined {
            assert_eq!(
                rail_events(&sim, 0, r),
                vec![Event::Connected(peer_b)],
                "{r:?}"
            );
            assert_eq!(ours.session_secret(), None);
        }
    }
    // Calls on every rail, from both sides.
    let mut arg = 0;
    let mut issued = Vec::new();
    for r in rails.iter() {
        for (node, peer, on) in [(0, 1, r), (1, 0, r.mirror())] {
            let id = sim.call_on(node, peer, on, arg, ms(100)).unwrap();
            issued.push((node, id, arg));
            arg += 1;
        }
    }
    sim.run_for(ms(10)).unwrap();
    let outcomes = check_outcomes(&sim, &issued);
    assert!(outcomes
        .values()
        .all(|o| matches!(o.result, RpcResult::Reply(_))));
    // Each request ran once, keyed by its sending shard.
    for (node, peer) in [(0usize, 1usize), (1, 0)] {
        let mut shards: Vec<u16> = sim
            .node(peer)
            .executions()
            .keys()
            .map(|k| k.shard.get())
            .collect();
        shards.sort_unstable();
        let mut want: Vec<u16> = sim
            .node(node)
            .rails(peer)
            .map(|(r, _)| r.local.get())
            .collect();
        want.sort_unstable();
        assert_eq!(
            shards, want,
            "node {peer} executed requests of node {node}'s shards"
        );
    }
    // No frame was misrouted or dropped on any rail.
    for (node, peer) in [(0usize, 1usize), (1, 0)] {
        for (r, c) in sim.node(node).rails(peer) {
            let s = c.stats();
            assert_eq!(
                (s.dropped_misrouted, s.dropped_not_ready, s.dropped_other),
                (0, 0, 0),
                "node {node} {r:?}"
            );
        }
    }
}

#[test]
fn primary_then_joins_of_every_rail_2x3() {
    join_every_rail(2, 3);
}

#[test]
fn primary_then_joins_of_every_rail_3x2() {
    join_every_rail(3, 2);
}

#[test]
fn join_with_a_wrong_secret_is_refused() {
    let mut sim = rail_pair(22, 2, 2);
    let (peer, _) = sim.node(0).session(sim.node(1).id()).cloned().unwrap();
    let wrong = SessionSecret::from_bytes([7; 32]);
    sim.join_with(0, 1, rail(1, 1), peer, wrong).unwrap();
    sim.run_for(Duration::from_secs(2)).unwrap();
    assert_eq!(
        rail_events(&sim, 0, rail(1, 1)),
        vec![rejected(RejectReason::BadProof)]
    );
    assert_eq!(
        rail_events(&sim, 1, rail(1, 1)),
        vec![failed(FailReason::Handshake(HandshakeError::BadProof))]
    );
    // Neither side retries; the primary is untouched.
    assert_eq!(
        sim.node(0).rail(1, rail(1, 1)).unwrap().state(),
        State::Failed
    );
    assert_eq!(
        sim.node(1).rail(0, rail(1, 1)).unwrap().state(),
        State::Failed
    );
    assert_eq!(
        sim.node(1)
            .rail(0, rail(1, 1))
            .unwrap()
            .stats()
            .joins_refused,
        1
    );
    assert_eq!(sim.node(0).conn(1).unwrap().state(), State::Ready);
    assert_eq!(rail_events(&sim, 0, PRIMARY).len(), 1, "connected only");
}

#[test]
fn join_for_an_unknown_session_is_refused() {
    // Two nodes that never ran a primary handshake.
    let mut sim = Sim::new(23, NetConfig::default(), RpcConfig::default());
    let (a, b) = (sim.add_node(cfg(101, KEY)), sim.add_node(cfg(202, KEY)));
    assert_eq!(
        sim.join(a, b, rail(1, 1)),
        Err(SimError::NoSession { node: a, peer: b })
    );
    // A session made up by the client (it knows the server's identity, not a secret).
    let made_up = PeerInfo {
        node_id: sim.node(b).id(),
        incarnation: sim.node(b).incarnation(),
        shard_count: 4,
        features: Features::RAILS,
        version: 1,
    };
    sim.join_with(
        a,
        b,
        rail(1, 1),
        made_up,
        SessionSecret::from_bytes([1; 32]),
    )
    .unwrap();
    sim.run_for(ms(50)).unwrap();
    assert_eq!(
        rail_events(&sim, a, rail(1, 1)),
        vec![rejected(RejectReason::UnknownSession)]
    );
    // The server's net layer answered with Connection::refuse and made no connection.
    assert_eq!(sim.node(b).rails(a).count(), 0);
    assert_eq!(
        sim.node(a).rail(b, rail(1, 1)).unwrap().state(),
        State::Failed
    );
}

#[test]
fn join_to_a_restarted_server_is_refused_until_a_new_session() {
    let mut sim = rail_pair(24, 2, 2);
    let idb = sim.node(1).id();
    let (old_peer, old_secret) = sim.node(0).session(idb).cloned().unwrap();
    sim.restart(1).unwrap();
    // At once: the restarted server has no session at all with the client.
    sim.join(0, 1, rail(1, 1)).unwrap();
    sim.run_for(ms(5)).unwrap();
    assert_eq!(
        rail_events(&sim, 0, rail(1, 1)),
        vec![rejected(RejectReason::UnknownSession)]
    );
    assert_eq!(sim.node(1).rails(0).count(), 1, "only the primary's server");
    // The primary notices the restart (dead peer), reconnects, and makes a new session.
    sim.run_for(ms(300)).unwrap();
    assert!(events_of(&sim, 0).iter().any(|(_, e)| *e
        == Event::PeerRestarted {
            old: Incarnation::new(1),
            new: Incarnation::new(2)
        }));
    let (new_peer, new_secret) = sim.node(0).session(idb).cloned().unwrap();
    assert_eq!(new_peer.incarnation, Incarnation::new(2));
    assert_ne!(new_secret, old_secret);
    // A join with the old session names the server's previous incarnation: the server holds a
    // session with the client now, but not that one.
    sim.join_with(0, 1, rail(1, 1), old_peer, old_secret)
        .unwrap();
    sim.run_for(ms(5)).unwrap();
    assert_eq!(
        rail_events(&sim, 0, rail(1, 1)),
        vec![
            rejected(RejectReason::UnknownSession),
            rejected(RejectReason::UnknownSession)
        ]
    );
    assert_eq!(
        rail_events(&sim, 1, rail(1, 1)),
        vec![failed(FailReason::Handshake(
            HandshakeError::UnknownSession
        ))]
    );
    // The client's fallback: the current session joins.
    sim.join(0, 1, rail(1, 1)).unwrap();
    sim.run_for(ms(5)).unwrap();
    assert_eq!(
        sim.node(0).rail(1, rail(1, 1)).unwrap().state(),
        State::Ready
    );
    assert_eq!(
        sim.node(1).rail(0, rail(1, 1)).unwrap().state(),
        State::Ready
    );
    assert_eq!(
        sim.node(1)
            .rail(0, rail(1, 1))
            .unwrap()
            .peer()
            .unwrap()
            .incarnation,
        Incarnation::new(1)
    );
}

#[test]
fn join_that_gets_no_answer_times_out_and_stays_failed() {
    let mut sim = rail_pair(25, 2, 2);
    sim.cut_rail(0, 1, rail(1, 1));
    let t0 = sim.now();
    sim.join(0, 1, rail(1, 1)).unwrap();
    sim.run_for(Duration::from_secs(3)).unwrap();
    let ev: Vec<_> = sim
        .events()
        .iter()
        .filter(|e| e.node == 0 && e.rail == rail(1, 1))
        .collect();
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert_eq!(
        ev[0].event,
        failed(FailReason::Handshake(HandshakeError::Timeout))
    );
    // The handshake timeout of `cfg` (200 ms) from the join.
    assert_eq!(ev[0].at, t0 + ms(200));
    let c = sim.node(0).rail(1, rail(1, 1)).unwrap();
    assert_eq!((c.state(), c.poll_timeout()), (State::Failed, None));
    assert_eq!(c.stats().reconnects, 0);
    assert_eq!(
        sim.node(1).rails(0).count(),
        1,
        "nothing reached the server"
    );
    // Healed, a new join works.
    sim.heal_rail(0, 1, rail(1, 1));
    sim.join(0, 1, rail(1, 1)).unwrap();
    sim.run_for(ms(5)).unwrap();
    assert_eq!(
        sim.node(0).rail(1, rail(1, 1)).unwrap().state(),
        State::Ready
    );
}

#[test]
fn heartbeats_and_close_are_per_rail() {
    let mut sim = rail_pair(26, 2, 3);
    for r in [rail(1, 1), rail(0, 2)] {
        sim.join(0, 1, r).unwrap();
    }
    sim.run_for(Duration::from_secs(1)).unwrap();
    for (r, c) in sim.node(0).rails(1) {
        assert_eq!(c.state(), State::Ready, "{r:?}");
        assert!(c.stats().heartbeat_acks >= 90, "{r:?}: {:?}", c.stats());
    }
    for (r, c) in sim.node(1).rails(0) {
        assert!(c.stats().heartbeat_acks >= 90, "{r:?}: {:?}", c.stats());
    }
    // One rail cut: it alone dies, on both sides, within the detection bound.
    let t0 = sim.now();
    sim.cut_rail(0, 1, rail(1, 1));
    sim.run_for(ms(200)).unwrap();
    let bound = cfg(0, KEY).failure_detection_bound();
    for (node, r) in [(0, rail(1, 1)), (1, rail(1, 1))] {
        let dead = sim
            .events()
            .iter()
            .find(|e| e.node == node && e.rail == r && e.event == Event::PeerDead)
            .map(|e| e.at)
            .expect("dead");
        assert!(dead <= t0 + bound, "node {node}: dead at {dead:?}");
    }
    assert_eq!(
        sim.node(0).rail(1, rail(1, 1)).unwrap().state(),
        State::Failed
    );
    for (node, r) in [(0, PRIMARY), (0, rail(0, 2)), (1, PRIMARY), (1, rail(2, 0))] {
        assert_eq!(
            rail_events(&sim, node, r).len(),
            1,
            "node {node} {r:?}: connected only"
        );
    }
    // Closing one rail closes its other end only.
    sim.close_rail(0, 1, rail(0, 2)).unwrap();
    sim.run_for(ms(5)).unwrap();
    assert_eq!(
        rail_events(&sim, 1, rail(2, 0)).last(),
        Some(&Event::Closed {
            reason: CloseReason::Peer
        })
    );
    assert_eq!(
        sim.node(1).rail(0, rail(2, 0)).unwrap().state(),
        State::Closed
    );
    assert_eq!(sim.node(0).conn(1).unwrap().state(), State::Ready);
    let id = sim.call(0, 1, 5, ms(100)).unwrap();
    sim.run_for(ms(5)).unwrap();
    assert!(sim
        .outcomes()
        .iter()
        .any(|o| o.req_id == id && o.result == RpcResult::Reply(11)));
    // The cut rail rejoins once healed.
    sim.heal_rail(0, 1, rail(1, 1));
    sim.join(0, 1, rail(1, 1)).unwrap();
    sim.run_for(ms(5)).unwrap();
    assert_eq!(
        sim.node(0).rail(1, rail(1, 1)).unwrap().state(),
        State::Ready
    );
    assert_eq!(
        sim.node(1).rail(0, rail(1, 1)).unwrap().state(),
        State::Ready
    );
}

#[test]
fn frames_off_their_rail_are_dropped() {
    let mut sim = rail_pair(27, 2, 3);
    sim.join(0, 1, rail(0, 2)).unwrap();
    sim.join(0, 1, rail(1, 1)).unwrap();
    sim.run_for(ms(5)).unwrap();
    // A request built for rail (0, 2), sent down the endpoint of rail (1, 1).
    let header = FrameHeader {
        req_id: shardcx_proto::ReqId::new(99),
        payload_len: 8,
        ..sim
            .node(0)
            .rail(1, rail(0, 2))
            .unwrap()
            .frame_header(FrameKind::RpcRequest)
            .unwrap()
    };
    let mut bytes = vec![0u8; shardcx_proto::wire::payload_offset() + 8];
    shardcx_proto::wire::encode_frame(&header, &7u64.to_le_bytes(), &mut bytes, &Limits::default())
        .unwrap();
    sim.inject(0, 1, rail(1, 1), bytes);
    sim.run_for(ms(5)).unwrap();
    let c = sim.node(1).rail(0, rail(1, 1)).unwrap();
    assert_eq!(c.stats().dropped_misrouted, 1);
    assert_eq!(c.state(), State::Ready);
    assert!(sim.node(1).executions().is_empty());
}
