//! The return check of a policy artifact: the artifact and its
//! full-precision source are served and driven over `/v1/act` in a
//! gymnasium environment by `scripts/eval-return`, and their returns
//! compared.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{Error, Result};

/// A return check to run on a written policy artifact.
#[derive(Debug, Clone)]
pub struct ReturnCheck {
    /// The gymnasium environment (`CartPole-v1`, …).
    pub env: String,
    /// Episodes per model.
    pub episodes: usize,
    /// Least return consistency, 1 − |int8 − fp| / |fp − random|.
    pub min_consistency: f64,
    /// The `qforge` executable the script serves the models with.
    pub qforge: PathBuf,
}

impl ReturnCheck {
    /// Runs the check on the artifact in `dir` (its manifest names the FP
    /// source) and returns the script's JSON; a consistency below the least
    /// is [`Error::Refused`].
    pub fn run(&self, dir: &Path) -> Result<Value> {
        let script = bundled("scripts/eval-return")?;
        let failed = |why: String| Error::HeldOut(format!("the return check {why}"));
        let output = std::process::Command::new(&script)
            .arg(&self.env)
            .arg(dir)
            .args(["--episodes", &self.episodes.to_string()])
            .env("QFORGE", &self.qforge)
            .output()
            .map_err(|e| failed(format!("cannot run {}: {e}", script.display())))?;
        if !output.status.success() {
            let stderr = String::from_utf8_lossy(&output.stderr);
            return Err(failed(format!("failed: {}", stderr.trim())));
        }
        let result: Value = serde_json::from_slice(&output.stdout)
            .map_err(|e| failed(format!("printed no JSON: {e}")))?;
        let consistency = result["consistency"].as_f64().unwrap_or(f64::NAN);
        if consistency.is_nan() || consistency < self.min_consistency {
            return Err(Error::Refused(format!(
                "return consistency {consistency:.4} in {} is below {}; no artifact written",
                self.env, self.min_consistency
            )));
        }
        Ok(result)
    }
}

/// A file shipped in the qforge repository (the bundled CartPole policy,
/// `scripts/eval-return`): found beside the working directory (a checkout)
/// or in the source tree this build came from.
pub fn bundled(relative: &str) -> Result<PathBuf> {
    let candidates = [
        PathBuf::from(relative),
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(relative),
    ];
    let found = candidates.into_iter().find(|p| p.exists()).ok_or_else(|| {
        Error::Model(qforge_model::Error::Format(format!(
            "the bundled {relative} is not here (run from a qforge checkout)"
        )))
    })?;
    Ok(std::fs::canonicalize(&found).unwrap_or(found))
}
