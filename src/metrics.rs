//! Prometheus metrics of a running node ([`NodeBuilder::metrics`](crate::NodeBuilder::metrics),
//! `shardcx node --metrics ADDR`).
//!
//! Publishing and serving are off the hot path: every shard copies its counters into the
//! node's board every [`PUBLISH_INTERVAL`] (a timer task), and a small server thread answers
//! `GET /metrics` from the board with the `prometheus-client` text encoding (OpenMetrics). The
//! counters are the shards' plain per-shard cells, kept whether metrics are served or not: the
//! message path pays a few integer increments per frame (its [`NetStats`] borrow). RPC calls
//! are timed for their histogram only on a node that serves metrics (two clock reads a call).
//! Each series carries a `shard` label.
//!
//! The families, per shard (counters end in `_total`):
//!
//! | family | kind | what |
//! | --- | --- | --- |
//! | `shardcx_frames_delivered` | counter | application frames handed to handlers |
//! | `shardcx_frames_dispatched_in_callback` | counter | of those, frames with eager data dispatched inside UCX's receive callback |
//! | `shardcx_frames_sent` | counter | application frames sent, by `path` (`in_place`, `posted`, `queued`) |
//! | `shardcx_sends_paced` | counter | sends from a task that found UCX's send queue full and waited for room, by `outcome` (`taken`: sent in place, counted in `shardcx_frames_sent` too; `gave_up`: then posted or queued) |
//! | `shardcx_frames_dropped` | counter | frames dropped, by `reason` |
//! | `shardcx_rendezvous_received` | counter | frames received by rendezvous, by `into` (`pool`, `recycled`, `allocated`, `declined`) |
//! | `shardcx_rendezvous_pulls_waited` | counter | rendezvous pulls into the runtime's buffers that waited for the same rail's earlier ones (`rndv_pull_budget`) |
//! | `shardcx_handler_panics` | counter | handler calls that panicked |
//! | `shardcx_handshakes`, `shardcx_rail_joins`, `shardcx_rail_join_retries` | counter | sessions and rails formed |
//! | `shardcx_bootstraps` | counter | connections to the listener's port, by `outcome` (`served`, `refused`, `timed_out`, `over_cap`) |
//! | `shardcx_openings_over_cap`, `shardcx_handshakes_expired` | counter | half-open handshakes refused at the cap, and expired |
//! | `shardcx_pending_openings`, `shardcx_pending_openings_closed` | counter | `Hello`s for a ready rail answered beside it, and those closed without replacing it, by `outcome` (`refused`, `expired`) |
//! | `shardcx_rpc_calls` | counter | RPC requests served, by `outcome` |
//! | `shardcx_rpc_cancels_sent` | counter | cancel frames sent for calls given up |
//! | `shardcx_mesh_taken` | counter | cross-shard lane messages, by `by` (`driver`, `task`) |
//! | `shardcx_driver_rounds`, `shardcx_driver_sleeps` | counter | progress rounds, and sleeps of an idle shard |
//! | `shardcx_driver_stalls`, `shardcx_driver_stall_longest_seconds` | counter, gauge | times the driver was not polled for 250 ms or more (a blocking call or a task that does not yield on the shard's thread; each is logged with what the thread was doing), and the longest |
//! | `shardcx_dispatch_budget_hits` | counter | dispatch rounds cut at the budget (a flood) |
//! | `shardcx_dispatch_preempted` | counter | dispatches cut short for the executor's timers and I/O (slow handlers) |
//! | `shardcx_connected_nodes` | gauge | nodes this shard has a ready default rail to |
//! | `shardcx_pending_requests` | gauge | requests waiting for a reply on this shard |
//! | `shardcx_backlog_bytes`, `shardcx_backlog_peak_bytes` | gauge | bytes of frames this shard's rails hold that UCX has not completed (a slow or stopped peer), now and the most one rail held |
//! | `shardcx_sends_backlogged` | counter | sends refused because their rail's backlog was full |
//! | `shardcx_peers_dropped`, `shardcx_refused_banned` | counter | peers dropped for sending malformed requests again and again, and their handshakes refused while banned |
//! | `shardcx_forwards` | counter | requests forwarded to another shard (hops through a lane) |
//! | `shardcx_lane_in_flight` | gauge | forwarded requests not completed, by `to` (the other shard) |
//! | `shardcx_rails` | gauge | rails to other nodes' shards, by `state` (`connecting`, `ready`, `draining`, `closing`, `pending_opening`) |
//! | `shardcx_heartbeat_misses`, `shardcx_peers_dead`, `shardcx_rails_failed`, `shardcx_peer_restarts` | counter | liveness and failures |
//! | `shardcx_reconnects` | counter | connects the node made by itself to a known peer address, by `outcome` (`ok`, `failed`) |
//! | `shardcx_messages_in`, `shardcx_bytes_in`, `shardcx_messages_out`, `shardcx_bytes_out` | counter | application frames and payload bytes, by `kind` (`am`, `tag`, `rpc`, `rma`) |
//! | `shardcx_rpc_call_seconds` | histogram | round trips of the calls this shard made, by `function` (id) and `name` |
//! | `shardcx_pool_bytes_in_use`, `shardcx_pool_registered_bytes` | gauge | the registered pool |
//! | `shardcx_metrics_age_seconds` | gauge | how old this shard's published figures are |

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::rc::{Rc, Weak};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::exemplar::Exemplar;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use shardcx_shards::mesh::MeshStats;
use shardcx_shards::net::NetStats;
use shardcx_shards::proto::ShardId;
use shardcx_shards::{RailStates, ShardCtx, Traffic};

