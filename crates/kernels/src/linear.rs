//! The INT8 linear layer: `y = x Wᵀ + b` with int8 weights and activations.

use rten_gemm::{GemmExecutor, GemmInputA, GemmInputB, GemmOptions, PackedBMatrix, QuantParams};
use rten_tensor::NdTensorView;

use crate::error::{Error, Result};
use crate::quantize::{ZERO_POINT, quantize_per_token, quantize_static};

thread_local! {
    // The executor is not `Sync`; each thread detects the same kernel, so
    // weights packed on one thread serve every other.
    static EXECUTOR: GemmExecutor<u8, i8, i32> = GemmExecutor::new();
}

fn with_executor<T>(f: impl FnOnce(&GemmExecutor<u8, i8, i32>) -> T) -> T {
    EXECUTOR.with(f)
}

/// Name of the GEMM kernel this CPU runs (e.g. `avx2-u8i8i32`).
pub fn gemm_kernel_name() -> String {
    with_executor(|e| e.kernel_name().to_owned())
}

/// Largest weight magnitude the GEMM can take exactly: 127, or 63 where the
/// kernel can saturate. AVX2 without VNNI multiplies u8 × i8 pairs with
/// `vpmaddubsw`, whose i16 sum of two products saturates above 32 767; with
/// |w| ≤ 63 the worst pair, 2 × 255 × 63 = 32 130, fits (the same 7-bit
/// remedy as ONNX Runtime's `reduce_range`).
pub fn weight_qmax() -> i8 {
    if with_executor(GemmExecutor::may_saturate) {
        63
    } else {
        127
    }
}

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
                .map(|&w| (w / scale).clamp(-qmax_f, qmax_f).round_ties_even() as i8),
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
    zero_points: Vec<u8>,
    accumulators: Vec<i32>,
}

/// A linear layer with int8 symmetric per-output-channel weights, prepacked
/// for the GEMM.
pub struct Int8Linear {
    packed: PackedBMatrix<i8>,
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
        let (values, scales) = quantize_rows_symmetric(weight, in_features, weight_qmax());
        Self::from_quantized(
            &values,
            scales,
            (out_features, in_features),
            bias,
            activations,
        )
    }

    /// Prepacks weights quantized already (`values[o·in + i] × scales[o]`),
    /// e.g. read back from an artifact. Values beyond what this CPU's GEMM
    /// takes exactly ([`weight_qmax`]: an artifact written on a VNNI machine
    /// and loaded on plain AVX2) are requantized to the narrower range from
    /// their dequantized values.
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
        let qmax = weight_qmax();
        let narrowed;
        let (values, scales) = if values
            .iter()
            .any(|v| v.unsigned_abs() > qmax.unsigned_abs())
        {
            let dequantized: Vec<f32> = values
                .chunks_exact(in_features)
                .zip(&scales)
                .flat_map(|(row, &s)| row.iter().map(move |&v| f32::from(v) * s))
                .collect();
            narrowed = quantize_rows_symmetric(&dequantized, in_features, qmax);
            (&narrowed.0[..], narrowed.1.clone())
        } else {
            (values, scales)
        };
        // The GEMM multiplies A [m, k] by B [k, n]: B is Wᵀ.
        let w = NdTensorView::from_data([out_features, in_features], values);
        let packed = with_executor(|e| e.prepack_b(w.transposed()));
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
        scratch.quantized.resize(rows * k, 0);
        scratch.row_scales.resize(rows, 0.0);
        scratch.zero_points.resize(rows, ZERO_POINT);
        scratch.accumulators.resize(rows * n, 0);
        match self.activations {
            Activations::Dynamic => {
                quantize_per_token(x, k, &mut scratch.quantized, &mut scratch.row_scales)?
            }
            Activations::Static(scale) => {
                quantize_static(x, scale, &mut scratch.quantized)?;
                scratch.row_scales.fill(scale);
            }
        }
        let a = NdTensorView::from_data([rows, k], &scratch.quantized[..]);
        with_executor(|e| {
            e.gemm(
                &mut scratch.accumulators,
                GemmInputA::Unpacked(a),
                GemmInputB::Packed(&self.packed),
                GemmOptions {
                    a_quant: Some(QuantParams {
                        zero_point: &scratch.zero_points,
                    }),
                    ..GemmOptions::default()
                },
            )
        })
        .map_err(|e| Error::Gemm(e.to_string()))?;
        epilogue(
            &scratch.accumulators,
            &scratch.row_scales,
            &self.scales,
            self.bias.as_deref(),
            y,
        );
        Ok(())
    }

    /// [`Int8Linear::forward_into`] into a fresh vector.
    pub fn forward(&self, x: &[f32], rows: usize, scratch: &mut Scratch) -> Result<Vec<f32>> {
        let mut y = vec![0f32; rows * self.out_features];
        self.forward_into(x, rows, scratch, &mut y)?;
        Ok(y)
    }
}

/// i32 accumulators → f32 outputs: `acc × row scale × channel scale + bias`,
/// one pass over the output.
fn epilogue(acc: &[i32], rows: &[f32], channels: &[f32], bias: Option<&[f32]>, y: &mut [f32]) {
    let n = channels.len();
    for ((out, acc), &row_scale) in y.chunks_exact_mut(n).zip(acc.chunks_exact(n)).zip(rows) {
        match bias {
            Some(bias) => {
                for (((o, &a), &c), &b) in out.iter_mut().zip(acc).zip(channels).zip(bias) {
                    *o = a as f32 * (row_scale * c) + b;
                }
            }
            None => {
                for ((o, &a), &c) in out.iter_mut().zip(acc).zip(channels) {
                    *o = a as f32 * (row_scale * c);
                }
            }
        }
    }
}
