//! The trained policy fixtures: qforge's forward reproduces every action the
//! numpy forward of `scripts/record_rollouts.py` recorded.

use std::path::PathBuf;

use qforge_formats::policy::Action;
use qforge_model::{MlpPolicy, Statistics, StatsObserver};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/policies")
        .join(name)
}

/// Observations and recorded actions of a fixture's bundled rollouts.
fn rollouts(name: &str) -> (Vec<f32>, Vec<serde_json::Value>) {
    let text = std::fs::read_to_string(fixture(name).join("rollouts.jsonl")).unwrap();
    let mut observations = Vec::new();
    let mut actions = Vec::new();
    for line in text.lines() {
        let episode: serde_json::Value = serde_json::from_str(line).unwrap();
        for obs in episode["observations"].as_array().unwrap() {
            observations.extend(
                obs.as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_f64().unwrap() as f32),
            );
        }
        actions.extend(episode["actions"].as_array().unwrap().iter().cloned());
    }
    (observations, actions)
}

#[test]
fn cartpole_reproduces_every_recorded_action() {
    let policy = MlpPolicy::from_dir(&fixture("cartpole")).unwrap();
    let (observations, recorded) = rollouts("cartpole");
    let actions = policy.act(&observations).unwrap();
    assert_eq!(actions.len(), recorded.len());
    assert!(actions.len() >= 2000);
    for (i, (got, want)) in actions.iter().zip(&recorded).enumerate() {
        assert_eq!(
            *got,
            Action::Discrete(want.as_u64().unwrap() as usize),
            "step {i}"
        );
    }
}

#[test]
fn pendulum_reproduces_every_recorded_action() {
    let policy = MlpPolicy::from_dir(&fixture("pendulum")).unwrap();
    let (observations, recorded) = rollouts("pendulum");
    let actions = policy.act(&observations).unwrap();
    assert_eq!(actions.len(), recorded.len());
    for (i, (got, want)) in actions.iter().zip(&recorded).enumerate() {
        let Action::Continuous(got) = got else {
            panic!("continuous head")
        };
        let want: Vec<f32> = want
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-4, "step {i}: {g} vs {w}");
        }
        assert!(policy.actions_agree(&Action::Continuous(got.clone()), &Action::Continuous(want)));
    }
}

#[test]
fn observer_sees_every_layer_input_by_name() {
    let policy = MlpPolicy::from_dir(&fixture("cartpole")).unwrap();
    let (observations, _) = rollouts("cartpole");
    let mut observer = StatsObserver::new(Statistics::Histograms { per_channel: true });
    policy
        .forward(&observations[..400], Some(&mut observer))
        .unwrap();
    let names: Vec<_> = observer.tensors.keys().cloned().collect();
    assert_eq!(names, ["layers.0", "layers.1", "layers.2"]);
    assert_eq!(observer.tensors["layers.0"].histogram().count(), 400);
    assert_eq!(
        observer.tensors["layers.1"]
            .channel_abs_max()
            .unwrap()
            .len(),
        32
    );
}