use crate::rpc::latency::Latency;
use crate::RpcStats;

/// How often each shard publishes its figures.
pub const PUBLISH_INTERVAL: Duration = Duration::from_millis(250);

/// One shard's figures at one moment.
#[derive(Debug, Clone)]
struct Snapshot {
    at: Instant,
    net: NetStats,
    rpc: RpcStats,
    mesh: MeshStats,
    rounds: u64,
    sleeps: u64,
    /// Driver stalls of 250 ms or more, and the longest (ms).
    stalls: (u64, u64),
    connected_nodes: u64,
    pending_requests: u64,
    backlog_bytes: u64,
    rails: RailStates,
    /// Requests forwarded to each other shard, not completed.
    lanes: Vec<(ShardId, usize)>,
    pool_in_use: u64,
    pool_registered: u64,
    /// Round trips of the calls this shard made, per function.
    latency: Vec<Latency>,
}

/// What the shards publish and the server reads: the latest snapshot of each shard.
#[derive(Debug, Default)]
pub(crate) struct Board {
    shards: Mutex<BTreeMap<usize, Snapshot>>,
    addr: std::sync::OnceLock<SocketAddr>,
}

impl Board {
    pub(crate) fn set_addr(&self, addr: SocketAddr) {
        let _ = self.addr.set(addr);
    }

    pub(crate) fn addr(&self) -> Option<SocketAddr> {
        self.addr.get().copied()
    }

    fn publish(&self, shard: usize, s: Snapshot) {
        if let Ok(mut m) = self.shards.lock() {
            m.insert(shard, s);
        }
    }

    fn snapshots(&self) -> Vec<(usize, Snapshot)> {
        self.shards
            .lock()
            .map(|m| m.iter().map(|(k, v)| (*k, v.clone())).collect())
            .unwrap_or_default()
    }
}

/// Copies shard `ctx`'s figures into `board` now and then, for as long as the shard lives (a
/// detached task of the shard; it holds the shard weakly).
pub(crate) fn spawn_publisher(
    ctx: &Rc<ShardCtx>,
    board: Arc<Board>,
    rpc: impl Fn() -> (RpcStats, Vec<Latency>) + 'static,
) {
    let weak: Weak<ShardCtx> = Rc::downgrade(ctx);
    glommio::spawn_local(async move {
        loop {
            {
                let Some(ctx) = weak.upgrade() else { return };
                board.publish(ctx.id().index(), snapshot(&ctx, rpc()));
            }
            glommio::timer::sleep(PUBLISH_INTERVAL).await;
        }
    })
    .detach();
}

