//! `qforge rollouts` on SmolLM2: every reward is recomputed here from the
//! prompt's arithmetic, the rewards cover both 0 and 1, and `qforge
//! calibrate --stratify reward` on the episodes draws from both ends.

mod support;

use support::{json, path, qforge, root};

fn temp(name: &str) -> tempfile::TempDir {
    support::temp("rollouts", name)
}

fn smollm2() -> String {
    let model = root().join("models/smollm2-135m-instruct-q4_1.gguf");
    assert!(
        model.exists(),
        "{} missing: run scripts/fetch-models.sh",
        model.display()
    );
    model.to_string_lossy().into_owned()
}

/// The result of "What is A op B? …", computed from the prompt's text.
fn result_of(prompt: &str) -> i64 {
    let question = prompt
        .strip_prefix("What is ")
        .and_then(|rest| rest.split('?').next())
        .unwrap_or_else(|| panic!("unexpected prompt {prompt:?}"));
    let parts: Vec<&str> = question.split(' ').collect();
    let [a, op, b] = parts[..] else {
        panic!("unexpected question {question:?}")
    };
    let (a, b): (i64, i64) = (a.parse().unwrap(), b.parse().unwrap());
    match op {
        "+" => a + b,
        "-" => a - b,
        "*" => a * b,
        _ => panic!("unexpected operator {op:?}"),
    }
}

/// The reward the command promises: 1 when the completion's last integer
/// (signed when its minus stands alone before the digits) is the result;
/// a completion cut off inside a number has no answer. Written apart from
/// the command's own parser (tokens of a character split, not a byte scan).
fn expected_reward(completion: &str, finish: &str, result: i64) -> f64 {
    if finish == "length" && completion.ends_with(|c: char| c.is_ascii_digit()) {
        return 0.0;
    }
    let mut last = None;
    let chars: Vec<char> = completion.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        if chars[i].is_ascii_digit() {
            let start = i;
            while i < chars.len() && chars[i].is_ascii_digit() {
                i += 1;
            }
            let digits: String = chars[start..i].iter().collect();
            let signed = start >= 1
                && chars[start - 1] == '-'
                && (start == 1 || !chars[start - 2].is_ascii_alphanumeric());
            last = digits
                .parse::<i64>()
                .ok()
                .map(|v| if signed { -v } else { v });
        } else {
            i += 1;
        }
    }
    if last == Some(result) { 1.0 } else { 0.0 }
}

