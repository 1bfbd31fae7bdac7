//! The `qforge` binary end to end: files in, files and JSON out, exit codes.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn qforge(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_qforge"))
        .args(args)
        .output()
        .expect("run qforge")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn json(out: &Output) -> Value {
    assert!(out.status.success(), "qforge failed: {}", stderr(out));
    serde_json::from_slice(&out.stdout).expect("valid JSON on stdout")
}

struct Dir(PathBuf);

impl Dir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("qforge-cli-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Dir(dir)
    }

    fn path(&self, file: &str) -> String {
        self.0.join(file).to_string_lossy().into_owned()
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn write_f32(path: &str, values: &[f32]) {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(path, bytes).unwrap();
}

/// A minimal version-1 .npy writer (C order, little-endian float32).
fn write_npy(path: &str, shape: &[usize], values: &[f32]) {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape = if dims.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend(values.iter().flat_map(|v| v.to_le_bytes()));
    std::fs::write(path, bytes).unwrap();
}

fn observe(input: &str, output: &str) -> Output {
    qforge(&["stats", "observe", "--input", input, "-o", output])
}

#[test]
fn observe_then_show_reports_exact_counts_and_every_threshold() {
    let dir = Dir::new("show");
    let values = [
        1.5f32,
        -4.0,
        0.0,
        -0.0,
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        2.25,
    ];
    write_f32(&dir.path("v.f32"), &values);
    assert!(
        observe(&dir.path("v.f32"), &dir.path("v.qstats"))
            .status
            .success()
    );
    let shown = json(&qforge(&["stats", "show", &dir.path("v.qstats"), "--json"]));
    let t = &shown["tensors"]["values"];
    assert_eq!(t["count"], 5);
    assert_eq!(t["nan"], 1);
    assert_eq!(t["pos_inf"], 1);
    assert_eq!(t["neg_inf"], 1);
    assert_eq!(t["min"], -4.0);
    assert_eq!(t["max"], 2.25);
    for name in ["minmax", "percentile", "entropy", "mse", "sigma"] {
        let threshold = t["thresholds"][name].as_f64().unwrap();
        assert!(threshold > 0.0 && threshold <= 4.0, "{name}: {threshold}");
    }
    assert_eq!(t["thresholds"]["minmax"], 4.0);
    assert_eq!(t["ranges"]["minmax"], serde_json::json!([-4.0, 2.25]));
    assert_eq!(
        shown["provenance"]["passes"],
        serde_json::json!(["observe"])
    );
    assert_eq!(shown["provenance"]["batches"].as_array().unwrap().len(), 1);
}

#[test]
fn same_values_give_the_same_bytes_from_raw_and_npy() {
    let dir = Dir::new("npy");
    let values: Vec<f32> = (0..600).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
    write_f32(&dir.path("a.f32"), &values);
    write_npy(&dir.path("a.npy"), &[100, 6], &values);
    assert!(
        observe(&dir.path("a.f32"), &dir.path("raw.qstats"))
            .status
            .success()
    );
    assert!(
        observe(&dir.path("a.npy"), &dir.path("npy.qstats"))
            .status
            .success()
    );
    let raw = std::fs::read(dir.path("raw.qstats")).unwrap();
    let npy = std::fs::read(dir.path("npy.qstats")).unwrap();
    assert_eq!(raw, npy);

    // Per-channel abs-max follows the last axis.
    let out = qforge(&[
        "stats",
        "observe",
        "--input",
        &dir.path("a.npy"),
        "--channels",
        "6",
        "--name",
        "layer",
        "-o",
        &dir.path("c.qstats"),
        "--json",
    ]);
    let shown = json(&out);
    let channels = shown["tensors"]["layer"]["channel_abs_max"]
        .as_array()
        .unwrap();
    assert_eq!(channels.len(), 6);
    for (c, got) in channels.iter().enumerate() {
        let expected = values
            .iter()
            .skip(c)
            .step_by(6)
            .fold(0.0f32, |m, v| m.max(v.abs()));
        assert_eq!(got.as_f64().unwrap() as f32, expected, "channel {c}");
    }
}

#[test]
fn merge_refuses_duplicates_and_foreign_data_unless_forced() {
    let dir = Dir::new("merge");
    write_f32(&dir.path("a.f32"), &[1.0, 2.0, 3.0]);
    write_f32(&dir.path("b.f32"), &[-1.0, 5.0]);
    assert!(
        observe(&dir.path("a.f32"), &dir.path("a.qstats"))
            .status
            .success()
    );
    assert!(
        observe(&dir.path("b.f32"), &dir.path("b.qstats"))
            .status
            .success()
    );

    let twice = qforge(&[
        "stats",
        "merge",
        &dir.path("a.qstats"),
        &dir.path("a.qstats"),
        "-o",
        &dir.path("x"),
    ]);
    assert_eq!(twice.status.code(), Some(1));
    assert!(
        stderr(&twice).contains("present in both"),
        "{}",
        stderr(&twice)
    );

    let foreign = qforge(&[
        "stats",
        "merge",
        &dir.path("a.qstats"),
        &dir.path("b.qstats"),
        "-o",
        &dir.path("x"),
    ]);
    assert_eq!(foreign.status.code(), Some(1));
    assert!(stderr(&foreign).contains("--force"), "{}", stderr(&foreign));
    assert!(
        !Path::new(&dir.path("x")).exists(),
        "no output after a refused merge"
    );

    let forced = json(&qforge(&[
        "stats",
        "merge",
        &dir.path("a.qstats"),
        &dir.path("b.qstats"),
        "-o",
        &dir.path("ab"),
        "--force",
        "--json",
    ]));
    assert_eq!(forced["provenance"]["forced"], true);
    assert_eq!(forced["tensors"]["values"]["count"], 5);
    assert_eq!(forced["tensors"]["values"]["min"], -1.0);
    assert_eq!(forced["tensors"]["values"]["max"], 5.0);
    let reversed = qforge(&[
        "stats",
        "merge",
        &dir.path("b.qstats"),
        &dir.path("a.qstats"),
        "-o",
        &dir.path("ba"),
        "--force",
    ]);
    assert!(reversed.status.success());
    assert_eq!(
        std::fs::read(dir.path("ab")).unwrap(),
        std::fs::read(dir.path("ba")).unwrap()
    );
}

#[test]
fn damaged_files_fail_with_a_message_naming_the_problem() {
    let dir = Dir::new("damaged");
    write_f32(&dir.path("a.f32"), &[1.0, 2.0, 3.0, 4.0]);
    assert!(
        observe(&dir.path("a.f32"), &dir.path("a.qstats"))
            .status
            .success()
    );
    let good = std::fs::read(dir.path("a.qstats")).unwrap();

    let mut flipped = good.clone();
    flipped[30] ^= 1;
    let mut version = good.clone();
    version[8] = 7;
    let cases: [(&str, Vec<u8>, &str); 4] = [
        ("truncated", good[..good.len() - 3].to_vec(), "truncated"),
        ("flipped", flipped, "checksum"),
        ("version", version, "version 7"),
        ("foreign", b"{\"not\": \"stats\"}".to_vec(), "not a .qstats"),
    ];
    for (name, bytes, message) in cases {
        let path = dir.path(name);
        std::fs::write(&path, bytes).unwrap();
        let out = qforge(&["stats", "show", &path]);
        assert_eq!(out.status.code(), Some(1), "{name}");
        assert!(stderr(&out).contains(message), "{name}: {}", stderr(&out));
        assert!(stderr(&out).contains(&path), "{name}: names the file");
    }

    write_f32(&dir.path("odd.f32"), &[1.0]);
    std::fs::write(dir.path("odd.f32"), [0u8; 5]).unwrap();
    let out = observe(&dir.path("odd.f32"), &dir.path("odd.qstats"));
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("multiple of 4"), "{}", stderr(&out));

    let mut npy = b"\x93NUMPY\x01\x00".to_vec();
    let header = "{'descr': '<f4', 'fortran_order': False, 'shape': (1000,), }\n";
    npy.extend_from_slice(&(header.len() as u16).to_le_bytes());
    npy.extend_from_slice(header.as_bytes());
    npy.extend_from_slice(&[0u8; 40]);
    std::fs::write(dir.path("short.npy"), npy).unwrap();
    let out = observe(&dir.path("short.npy"), &dir.path("short.qstats"));
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("truncated"), "{}", stderr(&out));
}

