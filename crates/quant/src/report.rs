//! The quantization report: `report.json` (everything, machine-readable)
//! and a self-contained `report.html` (inline SVG plots drawn with plotters,
//! no scripts, no external files).

use std::fmt::Write as _;

use std::collections::BTreeMap;

use plotters::prelude::*;
use qforge_runner::{Delivery, WorkerAccount};
use serde::Serialize;

use crate::error::{Error, Result};
use crate::guard::{Decision, GuardMetrics, PointReport};
use crate::recipe::QuantRecipe;
use crate::smoothing::SmoothingRecord;

/// The calibration run behind the statistics.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CalibrationSummary {
    /// `embedded` or `redis`.
    pub backend: String,
    /// Batches planned.
    pub planned: usize,
    /// Batches merged.
    pub merged: usize,
    /// Duplicate deliveries dropped.
    pub duplicates: usize,
    /// Retries.
    pub retries: usize,
    /// Wall seconds.
    pub seconds: f64,
    /// Per worker, by name.
    pub workers: BTreeMap<String, WorkerAccount>,
    /// Every delivered result, in arrival order.
    pub timeline: Vec<Delivery>,
    /// SHA-256 of the model, data and calibration recipe.
    pub model_sha256: String,
    /// SHA-256 of the data.
    pub data_sha256: String,
    /// SHA-256 of the calibration recipe.
    pub recipe_sha256: String,
    /// Every calibration pass of the recipe, in order (the fields above
    /// describe the first).
    pub passes: Vec<PassRecord>,
}

/// One calibration pass of a pipeline.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PassRecord {
    /// What it recorded (`smoothing`, `activation`).
    pub pass: String,
    /// Batches merged.
    pub merged: usize,
    /// Batches planned.
    pub planned: usize,
    /// Duplicate deliveries dropped.
    pub duplicates: usize,
    /// Retries.
    pub retries: usize,
    /// Wall seconds.
    pub seconds: f64,
}

/// GPTQ's rounding, when the recipe ran it (its Hessian passes are in
/// [`CalibrationSummary::passes`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GptqRecord {
    /// Linear layers whose int8 weights GPTQ rounded; the others (inputs
    /// without a usable Hessian) round to nearest.
    pub layers: usize,
    /// Seconds spent solving, after the passes.
    pub seconds: f64,
}

/// `report.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// qforge version.
    pub qforge_version: String,
    /// The source model.
    pub model: String,
    /// `policy` or `language-model`.
    pub kind: String,
    /// The recipe, as run.
    pub recipe: QuantRecipe,
    /// The calibration run.
    pub calibration: CalibrationSummary,
    /// GPTQ, if the recipe ran it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gptq: Option<GptqRecord>,
    /// SmoothQuant's α per input, if the recipe smoothed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub smoothing: Option<SmoothingRecord>,
    /// The method search, if the recipe searched (then `recipe` is the
    /// chosen method's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub method: Option<MethodSearch>,
    /// What the guard decided.
    pub decision: Decision,
}

/// Which methods the search tried, which it chose and why.
#[derive(Debug, Clone, Serialize)]
pub struct MethodSearch {
    /// The method whose artifact this is.
    pub chosen: String,
    /// Why it was chosen.
    pub reason: String,
    /// Every method tried, in order.
    pub tried: Vec<MethodTrial>,
}

/// One method of the search.
#[derive(Debug, Clone, Serialize)]
pub struct MethodTrial {
    /// Its name (`plain`, `smoothquant`, `residual-hadamard`, `quarot`, `quarot+gptq`,
    /// `hadamard-inputs`).
    pub method: String,
    /// The guard's measurement of its plan before any fallback.
    pub before: GuardMetrics,
    /// A static recipe whose plan missed the budget: the plan at the end of
    /// its ladder bounded to keep it mostly static (at most
    /// [`crate::guard::OFF_STATIC`] of the layers off static scales).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mostly_static: Option<MostlyStatic>,
    /// Its calibration passes and those measurements, seconds.
    pub seconds: f64,
}

/// A static plan at the end of its bounded ladder
/// ([`crate::guard::BoundedLadder`]).
#[derive(Debug, Clone, Serialize)]
pub struct MostlyStatic {
    /// Linear layers the ladder moved off their static scales (to dynamic
    /// activations or on to FP).
    pub moved_layers: usize,
    /// Linear layers in FP, the plan's own included.
    pub fp_layers: usize,
    /// The guard's measurement of that plan.
    pub metrics: GuardMetrics,
}

