//! The linear layer, chosen per layer.

use candle_core::{DType, Tensor};

use crate::error::{Error, Result};

/// One linear layer, `y = x Wᵀ + b`. Each layer of a model picks its own
/// variant, so a model can mix precisions; full precision is the reference
/// that calibration observes.
#[derive(Debug, Clone)]
pub enum Linear {
    /// f32 weights `[out, in]` and an optional bias `[out]`.
    Fp {
        /// Weight, `[out, in]`.
        weight: Tensor,
        /// Bias, `[out]`.
        bias: Option<Tensor>,
    },
}

impl Linear {
    /// A full-precision layer; checks shapes and converts to f32.
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
        Ok(Linear::Fp {
            weight: weight.to_dtype(DType::F32)?.contiguous()?,
            bias: bias.map(|b| b.to_dtype(DType::F32)).transpose()?,
        })
    }

    /// Applies the layer to `x` of shape `[..., in]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Linear::Fp { weight, bias } => {
                let y = x.broadcast_matmul(&weight.t()?)?;
                Ok(match bias {
                    Some(b) => y.broadcast_add(b)?,
                    None => y,
                })
            }
        }
    }

    /// Output and input widths.
    pub fn shape(&self) -> (usize, usize) {
        match self {
            Linear::Fp { weight, .. } => {
                let d = weight.dims();
                (d[0], d[1])
            }
        }
    }
}
