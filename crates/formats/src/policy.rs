//! What a policy directory's `policy.json` says (see
//! `fixtures/policies/README.md`): the widths of an MLP policy's layers, the
//! activation between them, and the head that gives the last layer's output
//! its meaning as an action: which action is greedy, how two actions are
//! compared, and the distribution a stochastic head samples and scores
//! actions from. The policy's forward lives with its weights, in
//! `qforge-model`.

use rand::Rng;
use rand_distr::StandardNormal;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Hidden-layer activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Activation {
    /// tanh.
    Tanh,
    /// max(0, x).
    Relu,
}

/// What the last layer's output means.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Head {
    /// Logits over `actions` discrete actions; the action is the argmax.
    Discrete {
        /// Number of actions.
        actions: usize,
    },
    /// The mean of a Gaussian policy; the action is the mean clipped to
    /// `[low, high]`.
    Gaussian {
        /// Action dimensions.
        action_dim: usize,
        /// Lower bound per dimension.
        low: Vec<f32>,
        /// Upper bound per dimension.
        high: Vec<f32>,
        /// The state-independent log standard deviation per dimension (as
        /// Stable-Baselines3's `log_std`): the policy's distribution is
        /// N(mean, exp(log_std)²). Absent: the head gives only the mean, so
        /// it has no log-probabilities and cannot sample.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        log_std: Option<Vec<f32>>,
    },
    /// A state-value estimate (one output).
    Value,
}

impl Head {
    /// Width of the last layer's output.
    pub fn outputs(&self) -> usize {
        match self {
            Head::Discrete { actions } => *actions,
            Head::Gaussian { action_dim, .. } => *action_dim,
            Head::Value => 1,
        }
    }

    /// Refuses head outputs (rows of [`Head::outputs`] values, one per
    /// observation) that are not all finite: finite observations far outside
    /// the training range can overflow the forward, and an action taken from
    /// NaN (argmax picks action 0) with a NaN log-probability would reach a
    /// trainer's importance weights. The error names the first such row.
    pub fn check_finite(&self, outputs: &[f32]) -> Result<()> {
        match outputs.iter().position(|v| !v.is_finite()) {
            None => Ok(()),
            Some(at) => Err(Error::Request(format!(
                "the policy's output for observation row {} is {} (not finite): the forward overflowed on values far outside the range the policy was trained on; check the observation's scale",
                at / self.outputs(),
                outputs[at]
            ))),
        }
    }

    /// Whether two actions agree: the same discrete action, or every component
    /// within 5 % of its action range (continuous) or of the reference value's
    /// magnitude (value heads).
    pub fn actions_agree(&self, a: &Action, b: &Action) -> bool {
        match (a, b, self) {
            (Action::Discrete(x), Action::Discrete(y), _) => x == y,
            (Action::Continuous(x), Action::Continuous(y), Head::Gaussian { low, high, .. }) => x
                .iter()
                .zip(y)
                .zip(low.iter().zip(high))
                .all(|((p, q), (lo, hi))| (p - q).abs() <= 0.05 * (hi - lo)),
            (Action::Continuous(x), Action::Continuous(y), _) => x
                .iter()
                .zip(y)
                .all(|(p, q)| (p - q).abs() <= 0.05 * q.abs().max(1e-6)),
            _ => false,
        }
    }

    /// The action the head's output `row` stands for: the argmax of the
    /// logits (first maximum on ties, as numpy's argmax), the mean clipped to
    /// the bounds, or the value.
    pub fn greedy(&self, row: &[f32]) -> Action {
        match self {
            Head::Discrete { .. } => {
                let best = row
                    .iter()
                    .enumerate()
                    .fold(0, |best, (i, &v)| if v > row[best] { i } else { best });
                Action::Discrete(best)
            }
            Head::Gaussian { low, high, .. } => Action::Continuous(
                row.iter()
                    .zip(low.iter().zip(high))
                    .map(|(&v, (&lo, &hi))| v.clamp(lo, hi))
                    .collect(),
            ),
            Head::Value => Action::Continuous(row.to_vec()),
        }
    }

