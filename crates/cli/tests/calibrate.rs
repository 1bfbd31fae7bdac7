//! `qforge calibrate` end to end on the embedded backend: byte-identical
//! statistics whatever the worker count, bad data reported by line, resume
//! from checkpoints.

use std::process::Output;

mod support;

use support::{json, path, qforge, root};

fn temp(name: &str) -> tempfile::TempDir {
    support::temp("calibrate", name)
}

fn policy_calibrate(out: &str, extra: &[&str]) -> Output {
    let mut args = vec![
        "calibrate",
        "--model",
        &path("fixtures/policies/pendulum"),
        "--data",
        &path("fixtures/policies/pendulum/rollouts.jsonl"),
        "--samples",
        "1500",
        "--batch-size",
        "50",
        "-o",
        out,
        "--json",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect::<Vec<_>>();
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    qforge(&refs)
}

#[test]
fn worker_count_does_not_change_a_byte() {
    let dir = temp("workers");
    let dir = dir.path();
    let mut files = Vec::new();
    for workers in ["1", "4"] {
        let out = dir.join(format!("w{workers}.qstats"));
        let summary = json(&policy_calibrate(
            out.to_str().unwrap(),
            &["--workers", workers],
        ));
        assert_eq!(summary["coverage"], 1.0);
        assert_eq!(summary["planned_batches"], 30);
        // Every batch is merged once, by whichever workers got to it (a fast
        // worker may take them all, so idle workers are not listed).
        let reports = summary["workers"].as_object().unwrap();
        assert!(reports.len() <= workers.parse::<usize>().unwrap());
        let merged: u64 = reports
            .values()
            .map(|w| w["merged"].as_u64().unwrap())
            .sum();
        assert_eq!(merged, 30);
        files.push(std::fs::read(out).unwrap());
    }
    assert_eq!(files[0], files[1]);
}

#[test]
fn smollm2_episodes_calibrate_identically_on_one_and_two_workers() {
    let model = root().join("models/smollm2-135m-instruct-q4_1.gguf");
    assert!(
        model.exists(),
        "{} missing: run scripts/fetch-models.sh",
        model.display()
    );
    let dir = temp("smollm2");
    let dir = dir.path();
    let mut files = Vec::new();
    for workers in ["1", "2"] {
        let out = dir.join(format!("w{workers}.qstats"));
        let summary = json(&qforge(&[
            "calibrate",
            "--model",
            model.to_str().unwrap(),
            "--data",
            &path("fixtures/episodes/arithmetic.jsonl"),
            "--samples",
            "8",
            "--seq-len",
            "64",
            "--batch-size",
            "2",
            "--workers",
            workers,
            "--stratify",
            "reward",
            "-o",
            out.to_str().unwrap(),
            "--json",
        ]));
        assert_eq!(summary["merged_batches"], 4);
        files.push(std::fs::read(&out).unwrap());
    }
    assert_eq!(files[0], files[1]);
    let shown = json(&qforge(&[
        "stats",
        "show",
        dir.join("w1.qstats").to_str().unwrap(),
        "--json",
    ]));
    let tensors = shown["tensors"].as_object().unwrap();
    assert_eq!(
        tensors.len(),
        30 * 4 + 1,
        "every distinct linear input of 30 layers + lm_head"
    );
    assert!(tensors.contains_key("model.layers.29.mlp.down_proj"));
}

#[test]
fn bad_lines_are_reported_by_number_or_skipped_on_request() {
    let dir = temp("bad");
    let dir = dir.path();
    let data = dir.join("bad.jsonl");
    let good =
        std::fs::read_to_string(root().join("fixtures/policies/pendulum/rollouts.jsonl")).unwrap();
    let first = good.lines().next().unwrap();
    std::fs::write(
        &data,
        format!("{first}\n{{\"observations\": [[1, 2]]\n{first}\n"),
    )
    .unwrap();
    let out = qforge(&[
        "calibrate",
        "--model",
        &path("fixtures/policies/pendulum"),
        "--data",
        data.to_str().unwrap(),
        "--samples",
        "100",
        "-o",
        dir.join("x.qstats").to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("bad.jsonl:2") && stderr.contains("--skip-invalid"),
        "{stderr}"
    );
    let out = qforge(&[
        "calibrate",
        "--model",
        &path("fixtures/policies/pendulum"),
        "--data",
        data.to_str().unwrap(),
        "--samples",
        "100",
        "--skip-invalid",
        "-o",
        dir.join("x.qstats").to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("bad.jsonl:2: skipped"));
}

/// Rows that parse but that the model cannot take: found when the data is
/// checked, with their line numbers, not three failed forwards later.
#[test]
fn rows_the_model_cannot_take_are_reported_by_line_at_the_data_check() {
    let dir = temp("unfit");
    let dir = dir.path();
    let pendulum = path("fixtures/policies/pendulum");
    let good =
        std::fs::read_to_string(root().join("fixtures/policies/pendulum/rollouts.jsonl")).unwrap();
    let first = good.lines().next().unwrap();
    let calibrate = |data: &std::path::Path, extra: &[&str]| {
        let mut args = vec![
            "calibrate",
            "--model",
            &pendulum,
            "--data",
            data.to_str().unwrap(),
            "--samples",
            "100",
        ];
        args.extend(extra);
        let out = dir.join("x.qstats");
        args.extend(["-o", out.to_str().unwrap()]);
        qforge(&args)
    };
    // Pendulum observations hold 3 values; 3.5e38 is finite as f64 only.
    for (row, expected) in [
        (
            "[[1, 2, 3, 4]]",
            "observation 0 has 4 values; the policy takes 3",
        ),
        ("[[0.5, 3.5e38, 0]]", "not a finite 32-bit float"),
    ] {
        let data = dir.join("unfit.jsonl");
        std::fs::write(
            &data,
            format!("{first}\n{first}\n{{\"observations\": {row}}}\n{first}\n"),
        )
        .unwrap();
        let out = calibrate(&data, &[]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains("unfit.jsonl:3: ") && stderr.contains(expected),
            "{stderr}"
        );
        let out = calibrate(&data, &["--skip-invalid"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        assert!(stderr.contains("unfit.jsonl:3: skipped"), "{stderr}");
    }

    // Token ids past SmolLM2's 49 152-token vocabulary.
    let data = dir.join("tokens.jsonl");
    std::fs::write(
        &data,
        "{\"token_ids\": [1, 2, 3]}\n{\"token_ids\": [1, 49152]}\n",
    )
    .unwrap();
    let model = root().join("models/smollm2-135m-instruct-q4_1.gguf");
    let out = qforge(&[
        "calibrate",
        "--model",
        model.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "-o",
        dir.join("t.qstats").to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("tokens.jsonl:2: token id 49152 (position 1) is outside the model's vocabulary of 49152 tokens"),
        "{stderr}"
    );
}

#[test]
fn a_finished_run_resumes_without_recomputing_and_gives_the_same_bytes() {
    let dir = temp("resume");
    let dir = dir.path();
    let checkpoints = dir.join("ckpt");
    let first = dir.join("first.qstats");
    let summary = json(&policy_calibrate(
        first.to_str().unwrap(),
        &[
            "--checkpoint-dir",
            checkpoints.to_str().unwrap(),
            "--checkpoint-every",
            "7",
            "--run",
            "r1",
        ],
    ));
    assert_eq!(
        summary["checkpoints_written"], 5,
        "after 7, 14, 21, 28 and the final 30"
    );
    let kept = std::fs::read_dir(checkpoints.join("r1")).unwrap().count();
    assert_eq!(kept, 3);
    let second = dir.join("second.qstats");
    let resumed = json(&policy_calibrate(
        second.to_str().unwrap(),
        &[
            "--checkpoint-dir",
            checkpoints.to_str().unwrap(),
            "--resume",
            "r1",
        ],
    ));
    assert_eq!(resumed["resumed_batches"], 30);
    assert_eq!(
        std::fs::read(first).unwrap(),
        std::fs::read(second).unwrap()
    );
}

/// Calibrates the CartPole policy on `samples` of its rollouts into a fresh
/// folder; returns the folder (removed when dropped) and the statistics' path.
fn calibrated_cartpole(name: &str, samples: &str) -> (tempfile::TempDir, String) {
    let dir = temp(name);
    let stats = dir.path().join("cartpole.qstats");
    let stats = stats.to_str().unwrap().to_owned();
    let out = qforge(&[
        "calibrate",
        "--model",
        &path("fixtures/policies/cartpole"),
        "--data",
        &path("fixtures/policies/cartpole/rollouts.jsonl"),
        "--samples",
        samples,
        "-o",
        &stats,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    (dir, stats)
}

/// Calibration feeds the INT8 engine: static per-tensor activation scales
/// from the statistics keep the CartPole policy's actions; statistics of
/// another model, or none, are refused clearly.
#[test]
fn static_int8_runs_on_calibrated_scales_and_refuses_foreign_statistics() {
    let (_dir, stats) = calibrated_cartpole("static-int8", "2000");
    let stats = stats.as_str();
    let cartpole = path("fixtures/policies/cartpole");
    let rollouts = path("fixtures/policies/cartpole/rollouts.jsonl");
    let agreement = |extra: &[&str]| {
        let mut args = vec![
            "eval",
            "agreement",
            "--model",
            &cartpole,
            "--reference",
            &cartpole,
            "--observations",
            &rollouts,
            "--json",
        ];
        args.extend(extra);
        qforge(&args)
    };
    for calibrator in ["minmax", "mse"] {
        let result = json(&agreement(&[
            "--precision",
            "int8-static",
            "--stats",
            stats,
            "--calibrator",
            calibrator,
        ]));
        let share = result["agreement"].as_f64().unwrap();
        assert!(share >= 0.95, "{calibrator}: {share}");
    }
    let missing = agreement(&["--precision", "int8-static"]);
    assert_eq!(missing.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("needs --stats"));
    let pendulum = path("fixtures/policies/pendulum");
    let foreign = qforge(&[
        "eval",
        "agreement",
        "--model",
        &pendulum,
        "--reference",
        &pendulum,
        "--observations",
        &path("fixtures/policies/pendulum/rollouts.jsonl"),
        "--precision",
        "int8-static",
        "--stats",
        stats,
    ]);
    assert_eq!(foreign.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&foreign.stderr).contains("calibrated on another model"),
        "{}",
        String::from_utf8_lossy(&foreign.stderr)
    );
}

/// `eval layers` ranks every layer by its output SQNR on the INT8 engine,
/// worst first, for dynamic and for calibrated static activations.
#[test]
fn eval_layers_ranks_every_layer_by_int8_sqnr() {
    let (_dir, stats) = calibrated_cartpole("layers", "512");
    let stats = stats.as_str();
    let cartpole = path("fixtures/policies/cartpole");
    let rollouts = path("fixtures/policies/cartpole/rollouts.jsonl");
    for extra in [
        vec!["--precision", "int8-dynamic"],
        vec!["--precision", "int8-static", "--stats", stats],
    ] {
        let mut args = vec![
            "eval",
            "layers",
            "--model",
            &cartpole,
            "--observations",
            &rollouts,
            "--json",
        ];
        args.extend(extra);
        let report = json(&qforge(&args));
        let layers = report["layers"].as_array().unwrap();
        assert_eq!(layers.len(), 3, "{report}");
        let db: Vec<f64> = layers
            .iter()
            .map(|l| l["sqnr_db"].as_f64().unwrap())
            .collect();
        assert!(db.windows(2).all(|w| w[0] <= w[1]), "worst first: {db:?}");
        // Int8 on a small tanh MLP: well above 25 dB, far below exact.
        assert!(db.iter().all(|&d| d > 25.0 && d < 80.0), "{db:?}");
        assert_eq!(layers[0]["rows"], 4000);
    }
    let f32_run = qforge(&[
        "eval",
        "layers",
        "--model",
        &cartpole,
        "--observations",
        &rollouts,
    ]);
    assert_eq!(f32_run.status.code(), Some(2));
}
