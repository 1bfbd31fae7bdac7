//! One way to open a model: [`open`] recognises the format of a path and
//! returns a [`Model`], and [`digest`] names the files it reads.
//!
//! Everything that loads a model (calibration workers, the quantization
//! pipeline, the server, the CLI) goes through here, so format detection is
//! written once and every consumer sees the same two kinds of model.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use qforge_core::{Digest, DigestBuilder};

use crate::error::{Error, Result};
use crate::fingerprint::{llm_fingerprint, llm_probe, policy_fingerprint, policy_probe};
use crate::linear::{Int8Weight, Linear};
use crate::lm::LanguageModel;
use crate::mlp::MlpPolicy;
use crate::observe::Observer;
use qforge_formats::manifest::Manifest;

/// A model qforge can calibrate, quantize, evaluate and serve.
#[derive(Debug, Clone)]
pub enum Model {
    /// A Llama-family decoder with its tokenizer and chat template.
    Language(Box<LanguageModel>),
    /// An MLP control policy.
    Policy(Box<MlpPolicy>),
}

/// The formats [`open`] recognises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// A GGUF file (a language model).
    Gguf,
    /// A Hugging Face directory: `config.json` and safetensors weights.
    HuggingFace,
    /// A policy directory: `policy.json` and `model.safetensors`.
    PolicyDir,
    /// An MLP policy exported to ONNX (`NAME.onnx`, the head in
    /// `NAME.policy.json` or implied by a final Softmax; see
    /// [`crate::onnx::open_policy`]).
    Onnx,
    /// A native qforge artifact (`qforge.json`), either kind.
    Artifact,
}

impl Format {
    /// Recognises the format of `path` by what it holds, not by its name
    /// alone; an error says what was expected.
    pub fn detect(path: &Path) -> Result<Self> {
        if !path.exists() {
            return Err(Error::Format(format!(
                "model {} does not exist",
                path.display()
            )));
        }
        if path.is_dir() {
            return if crate::artifact::is_artifact(path) {
                Ok(Format::Artifact)
            } else if path.join("policy.json").exists() {
                // `exists`: a policy.json that is not a regular file is the
                // loader's to refuse, with a message that says so.
                Ok(Format::PolicyDir)
            } else if path.join("config.json").exists() {
                Ok(Format::HuggingFace)
            } else {
                Err(Error::Format(format!(
                    "{} is neither a policy directory (policy.json), a Hugging Face model directory \
                     (config.json) nor a qforge artifact (qforge.json)",
                    path.display()
                )))
            };
        }
        // A GGUF file says so in its first bytes; an ONNX protobuf has no
        // magic, so it goes by its name and the importer checks its content.
        let mut magic = [0u8; 4];
        let mut file = qforge_formats::files::open_regular(path)?;
        let read = std::io::Read::read(&mut file, &mut magic).map_err(|e| Error::io(path, e))?;
        if magic[..read] == *b"GGUF" {
            return Ok(Format::Gguf);
        }
        if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("onnx"))
        {
            return Ok(Format::Onnx);
        }
        Err(Error::Format(format!(
            "{} is neither a GGUF file (it does not start with the bytes GGUF) nor an ONNX \
             policy (NAME.onnx); qforge opens those, Hugging Face and policy directories, and \
             qforge artifacts",
            path.display()
        )))
    }

    /// Whether the path holds a policy (a policy directory, an ONNX policy
    /// or a policy artifact) rather than a language model.
    pub fn is_policy(path: &Path) -> Result<bool> {
        Ok(match Self::detect(path)? {
            Format::PolicyDir | Format::Onnx => true,
            Format::Artifact => path.join("policy.json").exists(),
            Format::Gguf | Format::HuggingFace => false,
        })
    }
}

/// How many values one observation of the policy at `path` holds, read
/// from its `policy.json` without the weights (an ONNX policy is imported
/// whole: its width is in the graph). A planner without the weights checks
/// its data with it.
pub fn observation_dim(path: &Path) -> Result<usize> {
    match Format::detect(path)? {
        Format::PolicyDir | Format::Artifact => {
            let config_path = path.join("policy.json");
            let config: qforge_formats::policy::PolicyConfig =
                qforge_formats::files::read_json(&config_path)?;
            Ok(config.observation_dim)
        }
        Format::Onnx => Ok(crate::onnx::open_policy(path)?.config().observation_dim),
        Format::Gguf | Format::HuggingFace => Err(Error::Format(format!(
            "{} is a language model, not a policy",
            path.display()
        ))),
    }
}

