//! The native artifact: a quantized model exactly as qforge's INT8 engine
//! runs it, written by `qforge quantize` and loaded by every consumer
//! (`eval`, `generate`, `serve`, `export`).
//!
//! An artifact is a directory:
//!
//! * `qforge.json`: format and version, the model kind, the weight range the
//!   int8 values use, and the precision of every observation point (the input
//!   of a fused group of linear layers: q/k/v share one, gate/up share one);
//! * `model.safetensors`: for an INT8 layer `NAME.weight` (I8, `[out, in]`)
//!   and `NAME.weight_scale` (F32, `[out, 1]`); for a full-precision layer
//!   `NAME.weight`; biases and norms in F32. A full-precision weight or
//!   embedding is stored in BF16 when the model holds it in bf16 (a bf16
//!   source's values that nothing rescaled), else in F32. Names are Hugging
//!   Face's and the int8 layout is compressed-tensors' (symmetric
//!   per-channel, no zero points), so an export rewrites metadata rather than
//!   requantizing;
//! * what describes the model besides its tensors: `policy.json` for a
//!   policy; `config.json`, `tokenizer.json` and `tokenizer_config.json` for a
//!   language model (a GGUF source is written out in Hugging Face form, q/k
//!   rows already in Hugging Face order);
//! * `calibration.json` ([`qforge_formats::profile`]): each point's calibrated range
//!   and octave histogram, which `qforge serve` watches for drift;
//! * `manifest.json` ([`qforge_formats::manifest`]): provenance and the hash of every
//!   file.
//!
//! Loading gives the same layers the quantizer evaluated: the stored int8
//! values and scales are prepacked as they are (narrowed to 7 bits only on a
//! CPU whose GEMM cannot take 8, see `Int8Linear::from_quantized`).

use std::borrow::Cow;
use std::cell::OnceCell;
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::Path;
use std::rc::Rc;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use qforge_kernels::{Activations, Int8Linear, WEIGHT_QMAX};
use safetensors::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::linear::{Linear, check_finite};
use crate::llama::{Llama, RotatedInput, WeightSource};
use crate::lm::LanguageModel;
use crate::mlp::MlpPolicy;
use qforge_formats::llama_config::LlamaConfig;
use qforge_formats::manifest::MANIFEST_FILE;
use qforge_formats::policy::PolicyConfig;
use qforge_formats::safetensors_file::{TensorSource, write_safetensors};
use qforge_formats::text::TextSide;

mod numbers;
pub use numbers::check_numbers;

/// The file that marks a directory as a native artifact.
pub const ARTIFACT_FILE: &str = "qforge.json";
/// The tensors of an artifact.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// `format` of `qforge.json`.
const FORMAT: &str = "qforge-int8";
/// Version of the layout this code writes and reads.
const VERSION: u32 = 1;

/// How the layers of one observation point run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "precision", rename_all = "kebab-case", deny_unknown_fields)]
pub enum LayerPrecision {
    /// Full precision (f32).
    Fp,
    /// INT8 weights, activations quantized per token at run time.
    Int8Dynamic,
    /// INT8 weights, activations quantized with one calibrated scale.
    Int8Static {
        /// The activation scale (threshold / 127).
        input_scale: f32,
    },
}

impl LayerPrecision {
    /// How activations are quantized; `None` for full precision.
    pub fn activations(self) -> Option<Activations> {
        match self {
            LayerPrecision::Fp => None,
            LayerPrecision::Int8Dynamic => Some(Activations::Dynamic),
            LayerPrecision::Int8Static { input_scale } => Some(Activations::Static(input_scale)),
        }
    }

    /// The layer `layer` (full precision) in this precision.
    pub fn apply(self, layer: &Linear) -> Result<Linear> {
        match self.activations() {
            None => Ok(layer.clone()),
            Some(activations) => layer.to_int8(activations),
        }
    }

