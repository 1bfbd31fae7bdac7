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
use crate::fingerprint::{llm_fingerprint, policy_fingerprint};
use crate::lm::LanguageModel;
use crate::mlp::MlpPolicy;

/// A model qforge can calibrate, quantize, evaluate and serve.
#[derive(Debug, Clone)]
pub enum Model {
    /// A Llama-family decoder with its tokenizer and chat template.
    Language(Box<LanguageModel>),
    /// An MLP control policy.
    Policy(MlpPolicy),
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
        if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("onnx"))
        {
            return Err(Error::Unsupported(format!(
                "{} is an ONNX graph; qforge needs to know its policy head: import it with \
                 qforge_model::onnx::import_mlp and save it as a policy directory",
                path.display()
            )));
        }
        Ok(Format::Gguf)
    }

    /// Whether the path holds a policy (a policy directory or a policy
    /// artifact) rather than a language model.
    pub fn is_policy(path: &Path) -> Result<bool> {
        Ok(match Self::detect(path)? {
            Format::PolicyDir => true,
            Format::Artifact => path.join("policy.json").exists(),
            Format::Gguf | Format::HuggingFace => false,
        })
    }
}

/// Opens the model at `path`: a GGUF file, a Hugging Face directory, a
/// policy directory or a native artifact (with its stored precisions).
///
/// This is the one place that sends a native artifact to its loader
/// ([`crate::artifact`]): [`LanguageModel::load`] and
/// [`MlpPolicy::from_dir`] read full-precision formats only, so the
/// artifact module can build on them without depending on itself.
pub fn open(path: &Path) -> Result<Model> {
    let format = Format::detect(path)?;
    Ok(match format {
        Format::Artifact if Format::is_policy(path)? => {
            Model::Policy(crate::artifact::load_policy(path)?)
        }
        Format::Artifact => Model::Language(Box::new(crate::artifact::load_language_model(path)?)),
        Format::PolicyDir => Model::Policy(MlpPolicy::from_dir(path)?),
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

    /// The language model, or an error naming `path` as a policy.
    pub fn into_language(self, path: &Path) -> Result<LanguageModel> {
        match self {
            Model::Language(lm) => Ok(*lm),
            Model::Policy(_) => Err(Error::Unsupported(format!(
                "{} is a policy; this needs a language model (GGUF file or Hugging Face directory)",
                path.display()
            ))),
        }
    }

    /// The policy, or an error naming `path` as a language model.
    pub fn into_policy(self, path: &Path) -> Result<MlpPolicy> {
        match self {
            Model::Policy(policy) => Ok(policy),
            Model::Language(_) => Err(Error::Unsupported(format!(
                "{} is a language model; this needs a policy (a policy directory or a policy artifact)",
                path.display()
            ))),
        }
    }
}

/// SHA-256 over every file the loader of the model at `path` reads: the
/// file itself, or a directory's `.safetensors` and `.json` files plus the
/// shards its `model.safetensors.index.json` names (which may sit in
/// subdirectories), in name order, each preceded by its name relative to
/// the directory. Streamed: a model can be far larger than memory.
///
/// The index's shards used to be left out, so weights moved into a
/// subdirectory (or, before [`crate::files::inside`], outside the model)
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
    }
    let mut digest = DigestBuilder::default();
    let mut buffer = vec![0u8; 1 << 20];
    for (name, file) in files {
        let mut reader = crate::files::open_regular(&file)?;
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