impl MethodTrial {
    /// The best measurement of the method: the mostly static plan's where
    /// there is one (it only exists where the plan as it stands missed the
    /// budget), else the plan's.
    pub fn best(&self) -> &GuardMetrics {
        self.mostly_static
            .as_ref()
            .map_or(&self.before, |m| &m.metrics)
    }
}

impl Report {
    /// `report.json`'s text.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("plain data serializes") + "\n"
    }

    /// `report.html`'s text.
    pub fn to_html(&self) -> Result<String> {
        let d = &self.decision;
        let mut html = String::new();
        self.write_header(&mut html);
        if let Some(search) = &self.method {
            write_method_search(&mut html, search);
        }
        if let Some(smoothing) = &self.smoothing {
            write_smoothing(&mut html, smoothing);
        }
        write_accuracy(&mut html, d);
        write_fallback(&mut html, d);
        html.push_str("<h2>Per-layer SQNR</h2><p>Output SQNR of each layer input's worst layer on held-out inputs: static scale (blue) and dynamic per-token (orange). Lower is noisier.</p>");
        html.push_str(&sqnr_chart(&d.point_reports)?);
        write_calibration(&mut html, &self.calibration)?;
        write_histograms(&mut html, &d.point_reports)?;
        let _ = writeln!(
            html,
            "<h2>Recipe</h2><pre>{}</pre></body></html>",
            escape(&self.recipe.to_toml())
        );
        Ok(html)
    }

    /// The document's head, the title and the outcome, with the refusal and
    /// the warnings.
    fn write_header(&self, html: &mut String) {
        let d = &self.decision;
        let outcome = if d.accepted {
            "<span class=ok>accepted</span>"
        } else {
            "<span class=bad>refused</span>"
        };
        let _ = write!(
            html,
            "<!doctype html><html lang=en><head><meta charset=utf-8>\
             <title>qforge quantization report</title><style>{STYLE}</style></head><body>\
             <h1>qforge quantization report</h1>\
             <p>Model <code>{model}</code> ({kind}), qforge {version}. Outcome: {outcome}.</p>",
            model = escape(&self.model),
            kind = escape(&self.kind),
            version = escape(&self.qforge_version),
        );
        if let Some(reason) = &d.refusal {
            let _ = write!(
                html,
                "<p class=bad>{} No artifact was written.</p>",
                escape(reason)
            );
        }
        for warning in &d.warnings {
            let _ = write!(html, "<p class=warn>warning: {}</p>", escape(warning));
        }
    }
}

/// "Method": what the search tried before the fallback, and what it chose;
/// the mostly static measurement's column only where a trial has one.
fn write_method_search(html: &mut String, search: &MethodSearch) {
    let mostly_static_column = search.tried.iter().any(|t| t.mostly_static.is_some());
    let _ = write!(
        html,
        "<h2>Method</h2><p>Chosen: <b>{}</b>, {}.</p><table><tr><th>method tried</th><th>before any fallback</th>{}<th>seconds</th></tr>",
        escape(&search.chosen),
        escape(&search.reason),
        if mostly_static_column {
            "<th>at the end of its bounded ladder</th>"
        } else {
            ""
        }
    );
    for trial in &search.tried {
        let mostly_static = match (&trial.mostly_static, mostly_static_column) {
            (_, false) => String::new(),
            (None, true) => "<td></td>".into(),
            (Some(m), true) => format!(
                "<td>{}</td>",
                escape(&format!(
                    "{} layers off static ({} FP): {}",
                    m.moved_layers,
                    m.fp_layers,
                    crate::guard::describe(&m.metrics)
                ))
            ),
        };
        let _ = write!(
            html,
            "<tr><td>{}</td><td>{}</td>{mostly_static}<td>{:.1}</td></tr>",
            escape(&trial.method),
            escape(&crate::guard::describe(&trial.before)),
            trial.seconds
        );
    }
    html.push_str("</table>");
}

/// "SmoothQuant": how α was chosen and how many inputs took each value.
fn write_smoothing(html: &mut String, smoothing: &SmoothingRecord) {
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for alpha in smoothing.alphas.values() {
        *counts.entry(format!("{alpha:.2}")).or_default() += 1;
    }
    let _ = write!(
        html,
        "<h2>SmoothQuant</h2><p>{} layer inputs smoothed: {}.</p><table><tr><th>α</th><th>inputs</th></tr>",
        smoothing.alphas.len(),
        escape(&smoothing.describe())
    );
    for (alpha, count) in counts {
        let _ = write!(html, "<tr><td>{alpha}</td><td>{count}</td></tr>");
    }
    html.push_str("</table>");
}

