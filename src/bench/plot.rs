//! `--plot FILE`: an SVG with two panels, hand-written (no plotting dependency).
//!
//! Left: latency percentiles (p50 solid, p99 dashed, p99.9 dotted) against message size for the
//! round-trip tests (`am-lat`, `tag-lat`, `rpc-lat`). Right: bandwidth (MB/s, all shards)
//! against size for every test with a size. Both axes are logarithmic; one colour per (test, transport, shards),
//! merged figures.

use std::fmt::Write as _;

use super::{format_size, Measurement, Test};

const W: f64 = 520.0;
const H: f64 = 360.0;
const PAD: f64 = 60.0;
const COLOURS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

/// One line of a panel: its label, dash pattern and points (size, value).
struct Series {
    label: String,
    colour: &'static str,
    dash: &'static str,
    points: Vec<(f64, f64)>,
}

/// The SVG document for `results` (skipped ones and `hop` left out).
pub fn svg(results: &[Measurement]) -> String {
    let mut keys: Vec<(Test, &'static str, usize)> = Vec::new();
    for m in results
        .iter()
        .filter(|m| m.skipped.is_none() && m.test != Test::Hop)
    {
        let k = (m.test, m.transport.name(), m.shards);
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    let mut lat = Vec::new();
    let mut bw = Vec::new();
    for (i, &(test, tls, shards)) in keys.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let ms: Vec<_> = results
            .iter()
            .filter(|m| {
                m.skipped.is_none() && (m.test, m.transport.name(), m.shards) == (test, tls, shards)
            })
            .map(|m| (m.size.max(1) as f64, m.merged()))
            .collect();
        let name = format!("{test} {tls} x{shards}");
        if matches!(test, Test::AmLat | Test::TagLat | Test::RpcLat) {
            for (q, qn, dash) in [
                (0.5, "p50", ""),
                (0.99, "p99", "6,3"),
                (0.999, "p99.9", "2,3"),
            ] {
                lat.push(Series {
                    label: format!("{name} {qn}"),
                    colour,
                    dash,
                    points: ms.iter().map(|(s, f)| (*s, f.quantile_us(q))).collect(),
                });
            }
        }
        bw.push(Series {
            label: name,
            colour,
            dash: "",
            points: ms.iter().map(|(s, f)| (*s, f.mb_per_s())).collect(),
        });
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" \
         font-family=\"sans-serif\" font-size=\"11\">",
        2.0 * W,
        H + 140.0
    );
    let _ = writeln!(out, "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>");
    panel(&mut out, 0.0, "round-trip latency (µs)", &lat);
    panel(&mut out, W, "bandwidth (MB/s, all shards)", &bw);
    out.push_str("</svg>\n");
    out
}

/// One panel at horizontal offset `x0`.
fn panel(out: &mut String, x0: f64, title: &str, series: &[Series]) {
    let pts = series
        .iter()
        .flat_map(|s| s.points.iter())
        .filter(|p| p.1 > 0.0);
    let (mut xmin, mut xmax, mut ymin, mut ymax) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in pts {
        xmin = xmin.min(x.log2());
        xmax = xmax.max(x.log2());
        ymin = ymin.min(y.log10());
        ymax = ymax.max(y.log10());
    }
    let _ = writeln!(
        out,
        "<text x=\"{}\" y=\"20\" font-size=\"14\" text-anchor=\"middle\">{title}</text>",
        x0 + W / 2.0
    );
    if xmin > xmax {
        let _ = writeln!(
            out,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">no data</text>",
            x0 + W / 2.0,
            H / 2.0
        );
        return;
    }
    // Whole decades and powers of two around the data, never a zero-width range.
    let (ymin, ymax) = (ymin.floor(), ymax.ceil().max(ymin.floor() + 1.0));
    let (xmin, xmax) = (xmin.floor(), xmax.ceil().max(xmin.floor() + 1.0));
    let px = |x: f64| x0 + PAD + (x.log2() - xmin) / (xmax - xmin) * (W - 1.5 * PAD);
    let py = |y: f64| H - PAD + 20.0 - (y.log10() - ymin) / (ymax - ymin) * (H - 1.5 * PAD);
    let (left, bottom) = (x0 + PAD, H - PAD + 20.0);
    let _ = writeln!(
        out,
        "<path d=\"M{left},{} V{bottom} H{}\" stroke=\"black\" fill=\"none\"/>",
        bottom - (H - 1.5 * PAD),
        left + W - 1.5 * PAD
    );
    let mut e = ymin;
    while e <= ymax {
        let y = py(10f64.powf(e));
        let _ = writeln!(
            out,
            "<line x1=\"{left}\" x2=\"{}\" y1=\"{y}\" y2=\"{y}\" stroke=\"#ddd\"/>\
             <text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>",
            left + W - 1.5 * PAD,
            left - 4.0,
            y + 4.0,
            10f64.powf(e)
        );
        e += 1.0;
    }
    let step = ((xmax - xmin) / 8.0).ceil().max(1.0);
    let mut e = xmin;
    while e <= xmax {
        let x = px(2f64.powf(e));
        let _ = writeln!(
            out,
            "<text x=\"{x}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
            bottom + 14.0,
            format_size(2f64.powf(e) as usize)
        );
        e += step;
    }
    let _ = writeln!(
        out,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">message size (bytes)</text>",
        left + (W - 1.5 * PAD) / 2.0,
        bottom + 30.0
    );
    for (i, s) in series.iter().enumerate() {
        let pts: Vec<String> = s
            .points
            .iter()
            .filter(|p| p.1 > 0.0)
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        if pts.is_empty() {
            continue;
        }
        let _ = writeln!(
            out,
            "<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\" \
             stroke-dasharray=\"{}\"/>",
            pts.join(" "),
            s.colour,
            s.dash
        );
        for p in &pts {
            let (x, y) = p.split_once(',').unwrap_or(("0", "0"));
            let _ = writeln!(
                out,
                "<circle cx=\"{x}\" cy=\"{y}\" r=\"2.5\" fill=\"{}\"/>",
                s.colour
            );
        }
        let ly = H + 40.0 + 14.0 * (i % 6) as f64;
        let lx = x0 + PAD + 240.0 * (i / 6) as f64;
        let _ = writeln!(
            out,
            "<line x1=\"{lx}\" x2=\"{}\" y1=\"{ly}\" y2=\"{ly}\" stroke=\"{}\" \
             stroke-dasharray=\"{}\" stroke-width=\"1.5\"/><text x=\"{}\" y=\"{}\">{}</text>",
            lx + 20.0,
            s.colour,
            s.dash,
            lx + 24.0,
            ly + 4.0,
            s.label
        );
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;
    use crate::bench::{Figures, Route, ShardFigures, Transport};
    use shardcx_shards::proto::ShardId;
    use std::time::Duration;

    #[test]
    fn svg_has_a_line_per_series_and_survives_no_data() {
        let m = |test, size| {
            let mut f = Figures::new(size);
            f.hist.record(5000).unwrap();
            f.msgs = 1;
            f.elapsed = Duration::from_millis(1);
            Measurement {
                test,
                size,
                shards: 1,
                transport: Transport::Shm,
                per_shard: vec![ShardFigures {
                    shard: ShardId::new(0),
                    route: Route::Rail,
                    figures: f,
                }],
                skipped: None,
            }
        };
        let s = svg(&[
            m(Test::AmLat, 8),
            m(Test::AmLat, 4096),
            m(Test::AmBw, 1 << 20),
        ]);
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        // am-lat: three percentiles and a bandwidth line; am-bw: one bandwidth line.
        assert_eq!(s.matches("<polyline").count(), 5);
        assert!(s.contains("am-lat shm x1 p99.9"));
        let empty = svg(&[]);
        assert_eq!(empty.matches("no data").count(), 2);
    }
}