    /// Short name: `fp`, `int8-dynamic` or `int8-static`.
    pub fn name(self) -> &'static str {
        match self {
            LayerPrecision::Fp => "fp",
            LayerPrecision::Int8Dynamic => "int8-dynamic",
            LayerPrecision::Int8Static { .. } => "int8-static",
        }
    }
}

/// `layer` (full precision, fed at `point`) in the precision `points` gives
/// its input; full precision where `points` names none. The converter of
/// `with_linears` for a whole plan.
pub fn in_precision(
    points: &BTreeMap<String, LayerPrecision>,
    point: &str,
    layer: &Linear,
) -> Result<Linear> {
    points
        .get(point)
        .copied()
        .unwrap_or(LayerPrecision::Fp)
        .apply(layer)
}

/// What kind of model an artifact holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ModelKind {
    /// An MLP control policy.
    Policy,
    /// A Llama-family language model.
    LanguageModel,
}

/// `qforge.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArtifactConfig {
    /// Always `qforge-int8`.
    pub format: String,
    /// Layout version.
    pub version: u32,
    /// The model kind.
    pub kind: ModelKind,
    /// Largest int8 weight magnitude: 127 ([`WEIGHT_QMAX`]; 63 in artifacts
    /// written by builds whose AVX2 GEMM took 7-bit weights, which load as
    /// they are).
    pub weight_qmax: i8,
    /// Precision of every observation point.
    pub points: BTreeMap<String, LayerPrecision>,
    /// Linear inputs the forward rotates online by a Hadamard matrix, their
    /// weights holding the rotation (`["mlp.down_proj", "lm_head"]`, see
    /// `Llama::rotated`). Absent: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub online_rotations: Vec<RotatedInput>,
}

/// Whether `dir` holds a native artifact.
pub fn is_artifact(dir: &Path) -> bool {
    // `exists`, not `is_file`: a `qforge.json` that is a FIFO or a device
    // still marks an artifact, whose loader then says what is wrong with it.
    dir.join(ARTIFACT_FILE).exists()
}

/// Reads and checks `qforge.json`.
pub fn read_config(dir: &Path) -> Result<ArtifactConfig> {
    let path = dir.join(ARTIFACT_FILE);
    let config: ArtifactConfig = qforge_formats::files::read_json(&path)?;
    if config.format != FORMAT || config.version != VERSION {
        return Err(qforge_formats::Error::Unsupported(format!(
            "{}: artifact format {:?} version {} (this qforge reads {FORMAT} version {VERSION})",
            path.display(),
            config.format,
            config.version
        ))
        .into());
    }
    if !(1..=127).contains(&config.weight_qmax) {
        return Err(Error::Format(format!(
            "{}: weight_qmax {} is not in 1..=127",
            path.display(),
            config.weight_qmax
        )));
    }
    // A scale of 0, 1e-40 or infinity (1e39 parses to f32 infinity)
    // quantizes every activation to 0 or saturates it: the layer then
    // answers garbage instead of failing.
    for (point, precision) in &config.points {
        if let LayerPrecision::Int8Static { input_scale } = *precision {
            numbers::check_input_scale(&path, point, input_scale)?;
        }
    }
    Ok(config)
}

/// `qforge.json` of an artifact that must hold a model of `kind`.
fn read_config_of(dir: &Path, kind: ModelKind) -> Result<ArtifactConfig> {
    let config = read_config(dir)?;
    if config.kind != kind {
        return Err(Error::Format(format!(
            "{} holds a {:?} artifact, not a {kind:?} one",
            dir.display(),
            config.kind
        )));
    }
    Ok(config)
}

/// The precision of `point`, which every artifact must list.
fn precision_of(points: &BTreeMap<String, LayerPrecision>, point: &str) -> Result<LayerPrecision> {
    points.get(point).copied().ok_or_else(|| {
        Error::Format(format!(
            "{ARTIFACT_FILE} gives no precision for {point}; the artifact is incomplete"
        ))
    })
}

