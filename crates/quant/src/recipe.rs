//! The quantization recipe: a TOML file (every field also a `qforge
//! quantize` flag) saying how to calibrate, how to quantize each layer
//! input, and what accuracy the result must keep. `recipes/w8a8.toml` in the
//! repository documents every field with its default.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use qforge_calib::Stratify;
use qforge_core::Calibrator;
use qforge_model::RotatedInput;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// How static activation scales are chosen: a calibrator, written as
/// `qforge stats show` prints it (`minmax`, `percentile(99.99)`, `entropy`,
/// `mse`, `sigma(3)`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct CalibratorChoice(pub Calibrator);

impl TryFrom<String> for CalibratorChoice {
    type Error = String;

    fn try_from(text: String) -> std::result::Result<Self, String> {
        Calibrator::from_str(&text)
            .map(CalibratorChoice)
            .map_err(|e| e.to_string())
    }
}

impl From<CalibratorChoice> for String {
    fn from(choice: CalibratorChoice) -> String {
        choice.0.to_string()
    }
}

impl fmt::Display for CalibratorChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// How activations are quantized by default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum ActivationScheme {
    /// One calibrated scale per layer input (cheapest at run time).
    Static,
    /// A scale per token (row), computed at run time (no calibration needed).
    Dynamic,
}

/// What replaces static scales when calibration covered too little data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LowCoverage {
    /// Dynamic per-token activations (still integer compute).
    Dynamic,
    /// Full precision for every layer that would have been static.
    Fp,
}

/// The calibration pass.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CalibrationSection {
    /// Samples to draw: sequences (LLMs) or observations (policies).
    pub samples: usize,
    /// Most tokens per sequence (LLMs).
    pub seq_len: usize,
    /// Samples per batch.
    pub batch_size: usize,
    /// Seed of the sampling.
    pub seed: u64,
    /// How samples are drawn.
    pub stratify: Stratify,
    /// Static scales are used only when the statistics cover at least this
    /// fraction of the planned batches.
    pub min_coverage: f64,
    /// What to do below `min_coverage`.
    pub low_coverage: LowCoverage,
}

impl Default for CalibrationSection {
    fn default() -> Self {
        let calib = qforge_calib::Recipe::default();
        Self {
            samples: calib.samples,
            seq_len: calib.seq_len,
            batch_size: calib.batch_size,
            seed: calib.seed,
            stratify: calib.stratify,
            min_coverage: 1.0,
            low_coverage: LowCoverage::Dynamic,
        }
    }
}

/// How layers are quantized.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QuantizeSection {
    /// Activation scheme of every layer input not overridden below.
    pub activations: ActivationScheme,
    /// Calibrator of static scales.
    pub calibrator: CalibratorChoice,
    /// Calibrator per layer input: a key matches an input whose name is the
    /// key or ends with `.key` (`down_proj`, `layers.0`, `lm_head`).
    pub calibrators: BTreeMap<String, CalibratorChoice>,
    /// Layer inputs kept in full precision (matched like `calibrators`),
    /// e.g. a policy's first or last layer.
    pub ignore: Vec<String>,
    /// The tied embedding / output projection of a language model: int8
    /// weights with dynamic activations by default (its f32 copy alone reads
    /// as many bytes per token as every other layer at int8).
    pub lm_head: LmHead,
}

/// How a language model's `lm_head` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LmHead {
    /// INT8 weights, dynamic activations.
    Int8,
    /// Full precision.
    Fp,
}

impl Default for QuantizeSection {
    fn default() -> Self {
        Self {
            activations: ActivationScheme::Static,
            calibrator: CalibratorChoice(Calibrator::MinMax),
            calibrators: BTreeMap::new(),
            ignore: Vec::new(),
            lm_head: LmHead::Int8,
        }
    }
}

/// The accuracy the quantized model must keep on held-out data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GuardSection {
    /// Language models: largest relative perplexity increase (0.03 = +3 %).
    pub max_perplexity_increase: f64,
    /// Policies: smallest action agreement with the full-precision policy.
    pub min_agreement: f64,
    /// Largest share of linear layers the fallback may leave in full
    /// precision; beyond it the run refuses (exit code 3).
    pub max_fp_fraction: f64,
    /// Tokens per perplexity chunk (language models).
    pub ctx: usize,
}

