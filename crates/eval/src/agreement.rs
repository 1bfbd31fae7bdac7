//! Action agreement of two MLP policies: how often the quantized policy
//! takes the reference's action (`qforge eval agreement`).

use qforge_model::{MlpPolicy, Result};
use serde::Serialize;

/// How often `policy`'s actions agree with `reference`'s on
/// `observations` (row-major). The two must take the same observations
/// through the same head.
pub fn agreement(
    policy: &MlpPolicy,
    reference: &MlpPolicy,
    observations: &[f32],
) -> Result<AgreementReport> {
    let (ours, theirs) = (policy.config(), reference.config());
    if ours.observation_dim != theirs.observation_dim || ours.head != theirs.head {
        return Err(qforge_formats::Error::Request(
            "the policies differ in observation width or head; agreement needs the same interface"
                .into(),
        )
        .into());
    }
    let actions = policy.act(observations)?;
    Ok(AgreementReport {
        agreement: reference.agreement(&actions, &reference.act(observations)?),
        observations: actions.len(),
    })
}

/// What `qforge eval agreement` reports.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct AgreementReport {
    /// The share of observations whose actions agree.
    pub agreement: f64,
    /// Observations compared.
    pub observations: usize,
}

impl std::fmt::Display for AgreementReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "action agreement {:.2} % over {} observations",
            100.0 * self.agreement,
            self.observations
        )
    }
}
