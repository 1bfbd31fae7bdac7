#!/usr/bin/env python3
"""Builds the ONNX policy-import fixtures in fixtures/onnx/.

Each fixture is an ONNX file shaped like a real exporter's output, plus a JSON
file with 64 observations and ONNX Runtime's outputs for them, so the Rust
importer (crates/model/tests/onnx_import.rs) is checked against an
independent runtime:

- cartpole_torch, pendulum_torch: the trained fixture policies as
  torch.onnx.export writes an nn.Sequential (Gemm transB=1, Tanh, opset 17,
  weights in raw_data, PyTorch's names);
- cartpole_sb3, pendulum_sb3: the same weights as a Stable-Baselines3 actor
  export writes them (MatMul with [in, out] weights, Add, Tanh; weights in
  float_data);
- relu_cartpole_torch: seeded random weights, 4-32-32-2, Gemm + Relu;
- relu_cartpole_mixed: seeded random weights, 4-24-16-2, mixing every
  supported form: Flatten, Gemm transB=0, Constant-node weights, MatMul + Add
  with the bias first, Identity, a [1, out] Gemm bias and a final Softmax
  (its saved outputs are probabilities).

Observations are the first rows of the source fixture's rollouts.jsonl.
Only numpy, onnx, onnxruntime and safetensors are needed (no torch). The
output is deterministic: running twice writes identical bytes (ORT runs on
one thread; its outputs could differ in the last bits on another CPU).

    python3 -m venv /tmp/onnxvenv
    /tmp/onnxvenv/bin/pip install numpy onnx onnxruntime safetensors
    /tmp/onnxvenv/bin/python tests/python/make_onnx_fixtures.py
"""

import json
import pathlib

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from safetensors.numpy import load_file

ROOT = pathlib.Path(__file__).resolve().parents[2]
POLICIES = ROOT / "fixtures" / "policies"
OUT = ROOT / "fixtures" / "onnx"
ROWS = 64
OPSET = 17
# The IR version torch.onnx.export writes at opset 17.
IR_VERSION = 8
SEED = 20240611


def observations(policy: str) -> np.ndarray:
    """The first ROWS observations of a fixture's rollouts, as float32."""
    rows = []
    with open(POLICIES / policy / "rollouts.jsonl") as f:
        for line in f:
            rows.extend(json.loads(line)["observations"])
            if len(rows) >= ROWS:
                break
    return np.asarray(rows[:ROWS], dtype=np.float32)


def trained(policy: str):
    """Weights ([out, in]) and biases of a trained fixture, and its config."""
    tensors = load_file(str(POLICIES / policy / "model.safetensors"))
    config = json.loads((POLICIES / policy / "policy.json").read_text())
    n = len(config["hidden"]) + 1
    weights = [tensors[f"layers.{i}.weight"] for i in range(n)]
    biases = [tensors[f"layers.{i}.bias"] for i in range(n)]
    return weights, biases, config


def random_mlp(rng, widths):
    """He-initialised weights ([out, in]) and small biases."""
    weights, biases = [], []
    for inp, out in zip(widths, widths[1:]):
        weights.append((rng.standard_normal((out, inp)) * np.sqrt(2.0 / inp)).astype(np.float32))
        biases.append((rng.standard_normal(out) * 0.1).astype(np.float32))
    return weights, biases


def float_data(name, array):
    """A float32 initializer stored in float_data (SB3 exports look like this
    after onnx.helper round trips; PyTorch uses raw_data)."""
    array = np.asarray(array, dtype=np.float32)
    return helper.make_tensor(name, TensorProto.FLOAT, array.shape, array.ravel().tolist())


def io(name, width):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", width])


def model(graph):
    m = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="qforge-fixtures",
        producer_version="1",
    )
    m.ir_version = IR_VERSION
    onnx.checker.check_model(m, full_check=True)
    return m


