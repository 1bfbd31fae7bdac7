//! The linear layer, chosen per layer.

use std::borrow::Cow;
use std::cell::RefCell;
use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Tensor};
use qforge_kernels::{Activations, Int8Linear, Scratch, WEIGHT_QMAX, quantize_rows_symmetric};

use crate::error::{Error, Result};

/// Whether `scale` can step int8 levels up to `qmax`: positive, finite and
/// normal (so its reciprocal, at most 2^126, is finite too), with the top
/// level `scale × qmax` finite.
pub(crate) fn usable_scale(scale: f32, qmax: f32) -> bool {
    scale.is_normal() && scale > 0.0 && (scale * qmax).is_finite()
}

/// Why a scale is refused, for every message that refuses one.
pub(crate) fn scale_rule(qmax: f32) -> String {
    format!(
        "a scale must be a positive finite normal f32 (its reciprocal finite) whose top level, \
         scale × {qmax}, is finite"
    )
}

/// One linear layer, `y = x Wᵀ + b`. Each layer of a model picks its own
/// variant, so a model can mix precisions; full precision is the reference
/// that calibration observes.
#[derive(Debug, Clone)]
pub enum Linear {
    /// Full-precision weights `[out, in]` and an optional bias `[out]`.
    /// bf16 and f16 weights stay as stored and are widened to f32 one layer at
    /// a time in the forward (exactly: both widen to f32 without rounding), so
    /// a bf16 Llama-3-8B needs 16 GB, not 32 GB.
    Fp {
        /// Weight, `[out, in]`, in f32, bf16 or f16.
        weight: Tensor,
        /// Bias, `[out]`.
        bias: Option<Tensor>,
        /// The int8 values chosen for `weight` by a rounding better than
        /// nearest (GPTQ), used whenever the layer is quantized; `None`:
        /// round to nearest.
        int8: Option<Arc<Int8Weight>>,
    },
    /// Weights kept where and as their file stores them, widened to f32 at
    /// every forward: the same values as [`Linear::Fp`] of the widened
    /// weight, for models whose f32 copy would not fit in memory.
    /// Prefill-heavy work (calibration, evaluation) barely notices the
    /// widening; decoding does.
    Stored {
        /// Weight, `[out, in]`.
        weight: StoredWeight,
        /// Bias, `[out]`.
        bias: Option<Tensor>,
        /// As [`Linear::Fp`]'s.
        int8: Option<Arc<Int8Weight>>,
    },
    /// qforge's INT8 engine: int8 symmetric per-output-channel weights,
    /// activations quantized to int8 per token at run time or by a calibrated
    /// static scale, u8 × i8 → i32 GEMM, f32 out.
    Int8(Arc<Int8Linear>),
}

/// A weight held as its file stores it.
#[derive(Debug, Clone)]
pub enum StoredWeight {
    /// GGUF blocks (quantized), as loaded.
    Blocks(Arc<QTensor>),
    /// A bf16 or f16 tensor of memory-mapped safetensors shards, read from
    /// the mapping (the page cache, which the kernel may evict and re-read)
    /// at every use: a bf16 Llama-3-8B holds none of its 16 GB of linear
    /// weights in the process's own memory.
    Mapped(Arc<MappedTensor>),
    /// The int8 values and scales a rounding (GPTQ) chose, dequantized at
    /// every use: what the calibration passes after it observe when GPTQ
    /// propagates its rounding (`Linear::with_rounded_weight`).
    Rounded(Arc<Int8Weight>),
}

/// One tensor of memory-mapped safetensors shards.
pub struct MappedTensor {
    shards: Arc<candle_core::safetensors::MmapedSafetensors>,
    name: String,
    dtype: DType,
    shape: (usize, usize),
}

impl std::fmt::Debug for MappedTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedTensor")
            .field("name", &self.name)
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .finish()
    }
}

impl MappedTensor {
    /// Tensor `name` of `shards`, a matrix; its values are read at each use.
    pub(crate) fn new(
        shards: Arc<candle_core::safetensors::MmapedSafetensors>,
        name: &str,
    ) -> Result<Self> {
        let view = shards.get(name)?;
        let dtype = DType::try_from(view.dtype())?;
        let &[rows, cols] = view.shape() else {
            return Err(qforge_formats::Error::Shape(format!(
                "{name} is {:?}, expected a matrix",
                view.shape()
            ))
            .into());
        };
        Ok(Self {
            name: name.to_owned(),
            dtype,
            shape: (rows, cols),
            shards: shards.clone(),
        })
    }

