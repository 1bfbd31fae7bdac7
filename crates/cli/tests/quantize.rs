//! `qforge quantize` end to end: the bundled default (README's first
//! command) writes an artifact that `eval` runs and `verify` checks; the
//! guard's refusal exits 3 without an artifact; SmolLM2 quantizes with
//! SmoothQuant and static scales under a perplexity budget with fallback,
//! and the artifact (factors folded in) runs in `eval perplexity` and
//! `generate`.

mod support;

use serde_json::Value;
use support::{json, path, qforge_in};

fn temp(name: &str) -> tempfile::TempDir {
    support::temp("quantize", name)
}

#[test]
fn the_bundled_default_writes_an_artifact_that_runs_and_verifies() {
    // Run outside the checkout: the bundled policy is found all the same.
    let dir = temp("default");
    let dir = dir.path();
    let result = json(&qforge_in(dir, &["quantize", "--json"]));
    assert_eq!(result["accepted"], true);
    let agreement = result["after"]["agreement"].as_f64().unwrap();
    assert!(agreement >= 0.99, "{result}");
    // No method named: plain static scales miss the budget before any
    // fallback, SmoothQuant meets it, with every layer int8.
    let tried: Vec<&str> = result["method"]["tried"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["method"].as_str().unwrap())
        .collect();
    assert_eq!(tried, ["plain", "smoothquant"], "{result}");
    assert_eq!(result["method"]["chosen"], "smoothquant");
    assert_eq!(result["fp_layers"], 0);
    let out = dir.join("qforge-out");
    for file in [
        "qforge.json",
        "model.safetensors",
        "policy.json",
        "calibration.json",
        "transforms.json",
        "manifest.json",
        "report.json",
        "report.html",
    ] {
        assert!(out.join(file).is_file(), "{file} missing");
    }

    // The report holds the decisions and draws them.
    let report: Value =
        serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
    let points = report["decision"]["point_reports"].as_array().unwrap();
    assert_eq!(points.len(), 3);
    assert!(
        points
            .iter()
            .all(|p| p["histogram"].as_array().unwrap().len() > 10)
    );
    assert!(
        !report["decision"]["evaluations"]
            .as_array()
            .unwrap()
            .is_empty()
    );
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(html.contains("accepted") && html.matches("<svg").count() >= 4);
    assert!(html.contains("<h2>Method</h2>") && html.contains("smoothquant"));

    // The artifact runs through `eval agreement` and keeps its agreement with
    // the FP policy on all recorded observations.
    let reference = path("fixtures/policies/cartpole");
    let observations = path("fixtures/policies/cartpole/rollouts.jsonl");
    let agreement = |extra: &[&str]| {
        let mut args = vec![
            "eval",
            "agreement",
            "--model",
            "qforge-out",
            "--reference",
            &reference,
            "--observations",
            &observations,
        ];
        args.extend_from_slice(extra);
        qforge_in(dir, &args)
    };
    let eval = json(&agreement(&["--json"]));
    assert!(eval["agreement"].as_f64().unwrap() >= 0.99, "{eval}");
    // An artifact runs as stored: asking for another precision is a usage error.
    let asked = agreement(&["--precision", "int8-dynamic"]);
    assert_eq!(asked.status.code(), Some(2));

    let verified = json(&qforge_in(dir, &["verify", "qforge-out", "--json"]));
    assert_eq!(verified["files"], 7);

    // Quantizing again replaces the earlier output.
    json(&qforge_in(dir, &["quantize", "--json"]));
    assert!(out.join("qforge.json").is_file());

    // compressed-tensors is for language models; a policy is refused.
    let ct = qforge_in(
        dir,
        &[
            "export",
            "--model",
            "qforge-out",
            "--format",
            "compressed-tensors",
            "-o",
            "ct",
        ],
    );
    assert_eq!(ct.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&ct.stderr).contains("language models"));
    // A directory that is not an artifact is a usage error.
    let not_artifact = qforge_in(
        dir,
        &[
            "export",
            "--model",
            ".",
            "--format",
            "compressed-tensors",
            "-o",
            "ct",
        ],
    );
    assert_eq!(not_artifact.status.code(), Some(2));

    // A changed file is named.
    let policy = out.join("policy.json");
    let text = std::fs::read_to_string(&policy).unwrap();
    std::fs::write(&policy, text.replace("CartPole", "CartP0le")).unwrap();
    let tampered = qforge_in(dir, &["verify", "qforge-out"]);
    assert_eq!(tampered.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&tampered.stderr);
    assert!(stderr.contains("policy.json changed"), "{stderr}");
    // … and nothing is exported from a tampered artifact.
    let export = qforge_in(
        dir,
        &[
            "export",
            "--model",
            "qforge-out",
            "--format",
            "onnx",
            "-o",
            "onnx",
        ],
    );
    assert_eq!(export.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&export.stderr);
    assert!(stderr.contains("does not match its manifest"), "{stderr}");
}

