//! What load refuses, nothing writes or accepts (issue 55, point 5): an
//! artifact with one number edited and its manifest rewritten to match is
//! refused by every command that reads it — `verify`, `export` (ONNX and
//! compressed-tensors), `requantize`, and the loaders of `act`, `eval` and
//! `serve` — with one message, the artifact check's. Before, `verify`,
//! `export` and `requantize` accepted a weight scale of 1e-40 or 3e38, and
//! `export` wrote a NaN scale or an infinite bias that `serve` refused.

mod support;

#[path = "../../model/tests/tampered/mod.rs"]
mod tampered;

use std::path::Path;
use std::process::Output;

use support::{path, qforge_bounded};
use tampered::{ATTACKS, REMEDY, cartpole_artifact};

/// Every command that reads the artifact `model`, writing into `out`.
fn commands(model: &str, out: &Path) -> Vec<Vec<String>> {
    let observations = path("fixtures/policies/cartpole/rollouts.jsonl");
    let source = path("fixtures/policies/cartpole");
    let dest = |name: &str| out.join(name).to_string_lossy().into_owned();
    let commands: [&[&str]; 7] = [
        &["verify", model],
        &[
            "export",
            "--model",
            model,
            "--format",
            "onnx",
            "-o",
            &dest("onnx"),
        ],
        &[
            "export",
            "--model",
            model,
            "--format",
            "compressed-tensors",
            "-o",
            &dest("ct"),
        ],
        &[
            "requantize",
            "--model",
            &source,
            "--like",
            model,
            "-o",
            &dest("requantized"),
        ],
        &["act", "--model", model, "--observations", &observations],
        &[
            "eval",
            "agreement",
            "--model",
            model,
            "--reference",
            &source,
            "--observations",
            &observations,
        ],
        &["serve", "--model", model, "--addr", "127.0.0.1:0"],
    ];
    commands
        .iter()
        .map(|c| c.iter().map(|s| s.to_string()).collect())
        .collect()
}

fn run(args: &[String]) -> Output {
    qforge_bounded(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

#[test]
fn every_command_refuses_a_tampered_number_with_one_message() {
    let scratch = support::temp("numbers", "clean");
    let clean = scratch.path().join("artifact");
    std::fs::create_dir(&clean).unwrap();
    cartpole_artifact(&clean);
    let model = clean.to_string_lossy().into_owned();
    // The untouched artifact: each command but `serve` (which would run on)
    // and compressed-tensors (for language models) works.
    for (i, args) in commands(&model, scratch.path()).iter().enumerate() {
        if [2, 6].contains(&i) {
            continue;
        }
        let out = run(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {stderr}");
    }
    for attack in ATTACKS {
        let scratch = support::temp("numbers", "tampered");
        let dir = scratch.path().join("artifact");
        std::fs::create_dir(&dir).unwrap();
        cartpole_artifact(&dir);
        attack.apply(&dir);
        let message = qforge_model::artifact::check_numbers(&dir)
            .unwrap_err()
            .to_string();
        assert!(message.contains(attack.expected), "{attack:?}: {message}");
        let model = dir.to_string_lossy().into_owned();
        for args in commands(&model, scratch.path()) {
            let out = run(&args);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{attack:?} {args:?}: {stderr}");
            assert!(
                stderr.contains(&message) && stderr.contains(REMEDY),
                "{attack:?} {args:?}: expected {message:?} in: {stderr}"
            );
        }
        for written in ["onnx", "ct", "requantized"] {
            assert!(
                !scratch.path().join(written).exists(),
                "{attack:?}: {written}"
            );
        }
    }
}