impl Default for GuardSection {
    fn default() -> Self {
        Self {
            max_perplexity_increase: 0.03,
            min_agreement: 0.99,
            max_fp_fraction: 0.25,
            ctx: 256,
        }
    }
}

/// SmoothQuant (language models).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SmoothingSection {
    /// Run it: a first pass records each layer input's per-channel abs-max,
    /// the smoothing factors fold into the preceding norms (and `up_proj`'s
    /// rows for `down_proj`), and a second pass calibrates the smoothed model.
    pub enabled: bool,
    /// Migration strength α: factor `s_j = max|X_j|^α / max|W_j|^(1−α)`,
    /// one for every input. Unset: chosen per smoothable input from
    /// [`crate::smoothing::ALPHA_GRID`] by the output error of the layers the
    /// input feeds, quantized as the recipe says, on calibration rows.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alpha: Option<f64>,
    /// Rows (tokens, or observations) of calibration data the α search runs
    /// on: the plan's first batches until this many.
    pub search_rows: usize,
}

impl Default for SmoothingSection {
    fn default() -> Self {
        Self {
            enabled: false,
            alpha: None,
            search_rows: 512,
        }
    }
}

/// How the method (SmoothQuant, rotation, GPTQ) is chosen.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MethodSection {
    /// When the recipe enables no method itself, try the methods in order of
    /// cost ([`Method::ORDER`]) and keep the first whose plan meets the
    /// guard's budget before any layer falls back (with static activations:
    /// or at the end of its ladder bounded to keep 90 % of the layers
    /// static, which the fallback then walks); when none does, the one that
    /// comes closest. The layer-by-layer fallback then runs on the chosen
    /// one.
    pub search: bool,
}

impl Default for MethodSection {
    fn default() -> Self {
        Self { search: true }
    }
}

/// A quantization method: what is done to the model before the guard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Method {
    /// Calibrate and quantize the model as it is.
    Plain,
    /// SmoothQuant (one extra calibration pass).
    Smoothquant,
    /// The residual stream rotated offline (language models): no run-time
    /// cost, and the artifact exports like a plain one.
    ResidualHadamard,
    /// QuaRot: the residual offline, down_proj's input online (language
    /// models; a little run-time cost; compressed-tensors carries the online
    /// rotation as a transform).
    Quarot,
    /// QuaRot, then GPTQ's rounding (Hessian passes and a solve per layer).
    QuarotGptq,
    /// Every decoder linear's input rotated online (q/k/v, o_proj, gate/up,
    /// down_proj; not lm_head's, which vLLM could not apply): four
    /// rotations a layer at run time, the dearest method, and on SmolLM2
    /// the one whose static scales hold (BENCHMARKS.md).
    HadamardInputs,
}

impl Method {
    /// Every method, cheapest first.
    pub const ORDER: [Method; 6] = [
        Method::Plain,
        Method::Smoothquant,
        Method::ResidualHadamard,
        Method::Quarot,
        Method::QuarotGptq,
        Method::HadamardInputs,
    ];

    /// The name used in reports and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Method::Plain => "plain",
            Method::Smoothquant => "smoothquant",
            Method::ResidualHadamard => "residual-hadamard",
            Method::Quarot => "quarot",
            Method::QuarotGptq => "quarot+gptq",
            Method::HadamardInputs => "hadamard-inputs",
        }
    }

    /// Whether the method applies to a policy (rotations fold into a
    /// decoder's norms and layers).
    pub fn fits_policies(self) -> bool {
        matches!(self, Method::Plain | Method::Smoothquant)
    }
}

