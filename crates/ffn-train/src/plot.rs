//! # The plots
//!
//! `loss.svg`: training loss (line), validation loss (line with dots) and the optimum (dashed),
//! against steps. `gap.svg` (when the optimum is known): the gap to the optimum of both, on a
//! log scale. A sweep's `gaps.svg` (mean gap with 95 % error bars per variant) and `curves.svg`
//! (validation gaps per variant, log scale), one panel per task. Plain SVG, written by hand: it
//! opens in any browser and needs no fonts or native libraries.

use std::fmt::Write;

/// One logged moment of a run, as the run's plots take it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Point {
    /// Steps completed.
    pub step: usize,
    /// A validation point; else a training one.
    pub valid: bool,
    /// The loss.
    pub loss: f64,
    /// `loss − optimum`, when the optimum is known.
    pub gap: Option<f64>,
    /// The expert load of a run with sparse layers: the busiest expert over the mean, the
    /// coefficient of variation, and the fraction dropped by capacity.
    pub load: Option<[f64; 3]>,
}

/// A variant's mean final gap on a task and its 95 % interval, as `gaps.svg` takes it.
#[derive(Debug, Clone, PartialEq)]
pub struct Interval {
    /// The task.
    pub task: String,
    /// The variant.
    pub variant: String,
    /// The mean final gap over seeds.
    pub mean: f64,
    /// The interval's lower end.
    pub low: f64,
    /// The interval's upper end.
    pub high: f64,
}

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

/// The `(step, value)` points of the validation points (`valid`) or the training ones, where
/// `value` gives one.
fn series(points: &[Point], valid: bool, value: impl Fn(&Point) -> Option<f64>) -> Vec<(f64, f64)> {
    points
        .iter()
        .filter(|r| r.valid == valid)
        .filter_map(|r| Some((r.step as f64, value(r)?)))
        .filter(|p| p.1.is_finite())
        .collect()
}

/// The training (line) and validation (line with dots) series of `value`.
fn train_and_valid(records: &[Point], value: impl Fn(&Point) -> Option<f64>) -> Vec<Series> {
    vec![
        Series {
            name: "train".into(),
            color: "#3060c0",
            width: 1.2,
            dots: false,
            points: series(records, false, &value),
        },
        Series {
            name: "validation".into(),
            color: "#d04020",
            width: 2.0,
            dots: true,
            points: series(records, true, &value),
        },
    ]
}

/// `loss.svg`: the losses against steps, with the optimum dashed.
pub fn svg(title: &str, records: &[Point], optimum: Option<f64>) -> String {
    let lines = train_and_valid(records, |r| Some(r.loss));
    let reference = optimum.map(|o| (format!("optimum {}", label(o)), o));
    chart(title, "loss", &lines, reference, false)
}

/// `gap.svg`: the gap to the optimum, `loss − optimum`, on a log scale, where the slow last
/// stretch of training stays visible (on `loss.svg` the first steps' drop flattens it).
/// Points at or below the optimum (sampling noise) have no logarithm and are left out.
pub fn gap_svg(title: &str, records: &[Point]) -> String {
    let lines = train_and_valid(records, |r| r.gap.filter(|g| *g > 0.0));
    chart(title, "gap to the optimum (log scale)", &lines, None, true)
}

/// `load.svg` of a run with sparse layers: at each logged training step, the busiest expert's
/// load over the mean and the loads' coefficient of variation (the largest over the layers),
/// and the fraction of pairs dropped by capacity when there is any; balance is the dashed 1
/// and 0. `None` for a run without sparse layers.
pub fn load_svg(title: &str, records: &[Point]) -> Option<String> {
    let moe = |i: usize| move |r: &Point| r.load.map(|l| l[i]);
    let line = |name: &str, color, points: Vec<(f64, f64)>| Series {
        name: name.into(),
        color,
        width: 1.5,
        dots: false,
        points,
    };
    let max = series(records, false, moe(0));
    if max.is_empty() {
        return None;
    }
    let mut lines = vec![
        line("busiest expert / mean", "#3060c0", max),
        line(
            "coefficient of variation",
            "#2ca02c",
            series(records, false, moe(1)),
        ),
    ];
    let dropped = series(records, false, moe(2));
    if dropped.iter().any(|p| p.1 > 0.0) {
        lines.push(line("dropped fraction", "#d04020", dropped));
    }
    let reference = Some(("balanced: 1 (and 0)".to_string(), 1.0));
    Some(chart(title, "expert load", &lines, reference, false))
}

/// The colours of a sweep's variants, in order.
const PALETTE: [&str; 10] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
    "#7f7f7f", "#bcbd22",
];

/// Panels stacked one above the other, each a complete SVG of `WIDTH × HEIGHT`.
fn stack(panels: &[String]) -> String {
    let mut out = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{}">"#,
        HEIGHT * panels.len().max(1) as f64
    );
    out.push('\n');
    for (i, panel) in panels.iter().enumerate() {
        // A nested <svg> placed by its x/y: the panel keeps its own coordinates.
        let placed = panel.replacen(
            "<svg ",
            &format!(r#"<svg x="0" y="{}" "#, HEIGHT * i as f64),
            1,
        );
        out += &placed;
    }
    out.push_str("</svg>\n");
    out
}

