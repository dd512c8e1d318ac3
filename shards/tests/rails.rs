//! Tier 3: rails (see `shardcx_shards::net`, "Rails" in the session docs) between nodes of
//! several shards in one process over tcp on loopback: where default and addressed calls go,
//! that default calls cross no shard, that a rail is only joined to an authenticated session,
//! and that a restarted node gets every rail back.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // A test/example may panic: a panic is a failure it reports.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use common::{
    dropped, join_bounded, mesh_taken, node, run_node, serial, wait_until, Barrier, Server,
    ShardReport, A, B, LIMIT,
};
use shardcx_shards::net::{
    bootstrap::fetch_directory_blocking, data_am_header, frame_am_header, opening_am_header, Dest,
    Directory, Frame, NetConfig, DATA_AM, FRAME_AM,
};
use shardcx_shards::proto::handshake::{HandshakeMessage, RejectReason, SESSION_SECRET_LEN};
use shardcx_shards::proto::wire::{decode_frame, MAX_WIRE_VERSION};
use shardcx_shards::proto::{
    AmId, ConnConfig, Connection, Features, FrameHeader, FrameKind, HandshakeConfig, Incarnation,
    Limits, NodeId, PeerInfo, PreSharedKey, Rails, Seeds, SessionSecret, ShardId, Timestamp,
};
use shardcx_shards::ucx::{
    AmPayload, AmProto, Config, Context, Endpoint, EpOptions, ErrorMode, Features as UcxFeatures,
    Worker,
};
use shardcx_shards::{NetError, NetStats, ShardCtx, ShardsBuilder};

const PING: AmId = AmId::new(30);
const PONG: AmId = AmId::new(31);
const LOAD: AmId = AmId::new(32);
/// The `id` of the RPC request that asks a shard which it is and which rail the request came
/// in on.
const PROBE: u32 = 5;
/// A third node.
const C: NodeId = NodeId::new(0xC0C0A);
/// A node id nobody has a session with.
const X: NodeId = NodeId::new(0xBAD);

/// What a shard's PING handler saw: which shard handled it, from which node and remote shard
/// (the rail), and the payload.
#[derive(Debug, Clone)]
struct Hit {
    at: u16,
    from: NodeId,
    src: u16,
    payload: Vec<u8>,
}

type Hits = Arc<Mutex<Vec<Hit>>>;

fn id8(s: ShardId) -> u8 {
    u8::try_from(s.get()).unwrap()
}

/// On a shard: PING is recorded in `hits` and answered inline with PONG (the payload and this
/// shard) on the rail it came in on; a PROBE request is answered inline with this shard and
/// the rail's remote shard; PONGs are recorded in `pongs` like PINGs.
fn echo_handlers(ctx: &Rc<ShardCtx>, hits: &Hits, pongs: &Hits) {
    let hits = hits.clone();
    ctx.set_frame_handler_am(PING, move |ctx, frame: Frame| {
        let (node, src) = (frame.node(), frame.header().src_shard);
        hits.lock().unwrap().push(Hit {
            at: ctx.id().get(),
            from: node,
            src: src.get(),
            payload: frame.payload().to_vec(),
        });
        let mut pong = frame.payload().to_vec();
        pong.push(id8(ctx.id()));
        // Not from the network's side of the test: a refused answer shows as a missing pong.
        let _ = ctx.send_am_now(Dest::shard(node, src), PONG, &[], &pong);
    });
    let pongs = pongs.clone();
    ctx.set_frame_handler_am(PONG, move |ctx, frame: Frame| {
        pongs.lock().unwrap().push(Hit {
            at: ctx.id().get(),
            from: frame.node(),
            src: frame.header().src_shard.get(),
            payload: frame.payload().to_vec(),
        });
    });
    ctx.set_frame_handler_inline(FrameKind::RpcRequest, |ctx, frame: Frame| {
        if frame.header().id == PROBE {
            let answer = [id8(ctx.id()), id8(frame.header().src_shard)];
            let _ = ctx.reply_now(
                frame.node(),
                frame.header(),
                FrameKind::RpcResponse,
                &answer,
            );
        }
    })
    .unwrap();
}

/// A listening node of `shards` shards with [`echo_handlers`].
fn echo_server(id: NodeId, shards: usize, hits: &Hits) -> ShardsBuilder {
    let (hits, pongs) = (hits.clone(), Hits::default());
    node(id, shards)
        .listen("127.0.0.1:0".parse().unwrap())
        .on_start(move |ctx| echo_handlers(ctx, &hits, &pongs))
}

/// Where a call from local shard `me` for `target` (`None`: no target) of a node of `m` shards
/// must go, by proto's rails: (the remote shard that handles it, the local shard that holds
/// the rail it travels on).
fn expected_route(rails: &Rails, me: ShardId, target: Option<ShardId>) -> (ShardId, ShardId) {
    match target {
        None => (rails.default_remote(me), me),
        Some(j) if rails.has_rail(me, j) => (j, me),
        Some(j) => (j, rails.owner_of_remote(j)),
    }
}

/// From this shard, a PROBE request with no target and one to every shard of `peer` (of `m`
/// shards): each must be answered by the shard it was meant for, having come in on the
/// expected rail, and the reply must come back on that rail. What went wrong, if anything.
async fn probe_rails(ctx: &Rc<ShardCtx>, peer: NodeId, m: u16) -> Vec<String> {
    let rails = Rails::new(u16::try_from(ctx.shard_count()).unwrap(), m).unwrap();
    let me = ctx.id();
    let mut problems = Vec::new();
    let targets = std::iter::once(None).chain((0..m).map(|j| Some(ShardId::new(j))));
    for target in targets {
        let dest = target.map_or(Dest::from(peer), |j| Dest::shard(peer, j));
        let (server, holder) = expected_route(&rails, me, target);
        let r = ctx
            .request(
                dest,
                FrameKind::RpcRequest,
                PROBE,
                vec![],
                Duration::from_secs(2),
            )
            .await;
        match r {
            Ok((h, reply)) if h.src_shard == server && reply == [id8(server), id8(holder)] => {}
            Ok((h, reply)) => problems.push(format!(
                "shard {me} → {target:?}: answered by shard {} with {reply:?}, expected shard \
                 {server} on the rail from shard {holder}",
                h.src_shard
            )),
            Err(e) => problems.push(format!("shard {me} → {target:?}: {e}")),
        }
    }
    problems
}

