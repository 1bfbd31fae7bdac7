//! `qforge-kernels`: the INT8 arithmetic of qforge's deployment engine.
//!
//! * [`quantize`]: f32 → int8 activation quantizers (dynamic per-token and
//!   static per-tensor), with CPU tiers and a scalar twin.
//! * [`Int8Linear`]: a linear layer with int8 symmetric per-output-channel
//!   weights, prepacked once for the GEMM, and a fused epilogue that turns the
//!   i32 accumulators into f32 (activation scale × channel scale, + bias).
//!
//! * [`attention`]: one GQA group's attention over its keys and values, in
//!   a fixed arithmetic order that the AVX2 tier and its scalar twin share.
//!
//! * [`exp`]: `e^x` for `x ≤ 0` with the same bits on every tier, and the
//!   sampler's softmax weights built on it.
//!
//! * [`Hadamard`]: the normalized Walsh–Hadamard rotation that spreads an
//!   outlier channel over all channels before a layer's input is quantized.
//!
//! * [`gemm`]: the u8 × i8 → i32 GEMM on prepacked weights, with CPU tiers
//!   (AVX-512 VNNI, AVX2, portable) chosen at run time.
//!
//! Activations are symmetric int8 stored as u8 with zero point 128, the
//! operand layout of the VNNI instructions.

pub mod attention;
pub mod error;
pub mod exp;
pub mod fma_tier;
pub mod gemm;
pub mod hadamard;
pub mod linear;
pub mod quantize;
pub mod team;
pub mod tiers;

pub use attention::{AttentionTier, KeyValues, Queries};
pub use error::{Error, Result};
pub use gemm::{GemmTier, PackedWeights, WEIGHT_QMAX};
pub use hadamard::Hadamard;
pub use linear::{Activations, Int8Linear, Scratch, quantize_rows_symmetric};
pub use quantize::{QuantizeTier, ZERO_POINT};
pub use team::Team;
pub use tiers::MachineReport;
