//! The linear layer, chosen per layer.

use std::borrow::Cow;
use std::cell::RefCell;
use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Tensor};
use qforge_kernels::{Activations, Int8Linear, Scratch, WEIGHT_QMAX, quantize_rows_symmetric};

use crate::error::{Error, Result};

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
    /// Weights kept as a GGUF file stores them (quantized) and dequantized to
    /// f32 at every forward: the same values as [`Linear::Fp`] after a
    /// load-time dequantization, for models whose f32 copy would not fit in
    /// memory. Prefill-heavy work (calibration, evaluation) barely notices the
    /// extra dequantization; decoding does.
    Dequantizing {
        /// Weight, `[out, in]`, quantized.
        weight: Arc<QTensor>,
        /// Bias, `[out]`.
        bias: Option<Tensor>,
    },
    /// qforge's INT8 engine: int8 symmetric per-output-channel weights,
    /// activations quantized to int8 per token at run time or by a calibrated
    /// static scale, u8 × i8 → i32 GEMM, f32 out.
    Int8(Arc<Int8Linear>),
}

/// Int8 values and per-output-row scales chosen for a full-precision weight
/// (`values[o·in + i] × scales[o]` approximates `weight[o][i]`).
#[derive(Debug, Clone, PartialEq)]
pub struct Int8Weight {
    /// `[out, in]`, row-major, within ±[`WEIGHT_QMAX`].
    pub values: Vec<i8>,
    /// One positive scale per output row.
    pub scales: Vec<f32>,
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
        if weight.dims() != [shape.0, shape.1] {
            return Err(Error::Shape(format!(
                "{name}.weight is {:?}, expected [{}, {}]",
                weight.dims(),
                shape.0,
                shape.1
            )));
        }
        if let Some(b) = &bias
            && b.dims() != [shape.0]
        {
            return Err(Error::Shape(format!(
                "{name}.bias is {:?}, expected [{}]",
                b.dims(),
                shape.0
            )));
        }
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

    /// The layer with `int8` as the values it quantizes to (full-precision
    /// layers only; a GGUF-block layer is widened to f32 first). Its
    /// full-precision forward is unchanged.
    pub fn with_int8_weight(&self, int8: Int8Weight) -> Result<Linear> {
        let (out, inp) = self.shape();
        let qmax = WEIGHT_QMAX.unsigned_abs();
        if int8.values.len() != out * inp || int8.scales.len() != out {
            return Err(Error::Shape(format!(
                "{} int8 values and {} scales for a [{out}, {inp}] layer",
                int8.values.len(),
                int8.scales.len()
            )));
        }
        if int8.values.iter().any(|v| v.unsigned_abs() > qmax)
            || int8.scales.iter().any(|s| !(s.is_finite() && *s > 0.0))
        {
            return Err(Error::Shape(format!(
                "int8 weights beyond ±{qmax} or scales that are not positive and finite"
            )));
        }
        let (weight, bias) = self.full_precision()?;
        Ok(Linear::Fp {
            weight: match self {
                Linear::Fp { weight, .. } => weight.clone(),
                _ => weight,
            },
            bias,
            int8: Some(Arc::new(int8)),
        })
    }

    /// The same layer on the INT8 engine (an INT8 layer is returned as is).
    pub fn to_int8(&self, activations: Activations) -> Result<Linear> {
        if let Linear::Int8(_) = self {
            return Ok(self.clone());
        }
        let (_, bias) = self.full_precision()?;
        let int8 = self.int8_weight()?;
        let bias = bias.map(|b| b.to_vec1::<f32>()).transpose()?;
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
            Linear::Dequantizing { weight, bias } => {
                Ok((weight.dequantize(&Device::Cpu)?, bias.clone()))
            }
            Linear::Int8(_) => Err(Error::Unsupported(
                "this layer is INT8 already; quantize from the full-precision model".into(),
            )),
        }
    }

    /// The f32 weight and bias of a full-precision layer that a transform
    /// (smoothing, rotation) is about to change: refused once an int8
    /// rounding was chosen for the current weights, which the change would
    /// make stale.
    pub fn weights_to_transform(&self) -> Result<(Tensor, Option<Tensor>)> {
        if let Linear::Fp { int8: Some(_), .. } = self {
            return Err(Error::Unsupported(
                "this layer's int8 rounding (GPTQ) was chosen for its current weights; transform the model before rounding it".into(),
            ));
        }
        self.full_precision()
    }

    /// The int8 values and per-row scales this full-precision layer quantizes
    /// to: the rounding chosen for it (GPTQ), or its weight rounded to
    /// nearest, symmetric in ±[`WEIGHT_QMAX`].
    /// The chosen rounding is lent, not copied: a model's weights are read
    /// several times on their way into an artifact.
    pub fn int8_weight(&self) -> Result<Cow<'_, Int8Weight>> {
        if let Linear::Fp {
            int8: Some(int8), ..
        } = self
        {
            return Ok(Cow::Borrowed(int8));
        }
        let (weight, _) = self.full_precision()?;
        let (values, scales) = Self::quantize_weight(&weight)?;
        Ok(Cow::Owned(Int8Weight { values, scales }))
    }

    /// The int8 values and per-row scales of `weight` (`[out, in]`, f32)
    /// rounded to nearest: symmetric in ±[`WEIGHT_QMAX`].
    fn quantize_weight(weight: &Tensor) -> Result<(Vec<i8>, Vec<f32>)> {
        let &[_, cols] = weight.dims() else {
            return Err(Error::Shape(format!(
                "a weight of shape {:?} is not a matrix",
                weight.dims()
            )));
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
            return Err(Error::Shape(format!(
                "{} input factors for a layer taking {inp}",
                factors.len()
            )));
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
            return Err(Error::Shape(format!(
                "{} output factors for a layer giving {out}",
                factors.len()
            )));
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
            Linear::Dequantizing { weight, bias } => (weight.dequantize(&Device::Cpu)?, bias),
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
            Linear::Dequantizing { weight, .. } => weight.storage_size_in_bytes(),
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
            Linear::Dequantizing { weight, .. } => {
                let d = weight.shape().dims();
                (d[0], d[1])
            }
            Linear::Int8(layer) => layer.shape(),
        }
    }
}

fn int8_forward(layer: &Int8Linear, x: &Tensor) -> Result<Tensor> {
    let (out, inp) = layer.shape();
    let mut dims = x.dims().to_vec();
    if dims.last() != Some(&inp) {
        return Err(Error::Shape(format!(
            "input {dims:?} to a layer taking {inp} features"
        )));
    }
    let rows = x.elem_count() / inp;
    let input = x.flatten_all()?.to_vec1::<f32>()?;
    let y = SCRATCH.with(|scratch| layer.forward(&input, rows, &mut scratch.borrow_mut()))?;
    *dims.last_mut().expect("checked above") = out;
    Ok(Tensor::from_vec(y, dims, &Device::Cpu)?)
}