def torch_style(weights, biases, activation, out_name):
    """torch.onnx.export of nn.Sequential(Linear, Act, Linear, Act, Linear)."""
    nodes, inits = [], []
    x = "input"
    n = len(weights)
    for i, (w, b) in enumerate(zip(weights, biases)):
        module = 2 * i
        inits += [numpy_helper.from_array(w, f"{module}.weight"),
                  numpy_helper.from_array(b, f"{module}.bias")]
        y = out_name if i == n - 1 else f"/{module}/Gemm_output_0"
        nodes.append(helper.make_node(
            "Gemm", [x, f"{module}.weight", f"{module}.bias"], [y],
            name=f"/{module}/Gemm", alpha=1.0, beta=1.0, transB=1))
        x = y
        if i < n - 1:
            y = f"/{module + 1}/{activation}_output_0"
            nodes.append(helper.make_node(activation, [x], [y], name=f"/{module + 1}/{activation}"))
            x = y
    graph = helper.make_graph(nodes, "main_graph", [io("input", weights[0].shape[1])],
                              [io(out_name, weights[-1].shape[0])], inits)
    return model(graph)


def sb3_style(weights, biases, activation, out_name):
    """A Stable-Baselines3 actor (mlp_extractor.policy_net + action_net) as
    torch.onnx.export writes it: MatMul by the transposed weight, then Add."""
    nodes, inits = [], []
    x = "observation"
    n = len(weights)
    for i, (w, b) in enumerate(zip(weights, biases)):
        if i < n - 1:
            prefix = f"/mlp_extractor/policy_net/policy_net.{2 * i}"
            bias_name = f"mlp_extractor.policy_net.{2 * i}.bias"
        else:
            prefix = "/action_net"
            bias_name = "action_net.bias"
        w_name = f"onnx::MatMul_{100 + i}"
        inits += [float_data(w_name, w.T), float_data(bias_name, b)]
        nodes.append(helper.make_node("MatMul", [x, w_name], [f"{prefix}/MatMul_output_0"],
                                      name=f"{prefix}/MatMul"))
        y = out_name if i == n - 1 else f"{prefix}/Add_output_0"
        nodes.append(helper.make_node("Add", [f"{prefix}/MatMul_output_0", bias_name], [y],
                                      name=f"{prefix}/Add"))
        x = y
        if i < n - 1:
            act = f"/mlp_extractor/policy_net/policy_net.{2 * i + 1}/{activation}"
            nodes.append(helper.make_node(activation, [x], [f"{act}_output_0"], name=act))
            x = f"{act}_output_0"
    graph = helper.make_graph(nodes, "main_graph", [io("observation", weights[0].shape[1])],
                              [io(out_name, weights[-1].shape[0])], inits)
    return model(graph)


def mixed_style(weights, biases):
    """Every supported form in one graph (three layers, Relu, Softmax)."""
    (w0, w1, w2), (b0, b1, b2) = weights, biases

    def const(name, array, raw):
        tensor = numpy_helper.from_array(array, name) if raw else float_data(name, array)
        return helper.make_node("Constant", [], [name], name=f"const_{name}", value=tensor)

    nodes = [
        helper.make_node("Flatten", ["obs"], ["flat"], name="flatten", axis=1),
        helper.make_node("Gemm", ["flat", "w0", "b0"], ["h0"], name="gemm0", transB=0),
        helper.make_node("Relu", ["h0"], ["a0"], name="relu0"),
        const("w1", w1.T.copy(), raw=True),
        helper.make_node("MatMul", ["a0", "w1"], ["m1"], name="matmul1"),
        const("b1", b1, raw=False),
        helper.make_node("Add", ["b1", "m1"], ["h1"], name="add1"),
        helper.make_node("Relu", ["h1"], ["a1"], name="relu1"),
        helper.make_node("Identity", ["a1"], ["a1_id"], name="identity"),
        const("w2", w2, raw=False),
        helper.make_node("Gemm", ["a1_id", "w2", "b2"], ["logits"], name="gemm2",
                         alpha=1.0, beta=1.0, transA=0, transB=1),
        helper.make_node("Softmax", ["logits"], ["probs"], name="softmax", axis=-1),
    ]
    inits = [numpy_helper.from_array(w0.T.copy(), "w0"), numpy_helper.from_array(b0, "b0"),
             float_data("b2", b2.reshape(1, -1))]
    graph = helper.make_graph(nodes, "mixed", [io("obs", w0.shape[1])],
                              [io("probs", w2.shape[0])], inits)
    return model(graph)