/// A line of a sweep's `curves.svg`: a variant's mean validation gap on a task, by step.
#[derive(Debug, Clone, PartialEq)]
pub struct Curve {
    /// The task.
    pub task: String,
    /// The variant.
    pub variant: String,
    /// `(step, gap)`.
    pub points: Vec<(usize, f64)>,
}

/// A sweep's `curves.svg`: for each task a panel of the validation gap (log scale) against
/// steps, one line per variant.
pub fn curves_svg(name: &str, tasks: &[&str], curves: &[Curve]) -> String {
    let panels: Vec<String> = tasks
        .iter()
        .map(|task| {
            let series: Vec<Series> = curves
                .iter()
                .filter(|c| c.task == *task)
                .enumerate()
                .map(|(i, c)| Series {
                    name: c.variant.clone(),
                    color: PALETTE[i % PALETTE.len()],
                    width: 1.6,
                    dots: false,
                    points: c
                        .points
                        .iter()
                        .map(|&(s, g)| (s as f64, g))
                        .filter(|p| p.1 > 0.0 && p.1.is_finite())
                        .collect(),
                })
                .collect();
            chart(
                &format!("{name}: {task}, mean validation gap over seeds"),
                "gap to the optimum (log scale)",
                &series,
                None,
                true,
            )
        })
        .collect();
    stack(&panels)
}

/// A sweep's `gaps.svg`: for each task a panel of every variant's mean final gap (dot) and
/// its 95 % interval (bar).
pub fn gaps_svg(name: &str, intervals: &[Interval]) -> String {
    let mut tasks: Vec<&str> = Vec::new();
    for v in intervals {
        if !tasks.contains(&v.task.as_str()) {
            tasks.push(&v.task);
        }
    }
    let panels: Vec<String> = tasks
        .iter()
        .map(|task| {
            let rows: Vec<(&str, f64, f64, f64)> = intervals
                .iter()
                .filter(|v| v.task == *task)
                .map(|v| (v.variant.as_str(), v.mean, v.low, v.high))
                .collect();
            error_bars(
                &format!("{name}: {task}, final gap, mean and 95% CI"),
                &rows,
            )
        })
        .collect();
    stack(&panels)
}

/// `[lo, hi]` of `values`, widened by `pad` of its span on each side (`[0, 1]` if empty).
fn padded_range(values: impl Iterator<Item = f64>, pad: f64) -> (f64, f64) {
    let (mut lo, mut hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
        (a.min(v), b.max(v))
    });
    if !lo.is_finite() {
        (lo, hi) = (0.0, 1.0);
    }
    let pad = ((hi - lo) * pad).max(1e-6);
    (lo - pad, hi + pad)
}

