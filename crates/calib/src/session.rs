//! A calibration session: model + data + recipe → plan and hashes, built the
//! same way by a coordinator and by every worker, so both sides agree on the
//! batches and on what the statistics' provenance names.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use qforge_core::{Digest, DigestBuilder};
use qforge_formats::text::TextSide;
use qforge_model::{Format, Model};

use crate::data::{Dataset, EpisodeContent, Record, fits_width, load_jsonl};
use crate::error::{Error, Result};
use crate::observe::{HiddenStates, Job, RoundedLayers};
use crate::plan::{Plan, Recipe, plan};
use crate::transform::{Transform, apply_all, transformed_digest};

/// Whether a session loads the model's weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Weights {
    /// Load them: this process observes batches (or quantizes).
    Load,
    /// Skip them: this process only plans (a cluster coordinator reads the
    /// tokenizer and chat template, never the weights).
    Skip,
}

/// The inputs of a calibration, loaded and planned.
pub struct Session {
    /// Where the model was read from.
    pub model_path: PathBuf,
    /// Where the data was read from.
    pub data_path: PathBuf,
    /// Whether invalid data lines were skipped instead of failing.
    pub skip_invalid: bool,
    /// The model, unless loaded with [`Weights::Skip`].
    pub model: Option<Model>,
    /// SHA-256 of the model files ([`qforge_model::open::digest`]).
    pub model_digest: Digest,
    /// The data.
    pub data: Dataset,
    /// The recipe the plan was made with.
    pub recipe: Recipe,
    /// The batches.
    pub plan: Plan,
    /// Hidden states this process's passes keep for the next ones.
    pub hidden_states: Arc<HiddenStates>,
    /// GPTQ's roundings this process holds, for the passes that run them.
    pub rounded: RoundedLayers,
}

impl Session {
    /// Loads the data (and the model, or with [`Weights::Skip`] only its
    /// tokenizer) and plans the batches of `recipe`.
    pub fn open(
        model_path: &Path,
        data_path: &Path,
        recipe: &Recipe,
        skip_invalid: bool,
        weights: Weights,
    ) -> Result<Self> {
        recipe.validate()?;
        let mut data = load_jsonl(data_path, skip_invalid)?;
        let name = data_path.display().to_string();
        let model = match weights {
            Weights::Load => Some(qforge_model::open(model_path)?),
            Weights::Skip => None,
        };
        // The records are checked against what the model takes here, where
        // their line numbers are known, with what a planner without the
        // weights reads too, so coordinator and workers skip the same lines.
        let plan = match &model {
            Some(Model::Policy(policy)) => {
                let width = policy.config().observation_dim;
                data.check(&name, skip_invalid, |r| fits_policy(r, width))?;
                plan(&data, recipe, None)?
            }
            Some(Model::Language(lm)) => {
                plan_checked_episodes(&mut data, recipe, &lm.text, &name, skip_invalid)?
            }
            None if Format::is_policy(model_path)? => {
                let width = qforge_model::open::observation_dim(model_path)?;
                data.check(&name, skip_invalid, |r| fits_policy(r, width))?;
                plan(&data, recipe, None)?
            }
            None => {
                let text = TextSide::load(model_path)?;
                plan_checked_episodes(&mut data, recipe, &text, &name, skip_invalid)?
            }
        };
        Ok(Self {
            model_path: model_path.to_owned(),
            data_path: data_path.to_owned(),
            skip_invalid,
            model,
            model_digest: qforge_model::open::digest(model_path)?,
            data,
            recipe: recipe.clone(),
            plan,
            hidden_states: Arc::default(),
            rounded: RoundedLayers::default(),
        })
    }

    /// What a person should hear before the first pass runs: each data line
    /// skipped, and a plan with fewer samples than the recipe asked for.
    pub fn warnings(&self) -> Vec<String> {
        let data = self.data_path.display();
        let mut warnings: Vec<String> = (self.data.skipped.iter())
            .map(|(line, reason)| format!("{data}:{line}: skipped: {reason}"))
            .collect();
        if self.plan.samples < self.recipe.samples {
            warnings.push(format!(
                "the data holds {} samples, fewer than the {} asked for; calibrating on all of them",
                self.plan.samples, self.recipe.samples
            ));
        }
        warnings
    }

