//! `--plot FILE`: latency and bandwidth against message size, drawn with `plotters` as SVG or
//! PNG ([`PlotFormat`], chosen by the file's extension).
//!
//! Left panel: round-trip latency percentiles (p50 solid with dots, p99 dashed, p99.9 dotted)
//! for the round-trip tests (`am-lat`, `tag-lat`, `rpc-lat`). Right panel: bandwidth (MB/s,
//! all shards) for every test with a size. Both axes are logarithmic (sizes in powers of two);
//! one colour per (test, transport, shard count), merged figures. `hop` (no size) and skipped
//! combinations are left out; a panel with nothing to show says "no data".
//!
//! With `--vs-perftest`, `ucx_perftest`'s figures are thin lines with triangles in the colour of
//! the shardcx test they match, labelled `ucx_perftest TEST (vs TEST TLS)`: its p50 round trip
//! on the left (for `am-lat`, `tag-lat`), its MB/s on the right (for `am-rate`, `am-bw`,
//! `put-bw`; see [`super::perftest`]).
//!
//! Text is laid out and drawn with `ab_glyph` from a font compiled into the program
//! (`epaint_default_fonts`' Ubuntu Light), so a PNG renders the same on a machine with no fonts
//! installed; an SVG names the `sans-serif` family and leaves the glyphs to its viewer.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::FontStyle;

use super::perftest::{counterpart, Metric, PerftestFigures};
use super::{format_size, Measurement, Test};

/// Width of the whole picture, in pixels (each panel gets half).
const W: u32 = 1280;
/// Height of the whole picture, in pixels.
const H: u32 = 560;
/// The font family every text of the plot asks for (registered by [`write`]).
const FONT: &str = "sans-serif";
/// One colour per (test, transport, shards), in order of appearance (matplotlib's "tab10").
const COLOURS: [RGBColor; 10] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x7f, 0x7f, 0x7f),
    RGBColor(0xbc, 0xbd, 0x22),
    RGBColor(0x17, 0xbe, 0xcf),
];

/// The file formats `--plot` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlotFormat {
    /// SVG (`.svg`): vector, text left to the viewer's fonts.
    Svg,
    /// PNG (`.png`): a bitmap, text drawn with the compiled-in font.
    Png,
}

/// Why a plot could not be written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PlotError {
    /// The file's extension names no format [`PlotFormat`] knows.
    #[error("{path}: the plot's format comes from its extension: .svg or .png")]
    Format {
        /// The file.
        path: String,
    },
    /// The compiled-in font could not be read (a build problem, not the user's).
    #[error("the plot font could not be loaded")]
    Font,
    /// Drawing or writing failed.
    #[error("cannot draw {path}: {why}")]
    Draw {
        /// The file.
        path: String,
        /// plotters' error.
        why: String,
    },
}

/// How one line of a panel is drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stroke {
    /// A solid line with a dot at each point, and a legend entry.
    Solid,
    /// Dashed, no legend entry (its solid sibling has it).
    Dashed,
    /// Dotted, no legend entry.
    Dotted,
    /// ucx_perftest's figures: thin, with triangles, and a legend entry.
    Perftest,
}

/// One line of a panel: its label, colour, stroke and points (size, value), values > 0 only.
struct Series {
    label: String,
    colour: RGBColor,
    stroke: Stroke,
    points: Vec<(f64, f64)>,
}

impl PlotFormat {
    /// The format named by `path`'s extension (case does not matter), or why there is none.
    pub fn of(path: &Path) -> Result<Self, PlotError> {
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        match ext.as_deref() {
            Some("svg") => Ok(PlotFormat::Svg),
            Some("png") => Ok(PlotFormat::Png),
            _ => Err(PlotError::Format {
                path: path.display().to_string(),
            }),
        }
    }
}