/// Rotations (language models).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RotationSection {
    /// Linear inputs rotated by the normalized Hadamard matrix of their
    /// width (QuaRot): offline in the weights, online in qforge's engine.
    /// Spreads outlier channels over all channels. compressed-tensors
    /// carries every online rotation but lm_head's as a transform. Names:
    /// `self_attn.q_proj`, `self_attn.o_proj`, `mlp.gate_proj`,
    /// `mlp.down_proj`, `lm_head`.
    pub inputs: Vec<RotatedInput>,
    /// Rotate the residual stream offline (QuaRot's main rotation: the
    /// norms' gains fold into the linears they feed, the embedding and the
    /// layers writing the residual are rotated). q/k/v, gate/up and lm_head
    /// then take rotated inputs at no run-time cost, and the model stays a
    /// plain Llama that every format carries; `inputs` adds the ones the
    /// residual does not reach (`self_attn.o_proj`, `mlp.down_proj`).
    pub residual: bool,
    /// Seed of the residual rotation's random ±1 signs (QuaRot's randomized
    /// Hadamard matrix `diag(s) Q`).
    pub seed: u64,
}

impl RotationSection {
    /// QuaRot's arrangement (Ashkboos et al. 2024) without its o_proj
    /// rotation: the residual offline (signs from `seed`), down_proj's input
    /// online. On SmolLM2 rotating o_proj's input online as well changed
    /// the perplexity by 0.001 % (BENCHMARKS.md), not worth its run time.
    pub fn quarot(seed: u64) -> Self {
        Self {
            inputs: vec![RotatedInput::MlpProduct],
            residual: true,
            seed,
        }
    }

    /// Every decoder linear's input rotated online, lm_head's not
    /// ([`Method::HadamardInputs`]).
    pub fn decoder_inputs() -> Self {
        Self {
            inputs: vec![
                RotatedInput::Attention,
                RotatedInput::AttentionOutput,
                RotatedInput::Mlp,
                RotatedInput::MlpProduct,
            ],
            residual: false,
            seed: 0,
        }
    }

    /// The residual rotated offline alone (signs from `seed`).
    pub fn residual(seed: u64) -> Self {
        Self {
            inputs: Vec::new(),
            residual: true,
            seed,
        }
    }

    /// Whether anything is rotated.
    pub fn is_enabled(&self) -> bool {
        self.residual || !self.inputs.is_empty()
    }

    /// Whether the inputs rotated online are `inputs`, in any order.
    fn rotates_exactly(&self, inputs: &[RotatedInput]) -> bool {
        let mut ours = self.inputs.clone();
        ours.sort();
        ours.dedup();
        let mut theirs = inputs.to_vec();
        theirs.sort();
        ours == theirs
    }

    /// Reads a comma-separated list of `residual` and linear inputs (as
    /// [`RotatedInput::parse`] takes them), `all` (every input online) or
    /// `quarot` ([`RotationSection::quarot`]); the residual's signs from
    /// `seed`.
    pub fn parse(list: &str, seed: u64) -> Result<Self> {
        if list == "quarot" {
            return Ok(Self::quarot(seed));
        }
        let names: Vec<&str> = list.split(',').map(str::trim).collect();
        let residual = names.contains(&"residual");
        let online: Vec<&str> = names.into_iter().filter(|n| *n != "residual").collect();
        let inputs = if online.is_empty() {
            Vec::new()
        } else {
            RotatedInput::parse_list(&online.join(","))
                .map_err(|e| Error::Recipe(format!("hadamard: {e}")))?
        };
        Ok(Self {
            inputs,
            residual,
            seed,
        })
    }

    /// An online input the residual rotation already rotates, if the
    /// section names one beside it.
    fn redundant_input(&self) -> Option<RotatedInput> {
        let reached = [
            RotatedInput::Attention,
            RotatedInput::Mlp,
            RotatedInput::Head,
        ];
        self.residual
            .then(|| self.inputs.iter().copied().find(|i| reached.contains(i)))
            .flatten()
    }
}

