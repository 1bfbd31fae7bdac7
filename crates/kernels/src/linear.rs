//! The INT8 linear layer: `y = x Wᵀ + b` with int8 weights and activations.

use qforge_core::CpuTier;

use crate::error::{Error, Result};
use crate::gemm::{GemmTier, PANEL, PackedWeights, WEIGHT_QMAX};
use crate::quantize::{ROUNDER, ZERO_POINT, quantize_per_token, quantize_static};

/// Quantizes the rows of `weight` (rows of `cols` values) symmetrically, each
/// with its own scale `max|w| / qmax` (1 for an all-zero row), rounding half
/// to even. Returns the int8 values and the scales.
pub fn quantize_rows_symmetric(weight: &[f32], cols: usize, qmax: i8) -> (Vec<i8>, Vec<f32>) {
    let qmax_f = f32::from(qmax);
    let mut values = Vec::with_capacity(weight.len());
    let mut scales = Vec::with_capacity(weight.len() / cols.max(1));
    for row in weight.chunks_exact(cols) {
        let max = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = if max > 0.0 { max / qmax_f } else { 1.0 };
        values.extend(
            row.iter()
                // The rounder is `round_ties_even` without its libm call.
                .map(|&w| (((w / scale).clamp(-qmax_f, qmax_f) + ROUNDER) - ROUNDER) as i8),
        );
        scales.push(scale);
    }
    (values, scales)
}

/// How activations are quantized.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Activations {
    /// Each row (token) by its own abs-max, at run time.
    Dynamic,
    /// One calibrated scale for the whole tensor.
    Static(f32),
}

/// Buffers a forward reuses, so that a decode loop does not allocate once
/// they have grown to the largest layer.
#[derive(Debug, Default)]
pub struct Scratch {
    quantized: Vec<u8>,
    row_scales: Vec<f32>,
    /// Raw sums, `[part][panel][row][PANEL]`: one part per thread when the
    /// threads split the inputs.
    sums: Vec<i32>,
}

/// A linear layer with int8 symmetric per-output-channel weights, prepacked
/// for the GEMM.
pub struct Int8Linear {
    packed: PackedWeights,
    scales: Vec<f32>,
    bias: Option<Vec<f32>>,
    activations: Activations,
    out_features: usize,
    in_features: usize,
}

impl std::fmt::Debug for Int8Linear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Int8Linear")
            .field("out_features", &self.out_features)
            .field("in_features", &self.in_features)
            .field("activations", &self.activations)
            .finish_non_exhaustive()
    }
}

impl Int8Linear {
    /// Quantizes `weight` (`[out, in]`, row-major) per output channel and
    /// prepacks it.
    pub fn new(
        weight: &[f32],
        (out_features, in_features): (usize, usize),
        bias: Option<&[f32]>,
        activations: Activations,
    ) -> Result<Self> {
        if out_features == 0 || in_features == 0 || weight.len() != out_features * in_features {
            return Err(Error::Shape(format!(
                "{} weights for a [{out_features}, {in_features}] layer",
                weight.len()
            )));
        }
        let (values, scales) = quantize_rows_symmetric(weight, in_features, WEIGHT_QMAX);
        Self::from_quantized(
            &values,
            scales,
            (out_features, in_features),
            bias,
            activations,
        )
    }

    /// Prepacks weights quantized already (`values[o·in + i] × scales[o]`),
    /// e.g. read back from an artifact.
    pub fn from_quantized(
        values: &[i8],
        scales: Vec<f32>,
        (out_features, in_features): (usize, usize),
        bias: Option<&[f32]>,
        activations: Activations,
    ) -> Result<Self> {
        if out_features == 0
            || in_features == 0
            || values.len() != out_features * in_features
            || scales.len() != out_features
        {
            return Err(Error::Shape(format!(
                "{} weights and {} scales for a [{out_features}, {in_features}] layer",
                values.len(),
                scales.len()
            )));
        }
        if let Some(b) = bias
            && b.len() != out_features
        {
            return Err(Error::Shape(format!(
                "{} biases for {out_features} outputs",
                b.len()
            )));
        }
        if let Some(bad) = scales.iter().find(|s| !(s.is_finite() && **s > 0.0)) {
            return Err(Error::Shape(format!(
                "weight scale {bad} is not a positive finite number"
            )));
        }
        let tier = GemmTier::detect();
        let packed = PackedWeights::new(tier, values, out_features, in_features)?;
        Ok(Self {
            packed,
            scales,
            bias: bias.map(<[f32]>::to_vec),
            activations,
            out_features,
            in_features,
        })
    }

    /// `(out, in)`.
    pub fn shape(&self) -> (usize, usize) {
        (self.out_features, self.in_features)
    }

    /// How activations are quantized.
    pub fn activations(&self) -> Activations {
        self.activations
    }

    /// The per-output-channel weight scales.
    pub fn weight_scales(&self) -> &[f32] {
        &self.scales
    }

    /// Bytes of the prepacked weights and their scales.
    pub fn weight_bytes(&self) -> usize {
        self.out_features * self.in_features + 4 * self.scales.len()
    }