/// Draws `results` (see the module docs) into `path`, as SVG or PNG by its extension.
pub fn write(path: &Path, results: &[Measurement]) -> Result<(), PlotError> {
    let format = PlotFormat::of(path)?;
    // Registering again replaces the entry with the same font: harmless.
    plotters::style::register_font(FONT, FontStyle::Normal, epaint_default_fonts::UBUNTU_LIGHT)
        .map_err(|_| PlotError::Font)?;
    let (lat, bw) = series(results);
    let draw_err = |why: String| PlotError::Draw {
        path: path.display().to_string(),
        why,
    };
    match format {
        PlotFormat::Svg => draw(SVGBackend::new(path, (W, H)).into_drawing_area(), &lat, &bw),
        PlotFormat::Png => draw(
            BitMapBackend::new(path, (W, H)).into_drawing_area(),
            &lat,
            &bw,
        ),
    }
    .map_err(draw_err)
}

/// The latency and bandwidth panels' lines.
fn series(results: &[Measurement]) -> (Vec<Series>, Vec<Series>) {
    let shown = |m: &&Measurement| m.skipped.is_none() && m.test != Test::Hop;
    let mut keys: Vec<(Test, &'static str, usize)> = Vec::new();
    for m in results.iter().filter(shown) {
        let k = (m.test, m.transport.name(), m.shards);
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    let mut lat = Vec::new();
    let mut bw = Vec::new();
    for (i, &(test, tls, shards)) in keys.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let mut ms: Vec<_> = results
            .iter()
            .filter(shown)
            .filter(|m| (m.test, m.transport.name(), m.shards) == (test, tls, shards))
            .map(|m| (m.size.max(1) as f64, m.merged()))
            .collect();
        ms.sort_by(|a, b| a.0.total_cmp(&b.0));
        let points = |value: &dyn Fn(&super::Figures) -> f64| -> Vec<(f64, f64)> {
            ms.iter()
                .map(|(s, f)| (*s, value(f)))
                .filter(|p| p.1 > 0.0 && p.1.is_finite())
                .collect()
        };
        let name = format!("{test} {tls} ×{shards}");
        if matches!(test, Test::AmLat | Test::TagLat | Test::RpcLat) {
            for (q, stroke) in [
                (0.5, Stroke::Solid),
                (0.99, Stroke::Dashed),
                (0.999, Stroke::Dotted),
            ] {
                lat.push(Series {
                    label: name.clone(),
                    colour,
                    stroke,
                    points: points(&|f| f.quantile_us(q)),
                });
            }
        }
        bw.push(Series {
            label: name,
            colour,
            stroke: Stroke::Solid,
            points: points(&|f| f.mb_per_s()),
        });
        // perftest's line: once per (test, transport), with the first shard count's colour.
        if keys[..i].iter().any(|k| (k.0, k.1) == (test, tls)) {
            continue;
        }
        let mut theirs: Vec<(f64, PerftestFigures)> = results
            .iter()
            .filter(shown)
            .filter(|m| (m.test, m.transport.name()) == (test, tls))
            .filter_map(|m| {
                let f = m.perftest.as_ref()?.outcome.as_ref().ok()?;
                Some((m.size.max(1) as f64, *f))
            })
            .collect();
        theirs.sort_by(|a, b| a.0.total_cmp(&b.0));
        theirs.dedup_by(|a, b| a.0 == b.0);
        let Some(c) = counterpart(test).filter(|_| !theirs.is_empty()) else {
            continue;
        };
        let label = format!("ucx_perftest {} (vs {test} {tls})", c.test);
        let line = |value: &dyn Fn(&PerftestFigures) -> f64| Series {
            label: label.clone(),
            colour,
            stroke: Stroke::Perftest,
            points: theirs
                .iter()
                .map(|(s, f)| (*s, value(f)))
                .filter(|p| p.1 > 0.0 && p.1.is_finite())
                .collect(),
        };
        // perftest's latency tests count one-way bytes per half round trip: their MB/s is not
        // comparable to shardcx's (per round trip), so only the p50 is drawn for them.
        if c.metric == Metric::P50Us {
            lat.push(line(&|f| f.p50_us));
        } else {
            bw.push(line(&|f| f.mb_per_s));
        }
    }
    (lat, bw)
}

/// Both panels on `root`, then the file written.
fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    lat: &[Series],
    bw: &[Series],
) -> Result<(), String> {
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let (left, right) = root.split_horizontally(W / 2);
    panel(
        &left,
        "round-trip latency: p50 solid, p99 dashed, p99.9 dotted",
        "latency (µs)",
        lat,
        // Latency grows with size: the upper left is the emptiest corner.
        SeriesLabelPosition::UpperLeft,
    )
    .map_err(|e| e.to_string())?;
    panel(
        &right,
        "bandwidth, all shards",
        "bandwidth (MB/s, 10⁶ bytes/s)",
        bw,
        // Bandwidth grows with size: the lower right is the emptiest corner.
        SeriesLabelPosition::LowerRight,
    )
    .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}