    /// The dtype the file stores.
    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }
}

/// Little-endian bf16 `bytes` widened to f32: a bf16 is the upper half of
/// an f32, so exactly.
pub fn bf16_values(bytes: &[u8]) -> impl Iterator<Item = f32> + '_ {
    bytes
        .chunks_exact(2)
        .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16))
}

impl StoredWeight {
    /// The weight widened to f32.
    fn to_f32(&self) -> Result<Tensor> {
        Ok(match self {
            StoredWeight::Blocks(blocks) => blocks.dequantize(&Device::Cpu)?,
            // bf16 is the top half of an f32: widened straight from the
            // mapping, with no bf16 copy on the way.
            StoredWeight::Mapped(mapped) if mapped.dtype == DType::BF16 => {
                let view = mapped.shards.get(&mapped.name)?;
                let values: Vec<f32> = bf16_values(view.data()).collect();
                Tensor::from_vec(values, mapped.shape, &Device::Cpu)?
            }
            StoredWeight::Mapped(mapped) => mapped
                .shards
                .load(&mapped.name, &Device::Cpu)?
                .to_dtype(DType::F32)?,
            // Exact: an int8 value times an f32 scale is the f32 product.
            StoredWeight::Rounded(int8) => {
                let (rows, cols) = int8.shape();
                let values: Vec<f32> = int8
                    .values
                    .chunks_exact(cols)
                    .zip(&int8.scales)
                    .flat_map(|(row, &scale)| row.iter().map(move |&v| f32::from(v) * scale))
                    .collect();
                Tensor::from_vec(values, (rows, cols), &Device::Cpu)?
            }
        })
    }

    /// The stored dimensions (checked to be a matrix's by [`Linear::stored`]).
    fn dims(&self) -> Vec<usize> {
        match self {
            StoredWeight::Blocks(blocks) => blocks.shape().dims().to_vec(),
            StoredWeight::Mapped(mapped) => vec![mapped.shape.0, mapped.shape.1],
            StoredWeight::Rounded(int8) => {
                let (rows, cols) = int8.shape();
                vec![rows, cols]
            }
        }
    }

    fn shape(&self) -> (usize, usize) {
        match self {
            StoredWeight::Blocks(blocks) => {
                let d = blocks.shape().dims();
                (d[0], d[1])
            }
            StoredWeight::Mapped(mapped) => mapped.shape,
            StoredWeight::Rounded(int8) => int8.shape(),
        }
    }

    fn stored_bytes(&self) -> usize {
        match self {
            StoredWeight::Blocks(blocks) => blocks.storage_size_in_bytes(),
            StoredWeight::Mapped(mapped) => {
                mapped.shape.0 * mapped.shape.1 * mapped.dtype.size_in_bytes()
            }
            StoredWeight::Rounded(int8) => int8.values.len() + 4 * int8.scales.len(),
        }
    }
}

/// Int8 values and per-output-row scales chosen for a full-precision weight
/// (`values[o·in + i] × scales[o]` approximates `weight[o][i]`).
#[derive(Debug, Clone, PartialEq)]
pub struct Int8Weight {
    /// `[out, in]`, row-major, within ±[`WEIGHT_QMAX`].
    pub values: Int8Values,
    /// One positive scale per output row.
    pub scales: Vec<f32>,
}

impl Int8Weight {
    /// `(out, in)`.
    pub fn shape(&self) -> (usize, usize) {
        let rows = self.scales.len();
        (rows, self.values.len().checked_div(rows).unwrap_or(0))
    }

    /// SHA-256 of the values and scales: names this rounding in the jobs of
    /// the passes that run with it.
    pub fn digest(&self) -> qforge_core::Digest {
        let mut digest = qforge_core::DigestBuilder::default();
        digest.update(b"qforge.int8-weight.v1");
        digest.update(&(self.scales.len() as u64).to_le_bytes());
        for scale in &self.scales {
            digest.update(&scale.to_le_bytes());
        }
        for chunk in self.values.chunks(qforge_formats::spill::CHUNK) {
            let bytes: Vec<u8> = chunk.iter().map(|v| v.to_le_bytes()[0]).collect();
            digest.update(&bytes);
        }
        digest.finish()
    }

