//! The SVG plot: fresh hand-off latency (p50) against buffer size, both
//! axes logarithmic, ours per mechanism (per buffer and from an arena)
//! against PyTorch and the driver floor; and, when the sets section ran, a
//! second chart of the weight-set hand-offs against the number of tensors.

use plotters::prelude::*;

use super::report::{Report, SectionId, human};

/// One line of the plot: a name and (size in bytes, p50 in ms) points.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// The legend text.
    pub name: String,
    /// The points, by increasing size.
    pub points: Vec<(f64, f64)>,
    /// Dashed (the floor) or solid.
    pub dashed: bool,
}

/// The series the plot draws from a report: ours (fresh hand-off) per
/// mechanism, PyTorch's fresh hand-off and each driver floor.
pub fn series(r: &Report) -> Vec<Series> {
    let mut out = Vec::new();
    let mut add = |name: String, id: SectionId, series: &str, variant: Option<&str>, dashed| {
        let Some(s) = r.section(id) else { return };
        let mut points: Vec<(f64, f64)> = s
            .rows
            .iter()
            .filter(|row| row.series == series && row.variant.as_deref() == variant)
            .filter_map(|row| Some((row.size? as f64, row.p50()?)))
            .filter(|(x, y)| *x > 0.0 && *y > 0.0 && y.is_finite())
            .collect();
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        if !points.is_empty() {
            out.push(Series {
                name,
                points,
                dashed,
            });
        }
    };
    for m in &r.mechanisms {
        add(format!("ours ({m})"), SectionId::Fresh, m, None, false);
    }
    for m in &r.mechanisms {
        add(
            format!("ours from an arena ({m})"),
            SectionId::Arena,
            m,
            None,
            false,
        );
    }
    add(
        "PyTorch (torch.multiprocessing)".into(),
        SectionId::Torch,
        "PyTorch",
        Some("fresh"),
        false,
    );
    for m in &r.mechanisms {
        add(
            format!("driver floor ({m})"),
            SectionId::Floor,
            &format!("{m} floor"),
            None,
            true,
        );
    }
    out
}

/// The weight-set series: (tensors, p50 in ms) points of ours, its update,
/// PyTorch's list and its bucket.
pub fn set_series(r: &Report) -> Vec<Series> {
    let Some(s) = r.section(SectionId::Sets) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (name, series, variant) in [
        ("ours, set hand-off", "ours", "set"),
        ("ours, set update", "ours", "update"),
        ("PyTorch, list of tensors", "PyTorch", "list"),
        ("PyTorch, flattened bucket", "PyTorch", "bucket"),
    ] {
        let mut points: Vec<(f64, f64)> = s
            .rows
            .iter()
            .filter(|row| row.series == series && row.variant.as_deref() == Some(variant))
            .filter(|row| row.error.is_none())
            .filter_map(|row| Some((row.count? as f64, row.p50()?)))
            .filter(|(x, y)| *x > 0.0 && *y > 0.0 && y.is_finite())
            .collect();
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        if !points.is_empty() {
            out.push(Series {
                name: name.into(),
                points,
                dashed: false,
            });
        }
    }
    out
}

/// One chart of the plot.
#[derive(Clone, Debug, PartialEq)]
pub struct Panel {
    /// Its caption.
    pub caption: String,
    /// The x axis: bytes (sizes) or a count (tensors).
    pub x_bytes: bool,
    /// The lines.
    pub series: Vec<Series>,
}

/// A decade-padded range around `values` for a log axis.
fn log_range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values.fold((f64::INFINITY, 0.0f64), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if !lo.is_finite() || hi <= 0.0 {
        return (1.0, 10.0);
    }
    (lo / 2.0, hi * 2.0)
}

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

/// Draws the panels, one under the other, as an SVG document.
pub fn render_svg(panels: &[Panel]) -> Result<String, String> {
    let mut svg = String::new();
    {
        let height = 600 * panels.len().max(1) as u32;
        let root = SVGBackend::with_string(&mut svg, (960, height)).into_drawing_area();
        let err = |e: DrawingAreaErrorKind<_>| format!("drawing the plot: {e}");
        root.fill(&WHITE).map_err(err)?;
        let areas = root.split_evenly((panels.len().max(1), 1));
        for (panel, area) in panels.iter().zip(&areas) {
            draw_panel(panel, area)?;
        }
        root.present().map_err(err)?;
    }
    Ok(svg)
}

