//! ONNX policy import: every fixture in `fixtures/onnx` (written by
//! `tests/python/make_onnx_fixtures.py`) imports and reproduces ONNX
//! Runtime's outputs, the trained ones equal the safetensors policies they
//! came from, and malformed or unsupported graphs are refused with errors
//! that name the problem.

use std::path::{Path, PathBuf};

use prost::Message;
use qforge_formats::onnx::proto::{
    self, AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TensorProto,
    TensorShapeProto, TypeProto, ValueInfoProto,
};
use qforge_formats::policy::{Action, Activation, Head};
use qforge_model::onnx::{import_mlp, import_mlp_bytes};
use qforge_model::{Error, MlpPolicy};

/// Our outputs and ORT's agree within `TOLERANCE * max(1, |ort|)`: absolute
/// for outputs up to 1, relative above. Candle and ORT (MLAS) sum the same
/// products in different orders, and f32 rounding grows with the size of
/// what is summed: the trained CartPole logits reach 4.9.
const TOLERANCE: f32 = 1e-5;

fn onnx_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/onnx")
}

fn policy_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/policies")
        .join(name)
}

/// One fixture: model, head, inputs and ORT's outputs.
struct Fixture {
    name: String,
    model: PathBuf,
    env: Option<String>,
    head: Head,
    softmax: bool,
    inputs: Vec<f32>,
    outputs: Vec<f32>,
    source: Option<String>,
}

fn floats(rows: &serde_json::Value) -> Vec<f32> {
    rows.as_array()
        .unwrap()
        .iter()
        .flat_map(|row| row.as_array().unwrap().iter())
        .map(|v| v.as_f64().unwrap() as f32)
        .collect()
}

fn fixtures() -> Vec<Fixture> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(onnx_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    paths.sort();
    paths
        .into_iter()
        .map(|path| {
            let meta: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            Fixture {
                name: path.file_stem().unwrap().to_string_lossy().into_owned(),
                model: onnx_dir().join(meta["model"].as_str().unwrap()),
                env: meta["env"].as_str().map(str::to_owned),
                head: serde_json::from_value(meta["head"].clone()).unwrap(),
                softmax: meta["output_kind"] == "softmax",
                inputs: floats(&meta["inputs"]),
                outputs: floats(&meta["outputs"]),
                source: meta["source"].as_str().map(str::to_owned),
            }
        })
        .collect()
}

fn softmax_rows(logits: &[f32], width: usize) -> Vec<f32> {
    logits
        .chunks_exact(width)
        .flat_map(|row| {
            let max = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
            let exp: Vec<f64> = row.iter().map(|&v| (v as f64 - max).exp()).collect();
            let sum: f64 = exp.iter().sum();
            exp.into_iter().map(move |e| (e / sum) as f32)
        })
        .collect()
}

#[test]
fn every_fixture_matches_onnx_runtime() {
    let fixtures = fixtures();
    assert!(fixtures.len() >= 6, "found {} fixtures", fixtures.len());
    for f in &fixtures {
        let policy = import_mlp(&f.model, f.head.clone(), f.env.clone())
            .unwrap_or_else(|e| panic!("{}: {e}", f.name));
        let config = policy.config();
        assert_eq!(config.env, f.env, "{}", f.name);
        assert_eq!(config.head, f.head, "{}", f.name);
        let expected = if f.name.starts_with("relu") {
            Activation::Relu
        } else {
            Activation::Tanh
        };
        assert_eq!(config.activation, expected, "{}", f.name);
        let width = f.head.outputs();
        assert_eq!(f.inputs.len(), 64 * config.observation_dim, "{}", f.name);
        assert_eq!(f.outputs.len(), 64 * width, "{}", f.name);

        let raw = policy.forward(&f.inputs, None).unwrap();
        // A final Softmax is dropped on import: compare probabilities.
        let ours = if f.softmax {
            softmax_rows(&raw, width)
        } else {
            raw.clone()
        };
        let mut max_diff = 0.0f32;
        for (i, (a, b)) in ours.iter().zip(&f.outputs).enumerate() {
            let diff = (a - b).abs();
            max_diff = max_diff.max(diff);
            assert!(
                diff <= TOLERANCE * b.abs().max(1.0),
                "{} output {i}: ours {a} vs ORT {b}",
                f.name
            );
        }
        eprintln!("{}: max |ours - ORT| = {max_diff:.3e}", f.name);

        // Discrete actions agree with ORT's argmax (softmax or not).
        if let Head::Discrete { .. } = f.head {
            let ort_actions = policy.actions_from_outputs(&f.outputs);
            assert_eq!(policy.actions_from_outputs(&raw), ort_actions, "{}", f.name);
        }
    }
}