    /// `y = x Wᵀ + b` for `x` of `rows × in` values into `y` of `rows × out`.
    pub fn forward_into(
        &self,
        x: &[f32],
        rows: usize,
        scratch: &mut Scratch,
        y: &mut [f32],
    ) -> Result<()> {
        let (n, k) = (self.out_features, self.in_features);
        if x.len() != rows * k || y.len() != rows * n {
            return Err(Error::Shape(format!(
                "{} inputs and {} outputs for {rows} rows of a [{n}, {k}] layer",
                x.len(),
                y.len()
            )));
        }
        if rows == 0 {
            return Ok(());
        }
        self.quantize(x, rows, &mut scratch.quantized, &mut scratch.row_scales)?;
        let parts = self
            .packed
            .sums(&scratch.quantized, rows, &mut scratch.sums);
        let part_len = scratch.sums.len() / parts;
        self.dequantize(&scratch.sums, parts, part_len, &scratch.row_scales, y);
        Ok(())
    }

    /// The packed weights, for callers that schedule the GEMM themselves.
    pub fn packed(&self) -> &PackedWeights {
        &self.packed
    }

    /// Quantizes `rows` rows of `x` as this layer's activations into `q`
    /// (rows of [`PackedWeights::row_stride`] bytes, padding at the zero
    /// point) and their scales into `row_scales`.
    pub fn quantize(
        &self,
        x: &[f32],
        rows: usize,
        q: &mut Vec<u8>,
        row_scales: &mut Vec<f32>,
    ) -> Result<()> {
        let k = self.in_features;
        if x.len() != rows * k {
            return Err(Error::Shape(format!(
                "{} inputs for {rows} rows of {k}",
                x.len()
            )));
        }
        let stride = self.packed.row_stride();
        q.resize(rows * stride, ZERO_POINT);
        row_scales.resize(rows, 0.0);
        for ((x, q), scale) in x
            .chunks_exact(k)
            .zip(q.chunks_exact_mut(stride))
            .zip(row_scales.iter_mut())
        {
            let (q, padding) = q.split_at_mut(k);
            match self.activations {
                Activations::Dynamic => {
                    quantize_per_token(x, k, q, std::slice::from_mut(scale))?;
                }
                Activations::Static(s) => {
                    quantize_static(x, s, q)?;
                    *scale = s;
                }
            }
            padding.fill(ZERO_POINT);
        }
        Ok(())
    }

    /// Raw sums → outputs: `(Σ parts − offset) × row scale × channel scale +
    /// bias`, where part `i` of the sums starts at `sums[i · part_stride]`,
    /// laid out `[panel][row][PANEL]` ([`PackedWeights::raw_sums`]).
    pub fn dequantize(
        &self,
        sums: &[i32],
        parts: usize,
        part_stride: usize,
        row_scales: &[f32],
        y: &mut [f32],
    ) {
        let n = self.out_features;
        let rows = row_scales.len();
        assert!(
            y.len() == rows * n
                && parts >= 1
                && sums.len() >= (parts - 1) * part_stride + self.packed.panels() * rows * PANEL,
            "dequantize: sums and outputs do not fit the layer"
        );
        let mut acc = [0i32; PANEL];
        for (r, (out, &row_scale)) in y.chunks_exact_mut(n).zip(row_scales).enumerate() {
            for (p, out) in out.chunks_mut(PANEL).enumerate() {
                let width = out.len();
                let at = (p * rows + r) * PANEL;
                acc[..width].copy_from_slice(&sums[at..at + width]);
                for part in 1..parts {
                    let from = &sums[part * part_stride + at..part * part_stride + at + width];
                    for (a, &s) in acc.iter_mut().zip(from) {
                        *a += s;
                    }
                }
                self.epilogue(p, &acc[..width], row_scale, out);
            }
        }
    }

    /// [`Self::dequantize`] of one panel's columns: `sums` holds the panel's
    /// complete raw sums, `[row][PANEL]` (one panel of
    /// [`PackedWeights::raw_sums`] over all input groups), and its columns
    /// of every row of `y` (`rows × out` values) are written; the other
    /// columns are left as they are. Lets a caller that owns whole rows of
    /// the output turn each panel's sums into outputs while they are in cache.
    pub fn dequantize_panel(&self, panel: usize, sums: &[i32], row_scales: &[f32], y: &mut [f32]) {
        let n = self.out_features;
        let rows = row_scales.len();
        assert!(
            panel < self.packed.panels() && sums.len() == rows * PANEL && y.len() == rows * n,
            "dequantize_panel: sums and outputs do not fit the layer"
        );
        let cols = panel * PANEL..(panel * PANEL + PANEL).min(n);
        for ((out, sums), &row_scale) in y
            .chunks_exact_mut(n)
            .zip(sums.chunks_exact(PANEL))
            .zip(row_scales)
        {
            let out = &mut out[cols.clone()];
            self.epilogue(panel, &sums[..out.len()], row_scale, out);
        }
    }

    /// One row's outputs of panel `panel` from its summed raw sums `acc`.
    fn epilogue(&self, panel: usize, acc: &[i32], row_scale: f32, out: &mut [f32]) {
        let cols = panel * PANEL..panel * PANEL + out.len();
        let offsets = &self.packed.offsets()[cols.clone()];
        let channels = &self.scales[cols.clone()];
        for (((o, &a), &off), &c) in out.iter_mut().zip(acc).zip(offsets).zip(channels) {
            *o = (a - off) as f32 * (row_scale * c);
        }
        if let Some(bias) = &self.bias {
            for (o, &b) in out.iter_mut().zip(&bias[cols]) {
                *o += b;
            }
        }
    }

    /// [`Int8Linear::forward_into`] into a fresh vector.
    pub fn forward(&self, x: &[f32], rows: usize, scratch: &mut Scratch) -> Result<Vec<f32>> {
        let mut y = vec![0f32; rows * self.out_features];
        self.forward_into(x, rows, scratch, &mut y)?;
        Ok(y)
    }
}