    /// The job of a pass over this session's plan: `recipe` (the session's,
    /// or another pass of it) observing the model after `transforms`.
    pub fn job(&self, recipe: &Recipe, transforms: &[Transform]) -> Job {
        Job {
            model: transformed_digest(self.model_digest, transforms),
            data: self.data.digest,
            recipe: recipe.clone(),
            planned: self.plan.batches.len() as u64,
            transforms: transforms.to_vec(),
        }
    }

    /// The model a pass observes: the loaded one after `transforms`.
    pub fn target(&self, transforms: &[Transform]) -> Result<Model> {
        let model = self.model.as_ref().ok_or_else(|| {
            Error::Data("this session planned without loading the model's weights".into())
        })?;
        apply_all(model, transforms)
    }

    /// The model the pass `job` observes: the loaded one after its
    /// transforms, with the layers it runs rounded
    /// ([`crate::HessianPass::rounded`]) with the roundings it holds.
    pub fn pass_target(&self, job: &Job) -> Result<Model> {
        let model = self.target(&job.transforms)?;
        let rounded = job.recipe.pass.rounded();
        if rounded.is_empty() {
            return Ok(model);
        }
        Ok(model.with_layers(&self.rounded.layers(&model, rounded)?)?)
    }

    /// The default name of a run over this session: the first 12 hex digits
    /// of the hash of model, data and recipe, so a rerun of the same inputs
    /// finds its checkpoints.
    pub fn run_name(&self) -> String {
        let mut d = DigestBuilder::default();
        d.update(&self.model_digest.0);
        d.update(&self.data.digest.0);
        d.update(&self.recipe.digest().0);
        d.finish().to_hex()[..12].to_owned()
    }

    /// Loads the model if the session was opened without it.
    pub fn load_model(&mut self) -> Result<&Model> {
        if self.model.is_none() {
            self.model = Some(qforge_model::open(&self.model_path)?);
        }
        Ok(self.model.as_ref().expect("loaded above"))
    }
}

/// The plan of LLM episodes: chat-formatted (when the model has a template)
/// and tokenized, once their token ids are checked against the vocabulary.
fn plan_checked_episodes(
    data: &mut Dataset,
    recipe: &Recipe,
    text: &TextSide,
    name: &str,
    skip_invalid: bool,
) -> Result<Plan> {
    let vocabulary = text.tokenizer.vocab_size();
    data.check(name, skip_invalid, |r| fits_vocabulary(r, vocabulary))?;
    plan(data, recipe, Some(&|content| episode_tokens(text, content)))
}

/// A trajectory's observations are as wide as the policy's input (an
/// episode is left to the planner, which refuses it for a policy).
fn fits_policy(record: &Record, width: usize) -> std::result::Result<(), String> {
    match record {
        Record::Trajectory { observations, .. } => fits_width(observations, width),
        Record::Episode { .. } => Ok(()),
    }
}

/// An episode's token ids are in the model's vocabulary.
fn fits_vocabulary(record: &Record, vocabulary: usize) -> std::result::Result<(), String> {
    let Record::Episode {
        content: EpisodeContent::TokenIds(ids),
        ..
    } = record
    else {
        return Ok(());
    };
    match ids.iter().position(|&id| id as usize >= vocabulary) {
        Some(i) => Err(format!(
            "token id {} (position {i}) is outside the model's vocabulary of {vocabulary} tokens",
            ids[i]
        )),
        None => Ok(()),
    }
}

/// The token ids of an LLM episode, as calibration sees it.
pub fn episode_tokens(text: &TextSide, content: &EpisodeContent) -> Result<Vec<u32>> {
    let rendered = match content {
        EpisodeContent::TokenIds(ids) => return Ok(ids.clone()),
        EpisodeContent::Text(t) => t.clone(),
        EpisodeContent::PromptCompletion { prompt, completion } => {
            text.chat_text(prompt, completion)?
        }
    };
    Ok(text.tokenizer.encode(&rendered)?)
}