/// Runs the routing test between a client node of 2 shards and a server node of `m`.
fn routing(m: u16) {
    const K: u8 = 10;
    let _g = serial();
    let hits = Hits::default();
    let b = Server::start(echo_server(B, usize::from(m), &hits));
    let addr = b.addr;
    let pongs = Hits::default();
    let p = pongs.clone();
    let barrier = Barrier::default();
    let problems = run_node(node(A, 2), move |ctx| {
        let (pongs, barrier) = (p.clone(), barrier.clone());
        async move {
            echo_handlers(&ctx, &Hits::default(), &pongs);
            ctx.connect(addr).await.expect("connect");
            barrier.wait(2, 1).await;
            let me = ctx.id();
            let rails = Rails::new(2, m).unwrap();
            let mut problems = probe_rails(&ctx, B, m).await;
            // Who holds which rail, as the shard reports it.
            for j in (0..m).map(ShardId::new) {
                let want = expected_route(&rails, me, Some(j)).1;
                let got = ctx.owner_of_shard(B, j);
                if got != Some(want) {
                    problems.push(format!("shard {me}: owner_of_shard({j}) = {got:?}"));
                }
                // A call that needs another shard's rail is refused here, not forwarded.
                let here = ctx
                    .request_here(
                        Dest::shard(B, j),
                        FrameKind::RpcRequest,
                        PROBE,
                        vec![],
                        (Duration::from_secs(2), Duration::from_secs(2)),
                    )
                    .await;
                match (want == me, here) {
                    (true, Ok(_)) => {}
                    (false, Err(NetError::OtherShard { owner, .. })) if owner == want => {}
                    (_, other) => problems.push(format!(
                        "shard {me}: request_here to shard {j}: {:?}",
                        other.map(|(h, _)| h.src_shard)
                    )),
                }
            }
            // Active messages, with no target and to every shard; each PONG comes back on
            // the PING's rail.
            let targets: Vec<u8> = std::iter::once(0xFF)
                .chain(0..id8(ShardId::new(m)))
                .collect();
            for &t in &targets {
                for k in 0..K {
                    let dest = if t == 0xFF {
                        Dest::from(B)
                    } else {
                        Dest::shard(B, ShardId::new(u16::from(t)))
                    };
                    ctx.send_am(dest, PING, vec![id8(me), t, k])
                        .await
                        .expect("ping");
                }
            }
            let want = targets.len() * usize::from(K);
            let all = wait_until(Duration::from_secs(5), || {
                pongs
                    .lock()
                    .unwrap()
                    .iter()
                    .filter(|p| p.payload[0] == id8(me))
                    .count()
                    >= want
            })
            .await;
            if !all {
                problems.push(format!("shard {me}: not every pong came back"));
            }
            barrier.wait(2, 2).await;
            problems
        }
    });
    let reports = b.stop();
    let problems: Vec<String> = problems.into_iter().flatten().collect();
    assert!(problems.is_empty(), "{problems:#?}");
    let rails = Rails::new(2, m).unwrap();
    let target_of = |t: u8| (t != 0xFF).then(|| ShardId::new(u16::from(t)));
    let hits = hits.lock().unwrap().clone();
    let pongs = pongs.lock().unwrap().clone();
    assert_eq!(hits.len(), 2 * (usize::from(m) + 1) * usize::from(K));
    assert_eq!(pongs.len(), hits.len());
    for h in &hits {
        let me = ShardId::new(u16::from(h.payload[0]));
        let (server, holder) = expected_route(&rails, me, target_of(h.payload[1]));
        assert_eq!(
            (h.from, h.at, h.src),
            (A, server.get(), holder.get()),
            "ping {:?}",
            h.payload
        );
    }
    for p in &pongs {
        let me = ShardId::new(u16::from(p.payload[0]));
        let (server, holder) = expected_route(&rails, me, target_of(p.payload[1]));
        assert_eq!(
            (p.from, p.at, p.src, p.payload[3]),
            (B, holder.get(), server.get(), id8(server)),
            "pong {:?}",
            p.payload
        );
    }
    for (s, r) in reports.iter().enumerate() {
        assert_eq!(dropped(&r.stats), 0, "server shard {s}: {:?}", r.stats);
    }
}

/// Two nodes of two shards: from client shard `i`, a call with no target reaches server shard
/// `i`; a call for server shard `j` reaches `j` from either client shard (from the other one
/// through the shard that holds the rail); every answer (a reply to a request, an active
/// message sent back on the request's rail) comes back on the rail the call went out on.
#[test]
fn calls_take_their_rails_two_by_two() {
    routing(2);
}

/// The same with three server shards for two client shards: client shard 0 holds rails to
/// server shards 0 and 2, client shard 1 to server shard 1 (proto's `Rails`).
#[test]
fn calls_take_their_rails_two_by_three() {
    routing(3);
}

/// Under load from every client shard on its default rail (active messages and requests
/// answered inline), each server shard handles its client shard's messages (half of them
/// each, so more than a third), and neither node's mesh takes a single message in the
/// meantime: no cross-shard hop on either side. One forwarded call afterwards shows that the
/// counters do count hops.
#[test]
fn default_calls_cross_no_shard_on_either_node() {
    const K: u64 = 3000;
    let _g = serial();
    let counts = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
    // Per server shard: its mesh counter at its first and at its latest load message.
    let first = Arc::new([AtomicU64::new(u64::MAX), AtomicU64::new(u64::MAX)]);
    let last = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
    let misrouted = Arc::new(AtomicU64::new(0));
    let (c, f, l, mis) = (
        counts.clone(),
        first.clone(),
        last.clone(),
        misrouted.clone(),
    );
    let b = Server::start(
        node(B, 2)
            .listen("127.0.0.1:0".parse().unwrap())
            .on_start(move |ctx| {
                let (c, f, l, mis) = (c.clone(), f.clone(), l.clone(), mis.clone());
                let me = ctx.id().index();
                let seen = move |ctx: &ShardCtx, src: ShardId| {
                    let taken = mesh_taken(ctx.mesh_stats());
                    let _ = f[me].compare_exchange(
                        u64::MAX,
                        taken,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    );
                    l[me].store(taken, Ordering::Release);
                    if src != ctx.id() {
                        mis.fetch_add(1, Ordering::AcqRel);
                    }
                };
                let seen = Rc::new(seen);
                let s = seen.clone();
                ctx.set_frame_handler_am(LOAD, move |ctx, frame| {
                    s(ctx, frame.header().src_shard);
                    c[me].fetch_add(1, Ordering::AcqRel);
                });
                ctx.set_frame_handler_inline(FrameKind::RpcRequest, move |ctx, frame: Frame| {
                    seen(ctx, frame.header().src_shard);
                    let answer = [id8(ctx.id()), id8(frame.header().src_shard)];
                    ctx.reply_now(
                        frame.node(),
                        frame.header(),
                        FrameKind::RpcResponse,
                        &answer,
                    )
                    .expect("reply");
                })
                .unwrap();
            }),
    );
    let addr = b.addr;
    let barrier = Barrier::default();
    let out = run_node(node(A, 2), move |ctx| {
        let barrier = barrier.clone();
        async move {
            ctx.connect(addr).await.expect("connect");
            barrier.wait(2, 1).await;
            let me = ctx.id();
            let before = mesh_taken(ctx.mesh_stats());
            let payload = [id8(me); 32];
            for k in 0..K {
                ctx.send_am_now(B, LOAD, &[], &payload).expect("load");
                // Every tenth, a request answered inline; it also paces the load (the rail
                // is FIFO: its reply comes after every message before it was handled).
                if k % 10 == 9 {
                    let (h, reply) = ctx
                        .request_here(
                            B,
                            FrameKind::RpcRequest,
                            PROBE,
                            vec![],
                            (Duration::from_secs(5), Duration::from_secs(5)),
                        )
                        .await
                        .expect("request on the default rail");
                    assert_eq!(
                        (h.src_shard, reply.as_slice()),
                        (me, &[id8(me), id8(me)][..])
                    );
                }
            }
            let after = mesh_taken(ctx.mesh_stats());
            barrier.wait(2, 2).await;
            // One addressed call through the other shard's rail: a hop, which must show.
            let other = ShardId::new(1 - me.get());
            let t0 = mesh_taken(ctx.mesh_stats());
            ctx.request(
                Dest::shard(B, other),
                FrameKind::RpcRequest,
                PROBE,
                vec![],
                Duration::from_secs(5),
            )
            .await
            .expect("forwarded request");
            let hop = mesh_taken(ctx.mesh_stats()) - t0;
            barrier.wait(2, 3).await;
            (before, after, hop)
        }
    });
    let reports = b.stop();
    assert_eq!(
        misrouted.load(Ordering::Acquire),
        0,
        "a call on another rail"
    );
    let total: u64 = counts.iter().map(|c| c.load(Ordering::Acquire)).sum();
    assert_eq!(total, 2 * K);
    for (s, c) in counts.iter().enumerate() {
        let c = c.load(Ordering::Acquire);
        assert!(3 * c >= total, "server shard {s} handled {c} of {total}");
        let (f, l) = (
            first[s].load(Ordering::Acquire),
            last[s].load(Ordering::Acquire),
        );
        assert_eq!(l, f, "server shard {s}: {} mesh messages under load", l - f);
    }
    for (s, (before, after, hop)) in out.iter().enumerate() {
        assert_eq!(after, before, "client shard {s}: mesh messages under load");
        assert!(*hop > 0, "client shard {s}: a forwarded call left no trace");
    }
    for (s, r) in reports.iter().enumerate() {
        assert_eq!(dropped(&r.stats), 0, "server shard {s}: {:?}", r.stats);
    }
}

