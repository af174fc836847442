//! # The plots
//!
//! `loss.svg`: training loss (line), validation loss (line with dots) and the optimum (dashed),
//! against steps. `gap.svg` (when the optimum is known): the gap to the optimum of both, on a
//! log scale. Plain SVG, written by hand: it opens in any browser and needs no fonts or native
//! libraries.

use std::fmt::Write;

use crate::metrics::Record;

const WIDTH: f64 = 720.0;
const HEIGHT: f64 = 420.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;

/// Round tick values covering `[lo, hi]`.
fn ticks(lo: f64, hi: f64, target: usize) -> Vec<f64> {
    let span = (hi - lo).max(1e-12);
    let raw = span / target as f64;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|s| span / s <= target as f64)
        .unwrap_or(10.0 * magnitude);
    let first = (lo / step).ceil() as i64;
    let last = (hi / step).floor() as i64;
    (first..=last).map(|i| i as f64 * step).collect()
}

fn label(v: f64) -> String {
    if v == 0.0 || (1e-2..1e5).contains(&v.abs()) {
        let s = format!("{v:.4}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        format!("{v:.1e}")
    }
}

/// One line of a chart.
struct Series {
    name: String,
    color: &'static str,
    width: f64,
    dots: bool,
    points: Vec<(f64, f64)>,
}

/// The `(step, value)` points of the records of `kind`, where `value` gives one.
fn series(
    records: &[Record],
    kind: &str,
    value: impl Fn(&Record) -> Option<f64>,
) -> Vec<(f64, f64)> {
    records
        .iter()
        .filter(|r| r.kind == kind)
        .filter_map(|r| Some((r.step as f64, value(r)?)))
        .filter(|p| p.1.is_finite())
        .collect()
}

/// The training (line) and validation (line with dots) series of `value`.
fn train_and_valid(records: &[Record], value: impl Fn(&Record) -> Option<f64>) -> Vec<Series> {
    vec![
        Series {
            name: "train".into(),
            color: "#3060c0",
            width: 1.2,
            dots: false,
            points: series(records, "train", &value),
        },
        Series {
            name: "validation".into(),
            color: "#d04020",
            width: 2.0,
            dots: true,
            points: series(records, "valid", &value),
        },
    ]
}

/// `loss.svg`: the losses against steps, with the optimum dashed.
pub fn svg(title: &str, records: &[Record], optimum: Option<f64>) -> String {
    let lines = train_and_valid(records, |r| Some(r.loss));
    let reference = optimum.map(|o| (format!("optimum {}", label(o)), o));
    chart(title, "loss", &lines, reference, false)
}

/// `gap.svg`: the gap to the optimum, `loss − optimum`, on a log scale, where the slow last
/// stretch of training stays visible (on `loss.svg` the first steps' drop flattens it).
/// Points at or below the optimum (sampling noise) have no logarithm and are left out.
pub fn gap_svg(title: &str, records: &[Record]) -> String {
    let lines = train_and_valid(records, |r| r.gap.filter(|g| *g > 0.0));
    chart(title, "gap to the optimum (log scale)", &lines, None, true)
}

/// A chart of `lines` against steps, with a dashed horizontal `reference`; on a log10 scale
/// when `log` (every value must then be positive).
fn chart(
    title: &str,
    y_name: &str,
    lines: &[Series],
    reference: Option<(String, f64)>,
    log: bool,
) -> String {
    let scale = |v: f64| if log { v.log10() } else { v };
    let all: Vec<f64> = lines
        .iter()
        .flat_map(|s| s.points.iter().map(|p| scale(p.1)))
        .chain(reference.as_ref().map(|r| scale(r.1)))
        .collect();
    let max_step = lines
        .iter()
        .flat_map(|s| &s.points)
        .map(|p| p.0)
        .fold(1.0, f64::max);
    let (mut lo, mut hi) = all
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &v| {
            (a.min(v), b.max(v))
        });
    if !lo.is_finite() {
        (lo, hi) = (0.0, 1.0);
    }
    let pad = ((hi - lo) * 0.05).max(1e-6);
    let (lo, hi) = (lo - pad, hi + pad);
    let x = |step: f64| LEFT + step / max_step * (WIDTH - LEFT - RIGHT);
    // `v` already scaled.
    let y = |v: f64| TOP + (hi - v) / (hi - lo) * (HEIGHT - TOP - BOTTOM);

    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>"#,
        WIDTH / 2.0,
        escape(title)
    );
    // Axes, grid and ticks.
    let (x0, x1, y0, y1) = (LEFT, WIDTH - RIGHT, TOP, HEIGHT - BOTTOM);
    for t in ticks(lo, hi, 6) {
        let _ = writeln!(
            out,
            r##"<line x1="{x0}" x2="{x1}" y1="{yy:.1}" y2="{yy:.1}" stroke="#e5e5e5"/><text x="{tx}" y="{ty:.1}" text-anchor="end">{}</text>"##,
            label(if log { 10f64.powf(t) } else { t }),
            yy = y(t),
            tx = x0 - 6.0,
            ty = y(t) + 4.0
        );
    }
    for t in ticks(0.0, max_step, 8) {
        let _ = writeln!(
            out,
            r##"<line x1="{xx:.1}" x2="{xx:.1}" y1="{y0}" y2="{y1}" stroke="#e5e5e5"/><text x="{xx:.1}" y="{ty}" text-anchor="middle">{}</text>"##,
            label(t),
            xx = x(t),
            ty = y1 + 18.0
        );
    }
    let _ = writeln!(
        out,
        r#"<rect x="{x0}" y="{y0}" width="{}" height="{}" fill="none" stroke="black"/>"#,
        x1 - x0,
        y1 - y0
    );
    let _ = writeln!(
        out,
        r#"<text x="{}" y="{}" text-anchor="middle">step</text><text x="16" y="{}" text-anchor="middle" transform="rotate(-90 16 {})">{}</text>"#,
        (x0 + x1) / 2.0,
        HEIGHT - 12.0,
        (y0 + y1) / 2.0,
        (y0 + y1) / 2.0,
        escape(y_name)
    );
    let mut legend = Vec::new();
    if let Some((text, value)) = reference {
        let _ = writeln!(
            out,
            r##"<line x1="{x0}" x2="{x1}" y1="{yy:.1}" y2="{yy:.1}" stroke="#2a9d3a" stroke-width="1.5" stroke-dasharray="6 4"/>"##,
            yy = y(scale(value))
        );
        legend.push(("#2a9d3a", text));
    }
    for line in lines.iter().filter(|l| !l.points.is_empty()) {
        let pts: Vec<String> = line
            .points
            .iter()
            .map(|(s, v)| format!("{:.1},{:.1}", x(*s), y(scale(*v))))
            .collect();
        let _ = writeln!(
            out,
            r#"<polyline fill="none" stroke="{}" stroke-width="{}" points="{}"/>"#,
            line.color,
            line.width,
            pts.join(" ")
        );
        if line.dots {
            for (s, v) in &line.points {
                let _ = writeln!(
                    out,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="2.5" fill="{}"/>"#,
                    x(*s),
                    y(scale(*v)),
                    line.color
                );
            }
        }
        legend.push((line.color, line.name.clone()));
    }
    for (i, (color, text)) in legend.iter().enumerate() {
        let ly = y0 + 16.0 + 18.0 * i as f64;
        let _ = writeln!(
            out,
            r#"<line x1="{}" x2="{}" y1="{ly}" y2="{ly}" stroke="{color}" stroke-width="2"/><text x="{}" y="{}">{}</text>"#,
            x1 - 160.0,
            x1 - 135.0,
            x1 - 128.0,
            ly + 4.0,
            escape(text)
        );
    }
    out.push_str("</svg>\n");
    out
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(
            ticks(0.0, 1000.0, 8),
            vec![0.0, 200.0, 400.0, 600.0, 800.0, 1000.0]
        );
        let t = ticks(1.234, 2.71, 6);
        assert!(t.iter().all(|v| (1.234..=2.71).contains(v)), "{t:?}");
        assert!(t.len() >= 3);
    }

    #[test]
    fn plots_every_series() {
        let rec = |step, kind: &str, loss| Record {
            step,
            kind: kind.into(),
            loss,
            gap: None,
            lr: None,
        };
        let records = vec![
            rec(10, "train", 3.0),
            rec(20, "train", 2.0),
            rec(20, "valid", 2.1),
        ];
        let svg = svg("a <run>", &records, Some(1.5));
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("stroke-dasharray"));
        assert!(svg.contains("a &lt;run&gt;"));
        assert!(svg.contains("optimum 1.5"));
    }

    /// The gap plot is logarithmic: a gap of 10⁻³ sits as far below 10⁻² as 10⁻² below 10⁻¹,
    /// and gaps at or below zero are left out.
    #[test]
    fn the_gap_plot_is_logarithmic() {
        let rec = |step, kind: &str, gap: f64| Record {
            step,
            kind: kind.into(),
            loss: 1.0 + gap,
            gap: Some(gap),
            lr: None,
        };
        let records = vec![
            rec(10, "valid", 1e-1),
            rec(20, "valid", 1e-2),
            rec(30, "valid", 1e-3),
            rec(40, "valid", -1e-4),
        ];
        let svg = gap_svg("run", &records);
        let ys: Vec<f64> = svg
            .lines()
            .filter(|l| l.starts_with("<circle"))
            .map(|l| {
                l.split("cy=\"")
                    .nth(1)
                    .unwrap()
                    .split('"')
                    .next()
                    .unwrap()
                    .parse()
                    .unwrap()
            })
            .collect();
        assert_eq!(ys.len(), 3);
        assert!(((ys[1] - ys[0]) - (ys[2] - ys[1])).abs() < 0.2, "{ys:?}");
        assert!(svg.contains(">0.01<"), "{svg}");
    }
}