/// The dtype the artifact stores a full-precision tensor held in `held`
/// in: bf16 stays bf16 (a bf16 source's embedding, and its weights that
/// nothing rescaled), everything else is f32, which holds it exactly.
fn stored_dtype(held: DType) -> Dtype {
    match held {
        DType::BF16 => Dtype::BF16,
        _ => Dtype::F32,
    }
}

/// Writes `tensor`'s values as little-endian `dtype` (f32, or bf16 for a
/// tensor whose values are all bf16), a chunk at a time: a tensor's bytes
/// are never all in memory at once.
fn write_floats(tensor: &Tensor, dtype: Dtype, out: &mut dyn Write) -> std::io::Result<()> {
    let chunk = qforge_formats::spill::CHUNK / 4;
    let flat = tensor.flatten_all().map_err(std::io::Error::other)?;
    let count = flat.elem_count();
    for start in (0..count).step_by(chunk) {
        let values = flat
            .narrow(0, start, chunk.min(count - start))
            .and_then(|part| part.to_dtype(DType::F32)?.to_vec1::<f32>())
            .map_err(std::io::Error::other)?;
        match dtype {
            Dtype::BF16 => qforge_formats::spill::write_bf16(&values, out)?,
            _ => qforge_formats::spill::write_f32(&values, out)?,
        }
    }
    Ok(())
}

/// Makes a tensor's bytes and writes them out.
type MakeBytes<'a> = Box<dyn Fn(&mut dyn Write) -> std::io::Result<()> + 'a>;

/// An artifact tensor, made when it is written.
struct Pending<'a> {
    dtype: Dtype,
    shape: Vec<usize>,
    make: MakeBytes<'a>,
}

impl TensorSource for Pending<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn write_to(&self, out: &mut dyn Write) -> std::io::Result<()> {
        (self.make)(out)
    }
}

/// Tensors to write, by name.
#[derive(Default)]
struct TensorsOut<'a>(BTreeMap<String, Pending<'a>>);

impl<'a> TensorsOut<'a> {
    fn add(
        &mut self,
        name: String,
        (dtype, shape): (Dtype, Vec<usize>),
        make: impl Fn(&mut dyn Write) -> std::io::Result<()> + 'a,
    ) {
        let make = Box::new(make);
        self.0.insert(name, Pending { dtype, shape, make });
    }

    /// A full-precision tensor, in [`stored_dtype`].
    fn float(&mut self, name: String, tensor: Tensor) {
        let (dtype, shape) = (stored_dtype(tensor.dtype()), tensor.dims().to_vec());
        self.add(name, (dtype, shape), move |out| {
            write_floats(&tensor, dtype, out)
        });
    }

    /// A linear layer of the full-precision model, written in `precision`.
    fn linear(&mut self, name: &str, layer: &'a Linear, precision: LayerPrecision) -> Result<()> {
        let (out, inp) = layer.shape();
        match precision {
            LayerPrecision::Fp => {
                let dtype = stored_dtype(layer.full_precision_dtype());
                self.add(
                    format!("{name}.weight"),
                    (dtype, vec![out, inp]),
                    move |w| {
                        let (weight, _) = layer.full_precision().map_err(std::io::Error::other)?;
                        write_floats(&weight, dtype, w)
                    },
                )
            }
            LayerPrecision::Int8Dynamic | LayerPrecision::Int8Static { .. } => {
                // A layer rounded to nearest is rounded when its values are
                // written (the name sorts them first); its scales are kept
                // for their own tensor instead of rounding it again.
                let scales = Rc::new(OnceCell::new());
                let kept = scales.clone();
                self.add(
                    format!("{name}.weight"),
                    (Dtype::I8, vec![out, inp]),
                    move |w| {
                        let int8 = layer.int8_weight().map_err(std::io::Error::other)?;
                        qforge_formats::spill::write_i8(&int8.values, w)?;
                        let _ = kept.set(int8.scales.clone());
                        Ok(())
                    },
                );
                self.add(
                    format!("{name}.weight_scale"),
                    (Dtype::F32, vec![out, 1]),
                    move |w| {
                        let scales = match scales.get() {
                            Some(scales) => Cow::Borrowed(scales),
                            None => Cow::Owned(
                                layer
                                    .int8_weight()
                                    .map_err(std::io::Error::other)?
                                    .scales
                                    .clone(),
                            ),
                        };
                        let bytes: Vec<u8> = scales.iter().flat_map(|v| v.to_le_bytes()).collect();
                        w.write_all(&bytes)
                    },
                );
            }
        }
        // The bias alone: the weight is widened only when it is written.
        if let Some(bias) = layer.bias()? {
            self.float(format!("{name}.bias"), bias.clone());
        }
        Ok(())
    }