/// A frame an intruder sends.
#[derive(Clone, Copy, Debug)]
enum Forgery {
    /// A `Join` claiming to be `claim` (with incarnation `inc`) on its shard `src`, to the
    /// server's shard `dst`, with a proof under a made-up session secret.
    Join {
        claim: NodeId,
        inc: Incarnation,
        src: ShardId,
        dst: ShardId,
    },
    /// A `Hello` claiming to be `claim` (with incarnation `inc`) on its shard `src`, to the
    /// server's shard `dst`: the start of a pre-shared-key handshake the intruder cannot
    /// finish.
    Hello {
        claim: NodeId,
        inc: Incarnation,
        src: ShardId,
        dst: ShardId,
    },
    /// An active message PING claiming to be `claim`'s shard `src`, to shard `dst`.
    Data {
        claim: NodeId,
        src: ShardId,
        dst: ShardId,
    },
}

/// What came back to the intruder: each frame's kind, sending shard and, for a `Reject`, its
/// reason.
type Answers = Vec<(FrameKind, ShardId, Option<RejectReason>)>;

/// An endpoint with no session: a plain UCX worker in a thread of its own, outside any node,
/// that fetches the listener's directory at `addr` as any client may, sends `forgeries` to the
/// directory's workers (its own address in each opening, as a node's would be), and collects
/// what comes back for half a second.
fn intrude(addr: SocketAddr, forgeries: Vec<Forgery>) -> Answers {
    intrude_with(addr, forgeries, Duration::from_millis(500), None)
}

/// [`intrude`], collecting for `keep` (its endpoints stay up that long), and raising `sent`
/// (when given) once the forgeries have been out for 50 ms.
fn intrude_with(
    addr: SocketAddr,
    forgeries: Vec<Forgery>,
    keep: Duration,
    sent: Option<Arc<AtomicBool>>,
) -> Answers {
    let h = std::thread::spawn(move || {
        let mut cfg = Config::from_env().unwrap();
        cfg.set("TLS", "tcp").unwrap();
        let ctx = Context::new(&cfg, UcxFeatures::messaging()).unwrap();
        let worker = Worker::new(&ctx).unwrap();
        let got: Rc<std::cell::RefCell<Answers>> = Rc::default();
        let g = got.clone();
        worker
            .set_am_handler(FRAME_AM, move |_, p| {
                let AmPayload::Data(data) = p else { return };
                let bytes = data.into_vec();
                let Ok((header, payload)) = decode_frame(&bytes, &Limits::default()) else {
                    return;
                };
                let reason = match HandshakeMessage::decode(header.kind, payload) {
                    Ok(HandshakeMessage::Reject(r)) => Some(r.reason),
                    _ => None,
                };
                g.borrow_mut().push((header.kind, header.src_shard, reason));
            })
            .unwrap();
        let opts = EpOptions {
            error_mode: ErrorMode::Peer,
        };
        let progress_for = |d: Duration, until: &dyn Fn() -> bool| {
            let deadline = Instant::now() + d;
            while Instant::now() < deadline && !until() {
                worker.progress();
                std::thread::sleep(Duration::from_micros(200));
            }
        };
        let dir = fetch_directory_blocking(addr, Duration::from_secs(5)).expect("a directory");
        let me = worker.address().unwrap().as_bytes().to_vec();
        let mut eps: HashMap<ShardId, Endpoint> = HashMap::new();
        for f in forgeries {
            let (dst, id, header, payload) = match f {
                Forgery::Join {
                    claim,
                    inc,
                    src,
                    dst,
                }
                | Forgery::Hello {
                    claim,
                    inc,
                    src,
                    dst,
                } => {
                    let hello = matches!(f, Forgery::Hello { .. });
                    let frame = forged_opening(&dir, hello, (claim, inc, src), dst);
                    let header = frame_am_header(claim, u32::try_from(me.len()).unwrap());
                    let mut payload = me.clone();
                    payload.extend_from_slice(&frame);
                    (dst, FRAME_AM, header.to_vec(), payload)
                }
                Forgery::Data { claim, src, dst } => {
                    let payload = b"intruder".to_vec();
                    let fh = FrameHeader {
                        id: PING.get(),
                        payload_len: payload.len() as u64,
                        src_shard: src,
                        dst_shard: dst,
                        ..FrameHeader::new(FrameKind::Am)
                    };
                    (dst, DATA_AM, data_am_header(claim, &fh, &[]), payload)
                }
            };
            let ep = eps.entry(dst).or_insert_with(|| {
                Endpoint::connect_to_worker(&worker, &dir.workers[dst.index()], opts).unwrap()
            });
            let (r, _) = worker.block_on(ep.am_send(id, &header, payload, AmProto::Eager));
            r.expect("intruder's send");
        }
        let early = Duration::from_millis(50).min(keep);
        progress_for(early, &|| false);
        if let Some(sent) = sent {
            sent.store(true, Ordering::Release);
        }
        progress_for(keep - early, &|| false);
        drop(eps);
        let answers = got.borrow().clone();
        answers
    });
    join_bounded(h, "intruder")
}

