//! `Calibration::run`, the pass `qforge calibrate` and Python's
//! `qforge.calibrate` run: the statistics file it writes is the same for any
//! thread count, the listener hears the session's warnings and the pass's
//! events, and a bad request is refused before anything is loaded.

use std::path::PathBuf;

use qforge_calib::Recipe;
use qforge_runner::{Calibration, EmbeddedExecutor, Error, Listener, PassEvent, PassPosition};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/policies/pendulum")
}

/// Everything a calibration said.
#[derive(Default)]
struct Heard {
    messages: Vec<String>,
    opened: usize,
    last_merged: usize,
}

impl Listener for Heard {
    fn message(&mut self, line: &str) {
        self.messages.push(line.to_owned());
    }

    fn pass_event(&mut self, pass: PassPosition, event: &PassEvent) {
        assert_eq!(pass, PassPosition::ONLY);
        match event {
            PassEvent::Opened { .. } => self.opened += 1,
            PassEvent::Progress(p) => self.last_merged = p.merged,
        }
    }
}

fn pendulum(samples: usize) -> Calibration {
    let recipe = Recipe {
        samples,
        batch_size: 32,
        ..Recipe::default()
    };
    Calibration::new(fixture(), fixture().join("rollouts.jsonl"), recipe)
}

#[test]
fn one_thread_and_three_write_the_same_statistics() {
    let dir = tempfile::tempdir().unwrap();
    let calibration = pendulum(600);
    let mut bytes = Vec::new();
    for threads in [1, 3] {
        let output = dir.path().join(format!("{threads}.qstats"));
        let mut heard = Heard::default();
        let done = calibration
            .run(&EmbeddedExecutor { threads }, &output, &mut heard)
            .unwrap();
        let report = serde_json::to_value(done.report()).unwrap();
        assert_eq!(report["planned_batches"], 19);
        assert_eq!(report["merged_batches"], 19);
        assert_eq!(report["backend"], "embedded");
        assert_eq!(done.workers, threads);
        assert_eq!(done.run, done.session.run_name());
        assert_eq!((heard.opened, heard.last_merged), (1, 19));
        assert!(heard.messages.is_empty(), "{:?}", heard.messages);
        bytes.push(std::fs::read(&output).unwrap());
    }
    assert_eq!(bytes[0], bytes[1]);
}

#[test]
fn the_listener_hears_skipped_lines_and_too_few_samples() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("rollouts.jsonl");
    let mut text = std::fs::read_to_string(fixture().join("rollouts.jsonl")).unwrap();
    let bad_line = text.lines().count() + 1;
    text.push_str("{\"observations\": [[1.0]]\n");
    std::fs::write(&data, text).unwrap();
    let calibration = Calibration {
        data: data.clone(),
        skip_invalid: true,
        ..pendulum(1_000_000)
    };
    let mut heard = Heard::default();
    calibration
        .run(
            &EmbeddedExecutor { threads: 2 },
            &dir.path().join("out.qstats"),
            &mut heard,
        )
        .unwrap();
    let skipped = format!("warning: {}:{bad_line}: skipped: ", data.display());
    assert!(
        heard.messages.iter().any(|m| m.starts_with(&skipped)),
        "{:?}",
        heard.messages
    );
    assert!(
        (heard.messages.iter()).any(|m| m.contains("fewer than the 1000000 asked for")),
        "{:?}",
        heard.messages
    );
}

#[test]
fn a_bad_request_is_refused_before_loading_and_names_the_setting() {
    let dir = tempfile::tempdir().unwrap();
    let output = dir.path().join("out.qstats");
    let missing = Calibration::new(
        dir.path().join("no-such-model"),
        dir.path().join("no-such-data.jsonl"),
        Recipe::default(),
    );
    let cases = [
        (
            Calibration {
                min_coverage: 1.5,
                ..missing.clone()
            },
            "min_coverage",
        ),
        (
            Calibration {
                checkpoint_every: 0,
                ..missing.clone()
            },
            "checkpoint_every",
        ),
        (
            Calibration {
                resume: true,
                run: Some("r".into()),
                ..missing.clone()
            },
            "checkpoint directory",
        ),
        (
            Calibration {
                recipe: Recipe {
                    batch_size: 0,
                    ..Recipe::default()
                },
                ..missing
            },
            "batch",
        ),
    ];
    for (calibration, named) in cases {
        let Err(error) = calibration.run(&EmbeddedExecutor { threads: 1 }, &output, &mut ()) else {
            panic!("{named}: accepted");
        };
        assert!(matches!(error, Error::Request(_)), "{error:?}");
        assert!(error.to_string().contains(named), "{error}");
    }
    assert!(!output.exists());
}
