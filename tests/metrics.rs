//! The metrics endpoint of `shardcx node --metrics`: scraped over HTTP by a real client,
//! checked by `promtool check metrics` (installed by `scripts/setup`), and its counters move
//! when a bench runs against the node.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // A test may panic: a panic is a failure it reports.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

mod common;
use common::{shardcx, NodeProc};

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
        if total(&after, "shardcx_frames_delivered_total") >= 2 * 2 * 200 {
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

    // Anything but /metrics: 404.
    let err = ureq::get(&format!("http://{metrics}/")).call().unwrap_err();
    assert!(matches!(err, ureq::Error::Status(404, _)), "{err}");
}
