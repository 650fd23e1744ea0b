//! The report drawn as one SVG image: a grouped bar chart per section of the report, then
//! the goals as bars of "measured ÷ goal" around a line at 1.
//!
//! Only plotters' SVG backend is used. It writes text as SVG `<text>` and leaves the fonts
//! to the viewer, so nothing here loads or measures fonts: text widths are estimated from the
//! number of characters.

use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::report::{number, size_text, Goal, Report, Row};

const WIDTH: u32 = 1000;
const HEADER_HEIGHT: u32 = 64;
const PANEL_HEIGHT: u32 = 380;
/// The body of a report with nothing in it: room for one line saying so.
const EMPTY_HEIGHT: u32 = 60;
/// The column right of each chart that holds its legend.
const LEGEND_WIDTH: u32 = 200;
/// Room left of the goals' bars for their labels.
const GOAL_LABEL_WIDTH: u32 = 320;
/// Height per goal, so that a two-line label fits.
const GOAL_ROW_HEIGHT: u32 = 36;
/// The goals panel's height with few goals: room for its legend.
const GOALS_MIN_HEIGHT: u32 = 240;
/// A goal's bar is at most this thick, so that few goals do not make slabs.
const GOAL_BAR_PX: f64 = 22.0;
/// Above this ratio between the largest and the smallest positive value of a section, the
/// small bars would be invisible on a linear axis.
const LOG_ABOVE_RATIO: f64 = 20.0;
/// A goal met a hundredfold would squash every other bar; its bar stops here and its text
/// gives the number.
const SCORE_CAP: f64 = 5.0;
/// Values beyond this are garbage rather than measurements, and would overflow the axis
/// arithmetic (an axis running to infinity never finishes placing its ticks).
const MAX_MAGNITUDE: f64 = 1e100;
/// The most decades a log axis spans.
const MAX_DECADES: f64 = 9.0;
/// Share of a group's width taken by its bars; the rest separates the groups.
const GROUP_FILL: f64 = 0.8;
/// Average width of a character of a sans-serif font, in ems, to estimate text widths.
const CHAR_EM: f64 = 0.55;
/// plotters' SVG backend writes a font's size divided by 1.24 (its em-to-pixel guess for
/// bitmaps), so sizes are scaled up by that to land on the pixel size asked for.
const SVG_FONT_SCALE: f64 = 1.24;

/// Colours for xroce's own methods: strong, so xroce stands out.
const OURS: [RGBColor; 3] = [
    RGBColor(0x1f, 0x5f, 0xd0),
    RGBColor(0xe0, 0x6c, 0x00),
    RGBColor(0x7b, 0x2c, 0xbf),
];
/// Colours for the baselines: muted, and neither green nor red, which mean met and not met.
const BASELINES: [RGBColor; 7] = [
    RGBColor(0xa0, 0xa0, 0xa0),
    RGBColor(0xc9, 0xa9, 0x7e),
    RGBColor(0xa9, 0x9e, 0xc9),
    RGBColor(0x8f, 0xbc, 0xc4),
    RGBColor(0xb8, 0xb8, 0x82),
    RGBColor(0x8a, 0x9b, 0xb0),
    RGBColor(0xd8, 0xc4, 0x8c),
];
const MET: RGBColor = RGBColor(0x2e, 0x9e, 0x44);
const NOT_MET: RGBColor = RGBColor(0xd0, 0x3b, 0x2f);
const INK: RGBColor = RGBColor(0x22, 0x22, 0x22);
const FAINT_INK: RGBColor = RGBColor(0x66, 0x66, 0x66);
const GRID_LIGHT: RGBColor = RGBColor(0xee, 0xee, 0xee);
const GRID_BOLD: RGBColor = RGBColor(0xdd, 0xdd, 0xdd);

type Failure = Box<dyn std::error::Error>;
type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

/// The report as one SVG document: one panel per section of the report (in order), then a
/// panel for the goals when there are any.
pub fn svg(report: &Report) -> String {
    let palette = palette(report);
    let sections: Vec<Section> = report
        .sections()
        .into_iter()
        .map(|name| Section::new(report, name, &palette))
        .collect();
    let mut body = sections.len() as u32 * PANEL_HEIGHT;
    if !report.goals.is_empty() {
        body += goals_height(report.goals.len());
    }
    let size = (WIDTH, HEADER_HEIGHT + body.max(EMPTY_HEIGHT));
    let mut out = String::new();
    match draw(&mut out, size, report, &sections) {
        Ok(()) => out,
        Err(e) => fallback(size.0, &format!("the plot could not be drawn: {e}")),
    }
}