/// Opens the model at `path`: a GGUF file, a Hugging Face directory, a
/// policy directory, an ONNX policy or a native artifact (with its stored
/// precisions, after checking it against its manifest).
///
/// This is the one place that sends a native artifact to its loader
/// ([`crate::artifact`]): [`LanguageModel::load`] and
/// [`MlpPolicy::from_dir`] read full-precision formats only, so the
/// artifact module can build on them without depending on itself.
pub fn open(path: &Path) -> Result<Model> {
    let format = Format::detect(path)?;
    Ok(match format {
        Format::Artifact if Format::is_policy(path)? => {
            Model::Policy(Box::new(crate::artifact::load_policy(path)?))
        }
        Format::Artifact => Model::Language(Box::new(crate::artifact::load_language_model(path)?)),
        Format::PolicyDir => Model::Policy(Box::new(MlpPolicy::from_dir(path)?)),
        Format::Onnx => Model::Policy(Box::new(crate::onnx::open_policy(path)?)),
        Format::Gguf | Format::HuggingFace => Model::Language(Box::new(LanguageModel::load(path)?)),
    })
}

impl Model {
    /// `policy` or `language-model`, as reports and manifests name the kind.
    pub fn kind(&self) -> &'static str {
        match self {
            Model::Language(_) => "language-model",
            Model::Policy(_) => "policy",
        }
    }

    /// The determinism fingerprint of this machine's forward pass: two
    /// processes whose fingerprints agree compute bit-identical activations.
    pub fn fingerprint(&self) -> Result<Digest> {
        match self {
            Model::Language(lm) => llm_fingerprint(&lm.model),
            Model::Policy(policy) => policy_fingerprint(policy),
        }
    }

    /// Runs the fingerprint's fixed probe batch past `observer` (every
    /// linear input on the way), for comparing two weights' activations on
    /// the same inputs.
    pub fn probe(&self, observer: &mut dyn Observer) -> Result<()> {
        match self {
            Model::Language(lm) => llm_probe(&lm.model, observer).map(drop),
            Model::Policy(policy) => policy_probe(policy, observer).map(drop),
        }
    }

    /// Every linear layer as (name, observation point, layer), in forward
    /// order.
    pub fn linears(&self) -> Vec<(String, String, &Linear)> {
        match self {
            Model::Language(lm) => lm.model.linears(),
            Model::Policy(policy) => policy.linears(),
        }
    }

    /// The same model with every linear layer replaced by
    /// `convert(observation point, layer)`.
    pub fn with_linears(
        &self,
        convert: impl Fn(&str, &Linear) -> Result<Linear> + Sync,
    ) -> Result<Model> {
        Ok(match self {
            Model::Language(lm) => Model::Language(Box::new(LanguageModel {
                model: lm.model.with_linears(convert)?,
                text: lm.text.clone(),
                source: lm.source.clone(),
            })),
            Model::Policy(policy) => Model::Policy(Box::new(policy.with_linears(convert)?)),
        })
    }

    /// The same model with the int8 values `weights` (by layer name) chosen
    /// for those layers ([`Linear::with_int8_weight`]).
    pub fn with_int8_weights(&self, weights: &BTreeMap<String, Int8Weight>) -> Result<Model> {
        self.with_replaced(weights, |layer, weight| {
            layer.with_int8_weight(weight.clone())
        })
    }

    /// The same model with the linear layers `layers` names replaced by
    /// those given.
    pub fn with_layers(&self, layers: &BTreeMap<String, Linear>) -> Result<Model> {
        self.with_replaced(layers, |_, layer| Ok(layer.clone()))
    }

    /// See [`Llama::with_replaced`].
    fn with_replaced<T: Sync>(
        &self,
        replacements: &BTreeMap<String, T>,
        replace: impl Fn(&Linear, &T) -> Result<Linear> + Sync,
    ) -> Result<Model> {
        Ok(match self {
            Model::Language(lm) => Model::Language(Box::new(LanguageModel {
                model: lm.model.with_replaced(replacements, replace)?,
                text: lm.text.clone(),
                source: lm.source.clone(),
            })),
            Model::Policy(policy) => {
                Model::Policy(Box::new(policy.with_replaced(replacements, replace)?))
            }
        })
    }

    /// The language model, or an error naming `path` as a policy.
    pub fn into_language(self, path: &Path) -> Result<LanguageModel> {
        match self {
            Model::Language(lm) => Ok(*lm),
            Model::Policy(_) => Err(qforge_formats::Error::Request(format!(
                "{} is a policy; this needs a language model (GGUF file or Hugging Face directory)",
                path.display()
            ))
            .into()),
        }
    }

    /// The policy, or an error naming `path` as a language model.
    pub fn into_policy(self, path: &Path) -> Result<MlpPolicy> {
        match self {
            Model::Policy(policy) => Ok(*policy),
            Model::Language(_) => Err(qforge_formats::Error::Request(format!(
                "{} is a language model; this needs a policy (a policy directory, an ONNX policy or a policy artifact)",
                path.display()
            )).into()),
        }
    }
}