/// GPTQ (Frantar et al. 2022) for the int8 weights.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GptqSection {
    /// Run it: the activation pass (and, past `hessian_memory_mib`, Hessian
    /// passes after it) sum the exact `Σ x xᵀ` of every linear input, and
    /// every int8 layer's weights are rounded column by column with error
    /// compensation instead of to nearest.
    pub enabled: bool,
    /// Columns per block of lazily applied updates.
    pub block_size: usize,
    /// Added to the Hessian's diagonal, as a fraction of its mean.
    pub dampening: f64,
    /// Round columns in order of decreasing Hessian diagonal (act-order).
    pub act_order: bool,
    /// Memory the Hessians of one pass may take, MiB (16 bytes per entry of
    /// each input's upper triangle): the inputs are cut into as many passes
    /// as needed, so memory holds one group of layers' Hessians (each worker
    /// thread holds its own partial sums beside the merged ones: SmolLM2's
    /// 806 MB of Hessians in one pass peaked at 5.1 GB resident with two
    /// threads, against 3.2 GB in four passes of 256 MiB). Every pass runs
    /// the forward again up to its last layer, so fewer passes are faster:
    /// 25.5 s against 43.4 s there.
    pub hessian_memory_mib: usize,
    /// Propagate the rounding (GPTQ's sequential order, Frantar et al. 2022,
    /// the "true-sequential" option of its reference code): one pass per
    /// layer input, each observing the model with every layer rounded so far
    /// computing with its rounded weights, so that a layer's rounding
    /// compensates the error of those before it. Off: every pass observes
    /// the full-precision model. Each pass resumes from the hidden states
    /// the one before it kept, so the passes together still run the model
    /// about once; the rounded layers live in the coordinating process, so
    /// it runs on embedded workers only.
    pub sequential: bool,
}

impl Default for GptqSection {
    fn default() -> Self {
        Self {
            enabled: false,
            block_size: 128,
            dampening: 0.01,
            act_order: false,
            hessian_memory_mib: 1024,
            sequential: false,
        }
    }
}

/// A quantization recipe.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QuantRecipe {
    /// How the method is chosen when the recipe names none.
    pub method: MethodSection,
    /// The calibration pass.
    pub calibration: CalibrationSection,
    /// SmoothQuant.
    pub smoothing: SmoothingSection,
    /// Rotations.
    pub rotation: RotationSection,
    /// GPTQ.
    pub gptq: GptqSection,
    /// How layers are quantized.
    pub quantize: QuantizeSection,
    /// The accuracy guard.
    pub guard: GuardSection,
}

/// Whether the layer input `point` is named by `key`: equal, or ending in
/// `.key`.
pub fn point_matches(point: &str, key: &str) -> bool {
    point == key
        || point
            .strip_suffix(key)
            .is_some_and(|head| head.ends_with('.'))
}

impl QuantRecipe {
    /// Parses a TOML recipe.
    pub fn from_toml(text: &str) -> Result<Self> {
        let recipe: Self = toml::from_str(text).map_err(|e| Error::Recipe(e.to_string()))?;
        recipe.validate()?;
        Ok(recipe)
    }