    fn write(self, path: &Path) -> Result<()> {
        Ok(write_safetensors(path, self.0.into_iter().collect())?)
    }
}

fn write_json(path: &Path, value: &impl Serialize) -> Result<()> {
    let text = serde_json::to_string_pretty(value).expect("plain data serializes");
    std::fs::write(path, text + "\n").map_err(|e| Error::io(path, e))
}

fn write_config(
    dir: &Path,
    kind: ModelKind,
    points: &BTreeMap<String, LayerPrecision>,
    online_rotations: Vec<RotatedInput>,
) -> Result<()> {
    write_json(
        &dir.join(ARTIFACT_FILE),
        &ArtifactConfig {
            format: FORMAT.into(),
            version: VERSION,
            kind,
            weight_qmax: WEIGHT_QMAX,
            points: points.clone(),
            online_rotations,
        },
    )
}

/// Checks that `points` covers exactly the model's observation points.
fn check_points<'a>(
    points: &BTreeMap<String, LayerPrecision>,
    model_points: impl Iterator<Item = &'a str>,
) -> Result<()> {
    let model: std::collections::BTreeSet<&str> = model_points.collect();
    if let Some(unknown) = points.keys().find(|p| !model.contains(p.as_str())) {
        return Err(Error::Format(format!(
            "precision given for {unknown}, which is not a layer input of this model"
        )));
    }
    if let Some(missing) = model.iter().find(|p| !points.contains_key(**p)) {
        return Err(Error::Format(format!("no precision given for {missing}")));
    }
    Ok(())
}

/// Writes `policy` (full precision) into the empty directory `dir` with
/// each layer in the precision of its point.
pub fn write_policy(
    dir: &Path,
    policy: &MlpPolicy,
    points: &BTreeMap<String, LayerPrecision>,
) -> Result<()> {
    let linears = policy.linears();
    check_points(points, linears.iter().map(|(_, point, _)| point.as_str()))?;
    let mut tensors = TensorsOut::default();
    for (name, point, layer) in &linears {
        tensors.linear(name, layer, precision_of(points, point)?)?;
    }
    tensors.write(&dir.join(WEIGHTS_FILE))?;
    write_json(&dir.join("policy.json"), policy.config())?;
    write_config(dir, ModelKind::Policy, points, Vec::new())
}