    /// The same weight with its values moved out of the process's memory
    /// into an unnamed file in `dir`, mapped read-only (see the `spill`
    /// module): a model's int8 rounding (7.5 GB for Llama-3-8B) then lives
    /// in the page cache instead of beside the solves that make the next
    /// layers'.
    pub fn spill(self, dir: &Path) -> Result<Self> {
        let Int8Values::Owned(values) = &self.values else {
            return Ok(self);
        };
        let map = qforge_formats::spill::spill_in(dir, |out| {
            qforge_formats::spill::write_i8(values, out)
        })?;
        Ok(Self {
            values: Int8Values::Spilled(map),
            scales: self.scales,
        })
    }
}

/// Where an [`Int8Weight`]'s values are: in memory, or in a read-only
/// mapping of a file ([`Int8Weight::spill`]). Either reads as `[i8]`.
#[derive(Debug, Clone)]
pub enum Int8Values {
    /// In the process's memory.
    Owned(Vec<i8>),
    /// In a mapped file.
    Spilled(Arc<memmap2::Mmap>),
}

impl std::ops::Deref for Int8Values {
    type Target = [i8];

    fn deref(&self) -> &[i8] {
        match self {
            Int8Values::Owned(values) => values,
            Int8Values::Spilled(map) => {
                // SAFETY: i8 and u8 have the same size and alignment and
                // every bit pattern is valid for both; the slice borrows the
                // mapping, which lives as long as `self`.
                unsafe { std::slice::from_raw_parts(map.as_ptr().cast::<i8>(), map.len()) }
            }
        }
    }
}