/// The full-precision model the artifact of `manifest` was quantized from,
/// as the manifest records it, checked to be unchanged since (its SHA-256).
pub fn recorded_source(manifest: &Manifest) -> Result<PathBuf> {
    let recorded = &manifest.info["source_model"];
    let path = PathBuf::from(recorded["path"].as_str().unwrap_or_default());
    let digest = digest(&path).map_err(|e| {
        Error::Format(format!(
            "the artifact's full-precision source {} is not readable: {e}",
            path.display()
        ))
    })?;
    if Some(digest.to_hex().as_str()) != recorded["sha256"].as_str() {
        return Err(Error::Format(format!(
            "{} changed since it was quantized (its SHA-256 differs from the manifest's)",
            path.display()
        )));
    }
    Ok(path)
}

/// SHA-256 over every file the loader of the model at `path` reads: the
/// file itself (with its head file, for an ONNX policy that has one), or a
/// directory's `.safetensors` and `.json` files plus the
/// shards its `model.safetensors.index.json` names (which may sit in
/// subdirectories), in name order, each preceded by its name relative to
/// the directory. Streamed: a model can be far larger than memory.
///
/// The index's shards used to be left out, so weights moved into a
/// subdirectory (or, before [`qforge_formats::files::inside`], outside the model)
/// could change without changing the hash.
pub fn digest(path: &Path) -> Result<Digest> {
    let mut files: BTreeMap<OsString, PathBuf> = BTreeMap::new();
    if path.is_dir() {
        for entry in std::fs::read_dir(path).map_err(|e| Error::io(path, e))? {
            let file = entry.map_err(|e| Error::io(path, e))?.path();
            let name = file.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if name.ends_with(".safetensors") || name.ends_with(".json") {
                files.insert(name.into(), file);
            }
        }
        if path.join(crate::llama::SHARD_INDEX).exists() {
            for (name, file) in crate::llama::index_shards(path)? {
                files.insert(name.into(), file);
            }
        }
    } else {
        files.insert(
            path.file_name().map(OsString::from).unwrap_or_default(),
            path.to_owned(),
        );
        let head = crate::onnx::head_file(path);
        if Format::detect(path)? == Format::Onnx && head.exists() {
            files.insert(
                head.file_name().map(OsString::from).unwrap_or_default(),
                head,
            );
        }
    }
    let mut digest = DigestBuilder::default();
    let mut buffer = vec![0u8; 1 << 20];
    for (name, file) in files {
        let mut reader = qforge_formats::files::open_regular(&file)?;
        digest.update(name.as_encoded_bytes());
        loop {
            let n =
                std::io::Read::read(&mut reader, &mut buffer).map_err(|e| Error::io(&file, e))?;
            if n == 0 {
                break;
            }
            digest.update(&buffer[..n]);
        }
    }
    Ok(digest.finish())
}