fn snapshot(ctx: &ShardCtx, (rpc, latency): (RpcStats, Vec<Latency>)) -> Snapshot {
    let pool = ctx.pool();
    Snapshot {
        at: Instant::now(),
        net: ctx.net_stats(),
        rpc,
        latency,
        rails: ctx.rail_states(),
        lanes: ctx.lanes_in_flight(),
        mesh: ctx.mesh_stats(),
        rounds: ctx.progress_rounds(),
        sleeps: ctx.driver_sleeps(),
        stalls: ctx.driver_stalls(),
        connected_nodes: ctx.connected_nodes().len() as u64,
        pending_requests: ctx.pending_requests() as u64,
        backlog_bytes: ctx.backlog_total(),
        pool_in_use: pool.bytes_in_use(),
        pool_registered: pool.memory().len() as u64,
    }
}

/// `(value, count)` pairs as series labelled `label`.
fn labelled(label: &'static str, pairs: &[(&'static str, u64)]) -> Series {
    pairs.iter().map(|(v, n)| (Some((label, *v)), *n)).collect()
}

/// A traffic counter array as series labelled by `kind`.
fn traffic(by: &[u64; Traffic::COUNT]) -> Series {
    Traffic::ALL
        .iter()
        .map(|t| (Some(("kind", t.name())), by[*t as usize]))
        .collect()
}

/// The collector the registry calls on each scrape: every family, one series per shard (and
/// label value).
#[derive(Debug)]
struct ShardsCollector(Arc<Board>);

/// One family: its name, help, type, and for each shard its `(extra label, value)` series.
type Series = Vec<(Option<(&'static str, &'static str)>, u64)>;

fn family(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    kind: MetricType,
    shards: &[(usize, Series)],
) -> Result<(), std::fmt::Error> {
    let mut metric = encoder.encode_descriptor(name, help, None, kind)?;
    for (shard, series) in shards {
        for (extra, value) in series {
            let mut labels = vec![("shard", shard.to_string())];
            if let Some((k, v)) = extra {
                labels.push((k, (*v).to_string()));
            }
            let fam = metric.encode_family(&labels)?;
            match kind {
                MetricType::Counter => ConstCounter::new(*value).encode(fam)?,
                _ => ConstGauge::new(i64::try_from(*value).unwrap_or(i64::MAX)).encode(fam)?,
            }
        }
    }
    Ok(())
}

/// A gauge family in seconds (a float), one series per shard.
fn seconds_family(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    snaps: &[(usize, Snapshot)],
    secs: impl Fn(&Snapshot) -> f64,
) -> Result<(), std::fmt::Error> {
    let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (shard, snap) in snaps {
        let labels = [("shard", shard.to_string())];
        ConstGauge::new(secs(snap)).encode(metric.encode_family(&labels)?)?;
    }
    Ok(())
}