/// "Accuracy": the reference, the plan and the chosen configuration, and how
/// many layers stayed in FP.
fn write_accuracy(html: &mut String, d: &Decision) {
    html.push_str("<h2>Accuracy</h2><table><tr><th></th><th>metric</th></tr>");
    for (label, metrics) in [
        ("full precision", &d.reference),
        ("recipe, before fallback", &d.before),
        ("chosen", &d.after),
    ] {
        let _ = write!(
            html,
            "<tr><td>{label}</td><td>{}</td></tr>",
            escape(&metrics_text(metrics))
        );
    }
    let _ = write!(
        html,
        "</table><p>{} of {} linear layers in full precision (cap {}); calibration coverage {:.1} %.</p>",
        d.fp_layers,
        d.total_layers,
        d.max_fp_layers,
        100.0 * d.coverage
    );
}

/// "Fallback": every guard evaluation, then the whole ladder with its
/// applied prefix highlighted.
fn write_fallback(html: &mut String, d: &Decision) {
    html.push_str("<h2>Fallback</h2><p>Guard evaluations, in order:</p><table><tr><th>steps</th><th>FP layers</th><th>metric</th></tr>");
    for e in &d.evaluations {
        let _ = write!(
            html,
            "<tr><td>{}</td><td>{}</td><td>{}</td></tr>",
            e.steps,
            e.fp_layers,
            escape(&metrics_text(&e.metrics))
        );
    }
    let _ = write!(
        html,
        "</table><p>Demotions, noisiest rung first (language models: by the output KL with only that input quantized; policies: by SQNR); the first {} were applied:</p>\
         <table><tr><th>#</th><th>layer input</th><th>from</th><th>to</th><th>SQNR dB</th><th>output KL</th></tr>",
        d.applied_steps
    );
    for (i, step) in d.ladder.iter().enumerate() {
        let class = if i < d.applied_steps {
            " class=applied"
        } else {
            ""
        };
        let _ = write!(
            html,
            "<tr{class}><td>{}</td><td><code>{}</code></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            i + 1,
            escape(&step.point),
            step.from,
            step.to,
            db(step.sqnr_db),
            step.kl.map_or("–".into(), |kl| format!("{kl:.5}"))
        );
    }
    html.push_str("</table>");
}

/// "Calibration": the run's totals and hashes, per-worker table, timeline.
fn write_calibration(html: &mut String, c: &CalibrationSummary) -> Result<()> {
    html.push_str("<h2>Calibration</h2>");
    let _ = write!(
        html,
        "<p>{} backend: {}/{} batches merged, {} duplicates dropped, {} retries, {:.2} s. \
         Model sha256 <code>{}</code>, data <code>{}</code>, calibration recipe <code>{}</code>.</p>",
        escape(&c.backend),
        c.merged,
        c.planned,
        c.duplicates,
        c.retries,
        c.seconds,
        &c.model_sha256,
        &c.data_sha256,
        &c.recipe_sha256
    );
    html.push_str("<table><tr><th>worker</th><th>merged</th><th>duplicates</th><th>failures</th><th>busy s</th></tr>");
    for (name, w) in &c.workers {
        let _ = write!(
            html,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.2}</td></tr>",
            escape(name),
            w.merged,
            w.duplicates,
            w.failures,
            w.busy_seconds
        );
    }
    html.push_str("</table>");
    html.push_str(&timeline_chart(&c.workers, &c.timeline)?);
    Ok(())
}

/// "Activation histograms": one chart per layer input.
fn write_histograms(html: &mut String, points: &[PointReport]) -> Result<()> {
    html.push_str("<h2>Activation histograms</h2><p>|x| of every layer input (log–log), with each calibrator's threshold; the solid black line is the scale in use (static layers only).</p>");
    for point in points {
        let _ = write!(
            html,
            "<h3><code>{}</code> — {}{}</h3>",
            escape(&point.point),
            point.precision,
            if point.ignored {
                " (ignored by the recipe)"
            } else {
                ""
            }
        );
        html.push_str(&histogram_chart(point)?);
    }
    Ok(())
}

const STYLE: &str = "body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}\
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}\
tr.applied{background:#fff3d6}.ok{color:#17702b;font-weight:bold}.bad{color:#b00020;font-weight:bold}\
.warn{color:#8a5a00}h3{font-size:1em;margin-bottom:0}svg{display:block}";

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn db(value: Option<f64>) -> String {
    value.map_or("exact".into(), |v| format!("{v:.2}"))
}