#[test]
fn usage_errors_exit_with_two() {
    let dir = Dir::new("usage");
    write_f32(&dir.path("a.f32"), &[1.0; 4]);
    for args in [
        vec!["stats", "observe", "-o", "x"],
        vec!["stats", "merge", "only-one", "-o", "x"],
        vec!["stats", "frobnicate"],
        vec![
            "stats",
            "observe",
            "--input",
            &dir.path("a.f32"),
            "--channels",
            "0",
            "-o",
            "x",
        ],
        vec!["stats", "show", "whatever", "--percentile", "150"],
    ] {
        let out = qforge(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
    }
    let help = qforge(&["stats", "observe", "--help"]);
    assert!(help.status.success());
    assert!(String::from_utf8_lossy(&help.stdout).contains("--channels"));
}

#[test]
fn demo_proves_sharded_statistics_are_identical() {
    let dir = Dir::new("demo");
    let out = json(&qforge(&[
        "demo",
        "--values",
        "200000",
        "--batches",
        "16",
        "--workers",
        "3",
        "-o",
        &dir.0.to_string_lossy(),
        "--json",
    ]));
    assert_eq!(out["demo"]["identical"], true);
    assert_eq!(out["tensors"].as_object().unwrap().len(), 5);
    assert_eq!(out["provenance"]["batches"].as_array().unwrap().len(), 16);
    assert!(Path::new(&dir.path("demo.qstats")).exists());
}