impl Collector for ShardsCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        use MetricType::{Counter, Gauge};
        let snaps = self.0.snapshots();
        let now = Instant::now();
        let per = |f: &dyn Fn(&Snapshot) -> Series| -> Vec<(usize, Series)> {
            snaps.iter().map(|(i, s)| (*i, f(s))).collect()
        };
        let one = |f: fn(&Snapshot) -> u64| per(&|s| vec![(None, f(s))]);
        family(
            &mut encoder,
            "shardcx_frames_delivered",
            "Application frames handed to handlers.",
            Counter,
            &one(|s| s.net.delivered),
        )?;
        family(
            &mut encoder,
            "shardcx_frames_dispatched_in_callback",
            "Application frames with eager data dispatched inside UCX's receive callback (of those delivered).",
            Counter,
            &one(|s| s.net.dispatched_in_callback),
        )?;
        family(
            &mut encoder,
            "shardcx_frames_sent",
            "Application frames sent, by path: in place (UCX took them at once), posted (owned buffer, no task switch), queued (for the rail's sender task).",
            Counter,
            &per(&|s| {
                labelled(
                    "path",
                    &[
                        ("in_place", s.net.sent_in_place),
                        ("posted", s.net.sent_posted),
                        ("queued", s.net.sent_queued),
                    ],
                )
            }),
        )?;
        family(
            &mut encoder,
            "shardcx_sends_paced",
            "Sends from a task that found UCX's send queue full and waited for room (NetConfig::send_pace), by outcome: taken (in place, counted there too), gave_up (then posted or queued).",
            Counter,
            &per(&|s| {
                labelled(
                    "outcome",
                    &[
                        ("taken", s.net.sends_paced),
                        ("gave_up", s.net.pace_timeouts),
                    ],
                )
            }),
        )?;
        family(
            &mut encoder,
            "shardcx_frames_dropped",
            "Frames dropped, by reason.",
            Counter,
            &per(&|s| {
                let n = &s.net;
                labelled("reason", &n.dropped_by_reason())
            }),
        )?;
        family(
            &mut encoder,
            "shardcx_rendezvous_received",
            "Frames received by rendezvous, by where their data went.",
            Counter,
            &per(&|s| {
                let n = &s.net;
                labelled(
                    "into",
                    &[
                        ("pool", n.rndv_pooled),
                        ("recycled", n.rndv_recycled),
                        ("allocated", n.rndv_allocated),
                        ("declined", n.declined),
                    ],
                )
            }),
        )?;
        family(
            &mut encoder,
            "shardcx_rendezvous_pulls_waited",
            "Rendezvous pulls into the runtime's buffers that waited for the same rail's earlier ones.",
            Counter,
            &one(|s| s.net.rndv_pulls_waited),
        )?;
        family(
            &mut encoder,
            "shardcx_handler_panics",
            "Handler calls that panicked (the frame is dropped, the shard goes on).",
            Counter,
            &one(|s| s.net.handler_panics),
        )?;
        family(
            &mut encoder,
            "shardcx_handshakes",
            "Pre-shared-key handshakes completed.",
            Counter,
            &one(|s| s.net.handshakes),
        )?;
        family(
            &mut encoder,
            "shardcx_rail_joins",
            "Rails that joined a session.",
            Counter,
            &one(|s| s.net.joins),
        )?;
        family(
            &mut encoder,
            "shardcx_bootstraps",
            "Connections to the listener's port (on the listening shard), by outcome: served the directory, refused (not a bootstrap request: garbage, a foreign client), timed out (silent), over the half-open cap.",
            Counter,
            &per(&|s| {
                let n = &s.net;
                labelled(
                    "outcome",
                    &[
                        ("served", n.bootstraps_served),
                        ("refused", n.bootstraps_refused),
                        ("timed_out", n.bootstraps_timed_out),
                        ("over_cap", n.bootstraps_over_cap),
                    ],
                )
            }),
        )?;
        family(
            &mut encoder,
            "shardcx_openings_over_cap",
            "Hellos dropped unanswered: the shard had max_half_open handshakes under way.",
            Counter,
            &one(|s| s.net.openings_over_cap),
        )?;
        family(
            &mut encoder,
            "shardcx_handshakes_expired",
            "Rails opened by a peer whose handshake did not complete in time (endpoint closed).",
            Counter,
            &one(|s| s.net.handshakes_expired),
        )?;
        family(
            &mut encoder,
            "shardcx_pending_openings",
            "Hellos for a ready rail, answered beside it: a peer's restart or reconnect, or anyone naming it (those that completed count as handshakes).",
            Counter,
            &one(|s| s.net.pending_openings),
        )?;
        family(
            &mut encoder,
            "shardcx_pending_openings_closed",
            "Pending openings closed without replacing their rail, by outcome: refused (failed handshake, superseded), expired (at the handshake deadline).",
            Counter,
            &per(&|s| {
                let n = &s.net;
                labelled(
                    "outcome",
                    &[
                        ("refused", n.pending_refused),
                        ("expired", n.pending_expired),
                    ],
                )
            }),
        )?;
        family(
            &mut encoder,
            "shardcx_rail_join_retries",
            "Joins tried again (the peer did not know the session yet).",
            Counter,
            &one(|s| s.net.join_retries),
        )?;
        family(
            &mut encoder,
            "shardcx_rpc_calls",
            "RPC requests served on this shard, by outcome.",
            Counter,
            &per(&|s| {
                let r = &s.rpc;
                labelled(
                    "outcome",
                    &[
                        ("served", r.served),
                        ("one_way", r.one_way),
                        ("failed", r.failed),
                        ("panicked", r.panicked),
                        ("unknown_function", r.unknown_function),
                        ("schema_mismatch", r.schema_mismatch),
                        ("malformed", r.malformed),
                        ("too_large", r.too_large),
                        ("too_old", r.too_old),
                        ("expired", r.expired),
                        ("cancelled", r.cancelled),
                        ("replayed", r.replayed),
                        ("duplicate_dropped", r.duplicates_dropped),
                    ],
                )
            }),
        )?;
        family(
            &mut encoder,
            "shardcx_rpc_cancels_sent",
            "Cancel frames sent for RPC calls given up before their reply.",
            Counter,
            &one(|s| s.net.cancels_sent),
        )?;
        family(
            &mut encoder,
            "shardcx_mesh_taken",
            "Cross-shard lane messages taken, by who took them (the progress driver, or the inbox task after a wake-up).",
            Counter,
            &per(&|s| {
                labelled(
                    "by",
                    &[
                        ("driver", s.mesh.taken_by_driver),
                        ("task", s.mesh.taken_by_task),
                    ],
                )
            }),
        )?;
        family(
            &mut encoder,
            "shardcx_driver_rounds",
            "Progress driver rounds.",
            Counter,
            &one(|s| s.rounds),
        )?;
        family(
            &mut encoder,
            "shardcx_driver_sleeps",
            "Times the idle progress driver went to sleep.",
            Counter,
            &one(|s| s.sleeps),
        )?;
        family(
            &mut encoder,
            "shardcx_driver_stalls",
            "Times the progress driver was not polled for 250 ms or more (each is logged).",
            Counter,
            &one(|s| s.stalls.0),
        )?;
        family(
            &mut encoder,
            "shardcx_dispatch_budget_hits",
            "Dispatch rounds cut at the budget with inputs left (a flood).",
            Counter,
            &one(|s| s.net.dispatch_budget_hits),
        )?;
        family(
            &mut encoder,
            "shardcx_dispatch_preempted",
            "Dispatches cut short for the executor's timers and I/O (slow handlers).",
            Counter,
            &one(|s| s.net.dispatch_preempted),
        )?;
        family(
            &mut encoder,
            "shardcx_connected_nodes",
            "Nodes this shard has a ready default rail to.",
            Gauge,
            &one(|s| s.connected_nodes),
        )?;
        family(
            &mut encoder,
            "shardcx_pending_requests",
            "Requests of this shard waiting for a reply.",
            Gauge,
            &one(|s| s.pending_requests),
        )?;
        family(
            &mut encoder,
            "shardcx_backlog_bytes",
            "Bytes of application frames this shard's rails hold that UCX has not completed (queued, or in flight to a slow or stopped peer).",
            Gauge,
            &one(|s| s.backlog_bytes),
        )?;
        family(
            &mut encoder,
            "shardcx_backlog_peak_bytes",
            "The most bytes one of this shard's rails has held that UCX had not completed.",
            Gauge,
            &one(|s| s.net.backlog_peak_bytes),
        )?;
        family(
            &mut encoder,
            "shardcx_sends_backlogged",
            "Sends refused because their rail held max_backlog_bytes already.",
            Counter,
            &one(|s| s.net.sends_backlogged),
        )?;
        family(
            &mut encoder,
            "shardcx_peers_dropped",
            "Peers this shard dropped for misbehaviour (strike_limit malformed requests within strike_window).",
            Counter,
            &one(|s| s.net.peers_dropped),
        )?;
        family(
            &mut encoder,
            "shardcx_refused_banned",
            "Handshakes refused because their node was dropped and is still banned.",
            Counter,
            &one(|s| s.net.refused_banned),
        )?;
        family(
            &mut encoder,
            "shardcx_forwards",
            "Requests this shard forwarded to another shard (a hop through a cross-shard lane).",
            Counter,
            &one(|s| s.mesh.forwarded),
        )?;
        let mut lanes = encoder.encode_descriptor(
            "shardcx_lane_in_flight",
            "Requests this shard forwarded to shard `to` that have not completed (its lane's depth).",
            None,
            Gauge,
        )?;
        for (shard, snap) in &snaps {
            for (to, n) in &snap.lanes {
                let labels = [("shard", shard.to_string()), ("to", to.get().to_string())];
                ConstGauge::new(i64::try_from(*n).unwrap_or(i64::MAX))
                    .encode(lanes.encode_family(&labels)?)?;
            }
        }
        family(
            &mut encoder,
            "shardcx_rails",
            "This shard's rails to other nodes' shards, by state (and the pending openings beside ready rails: a peer's restart or reconnect under way).",
            Gauge,
            &per(&|s| {
                let r = &s.rails;
                labelled(
                    "state",
                    &[
                        ("connecting", r.connecting as u64),
                        ("ready", r.ready as u64),
                        ("draining", r.draining as u64),
                        ("closing", r.closing as u64),
                        ("pending_opening", r.pending_openings as u64),
                    ],
                )
            }),
        )?;
        family(
            &mut encoder,
            "shardcx_heartbeat_misses",
            "Times a peer went silent on a rail for suspect_after heartbeat intervals.",
            Counter,
            &one(|s| s.net.heartbeat_misses),
        )?;
        family(
            &mut encoder,
            "shardcx_peers_dead",
            "Rails whose peer stayed silent for dead_after heartbeat intervals and was declared dead.",
            Counter,
            &one(|s| s.net.peers_dead),
        )?;
        family(
            &mut encoder,
            "shardcx_rails_failed",
            "Rails that failed (handshake, transport error, dead peer).",
            Counter,
            &one(|s| s.net.rails_failed),
        )?;
        family(
            &mut encoder,
            "shardcx_peer_restarts",
            "Sessions replaced by a peer's restart (a new incarnation).",
            Counter,
            &one(|s| s.net.peer_restarts),
        )?;
        family(
            &mut encoder,
            "shardcx_reconnects",
            "Connects made by the node itself to a known peer address when an operation found no session, by outcome.",
            Counter,
            &per(&|s| {
                labelled(
                    "outcome",
                    &[
                        ("ok", s.net.reconnects),
                        ("failed", s.net.reconnects_failed),
                    ],
                )
            }),
        )?;
        family(
            &mut encoder,
            "shardcx_messages_in",
            "Application frames received on this shard's rails and handed on, by kind (am, tag, rpc, rma).",
            Counter,
            &per(&|s| traffic(&s.net.frames_in)),
        )?;
        family(
            &mut encoder,
            "shardcx_bytes_in",
            "Payload bytes of those frames, by kind.",
            Counter,
            &per(&|s| traffic(&s.net.bytes_in)),
        )?;
        family(
            &mut encoder,
            "shardcx_messages_out",
            "Application frames sent from this shard, by kind (am, tag, rpc, rma).",
            Counter,
            &per(&|s| traffic(&s.net.frames_out)),
        )?;
        family(
            &mut encoder,
            "shardcx_bytes_out",
            "Payload bytes of those frames, by kind.",
            Counter,
            &per(&|s| traffic(&s.net.bytes_out)),
        )?;
        let mut calls = encoder.encode_descriptor(
            "shardcx_rpc_call_seconds",
            "Round trips of the RPC calls this shard made, per function (errors and timeouts included).",
            None,
            MetricType::Histogram,
        )?;
        for (shard, snap) in &snaps {
            for l in &snap.latency {
                let labels = [
                    ("shard", shard.to_string()),
                    ("function", l.id.to_string()),
                    ("name", l.name.clone()),
                ];
                calls.encode_family(&labels)?.encode_histogram(
                    l.sum,
                    l.count,
                    &l.by_bound(),
                    None::<&std::collections::HashMap<usize, Exemplar<Vec<(String, String)>, f64>>>,
                )?;
            }
        }
        family(
            &mut encoder,
            "shardcx_pool_bytes_in_use",
            "Bytes of the shard's registered pool in use.",
            Gauge,
            &one(|s| s.pool_in_use),
        )?;
        family(
            &mut encoder,
            "shardcx_pool_registered_bytes",
            "Bytes of the shard's registered pool.",
            Gauge,
            &one(|s| s.pool_registered),
        )?;
        seconds_family(
            &mut encoder,
            "shardcx_metrics_age_seconds",
            "How old this shard's published figures are.",
            &snaps,
            |snap| now.saturating_duration_since(snap.at).as_secs_f64(),
        )?;
        seconds_family(
            &mut encoder,
            "shardcx_driver_stall_longest_seconds",
            "The longest time the progress driver was not polled (of the stalls counted).",
            &snaps,
            |snap| snap.stalls.1 as f64 / 1000.0,
        )?;
        Ok(())
    }
}