    /// The recipe as TOML.
    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("a recipe serializes")
    }

    /// Checks ranges.
    pub fn validate(&self) -> Result<()> {
        self.calibration_recipe()
            .validate()
            .map_err(|e| Error::Recipe(e.to_string()))?;
        let c = &self.calibration;
        let g = &self.guard;
        let checks = [
            (
                (0.0..=1.0).contains(&c.min_coverage),
                "calibration.min_coverage must be in [0, 1]",
            ),
            (
                g.max_perplexity_increase.is_finite() && g.max_perplexity_increase >= 0.0,
                "guard.max_perplexity_increase must be ≥ 0",
            ),
            (
                (0.0..=1.0).contains(&g.min_agreement),
                "guard.min_agreement must be in [0, 1]",
            ),
            (
                (0.0..=1.0).contains(&g.max_fp_fraction),
                "guard.max_fp_fraction must be in [0, 1]",
            ),
            (g.ctx >= 4, "guard.ctx must be at least 4 tokens"),
            (
                self.smoothing
                    .alpha
                    .is_none_or(|a| (0.0..=1.0).contains(&a)),
                "smoothing.alpha must be in [0, 1]",
            ),
            (
                self.smoothing.search_rows >= 1,
                "smoothing.search_rows must be at least 1",
            ),
            (
                self.gptq.block_size >= 1,
                "gptq.block_size must be at least 1",
            ),
            (
                self.gptq.dampening > 0.0 && self.gptq.dampening <= 1.0,
                "gptq.dampening must be in (0, 1]",
            ),
            (
                self.gptq.hessian_memory_mib >= 1,
                "gptq.hessian_memory_mib must be at least 1",
            ),
            (
                self.gptq.enabled || !self.gptq.sequential,
                "gptq.sequential orders GPTQ's rounding: it needs gptq.enabled",
            ),
        ];
        if let Some((_, message)) = checks.iter().find(|(ok, _)| !ok) {
            return Err(Error::Recipe((*message).into()));
        }
        match self.rotation.redundant_input() {
            Some(input) => Err(Error::Recipe(format!(
                "rotation: the residual rotation already rotates the {} inputs; rotate only self_attn.o_proj and mlp.down_proj online beside it",
                input.name()
            ))),
            None => Ok(()),
        }
    }

    /// The calibration pass this recipe runs (hashed into the statistics'
    /// provenance).
    pub fn calibration_recipe(&self) -> qforge_calib::Recipe {
        let c = &self.calibration;
        qforge_calib::Recipe {
            samples: c.samples,
            seq_len: c.seq_len,
            batch_size: c.batch_size,
            seed: c.seed,
            stratify: c.stratify,
            pass: qforge_calib::Pass::Activation,
        }
    }

    /// The calibrator of `point`: the longest matching override, else the
    /// default.
    pub fn calibrator_for(&self, point: &str) -> Calibrator {
        self.quantize
            .calibrators
            .iter()
            .filter(|(key, _)| point_matches(point, key))
            .max_by_key(|(key, _)| key.len())
            .map_or(self.quantize.calibrator.0, |(_, c)| c.0)
    }

    /// Whether the recipe enables a method itself (then it runs as given).
    pub fn names_a_method(&self) -> bool {
        self.smoothing.enabled || self.rotation.is_enabled() || self.gptq.enabled
    }

    /// The recipes the pipeline runs, in order: the methods of
    /// [`Method::ORDER`] that fit the model when this recipe searches (each
    /// with the search off and its method's sections on; SmoothQuant's α and
    /// GPTQ's options from this recipe), else this recipe alone.
    pub fn candidates(&self, policy: bool) -> Vec<(Method, QuantRecipe)> {
        if !self.method.search || self.names_a_method() {
            return vec![(self.method_named(), self.clone())];
        }
        Method::ORDER
            .into_iter()
            .filter(|m| !policy || m.fits_policies())
            .map(|method| {
                let mut recipe = self.clone();
                recipe.method.search = false;
                let seed = self.rotation.seed;
                match method {
                    Method::Plain => {}
                    Method::Smoothquant => recipe.smoothing.enabled = true,
                    Method::ResidualHadamard => recipe.rotation = RotationSection::residual(seed),
                    Method::Quarot => recipe.rotation = RotationSection::quarot(seed),
                    Method::QuarotGptq => {
                        recipe.rotation = RotationSection::quarot(seed);
                        recipe.gptq.enabled = true;
                    }
                    Method::HadamardInputs => recipe.rotation = RotationSection::decoder_inputs(),
                }
                (method, recipe)
            })
            .collect()
    }

    /// The method this recipe runs as given, named by its nearest
    /// [`Method`] (online rotations of other inputs count as QuaRot,
    /// SmoothQuant beside a rotation as SmoothQuant).
    fn method_named(&self) -> Method {
        let r = &self.rotation;
        if self.smoothing.enabled {
            Method::Smoothquant
        } else if !r.is_enabled() {
            Method::Plain
        } else if self.gptq.enabled {
            Method::QuarotGptq
        } else if r.inputs.is_empty() {
            Method::ResidualHadamard
        } else if !r.residual && r.rotates_exactly(&RotationSection::decoder_inputs().inputs) {
            Method::HadamardInputs
        } else {
            Method::Quarot
        }
    }

    /// Why the recipe cannot quantize a policy, if it cannot: the rotation
    /// folds into a decoder's norms and MLPs (SmoothQuant applies to a
    /// policy's observation).
    pub fn needs_language_model(&self) -> Option<&'static str> {
        self.rotation.is_enabled().then_some(
            "Hadamard rotations fold into a decoder's norms and layers: they apply to language models, not policies",
        )
    }

    /// Whether `point` is on the ignore list.
    pub fn ignores(&self, point: &str) -> bool {
        self.quantize
            .ignore
            .iter()
            .any(|key| point_matches(point, key))
    }
}

