//! Printing results: the table (one per test) and the JSON file (schema in [`crate::bench`]).

use std::fmt::Write as _;

use super::perftest::{Metric, Perftest};
use super::{format_size, Figures, Measurement, Memory, Test};

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
        // The perftest columns, when this test was compared (`--vs-perftest`).
        let compared = results
            .iter()
            .filter(|m| m.test == test)
            .find_map(|m| m.perftest.as_ref().map(|p| p.counterpart));
        let _ = write!(
            out,
            "\n{test}: latency in µs ({}), hdrhistogram",
            test.sample()
        );
        // Device memory (`--memory cuda`), and the client shards' CUDA mode.
        if let Some(m) = results
            .iter()
            .find(|m| m.test == test && m.memory == Memory::Cuda)
        {
            let _ = write!(out, ", {}", memory_note(m));
        }
        let _ = match compared {
            Some(c) => writeln!(
                out,
                "; ucx_perftest {} on client shard 0's row ({}), ratio shardcx/perftest",
                c.test,
                c.metric.unit()
            ),
            None => writeln!(out),
        };
        let _ = write!(
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
        let _ = match compared {
            Some(_) => writeln!(out, " {:>12} {:>6}", "perftest", "ratio"),
            None => writeln!(out),
        };
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
                match &m.perftest {
                    Some(p) if s.shard.index() == 0 => perftest_cells(&mut out, p, &s.figures),
                    _ => out.push('\n'),
                }
            }
            if m.per_shard.len() > 1 {
                row(&mut out, &lead, "all", "", &m.merged());
                out.push('\n');
            }
        }
    }
    out
}

/// What the table says of a measurement's memory: `memory cuda (staging: ...)`.
fn memory_note(m: &Measurement) -> String {
    match (m.memory, m.cuda_mode) {
        (Memory::Host, _) => "memory host".into(),
        (Memory::Cuda, Some(mode)) => format!(
            "memory cuda (CUDA mode {}; device data staged through pinned host buffers)",
            mode.as_str()
        ),
        (Memory::Cuda, None) => "memory cuda".into(),
    }
}