fn metrics_text(m: &GuardMetrics) -> String {
    let mut parts = Vec::new();
    if let Some(a) = m.agreement {
        parts.push(format!("action agreement {:.3} %", 100.0 * a));
    }
    if let Some(p) = m.perplexity {
        parts.push(format!("perplexity {p:.4}"));
    }
    if let Some(p) = m.perplexity_increase {
        parts.push(format!("{:+.2} %", 100.0 * p));
    }
    if let Some([low, high]) = m.perplexity_increase_interval {
        parts.push(format!(
            "95 % interval {:+.2} … {:+.2} %",
            100.0 * low,
            100.0 * high
        ));
    }
    if let Some(k) = m.kl_divergence {
        parts.push(format!("KL {k:.5}"));
    }
    if let Some(t) = m.top1_agreement {
        parts.push(format!("top-1 {:.2} %", 100.0 * t));
    }
    parts.push(if m.passes { "passes" } else { "fails" }.into());
    parts.join(", ")
}

fn plot_error(e: impl std::fmt::Display) -> Error {
    Error::Report(format!("plot: {e}"))
}

fn sqnr_chart(points: &[PointReport]) -> Result<String> {
    let mut svg = String::new();
    let n = points.len().max(1);
    let values = points
        .iter()
        .flat_map(|p| [p.sqnr_static_db, p.sqnr_dynamic_db])
        .flatten();
    let top = values.fold(10.0f64, f64::max) + 5.0;
    {
        let root = SVGBackend::with_string(&mut svg, (1000, 320)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_error)?;
        let mut chart = ChartBuilder::on(&root)
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(45)
            .build_cartesian_2d(0f64..n as f64, 0f64..top)
            .map_err(plot_error)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_desc("layer input (forward order of names, see the tables)")
            .y_desc("SQNR dB")
            .draw()
            .map_err(plot_error)?;
        for (i, p) in points.iter().enumerate() {
            let x = i as f64;
            if let Some(s) = p.sqnr_static_db {
                chart
                    .draw_series([Rectangle::new(
                        [(x + 0.1, 0.0), (x + 0.5, s.max(0.0))],
                        BLUE.filled(),
                    )])
                    .map_err(plot_error)?;
            }
            if let Some(s) = p.sqnr_dynamic_db {
                chart
                    .draw_series([Rectangle::new(
                        [(x + 0.5, 0.0), (x + 0.9, s.max(0.0))],
                        RGBColor(230, 120, 20).filled(),
                    )])
                    .map_err(plot_error)?;
            }
        }
        root.present().map_err(plot_error)?;
    }
    Ok(svg)
}

/// Each delivered batch as a bar from (arrival − observation time) to its
/// arrival, one row per worker: blue merged, red dropped as a duplicate.
fn timeline_chart(
    workers: &BTreeMap<String, WorkerAccount>,
    timeline: &[Delivery],
) -> Result<String> {
    if timeline.is_empty() {
        return Ok("<p>(no batches were observed in this session: all resumed)</p>".into());
    }
    let row: BTreeMap<&str, usize> = workers
        .keys()
        .enumerate()
        .map(|(i, name)| (name.as_str(), i))
        .collect();
    let end = timeline
        .iter()
        .map(|d| d.at_seconds)
        .fold(0.0f64, f64::max)
        .max(1e-3)
        * 1.05;
    let mut svg = String::new();
    {
        let height = 90 + 26 * workers.len() as u32;
        let root = SVGBackend::with_string(&mut svg, (900, height)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_error)?;
        let mut chart = ChartBuilder::on(&root)
            .margin(8)
            .x_label_area_size(35)
            .y_label_area_size(10)
            .build_cartesian_2d(0f64..end, 0f64..workers.len().max(1) as f64)
            .map_err(plot_error)?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .y_labels(0)
            .x_desc("seconds since the run started (rows: workers in the table's order)")
            .draw()
            .map_err(plot_error)?;
        for d in timeline {
            let y = row.get(d.worker.as_str()).copied().unwrap_or(0) as f64;
            let colour = if d.merged {
                BLUE.mix(0.6)
            } else {
                RED.mix(0.8)
            };
            chart
                .draw_series([Rectangle::new(
                    [
                        ((d.at_seconds - d.busy_seconds).max(0.0), y + 0.2),
                        (d.at_seconds, y + 0.8),
                    ],
                    colour.filled(),
                )])
                .map_err(plot_error)?;
        }
        root.present().map_err(plot_error)?;
    }
    Ok(svg)
}

