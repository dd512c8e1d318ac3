//! Printing results: the table (one per test) and the JSON file (schema in [`crate::bench`]).

use std::fmt::Write as _;

use super::{format_size, Figures, Measurement, Test};

/// The results as tables, one per test, in the order the tests first appear in `results`.
pub fn table(results: &[Measurement]) -> String {
    let mut out = String::new();
    let mut tests: Vec<Test> = Vec::new();
    for m in results {
        if !tests.contains(&m.test) {
            tests.push(m.test);
        }
    }
    for test in tests {
        let _ = writeln!(
            out,
            "\n{test}: latency in µs ({}), hdrhistogram",
            test.sample()
        );
        let _ = writeln!(
            out,
            "{:>6} {:<5} {:>6} {:<5} {:<9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>12} {:>10}",
            "size",
            "tls",
            "shards",
            "shard",
            "route",
            "iters",
            "p50",
            "p99",
            "p99.9",
            "max",
            "msgs/s",
            "MB/s"
        );
        for m in results.iter().filter(|m| m.test == test) {
            let lead = format!(
                "{:>6} {:<5} {:>6}",
                format_size(m.size),
                m.transport.name(),
                m.shards
            );
            if let Some(why) = &m.skipped {
                let _ = writeln!(out, "{lead} skipped: {why}");
                continue;
            }
            for s in &m.per_shard {
                row(
                    &mut out,
                    &lead,
                    &s.shard.to_string(),
                    s.route.name(),
                    &s.figures,
                );
            }
            if m.per_shard.len() > 1 {
                row(&mut out, &lead, "all", "", &m.merged());
            }
        }
    }
    out
}

fn row(out: &mut String, lead: &str, shard: &str, route: &str, f: &Figures) {
    let _ = writeln!(
        out,
        "{lead} {shard:<5} {route:<9} {:>9} {:>9.2} {:>9.2} {:>9.2} {:>10.2} {:>12.0} {:>10.1}",
        f.iters(),
        f.quantile_us(0.5),
        f.quantile_us(0.99),
        f.quantile_us(0.999),
        f.max_us(),
        f.msgs_per_s(),
        f.mb_per_s()
    );
}

/// The results as the JSON array documented in [`crate::bench`] (skipped ones left out).
pub fn json(results: &[Measurement]) -> String {
    let mut out = String::from("[\n");
    let mut first = true;
    for m in results.iter().filter(|m| m.skipped.is_none()) {
        if !first {
            out.push_str(",\n");
        }
        first = false;
        let merged = m.merged();
        let _ = write!(
            out,
            "  {{\"test\": \"{}\", \"size\": {}, \"shards\": {}, \"transport\": \"{}\", {}, \
             \"per_shard\": [",
            m.test.name(),
            m.size,
            m.shards,
            m.transport.name(),
            fields(&merged)
        );
        for (i, s) in m.per_shard.iter().enumerate() {
            let _ = write!(
                out,
                "{}{{\"shard\": {}, \"route\": \"{}\", {}}}",
                if i == 0 { "" } else { ", " },
                s.shard.get(),
                s.route.name(),
                fields(&s.figures)
            );
        }
        out.push_str("]}");
    }
    out.push_str("\n]\n");
    out
}

fn fields(f: &Figures) -> String {
    format!(
        "\"iters\": {}, \"p50_us\": {}, \"p99_us\": {}, \"p999_us\": {}, \"max_us\": {}, \
         \"msgs_per_s\": {}, \"mb_per_s\": {}",
        f.iters(),
        num(f.quantile_us(0.5)),
        num(f.quantile_us(0.99)),
        num(f.quantile_us(0.999)),
        num(f.max_us()),
        num(f.msgs_per_s()),
        num(f.mb_per_s())
    )
}

/// A JSON number (finite; 3 decimals are more than the histogram's precision).
fn num(x: f64) -> String {
    if x.is_finite() {
        format!("{:.3}", x)
    } else {
        "0".into()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;
    use crate::bench::{Route, ShardFigures, Transport};
    use shardcx_shards::proto::ShardId;
    use std::time::Duration;

    fn sample() -> Vec<Measurement> {
        let mut f = Figures::new(8);
        for v in [1000u64, 2000, 3000, 100_000] {
            f.hist.record(v).unwrap();
        }
        f.msgs = 4;
        f.elapsed = Duration::from_millis(1);
        vec![
            Measurement {
                test: Test::AmLat,
                size: 8,
                shards: 2,
                transport: Transport::Shm,
                per_shard: vec![
                    ShardFigures {
                        shard: ShardId::new(0),
                        route: Route::Rail,
                        figures: f.clone(),
                    },
                    ShardFigures {
                        shard: ShardId::new(1),
                        route: Route::Hop,
                        figures: f,
                    },
                ],
                skipped: None,
            },
            Measurement {
                test: Test::Hop,
                size: 0,
                shards: 1,
                transport: Transport::Shm,
                per_shard: vec![],
                skipped: Some("needs --shards 2 or more".into()),
            },
        ]
    }

    #[test]
    fn table_has_per_shard_and_merged_rows_and_says_what_was_skipped() {
        let t = table(&sample());
        assert!(t.contains("am-lat: latency in µs (round trip)"));
        assert_eq!(t.lines().filter(|l| l.contains(" shm ")).count(), 4);
        assert!(t.contains(" all "));
        assert!(t.contains("skipped: needs --shards 2 or more"));
    }

    #[test]
    fn json_has_the_documented_fields() {
        let j = json(&sample());
        for field in [
            "\"test\": \"am-lat\"",
            "\"size\": 8",
            "\"shards\": 2",
            "\"transport\": \"shm\"",
            "\"iters\": 8",
            "\"p50_us\": 2.",
            "\"p99_us\"",
            "\"p999_us\"",
            "\"max_us\": 100.",
            "\"msgs_per_s\": 8000.000",
            "\"mb_per_s\": 0.064",
            "\"route\": \"rail\"",
            "\"route\": \"hop\"",
        ] {
            assert!(j.contains(field), "{field} missing in {j}");
        }
        assert!(
            !j.contains("\"test\": \"hop\""),
            "skipped results are left out"
        );
    }
}