/// Writes `lm` (full precision) into the empty directory `dir` with each
/// linear layer in the precision of its point, as a Hugging Face directory
/// plus `qforge.json`.
pub fn write_language_model(
    dir: &Path,
    lm: &LanguageModel,
    points: &BTreeMap<String, LayerPrecision>,
) -> Result<()> {
    let linears = lm.model.linears();
    check_points(points, linears.iter().map(|(_, point, _)| point.as_str()))?;
    let mut tensors = TensorsOut::default();
    for (name, tensor) in lm.model.other_tensors() {
        tensors.float(name, tensor.clone());
    }
    for (name, point, layer) in &linears {
        tensors.linear(name, layer, precision_of(points, point)?)?;
    }
    tensors.write(&dir.join(WEIGHTS_FILE))?;
    let mut config = lm.model.config().to_hf();
    // The artifact stores lm_head whatever the source did (an INT8 lm_head
    // differs from the f32 embedding); exports need to know the source tied
    // them.
    config["tie_word_embeddings"] = lm.model.tied_embeddings().into();
    write_json(&dir.join("config.json"), &config)?;
    lm.text.tokenizer.save(dir)?;
    let token = |id: Option<u32>| id.and_then(|i| lm.text.tokenizer.decode(&[i]).ok());
    write_json(
        &dir.join("tokenizer_config.json"),
        &serde_json::json!({
            "add_bos_token": lm.text.tokenizer.adds_bos(),
            "bos_token": token(lm.text.tokenizer.bos),
            "eos_token": token(lm.text.tokenizer.eos.first().copied()),
            "chat_template": lm.text.chat_template,
        }),
    )?;
    write_config(
        dir,
        ModelKind::LanguageModel,
        points,
        lm.model.rotated_inputs(),
    )
}

/// The int8 values of every int8 layer of the artifact in `dir`, by layer
/// name: what `Linear::int8_weight` gave when it was written.
pub fn int8_weights(dir: &Path) -> Result<BTreeMap<String, Vec<i8>>> {
    let path = dir.join(WEIGHTS_FILE);
    let file = qforge_formats::files::open_regular(&path)?;
    // SAFETY: a read-only map of a file qforge does not modify (artifacts
    // are written once, then renamed into place).
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
    let tensors = SafeTensors::deserialize(&map)
        .map_err(|e| Error::Format(format!("{}: {e}", path.display())))?;
    Ok(tensors
        .iter()
        .filter(|(_, view)| view.dtype() == Dtype::I8)
        .filter_map(|(name, view)| {
            let layer = name.strip_suffix(".weight")?;
            Some((
                layer.to_owned(),
                view.data().iter().map(|&b| b as i8).collect(),
            ))
        })
        .collect())
}

/// The tensors of an artifact, memory-mapped.
struct ArtifactTensors {
    map: memmap2::Mmap,
    path: std::path::PathBuf,
    /// The header, parsed and checked once: where each tensor's bytes start
    /// (after `data_start`) and end.
    metadata: safetensors::tensor::Metadata,
    data_start: usize,
    points: BTreeMap<String, LayerPrecision>,
    /// Linear layer name → its observation point.
    point_of: HashMap<String, String>,
}

impl ArtifactTensors {
    fn open(
        dir: &Path,
        config: &ArtifactConfig,
        point_of: HashMap<String, String>,
    ) -> Result<Self> {
        let path = dir.join(WEIGHTS_FILE);
        let file = qforge_formats::files::open_regular(&path)?;
        // SAFETY: a read-only map of a file qforge does not modify while the
        // model is loaded (artifacts are written once, then renamed into place).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
        let malformed =
            |e: safetensors::SafeTensorError| Error::Format(format!("{}: {e}", path.display()));
        // Full validation (offsets within the file) once, then only lookups.
        SafeTensors::deserialize(&map).map_err(malformed)?;
        let (header, metadata) = SafeTensors::read_metadata(&map).map_err(malformed)?;
        Ok(Self {
            map,
            data_start: 8 + header,
            metadata,
            path,
            points: config.points.clone(),
            point_of,
        })
    }