/// A `Join` frame (or a `Hello` when `hello`) from `claim` (incarnation `inc`, 2 shards) on
/// its shard `src` to shard `dst` of the directory's node; a join is for a session with that
/// node as the directory describes it, under a session secret the intruder made up.
fn forged_opening(
    dir: &Directory,
    hello: bool,
    (claim, inc, src): (NodeId, Incarnation, ShardId),
    dst: ShardId,
) -> Vec<u8> {
    let psk = PreSharedKey::new(b"not the cluster's key at all").unwrap();
    let mut cfg = ConnConfig::new(HandshakeConfig::new(claim, inc, 2, psk));
    cfg.local_shard = src;
    let server = PeerInfo {
        node_id: dir.node_id,
        incarnation: dir.incarnation,
        shard_count: dir.shard_count(),
        features: Features::RAILS,
        version: MAX_WIRE_VERSION,
    };
    let secret = SessionSecret::from_bytes([0x5A; SESSION_SECRET_LEN]);
    let seeds = Seeds {
        rng: 1,
        nonce: [7; 32],
    };
    let (mut conn, kind) = if hello {
        (
            Connection::client(cfg, dir.node_id, dst, seeds),
            FrameKind::Hello,
        )
    } else {
        let c = Connection::join_client(cfg, server, secret, dst, seeds);
        (c, FrameKind::Join)
    };
    conn.connect(Timestamp::ZERO).expect("an opening to send");
    let t = conn.poll_transmit().expect("the opening");
    assert_eq!(t.header.kind, kind);
    t.to_vec()
}

/// A's side of the intrusion tests: connect to B, probe every rail, tell the test thread, wait
/// until the intrusion is over, then probe every rail again and ping from every shard.
/// Sends A's incarnation on `ready`; returns, per shard, what went wrong and the shard's
/// `join_retries` (each a join that B refused as `UnknownSession` while setting up).
fn a_around_intrusion(
    addr: SocketAddr,
    ready: mpsc::Sender<Incarnation>,
    over: Arc<AtomicBool>,
) -> Vec<(Vec<String>, u64)> {
    let ready = Arc::new(Mutex::new(ready));
    let barrier = Barrier::default();
    run_node(node(A, 2), move |ctx| {
        let (ready, over, barrier) = (ready.clone(), over.clone(), barrier.clone());
        async move {
            echo_handlers(&ctx, &Hits::default(), &Hits::default());
            ctx.connect(addr).await.expect("connect");
            // A connect that finds this shard's own rail up returns at once, maybe while the
            // other shard's rails are still being joined: wait for both shards' connects.
            barrier.wait(2, 1).await;
            let mut problems = probe_rails(&ctx, B, 2).await;
            barrier.wait(2, 2).await;
            if ctx.id().get() == 0 {
                ready.lock().unwrap().send(ctx.incarnation()).unwrap();
            }
            let done = wait_until(Duration::from_secs(20), || over.load(Ordering::Acquire)).await;
            assert!(done, "the intruder never finished");
            problems.extend(
                probe_rails(&ctx, B, 2)
                    .await
                    .into_iter()
                    .map(|p| format!("after the intrusion: {p}")),
            );
            for k in 0..5u8 {
                if let Err(e) = ctx.send_am(B, PING, vec![id8(ctx.id()), 0xAA, k]).await {
                    problems.push(format!("ping after the intrusion: {e}"));
                }
            }
            barrier.wait(2, 3).await;
            (problems, ctx.net_stats().join_retries)
        }
    })
}

/// What an intrusion test saw.
struct Intrusion {
    /// What went wrong on A.
    problems: Vec<String>,
    /// B's shards' reports.
    reports: Vec<ShardReport>,
    /// What B's PING handlers saw.
    hits: Vec<Hit>,
    /// What came back to the intruder.
    answers: Answers,
    /// Joins of A's shards that B refused while setting up (see `common::dropped`): B
    /// counted each as an unauthenticated drop on the shard with the same index.
    a_join_retries: Vec<u64>,
}

/// Splits A's results into its problems and its shards' join retries.
fn a_results(a: Vec<(Vec<String>, u64)>) -> (Vec<String>, Vec<u64>) {
    let retries = a.iter().map(|r| r.1).collect();
    (a.into_iter().flat_map(|r| r.0).collect(), retries)
}

/// Runs B, A connected to it, and an intruder sending `forgeries(A's incarnation)` to B once
/// A's rails are up; A probes its rails again after it.
fn intrusion(forgeries: impl FnOnce(Incarnation) -> Vec<Forgery>) -> Intrusion {
    intrusion_with(common::net_config(), None, forgeries)
}

/// [`intrusion`] with B on `net`; with `beside`, the intruder keeps its endpoints for that
/// long, and A probes its rails again meanwhile (50 ms after the forgeries went out) rather
/// than after it.
fn intrusion_with(
    net: NetConfig,
    beside: Option<Duration>,
    forgeries: impl FnOnce(Incarnation) -> Vec<Forgery>,
) -> Intrusion {
    let _g = serial();
    let hits = Hits::default();
    let b = Server::start(echo_server(B, 2, &hits).net(net));
    let addr = b.addr;
    let (tx, rx) = mpsc::channel();
    let over = Arc::new(AtomicBool::new(false));
    let o = over.clone();
    let a = std::thread::spawn(move || a_around_intrusion(addr, tx, o));
    let a_inc = rx.recv_timeout(LIMIT).expect("A did not connect");
    let answers = match beside {
        Some(keep) => intrude_with(addr, forgeries(a_inc), keep, Some(over.clone())),
        None => intrude(addr, forgeries(a_inc)),
    };
    over.store(true, Ordering::Release);
    let (problems, a_join_retries) = a_results(join_bounded(a, "node A"));
    let reports = b.stop();
    let hits = hits.lock().unwrap().clone();
    Intrusion {
        problems,
        reports,
        hits,
        answers,
        a_join_retries,
    }
}