/// One panel: log-log axes around the data, a line per series, a legend.
fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    title: &str,
    y_desc: &str,
    series: &[Series],
    legend_at: SeriesLabelPosition,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let all = series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in all {
        (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
    }
    let mut builder = ChartBuilder::on(area);
    builder
        .caption(title, (FONT, 18))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(64);
    if x0 > x1 {
        let (w, h) = area.dim_in_pixel();
        area.draw(&Text::new(
            "no data",
            (w as i32 / 2 - 30, h as i32 / 2),
            (FONT, 18),
        ))?;
        return area.titled(title, (FONT, 18)).map(|_| ());
    }
    // Half a step of room around the data; sizes on powers of two, values on decades.
    let mut chart = builder.build_cartesian_2d(
        (x0 / 1.5..x1 * 1.5).log_scale().base(2.0),
        (y0 / 2.0..y1 * 2.0).log_scale(),
    )?;
    chart
        .configure_mesh()
        .x_desc("message size (bytes)")
        .y_desc(y_desc)
        .x_labels(12)
        .x_label_formatter(&|x| format_size(x.round() as usize))
        .y_label_formatter(&|y| format!("{y}"))
        .label_style((FONT, 13))
        .axis_desc_style((FONT, 15))
        .light_line_style(WHITE.mix(0.0))
        .draw()?;
    for s in series.iter().filter(|s| !s.points.is_empty()) {
        let style = s.colour.stroke_width(2);
        match s.stroke {
            Stroke::Solid => {
                let colour = s.colour;
                chart
                    .draw_series(LineSeries::new(s.points.iter().copied(), style))?
                    .label(&s.label)
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2))
                    });
                chart.draw_series(
                    s.points
                        .iter()
                        .map(|&p| Circle::new(p, 3, s.colour.filled())),
                )?;
            }
            Stroke::Dashed | Stroke::Dotted => {
                let (dash, gap) = if s.stroke == Stroke::Dashed {
                    (8, 5)
                } else {
                    (2, 4)
                };
                chart.draw_series(DashedLineSeries::new(
                    s.points.iter().copied(),
                    dash,
                    gap,
                    style.stroke_width(1),
                ))?;
            }
            Stroke::Perftest => {
                let colour = s.colour;
                chart
                    .draw_series(LineSeries::new(
                        s.points.iter().copied(),
                        s.colour.stroke_width(1),
                    ))?
                    .label(&s.label)
                    .legend(move |(x, y)| {
                        EmptyElement::at((x, y))
                            + PathElement::new(vec![(0, 0), (20, 0)], colour.stroke_width(1))
                            + TriangleMarker::new((10, 0), 4, colour.filled())
                    });
                chart.draw_series(
                    s.points
                        .iter()
                        .map(|&p| TriangleMarker::new(p, 5, s.colour.filled())),
                )?;
            }
        }
    }
    chart
        .configure_series_labels()
        .position(legend_at)
        .label_font((FONT, 13))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .draw()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;
    use crate::bench::perftest::Perftest;
    use crate::bench::{Figures, Memory, Route, ShardFigures, Transport};
    use shardcx_shards::proto::ShardId;
    use std::time::Duration;

    fn m(test: Test, size: usize) -> Measurement {
        let mut f = Figures::new(size);
        f.hist.record(5000).unwrap();
        f.hist.record(9000).unwrap();
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
            memory: Memory::Host,
            cuda_mode: None,
            skipped: None,
            perftest: None,
        }
    }

    fn tmp(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("shardcx-plot-{}-{name}", std::process::id()))
    }

    #[test]
    fn the_format_comes_from_the_extension() {
        assert_eq!(PlotFormat::of(Path::new("a.svg")).unwrap(), PlotFormat::Svg);
        assert_eq!(
            PlotFormat::of(Path::new("a/b.PNG")).unwrap(),
            PlotFormat::Png
        );
        for bad in ["a.jpg", "a", "svg", "a.svg.txt"] {
            let e = PlotFormat::of(Path::new(bad)).unwrap_err();
            assert!(e.to_string().contains(".svg or .png"), "{bad}: {e}");
        }
    }

    #[test]
    fn svg_has_a_line_per_series_a_legend_and_survives_no_data() {
        let results = [
            m(Test::AmLat, 8),
            m(Test::AmLat, 4096),
            m(Test::AmBw, 1 << 20),
            m(Test::AmBw, 4 << 20),
        ];
        let (lat, bw) = series(&results);
        // am-lat: three percentiles; both tests a bandwidth line.
        assert_eq!(lat.len(), 3);
        assert_eq!(bw.len(), 2);
        // With perftest's figures: its p50 on the left, its MB/s on the right for am-bw only
        // (a latency test's MB/s is not comparable).
        let mut compared = results.clone();
        for m in &mut compared {
            let c = counterpart(m.test).unwrap();
            m.perftest = Some(Perftest {
                counterpart: c,
                iters: 1,
                outcome: Ok(PerftestFigures {
                    p50_us: 3.0,
                    msgs_per_s: 1e6,
                    mb_per_s: 100.0,
                }),
            });
        }
        let (lat_vs, bw_vs) = series(&compared);
        assert_eq!(lat_vs.len(), 4);
        assert_eq!(lat_vs[3].label, "ucx_perftest ucp_am_lat (vs am-lat shm)");
        assert_eq!(lat_vs[3].points, vec![(8.0, 3.0), (4096.0, 3.0)]);
        assert_eq!(bw_vs.len(), 3);
        assert_eq!(bw_vs[2].label, "ucx_perftest ucp_am_bw (vs am-bw shm)");
        assert_eq!(
            bw_vs[2].points,
            vec![(1048576.0, 100.0), (4194304.0, 100.0)]
        );
        let path_vs = tmp("vs.svg");
        write(&path_vs, &compared).unwrap();
        let s = std::fs::read_to_string(&path_vs).unwrap();
        assert!(s.contains("ucx_perftest ucp_am_bw (vs am-bw shm)"), "{s}");
        let _ = std::fs::remove_file(&path_vs);
        assert_eq!(lat[1].points, vec![(8.0, 9.007), (4096.0, 9.007)]);
        let path = tmp("a.svg");
        write(&path, &results).unwrap();
        let s = std::fs::read_to_string(&path).unwrap();
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        // plotters draws every line as a polyline (axes and ticks too): count the series'
        // solid ones by colour and width. am-lat: its p50 and bandwidth lines and their legend
        // entries; am-bw: its bandwidth line and legend entry.
        let solid = |colour: &str| {
            s.matches(&format!(
                "<polyline fill=\"none\" opacity=\"1\" stroke=\"{colour}\" stroke-width=\"2\""
            ))
            .count()
        };
        assert_eq!(solid("#1F77B4"), 4, "{s}");
        assert_eq!(solid("#D62728"), 2, "{s}");
        // p99 and p99.9: dashes, thinner.
        assert!(s.contains("stroke=\"#1F77B4\" stroke-width=\"1\""), "{s}");
        assert!(s.contains("am-lat shm ×1") && s.contains("am-bw shm ×1"));
        assert!(s.contains("message size (bytes)") && s.contains("latency (µs)"));
        assert!(
            s.contains("\n4K\n") && s.contains("\n512K\n"),
            "sizes as powers of two: {s}"
        );
        write(&path, &[]).unwrap();
        let empty = std::fs::read_to_string(&path).unwrap();
        assert_eq!(empty.matches("no data").count(), 2);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn png_renders_text_with_the_built_in_font() {
        let path = tmp("a.png");
        write(&path, &[m(Test::AmLat, 8), m(Test::AmLat, 64)]).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"));
        // A blank 1280x560 picture compresses to a few KiB; text and lines make it larger.
        assert!(bytes.len() > 20_000, "{} bytes", bytes.len());
        let _ = std::fs::remove_file(&path);
        let bad = write(Path::new("a.gif"), &[]).unwrap_err();
        assert!(matches!(bad, PlotError::Format { .. }), "{bad}");
    }
}