#[test]
fn a_refused_guard_exits_3_and_writes_no_artifact() {
    let dir = temp("refused");
    let dir = dir.path();
    // Every observation must agree and no layer may fall back to FP: INT8
    // cannot promise that on this policy.
    let out = qforge_in(
        dir,
        &[
            "quantize",
            "--min-agreement",
            "1.0",
            "--max-fp-fraction",
            "0",
        ],
    );
    assert_eq!(
        out.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("No artifact written"), "{stderr}");
    let written = dir.join("qforge-out");
    assert!(written.join("report.json").is_file());
    assert!(!written.join("qforge.json").exists() && !written.join("model.safetensors").exists());
    let report: Value =
        serde_json::from_slice(&std::fs::read(written.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["decision"]["accepted"], false);

    // A directory that is not a qforge output is never replaced.
    let foreign = dir.join("mine");
    std::fs::create_dir_all(&foreign).unwrap();
    std::fs::write(foreign.join("notes.txt"), "keep me").unwrap();
    let out = qforge_in(dir, &["quantize", "-o", "mine"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        std::fs::read_to_string(foreign.join("notes.txt")).unwrap(),
        "keep me"
    );

    // Bad recipes are usage errors that name the field.
    let recipe = dir.join("bad.toml");
    std::fs::write(&recipe, "[guard]\nmin_agreemnt = 0.9\n").unwrap();
    let out = qforge_in(dir, &["quantize", "--recipe", recipe.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("min_agreemnt"));
}

#[test]
fn smollm2_smoothed_and_static_quantizes_within_its_budget_and_the_artifact_runs() {
    let dir = temp("smollm2");
    let dir = dir.path();
    let gguf = path("models/smollm2-135m-instruct-q4_1.gguf");
    let text = path("fixtures/text/eval.txt");
    // The α search scores every input's ten α on the INT8 engine; 128 rows
    // keep it to seconds here (the default is 512).
    let recipe = dir.join("search.toml");
    std::fs::write(&recipe, "[smoothing]\nsearch_rows = 128\n").unwrap();
    let result = json(&qforge_in(
        dir,
        &[
            "quantize",
            "--recipe",
            recipe.to_str().unwrap(),
            "--model",
            &gguf,
            "--data",
            &path("fixtures/episodes/arithmetic.jsonl"),
            "--samples",
            "16",
            "--seq-len",
            "128",
            "--activations",
            "static",
            "--smoothquant",
            "--eval-data",
            &text,
            "--ctx",
            "128",
            "-o",
            "out",
            "--json",
        ],
    ));
    assert_eq!(result["accepted"], true, "{result}");
    let increase = result["after"]["perplexity_increase"].as_f64().unwrap();
    assert!(increase <= 0.03, "{result}");
    // The guard says how far its held-out chunks let it trust that figure.
    let interval = &result["after"]["perplexity_increase_interval"];
    let (low, high) = (interval[0].as_f64().unwrap(), interval[1].as_f64().unwrap());
    assert!(low < increase && increase < high, "{result}");
    // Static scales everywhere cost far more than the budget: the ladder worked.
    let before = result["before"]["perplexity_increase"].as_f64().unwrap();
    assert!(
        before > 0.1 && result["fallback_steps"].as_u64().unwrap() > 0,
        "{result}"
    );
    let fp_layers = result["fp_layers"].as_u64().unwrap();
    assert!(fp_layers * 4 <= result["total_layers"].as_u64().unwrap());
    // Every smoothable input (q/k/v, gate/up, down_proj of 30 layers) got
    // its own α from the grid, scored on the rows asked for.
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("out/report.json")).unwrap()).unwrap();
    let smoothing = &report["smoothing"];
    let alphas = smoothing["alphas"].as_object().unwrap();
    assert_eq!(alphas.len(), 90, "{smoothing}");
    assert!(
        alphas
            .values()
            .all(|a| (0.1..=1.0).contains(&a.as_f64().unwrap()))
    );
    assert!(
        smoothing["search_rows"].as_u64().unwrap() >= 128,
        "{smoothing}"
    );
    assert!(
        smoothing["error_vs_half"].as_f64().unwrap() <= 1.0,
        "{smoothing}"
    );

    // `eval perplexity` on the artifact reproduces the guard's figure.
    reproduces_the_guard_perplexity(dir, &text, &result);

    answers_paris(dir);
    json(&qforge_in(dir, &["verify", "out", "--json"]));

    // New weights go through the transforms the artifact records (the
    // SmoothQuant factors folded into its norms).
    requantizes_to_its_own_bytes(dir, &gguf);
}

/// A static method search measures each method's plan twice: as it
/// stands, and at the end of the guard's ladder bounded to keep at most a
/// tenth of the linear layers off static scales (FP within its cap). On
/// SmolLM2 plain static scales miss a +40 % budget on the fixture text as
/// they stand (about +106 %) but meet it within the bound: the search keeps
/// plain, says why, tries nothing dearer, and the guard walks that ladder,
/// so the artifact keeps at least 90 % of its layers static.
#[test]
fn a_static_search_keeps_a_method_that_meets_the_budget_within_its_bounded_ladder() {
    let dir = temp("mostly-static");
    let dir = dir.path();
    let result = json(&qforge_in(
        dir,
        &[
            "quantize",
            "--model",
            &path("models/smollm2-135m-instruct-q4_1.gguf"),
            "--data",
            &path("fixtures/episodes/arithmetic.jsonl"),
            "--samples",
            "8",
            "--seq-len",
            "64",
            "--activations",
            "static",
            "--max-perplexity-increase",
            "0.4",
            "--eval-data",
            &path("fixtures/text/eval.txt"),
            "--ctx",
            "128",
            "-o",
            "out",
            "--json",
        ],
    ));
    assert_eq!(result["accepted"], true, "{result}");
    let search = &result["method"];
    assert_eq!(search["chosen"], "plain", "{search}");
    let tried = search["tried"].as_array().unwrap();
    assert_eq!(tried.len(), 1, "{search}");
    let plain = &tried[0];
    assert_eq!(plain["before"]["passes"], false, "{plain}");
    let mostly = &plain["mostly_static"];
    let moved = mostly["moved_layers"].as_u64().unwrap();
    let total = result["total_layers"].as_u64().unwrap();
    // lm_head runs dynamic in a static plan: it counts against the tenth.
    assert!(moved > 0 && (moved + 1) * 10 <= total, "{plain}");
    assert_eq!(mostly["metrics"]["passes"], true, "{plain}");
    let (as_is, mostly_static) = (
        plain["before"]["perplexity_increase"].as_f64().unwrap(),
        mostly["metrics"]["perplexity_increase"].as_f64().unwrap(),
    );
    assert!(mostly_static < 0.4 && 0.4 < as_is, "{plain}");
    let reason = search["reason"].as_str().unwrap();
    assert!(reason.contains("bounded to keep 90 %"), "{reason}");
    // The guard starts from the plan as it stood and walks the bounded
    // ladder: what it settles on is within the bound.
    assert_eq!(result["before"], plain["before"], "{result}");
    let after = result["after"]["perplexity_increase"].as_f64().unwrap();
    assert!(after <= 0.4, "{result}");
    assert!(result["fp_layers"].as_u64() <= mostly["fp_layers"].as_u64());
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("out/report.json")).unwrap())
            .unwrap();
    let static_layers: usize = report["decision"]["point_reports"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["precision"] == "int8-static")
        .map(|p| p["layers"].as_array().unwrap().len())
        .sum();
    assert!(
        static_layers as u64 * 10 >= total * 9,
        "{static_layers} of {total} static"
    );
    let html = std::fs::read_to_string(dir.join("out/report.html")).unwrap();
    assert!(
        html.contains(&format!("{moved} layers off static")),
        "{html}"
    );
}