fn histogram_chart(point: &PointReport) -> Result<String> {
    let bins: Vec<(f64, u64)> = point
        .histogram
        .iter()
        .map(|&(lower, upper, count)| ((lower * upper).sqrt(), count))
        .collect();
    if bins.is_empty() {
        return Ok("<p>(no finite non-zero values observed)</p>".into());
    }
    let lo = bins.first().map_or(1e-6, |b| b.0) / 2.0;
    let hi = bins.last().map_or(1.0, |b| b.0) * 2.0;
    let max_count = bins.iter().map(|b| b.1).max().unwrap_or(1) as f64 * 2.0;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 230)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_error)?;
        let mut chart = ChartBuilder::on(&root)
            .margin(8)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d((lo..hi).log_scale(), (0.5f64..max_count).log_scale())
            .map_err(plot_error)?;
        chart
            .configure_mesh()
            .x_desc("|x|")
            .y_desc("count")
            .x_label_formatter(&|v| format!("{v:.0e}"))
            .y_label_formatter(&|v| format!("{v:.0}"))
            .draw()
            .map_err(plot_error)?;
        chart
            .draw_series(LineSeries::new(
                bins.iter().map(|&(x, c)| (x, c as f64)),
                RGBColor(60, 60, 60).stroke_width(1),
            ))
            .map_err(plot_error)?;
        let colours = [
            RGBColor(200, 30, 30),
            RGBColor(30, 120, 200),
            RGBColor(20, 150, 60),
            RGBColor(160, 60, 180),
            RGBColor(230, 120, 20),
        ];
        for ((name, threshold), colour) in point.thresholds.iter().zip(colours) {
            let Some(t) = threshold.map(f64::from).filter(|t| *t > lo && *t < hi) else {
                continue;
            };
            chart
                .draw_series(LineSeries::new(
                    [(t, 0.5), (t, max_count)],
                    colour.stroke_width(1),
                ))
                .map_err(plot_error)?
                .label(name.clone())
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 15, y)], colour.stroke_width(2))
                });
        }
        if let Some(scale) = point.input_scale {
            let t = f64::from(scale) * 127.0;
            chart
                .draw_series(LineSeries::new(
                    [(t, 0.5), (t, max_count)],
                    BLACK.stroke_width(2),
                ))
                .map_err(plot_error)?
                .label(format!("in use ({})", point.calibrator))
                .legend(|(x, y)| PathElement::new([(x, y), (x + 15, y)], BLACK.stroke_width(2)));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(plot_error)?;
        root.present().map_err(plot_error)?;
    }
    Ok(svg)
}

/// What `qforge quantize` prints when it is done: the decision's headline,
/// for people (`Display`, with the artifact's `out`) and programs
/// (`Serialize`).
#[derive(Serialize)]
pub struct Outcome<'a> {
    output: &'a std::path::Path,
    accepted: bool,
    /// The same as `accepted`: whether an artifact was written.
    artifact: bool,
    refusal: &'a Option<String>,
    report_json: std::path::PathBuf,
    report_html: std::path::PathBuf,
    held_out: &'a str,
    reference: &'a GuardMetrics,
    before: &'a GuardMetrics,
    after: &'a GuardMetrics,
    fp_layers: usize,
    total_layers: usize,
    method: &'a Option<MethodSearch>,
    fallback_steps: usize,
    guard_evaluations: usize,
    coverage: f64,
    warnings: &'a [String],
    #[serde(skip)]
    model: &'a std::path::Path,
}

impl Report {
    /// The outcome of quantizing `model` into `output`, the guard having
    /// evaluated on `held_out`.
    pub fn outcome<'a>(
        &'a self,
        model: &'a std::path::Path,
        held_out: &'a str,
        output: &'a std::path::Path,
    ) -> Outcome<'a> {
        let d = &self.decision;
        Outcome {
            output,
            accepted: d.accepted,
            artifact: d.accepted,
            refusal: &d.refusal,
            report_json: output.join("report.json"),
            report_html: output.join("report.html"),
            held_out,
            reference: &d.reference,
            before: &d.before,
            after: &d.after,
            fp_layers: d.fp_layers,
            total_layers: d.total_layers,
            method: &self.method,
            fallback_steps: d.applied_steps,
            guard_evaluations: d.evaluations.len(),
            coverage: d.coverage,
            warnings: &d.warnings,
            model,
        }
    }
}

impl std::fmt::Display for Outcome<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let method = self.method.as_ref().map_or(String::new(), |m| {
            format!(" ({} of {} methods tried)", m.chosen, m.tried.len())
        });
        writeln!(
            f,
            "quantized {}{method}: {}; {} of {} linear layers in FP",
            self.model.display(),
            crate::guard::describe(self.after),
            self.fp_layers,
            self.total_layers
        )?;
        let out = self.output.display();
        writeln!(f, "artifact: {out}/  (load it with --model {out})")?;
        write!(f, "report:   {}", self.report_html.display())
    }
}