    /// Whether `other` answers the same requests with actions of the same
    /// kind and bounds, and has a distribution exactly when this one does:
    /// a Gaussian's `log_std` values may differ (training moves them).
    pub fn answers_like(&self, other: &Head) -> bool {
        match (self, other) {
            (
                Head::Gaussian {
                    action_dim,
                    low,
                    high,
                    log_std,
                },
                Head::Gaussian {
                    action_dim: other_dim,
                    low: other_low,
                    high: other_high,
                    log_std: other_log_std,
                },
            ) => {
                action_dim == other_dim
                    && low == other_low
                    && high == other_high
                    && log_std.is_some() == other_log_std.is_some()
            }
            _ => self == other,
        }
    }

    /// Whether the head defines a distribution over actions (then it has
    /// log-probabilities and can sample): a discrete head, or a Gaussian one
    /// with `log_std`.
    pub fn is_stochastic(&self) -> bool {
        matches!(
            self,
            Head::Discrete { .. }
                | Head::Gaussian {
                    log_std: Some(_),
                    ..
                }
        )
    }

    /// The log-probability of `action` under the distribution the output
    /// `row` defines: the log-softmax of the logits at a discrete action, the
    /// diagonal Gaussian's log-density at a continuous one. `None` where the
    /// head defines no distribution ([`Head::is_stochastic`]) or the action
    /// is not one of its kind.
    pub fn log_prob(&self, row: &[f32], action: &Action) -> Option<f64> {
        match (self, action) {
            (Head::Discrete { .. }, Action::Discrete(a)) => {
                let max = row
                    .iter()
                    .fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
                let sum: f64 = row.iter().map(|&v| (f64::from(v) - max).exp()).sum();
                Some(f64::from(*row.get(*a)?) - max - sum.ln())
            }
            (
                Head::Gaussian {
                    log_std: Some(log_std),
                    ..
                },
                Action::Continuous(a),
            ) if a.len() == row.len() => Some(
                row.iter()
                    .zip(a)
                    .zip(log_std)
                    .map(|((&mean, &x), &log_std)| {
                        let z = (f64::from(x) - f64::from(mean)) / f64::from(log_std).exp();
                        -0.5 * z * z - f64::from(log_std) - 0.5 * (2.0 * std::f64::consts::PI).ln()
                    })
                    .sum(),
            ),
            _ => None,
        }
    }

    /// An action drawn from the distribution of the output `row`: a
    /// categorical draw from the softmax, or mean + exp(log_std)·ε clipped
    /// to the bounds (the clipped action is the one returned and scored).
    /// `None` where the head defines no distribution.
    pub fn sample<R: Rng + ?Sized>(&self, row: &[f32], rng: &mut R) -> Option<Action> {
        match self {
            Head::Discrete { .. } => {
                let max = row
                    .iter()
                    .fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
                let weights: Vec<f64> = row.iter().map(|&v| (f64::from(v) - max).exp()).collect();
                let mut u = rng.random::<f64>() * weights.iter().sum::<f64>();
                for (i, w) in weights.iter().enumerate() {
                    if u < *w {
                        return Some(Action::Discrete(i));
                    }
                    u -= w;
                }
                // Rounding left u at the total: the last action with weight.
                weights.iter().rposition(|&w| w > 0.0).map(Action::Discrete)
            }
            Head::Gaussian {
                low,
                high,
                log_std: Some(log_std),
                ..
            } => Some(Action::Continuous(
                row.iter()
                    .zip(log_std)
                    .zip(low.iter().zip(high))
                    .map(|((&mean, &log_std), (&lo, &hi))| {
                        let noise: f32 = rng.sample(StandardNormal);
                        (mean + log_std.exp() * noise).clamp(lo, hi)
                    })
                    .collect(),
            )),
            _ => None,
        }
    }
}

/// `policy.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyConfig {
    /// Always `qforge-mlp-policy`.
    pub format: String,
    /// Format version (1).
    pub version: u32,
    /// The environment the policy acts in (e.g. `CartPole-v1`), if known.
    #[serde(default)]
    pub env: Option<String>,
    /// Width of an observation.
    pub observation_dim: usize,
    /// Widths of the hidden layers.
    pub hidden: Vec<usize>,
    /// Activation after every hidden layer.
    pub activation: Activation,
    /// The head.
    pub head: Head,
    /// Per observation feature, what it is divided by before the first
    /// layer: SmoothQuant's factors for the first layer's input, whose
    /// multiplication went into that layer's weights (a policy's input has
    /// no norm to fold the division into). Absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observation_divisors: Option<Vec<f32>>,
}

/// An action chosen by a policy.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Action {
    /// Index of a discrete action.
    Discrete(usize),
    /// A continuous action (or a value estimate).
    Continuous(Vec<f32>),
}
