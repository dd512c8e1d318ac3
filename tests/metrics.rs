//! The metrics endpoint of `shardcx node --metrics`: scraped over HTTP by a real client,
//! checked by `promtool check metrics` (installed by `scripts/setup`), and its counters move
//! when a bench runs against the node.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // A test may panic: a panic is a failure it reports.

use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use shardcx::proto::NodeId;
use shardcx::rpc::RpcContext;
use shardcx::{rpc_function, Node};

mod common;
use common::{shardcx, two_shard_node, NodeProc};

rpc_function!(Echo: String => String, id = 1, name = "test.echo");

fn scrape(addr: &str) -> String {
    let r = ureq::get(&format!("http://{addr}/metrics"))
        .timeout(Duration::from_secs(10))
        .call()
        .unwrap();
    assert!(
        r.content_type().starts_with("text/plain"),
        "{}",
        r.content_type()
    );
    r.into_string().unwrap()
}

/// The sum over shards of the series `name` (with labels, or none).
fn total(text: &str, name: &str) -> u64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap() as u64)
        .sum()
}

fn promtool_check(text: &str) {
    let mut p = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool is missing: scripts/setup installs it (Debian package `prometheus`)");
    p.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = p.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics failed:\n{}{}\n--- the text:\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_node_serves_metrics_that_promtool_accepts_and_that_move() {
    let node = NodeProc::start(2, &["--metrics", "127.0.0.1:0"], false);
    let metrics = node.metrics.unwrap().to_string();
    let before = scrape(&metrics);
    promtool_check(&before);
    for family in [
        "shardcx_frames_delivered_total",
        "shardcx_frames_sent_total",
        "shardcx_sends_paced_total",
        "shardcx_rendezvous_pulls_waited_total",
        "shardcx_frames_dropped_total",
        "shardcx_rpc_calls_total",
        "shardcx_driver_rounds_total",
        "shardcx_pool_registered_bytes",
        "shardcx_metrics_age_seconds",
    ] {
        assert!(
            before.contains(&format!("{family}{{shard=\"1\"")),
            "{family} of shard 1 missing:\n{before}"
        );
    }
    assert_eq!(total(&before, "shardcx_frames_delivered_total"), 0);

    // A short bench from another process: every client shard on its own rail.
    let out = shardcx()
        .args([
            "bench",
            "--connect",
            &node.addr.to_string(),
            "--transport",
            "tcp",
        ])
        .args([
            "--test",
            "am-lat,rpc-lat",
            "--iters",
            "200",
            "--warmup",
            "10",
        ])
        .args(["--shards", "2"])
        .output()
        .unwrap();
    assert!(out.status.success(), "bench failed: {out:?}");

    // The shards publish every 250 ms: wait for figures at least that fresh.
    let mut after = String::new();
    for _ in 0..40 {
        std::thread::sleep(Duration::from_millis(100));
        after = scrape(&metrics);
        // Every figure the test checks must be fresh: shards publish on
        // their own clocks, so one can be up to date while another is not.
        if total(&after, "shardcx_frames_delivered_total") >= 2 * 2 * 200
            && total(&after, "shardcx_frames_sent_total") >= 2 * 200
            && total(&after, "shardcx_rpc_calls_total") >= 2 * 200
        {
            break;
        }
    }
    promtool_check(&after);
    let delivered = total(&after, "shardcx_frames_delivered_total");
    assert!(delivered >= 2 * 2 * 200, "delivered {delivered}:\n{after}");
    assert!(
        total(&after, "shardcx_frames_sent_total") >= 2 * 200,
        "{after}"
    );
    assert!(
        total(&after, "shardcx_rpc_calls_total") >= 2 * 200,
        "{after}"
    );
    assert!(total(&after, "shardcx_handshakes_total") >= 1, "{after}");
    assert!(
        total(&after, "shardcx_driver_rounds_total")
            > total(&before, "shardcx_driver_rounds_total"),
        "{after}"
    );
    // Both server shards took part (each client shard has its own rail).
    for shard in ["0", "1"] {
        let line = after
            .lines()
            .find(|l| {
                l.starts_with(&format!(
                    "shardcx_frames_delivered_total{{shard=\"{shard}\"}}"
                ))
            })
            .unwrap();
        let n: u64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        assert!(n >= 200, "{line}");
    }

    // Traffic by kind: the server took the am-lat pings and the rpc-lat requests in, and sent
    // pongs and replies out, with their payload bytes.
    let kind = |name: &str, kind: &str| {
        after
            .lines()
            .filter(|l| {
                l.starts_with(&format!("{name}{{")) && l.contains(&format!("kind=\"{kind}\""))
            })
            .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
            .sum::<u64>()
    };
    for k in ["am", "rpc"] {
        assert!(
            kind("shardcx_messages_in_total", k) >= 2 * 200,
            "{k}:\n{after}"
        );
        assert!(
            kind("shardcx_messages_out_total", k) >= 2 * 200,
            "{k}:\n{after}"
        );
        assert!(
            kind("shardcx_bytes_in_total", k) >= 2 * 200 * 8,
            "{k}:\n{after}"
        );
    }
    assert_eq!(kind("shardcx_messages_in_total", "rma"), 0, "{after}");
    assert!(
        after.contains("shardcx_rails{shard=\"0\",state=\"ready\"}"),
        "{after}"
    );
    assert!(
        after.contains("shardcx_lane_in_flight{shard=\"0\",to=\"1\"} 0"),
        "{after}"
    );

    // A scraper that asks for OpenMetrics (as Prometheus does) gets it: counter families named
    // without `_total`, and the closing `# EOF`.
    let om = ureq::get(&format!("http://{metrics}/metrics"))
        .set("Accept", "application/openmetrics-text; version=1.0.0")
        .timeout(Duration::from_secs(10))
        .call()
        .unwrap();
    assert!(
        om.content_type()
            .starts_with("application/openmetrics-text"),
        "{}",
        om.content_type()
    );
    let om = om.into_string().unwrap();
    assert!(om.ends_with("# EOF\n"), "{om}");
    assert!(
        om.contains("# TYPE shardcx_frames_delivered counter\n"),
        "{om}"
    );

    // Anything but /metrics: 404.
    let err = ureq::get(&format!("http://{metrics}/")).call().unwrap_err();
    assert!(matches!(err, ureq::Error::Status(404, _)), "{err}");
}

/// A client node's own metrics: a histogram of its RPC calls' round trips per function (every
/// call counted once, the buckets cumulative), and promtool accepts it all.
#[test]
fn rpc_calls_are_timed_per_function() {
    const CALLS: u64 = 50;
    let (tx, rx) = mpsc::channel();
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let server = std::thread::spawn(move || {
        two_shard_node(NodeId::new(1), b"metrics test key, 16+ bytes")
            .listen("127.0.0.1:0".parse().unwrap())
            .rpc::<Echo, _, _>(|| {
                |_: &RpcContext, s: &rkyv::Archived<String>| Ok(s.as_str().to_owned())
            })
            .run(move |node: Node| {
                let (tx, stop) = (tx.clone(), stop2.clone());
                async move {
                    if let Some(a) = node.listen_addr() {
                        let _ = tx.send(a);
                    }
                    let until = Instant::now() + Duration::from_secs(60);
                    while !stop.load(Ordering::Acquire) && Instant::now() < until {
                        glommio::timer::sleep(Duration::from_millis(5)).await;
                    }
                }
            })
            .unwrap();
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("server did not start");
    let texts = two_shard_node(NodeId::new(2), b"metrics test key, 16+ bytes")
        .metrics("127.0.0.1:0".parse().unwrap())
        .run(move |node: Node| async move {
            let peer = node.connect(addr).await.expect("connect");
            // Every shard calls on its own rail.
            let rpc = node.rpc();
            for i in 0..CALLS {
                let got = rpc
                    .call::<Echo>(peer, &format!("call {i}"))
                    .await
                    .expect("call");
                assert_eq!(got, format!("call {i}"));
            }
            if node.shard().get() != 0 {
                return None;
            }
            // Published every 250 ms: wait until both shards' figures count every call.
            let metrics = node.metrics_addr().expect("metrics address").to_string();
            let until = Instant::now() + Duration::from_secs(10);
            loop {
                glommio::timer::sleep(Duration::from_millis(100)).await;
                let text = scrape(&metrics);
                if total(&text, "shardcx_rpc_call_seconds_count") >= 2 * CALLS
                    || Instant::now() > until
                {
                    return Some(text);
                }
            }
        })
        .unwrap();
    stop.store(true, Ordering::Release);
    server.join().expect("server panicked");
    let text = texts.into_iter().flatten().next().expect("shard 0 scraped");
    promtool_check(&text);
    assert_eq!(
        total(&text, "shardcx_rpc_call_seconds_count"),
        2 * CALLS,
        "{text}"
    );
    for shard in ["0", "1"] {
        let series = format!("shard=\"{shard}\",function=\"1\",name=\"test.echo\"");
        let inf = text
            .lines()
            .find(|l| {
                l.starts_with("shardcx_rpc_call_seconds_bucket")
                    && l.contains(&series)
                    && l.contains("le=\"+Inf\"")
            })
            .unwrap_or_else(|| panic!("no +Inf bucket of shard {shard}:\n{text}"));
        assert!(inf.ends_with(&format!(" {CALLS}")), "{inf}");
        let sum = text
            .lines()
            .find(|l| l.starts_with(&format!("shardcx_rpc_call_seconds_sum{{{series}}}")))
            .unwrap();
        let secs: f64 = sum.rsplit(' ').next().unwrap().parse().unwrap();
        assert!(secs > 0.0 && secs < 60.0, "{sum}");
    }
    assert!(
        total(&text, "shardcx_messages_out_total") >= 2 * CALLS,
        "{text}"
    );
}