fn draw(
    out: &mut String,
    size: (u32, u32),
    report: &Report,
    sections: &[Section],
) -> Result<(), Failure> {
    let root = SVGBackend::with_string(out, size).into_drawing_area();
    root.fill(&WHITE)?;
    let (header_area, mut rest) = root.split_vertically(HEADER_HEIGHT);
    header(&header_area, report)?;
    for section in sections {
        let (panel, below) = rest.split_vertically(PANEL_HEIGHT);
        section_panel(&panel, section)?;
        rest = below;
    }
    if !report.goals.is_empty() {
        goals_panel(&rest, &report.goals)?;
    } else if sections.is_empty() {
        rest.draw(&Text::new(
            "Nothing was measured.",
            (20, 20),
            font(14.0).color(&FAINT_INK),
        ))?;
    }
    root.present()?;
    Ok(())
}

/// A stand-in document for when plotters fails, so the caller still writes an image and the
/// image says what went wrong.
fn fallback(width: u32, why: &str) -> String {
    let mut text = String::new();
    for c in why.chars() {
        match c {
            '<' => text.push_str("&lt;"),
            '>' => text.push_str("&gt;"),
            '&' => text.push_str("&amp;"),
            c => text.push(c),
        }
    }
    format!(
        "<svg width=\"{width}\" height=\"60\" viewBox=\"0 0 {width} 60\" \
         xmlns=\"http://www.w3.org/2000/svg\">\n\
         <rect width=\"{width}\" height=\"60\" fill=\"#FFFFFF\"/>\n\
         <text x=\"20\" y=\"35\" font-family=\"sans-serif\" font-size=\"14\">{text}</text>\n\
         </svg>\n"
    )
}

/// A sans-serif font of `px` pixels in the SVG.
fn font(px: f64) -> FontDesc<'static> {
    FontDesc::new(
        FontFamily::SansSerif,
        px * SVG_FONT_SCALE,
        FontStyle::Normal,
    )
}

fn bold(px: f64) -> FontDesc<'static> {
    FontDesc::new(FontFamily::SansSerif, px * SVG_FONT_SCALE, FontStyle::Bold)
}

/// How many characters of a `px` font fit in `width` pixels, about.
fn chars_in(width: f64, px: f64) -> usize {
    (width / (px * CHAR_EM)).floor().max(1.0) as usize
}

fn text_width(text: &str, px: f64) -> f64 {
    text.chars().count() as f64 * px * CHAR_EM
}

/// The report's title and where it was measured.
fn header(area: &Area, report: &Report) -> Result<(), Failure> {
    area.draw(&Text::new(
        "xroce next to the kernel, raw AF_XDP and rdma_rxe",
        (20, 14),
        bold(18.0).color(&INK).pos(Pos::new(HPos::Left, VPos::Top)),
    ))?;
    let facts: Vec<String> = [
        ("machine", &report.machine),
        ("commit", &report.commit),
        ("date", &report.date),
    ]
    .into_iter()
    .filter(|(_, v)| !v.is_empty())
    .map(|(k, v)| format!("{k}: {v}"))
    .collect();
    let line = shorten(
        &facts.join("  ·  "),
        chars_in(f64::from(WIDTH) - 40.0, 12.0),
    );
    area.draw(&Text::new(
        line,
        (20, 40),
        font(12.0)
            .color(&FAINT_INK)
            .pos(Pos::new(HPos::Left, VPos::Top)),
    ))?;
    Ok(())
}

/// Each method's colour, the same in every panel: xroce's own methods first and strong, then
/// the baselines muted, each in the order they first appear in the report. This order is also
/// the order of the bars in a group and of the legends.
fn palette(report: &Report) -> Vec<(&str, RGBColor)> {
    let mut methods: Vec<&str> = Vec::new();
    for r in &report.rows {
        if !methods.contains(&r.method.as_str()) {
            methods.push(&r.method);
        }
    }
    let is_ours = |m: &str| m == "xroce" || m.starts_with("xroce ");
    let ours = methods.iter().copied().filter(|m| is_ours(m));
    let baselines = methods.iter().copied().filter(|m| !is_ours(m));
    ours.zip(OURS.iter().cycle())
        .chain(baselines.zip(BASELINES.iter().cycle()))
        .map(|(m, c)| (m, *c))
        .collect()
}