#[test]
fn trained_fixtures_import_to_their_safetensors_policies() {
    let mut checked = 0;
    for f in fixtures() {
        let Some(source) = &f.source else { continue };
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(source);
        let reference = MlpPolicy::from_dir(&dir).unwrap();
        let imported = import_mlp(&f.model, f.head.clone(), f.env.clone()).unwrap();
        // Same config, and the same weights: our forward is bit-identical.
        assert_eq!(imported.config(), reference.config(), "{}", f.name);
        assert_eq!(
            imported.forward(&f.inputs, None).unwrap(),
            reference.forward(&f.inputs, None).unwrap(),
            "{}",
            f.name
        );
        assert_eq!(
            imported.act(&f.inputs).unwrap(),
            reference.act(&f.inputs).unwrap(),
            "{}",
            f.name
        );
        checked += 1;
    }
    assert_eq!(checked, 4);

    // The brief's named case, spelled out.
    let reference = MlpPolicy::from_dir(&policy_dir("cartpole")).unwrap();
    let f = fixtures()
        .into_iter()
        .find(|f| f.name == "cartpole_torch")
        .unwrap();
    let imported = import_mlp(&f.model, f.head.clone(), f.env.clone()).unwrap();
    let actions = imported.act(&f.inputs).unwrap();
    assert_eq!(actions.len(), 64);
    assert!(actions.iter().all(|a| matches!(a, Action::Discrete(0 | 1))));
    assert_eq!(actions, reference.act(&f.inputs).unwrap());
}

fn discrete(actions: usize) -> Head {
    Head::Discrete { actions }
}

fn gaussian() -> Head {
    Head::Gaussian {
        action_dim: 2,
        low: vec![-1.0; 2],
        high: vec![1.0; 2],
        log_std: None,
    }
}

fn temp_file(name: &str, bytes: &[u8]) -> PathBuf {
    let path = std::env::temp_dir().join(format!("qforge-onnx-{}-{name}", std::process::id()));
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn truncated_file_is_refused_with_its_path() {
    let bytes = std::fs::read(onnx_dir().join("cartpole_torch.onnx")).unwrap();
    let path = temp_file("truncated.onnx", &bytes[..bytes.len() / 2]);
    let err = import_mlp(&path, discrete(2), None).unwrap_err();
    std::fs::remove_file(&path).unwrap();
    let message = err.to_string();
    assert!(
        matches!(&err, Error::Formats(qforge_formats::Error::InFile { source, .. }) if matches!(**source, qforge_formats::Error::Format(_))),
        "{err:?}"
    );
    assert!(message.contains("truncated.onnx"), "{message}");
    assert!(message.contains("protobuf decoding failed"), "{message}");

    let missing = onnx_dir().join("no-such-model.onnx");
    assert!(matches!(
        import_mlp(&missing, discrete(2), None),
        Err(Error::Formats(qforge_formats::Error::Io { .. }))
    ));
}

#[test]
fn every_strict_prefix_of_a_fixture_is_refused() {
    let pendulum = Head::Gaussian {
        action_dim: 1,
        low: vec![-2.0],
        high: vec![2.0],
        log_std: None,
    };
    for (name, head) in [
        ("cartpole_torch.onnx", discrete(2)),
        ("pendulum_sb3.onnx", pendulum),
    ] {
        let bytes = std::fs::read(onnx_dir().join(name)).unwrap();
        import_mlp_bytes(&bytes, head.clone(), None).unwrap();
        for len in 0..bytes.len() {
            assert!(
                import_mlp_bytes(&bytes[..len], head.clone(), None).is_err(),
                "{name}: prefix of {len} bytes imported"
            );
        }
    }
}

/// A small deterministic generator (xorshift64*), so the test needs no
/// random-number crate.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[test]
fn random_and_corrupted_bytes_never_panic() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for _ in 0..2000 {
        let len = rng.below(4096);
        let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        let err = import_mlp_bytes(&bytes, discrete(2), None).unwrap_err();
        assert!(
            matches!(err, Error::Formats(qforge_formats::Error::Format(_))),
            "{len} random bytes: {err}"
        );
    }
    // Corrupting a valid file may or may not leave it importable; it must
    // never panic, and an import that succeeds must still run.
    let valid = std::fs::read(onnx_dir().join("relu_cartpole_mixed.onnx")).unwrap();
    let mut imported = 0;
    for _ in 0..3000 {
        let mut bytes = valid.clone();
        for _ in 0..1 + rng.below(4) {
            let at = rng.below(bytes.len());
            bytes[at] = rng.next() as u8;
        }
        if let Ok(policy) = import_mlp_bytes(&bytes, discrete(2), None) {
            let dim = policy.config().observation_dim;
            policy.forward(&vec![0.5; dim], None).unwrap();
            imported += 1;
        }
    }
    eprintln!("{imported} of 3000 corrupted files still imported");
}