#[test]
fn bad_policy_files_are_clear_errors() {
    let dir = std::env::temp_dir().join(format!("qforge-bad-policy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(
        fixture("cartpole").join("policy.json"),
        dir.join("policy.json"),
    )
    .unwrap();
    let weights = std::fs::read(fixture("cartpole").join("model.safetensors")).unwrap();
    std::fs::write(dir.join("model.safetensors"), &weights[..weights.len() / 2]).unwrap();
    let err = MlpPolicy::from_dir(&dir).unwrap_err().to_string();
    assert!(err.contains("model.safetensors"), "{err}");
    std::fs::write(dir.join("model.safetensors"), &weights).unwrap();
    let config = std::fs::read_to_string(dir.join("policy.json")).unwrap();
    std::fs::write(
        dir.join("policy.json"),
        config.replace("\"observation_dim\": 4", "\"observation_dim\": 5"),
    )
    .unwrap();
    let err = MlpPolicy::from_dir(&dir).unwrap_err().to_string();
    assert!(err.contains("layers.0.weight"), "{err}");
    std::fs::write(dir.join("policy.json"), "{not json").unwrap();
    let err = MlpPolicy::from_dir(&dir).unwrap_err().to_string();
    assert!(err.contains("policy.json"), "{err}");
    // A Gaussian head's log_std must have one finite entry per dimension.
    for file in ["policy.json", "model.safetensors"] {
        std::fs::copy(fixture("pendulum").join(file), dir.join(file)).unwrap();
    }
    let config = std::fs::read_to_string(dir.join("policy.json")).unwrap();
    for log_std in ["[0.0, 0.0]", "[1e30]"] {
        let bad = config.replace(
            "\"action_dim\": 1",
            &format!("\"action_dim\": 1, \"log_std\": {log_std}"),
        );
        std::fs::write(dir.join("policy.json"), bad).unwrap();
        let err = MlpPolicy::from_dir(&dir).unwrap_err().to_string();
        assert!(err.contains("log_std"), "{err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The INT8 engine (dynamic per-token activations, per-channel weights) on
/// the trained policies: the actions agree with full precision on the
/// recorded rollouts.
#[test]
fn int8_dynamic_policies_agree_with_full_precision() {
    for (name, required) in [("cartpole", 0.98), ("pendulum", 0.98)] {
        let policy = MlpPolicy::from_dir(&fixture(name)).unwrap();
        let int8 = policy
            .with_linears(|_, layer| layer.to_int8(qforge_model::Activations::Dynamic))
            .unwrap();
        let (observations, _) = rollouts(name);
        let fp = policy.act(&observations).unwrap();
        let q = int8.act(&observations).unwrap();
        let agreeing = fp
            .iter()
            .zip(&q)
            .filter(|(a, b)| policy.actions_agree(a, b))
            .count();
        let agreement = agreeing as f64 / fp.len() as f64;
        eprintln!(
            "{name}: INT8 dynamic action agreement {:.2} %",
            100.0 * agreement
        );
        assert!(agreement >= required, "{name}: {agreement}");
    }
}

#[test]
fn a_smoothed_policy_computes_what_the_policy_does_with_its_observation_divided() {
    let policy = MlpPolicy::from_dir(&fixture("cartpole")).unwrap();
    let (observations, _) = rollouts("cartpole");
    let factors: std::collections::BTreeMap<String, Vec<f32>> =
        [("layers.0".to_owned(), vec![2.0, 0.5, 3.0, 0.25])].into();
    let smoothed = policy.smoothed(&factors).unwrap();
    assert_eq!(
        smoothed.config().observation_divisors,
        Some(vec![2.0, 0.5, 3.0, 0.25])
    );
    // The first layer now sees each feature divided by its factor.
    let mut seen = StatsObserver::new(Statistics::Histograms { per_channel: true });
    smoothed
        .forward(&observations[..400], Some(&mut seen))
        .unwrap();
    let expected: Vec<f32> = (0..4)
        .map(|j| {
            observations[..400]
                .iter()
                .skip(j)
                .step_by(4)
                .map(|x| (x / [2.0f32, 0.5, 3.0, 0.25][j]).abs())
                .fold(0.0, f32::max)
        })
        .collect();
    assert_eq!(
        seen.tensors["layers.0"].channel_abs_max().unwrap(),
        expected
    );
    let ours = smoothed.forward(&observations, None).unwrap();
    let theirs = policy.forward(&observations, None).unwrap();
    for (a, b) in ours.iter().zip(&theirs) {
        assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
    }
    // Smoothing twice multiplies the divisors.
    let twice = smoothed.smoothed(&factors).unwrap();
    assert_eq!(
        twice.config().observation_divisors,
        Some(vec![4.0, 0.25, 9.0, 0.0625])
    );
    // A hidden layer's input follows a tanh, which no factor commutes with.
    let hidden: std::collections::BTreeMap<String, Vec<f32>> =
        [("layers.1".to_owned(), vec![1.0; 32])].into();
    let error = policy.smoothed(&hidden).unwrap_err().to_string();
    assert!(error.contains("only layers.0"), "{error}");
    let bad: std::collections::BTreeMap<String, Vec<f32>> =
        [("layers.0".to_owned(), vec![1.0, 0.0, 1.0, 1.0])].into();
    assert!(policy.smoothed(&bad).is_err());
}

/// A discrete head's log-probabilities are the log-softmax of its logits
/// (they exponentiate to 1), and its samples follow the softmax: 40 000
/// seeded draws land within 0.01 of each probability.
#[test]
fn a_discrete_head_scores_and_samples_its_softmax() {
    use qforge_formats::policy::Head;
    use rand::SeedableRng;
    let head = Head::Discrete { actions: 3 };
    let logits = [1.0f32, 2.5, -0.5];
    let log_probs: Vec<f64> = (0..3)
        .map(|a| head.log_prob(&logits, &Action::Discrete(a)).unwrap())
        .collect();
    let total: f64 = log_probs.iter().map(|l| l.exp()).sum();
    assert!((total - 1.0).abs() < 1e-12, "{total}");
    // log softmax by hand: x_a − ln Σ e^x.
    let lse = logits.iter().map(|&v| f64::from(v).exp()).sum::<f64>().ln();
    assert!((log_probs[1] - (2.5 - lse)).abs() < 1e-12);
    assert_eq!(head.log_prob(&logits, &Action::Discrete(3)), None);

    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let draws = 40_000;
    let mut counts = [0usize; 3];
    for _ in 0..draws {
        let Some(Action::Discrete(a)) = head.sample(&logits, &mut rng) else {
            panic!("a discrete head samples a discrete action");
        };
        counts[a] += 1;
    }
    for (count, log_prob) in counts.iter().zip(&log_probs) {
        let share = *count as f64 / draws as f64;
        assert!((share - log_prob.exp()).abs() < 0.01, "{counts:?}");
    }
}

/// A Gaussian head with `log_std` scores an action by the diagonal
/// Gaussian's log-density and samples around its mean within its bounds;
/// without `log_std` it has no distribution.
#[test]
fn a_gaussian_head_with_log_std_scores_and_samples_its_density() {
    use qforge_formats::policy::Head;
    use rand::SeedableRng;
    let head = |log_std| Head::Gaussian {
        action_dim: 2,
        low: vec![-2.0, -2.0],
        high: vec![2.0, 2.0],
        log_std,
    };
    let stochastic = head(Some(vec![(0.5f32).ln(), 0.0]));
    let mean = [0.25f32, -1.0];
    let action = Action::Continuous(vec![0.75, 0.0]);
    // N(0.25, 0.5²) at 0.75 (z = 1) plus N(−1, 1) at 0 (z = 1).
    let expected = 2.0 * (-0.5 - 0.5 * (2.0 * std::f64::consts::PI).ln()) - (0.5f64).ln();
    let got = stochastic.log_prob(&mean, &action).unwrap();
    assert!((got - expected).abs() < 1e-6, "{got} vs {expected}");

    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let draws = 20_000;
    let mut sum = [0.0f64; 2];
    for _ in 0..draws {
        let Some(Action::Continuous(a)) = stochastic.sample(&mean, &mut rng) else {
            panic!("a Gaussian head samples a continuous action");
        };
        assert!(a.iter().all(|v| (-2.0..=2.0).contains(v)), "{a:?}");
        sum[0] += f64::from(a[0]);
        sum[1] += f64::from(a[1]);
    }
    // Clipping at ±2 barely moves the first mean (4σ away); the second
    // loses the tail below −2 (1σ), which pulls its mean up by about 0.08.
    assert!((sum[0] / draws as f64 - 0.25).abs() < 0.02, "{sum:?}");
    assert!((sum[1] / draws as f64 - (-0.92)).abs() < 0.03, "{sum:?}");

    let mean_only = head(None);
    assert!(!mean_only.is_stochastic() && stochastic.is_stochastic());
    assert_eq!(mean_only.log_prob(&mean, &action), None);
    assert!(mean_only.sample(&mean, &mut rng).is_none());
}