/// Why the metrics endpoint could not start.
#[derive(Debug, thiserror::Error)]
#[error("cannot serve metrics on {addr}: {reason}")]
pub struct MetricsError {
    /// The address asked for.
    pub addr: SocketAddr,
    /// What went wrong.
    pub reason: String,
}

/// The HTTP server thread: `GET /metrics` (anything else: 404). Stopped and joined on drop.
pub(crate) struct Server {
    http: Arc<tiny_http::Server>,
    thread: Option<JoinHandle<()>>,
    addr: SocketAddr,
}

impl Server {
    /// Binds `addr` (port 0 picks one) and serves `board` until dropped.
    pub(crate) fn start(addr: SocketAddr, board: Arc<Board>) -> Result<Server, MetricsError> {
        let http = tiny_http::Server::http(addr).map_err(|e| MetricsError {
            addr,
            reason: e.to_string(),
        })?;
        let bound = http.server_addr().to_ip().ok_or_else(|| MetricsError {
            addr,
            reason: "not an IP listener".into(),
        })?;
        let http = Arc::new(http);
        let serving = http.clone();
        let thread = std::thread::Builder::new()
            .name("shardcx-metrics".into())
            .spawn(move || serve(&serving, board))
            .map_err(|e| MetricsError {
                addr,
                reason: format!("cannot start its thread: {e}"),
            })?;
        Ok(Server {
            http,
            thread: Some(thread),
            addr: bound,
        })
    }