/// Changes to a recipe, field by field: `qforge quantize`'s recipe flags
/// (with the `clap` feature, these fields are those flags, their docs the
/// help) and the Python package's `quantize` keywords. `None`, `false` and
/// an empty list keep the recipe's value.
#[derive(Debug, Clone, Default)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
#[cfg_attr(feature = "clap", command(next_help_heading = "Recipe overrides"))]
pub struct Overrides {
    /// [method] run the recipe as given (plain, unless --smoothquant,
    /// --hadamard or --gptq name a method) instead of trying plain,
    /// SmoothQuant, the residual rotation, QuaRot, QuaRot + GPTQ and every
    /// decoder input rotated online, in order of cost, until one meets the
    /// guard before any fallback (static activations: or at the end of its
    /// ladder bounded to keep 90 % static; policies: plain and SmoothQuant).
    #[cfg_attr(feature = "clap", arg(long))]
    pub no_method_search: bool,
    /// [calibration] samples to draw.
    #[cfg_attr(feature = "clap", arg(long))]
    pub samples: Option<usize>,
    /// [calibration] most tokens per sequence.
    #[cfg_attr(feature = "clap", arg(long))]
    pub seq_len: Option<usize>,
    /// [calibration] samples per batch.
    #[cfg_attr(feature = "clap", arg(long))]
    pub batch_size: Option<usize>,
    /// [calibration] seed of the sampling.
    #[cfg_attr(feature = "clap", arg(long))]
    pub seed: Option<u64>,
    /// [calibration] how samples are drawn.
    #[cfg_attr(feature = "clap", arg(long, value_enum))]
    pub stratify: Option<Stratify>,
    /// [calibration] least coverage for static scales.
    #[cfg_attr(feature = "clap", arg(long))]
    pub min_coverage: Option<f64>,
    /// [quantize] activation scheme.
    #[cfg_attr(feature = "clap", arg(long, value_enum))]
    pub activations: Option<ActivationScheme>,
    /// [quantize] calibrator of static scales (minmax, percentile(P),
    /// entropy, mse, sigma(K)).
    #[cfg_attr(feature = "clap", arg(long))]
    pub calibrator: Option<String>,
    /// [quantize] keep this layer input in full precision (repeatable;
    /// matches the name or its last components, e.g. layers.0).
    #[cfg_attr(feature = "clap", arg(long, value_name = "POINT"))]
    pub ignore: Vec<String>,
    /// [quantize] keep a language model's lm_head in full precision.
    #[cfg_attr(feature = "clap", arg(long))]
    pub fp_lm_head: bool,
    /// [smoothing] run SmoothQuant: a first pass records per-channel
    /// abs-max, a second calibrates the smoothed model, on any backend (for
    /// a policy, its observation is what is smoothed).
    #[cfg_attr(feature = "clap", arg(long))]
    pub smoothquant: bool,
    /// [smoothing] migration strength α in [0, 1], one for every input
    /// (default: each input's α searched on its layers' output error).
    #[cfg_attr(feature = "clap", arg(long))]
    pub alpha: Option<f64>,
    /// [rotation] rotate by Hadamard matrices: comma-separated among
    /// `residual` (the residual stream, offline: no run-time cost, exports
    /// unchanged) and the linear inputs q_proj, o_proj, gate_proj,
    /// down_proj, lm_head (online: qforge's engine rotates the input, and
    /// compressed-tensors carries the rotation as a transform vLLM applies,
    /// but for lm_head's); `all` (every input online) or `quarot`
    /// (residual, down_proj).
    #[cfg_attr(feature = "clap", arg(long, value_name = "INPUTS"))]
    pub hadamard: Option<String>,
    /// [gptq] round int8 weights with GPTQ: the activation pass (and Hessian
    /// passes after it, for models whose Hessians pass hessian_memory_mib)
    /// sums each layer input's exact Σ x xᵀ (on any backend, the same bytes),
    /// and weights are rounded with error compensation.
    #[cfg_attr(feature = "clap", arg(long))]
    pub gptq: bool,
    /// [gptq] round columns in order of decreasing Hessian diagonal
    /// (implies --gptq).
    #[cfg_attr(feature = "clap", arg(long))]
    pub gptq_act_order: bool,
    /// [gptq] sequential: each layer input's Hessian observed through the
    /// layers rounded before it, one pass per input (implies --gptq;
    /// embedded workers only).
    #[cfg_attr(feature = "clap", arg(long))]
    pub sequential: bool,
    /// [guard] largest relative perplexity increase (0.03 = +3 %).
    #[cfg_attr(feature = "clap", arg(long))]
    pub max_perplexity_increase: Option<f64>,
    /// [guard] smallest action agreement with the FP policy.
    #[cfg_attr(feature = "clap", arg(long))]
    pub min_agreement: Option<f64>,
    /// [guard] largest share of linear layers left in FP.
    #[cfg_attr(feature = "clap", arg(long))]
    pub max_fp_fraction: Option<f64>,
    /// [guard] tokens per perplexity chunk.
    #[cfg_attr(feature = "clap", arg(long))]
    pub ctx: Option<usize>,
}