#[test]
fn rewards_are_exact_and_stratified_calibration_draws_both_ends() {
    let model = smollm2();
    let dir = temp("smollm2");
    let dir = dir.path();
    let episodes = dir.join("episodes.jsonl");
    let rollouts = |out: &std::path::Path, count: &str| {
        json(&qforge(&[
            "rollouts",
            "--model",
            &model,
            "--task",
            "arithmetic",
            "--episodes",
            count,
            "--seed",
            "1",
            "--max-tokens",
            "12",
            "-o",
            out.to_str().unwrap(),
            "--json",
        ]))
    };
    let summary = rollouts(&episodes, "16");
    let text = std::fs::read_to_string(&episodes).unwrap();
    let records: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(records.len(), 16);
    let mut counts = [0u64; 2];
    let mut ids = std::collections::BTreeSet::new();
    for record in &records {
        let prompt = record["prompt"].as_str().unwrap();
        let completion = record["completion"].as_str().unwrap();
        let finish = record["finish"].as_str().unwrap();
        let reward = record["reward"].as_f64().unwrap();
        assert_eq!(
            reward,
            expected_reward(completion, finish, result_of(prompt)),
            "{record}"
        );
        counts[reward as usize] += 1;
        assert!(ids.insert(record["episode_id"].as_str().unwrap().to_owned()));
    }
    assert!(
        counts[0] >= 2 && counts[1] >= 2,
        "both rewards should occur at least twice: {counts:?}\n{text}"
    );
    assert_eq!(summary["reward_counts"]["0"], counts[0]);
    assert_eq!(summary["reward_counts"]["1"], counts[1]);
    assert_eq!(summary["mean_reward"], counts[1] as f64 / 16.0);

    // Seeded: a shorter run with the same seed is the same episodes' prefix.
    let short = dir.join("short.jsonl");
    rollouts(&short, "3");
    let prefix: Vec<&str> = text.lines().take(3).collect();
    assert_eq!(
        std::fs::read_to_string(&short)
            .unwrap()
            .lines()
            .collect::<Vec<_>>(),
        prefix
    );

    // Eight samples from the 16 episodes, stratified by reward: eight strata
    // of two episodes each, one drawn from each, lowest rewards first; with
    // at least two episodes of each reward the end strata hold only one.
    let calibrated = json(&qforge(&[
        "calibrate",
        "--model",
        &model,
        "--data",
        episodes.to_str().unwrap(),
        "--samples",
        "8",
        "--seq-len",
        "48",
        "--batch-size",
        "2",
        "--stratify",
        "reward",
        "-o",
        dir.join("episodes.qstats").to_str().unwrap(),
        "--json",
    ]));
    assert_eq!(calibrated["coverage"], 1.0);
    let strata = calibrated["reward_strata"].as_array().unwrap();
    assert_eq!(strata.len(), 8, "{strata:?}");
    assert!(strata.iter().all(|s| s["drawn"] == 1), "{strata:?}");
    let (lowest, highest) = (&strata[0], &strata[7]);
    assert_eq!(
        lowest["max_reward"], 0.0,
        "the lowest stratum holds reward 0"
    );
    assert_eq!(
        highest["min_reward"], 1.0,
        "the highest stratum holds reward 1"
    );
    let available: u64 = strata
        .iter()
        .map(|s| s["available"].as_u64().unwrap())
        .sum();
    assert_eq!(available, 16);
}

#[test]
fn bad_input_is_refused_before_any_generation() {
    let model = smollm2();
    let dir = temp("bad");
    let dir = dir.path();
    let out = dir.join("out.jsonl");
    let out = out.to_str().unwrap();
    let run = |model: &str, episodes: &str, extra: &[&str], output: &str| {
        let mut args = vec![
            "rollouts",
            "--model",
            model,
            "--task",
            "arithmetic",
            "--episodes",
            episodes,
            "-o",
            output,
        ];
        args.extend_from_slice(extra);
        qforge(&args)
    };
    let stderr = |o: &std::process::Output| String::from_utf8_lossy(&o.stderr).into_owned();

    let unknown = qforge(&[
        "rollouts",
        "--model",
        &model,
        "--task",
        "poetry",
        "--episodes",
        "2",
        "-o",
        out,
    ]);
    assert_eq!(unknown.status.code(), Some(2), "{}", stderr(&unknown));
    assert!(
        stderr(&unknown).contains("arithmetic"),
        "{}",
        stderr(&unknown)
    );

    let none = run(&model, "0", &[], out);
    assert_eq!(none.status.code(), Some(2));
    assert!(stderr(&none).contains("episodes"), "{}", stderr(&none));

    let cold = run(&model, "2", &["--temperature=-1"], out);
    assert_eq!(cold.status.code(), Some(2));
    assert!(stderr(&cold).contains("temperature"), "{}", stderr(&cold));

    let policy = run(&path("fixtures/policies/cartpole"), "2", &[], out);
    assert_eq!(policy.status.code(), Some(2));
    assert!(
        stderr(&policy).contains("is a policy"),
        "{}",
        stderr(&policy)
    );

    let directory = run(&model, "2", &[], dir.to_str().unwrap());
    assert_eq!(directory.status.code(), Some(2));
    assert!(
        stderr(&directory).contains("is a directory"),
        "{}",
        stderr(&directory)
    );

    // Under a regular file no directory can be made, even for root.
    let file = dir.join("file");
    std::fs::write(&file, b"").unwrap();
    let unwritable = run(&model, "2", &[], file.join("out.jsonl").to_str().unwrap());
    assert_eq!(unwritable.status.code(), Some(1));
    assert!(
        stderr(&unwritable).contains("cannot create directory"),
        "{}",
        stderr(&unwritable)
    );

    assert!(!std::path::Path::new(out).exists());
}