impl PartialEq for Int8Values {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl From<Vec<i8>> for Int8Values {
    fn from(values: Vec<i8>) -> Self {
        Int8Values::Owned(values)
    }
}

/// Refuses weights with a NaN or an infinity, naming the tensor `name`:
/// such a weight loads, then makes every output NaN, which an argmax reads
/// as action 0 (a CartPole policy with one NaN weight answered 0 to every
/// observation).
pub(crate) fn check_finite(name: &str, values: impl IntoIterator<Item = f32>) -> Result<()> {
    match values.into_iter().enumerate().find(|(_, v)| !v.is_finite()) {
        None => Ok(()),
        Some((index, value)) => Err(Error::Format(format!(
            "{name} holds {value} at index {index}; weights must be finite numbers (is the file \
             damaged, or did training diverge?)"
        ))),
    }
}

/// [`check_finite`] on a tensor of any float dtype.
pub(crate) fn check_finite_tensor(name: &str, tensor: &Tensor) -> Result<()> {
    check_finite(
        name,
        tensor
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?,
    )
}

/// A layer's weight is a `shape` matrix and its bias, if there is one, a
/// vector of `shape.0` values.
fn check_shapes(
    name: &str,
    weight_dims: &[usize],
    bias: Option<&Tensor>,
    shape: (usize, usize),
) -> Result<()> {
    if weight_dims != [shape.0, shape.1] {
        return Err(qforge_formats::Error::Shape(format!(
            "{name}.weight is {weight_dims:?}, expected [{}, {}]",
            shape.0, shape.1
        ))
        .into());
    }
    match bias {
        Some(b) if b.dims() != [shape.0] => Err(qforge_formats::Error::Shape(format!(
            "{name}.bias is {:?}, expected [{}]",
            b.dims(),
            shape.0
        ))
        .into()),
        _ => Ok(()),
    }
}

thread_local! {
    // Quantized activations and accumulators, reused across layers and calls.
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

impl Linear {
    /// A full-precision layer; checks shapes. f32, bf16 and f16 weights are kept
    /// as they are; other dtypes are converted to f32.
    pub fn fp(
        name: &str,
        weight: Tensor,
        bias: Option<Tensor>,
        shape: (usize, usize),
    ) -> Result<Self> {
        check_shapes(name, weight.dims(), bias.as_ref(), shape)?;
        let weight = match weight.dtype() {
            DType::F32 | DType::BF16 | DType::F16 => weight,
            _ => weight.to_dtype(DType::F32)?,
        };
        Ok(Linear::Fp {
            weight: weight.contiguous()?,
            bias: bias.map(|b| b.to_dtype(DType::F32)).transpose()?,
            int8: None,
        })
    }

    /// A full-precision layer whose weight stays as its file stores it;
    /// checks shapes.
    pub(crate) fn stored(
        name: &str,
        weight: StoredWeight,
        bias: Option<Tensor>,
        shape: (usize, usize),
    ) -> Result<Self> {
        check_shapes(name, &weight.dims(), bias.as_ref(), shape)?;
        Ok(Linear::Stored {
            weight,
            bias: bias.map(|b| b.to_dtype(DType::F32)).transpose()?,
            int8: None,
        })
    }

    /// The layer with `int8` as the values it quantizes to (full-precision
    /// layers only). Its full-precision forward is unchanged.
    pub fn with_int8_weight(&self, int8: Int8Weight) -> Result<Linear> {
        self.check_int8(&int8)?;
        let int8 = Some(Arc::new(int8));
        match self {
            Linear::Fp { weight, bias, .. } => Ok(Linear::Fp {
                weight: weight.clone(),
                bias: bias.clone(),
                int8,
            }),
            Linear::Stored { weight, bias, .. } => Ok(Linear::Stored {
                weight: weight.clone(),
                bias: bias.clone(),
                int8,
            }),
            Linear::Int8(_) => Err(Self::already_int8()),
        }
    }

    /// The layer computing with `int8` (its weight as a rounding chose it,
    /// dequantized at every use) in place of its full-precision weight, and
    /// quantizing to `int8`: what the calibration passes after GPTQ's
    /// rounding of this layer observe when it propagates its rounding.
    pub fn with_rounded_weight(&self, int8: Int8Weight) -> Result<Linear> {
        self.check_int8(&int8)?;
        let bias = match self {
            Linear::Fp { bias, .. } | Linear::Stored { bias, .. } => bias.clone(),
            Linear::Int8(_) => return Err(Self::already_int8()),
        };
        let int8 = Arc::new(int8);
        Ok(Linear::Stored {
            weight: StoredWeight::Rounded(int8.clone()),
            bias,
            int8: Some(int8),
        })
    }

    /// Checks that `int8` fits this layer's shape and range.
    fn check_int8(&self, int8: &Int8Weight) -> Result<()> {
        let (out, inp) = self.shape();
        let qmax = WEIGHT_QMAX.unsigned_abs();
        if int8.values.len() != out * inp || int8.scales.len() != out {
            return Err(qforge_formats::Error::Shape(format!(
                "{} int8 values and {} scales for a [{out}, {inp}] layer",
                int8.values.len(),
                int8.scales.len()
            ))
            .into());
        }
        // A max over every value rather than `any`: the early exit kept the
        // scan from vectorizing, and a `--sequential` pass checks every
        // layer rounded so far (8 % of a SmolLM2 worker's time with `any`).
        let widest = int8.values.iter().fold(0, |m, v| v.unsigned_abs().max(m));
        if widest > qmax || int8.scales.iter().any(|s| !(s.is_finite() && *s > 0.0)) {
            return Err(qforge_formats::Error::Shape(format!(
                "int8 weights beyond ±{qmax} or scales that are not positive and finite"
            ))
            .into());
        }
        Ok(())
    }

    fn already_int8() -> Error {
        qforge_formats::Error::Unsupported(
            "this layer is INT8 already; quantize from the full-precision model".into(),
        )
        .into()
    }

    /// The int8 rounding chosen for this layer's weights (GPTQ), if any.
    fn chosen_int8(&self) -> Option<&Arc<Int8Weight>> {
        match self {
            Linear::Fp { int8, .. } | Linear::Stored { int8, .. } => int8.as_ref(),
            Linear::Int8(_) => None,
        }
    }

    /// The bias, `[out]` (f32), of a full-precision layer.
    pub(crate) fn bias(&self) -> Result<Option<&Tensor>> {
        match self {
            Linear::Fp { bias, .. } | Linear::Stored { bias, .. } => Ok(bias.as_ref()),
            Linear::Int8(_) => Err(Self::already_int8()),
        }
    }

    /// The same layer on the INT8 engine (an INT8 layer is returned as is).
    pub fn to_int8(&self, activations: Activations) -> Result<Linear> {
        if let Linear::Int8(_) = self {
            return Ok(self.clone());
        }
        let bias = self.bias()?.map(|b| b.to_vec1::<f32>()).transpose()?;
        let int8 = self.int8_weight()?;
        Ok(Linear::Int8(Arc::new(Int8Linear::from_quantized(
            &int8.values,
            int8.scales.clone(),
            self.shape(),
            bias.as_deref(),
            activations,
        )?)))
    }

    /// The f32 weight `[out, in]` and bias of a full-precision layer (an
    /// INT8 layer has no full-precision weights left: an error).
    pub fn full_precision(&self) -> Result<(Tensor, Option<Tensor>)> {
        match self {
            Linear::Fp { weight, bias, .. } => Ok((weight.to_dtype(DType::F32)?, bias.clone())),
            Linear::Stored { weight, bias, .. } => Ok((weight.to_f32()?, bias.clone())),
            Linear::Int8(_) => Err(Self::already_int8()),
        }
    }

    /// The dtype a full-precision layer's weight is held in: bf16 when its
    /// source stored bf16 and nothing changed it since (its f32 values from
    /// [`Linear::full_precision`] are then bf16 exactly), else f32, which
    /// holds every other source's values exactly.
    pub fn full_precision_dtype(&self) -> DType {
        match self {
            Linear::Fp { weight, .. } if weight.dtype() == DType::BF16 => DType::BF16,
            Linear::Stored {
                weight: StoredWeight::Mapped(mapped),
                ..
            } if mapped.dtype == DType::BF16 => DType::BF16,
            _ => DType::F32,
        }
    }

    /// The f32 weight and bias of a full-precision layer that a transform
    /// (smoothing, rotation) is about to change: refused once an int8
    /// rounding was chosen for the current weights, which the change would
    /// make stale.
    pub fn weights_to_transform(&self) -> Result<(Tensor, Option<Tensor>)> {
        if self.chosen_int8().is_some() {
            return Err(qforge_formats::Error::Unsupported(
                "this layer's int8 rounding (GPTQ) was chosen for its current weights; transform the model before rounding it".into(),
            ).into());
        }
        self.full_precision()
    }

    /// The int8 values and per-row scales this full-precision layer quantizes
    /// to: the rounding chosen for it (GPTQ), or its weight rounded to
    /// nearest, symmetric in ±[`WEIGHT_QMAX`].
    /// The chosen rounding is lent, not copied: a model's weights are read
    /// several times on their way into an artifact.
    pub fn int8_weight(&self) -> Result<Cow<'_, Int8Weight>> {
        if let Some(int8) = self.chosen_int8() {
            return Ok(Cow::Borrowed(int8));
        }
        let (weight, _) = self.full_precision()?;
        let (values, scales) = Self::quantize_weight(&weight)?;
        Ok(Cow::Owned(Int8Weight {
            values: values.into(),
            scales,
        }))
    }

    /// The int8 values and per-row scales of `weight` (`[out, in]`, f32)
    /// rounded to nearest: symmetric in ±[`WEIGHT_QMAX`].
    fn quantize_weight(weight: &Tensor) -> Result<(Vec<i8>, Vec<f32>)> {
        let &[_, cols] = weight.dims() else {
            return Err(qforge_formats::Error::Shape(format!(
                "a weight of shape {:?} is not a matrix",
                weight.dims()
            ))
            .into());
        };
        let values = weight.flatten_all()?.to_vec1::<f32>()?;
        Ok(quantize_rows_symmetric(&values, cols, WEIGHT_QMAX))
    }

    /// The layer with input column `j` multiplied by `factors[j]` (f32; a
    /// full-precision layer only): `x W'ᵀ = (x · diag(factors)) Wᵀ`.
    pub fn scale_inputs(&self, factors: &[f32]) -> Result<Linear> {
        let (weight, bias) = self.weights_to_transform()?;
        let (out, inp) = self.shape();
        if factors.len() != inp {
            return Err(qforge_formats::Error::Shape(format!(
                "{} input factors for a layer taking {inp}",
                factors.len()
            ))
            .into());
        }
        let s = Tensor::from_slice(factors, (1, inp), &Device::Cpu)?;
        Linear::fp("scaled", weight.broadcast_mul(&s)?, bias, (out, inp))
    }

    /// The layer with output row `i` (and its bias) multiplied by
    /// `factors[i]` (f32; a full-precision layer only).
    pub fn scale_outputs(&self, factors: &[f32]) -> Result<Linear> {
        let (weight, bias) = self.weights_to_transform()?;
        let (out, inp) = self.shape();
        if factors.len() != out {
            return Err(qforge_formats::Error::Shape(format!(
                "{} output factors for a layer giving {out}",
                factors.len()
            ))
            .into());
        }
        let s = Tensor::from_slice(factors, out, &Device::Cpu)?;
        let bias = bias.map(|b| b.mul(&s)).transpose()?;
        Linear::fp(
            "scaled",
            weight.broadcast_mul(&s.reshape((out, 1))?)?,
            bias,
            (out, inp),
        )
    }

    /// Applies the layer to `x` of shape `[..., in]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (weight, bias) = match self {
            Linear::Fp { weight, bias, .. } if weight.dtype() == DType::F32 => {
                (weight.clone(), bias)
            }
            Linear::Fp { weight, bias, .. } => (weight.to_dtype(DType::F32)?, bias),
            Linear::Stored { weight, bias, .. } => (weight.to_f32()?, bias),
            Linear::Int8(layer) => return int8_forward(layer, x),
        };
        let y = x.broadcast_matmul(&weight.t()?)?;
        Ok(match bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }

    /// Bytes the weight occupies as stored.
    pub fn weight_bytes(&self) -> usize {
        match self {
            Linear::Fp { weight, .. } => weight.elem_count() * weight.dtype().size_in_bytes(),
            Linear::Stored { weight, .. } => weight.stored_bytes(),
            Linear::Int8(layer) => layer.weight_bytes(),
        }
    }

    /// Output and input widths.
    pub fn shape(&self) -> (usize, usize) {
        match self {
            Linear::Fp { weight, .. } => {
                let d = weight.dims();
                (d[0], d[1])
            }
            Linear::Stored { weight, .. } => weight.shape(),
            Linear::Int8(layer) => layer.shape(),
        }
    }
}

fn int8_forward(layer: &Int8Linear, x: &Tensor) -> Result<Tensor> {
    let (out, inp) = layer.shape();
    let mut dims = x.dims().to_vec();
    if dims.last() != Some(&inp) {
        return Err(qforge_formats::Error::Shape(format!(
            "input {dims:?} to a layer taking {inp} features"
        ))
        .into());
    }
    let rows = x.elem_count() / inp;
    let input = x.flatten_all()?.to_vec1::<f32>()?;
    let y = SCRATCH.with(|scratch| layer.forward(&input, rows, &mut scratch.borrow_mut()))?;
    *dims.last_mut().expect("checked above") = out;
    Ok(Tensor::from_vec(y, dims, &Device::Cpu)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spilled_weight_reads_as_the_values_it_was_given_and_leaves_no_file() {
        // Three chunks and a bit, every int8 value.
        let values: Vec<i8> = (0..3 * qforge_formats::spill::CHUNK + 5)
            .map(|i| (i % 256) as u8 as i8)
            .collect();
        let weight = Int8Weight {
            values: values.clone().into(),
            scales: vec![0.5; 1],
        };
        let dir = tempfile::tempdir().unwrap();
        let spilled = weight.clone().spill(dir.path()).unwrap();
        assert!(matches!(spilled.values, Int8Values::Spilled(_)));
        assert_eq!(spilled, weight);
        assert_eq!(*spilled.values, values[..]);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);

        let missing = dir.path().join("missing");
        let e = weight.spill(&missing).unwrap_err().to_string();
        assert!(e.contains("missing") && e.contains("TMPDIR"), "{e}");
    }

    #[test]
    fn a_rounding_beyond_the_weight_range_or_with_a_bad_scale_is_refused() {
        let (rows, cols) = (3, 70);
        let weight = Tensor::zeros((rows, cols), DType::F32, &Device::Cpu).unwrap();
        let layer = Linear::fp("l", weight, None, (rows, cols)).unwrap();
        let rounding = |at: usize, value: i8, scale: f32| {
            let mut values = vec![1i8; rows * cols];
            values[at] = value;
            Int8Weight {
                values: values.into(),
                scales: vec![scale; rows],
            }
        };
        for at in [0, 137, rows * cols - 1] {
            for value in [WEIGHT_QMAX, -WEIGHT_QMAX] {
                layer.with_rounded_weight(rounding(at, value, 0.1)).unwrap();
            }
            let e = layer
                .with_rounded_weight(rounding(at, i8::MIN, 0.1))
                .unwrap_err()
                .to_string();
            assert!(e.contains("beyond"), "{e}");
        }
        for scale in [0.0, -1.0, f32::NAN] {
            assert!(layer.with_rounded_weight(rounding(0, 1, scale)).is_err());
        }
    }
}