/// A `Hello` is answered on an endpoint in the error mode its AM header says, whatever the
/// answering node's own (B's is PEER, over tcp), also where the answer comes first: a plain UCX
/// process sends B a `Hello` from worker `x` carrying worker `y`'s address, so B's endpoint to
/// `y` exists (and wires up) before `y` has any endpoint to B; `y` then gets B's `Welcome`,
/// dials B in the said mode and sends on that endpoint.
///
/// Regression: B answered with an endpoint in no mode (UCX's default, NONE, where the peer's
/// wire-up had not come first), and `y` in mode PEER died in `ucp_ep_create` (SIGSEGV after
/// "asymmetric endpoint configuration is not supported"; the same pair the other way round
/// dies in `ucp_wireup_init_lanes`, "endpoint reconfiguration not supported yet", which the
/// fault suite's R8 met with 64 client shards connecting at once). Before that B answered in
/// its own mode, and `y` in mode NONE died the same way.
#[test]
fn an_opening_is_answered_in_the_error_mode_it_says() {
    let _g = serial();
    for mode in [ErrorMode::Peer, ErrorMode::None] {
        let b = Server::start(echo_server(B, 1, &Hits::default()));
        let addr = b.addr;
        let got = join_bounded(
            std::thread::spawn(move || answered_before_dialling(addr, mode)),
            "the plain UCX peer",
        );
        let reports = b.stop();
        assert_eq!(
            got,
            [(FrameKind::Welcome, ShardId::new(0), None)],
            "what y got back, in mode {mode:?}"
        );
        assert_eq!(reports[0].stats.handshakes, 0, "{:?}", reports[0].stats);
    }
}

/// The plain UCX side of [`an_opening_is_answered_in_the_error_mode_it_says`]: what worker `y`
/// got back (each frame's kind, sending shard and reject reason).
fn answered_before_dialling(addr: SocketAddr, mode: ErrorMode) -> Answers {
    let mut cfg = Config::from_env().unwrap();
    cfg.set("TLS", "tcp").unwrap();
    let ctx = Context::new(&cfg, UcxFeatures::messaging()).unwrap();
    let (x, y) = (Worker::new(&ctx).unwrap(), Worker::new(&ctx).unwrap());
    let got: Rc<std::cell::RefCell<Answers>> = Rc::default();
    let g = got.clone();
    y.set_am_handler(FRAME_AM, move |_, p| {
        let AmPayload::Data(data) = p else { return };
        let bytes = data.into_vec();
        if let Ok((header, _)) = decode_frame(&bytes, &Limits::default()) {
            g.borrow_mut().push((header.kind, header.src_shard, None));
        }
    })
    .unwrap();
    let opts = EpOptions { error_mode: mode };
    let dir = fetch_directory_blocking(addr, Duration::from_secs(5)).expect("a directory");
    let y_addr = y.address().unwrap().as_bytes().to_vec();
    let frame = forged_opening(
        &dir,
        true,
        (X, Incarnation::new(7), ShardId::new(0)),
        ShardId::new(0),
    );
    let header = opening_am_header(X, u32::try_from(y_addr.len()).unwrap(), mode);
    let mut payload = y_addr;
    payload.extend_from_slice(&frame);
    let to_b = Endpoint::connect_to_worker(&x, &dir.workers[0], opts).unwrap();
    let (r, _) = x.block_on(to_b.am_send(FRAME_AM, &header, payload, AmProto::Eager));
    r.expect("x's send");
    let progress_until = |d: Duration, until: &dyn Fn() -> bool| {
        let deadline = Instant::now() + d;
        while Instant::now() < deadline && !until() {
            x.progress();
            y.progress();
            std::thread::sleep(Duration::from_micros(200));
        }
    };
    // B's endpoint to y wires up before its first frame goes out: y has that wire-up once the
    // `Welcome` is in.
    progress_until(Duration::from_secs(5), &|| !got.borrow().is_empty());
    let y_to_b = Endpoint::connect_to_worker(&y, &dir.workers[0], opts).unwrap();
    let fh = FrameHeader {
        id: PING.get(),
        payload_len: 8,
        ..FrameHeader::new(FrameKind::Am)
    };
    let (r, _) = y.block_on(y_to_b.am_send(
        DATA_AM,
        &data_am_header(X, &fh, &[]),
        vec![9u8; 8],
        AmProto::Eager,
    ));
    r.expect("y's send on its own endpoint");
    progress_until(Duration::from_millis(200), &|| false);
    drop((to_b, y_to_b));
    let answers = got.borrow().clone();
    answers
}

/// A `Join` from a node with no session with B (an endpoint that never authenticated) is
/// refused on each of B's shards with `UnknownSession`, sent back to the intruder at once;
/// application frames claiming to come from that node are dropped and counted; nothing of it
/// reaches a handler, no rail is made, and A's authenticated rails carry on.
#[test]
fn a_join_from_a_node_without_a_session_is_refused() {
    let Intrusion {
        problems,
        reports,
        hits,
        answers,
        a_join_retries,
    } = intrusion(|_| {
        let mut f = Vec::new();
        for s in [0, 1].map(ShardId::new) {
            f.push(Forgery::Join {
                claim: X,
                inc: Incarnation::new(1),
                src: s,
                dst: s,
            });
            for _ in 0..3 {
                f.push(Forgery::Data {
                    claim: X,
                    src: s,
                    dst: s,
                });
            }
        }
        f
    });
    assert!(problems.is_empty(), "{problems:#?}");
    let mut refused: Vec<_> = answers.clone();
    refused.sort_by_key(|a| a.1);
    assert_eq!(
        refused,
        [0, 1]
            .map(|s| (
                FrameKind::Reject,
                ShardId::new(s),
                Some(RejectReason::UnknownSession)
            ))
            .to_vec(),
        "what the intruder got back"
    );
    assert!(hits.iter().all(|h| h.from == A), "{hits:?}");
    for (s, r) in reports.iter().enumerate() {
        let st = r.stats;
        // The join and the three frames (and the set-up's refused joins).
        assert_eq!(
            st.dropped_unauthenticated,
            4 + a_join_retries[s],
            "shard {s}: {st:?}"
        );
        let (primary, joined) = if s == 0 { (1, 0) } else { (0, 1) };
        assert_eq!(
            (st.handshakes, st.joins),
            (primary, joined),
            "shard {s}: {st:?}"
        );
    }
}

/// A `Join` claiming to be A, the node B has a session with (right node, incarnations, shard
/// count and version: only the session's secret is unknown to the intruder), is refused on
/// each rail, and the authenticated rail it names is not disturbed: A's calls on every rail
/// work afterwards, and B counts no new join.
#[test]
fn a_forged_join_leaves_the_authenticated_rail_alone() {
    let Intrusion {
        problems,
        reports,
        hits,
        answers,
        a_join_retries,
    } = intrusion(|a_inc| {
        // Rail (1, 1) first (B holds A's joined rail there), then (0, 0) (B holds the
        // session's primary rail there).
        [1, 0]
            .map(|s| Forgery::Join {
                claim: A,
                inc: a_inc,
                src: ShardId::new(s),
                dst: ShardId::new(s),
            })
            .to_vec()
    });
    eprintln!("the intruder got back {answers:?}");
    assert!(problems.is_empty(), "{problems:#?}");
    assert!(
        answers
            .iter()
            .all(|a| a.0 == FrameKind::Reject && a.2 == Some(RejectReason::BadProof)),
        "{answers:?}"
    );
    // Every PING came from A: 5 from each of its shards after the intrusion.
    assert_eq!(hits.len(), 10, "{hits:?}");
    for (s, r) in reports.iter().enumerate() {
        let st = r.stats;
        let (primary, joined) = if s == 0 { (1, 0) } else { (0, 1) };
        assert_eq!(
            (st.handshakes, st.joins),
            (primary, joined),
            "shard {s}: {st:?}"
        );
        // On shard 0 the join met the session's primary rail, which takes no joins: it was
        // refused on an endpoint of its own and counted; on shard 1 A's joined rail refused
        // it itself (its answer went to A, which drops it).
        let refused_apart = u64::from(s == 0);
        assert_eq!(
            st.dropped_unauthenticated,
            refused_apart + a_join_retries[s],
            "shard {s}: {st:?}"
        );
    }
}