    fn view(&self, name: &str) -> Result<safetensors::tensor::TensorView<'_>> {
        let info =
            self.metadata
                .info(name)
                .ok_or_else(|| qforge_formats::Error::MissingTensor {
                    name: name.to_owned(),
                    file: self.path.clone(),
                })?;
        let (start, end) = info.data_offsets;
        let bytes = &self.map[self.data_start + start..self.data_start + end];
        safetensors::tensor::TensorView::new(info.dtype, info.shape.clone(), bytes)
            .map_err(|e| Error::Format(format!("{}: {name}: {e}", self.path.display())))
    }

    fn f32_values(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let view = self.view(name)?;
        if view.dtype() != Dtype::F32 || view.shape() != shape {
            return Err(Error::Format(format!(
                "{}: {name} is {:?} {:?}, expected F32 {shape:?}",
                self.path.display(),
                view.dtype(),
                view.shape()
            )));
        }
        let values: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        check_finite(name, values.iter().copied()).map_err(|e| e.in_file(&self.path))?;
        Ok(values)
    }

    /// A full-precision tensor in the dtype it is stored in (f32, or bf16
    /// for one that was bf16 when written), checked finite.
    fn float_tensor(&self, name: &str) -> Result<Tensor> {
        let view = self.view(name)?;
        let data = view.data();
        let (dtype, finite) = match view.dtype() {
            Dtype::F32 => (
                DType::F32,
                check_finite(
                    name,
                    data.chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
                ),
            ),
            Dtype::BF16 => (
                DType::BF16,
                check_finite(name, crate::linear::bf16_values(data)),
            ),
            other => {
                return Err(Error::Format(format!(
                    "{}: {name} is {other:?}; artifacts store full-precision tensors in F32 or BF16",
                    self.path.display()
                )));
            }
        };
        finite.map_err(|e| e.in_file(&self.path))?;
        Ok(Tensor::from_raw_buffer(
            data,
            dtype,
            view.shape(),
            &Device::Cpu,
        )?)
    }

    fn linear_layer(&self, name: &str, bias: bool, (out, inp): (usize, usize)) -> Result<Linear> {
        let point = self
            .point_of
            .get(name)
            .ok_or_else(|| Error::Format(format!("{name} is not a linear layer of this model")))?;
        let bias = if bias {
            Some(self.f32_values(&format!("{name}.bias"), &[out])?)
        } else {
            None
        };
        let weight_name = format!("{name}.weight");
        match precision_of(&self.points, point)?.activations() {
            None => {
                let weight = self.float_tensor(&weight_name)?;
                if weight.dims() != [out, inp] {
                    return Err(Error::Format(format!(
                        "{}: {weight_name} is {:?}, expected [{out}, {inp}]",
                        self.path.display(),
                        weight.dims()
                    )));
                }
                Linear::fp(
                    name,
                    weight,
                    bias.map(|b| Tensor::from_vec(b, out, &Device::Cpu))
                        .transpose()?,
                    (out, inp),
                )
            }
            Some(activations) => {
                let view = self.view(&weight_name)?;
                if view.dtype() != Dtype::I8 || view.shape() != [out, inp] {
                    return Err(Error::Format(format!(
                        "{}: {weight_name} is {:?} {:?}, expected I8 [{out}, {inp}]",
                        self.path.display(),
                        view.dtype(),
                        view.shape()
                    )));
                }
                let values: Vec<i8> = view.data().iter().map(|&b| b as i8).collect();
                let scale_name = format!("{name}.weight_scale");
                // Usable: `check_numbers` checked every scale before loading.
                let scales = self.f32_values(&scale_name, &[out, 1])?;
                Ok(Linear::Int8(Arc::new(Int8Linear::from_quantized(
                    &values,
                    scales,
                    (out, inp),
                    bias.as_deref(),
                    activations,
                )?)))
            }
        }
    }
}

impl WeightSource for ArtifactTensors {
    fn tensor(&self, name: &str) -> Result<Tensor> {
        self.float_tensor(name)
    }

    fn has(&self, name: &str) -> bool {
        self.metadata.info(name).is_some()
    }

    fn linear(&self, name: &str, bias: bool, shape: (usize, usize)) -> Result<Linear> {
        self.linear_layer(name, bias, shape)
    }
}