/// Draws one panel on `area`.
fn draw_panel(
    panel: &Panel,
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<_>| format!("drawing the plot: {e}");
    let series = &panel.series;
    let (x0, x1) = log_range(series.iter().flat_map(|s| s.points.iter().map(|p| p.0)));
    let (y0, y1) = log_range(series.iter().flat_map(|s| s.points.iter().map(|p| p.1)));
    // Ticks at the measured sizes, which are what the reader looks for.
    let mut ticks: Vec<f64> = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .collect();
    ticks.sort_by(f64::total_cmp);
    ticks.dedup();
    if ticks.is_empty() {
        ticks = vec![x0, x1];
    }
    let mut chart = ChartBuilder::on(area)
        .caption(&panel.caption, ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(
            (x0..x1).log_scale().with_key_points(ticks),
            (y0..y1).log_scale(),
        )
        .map_err(err)?;
    let x_bytes = panel.x_bytes;
    chart
        .configure_mesh()
        .x_desc(if x_bytes {
            "buffer size"
        } else {
            "tensors in the set"
        })
        .y_desc("hand-off latency, p50 (ms)")
        .x_label_formatter(&|x| {
            if x_bytes {
                human_axis(*x)
            } else {
                format!("{x:.0}")
            }
        })
        .y_label_formatter(&|y| axis_ms(*y))
        .draw()
        .map_err(err)?;
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let style = ShapeStyle {
            color: color.to_rgba(),
            filled: false,
            stroke_width: 2,
        };
        if s.dashed {
            chart
                .draw_series(DashedLineSeries::new(s.points.iter().copied(), 8, 5, style))
                .map_err(err)?
                .label(s.name.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        } else {
            chart
                .draw_series(LineSeries::new(s.points.iter().copied(), style))
                .map_err(err)?
                .label(s.name.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
        chart
            .draw_series(s.points.iter().map(|p| Circle::new(*p, 4, color.filled())))
            .map_err(err)?;
    }
    if !series.is_empty() {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(err)?;
    }
    Ok(())
}

/// An axis label for milliseconds: at most 4 decimals, no trailing zeros.
fn axis_ms(y: f64) -> String {
    let s = format!("{y:.4}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s.is_empty() {
        "0".into()
    } else {
        s.to_string()
    }
}

/// An axis label for a byte count: the nearest binary unit.
fn human_axis(x: f64) -> String {
    let n = x.round().max(1.0) as u64;
    // Round to a power of two so that the ticks read as sizes.
    let p = 1u64 << n.ilog2();
    let near = if n - p > p / 2 { p << 1 } else { p };
    human(near)
}

/// Draws the report's plot and writes it to `path`.
pub fn write(r: &Report, path: &std::path::Path) -> Result<(), String> {
    let on = r
        .device
        .as_ref()
        .map(|d| format!(" on {}", d.name))
        .unwrap_or_default();
    let mut panels = vec![Panel {
        caption: format!("cuda-ipc fresh hand-off{on}"),
        x_bytes: true,
        series: series(r),
    }];
    let sets = set_series(r);
    if !sets.is_empty() {
        let total = r
            .section(SectionId::Sets)
            .and_then(|s| s.rows.iter().find_map(|row| row.size))
            .map(|t| format!(" of {}", human(t)))
            .unwrap_or_default();
        panels.push(Panel {
            caption: format!("cuda-ipc weight set{total} (fp32 tensors){on}"),
            x_bytes: false,
            series: sets,
        });
    }
    let svg = render_svg(&panels)?;
    std::fs::write(path, svg).map_err(|e| format!("writing the plot to {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::super::report::tests::synthetic;
    use super::*;

    #[test]
    fn series_from_a_report() {
        let r = synthetic();
        let s = series(&r);
        let names: Vec<&str> = s.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "ours (legacy)",
                "ours (vmm)",
                "ours from an arena (legacy)",
                "PyTorch (torch.multiprocessing)",
                "driver floor (legacy)",
                "driver floor (vmm)"
            ]
        );
        let sets = set_series(&r);
        let names: Vec<&str> = sets.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "ours, set hand-off",
                "ours, set update",
                "PyTorch, list of tensors",
                "PyTorch, flattened bucket"
            ]
        );
        assert_eq!(sets[2].points, vec![(100.0, 11.0), (1000.0, 56.0)]);
        // pool failed: no series; points sorted by size
        assert_eq!(s[0].points.len(), 2);
        assert!(s[0].points[0].0 < s[0].points[1].0);
        assert!(s[4].dashed && !s[0].dashed);
    }

    #[test]
    fn svg_names_every_series() {
        let r = synthetic();
        let dir = std::env::temp_dir().join(format!("cuda-ipc-bench-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bench.svg");
        write(&r, &path).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(
            svg.starts_with("<svg") || svg.starts_with("<?xml"),
            "{}",
            &svg[..80]
        );
        for name in [
            "ours (legacy)",
            "ours (vmm)",
            "PyTorch (torch.multiprocessing)",
            "driver floor (legacy)",
            "hand-off latency, p50 (ms)",
            "NVIDIA H200",
            "ours from an arena (legacy)",
            "weight set of 256MiB",
            "PyTorch, flattened bucket",
            "tensors in the set",
        ] {
            assert!(svg.contains(name), "{name} missing");
        }
        assert!(svg.contains("2MiB") && svg.contains("64MiB"), "size ticks");
    }

    #[test]
    fn empty_and_single_point_plots_render() {
        let panel = |caption: &str, series: Vec<Series>| Panel {
            caption: caption.into(),
            x_bytes: true,
            series,
        };
        let svg = render_svg(&[panel("nothing", Vec::new())]).unwrap();
        assert!(svg.contains("nothing"));
        let one = Series {
            name: "only".into(),
            points: vec![(2.0 * 1024.0 * 1024.0, 0.1)],
            dashed: false,
        };
        assert!(
            render_svg(&[panel("one", vec![one])])
                .unwrap()
                .contains("only")
        );
        assert!(render_svg(&[]).is_ok());
    }

    #[test]
    fn axis_labels_are_short() {
        assert_eq!(axis_ms(0.700_000_000_000_000_1), "0.7");
        assert_eq!(axis_ms(0.0153), "0.0153");
        assert_eq!(axis_ms(3100.0), "3100");
        assert_eq!(axis_ms(0.00001), "0");
    }

    #[test]
    fn axis_labels_are_sizes() {
        assert_eq!(human_axis(2.0 * 1_048_576.0), "2MiB");
        assert_eq!(human_axis(1.1 * 1_073_741_824.0), "1GiB");
        assert_eq!(human_axis(0.2), "1");
    }
}