/// B's handshake deadline in the forged-`Hello` tests: A probes its rails from 50 ms after the
/// forgeries went out, beside the pending openings they opened.
const FORGED_HELLO_DEADLINE: Duration = Duration::from_millis(1000);

/// Runs A, B and an intruder that sends `forgeries` and keeps its endpoints past B's
/// handshake deadline ([`FORGED_HELLO_DEADLINE`]), and checks what every forged-`Hello` test
/// expects: A's rails carried on (probed and pinged while the forged openings were pending,
/// every ping from A), B made no new session nor rail, each B shard answered one forged
/// `Hello` beside the rail it holds for A and closed that pending opening at its deadline,
/// and the intruder got nothing but the `Welcome`s of those pending openings (no `Joined`,
/// no application frame). Returns B's reports.
fn forged_hellos(forgeries: impl FnOnce(Incarnation) -> Vec<Forgery>) -> Vec<ShardReport> {
    let net = NetConfig {
        handshake_timeout: FORGED_HELLO_DEADLINE,
        ..common::net_config()
    };
    let keep = FORGED_HELLO_DEADLINE + Duration::from_millis(400);
    let Intrusion {
        problems,
        reports,
        hits,
        answers,
        ..
    } = intrusion_with(net, Some(keep), forgeries);
    eprintln!("the intruder got back {answers:?}");
    assert!(problems.is_empty(), "{problems:#?}");
    assert_eq!(hits.len(), 10, "{hits:?}");
    assert!(hits.iter().all(|h| h.from == A), "{hits:?}");
    let mut welcomes: Vec<_> = answers.clone();
    welcomes.sort_by_key(|a| a.1);
    assert_eq!(
        welcomes,
        [0, 1]
            .map(|s| (FrameKind::Welcome, ShardId::new(s), None))
            .to_vec(),
        "what the intruder got back"
    );
    for (s, r) in reports.iter().enumerate() {
        let st = r.stats;
        let (primary, joined) = if s == 0 { (1, 0) } else { (0, 1) };
        assert_eq!(
            (st.handshakes, st.joins),
            (primary, joined),
            "shard {s}: {st:?}"
        );
        assert_eq!(
            (st.pending_openings, st.pending_refused, st.pending_expired),
            (1, 0, 1),
            "shard {s}: {st:?}"
        );
        assert_eq!(st.handshakes_expired, 0, "shard {s}: {st:?}");
    }
    reports
}

/// A `Hello` claiming to be A (with A's incarnation) on each of A's rails, from an endpoint
/// that cannot finish the handshake (it has no key), leaves A's authenticated rails alone.
///
/// Regression: B handed the `Hello` to the connection of the rail it holds for A, and proto's
/// `Connection::on_hello` on a `Ready` connection started a new server handshake at once
/// (`FailReason::SessionReplaced`: a `Hello` there was taken for the peer's restart). The
/// rail stopped delivering A's frames, its `Welcome` went to A, which dropped it, and the rail
/// failed at the handshake deadline: anyone who could reach B's workers and knew A's node id
/// and incarnation could cut A off. A ready connection now declines a `Hello`, which gets a
/// pending opening of its own beside the rail (see "Openings beside a ready rail" in the
/// session docs).
#[test]
fn a_forged_hello_leaves_the_authenticated_rail_alone() {
    forged_hellos(|a_inc| {
        [0, 1]
            .map(|s| Forgery::Hello {
                claim: A,
                inc: a_inc,
                src: ShardId::new(s),
                dst: ShardId::new(s),
            })
            .to_vec()
    });
}

/// The same with a `Hello` from another incarnation of A (as if A had restarted): it too is
/// answered beside A's ready rail, which it does not replace, since the intruder cannot finish
/// the handshake. A `Hello` from an older incarnation than A's is dropped as stale, with no
/// answer and no pending opening.
///
/// Regression: an opening from another incarnation than the rail's peer made a new rail on an
/// endpoint of its own at once (`accept_opening`, `insert_rail`), retiring A's ready rail
/// before any proof.
#[test]
fn a_forged_hello_from_another_incarnation_leaves_the_authenticated_rail_alone() {
    let reports = forged_hellos(|a_inc| {
        let (newer, older) = (
            Incarnation::new(a_inc.get() + 1_000),
            Incarnation::new(a_inc.get() - 1),
        );
        [0, 1]
            .into_iter()
            .flat_map(|s| {
                [newer, older].map(|inc| Forgery::Hello {
                    claim: A,
                    inc,
                    src: ShardId::new(s),
                    dst: ShardId::new(s),
                })
            })
            .collect()
    });
    for (s, r) in reports.iter().enumerate() {
        assert_eq!(r.stats.dropped_other, 1, "shard {s}: {:?}", r.stats);
    }
}

/// Defect "foreign UCX clients", on the rails: `Hello`s from made-up nodes (an endpoint that
/// cannot finish a handshake) open at most `max_half_open` rails per shard; the rest are
/// dropped unanswered, and the rails they opened are closed at the handshake deadline, all
/// counted.
#[test]
fn hellos_from_made_up_nodes_are_capped_per_shard_and_expire() {
    let _g = serial();
    // Shorter than the half second the intruder keeps its endpoints: the rails it opened
    // end at their deadline, not because its endpoints went.
    let handshake_timeout = Duration::from_millis(250);
    let b = echo_server(B, 2, &Hits::default()).net(NetConfig {
        handshake_timeout,
        max_half_open: 2,
        ..common::net_config()
    });
    let b = Server::start(b);
    let made_up = |k: u64, dst: u16| Forgery::Hello {
        claim: NodeId::new(0xF00D + k),
        inc: Incarnation::new(1),
        src: ShardId::new(dst),
        dst: ShardId::new(dst),
    };
    // Five to shard 0 (three over the cap of two), one to shard 1.
    let mut f: Vec<Forgery> = (0..5).map(|k| made_up(k, 0)).collect();
    f.push(made_up(9, 1));
    let t0 = Instant::now();
    let answers = intrude(b.addr, f);
    eprintln!("the intruder got back {answers:?}");
    let welcomed = |s: u16| {
        answers
            .iter()
            .filter(|a| a.0 == FrameKind::Welcome && a.1 == ShardId::new(s))
            .count()
    };
    assert_eq!((welcomed(0), welcomed(1)), (2, 1), "{answers:?}");
    // Past the handshake deadline (and a timer round).
    let wait = (handshake_timeout + Duration::from_millis(400)).saturating_sub(t0.elapsed());
    std::thread::sleep(wait);
    let reports = b.stop();
    let (s0, s1) = (reports[0].stats, reports[1].stats);
    assert_eq!(
        (s0.openings_over_cap, s0.handshakes_expired),
        (3, 2),
        "shard 0: {s0:?}"
    );
    assert_eq!(
        (s1.openings_over_cap, s1.handshakes_expired),
        (0, 1),
        "shard 1: {s1:?}"
    );
}