    /// The bound address.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.http.unblock();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The OpenMetrics text of `board`.
fn render(board: &Arc<Board>) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(ShardsCollector(board.clone())));
    let mut text = String::new();
    if prometheus_client::encoding::text::encode(&mut text, &registry).is_err() {
        text = "# EOF\n".into();
    }
    text
}

/// The same figures in the Prometheus text format 0.0.4, for clients that do not ask for
/// OpenMetrics (`curl`, `promtool check metrics`): a counter family is named with its `_total`
/// suffix, as its samples are, and the OpenMetrics-only lines (`# UNIT`, `# EOF`) go.
fn to_prometheus_text(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len() + 64 * counters.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|p| {
            let rest = line.strip_prefix(p)?;
            let (name, tail) = rest.split_once(' ')?;
            counters
                .contains(name)
                .then(|| format!("{p}{name}_total {tail}"))
        });
        match renamed {
            Some(l) => out.push_str(&l),
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

fn serve(http: &tiny_http::Server, board: Arc<Board>) {
    for request in http.incoming_requests() {
        let response = if request.url() == "/metrics" || request.url().starts_with("/metrics?") {
            let openmetrics = request.headers().iter().any(|h| {
                h.field.equiv("Accept") && h.value.as_str().contains("application/openmetrics-text")
            });
            let (body, content_type) = if openmetrics {
                (
                    render(&board),
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                )
            } else {
                (
                    to_prometheus_text(&render(&board)),
                    "text/plain; version=0.0.4; charset=utf-8",
                )
            };
            let header =
                tiny_http::Header::from_bytes(&b"Content-Type"[..], content_type.as_bytes());
            let mut r = tiny_http::Response::from_string(body);
            if let Ok(h) = header {
                r.add_header(h);
            }
            r
        } else {
            tiny_http::Response::from_string("shardcx: metrics are at /metrics\n")
                .with_status_code(404)
        };
        // A client that went away is its own business.
        let _ = request.respond(response);
    }
}