/// One row of figures, without its line end (perftest's cells may follow).
fn row(out: &mut String, lead: &str, shard: &str, route: &str, f: &Figures) {
    let _ = write!(
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

/// perftest's figure and the ratio, or why there are none, and the line end.
fn perftest_cells(out: &mut String, p: &Perftest, ours: &Figures) {
    let metric = p.counterpart.metric;
    let _ = match (&p.outcome, p.ratio(ours)) {
        (Ok(f), ratio) => writeln!(
            out,
            " {:>12} {:>6}",
            figure(metric, metric.of_perftest(f)),
            ratio.map_or("-".into(), |r| format!("{r:.2}"))
        ),
        (Err(why), _) => writeln!(out, " perftest: {why}"),
    };
}

/// A value as the table shows it in `metric`'s column.
fn figure(metric: Metric, v: f64) -> String {
    match metric {
        Metric::P50Us => format!("{v:.2}"),
        Metric::MsgsPerS => format!("{v:.0}"),
        Metric::MbPerS => format!("{v:.1}"),
    }
}

/// The results as the JSON array documented in [`crate::bench`] (skipped ones left out).
pub fn json(results: &[Measurement]) -> String {
    json_array(&json_objects(results))
}

/// A JSON array of `objects` (one a line), as [`json`] writes it.
pub fn json_array(objects: &[String]) -> String {
    format!("[\n{}\n]\n", objects.join(",\n"))
}

/// The elements of [`json`]: one JSON object per measurement (skipped ones left out).
pub fn json_objects(results: &[Measurement]) -> Vec<String> {
    let mut objects = Vec::new();
    for m in results.iter().filter(|m| m.skipped.is_none()) {
        let mut out = String::new();
        let merged = m.merged();
        let _ = write!(
            out,
            "  {{\"test\": \"{}\", \"size\": {}, \"shards\": {}, \"transport\": \"{}\", \
             \"memory\": \"{}\", ",
            m.test.name(),
            m.size,
            m.shards,
            m.transport.name(),
            m.memory.name(),
        );
        if let Some(mode) = m.cuda_mode {
            let _ = write!(out, "\"cuda_mode\": \"{}\", ", mode.as_str());
        }
        let _ = write!(out, "{}, \"per_shard\": [", fields(&merged));
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
        out.push(']');
        if let Some(p) = &m.perftest {
            let shard0 = m.per_shard.first().map(|s| &s.figures);
            let _ = write!(out, ", \"perftest\": {}", perftest_json(p, shard0));
        }
        out.push('}');
        objects.push(out);
    }
    objects
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

/// The `perftest` object (schema in [`crate::bench`]).
fn perftest_json(p: &Perftest, shard0: Option<&Figures>) -> String {
    let c = p.counterpart;
    let mut o = format!(
        "{{\"test\": {}, \"iters\": {}, \"metric\": \"{}\"",
        json_string(c.test),
        p.iters,
        c.metric.name()
    );
    match &p.outcome {
        Ok(f) => {
            let _ = match c.metric {
                Metric::P50Us => write!(o, ", \"p50_us\": {}", num(f.p50_us)),
                Metric::MsgsPerS | Metric::MbPerS => write!(
                    o,
                    ", \"msgs_per_s\": {}, \"mb_per_s\": {}",
                    num(f.msgs_per_s),
                    num(f.mb_per_s)
                ),
            };
            if let Some(r) = shard0.and_then(|s| p.ratio(s)) {
                let _ = write!(o, ", \"ratio\": {}", num(r));
            }
        }
        Err(why) => {
            let _ = write!(o, ", \"error\": {}", json_string(why));
        }
    }
    o.push('}');
    o
}

/// A JSON string (quotes and escapes by serde_json, which cannot fail on a `&str`).
fn json_string(s: &str) -> String {
    serde_json::Value::from(s).to_string()
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
    use crate::bench::{Memory, Route, ShardFigures, Transport};
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
                memory: Memory::Host,
                cuda_mode: None,
                skipped: None,
                perftest: None,
            },
            Measurement {
                test: Test::Hop,
                size: 0,
                shards: 1,
                transport: Transport::Shm,
                per_shard: vec![],
                memory: Memory::Host,
                cuda_mode: None,
                skipped: Some("needs --shards 2 or more".into()),
                perftest: None,
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

    /// `--memory cuda`: the table's heading and the JSON say the memory and the CUDA mode;
    /// host memory says `"memory": "host"` and no mode.
    #[test]
    fn device_memory_is_named_in_the_table_and_the_json() {
        let host = sample();
        let j = json(&host);
        assert!(
            j.contains("\"transport\": \"shm\", \"memory\": \"host\", \"iters\""),
            "{j}"
        );
        assert!(!j.contains("cuda"), "{j}");
        assert!(!table(&host).contains("memory"));
        let mut cuda = host;
        cuda[0].memory = Memory::Cuda;
        cuda[0].cuda_mode = Some(crate::cuda::CudaMode::Staging);
        let j = json(&cuda);
        assert!(
            j.contains("\"memory\": \"cuda\", \"cuda_mode\": \"staging\", \"iters\""),
            "{j}"
        );
        let t = table(&cuda);
        assert!(
            t.contains(
                "am-lat: latency in µs (round trip), hdrhistogram, memory cuda (CUDA mode staging;"
            ),
            "{t}"
        );
        // The skipped hop ran with host memory: its heading says nothing of memory.
        assert!(
            t.contains("hop: latency in µs (per hop), hdrhistogram\n"),
            "{t}"
        );
    }

    /// `--vs-perftest`: the perftest and ratio columns on shard 0's row, why on a failed one,
    /// and the `perftest` object in the JSON.
    #[test]
    fn perftest_figures_reach_the_table_and_the_json() {
        use crate::bench::perftest::{counterpart, PerftestFigures};
        let mut results = sample();
        let mut failed = results[0].clone();
        failed.size = 4096;
        results[0].perftest = Some(Perftest {
            counterpart: counterpart(Test::AmLat).unwrap(),
            iters: 4,
            outcome: Ok(PerftestFigures {
                p50_us: 1.0,
                msgs_per_s: 1.0,
                mb_per_s: 1.0,
            }),
        });
        failed.perftest = Some(Perftest {
            counterpart: counterpart(Test::AmLat).unwrap(),
            iters: 4,
            outcome: Err("ucx_perftest -t ucp_am_lat timed out after 30s (killed)".into()),
        });
        results.insert(1, failed);
        let t = table(&results);
        assert!(t.contains("ucx_perftest ucp_am_lat"), "{t}");
        let heading = t.lines().find(|l| l.contains("msgs/s")).unwrap();
        assert!(heading.ends_with("perftest  ratio"), "{heading}");
        // Shard 0's p50 is 2.00 µs (the histogram's 2000 ns), perftest's 1.00: ratio 2.00.
        let row0 = t.lines().find(|l| l.contains(" 0     rail")).unwrap();
        assert!(row0.ends_with("1.00   2.00"), "{row0}");
        assert!(
            t.contains("perftest: ucx_perftest -t ucp_am_lat timed out"),
            "{t}"
        );
        let j = json(&results);
        for field in [
            "\"perftest\": {\"test\": \"ucp_am_lat\", \"iters\": 4, \"metric\": \"p50_us\", \
             \"p50_us\": 1.000, \"ratio\": 2.000}",
            "\"error\": \"ucx_perftest -t ucp_am_lat timed out after 30s (killed)\"",
        ] {
            assert!(j.contains(field), "{field} missing in {j}");
        }
        let parsed: serde_json::Value = serde_json::from_str(&j).unwrap();
        assert_eq!(parsed.as_array().unwrap().len(), 2, "{j}");
        assert_eq!(parsed[0]["perftest"]["ratio"], 2.0);
        assert!(parsed[1]["perftest"]["error"].is_string(), "{j}");
        assert!(parsed[1]["perftest"].get("ratio").is_none(), "{j}");
        // Without --vs-perftest, no perftest key at all.
        assert!(!json(&sample()).contains("perftest"));
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
