//! `qforge-export`: the native INT8 artifact (written by `qforge quantize`,
//! defined in `qforge-model`) converted to what serving stacks load.
//!
//! * [`compressed_tensors`]: vLLM's INT8 checkpoint format (W8A8,
//!   `quant_method: compressed-tensors`, `format: int-quantized`).
//! * [`onnx_qdq`]: ONNX with QuantizeLinear/DequantizeLinear for MLP
//!   policies.
//!
//! It reads artifacts and writes directories; it depends on `qforge-model`
//! only and never requantizes: the exported int8 values are the ones the
//! guard measured.

pub mod compressed_tensors;
pub mod error;
pub mod onnx_qdq;

pub use compressed_tensors::{CompressedTensors, export_compressed_tensors};
pub use error::{Error, Result};
pub use onnx_qdq::{OnnxExport, export_onnx};
