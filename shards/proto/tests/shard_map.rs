//! ShardMap measurements (issue #3, item 2): balance and movement over 10,000 peers, plus golden
//! values that pin the hash across builds and platforms.

// Tests may unwrap: a panic is a test failure with a message.
#![allow(clippy::unwrap_used)]

use shardcx_proto::shard_map::{siphash24, weight};
use shardcx_proto::{NodeId, ShardId, ShardMap};

const PEERS: u64 = 10_000;

/// Peer ids as an operator might assign them: some sequential, some scattered.
fn peer(i: u64) -> NodeId {
    if i % 2 == 0 {
        NodeId::new(i)
    } else {
        NodeId::new(i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }
}

fn owners(n: u16) -> Vec<u16> {
    let m = ShardMap::new(n).unwrap();
    (0..PEERS).map(|i| m.owner_of(peer(i)).get()).collect()
}

#[test]
fn golden_values() {
    assert_eq!(weight(NodeId::new(0), ShardId::new(0)), GOLDEN_W00);
    assert_eq!(weight(NodeId::new(1), ShardId::new(7)), GOLDEN_W17);
    assert_eq!(siphash24(1, 2, b"shardcx"), GOLDEN_SIP);
    let m = ShardMap::new(8).unwrap();
    let got: Vec<u16> = (0..16).map(|i| m.owner_of(NodeId::new(i)).get()).collect();
    assert_eq!(got, GOLDEN_OWNERS_8);
    let m = ShardMap::new(64).unwrap();
    let got: Vec<u16> = [1u64, 42, 1 << 40, u64::MAX]
        .iter()
        .map(|&i| m.owner_of(NodeId::new(i)).get())
        .collect();
    assert_eq!(got, GOLDEN_OWNERS_64);
}

#[test]
fn balance_over_10k_peers() {
    let mut worst = 0.0f64;
    let mut report = Vec::new();
    for n in 1..=64u16 {
        let mut load = vec![0u64; usize::from(n)];
        for o in owners(n) {
            load[usize::from(o)] += 1;
        }
        let mean = PEERS as f64 / f64::from(n);
        let max = *load.iter().max().unwrap() as f64;
        let min = *load.iter().min().unwrap() as f64;
        let var = load.iter().map(|&l| (l as f64 - mean).powi(2)).sum::<f64>() / f64::from(n);
        // Random placement gives a standard deviation of about sqrt(mean): the hash should too.
        let cv_ratio = if n > 1 {
            var.sqrt() / (mean * (1.0 - 1.0 / f64::from(n))).sqrt()
        } else {
            0.0
        };
        worst = worst.max(max / mean);
        report.push((n, max / mean, min / mean, cv_ratio));
        assert!(max / mean <= 1.30, "n={n}: max/mean {}", max / mean);
        assert!(min / mean >= 0.70, "n={n}: min/mean {}", min / mean);
        assert!(
            cv_ratio < 1.5,
            "n={n}: spread {cv_ratio} × that of random placement"
        );
    }
    for (n, hi, lo, cv) in report
        .iter()
        .filter(|r| [2, 4, 8, 16, 32, 48, 64].contains(&r.0))
    {
        println!("balance n={n:2}: max/mean {hi:.3}  min/mean {lo:.3}  stddev/binomial {cv:.2}");
    }
    println!("balance worst max/mean over n=1..=64: {worst:.3}");
}

#[test]
fn movement_when_shard_count_changes_by_one() {
    let mut prev = owners(1);
    let mut worst_excess = 0.0f64;
    let mut total_ratio = 0.0;
    for n in 2..=64u16 {
        let cur = owners(n);
        let mut moved = 0u64;
        for (a, b) in prev.iter().zip(&cur) {
            if a != b {
                moved += 1;
                // Growing by one: a peer only ever moves to the new shard.
                assert_eq!(*b, n - 1, "peer moved between old shards");
            }
        }
        let frac = moved as f64 / PEERS as f64;
        let ideal = 1.0 / f64::from(n);
        total_ratio += frac / ideal;
        worst_excess = worst_excess.max((frac - ideal).abs());
        // Binomial noise: 4 standard deviations.
        let tol = 4.0 * (ideal * (1.0 - ideal) / PEERS as f64).sqrt();
        assert!(
            (frac - ideal).abs() <= tol,
            "n={}→{n}: moved {frac:.4}, ideal {ideal:.4}",
            n - 1
        );
        if [2, 4, 8, 16, 32, 64].contains(&n) {
            println!(
                "movement {}→{n}: {frac:.4} moved (ideal 1/{n} = {ideal:.4})",
                n - 1
            );
        }
        // Shrinking by one (n → n-1): only the removed shard's peers move.
        for (a, b) in cur.iter().zip(&prev) {
            if a != b {
                assert_eq!(*a, n - 1, "shrinking moved a peer not on the removed shard");
            }
        }
        prev = cur;
    }
    println!(
        "movement n→n+1 over n=1..63: mean moved/ideal {:.3}, worst |moved-ideal| {:.4}",
        total_ratio / 63.0,
        worst_excess
    );
}

// Pinned outputs. The SipHash implementation itself is checked against the paper's reference
// vector and against std's SipHasher in the unit tests; these pin the weight construction and
// the argmax on top of it. If one of these changes, peers would move between shards across a
// rolling upgrade: that is a wire-compatibility break, not a test to update casually.
const GOLDEN_W00: u64 = 0xa853_ae64_0ea2_934e;
const GOLDEN_W17: u64 = 0xba17_10d6_e2b1_7ceb;
const GOLDEN_SIP: u64 = 0x5560_ee9e_b81d_aa79;
const GOLDEN_OWNERS_8: [u16; 16] = [2, 6, 5, 5, 4, 3, 7, 0, 7, 5, 1, 4, 2, 2, 6, 5];
const GOLDEN_OWNERS_64: [u16; 4] = [44, 27, 23, 14];