/// A node with another pre-shared key, connecting while A is connected, is refused; none of
/// its shards gets a rail (every send is refused as not connected), and nothing it sends
/// reaches B's handlers; A's rails carry on.
#[test]
fn a_node_with_another_key_gets_no_rail() {
    let _g = serial();
    let hits = Hits::default();
    let b = Server::start(echo_server(B, 2, &hits));
    let addr = b.addr;
    let (tx, rx) = mpsc::channel();
    let over = Arc::new(AtomicBool::new(false));
    let o = over.clone();
    let a = std::thread::spawn(move || a_around_intrusion(addr, tx, o));
    rx.recv_timeout(LIMIT).expect("A did not connect");
    let c = run_node(
        node(C, 2).psk(b"another key, of sixteen bytes or more"),
        move |ctx| async move {
            let r = ctx.connect(addr).await;
            let sent = ctx.send_am(B, PING, vec![9, 9, 9]).await;
            (r, sent, ctx.connected_nodes(), ctx.net_stats())
        },
    );
    over.store(true, Ordering::Release);
    let (problems, _) = a_results(join_bounded(a, "node A"));
    let reports = b.stop();
    assert!(problems.is_empty(), "{problems:#?}");
    for (s, (r, sent, nodes, stats)) in c.iter().enumerate() {
        assert!(
            matches!(
                r,
                Err(NetError::Refused {
                    node: B,
                    reason: RejectReason::BadProof
                })
            ),
            "shard {s} of C: {r:?}"
        );
        assert_eq!(*sent, Err(NetError::NotConnected { node: B }), "shard {s}");
        assert!(nodes.is_empty(), "shard {s} of C: {nodes:?}");
        assert_eq!(
            (stats.handshakes, stats.joins),
            (0, 0),
            "shard {s}: {stats:?}"
        );
    }
    assert!(hits.lock().unwrap().iter().all(|h| h.from == A));
    for (s, r) in reports.iter().enumerate() {
        let (primary, joined) = if s == 0 { (1, 0) } else { (0, 1) };
        let st = r.stats;
        assert_eq!(
            (st.handshakes, st.joins),
            (primary, joined),
            "shard {s}: {st:?}"
        );
    }
}

/// What each shard of a node that connected and probed its peer reports.
#[derive(Debug, Clone)]
struct Probed {
    remote: Result<shardcx_shards::RemoteNode, NetError>,
    problems: Vec<String>,
    stats: NetStats,
}

/// Connects this shard to `addr`, waits for the node's other shard, and probes every rail to
/// `peer` (of 2 shards).
async fn connect_and_probe(
    ctx: &Rc<ShardCtx>,
    addr: SocketAddr,
    peer: NodeId,
    barrier: &Barrier,
    round: usize,
) -> (Result<shardcx_shards::RemoteNode, NetError>, Vec<String>) {
    let remote = ctx.connect(addr).await;
    barrier.wait(2, round).await;
    let problems = match &remote {
        Ok(_) => probe_rails(ctx, peer, 2).await,
        Err(e) => vec![format!("shard {}: connect: {e}", ctx.id())],
    };
    (remote, problems)
}

/// The connecting node B (2 shards) as a whole: connects to `addr` from every shard, probes
/// every rail to A, and ends (closing its rails) once both shards are done.
fn run_b(addr: SocketAddr) -> Vec<Probed> {
    let barrier = Barrier::default();
    run_node(node(B, 2), move |ctx| {
        let barrier = barrier.clone();
        async move {
            echo_handlers(&ctx, &Hits::default(), &Hits::default());
            let (remote, problems) = connect_and_probe(&ctx, addr, A, &barrier, 1).await;
            barrier.wait(2, 2).await;
            Probed {
                remote,
                problems,
                stats: ctx.net_stats(),
            }
        }
    })
}

fn assert_probed(who: &str, probed: &[Probed]) {
    for (s, p) in probed.iter().enumerate() {
        assert!(p.remote.is_ok(), "{who}, shard {s}: {:?}", p.remote);
        assert!(p.problems.is_empty(), "{who}, shard {s}: {:#?}", p.problems);
    }
}

/// `(handshakes, joins)` of each shard.
fn setups(stats: impl Iterator<Item = NetStats>) -> Vec<(u64, u64)> {
    stats.map(|s| (s.handshakes, s.joins)).collect()
}

/// Node B connects to A, uses every rail and stops (closing its rails); a new B (same node id,
/// new incarnation) connects to A: every rail works again (each client shard's default rail,
/// and each remote shard addressed from each shard). A ran one primary handshake per B on
/// its shard 0 and one join per B on its shard 1.
#[test]
fn a_restarted_client_node_gets_every_rail_back() {
    let _g = serial();
    let a = Server::start(echo_server(A, 2, &Hits::default()));
    let first = run_b(a.addr);
    let second = run_b(a.addr);
    let reports = a.stop();
    assert_probed("first B", &first);
    assert_probed("second B", &second);
    for b in [&first, &second] {
        assert_eq!(setups(b.iter().map(|p| p.stats)), vec![(1, 0), (0, 1)]);
        assert_eq!(b[0].remote.as_ref().unwrap().node_id, A);
    }
    assert_eq!(
        setups(reports.iter().map(|r| r.stats)),
        vec![(2, 0), (0, 2)],
        "{reports:?}"
    );
}