/// The start of a `WIDTH × HEIGHT` panel: background, title, the plot box `(x0, x1, y0, y1)`
/// with horizontal grid lines at the ticks of `[lo, hi]` (drawn at `y(t)`, labelled
/// `label_of(t)`), and the vertical axis's name.
fn panel(
    title: &str,
    y_name: &str,
    (x0, x1, y0, y1): (f64, f64, f64, f64),
    (lo, hi): (f64, f64),
    y: impl Fn(f64) -> f64,
    label_of: impl Fn(f64) -> String,
) -> String {
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
    for t in ticks(lo, hi, 6) {
        let _ = writeln!(
            out,
            r##"<line x1="{x0}" x2="{x1}" y1="{yy:.1}" y2="{yy:.1}" stroke="#e5e5e5"/><text x="{tx}" y="{ty:.1}" text-anchor="end">{}</text>"##,
            label_of(t),
            yy = y(t),
            tx = x0 - 6.0,
            ty = y(t) + 4.0
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
        r#"<text x="16" y="{c}" text-anchor="middle" transform="rotate(-90 16 {c})">{}</text>"#,
        escape(y_name),
        c = (y0 + y1) / 2.0
    );
    out
}

/// One panel of labelled means with intervals: `(label, mean, low, high)`.
fn error_bars(title: &str, rows: &[(&str, f64, f64, f64)]) -> String {
    let (lo, hi) = padded_range(rows.iter().flat_map(|r| [r.2, r.3]), 0.08);
    let (x0, x1, y0, y1) = (LEFT, WIDTH - RIGHT, TOP, HEIGHT - BOTTOM - 20.0);
    let slot = (x1 - x0) / rows.len().max(1) as f64;
    let x = |i: usize| x0 + slot * (i as f64 + 0.5);
    let y = |v: f64| y0 + (hi - v) / (hi - lo) * (y1 - y0);
    let mut out = panel(
        title,
        "final gap to the optimum",
        (x0, x1, y0, y1),
        (lo, hi),
        y,
        label,
    );
    for (i, (name, mean, low, high)) in rows.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let xx = x(i);
        let _ = writeln!(
            out,
            r#"<line x1="{xx:.1}" x2="{xx:.1}" y1="{:.1}" y2="{:.1}" stroke="{color}" stroke-width="2"/><line x1="{:.1}" x2="{:.1}" y1="{:.1}" y2="{:.1}" stroke="{color}" stroke-width="2"/><line x1="{:.1}" x2="{:.1}" y1="{:.1}" y2="{:.1}" stroke="{color}" stroke-width="2"/><circle cx="{xx:.1}" cy="{:.1}" r="4" fill="{color}"/>"#,
            y(*low),
            y(*high),
            xx - 6.0,
            xx + 6.0,
            y(*low),
            y(*low),
            xx - 6.0,
            xx + 6.0,
            y(*high),
            y(*high),
            y(*mean),
        );
        let _ = writeln!(
            out,
            r#"<text x="{xx:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            y1 + 18.0 + if i % 2 == 1 { 14.0 } else { 0.0 },
            escape(name)
        );
    }
    out.push_str("</svg>\n");
    out
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
    let (lo, hi) = padded_range(all.into_iter(), 0.05);
    let x = |step: f64| LEFT + step / max_step * (WIDTH - LEFT - RIGHT);
    // `v` already scaled.
    let y = |v: f64| TOP + (hi - v) / (hi - lo) * (HEIGHT - TOP - BOTTOM);
    let (x0, x1, y0, y1) = (LEFT, WIDTH - RIGHT, TOP, HEIGHT - BOTTOM);
    let mut out = panel(title, y_name, (x0, x1, y0, y1), (lo, hi), y, |t| {
        label(if log { 10f64.powf(t) } else { t })
    });
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
        r#"<text x="{}" y="{}" text-anchor="middle">step</text>"#,
        (x0 + x1) / 2.0,
        HEIGHT - 12.0,
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
    fn sweep_plots_have_a_panel_per_task_and_a_mark_per_variant() {
        let curve = |task: &str, variant: &str, points| Curve {
            task: task.into(),
            variant: variant.into(),
            points,
        };
        let curves = curves_svg(
            "s",
            &["a", "b"],
            &[
                curve("a", "FFN_ReLU", vec![(10, 0.1), (20, 0.01)]),
                curve("a", "FFN_GLU", vec![(10, 0.2), (20, -0.01)]),
                curve("b", "FFN_ReLU", vec![(10, 0.3)]),
            ],
        );
        assert_eq!(curves.matches("<svg").count(), 3, "{curves}");
        assert_eq!(curves.matches("<polyline").count(), 3);
        assert!(curves.contains("FFN_GLU") && curves.contains(r#"y="420""#));
        let entry = |task: &str, variant: &str, mean: f64| Interval {
            task: task.into(),
            variant: variant.into(),
            mean,
            low: mean - 0.02,
            high: mean + 0.02,
        };
        let intervals = [
            entry("a", "FFN_ReLU", 0.1),
            entry("a", "FFN_GLU", 0.05),
            entry("b", "FFN_ReLU", 0.2),
        ];
        let gaps = gaps_svg("s", &intervals);
        assert_eq!(gaps.matches("<svg").count(), 3);
        assert_eq!(gaps.matches("<circle").count(), 3);
        // The smaller mean sits lower (a larger y) than the larger one in the same panel.
        let cy: Vec<f64> = gaps
            .lines()
            .filter_map(|l| l.split("cy=\"").nth(1))
            .map(|r| r.split('"').next().unwrap().parse().unwrap())
            .collect();
        assert!(cy[1] > cy[0], "{cy:?}");
    }

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
        let rec = |step, kind: &str, loss| Point {
            load: None,
            step,
            valid: kind == "valid",
            loss,
            gap: None,
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
    fn the_load_plot_has_a_line_per_statistic_and_only_for_sparse_runs() {
        let rec = |step, moe: Option<(f64, f64, f64)>| Point {
            step,
            valid: false,
            loss: 1.0,
            gap: None,
            load: moe.map(|(a, b, c)| [a, b, c]),
        };
        assert_eq!(load_svg("dense", &[rec(10, None), rec(20, None)]), None);
        let balanced = [
            rec(10, Some((1.5, 0.3, 0.0))),
            rec(20, Some((1.1, 0.1, 0.0))),
        ];
        let svg = load_svg("sparse", &balanced).unwrap();
        assert_eq!(svg.matches("<polyline").count(), 2, "{svg}");
        assert!(svg.contains("coefficient of variation") && !svg.contains("dropped"));
        let dropping = [
            rec(10, Some((1.5, 0.3, 0.2))),
            rec(20, Some((1.1, 0.1, 0.1))),
        ];
        let svg = load_svg("sparse", &dropping).unwrap();
        assert_eq!(svg.matches("<polyline").count(), 3, "{svg}");
    }

    #[test]
    fn the_gap_plot_is_logarithmic() {
        let rec = |step, kind: &str, gap: f64| Point {
            load: None,
            step,
            valid: kind == "valid",
            loss: 1.0 + gap,
            gap: Some(gap),
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