/// One section of the report, ready to draw.
struct Section<'a> {
    title: String,
    unit: &'static str,
    groups: Vec<Group<'a>>,
    /// The methods with a bar in this section, in palette order.
    methods: Vec<(&'a str, RGBColor)>,
}

/// The bars of one (test, size) pair.
struct Group<'a> {
    label: String,
    /// At most one row per method, in palette order; rows without a [`plottable`] value are
    /// left out.
    bars: Vec<&'a Row>,
}

impl<'a> Section<'a> {
    fn new(report: &'a Report, name: &'a str, palette: &[(&'a str, RGBColor)]) -> Self {
        let rows: Vec<&Row> = report.section(name).collect();
        let unit = rows.first().map_or("", |r| r.kind.unit());
        let mut groups: Vec<(&str, u64, Vec<&Row>)> = Vec::new();
        for &r in &rows {
            let at = match groups
                .iter()
                .position(|(t, s, _)| *t == r.test && *s == r.size)
            {
                Some(at) => at,
                None => {
                    groups.push((&r.test, r.size, Vec::new()));
                    groups.len() - 1
                }
            };
            let bars = &mut groups[at].2;
            if plottable(r.value) && !bars.iter().any(|b| b.method == r.method) {
                bars.push(r);
            }
        }
        let rank = |method: &str| palette.iter().position(|(m, _)| *m == method);
        let groups: Vec<Group> = groups
            .into_iter()
            .map(|(test, size, mut bars)| {
                bars.sort_by_key(|r| rank(&r.method));
                Group {
                    label: group_label(test, size),
                    bars,
                }
            })
            .collect();
        let methods = palette
            .iter()
            .filter(|(m, _)| groups.iter().any(|g| g.bars.iter().any(|r| r.method == *m)))
            .copied()
            .collect();
        Section {
            title: if unit.is_empty() {
                name.to_string()
            } else {
                format!("{name} ({unit})")
            },
            unit,
            groups,
            methods,
        }
    }
}

fn plottable(v: f64) -> bool {
    v.is_finite() && v.abs() < MAX_MAGNITUDE
}

/// "ib_send_lat 64 B"; just the test when the size does not apply or the test already
/// says it ("64 B ping-pong").
fn group_label(test: &str, size: u64) -> String {
    if size == 0 {
        return test.to_string();
    }
    let size = size_text(size);
    if test.contains(&size) {
        test.to_string()
    } else {
        format!("{test} {size}")
    }
}

fn section_panel(area: &Area, section: &Section) -> Result<(), Failure> {
    let (chart_area, legend_area) = area.split_horizontally(WIDTH - LEGEND_WIDTH);
    let with_p99 = section
        .groups
        .iter()
        .flat_map(|g| &g.bars)
        .any(|r| r.p99.is_some_and(plottable));
    let note: &[&str] = if with_p99 {
        &["whisker: 99th percentile"]
    } else {
        &[]
    };
    legend(&legend_area, &section.methods, note)?;

    let values = || section.groups.iter().flat_map(|g| &g.bars).map(|r| r.value);
    // The tops include the p99 whiskers, so they fit under the top of the axis.
    let tops = || {
        section
            .groups
            .iter()
            .flat_map(|g| &g.bars)
            .flat_map(|r| [Some(r.value), r.p99.filter(|p| plottable(*p))])
            .flatten()
    };
    let positive_min = values().filter(|v| *v > 0.0).reduce(f64::min);
    let positive_max = values().filter(|v| *v > 0.0).reduce(f64::max);
    match (positive_min, positive_max) {
        (Some(lo), Some(hi)) if hi / lo > LOG_ABOVE_RATIO => {
            let top = tops().filter(|v| *v > 0.0).fold(hi, f64::max);
            let top = top * 2.5;
            // Whole decades at the bottom, so the smallest bar still has some height; at
            // most MAX_DECADES below the top (plotters walks every decade to place ticks,
            // and a bar 10^-9 of the largest is not readable anyway).
            let bottom = 10f64
                .powf(lo.log10().ceil() - 1.0)
                .max(10f64.powf(top.log10().floor() - MAX_DECADES));
            bars(
                &chart_area,
                section,
                (bottom..top).log_scale(),
                bottom,
                true,
            )
        }
        _ => {
            let low = tops().fold(0.0, f64::min);
            let high = tops().fold(0.0, f64::max);
            let (low, high) = if high - low > 0.0 {
                let span = high - low;
                (
                    if low < 0.0 { low - span * 0.05 } else { 0.0 },
                    high + span * 0.12,
                )
            } else {
                (0.0, 1.0)
            };
            bars(&chart_area, section, low..high, 0.0, false)
        }
    }
}

/// Draws the grouped bars of `section` on a y axis of `y_spec`, each bar rising from `base`.
fn bars<Y>(area: &Area, section: &Section, y_spec: Y, base: f64, log: bool) -> Result<(), Failure>
where
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let n = section.groups.len().max(1);
    let per_group = section
        .groups
        .iter()
        .map(|g| g.bars.len())
        .max()
        .unwrap_or(0)
        .max(1);
    let slot = GROUP_FILL / per_group as f64;

    const Y_LABEL_WIDTH: u32 = 64;
    let (area_w, _) = area.dim_in_pixel();
    let group_px = (f64::from(area_w) - f64::from(Y_LABEL_WIDTH) - 20.0) / n as f64;
    let label_px = if group_px < 60.0 { 9.5 } else { 11.0 };
    let labels: Vec<Vec<String>> = section
        .groups
        .iter()
        .map(|g| wrap(&g.label, chars_in(group_px, label_px), 3))
        .collect();
    let label_lines = labels.iter().map(Vec::len).max().unwrap_or(1) as u32;
    let line_px = (label_px * 1.25).ceil() as u32;

    let mut chart = ChartBuilder::on(area)
        .caption(&section.title, bold(15.0).color(&INK))
        .margin_top(10)
        .margin_left(10)
        .margin_right(10)
        .x_label_area_size(14 + label_lines * line_px)
        .y_label_area_size(Y_LABEL_WIDTH)
        .build_cartesian_2d(0.0..n as f64, y_spec)?;
    let tick_label = |v: &f64| tick(*v);
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_labels(8)
        .y_label_formatter(&tick_label)
        .y_desc(if log {
            format!("{}, log scale", section.unit)
        } else {
            section.unit.to_string()
        })
        .label_style(font(11.0).color(&INK))
        .axis_desc_style(font(12.0).color(&FAINT_INK))
        .light_line_style(GRID_LIGHT)
        .bold_line_style(GRID_BOLD)
        .draw()?;

    let shown = |v: f64| plottable(v) && (!log || v > 0.0);
    // The x extent of each bar: the bars of a group are centred on it, whatever methods it has.
    let placed: Vec<(f64, f64, &Row)> = section
        .groups
        .iter()
        .enumerate()
        .flat_map(|(i, g)| {
            let left = i as f64 + 0.5 - slot * g.bars.len() as f64 / 2.0;
            g.bars.iter().enumerate().map(move |(k, r)| {
                let x0 = left + slot * k as f64;
                (x0 + slot * 0.06, x0 + slot * 0.94, *r)
            })
        })
        .filter(|(_, _, r)| shown(r.value))
        .collect();
    for &(method, colour) in &section.methods {
        chart.draw_series(
            placed
                .iter()
                .filter(|(_, _, r)| r.method == method)
                .map(|&(x0, x1, r)| Rectangle::new([(x0, base), (x1, r.value)], colour.filled())),
        )?;
    }

    let whisker = INK.stroke_width(1);
    let mut whisker_tops: Vec<f64> = Vec::with_capacity(placed.len());
    for &(x0, x1, r) in &placed {
        let centre = (x0 + x1) / 2.0;
        match r.p99.filter(|p| shown(*p)) {
            Some(p99) => {
                let cap = (x1 - x0) * 0.2;
                chart.draw_series([
                    PathElement::new(vec![(centre, r.value), (centre, p99)], whisker),
                    PathElement::new(vec![(centre - cap, p99), (centre + cap, p99)], whisker),
                ])?;
                whisker_tops.push(p99.max(r.value));
            }
            None => whisker_tops.push(r.value),
        }
    }

    // Numbers and labels are placed in pixels, relative to this panel.
    let (ox, oy) = area.get_base_pixel();
    let pixel = |x: f64, y: f64| {
        let (px, py) = chart.backend_coord(&(x, y));
        (px - ox, py - oy)
    };
    let value_px = 9.5;
    for (&(x0, x1, r), &top) in placed.iter().zip(&whisker_tops) {
        let text = number(r.value);
        let (left, _) = pixel(x0, top);
        let (right, y) = pixel(x1, top);
        // A number wider than its bar would run into its neighbours' numbers.
        if text_width(&text, value_px) <= f64::from(right - left) + 6.0 {
            area.draw(&Text::new(
                text,
                ((left + right) / 2, y - 3),
                font(value_px)
                    .color(&INK)
                    .pos(Pos::new(HPos::Center, VPos::Bottom)),
            ))?;
        }
    }
    // Below the plot, which is not where `base` is when there are negative values.
    let (_, plot_y) = chart.plotting_area().get_pixel_range();
    let axis_y = plot_y.end - oy;
    for (i, lines) in labels.iter().enumerate() {
        let (x, _) = pixel(i as f64 + 0.5, base);
        for (k, line) in lines.iter().enumerate() {
            area.draw(&Text::new(
                line.clone(),
                (x, axis_y + 6 + k as i32 * line_px as i32),
                font(label_px)
                    .color(&INK)
                    .pos(Pos::new(HPos::Center, VPos::Top)),
            ))?;
        }
    }
    Ok(())
}

/// A colour swatch and a name per entry, then notes in grey.
fn legend(area: &Area, entries: &[(&str, RGBColor)], notes: &[&str]) -> Result<(), Failure> {
    const TEXT_PX: f64 = 12.0;
    let (width, _) = area.dim_in_pixel();
    let fits = chars_in(f64::from(width) - 40.0, TEXT_PX);
    let mut y = 44;
    for &(name, colour) in entries {
        area.draw(&Rectangle::new([(8, y), (22, y + 14)], colour.filled()))?;
        for line in wrap(name, fits, 2) {
            area.draw(&Text::new(
                line,
                (30, y + 7),
                font(TEXT_PX)
                    .color(&INK)
                    .pos(Pos::new(HPos::Left, VPos::Center)),
            ))?;
            y += 16;
        }
        y += 6;
    }
    for note in notes {
        for line in wrap(note, chars_in(f64::from(width) - 20.0, 11.0), 3) {
            area.draw(&Text::new(
                line,
                (8, y + 7),
                font(11.0)
                    .color(&FAINT_INK)
                    .pos(Pos::new(HPos::Left, VPos::Center)),
            ))?;
            y += 15;
        }
    }
    Ok(())
}

fn goals_height(goals: usize) -> u32 {
    GOALS_MIN_HEIGHT.max(140 + GOAL_ROW_HEIGHT * goals as u32)
}

/// How far a goal is met, > 1 when met: measured ÷ goal for "at least" goals, goal ÷ measured
/// for "at most" ones. `None` when there is no number to show.
fn score(goal: &Goal) -> Option<f64> {
    let s = if goal.at_least {
        goal.ratio / goal.target
    } else {
        goal.target / goal.ratio
    };
    if s.is_nan() {
        None
    } else {
        Some(s.clamp(0.0, SCORE_CAP))
    }
}

fn goals_panel(area: &Area, goals: &[Goal]) -> Result<(), Failure> {
    let (chart_area, legend_area) = area.split_horizontally(WIDTH - LEGEND_WIDTH);
    legend(
        &legend_area,
        &[("met", MET), ("not met", NOT_MET)],
        &[
            "bar: how far each goal is met, measured ÷ goal (goal ÷ measured for upper limits)",
            "right of the line at 1: met",
        ],
    )?;

    let n = goals.len();
    let scores: Vec<Option<f64>> = goals.iter().map(score).collect();
    let widest = scores.iter().flatten().fold(1.0, |a: f64, b| a.max(*b));
    let mut chart = ChartBuilder::on(&chart_area)
        .caption("Goals", bold(15.0).color(&INK))
        .margin_top(10)
        .margin_left(10)
        .margin_right(16)
        .x_label_area_size(40)
        .y_label_area_size(GOAL_LABEL_WIDTH)
        .build_cartesian_2d(0.0..widest * 1.15, 0.0..n as f64)?;
    let tick_label = |v: &f64| tick(*v);
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(0)
        .x_labels(8)
        .x_label_formatter(&tick_label)
        .x_desc("measured ÷ goal (1 = just met)")
        .label_style(font(11.0).color(&INK))
        .axis_desc_style(font(12.0).color(&FAINT_INK))
        .light_line_style(GRID_LIGHT)
        .bold_line_style(GRID_BOLD)
        .draw()?;

    // The first goal at the top.
    let centre = |i: usize| n as f64 - i as f64 - 0.5;
    let (_, plot_height) = chart.plotting_area().dim_in_pixel();
    let half = (GOAL_BAR_PX / 2.0 / (f64::from(plot_height) / n as f64)).min(0.3);
    chart.draw_series(
        goals
            .iter()
            .zip(&scores)
            .enumerate()
            .filter_map(|(i, (g, s))| {
                let colour = if g.met() { MET } else { NOT_MET };
                s.map(|s| {
                    Rectangle::new(
                        [(0.0, centre(i) - half), (s, centre(i) + half)],
                        colour.filled(),
                    )
                })
            }),
    )?;
    chart.draw_series(std::iter::once(PathElement::new(
        vec![(1.0, 0.0), (1.0, n as f64)],
        INK.stroke_width(2),
    )))?;

    let (ox, oy) = chart_area.get_base_pixel();
    let pixel = |x: f64, y: f64| {
        let (px, py) = chart.backend_coord(&(x, y));
        (px - ox, py - oy)
    };
    let (plot_left, _) = pixel(0.0, 0.0);
    let (plot_right, _) = pixel(widest * 1.15, 0.0);
    const TEXT_PX: f64 = 11.0;
    for (i, (goal, s)) in goals.iter().zip(&scores).enumerate() {
        let (_, y) = pixel(0.0, centre(i));
        let lines = wrap(
            &goal.what,
            chars_in(f64::from(GOAL_LABEL_WIDTH) - 16.0, 12.0),
            2,
        );
        let first = y - (lines.len() as i32 - 1) * 8;
        for (k, line) in lines.into_iter().enumerate() {
            chart_area.draw(&Text::new(
                line,
                (plot_left - 8, first + k as i32 * 16),
                font(12.0)
                    .color(&INK)
                    .pos(Pos::new(HPos::Right, VPos::Center)),
            ))?;
        }
        let said = match s {
            Some(_) => format!(
                "{} (goal {} {}{})",
                goal.ratio_text(),
                if goal.at_least { "≥" } else { "≤" },
                number(goal.target),
                if !goal.met() && goal.out_of_reach.is_some() {
                    ", out of reach"
                } else {
                    ""
                }
            ),
            None => "no number".to_string(),
        };
        let (end, _) = pixel(s.unwrap_or(0.0), centre(i));
        // After the bar when there is room, else inside its end, in white.
        let (x, anchor, colour) =
            if f64::from(end + 6) + text_width(&said, TEXT_PX) <= f64::from(plot_right) {
                (end + 6, HPos::Left, INK)
            } else {
                (end - 6, HPos::Right, WHITE)
            };
        chart_area.draw(&Text::new(
            said,
            (x, y),
            font(TEXT_PX)
                .color(&colour)
                .pos(Pos::new(anchor, VPos::Center)),
        ))?;
    }
    Ok(())
}

/// `text` in lines of at most `width` characters, broken after spaces, underscores and
/// hyphens, at most `max_lines` of them (the last one ending in "…" when cut).
fn wrap(text: &str, width: usize, max_lines: usize) -> Vec<String> {
    let width = width.max(2);
    // Words with the separator that ends them: a space is dropped, '_' and '-' are kept.
    let mut words: Vec<(String, bool)> = Vec::new();
    let mut word = String::new();
    for c in text.chars() {
        match c {
            ' ' => {
                if !word.is_empty() {
                    words.push((std::mem::take(&mut word), true));
                }
            }
            '_' | '-' | '/' => {
                word.push(c);
                words.push((std::mem::take(&mut word), false));
            }
            c => word.push(c),
        }
    }
    if !word.is_empty() {
        words.push((word, true));
    }

    let mut lines: Vec<String> = Vec::new();
    let mut line = String::new();
    let mut space_after_line = false;
    for (word, space_after) in words {
        let joined = if line.is_empty() {
            word.clone()
        } else if space_after_line {
            format!("{line} {word}")
        } else {
            format!("{line}{word}")
        };
        if joined.chars().count() <= width {
            line = joined;
        } else {
            if !line.is_empty() {
                lines.push(std::mem::take(&mut line));
            }
            // A word longer than a line is cut into pieces.
            let chars: Vec<char> = word.chars().collect();
            let mut pieces = chars
                .chunks(width)
                .map(|c| c.iter().collect::<String>())
                .peekable();
            while let Some(piece) = pieces.next() {
                if pieces.peek().is_some() {
                    lines.push(piece);
                } else {
                    line = piece;
                }
            }
        }
        space_after_line = space_after;
    }
    if !line.is_empty() {
        lines.push(line);
    }
    if lines.len() > max_lines {
        lines.truncate(max_lines);
        if let Some(last) = lines.last_mut() {
            *last = shorten(&format!("{last}…"), width);
        }
    }
    lines
}

/// `text` cut to `width` characters, ending in "…" when cut.
fn shorten(text: &str, width: usize) -> String {
    if text.chars().count() <= width {
        return text.to_string();
    }
    let mut out: String = text.chars().take(width.saturating_sub(1)).collect();
    out.push('…');
    out
}

/// An axis label: like [`number`], without trailing zeros.
fn tick(v: f64) -> String {
    if v != 0.0 && v.abs() < 0.001 {
        return format!("{v:.0e}");
    }
    let s = number(v);
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Kind;

    fn lat(test: &str, size: u64, method: &str, value: f64) -> Row {
        Row {
            p99: Some(value * 1.6),
            ..Row::new("Latency", test, size, method, Kind::LatencyUs, value)
        }
    }

    fn bw(test: &str, size: u64, method: &str, value: f64) -> Row {
        Row::new(
            "Bandwidth",
            test,
            size,
            method,
            Kind::MegabytesPerSecond,
            value,
        )
    }

    /// Two sections (latency with p99, bandwidth over more than 20×) and two goals, one met.
    pub(super) fn sample() -> Report {
        Report {
            machine: "2 CPUs, Intel(R) Xeon(R) Processor, kernel 6.18.44".into(),
            commit: "5da6a39".into(),
            date: "2025-01-01".into(),
            rows: vec![
                lat(
                    "64 B ping-pong, one way",
                    64,
                    "raw AF_XDP (busy-polled)",
                    2.1,
                ),
                lat("64 B ping-pong, one way", 64, "kernel UDP", 9.8),
                lat("64 B ping-pong, one way", 64, "kernel TCP", 11.5),
                lat("ib_send_lat", 64, "xroce", 5.6),
                lat("ib_send_lat", 4096, "xroce", 8.9),
                lat("ib_send_lat", 64, "rdma_rxe", 14.2),
                lat("ib_write_lat", 64, "xroce", 5.1),
                lat("ib_read_lat", 64, "xroce", 10.4),
                bw("ib_write_bw", 64, "xroce", 41.0),
                bw("ib_write_bw", 4096, "xroce", 1480.0),
                bw("ib_write_bw", 65536, "xroce", 2630.0),
                bw("4 KiB frames", 4096, "raw AF_XDP (busy-polled)", 3050.0),
                bw("4 KiB frames", 4096, "kernel UDP", 1210.0),
                bw("ib_write_bw", 65536, "rdma_rxe", 880.0),
            ],
            goals: vec![
                Goal {
                    what: "64 B ib_send_lat vs raw AF_XDP one-way".into(),
                    ratio: 2.67,
                    target: 1.5,
                    at_least: false,
                    detail: "5.60 / 2.10 µs".into(),
                    out_of_reach: None,
                },
                Goal {
                    what: "ib_write_bw 64 KiB vs kernel UDP 4 KiB datagrams".into(),
                    ratio: 2.17,
                    target: 1.5,
                    at_least: true,
                    detail: "2630 / 1210 MB/s".into(),
                    out_of_reach: None,
                },
            ],
            notes: Vec::new(),
        }
    }

    #[test]
    fn draws_every_section_method_and_goal() {
        let report = sample();
        let svg = svg(&report);
        assert!(svg.starts_with("<svg"), "{svg}");
        assert!(svg.contains("Latency (µs)"), "{svg}");
        assert!(svg.contains("Bandwidth (MB/s)"), "{svg}");
        for method in [
            "xroce",
            "raw AF_XDP (busy-polled)",
            "kernel UDP",
            "kernel TCP",
            "rdma_rxe",
        ] {
            assert!(
                svg.contains(&format!(">\n{method}\n</text>")),
                "no legend for {method}: {svg}"
            );
        }
        for goal in &report.goals {
            // Labels may be wrapped, so look for their first word.
            let first = goal.what.split(' ').next().unwrap_or_default();
            assert!(svg.contains(first), "no label for {}: {svg}", goal.what);
        }
        assert!(
            svg.contains("(goal ≤ 1.50)") && svg.contains("(goal ≥ 1.50)"),
            "{svg}"
        );
        // A background, a rectangle per bar, a swatch per legend entry, a bar per goal.
        let bars = report.rows.len() + report.goals.len();
        assert!(svg.matches("<rect").count() > bars, "{svg}");
        // Met in green, not met in red.
        assert!(svg.contains("#2E9E44") && svg.contains("#D03B2F"), "{svg}");
        // The bandwidth spans 41 to 3050 MB/s: a log axis, labelled in decades.
        assert!(svg.contains(">\n1000\n</text>"), "{svg}");
        assert!(!svg.contains("out of reach"), "{svg}");
        // A missed goal that no stack could meet on the path says so by its bar.
        let mut floored = report.clone();
        floored.goals[0].out_of_reach = Some("the floor misses it".into());
        let floored = super::svg(&floored);
        assert!(floored.contains("(goal ≤ 1.50, out of reach)"), "{floored}");
    }

    #[test]
    fn empty_and_odd_reports_do_not_panic() {
        let svg = svg(&Report::default());
        assert!(
            svg.starts_with("<svg") && svg.contains("Nothing was measured"),
            "{svg}"
        );

        let one = Report {
            rows: vec![bw("ib_write_bw", 0, "xroce", 12.0)],
            ..Report::default()
        };
        assert!(super::svg(&one).contains("ib_write_bw"));

        let odd = Report {
            rows: vec![
                bw("a", 64, "xroce", 0.0),
                bw("b", 64, "xroce", -3.0),
                bw("c", 64, "xroce", f64::NAN),
                bw("d", 64, "xroce", f64::INFINITY),
                bw("e", 64, "xroce", 1000.0),
                bw("e", 64, "xroce", 5.0),
                bw("h", 64, "xroce", f64::MAX),
                bw("h", 64, "kernel UDP", f64::MIN_POSITIVE),
                bw("h", 64, "kernel TCP", 1e99),
                Row {
                    p99: Some(f64::NAN),
                    ..lat("f", 0, "kernel UDP", 0.0)
                },
                lat("g", 0, "kernel UDP", 1e-9),
                lat("g", 0, "kernel TCP", 1e9),
            ],
            goals: vec![
                Goal {
                    what: "x".repeat(300),
                    ratio: 0.0,
                    target: 1.0,
                    at_least: false,
                    detail: String::new(),
                    out_of_reach: None,
                },
                Goal {
                    what: String::new(),
                    ratio: f64::NAN,
                    target: 0.0,
                    at_least: true,
                    detail: String::new(),
                    out_of_reach: None,
                },
                Goal {
                    what: "negative".into(),
                    ratio: -1.0,
                    target: 2.0,
                    at_least: true,
                    detail: String::new(),
                    out_of_reach: None,
                },
            ],
            ..Report::default()
        };
        let svg = super::svg(&odd);
        assert!(
            svg.starts_with("<svg") && !svg.contains("could not be drawn"),
            "{svg}"
        );
    }

    #[test]
    fn wraps_at_spaces_and_underscores() {
        assert_eq!(wrap("ib_send_lat 64 B", 12, 3), ["ib_send_lat", "64 B"]);
        assert_eq!(
            wrap("ib_write_lat 64 KiB", 9, 3),
            ["ib_write_", "lat 64", "KiB"]
        );
        assert_eq!(wrap("abcdefghij", 4, 3), ["abcd", "efgh", "ij"]);
        assert_eq!(wrap("one two three four", 4, 2), ["one", "two…"]);
        assert!(wrap("", 10, 2).is_empty());
    }

    #[test]
    fn numbers_read_naturally() {
        assert_eq!(tick(0.5), "0.5");
        assert_eq!(tick(2000.0), "2000");
        assert_eq!(tick(12.0), "12");
        assert_eq!(group_label("ib_send_lat", 64), "ib_send_lat 64 B");
        assert_eq!(group_label("64 B ping-pong", 64), "64 B ping-pong");
        assert_eq!(group_label("1 QP", 0), "1 QP");
    }
}