def numpy_forward(weights, biases, activation, obs):
    act = np.tanh if activation == "Tanh" else (lambda v: np.maximum(v, 0))
    x = obs.astype(np.float64)
    for i, (w, b) in enumerate(zip(weights, biases)):
        x = x @ w.T.astype(np.float64) + b
        if i < len(weights) - 1:
            x = act(x)
    return x


def run_ort(m, obs):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(m.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {session.get_inputs()[0].name: obs})
    return out


def f32(v) -> str:
    v = np.float32(v)
    assert np.isfinite(v)
    return str(v)  # shortest decimal that round-trips the float32


def write(name, m, obs, outputs, head, env, output_kind, source):
    (OUT / f"{name}.onnx").write_bytes(m.SerializeToString())
    meta = {
        "model": f"{name}.onnx",
        "source": source,
        "env": env,
        "head": head,
        "output_kind": output_kind,
    }
    lines = ["{"]
    for key, value in meta.items():
        lines.append(f"  {json.dumps(key)}: {json.dumps(value)},")

    def rows(key, array, last):
        lines.append(f'  "{key}": [')
        body = ["    [" + ", ".join(f32(v) for v in row) + "]" for row in array]
        lines.append(",\n".join(body))
        lines.append("  ]" + ("" if last else ","))

    rows("inputs", obs, last=False)
    rows("outputs", outputs, last=True)
    lines.append("}")
    (OUT / f"{name}.json").write_text("\n".join(lines) + "\n")


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    report = []

    def emit(name, m, weights, biases, activation, obs, head, env, source, softmax=False):
        outputs = run_ort(m, obs)
        reference = numpy_forward(weights, biases, activation, obs)
        if softmax:
            e = np.exp(reference - reference.max(axis=1, keepdims=True))
            reference = e / e.sum(axis=1, keepdims=True)
        diff = float(np.abs(outputs - reference).max())
        assert diff < 1e-4, f"{name}: ORT differs from numpy by {diff}"
        write(name, m, obs, outputs, head, env, "softmax" if softmax else "raw", source)
        report.append(f"{name}: ORT vs float64 numpy max |diff| {diff:.2e}")

    for policy, out_name in [("cartpole", "logits"), ("pendulum", "action_mean")]:
        weights, biases, config = trained(policy)
        assert config["activation"] == "tanh"
        obs = observations(policy)
        source = f"fixtures/policies/{policy}"
        emit(f"{policy}_torch", torch_style(weights, biases, "Tanh", out_name), weights, biases,
             "Tanh", obs, config["head"], config["env"], source)
        emit(f"{policy}_sb3", sb3_style(weights, biases, "Tanh", out_name), weights, biases,
             "Tanh", obs, config["head"], config["env"], source)

    cartpole_obs = observations("cartpole")
    discrete2 = {"kind": "discrete", "actions": 2}
    weights, biases = random_mlp(rng, [4, 32, 32, 2])
    emit("relu_cartpole_torch", torch_style(weights, biases, "Relu", "logits"), weights, biases,
         "Relu", cartpole_obs, discrete2, "CartPole-v1", None)
    weights, biases = random_mlp(rng, [4, 24, 16, 2])
    emit("relu_cartpole_mixed", mixed_style(weights, biases), weights, biases, "Relu",
         cartpole_obs, discrete2, "CartPole-v1", None, softmax=True)

    total = sum(p.stat().st_size for p in OUT.iterdir())
    print("\n".join(report))
    print(f"{OUT}: {total} bytes")


if __name__ == "__main__":
    main()