/// `qforge requantize` of the artifact `out` in `dir` from its own source
/// `gguf` changes no weight and writes the same weights, configuration and
/// transforms.
fn requantizes_to_its_own_bytes(dir: &std::path::Path, gguf: &str) {
    let requantized = json(&qforge_in(
        dir,
        &[
            "requantize",
            "--model",
            gguf,
            "--like",
            "out",
            "-o",
            "again",
            "--json",
        ],
    ));
    assert_eq!(requantized["changed_weights"], 0, "{requantized}");
    for file in ["model.safetensors", "qforge.json", "transforms.json"] {
        let read = |artifact: &str| std::fs::read(dir.join(artifact).join(file)).unwrap();
        assert!(read("out") == read("again"), "{file} differs");
    }
}

/// QuaRot (`--hadamard quarot`, the rotation the method search tries): the
/// residual rotated offline, down_proj's input online. The artifact records
/// both, runs as the guard measured it, still answers, and its source
/// requantizes to its own bytes. Its compressed-tensors export carries the
/// online rotation as a transform, and qforge reads the export back to the
/// artifact's perplexity, bit for bit.
#[test]
fn smollm2_rotated_by_quarot_runs_on_qforge_and_exports_its_rotation() {
    let dir = temp("smollm2-rotated");
    let dir = dir.path();
    let gguf = path("models/smollm2-135m-instruct-q4_1.gguf");
    let text = path("fixtures/text/eval.txt");
    let result = json(&qforge_in(
        dir,
        &[
            "quantize",
            "--model",
            &gguf,
            "--data",
            &path("fixtures/episodes/arithmetic.jsonl"),
            "--samples",
            "8",
            "--seq-len",
            "64",
            "--activations",
            "dynamic",
            "--hadamard",
            "quarot",
            "--eval-data",
            &text,
            "--ctx",
            "128",
            "-o",
            "out",
            "--json",
        ],
    ));
    assert_eq!(result["accepted"], true, "{result}");
    let config: Value =
        serde_json::from_slice(&std::fs::read(dir.join("out/qforge.json")).unwrap()).unwrap();
    assert_eq!(
        config["online_rotations"],
        serde_json::json!(["mlp.down_proj"])
    );
    let transforms: Value =
        serde_json::from_slice(&std::fs::read(dir.join("out/transforms.json")).unwrap()).unwrap();
    assert_eq!(
        transforms,
        serde_json::json!([
            {"kind": "rotate-residual", "seed": 0},
            {"kind": "rotate", "inputs": ["mlp.down_proj"]}
        ])
    );
    reproduces_the_guard_perplexity(dir, &text, &result);
    answers_paris(dir);
    requantizes_to_its_own_bytes(dir, &gguf);
    let export = qforge_in(
        dir,
        &[
            "export",
            "--model",
            "out",
            "--format",
            "compressed-tensors",
            "-o",
            "ct",
        ],
    );
    assert!(export.status.success(), "{export:?}");
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(dir.join("ct/manifest.json")).unwrap()).unwrap();
    assert_eq!(
        manifest["info"]["online_rotations"],
        serde_json::json!(["mlp.down_proj"]),
        "{manifest}"
    );
    reproduces_the_guard_perplexity_of(dir, "ct", &text, &result);
}