// --- Graphs built in the test from our generated types ---------------------

fn tensor(name: &str, dims: &[i64], data: &[f32]) -> TensorProto {
    TensorProto {
        name: name.into(),
        dims: dims.to_vec(),
        data_type: proto::tensor_proto::DataType::Float as i32,
        raw_data: data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ..Default::default()
    }
}

fn int_attr(name: &str, i: i64) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        i,
        r#type: proto::attribute_proto::AttributeType::Int as i32,
        ..Default::default()
    }
}

fn node(op: &str, name: &str, inputs: &[&str], output: &str) -> NodeProto {
    NodeProto {
        op_type: op.into(),
        name: name.into(),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: vec![output.into()],
        ..Default::default()
    }
}

fn gemm(name: &str, x: &str, w: &str, b: &str, y: &str) -> NodeProto {
    NodeProto {
        attribute: vec![int_attr("transB", 1)],
        ..node("Gemm", name, &[x, w, b], y)
    }
}

fn value(name: &str, width: i64) -> ValueInfoProto {
    use proto::tensor_shape_proto::{Dimension, dimension};
    let dim = |v| Dimension {
        value: Some(v),
        ..Default::default()
    };
    ValueInfoProto {
        name: name.into(),
        r#type: Some(TypeProto {
            value: Some(proto::type_proto::Value::TensorType(
                proto::type_proto::Tensor {
                    elem_type: proto::tensor_proto::DataType::Float as i32,
                    shape: Some(TensorShapeProto {
                        dim: vec![
                            dim(dimension::Value::DimParam("batch".into())),
                            dim(dimension::Value::DimValue(width)),
                        ],
                    }),
                },
            )),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn model(nodes: Vec<NodeProto>, initializers: Vec<TensorProto>, output: &str) -> Vec<u8> {
    ModelProto {
        ir_version: 8,
        producer_name: "qforge-test".into(),
        opset_import: vec![OperatorSetIdProto {
            domain: String::new(),
            version: 17,
        }],
        graph: Some(GraphProto {
            name: "test".into(),
            node: nodes,
            initializer: initializers,
            input: vec![value("x", 3)],
            output: vec![value(output, 2)],
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

/// Weights of a 3 → 4 → 2 MLP: `w0` [4, 3], `b0` [4], `w1` [2, 4], `b1` [2].
fn weights() -> Vec<TensorProto> {
    let ramp = |n: usize, scale: f32| -> Vec<f32> {
        (0..n)
            .map(|i| (i as f32 - n as f32 / 2.0) * scale)
            .collect()
    };
    vec![
        tensor("w0", &[4, 3], &ramp(12, 0.1)),
        tensor("b0", &[4], &ramp(4, 0.05)),
        tensor("w1", &[2, 4], &ramp(8, 0.2)),
        tensor("b1", &[2], &ramp(2, 0.3)),
    ]
}

/// Gemm → `act` → Gemm, then `tail` nodes.
fn two_layers(act: &str, tail: Vec<NodeProto>, output: &str) -> Vec<u8> {
    let mut nodes = vec![
        gemm("fc0", "x", "w0", "b0", "h0"),
        node(act, "act0", &["h0"], "a0"),
        gemm("fc1", "a0", "w1", "b1", "y"),
    ];
    nodes.extend(tail);
    model(nodes, weights(), output)
}

fn unsupported(bytes: &[u8], head: Head) -> String {
    match import_mlp_bytes(bytes, head, None) {
        Err(e @ Error::Formats(qforge_formats::Error::Unsupported(_))) => e.to_string(),
        other => panic!("expected an Unsupported error, got {other:?}"),
    }
}

fn error(bytes: &[u8]) -> String {
    import_mlp_bytes(bytes, discrete(2), None)
        .expect_err("expected an error")
        .to_string()
}

#[test]
fn built_graph_computes_what_it_says() {
    let policy = import_mlp_bytes(&two_layers("Relu", vec![], "y"), discrete(2), None).unwrap();
    assert_eq!(policy.config().observation_dim, 3);
    assert_eq!(policy.config().hidden, vec![4]);
    assert_eq!(policy.config().activation, Activation::Relu);
    // By hand: h = relu(W0 x + b0), y = W1 h + b1.
    let ramp = |n: usize, s: f32| -> Vec<f32> {
        (0..n).map(|i| (i as f32 - n as f32 / 2.0) * s).collect()
    };
    let (w0, b0, w1, b1) = (ramp(12, 0.1), ramp(4, 0.05), ramp(8, 0.2), ramp(2, 0.3));
    let x = [0.3f32, -1.2, 2.0];
    let h: Vec<f32> = (0..4)
        .map(|o| (b0[o] + (0..3).map(|i| w0[o * 3 + i] * x[i]).sum::<f32>()).max(0.0))
        .collect();
    let y: Vec<f32> = (0..2)
        .map(|o| b1[o] + (0..4).map(|i| w1[o * 4 + i] * h[i]).sum::<f32>())
        .collect();
    let got = policy.forward(&x, None).unwrap();
    for (g, w) in got.iter().zip(&y) {
        assert!((g - w).abs() <= 1e-6, "{g} vs {w}");
    }
}

#[test]
fn final_softmax_is_dropped_for_discrete_heads_only() {
    let with = two_layers("Tanh", vec![node("Softmax", "probs", &["y"], "p")], "p");
    let without = two_layers("Tanh", vec![], "y");
    let a = import_mlp_bytes(&with, discrete(2), None).unwrap();
    let b = import_mlp_bytes(&without, discrete(2), None).unwrap();
    let x = [0.1f32, 0.2, 0.3, -1.0, 0.5, 2.0];
    assert_eq!(a.forward(&x, None).unwrap(), b.forward(&x, None).unwrap());

    let message = unsupported(&with, gaussian());
    assert!(message.contains("Softmax node `probs`"), "{message}");
    assert!(message.contains("gaussian"), "{message}");
}

#[test]
fn unsupported_op_is_named() {
    let bytes = two_layers("Tanh", vec![node("Conv", "conv_out", &["y"], "z")], "z");
    let message = unsupported(&bytes, discrete(2));
    assert!(message.contains("Conv node `conv_out`"), "{message}");
    assert!(message.contains("qforge imports plain MLPs"), "{message}");
}

#[test]
fn mixed_activations_are_refused() {
    // 3 → 4 → 4 → 2 with Tanh then Relu.
    let mut init = weights();
    init.push(tensor("w_mid", &[4, 4], &[0.1; 16]));
    init.push(tensor("b_mid", &[4], &[0.0; 4]));
    let nodes = vec![
        gemm("fc0", "x", "w0", "b0", "h0"),
        node("Tanh", "tanh0", &["h0"], "a0"),
        gemm("fc_mid", "a0", "w_mid", "b_mid", "h1"),
        node("Relu", "relu1", &["h1"], "a1"),
        gemm("fc1", "a1", "w1", "b1", "y"),
    ];
    let message = unsupported(&model(nodes, init, "y"), discrete(2));
    assert!(message.contains("mixed activations"), "{message}");
    assert!(message.contains("Tanh node `tanh0`"), "{message}");
    assert!(message.contains("Relu node `relu1`"), "{message}");
}

#[test]
fn wrong_weight_shapes_are_refused() {
    // Second layer takes 5 inputs, first produces 4.
    let mut init = weights();
    init[2] = tensor("w1", &[2, 5], &[0.1; 10]);
    let bytes = model(
        vec![
            gemm("fc0", "x", "w0", "b0", "h0"),
            node("Tanh", "act0", &["h0"], "a0"),
            gemm("fc1", "a0", "w1", "b1", "y"),
        ],
        init,
        "y",
    );
    let err = import_mlp_bytes(&bytes, discrete(2), None).unwrap_err();
    assert!(
        matches!(err, Error::Formats(qforge_formats::Error::Shape(_))),
        "{err:?}"
    );
    let message = err.to_string();
    assert!(
        message.contains("Gemm node `fc1` takes 5 inputs")
            && message.contains("Gemm node `fc0`) produces 4"),
        "{message}"
    );

    // A bias of the wrong length.
    let mut init = weights();
    init[1] = tensor("b0", &[3], &[0.0; 3]);
    let bytes = model(
        vec![
            gemm("fc0", "x", "w0", "b0", "h0"),
            node("Tanh", "act0", &["h0"], "a0"),
            gemm("fc1", "a0", "w1", "b1", "y"),
        ],
        init,
        "y",
    );
    let message = error(&bytes);
    assert!(
        message.contains("bias `b0` has dims [3], expected [4]"),
        "{message}"
    );

    // The head wants 3 actions; the graph has 2.
    let message = unsupported_or_shape(&two_layers("Tanh", vec![], "y"), discrete(3));
    assert!(
        message.contains("has 2 outputs but the discrete head needs 3"),
        "{message}"
    );
}

fn unsupported_or_shape(bytes: &[u8], head: Head) -> String {
    import_mlp_bytes(bytes, head, None)
        .expect_err("expected an error")
        .to_string()
}

#[test]
fn declared_dims_are_checked_before_allocating() {
    let mut init = weights();
    init[0] = tensor("w0", &[1 << 40, 1 << 40], &[0.0; 4]);
    let message = error(&model(
        vec![
            gemm("fc0", "x", "w0", "b0", "h0"),
            node("Tanh", "act0", &["h0"], "a0"),
            gemm("fc1", "a0", "w1", "b1", "y"),
        ],
        init,
        "y",
    ));
    assert!(message.contains("weight `w0` declares dims"), "{message}");
    assert!(message.contains("holds 16 bytes of raw data"), "{message}");

    let mut init = weights();
    init[0].dims = vec![-4, 3];
    let message = error(&model(
        vec![
            gemm("fc0", "x", "w0", "b0", "h0"),
            node("Tanh", "act0", &["h0"], "a0"),
            gemm("fc1", "a0", "w1", "b1", "y"),
        ],
        init,
        "y",
    ));
    assert!(message.contains("negative dim"), "{message}");
}

/// The two-layer Tanh graph with its weights changed by `edit`.
fn with_weights(edit: impl FnOnce(&mut Vec<TensorProto>)) -> Vec<u8> {
    let mut init = weights();
    edit(&mut init);
    model(
        vec![
            gemm("fc0", "x", "w0", "b0", "h0"),
            node("Tanh", "act0", &["h0"], "a0"),
            gemm("fc1", "a0", "w1", "b1", "y"),
        ],
        init,
        "y",
    )
}

#[test]
fn non_float_external_and_missing_weights_are_refused() {
    let int8 = with_weights(|init| {
        init[0].data_type = proto::tensor_proto::DataType::Int8 as i32;
        init[0].raw_data = vec![1; 12];
    });
    let message = unsupported(&int8, discrete(2));
    assert!(
        message.contains("weight `w0` has data type INT8"),
        "{message}"
    );

    let external = with_weights(|init| {
        init[0].raw_data.clear();
        init[0].data_location = proto::tensor_proto::DataLocation::External as i32;
        init[0].external_data = vec![proto::StringStringEntryProto {
            key: "location".into(),
            value: "weights.bin".into(),
        }];
    });
    let message = unsupported(&external, discrete(2));
    assert!(message.contains("external file"), "{message}");

    let missing = with_weights(|init| {
        init.remove(2);
    });
    let message = error(&missing);
    assert!(
        message.contains("Gemm node `fc1`: weight `w1`") && message.contains("missing initializer"),
        "{message}"
    );
}

#[test]
fn non_chain_graphs_are_refused() {
    // The input feeds two nodes.
    let bytes = model(
        vec![
            gemm("fc0", "x", "w0", "b0", "h0"),
            node("Tanh", "act0", &["h0"], "a0"),
            gemm("fc1", "a0", "w1", "b1", "y"),
            node("Relu", "side", &["x"], "unused"),
        ],
        weights(),
        "y",
    );
    let message = unsupported(&bytes, discrete(2));
    assert!(
        message.contains("value `x` feeds 2 nodes") && message.contains("branches"),
        "{message}"
    );

    // A Tanh after the last layer (a squashed Gaussian mean).
    let message = unsupported(
        &two_layers("Tanh", vec![node("Tanh", "squash", &["y"], "t")], "t"),
        discrete(2),
    );
    assert!(
        message.contains("Tanh node `squash` follows the last layer"),
        "{message}"
    );

    // A hidden layer without an activation.
    let bytes = model(
        vec![
            gemm("fc0", "x", "w0", "b0", "h0"),
            gemm("fc1", "h0", "w1", "b1", "y"),
        ],
        weights(),
        "y",
    );
    let message = unsupported(&bytes, discrete(2));
    assert!(
        message.contains("hidden layer 0 (Gemm node `fc0`) has no Relu or Tanh"),
        "{message}"
    );

    // Gemm with alpha != 1.
    let mut nodes = vec![
        gemm("fc0", "x", "w0", "b0", "h0"),
        node("Tanh", "act0", &["h0"], "a0"),
        gemm("fc1", "a0", "w1", "b1", "y"),
    ];
    nodes[0].attribute.push(AttributeProto {
        name: "alpha".into(),
        f: 0.5,
        r#type: proto::attribute_proto::AttributeType::Float as i32,
        ..Default::default()
    });
    let message = unsupported(&model(nodes, weights(), "y"), discrete(2));
    assert!(
        message.contains("Gemm node `fc0` has alpha=0.5"),
        "{message}"
    );
}

#[test]
fn a_model_without_opset_or_graph_is_refused() {
    let mut m = ModelProto::decode(two_layers("Tanh", vec![], "y").as_slice()).unwrap();
    m.opset_import.clear();
    assert!(error(&m.encode_to_vec()).contains("no opset"));
    let m = ModelProto {
        opset_import: vec![OperatorSetIdProto {
            domain: String::new(),
            version: 17,
        }],
        ..Default::default()
    };
    assert!(error(&m.encode_to_vec()).contains("no graph"));
}

#[test]
fn a_file_that_is_not_onnx_is_refused() {
    let path: &Path = &policy_dir("cartpole").join("model.safetensors");
    let err = import_mlp(path, discrete(2), None).unwrap_err();
    assert!(err.to_string().contains("model.safetensors"), "{err}");
}

#[test]
fn declared_input_shape_is_checked_without_overflow() {
    use proto::tensor_shape_proto::{Dimension, dimension};
    let mut m = ModelProto::decode(two_layers("Tanh", vec![], "y").as_slice()).unwrap();
    let graph = m.graph.as_mut().unwrap();
    // Flatten a [batch, 2^40, 2^40, 2^40] input: the product overflows.
    graph.node[0].input[0] = "flat".into();
    graph
        .node
        .insert(0, node("Flatten", "flatten", &["x"], "flat"));
    let Some(proto::type_proto::Value::TensorType(t)) =
        &mut graph.input[0].r#type.as_mut().unwrap().value
    else {
        unreachable!()
    };
    let shape = t.shape.as_mut().unwrap();
    for _ in 0..2 {
        shape.dim.push(Dimension {
            value: Some(dimension::Value::DimValue(1 << 40)),
            ..Default::default()
        });
    }
    shape.dim[1].value = Some(dimension::Value::DimValue(1 << 40));
    let err = import_mlp_bytes(&m.encode_to_vec(), discrete(2), None).unwrap_err();
    assert!(
        matches!(err, Error::Formats(qforge_formats::Error::Shape(_))),
        "{err:?}"
    );
    assert!(
        err.to_string()
            .contains("first layer (Gemm node `fc0`) takes 3"),
        "{err}"
    );

    // Without the Flatten, a rank-4 input is refused.
    graph_without_flatten(&mut m);
    let message = unsupported(&m.encode_to_vec(), discrete(2));
    assert!(message.contains("input `x` has rank 4"), "{message}");
}

fn graph_without_flatten(m: &mut ModelProto) {
    let graph = m.graph.as_mut().unwrap();
    graph.node.remove(0);
    graph.node[0].input[0] = "x".into();
}