/// Checks `dir` against its manifest and its numbers ([`check_numbers`])
/// before anything of it is loaded: a flipped weight byte or an edited
/// `qforge.json` was otherwise served as if `qforge quantize` had written
/// it. Every loader of an artifact starts here, so `serve`, `eval`,
/// `generate`, `act` and the rest all check.
///
/// It re-hashes every file, once per load: SHA-256 runs at about 1 GB/s
/// here (SHA-NI), so SmolLM2's 367 MB artifact takes about 0.35 s more to
/// open (`qforge generate --max-tokens 1`: median 0.87 s → 1.23 s). A file
/// swapped between this check and its read is outside what it guards, as
/// for any writer racing a loader. The numbers' check reads the float
/// tensors once more: 60 ms of the 0.7 s that opening SmolLM2's 249 MB
/// int8-dynamic artifact takes.
fn verify_before_loading(dir: &Path) -> Result<()> {
    if !dir.join(MANIFEST_FILE).exists() {
        return Err(Error::Format(format!(
            "{} has {ARTIFACT_FILE} but no {MANIFEST_FILE}, so its files cannot be checked \
             before loading; write it again with `qforge quantize`",
            dir.display()
        )));
    }
    qforge_formats::manifest::verify(dir)?;
    check_numbers(dir)
}

/// Loads a policy artifact, after checking it against its manifest.
pub fn load_policy(dir: &Path) -> Result<MlpPolicy> {
    verify_before_loading(dir)?;
    let config = read_config_of(dir, ModelKind::Policy)?;
    let policy_path = dir.join("policy.json");
    let policy: PolicyConfig = qforge_formats::files::read_json(&policy_path)?;
    // A policy's layer names are its observation points.
    let point_of = config
        .points
        .keys()
        .map(|p| (p.clone(), p.clone()))
        .collect();
    let tensors = ArtifactTensors::open(dir, &config, point_of)?;
    let model = MlpPolicy::from_linears(policy, |name, shape| {
        tensors.linear_layer(name, true, shape)
    })
    .map_err(|e| e.in_file(dir))?;
    check_points(
        &config.points,
        model.linears().iter().map(|(_, point, _)| point.as_str()),
    )
    .map_err(|e| e.in_file(&dir.join(ARTIFACT_FILE)))?;
    Ok(model)
}

/// Loads a language-model artifact, after checking it against its
/// manifest.
pub fn load_language_model(dir: &Path) -> Result<LanguageModel> {
    verify_before_loading(dir)?;
    let config = read_config_of(dir, ModelKind::LanguageModel)?;
    let config_path = dir.join("config.json");
    let json: serde_json::Value = qforge_formats::files::read_json(&config_path)?;
    let llama_config = LlamaConfig::from_hf(&json).map_err(|e| e.in_file(&config_path))?;
    let point_of = Llama::linear_points(&llama_config).into_iter().collect();
    let tensors = ArtifactTensors::open(dir, &config, point_of)?;
    let model = Llama::load(llama_config, &tensors)
        .and_then(|m| m.with_rotations(&config.online_rotations))
        .map_err(|e| e.in_file(dir))?;
    check_points(
        &config.points,
        model.linears().iter().map(|(_, point, _)| point.as_str()),
    )
    .map_err(|e| e.in_file(&dir.join(ARTIFACT_FILE)))?;
    let text = TextSide::load(dir)?;
    Ok(LanguageModel {
        model,
        text,
        source: dir.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tensor_that_makes_other_than_its_size_is_an_error_and_so_is_a_failed_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let mut short = TensorsOut::default();
        short.add("w".into(), (Dtype::F32, vec![2, 2]), |out| {
            out.write_all(&[0; 12])
        });
        let e = short.write(&path).unwrap_err().to_string();
        assert!(
            e.contains("w gave 12 bytes where its shape needs 16"),
            "{e}"
        );

        let mut failing = TensorsOut::default();
        failing.add("w".into(), (Dtype::I8, vec![3]), |_| {
            Err(std::io::Error::other("no int8 rounding for w"))
        });
        let e = failing.write(&path).unwrap_err().to_string();
        assert!(
            e.contains("model.safetensors") && e.contains("no int8 rounding for w"),
            "{e}"
        );
    }
}