#[test]
fn the_artifact_is_written_with_the_users_umask() {
    let dir = temp("umask");
    let dir = dir.path();
    // The guard's verdict on CartPole depends on the CPU's GEMM tier (7-bit
    // weights on AVX2); this test is about the files, so it accepts any.
    let out = std::process::Command::new("sh")
        .current_dir(dir)
        .arg("-c")
        .arg(r#"umask 027 && exec "$0" quantize --min-agreement 0 -o out"#)
        .arg(env!("CARGO_BIN_EXE_qforge"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mode = |path: &std::path::Path| {
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(path).unwrap().permissions())
            & 0o777
    };
    assert_eq!(mode(&dir.join("out")), 0o750);
    // model.safetensors was 0600 whatever the umask (safetensors writes a
    // 0600 temporary and renames it); the rest was 0640 here.
    for entry in std::fs::read_dir(dir.join("out")).unwrap() {
        let path = entry.unwrap().path();
        assert_eq!(mode(&path), 0o640, "{}", path.display());
    }
}

/// `qforge requantize` at a weight sync: the artifact's own source weights
/// requantize to the same int8 values in a verified artifact that runs;
/// weights of another architecture, or a bad threshold, are refused.
#[test]
fn requantize_writes_an_artifact_like_the_given_one() {
    let dir = temp("requantize");
    let dir = dir.path();
    json(&qforge_in(dir, &["quantize", "--json"]));
    let cartpole = path("fixtures/policies/cartpole");
    let result = json(&qforge_in(
        dir,
        &[
            "requantize",
            "--model",
            &cartpole,
            "--like",
            "qforge-out",
            "-o",
            "synced",
            "--json",
        ],
    ));
    assert_eq!(result["changed_weights"], 0, "{result}");
    assert!(result["int8_weights"].as_u64().unwrap() > 1000, "{result}");
    assert_eq!(result["drift"], serde_json::json!([]));
    assert_eq!(
        std::fs::read_to_string(dir.join("synced/qforge.json")).unwrap(),
        std::fs::read_to_string(dir.join("qforge-out/qforge.json")).unwrap()
    );
    json(&qforge_in(dir, &["verify", "synced", "--json"]));
    let eval = json(&qforge_in(
        dir,
        &[
            "eval",
            "agreement",
            "--model",
            "synced",
            "--reference",
            &cartpole,
            "--observations",
            &path("fixtures/policies/cartpole/rollouts.jsonl"),
            "--json",
        ],
    ));
    assert!(eval["agreement"].as_f64().unwrap() >= 0.99, "{eval}");

    let other = qforge_in(
        dir,
        &[
            "requantize",
            "--model",
            &path("fixtures/policies/pendulum"),
            "--like",
            "qforge-out",
            "-o",
            "bad",
        ],
    );
    assert_eq!(other.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&other.stderr);
    assert!(stderr.contains("is not the architecture of"), "{stderr}");
    assert!(!dir.join("bad").exists());
    let threshold = qforge_in(
        dir,
        &[
            "requantize",
            "--model",
            &cartpole,
            "--like",
            "qforge-out",
            "-o",
            "bad",
            "--drift-threshold=-1",
        ],
    );
    assert_eq!(threshold.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&threshold.stderr).contains("--drift-threshold must be"));
}

/// Asks the quantized artifact `dir/out` the question that the original
/// model answers right, with the prompt in the chat template it was trained
/// on, and checks that quantization kept the answer.
fn answers_paris(dir: &std::path::Path) {
    let generated = json(&qforge_in(
        dir,
        &[
            "generate",
            "--model",
            "out",
            "--prompt",
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
            "--max-tokens",
            "8",
            "--json",
        ],
    ));
    assert!(
        generated["text"].as_str().unwrap().contains("Paris"),
        "{generated}"
    );
}

/// Checks that `eval perplexity` on the artifact `dir/out` gives, to the bit,
/// the perplexity the guard reported in `result` for the same text and
/// `--ctx`: the artifact runs as the guard measured it.
fn reproduces_the_guard_perplexity(dir: &std::path::Path, text: &str, result: &Value) {
    reproduces_the_guard_perplexity_of(dir, "out", text, result);
}

/// As [`reproduces_the_guard_perplexity`], for the model `dir/model` (the
/// artifact or an export of it).
fn reproduces_the_guard_perplexity_of(
    dir: &std::path::Path,
    model: &str,
    text: &str,
    result: &Value,
) {
    let ppl = json(&qforge_in(
        dir,
        &[
            "eval",
            "perplexity",
            "--model",
            model,
            "--text",
            text,
            "--ctx",
            "128",
            "--json",
        ],
    ));
    assert_eq!(
        ppl["perplexity"].as_f64().unwrap(),
        result["after"]["perplexity"].as_f64().unwrap()
    );
}
