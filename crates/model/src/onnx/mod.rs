//! ONNX: import of plain MLP policies.
//!
//! [`import_mlp`] reads the graph as a chain of linear layers with
//! [`qforge_formats::onnx::decode_chain`] (which says what it accepts and
//! refuses the rest, naming the node) and turns it into an [`MlpPolicy`].
//!
//! [`open_policy`] is how [`crate::open()`] loads an `.onnx` file: a graph
//! says how wide its output is but not what it means (discrete logits, a
//! Gaussian mean with its bounds, a value), so the head comes from a
//! [`HeadFile`] beside it, or from a final `Softmax` (a discrete head).
//! `policy` checks the chain against the head and builds the policy.

mod policy;

use std::path::{Path, PathBuf};

use qforge_formats::onnx::decode_chain;
use qforge_formats::policy::Head;
use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::mlp::MlpPolicy;
use policy::build_policy;

/// Imports the MLP policy in the ONNX file at `path`.
///
/// The graph must be a single chain from its one input to its one output:
/// layers of `Gemm` (alpha = 1, beta = 1, transA = 0, transB = 0 or 1, bias
/// `C` optional) or `MatMul` (weights `[in, out]`) optionally followed by an
/// `Add` of a constant bias; the same `Relu` or `Tanh` after every hidden
/// layer and none after the last; `Identity` and `Flatten(axis=1)` anywhere.
/// Weights are float32 initializers (`raw_data` or `float_data`) or
/// `Constant` nodes' `value` tensors. Shapes are inferred from the weights:
/// `observation_dim` from the first layer, the hidden widths from the rest;
/// the last layer's width must equal `head.outputs()`.
///
/// A final `Softmax` is accepted and **dropped** for a [`Head::Discrete`]:
/// softmax is monotonic, so the argmax (the action) is unchanged, and
/// [`MlpPolicy::forward`] of the imported policy returns the logits, not
/// the probabilities the ONNX graph outputs. Any other head ending in
/// `Softmax` is refused, since its outputs would change.
///
/// Errors, each naming the file, are [`crate::Error::Formats`] with
/// [`qforge_formats::Error::Io`] if the file cannot be read,
/// [`qforge_formats::Error::Format`] for bytes that are not a complete,
/// consistent ONNX model, [`qforge_formats::Error::Unsupported`] for a valid
/// model that is not such a chain (naming the node and op), and
/// [`qforge_formats::Error::Shape`] for weights whose shapes do not chain.
pub fn import_mlp(path: &Path, head: Head, env: Option<String>) -> Result<MlpPolicy> {
    let bytes = qforge_formats::files::read_regular(path)?;
    import_mlp_bytes(&bytes, head, env).map_err(|e| e.in_file(path))
}

/// `NAME.policy.json` beside an ONNX policy `NAME.onnx`: what the graph's
/// output means, which the graph cannot say.
///
/// ```json
/// {"head": {"kind": "discrete", "actions": 2}, "env": "CartPole-v1"}
/// ```
///
/// `head` is written as in `policy.json`; `env` is optional.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeadFile {
    /// The policy head.
    pub head: Head,
    /// The environment the policy acts in, if known.
    #[serde(default)]
    pub env: Option<String>,
}

/// Where the [`HeadFile`] of the ONNX policy `path` is: `NAME.policy.json`
/// beside `NAME.onnx`.
pub fn head_file(path: &Path) -> PathBuf {
    path.with_extension("policy.json")
}

/// Opens the ONNX policy at `path`, as [`crate::open()`] does: with the head
/// its [`HeadFile`] gives or, where there is none, the discrete head a final
/// `Softmax` implies. A graph with neither is refused with an error that
/// shows the head file to write.
pub fn open_policy(path: &Path) -> Result<MlpPolicy> {
    let bytes = qforge_formats::files::read_regular(path)?;
    let head_path = head_file(path);
    let given = if head_path.exists() {
        let file: HeadFile = qforge_formats::files::read_json(&head_path)?;
        Some(file)
    } else {
        None
    };
    let chain = decode_chain(&bytes).map_err(|e| e.in_file(path))?;
    let (head, env) = match given {
        Some(HeadFile { head, env }) => (head, env),
        None => match (&chain.softmax, chain.layers.last()) {
            (Some(_), Some(last)) => (Head::Discrete { actions: last.out }, None),
            (_, last) => {
                let n = last.map_or(1, |l| l.out);
                return Err(qforge_formats::Error::Unsupported(format!(
                    "{}: the graph's {n} outputs could be discrete logits, a Gaussian mean or a \
                     value, and it does not say which; write {} beside it, e.g. \
                     {{\"head\": {{\"kind\": \"discrete\", \"actions\": {n}}}}}, \
                     {{\"head\": {{\"kind\": \"gaussian\", \"action_dim\": {n}, \
                     \"low\": [...], \"high\": [...]}}}} or \
                     {{\"head\": {{\"kind\": \"value\"}}}}, optionally with \"env\"",
                    path.display(),
                    head_path.display()
                ))
                .into());
            }
        },
    };
    build_policy(chain, head, env).map_err(|e| e.in_file(path))
}

/// [`import_mlp`] on the bytes of an ONNX file.
///
/// Never panics on any input. Memory stays proportional to `bytes.len()`:
/// protobuf decoding checks every length prefix against the bytes left (and
/// nests at most 100 messages deep), and a tensor's data is copied only after
/// its declared dims have been checked against the length it actually holds.
/// The constant is not 1: a crafted file of empty messages (two bytes each)
/// decodes to structs of up to ~200 bytes each.
pub fn import_mlp_bytes(bytes: &[u8], head: Head, env: Option<String>) -> Result<MlpPolicy> {
    build_policy(decode_chain(bytes)?, head, env)
}