/// The same when the first B is still running (as after a crash, whose end A has not
/// noticed yet: no `Close` came) while the new B connects: A still holds the old B's rails,
/// with endpoints to the old B's workers, when the new B's `Hello` and `Join`s arrive.
///
/// Regression: A used to hand the new B's `Hello` to the connection of the rail it already
/// held for node B (an opening for an existing rail went to its connection), so A's `Welcome`
/// went out on that rail's endpoint, to the old B's worker; the new B never heard back and its
/// connect failed at the handshake deadline. An opening from another incarnation than the
/// rail's peer now makes a new rail on an endpoint of its own, which replaces the old one.
#[test]
fn a_restarted_client_node_gets_every_rail_back_before_its_peer_noticed() {
    let _g = serial();
    let a = Server::start(echo_server(A, 2, &Hits::default()));
    let addr = a.addr;
    // The first B: connected, probed, and kept running until the second B is done.
    let (tx, rx) = mpsc::channel();
    let stop_first = Arc::new(AtomicBool::new(false));
    let stop = stop_first.clone();
    let tx = Arc::new(Mutex::new(tx));
    let first = std::thread::spawn(move || {
        let barrier = Barrier::default();
        run_node(node(B, 2), move |ctx| {
            let (barrier, stop, tx) = (barrier.clone(), stop.clone(), tx.clone());
            async move {
                echo_handlers(&ctx, &Hits::default(), &Hits::default());
                let (remote, problems) = connect_and_probe(&ctx, addr, A, &barrier, 1).await;
                barrier.wait(2, 2).await;
                if ctx.id().get() == 0 {
                    tx.lock().unwrap().send(()).unwrap();
                }
                wait_until(LIMIT, || stop.load(Ordering::Acquire)).await;
                Probed {
                    remote,
                    problems,
                    stats: ctx.net_stats(),
                }
            }
        })
    });
    rx.recv_timeout(LIMIT).expect("the first B did not connect");
    let t0 = Instant::now();
    let second = run_b(addr);
    let took = t0.elapsed();
    stop_first.store(true, Ordering::Release);
    let first = join_bounded(first, "the first B");
    let reports = a.stop();
    assert_probed("first B", &first);
    assert_probed(&format!("second B (after {took:?})"), &second);
    assert_eq!(
        setups(reports.iter().map(|r| r.stats)),
        vec![(2, 0), (0, 2)],
        "{reports:?}"
    );
    // The new B's `Hello` met the old B's ready rail on A's shard 0: it was answered beside
    // that rail, which it replaced once its handshake completed. (On shard 1 the new B's
    // `Join`, checked against the new session, replaced the old rail at once.)
    let pending: Vec<_> = reports
        .iter()
        .map(|r| {
            let s = r.stats;
            (s.pending_openings, s.pending_refused, s.pending_expired)
        })
        .collect();
    assert_eq!(pending, vec![(1, 0, 0), (0, 0, 0)], "{reports:?}");
}

/// Node A connects to B, uses every rail; B stops and a new B (new incarnation) listens at the
/// same address; A's rails to the old B go (its `Close`), and A connects again: every rail
/// works again. A's shard 0 ran a primary handshake with each B, its shard 1 a join with
/// each; each B's shards one of each.
#[test]
fn a_restarted_listening_node_gets_every_rail_back() {
    restarted_listener(false);
}

/// The same, with the new B on another address and started while the old B still runs (as
/// after a crash that A has not noticed yet): A replaces the old B's rails as it connects to
/// the new B.
#[test]
fn a_restarted_listening_node_gets_every_rail_back_before_its_peer_noticed() {
    restarted_listener(true);
}

fn restarted_listener(crash: bool) {
    let _g = serial();
    let b1 = Server::start(echo_server(B, 2, &Hits::default()));
    let addr1 = b1.addr;
    let phase1 = Arc::new(AtomicBool::new(false));
    let old_gone: Arc<Mutex<Option<bool>>> = Arc::default();
    let next: Arc<Mutex<Option<SocketAddr>>> = Arc::default();
    let (p1, og, nx) = (phase1.clone(), old_gone.clone(), next.clone());
    let barrier = Barrier::default();
    let a = std::thread::spawn(move || {
        run_node(node(A, 2), move |ctx| {
            let (phase1, old_gone, next, barrier) =
                (p1.clone(), og.clone(), nx.clone(), barrier.clone());
            async move {
                echo_handlers(&ctx, &Hits::default(), &Hits::default());
                let first = connect_and_probe(&ctx, addr1, B, &barrier, 1).await;
                barrier.wait(2, 2).await;
                phase1.store(true, Ordering::Release);
                let told = wait_until(LIMIT, || next.lock().unwrap().is_some()).await;
                assert!(told, "no second B");
                let addr2 = next.lock().unwrap().unwrap();
                if !crash {
                    // The old B said Close on every rail.
                    let gone = wait_until(Duration::from_secs(5), || !ctx.is_connected(B)).await;
                    if !gone {
                        *old_gone.lock().unwrap() = Some(false);
                    }
                }
                barrier.wait(2, 3).await;
                let second = connect_and_probe(&ctx, addr2, B, &barrier, 4).await;
                barrier.wait(2, 5).await;
                (first, second, ctx.net_stats())
            }
        })
    });
    let told = {
        let deadline = Instant::now() + LIMIT;
        while !phase1.load(Ordering::Acquire) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        phase1.load(Ordering::Acquire)
    };
    assert!(told, "A did not connect to the first B");
    let (b2, b1_left) = if crash {
        (Server::start(echo_server(B, 2, &Hits::default())), Ok(b1))
    } else {
        let r = b1.stop();
        // The same address, once the old listener has let go of it.
        let mut started = Server::try_start(echo_server_at(B, addr1));
        let deadline = Instant::now() + Duration::from_secs(5);
        while started.is_err() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
            started = Server::try_start(echo_server_at(B, addr1));
        }
        (started.expect("a second B at the same address"), Err(r))
    };
    *next.lock().unwrap() = Some(b2.addr);
    let out = join_bounded(a, "node A");
    let b2_reports = b2.stop();
    let b1_reports = match b1_left {
        Ok(b1) => b1.stop(),
        Err(reports) => reports,
    };
    assert_eq!(*old_gone.lock().unwrap(), None, "A kept the old B's rails");
    for (s, ((r1, p1), (r2, p2), _)) in out.iter().enumerate() {
        assert!(
            r1.is_ok() && p1.is_empty(),
            "shard {s}, first B: {r1:?} {p1:#?}"
        );
        assert!(
            r2.is_ok() && p2.is_empty(),
            "shard {s}, second B: {r2:?} {p2:#?}"
        );
        let (i1, i2) = (
            r1.as_ref().unwrap().incarnation,
            r2.as_ref().unwrap().incarnation,
        );
        assert_ne!(
            i1, i2,
            "shard {s}: the second B has the first one's incarnation"
        );
    }
    assert_eq!(
        setups(out.iter().map(|o| o.2)),
        vec![(2, 0), (0, 2)],
        "A's shards"
    );
    for reports in [&b1_reports, &b2_reports] {
        assert_eq!(
            setups(reports.iter().map(|r| r.stats)),
            vec![(1, 0), (0, 1)]
        );
    }
}

/// [`echo_server`] listening at `addr`.
fn echo_server_at(id: NodeId, addr: SocketAddr) -> ShardsBuilder {
    let (hits, pongs) = (Hits::default(), Hits::default());
    node(id, 2)
        .listen(addr)
        .on_start(move |ctx| echo_handlers(ctx, &hits, &pongs))
}
