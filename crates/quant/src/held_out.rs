//! The guard's held-out data: a file the caller names, or what calibration
//! did not draw from its own data.

use std::collections::HashSet;
use std::path::Path;

use qforge_calib::{Record, Sample, Session, episode_tokens};
use qforge_model::{LanguageModel, MlpPolicy, Model};

use crate::error::{Error, Result};
use crate::guard::HeldOut;

/// The held-out data for `model` and a line describing it: `eval_data`
/// (trajectories JSONL for a policy, UTF-8 text for a language model), or
/// the samples of the session's data that its plan did not draw. A language
/// model's guard needs at least `ctx` tokens.
pub fn held_out(
    session: &Session,
    model: &Model,
    eval_data: Option<&Path>,
    ctx: usize,
) -> Result<(HeldOut, String)> {
    match model {
        Model::Policy(policy) => policy_held_out(session, policy, eval_data),
        Model::Language(lm) => language_held_out(session, lm, eval_data, ctx),
    }
}

fn policy_held_out(
    session: &Session,
    policy: &MlpPolicy,
    eval_data: Option<&Path>,
) -> Result<(HeldOut, String)> {
    let dim = policy.config().observation_dim;
    let loaded;
    let (data, drawn, name, source) = match eval_data {
        Some(path) => {
            loaded =
                qforge_calib::load_jsonl(path, false).map_err(|e| Error::HeldOut(e.to_string()))?;
            let name = path.display().to_string();
            (&loaded, HashSet::new(), name.clone(), name)
        }
        None => {
            let drawn: HashSet<Vec<u32>> = session
                .plan
                .samples()
                .filter_map(|s| match s {
                    Sample::Observation(o) => Some(bits(o)),
                    Sample::Tokens(_) => None,
                })
                .collect();
            (
                &session.data,
                drawn,
                session.data_path.display().to_string(),
                "observations of the calibration data not drawn for calibration".to_owned(),
            )
        }
    };
    let observations: Vec<f32> = data
        .observations(&name, dim)
        .map_err(|e| Error::HeldOut(e.to_string()))?
        .chunks_exact(dim)
        .filter(|row| !drawn.contains(&bits(row)))
        .flatten()
        .copied()
        .collect();
    if observations.is_empty() {
        return Err(Error::HeldOut(
            "no held-out observations: calibration drew all of them; draw fewer samples or pass held-out data"
                .into(),
        ));
    }
    let rows = observations.len() / dim;
    Ok((
        HeldOut::Observations(observations),
        format!("{rows} {source}"),
    ))
}

/// An observation's exact bits, to tell drawn observations from held-out ones.
fn bits(row: &[f32]) -> Vec<u32> {
    row.iter().map(|v| v.to_bits()).collect()
}

fn language_held_out(
    session: &Session,
    lm: &LanguageModel,
    eval_data: Option<&Path>,
    ctx: usize,
) -> Result<(HeldOut, String)> {
    if let Some(path) = eval_data {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::HeldOut(format!("cannot read {} as UTF-8 text: {e}", path.display()))
        })?;
        let tokens = lm.text.tokenizer.encode(&text)?;
        if tokens.len() < ctx {
            return Err(Error::HeldOut(format!(
                "{} has {} tokens; the guard needs at least ctx ({ctx})",
                path.display(),
                tokens.len()
            )));
        }
        let n = tokens.len();
        return Ok((
            HeldOut::Tokens(tokens),
            format!("{n} tokens of {}", path.display()),
        ));
    }
    let drawn: HashSet<&[u32]> = session
        .plan
        .samples()
        .filter_map(|s| match s {
            Sample::Tokens(t) => Some(&t[..]),
            Sample::Observation(_) => None,
        })
        .collect();
    let mut tokens = Vec::new();
    let mut episodes = 0;
    for record in &session.data.records {
        if let Record::Episode { content, .. } = record {
            let ids =
                episode_tokens(&lm.text, content).map_err(|e| Error::HeldOut(e.to_string()))?;
            let truncated = &ids[..ids.len().min(session.recipe.seq_len)];
            if !ids.is_empty() && !drawn.contains(truncated) {
                tokens.extend_from_slice(&ids);
                episodes += 1;
            }
        }
    }
    if tokens.len() < ctx {
        return Err(Error::HeldOut(format!(
            "only {} held-out tokens ({episodes} episodes not drawn for calibration); the guard needs at least ctx ({ctx}): pass held-out text or draw fewer samples",
            tokens.len()
        )));
    }
    let n = tokens.len();
    Ok((
        HeldOut::Tokens(tokens),
        format!("{n} tokens of {episodes} episodes not drawn for calibration"),
    ))
}