impl QuantRecipe {
    /// This recipe with `o` applied, validated.
    pub fn with_overrides(mut self, o: &Overrides) -> Result<Self> {
        self.method.search &= !o.no_method_search;
        let c = &mut self.calibration;
        c.samples = o.samples.unwrap_or(c.samples);
        c.seq_len = o.seq_len.unwrap_or(c.seq_len);
        c.batch_size = o.batch_size.unwrap_or(c.batch_size);
        c.seed = o.seed.unwrap_or(c.seed);
        c.stratify = o.stratify.unwrap_or(c.stratify);
        c.min_coverage = o.min_coverage.unwrap_or(c.min_coverage);
        let q = &mut self.quantize;
        q.activations = o.activations.unwrap_or(q.activations);
        if let Some(text) = &o.calibrator {
            q.calibrator = CalibratorChoice::try_from(text.clone())
                .map_err(|e| Error::Recipe(format!("calibrator: {e}")))?;
        }
        q.ignore.extend(o.ignore.iter().cloned());
        if o.fp_lm_head {
            q.lm_head = LmHead::Fp;
        }
        self.smoothing.enabled |= o.smoothquant;
        self.smoothing.alpha = o.alpha.or(self.smoothing.alpha);
        if let Some(list) = &o.hadamard {
            self.rotation = RotationSection::parse(list, self.rotation.seed)?;
        }
        self.gptq.enabled |= o.gptq || o.gptq_act_order || o.sequential;
        self.gptq.act_order |= o.gptq_act_order;
        self.gptq.sequential |= o.sequential;
        let g = &mut self.guard;
        g.max_perplexity_increase = o
            .max_perplexity_increase
            .unwrap_or(g.max_perplexity_increase);
        g.min_agreement = o.min_agreement.unwrap_or(g.min_agreement);
        g.max_fp_fraction = o.max_fp_fraction.unwrap_or(g.max_fp_fraction);
        g.ctx = o.ctx.unwrap_or(g.ctx);
        self.validate()?;
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_round_trips_and_defaults_fill_gaps() {
        let recipe = QuantRecipe::from_toml(
            r#"
            [quantize]
            activations = "static"
            calibrator = "percentile(99.9)"
            ignore = ["layers.0"]
            [quantize.calibrators]
            down_proj = "mse"
            [guard]
            min_agreement = 0.97
            "#,
        )
        .unwrap();
        assert_eq!(recipe.guard.min_agreement, 0.97);
        assert_eq!(recipe.guard.max_fp_fraction, 0.25);
        assert_eq!(
            recipe.calibrator_for("model.layers.3.mlp.down_proj"),
            Calibrator::Mse
        );
        assert_eq!(
            recipe.calibrator_for("model.layers.3.mlp.gate_proj"),
            Calibrator::Percentile { percentile: 99.9 }
        );
        assert!(recipe.ignores("layers.0"));
        assert!(!recipe.ignores("layers.10") && !recipe.ignores("model.layers.0.mlp.down_proj"));
        assert_eq!(QuantRecipe::from_toml(&recipe.to_toml()).unwrap(), recipe);
    }

    #[test]
    fn the_documented_example_is_the_defaults() {
        let text = include_str!("../../../recipes/w8a8.toml");
        assert_eq!(
            QuantRecipe::from_toml(text).unwrap(),
            QuantRecipe::default()
        );
    }

    #[test]
    fn a_recipe_that_names_no_method_searches_the_ones_that_fit_the_model() {
        let methods = |recipe: &QuantRecipe, policy: bool| -> Vec<Method> {
            recipe
                .candidates(policy)
                .into_iter()
                .map(|(m, _)| m)
                .collect()
        };
        let default = QuantRecipe::default();
        assert_eq!(methods(&default, false), Method::ORDER);
        assert_eq!(
            methods(&default, true),
            [Method::Plain, Method::Smoothquant]
        );
        let candidates = default.candidates(false);
        let (_, gptq) = &candidates[4];
        assert!(gptq.gptq.enabled && gptq.rotation == RotationSection::quarot(0));
        assert!(candidates[2].1.rotation.residual && candidates[2].1.rotation.inputs.is_empty());
        let (_, last) = &candidates[5];
        assert!(!last.gptq.enabled && last.rotation == RotationSection::decoder_inputs());
        assert!(candidates.iter().all(|(_, r)| !r.method.search));
        // The same rotation named on the command line is the same method.
        let named = QuantRecipe::default()
            .with_overrides(&Overrides {
                hadamard: Some("down_proj,gate_proj,o_proj,q_proj".into()),
                ..Overrides::default()
            })
            .unwrap();
        assert_eq!(methods(&named, false), [Method::HadamardInputs]);
        // A method named by the recipe, or the search off: that recipe alone.
        let mut smoothed = QuantRecipe::default();
        smoothed.smoothing.enabled = true;
        assert_eq!(smoothed.candidates(false)[0].1, smoothed);
        assert_eq!(methods(&smoothed, false), [Method::Smoothquant]);
        let mut off = QuantRecipe::default();
        off.method.search = false;
        assert_eq!(methods(&off, false), [Method::Plain]);
    }

    #[test]
    fn hadamard_lists_name_the_residual_and_online_inputs() {
        let rotation = |list: &str| {
            QuantRecipe::default()
                .with_overrides(&Overrides {
                    hadamard: Some(list.into()),
                    ..Overrides::default()
                })
                .map(|r| r.rotation)
        };
        assert_eq!(rotation("quarot").unwrap(), RotationSection::quarot(0));
        assert_eq!(
            rotation("residual, down_proj").unwrap(),
            RotationSection::quarot(0)
        );
        let residual = rotation("residual").unwrap();
        assert!(residual.residual && residual.inputs.is_empty() && residual.is_enabled());
        let all = rotation("all").unwrap();
        assert!(!all.residual && all.inputs == RotatedInput::ALL);
        // An input the residual rotation reaches already is refused beside it.
        let twice = rotation("residual,q_proj").unwrap_err().to_string();
        assert!(twice.contains("self_attn.q_proj"), "{twice}");
        let unknown = rotation("residual,v_proj").unwrap_err().to_string();
        assert!(unknown.contains("v_proj"), "{unknown}");
        // The recipe file says the same.
        let toml = QuantRecipe::from_toml("[rotation]\nresidual = true\ninputs = [\"lm_head\"]");
        assert!(toml.unwrap_err().to_string().contains("lm_head"));
    }

    #[test]
    fn bad_recipes_name_the_field() {
        let unknown = QuantRecipe::from_toml("[guard]\nmin_agreemnt = 0.9").unwrap_err();
        assert!(unknown.to_string().contains("min_agreemnt"), "{unknown}");
        let calibrator = QuantRecipe::from_toml("[quantize]\ncalibrator = \"kl\"").unwrap_err();
        assert!(calibrator.to_string().contains("kl"), "{calibrator}");
        let range = QuantRecipe::from_toml("[guard]\nmax_fp_fraction = 1.5").unwrap_err();
        assert!(range.to_string().contains("max_fp_fraction"), "{range}");
        let order = QuantRecipe::from_toml("[gptq]\nsequential = true").unwrap_err();
        assert!(order.to_string().contains("gptq.enabled"), "{order}");
    }
}
