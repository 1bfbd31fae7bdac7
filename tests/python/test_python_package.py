"""The Python package (`python/`, built into the venv by scripts/test.sh with maturin)
against the CLI: the same models give the same outputs, actions and reports, and
`qforge.quantize` writes the same artifact bytes as `qforge quantize`."""

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

import qforge

ROOT = Path(__file__).resolve().parents[2]
QFORGE = os.environ.get("QFORGE", str(ROOT / "target/debug/qforge"))
CARTPOLE = ROOT / "fixtures/policies/cartpole"
ROLLOUTS = CARTPOLE / "rollouts.jsonl"
SMOLLM2 = ROOT / "models/smollm2-135m-instruct-q4_1.gguf"


def cli(*args, cwd=ROOT):
    out = subprocess.run([QFORGE, *map(str, args)], capture_output=True, text=True, cwd=cwd)
    assert out.returncode == 0, out.stderr
    return out.stdout


def observations(rows=64):
    """The first `rows` observations of the bundled rollouts, and the file they came from."""
    values = []
    for line in ROLLOUTS.read_text().splitlines():
        values.extend(json.loads(line)["observations"])
        if len(values) >= rows:
            break
    return np.asarray(values[:rows], dtype=np.float32)


def write_observations(path, obs):
    path.write_text(json.dumps({"observations": obs.tolist()}) + "\n")


def log_softmax(x):
    x = x.astype(np.float64)
    shifted = x - x.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


@pytest.mark.parametrize("precision", ["f32", "int8-dynamic", "int8-dynamic-plain"])
def test_a_policy_acts_as_the_cli_and_its_log_probs_are_its_own(tmp_path, precision):
    obs = observations()
    data = tmp_path / "obs.jsonl"
    write_observations(data, obs)
    theirs = json.loads(cli("act", "--model", CARTPOLE, "--observations", data,
                            "--precision", precision, "--json"))
    policy = qforge.open(CARTPOLE, precision=precision)
    assert policy.precision == precision and policy.observation_dim == 4
    outputs = policy.forward(obs)
    assert outputs.dtype == np.float32 and outputs.shape == (len(obs), 2)
    # The CLI prints each f32 with its shortest round-tripping digits: equal bits.
    assert np.array_equal(outputs, np.asarray(theirs["outputs"], dtype=np.float32))
    actions, log_probs = policy.act(obs)
    assert actions.dtype == np.int64
    assert actions.tolist() == theirs["actions"]
    expected = log_softmax(outputs)[np.arange(len(obs)), actions]
    np.testing.assert_allclose(log_probs, expected, rtol=0, atol=1e-12)


def test_sampled_actions_are_seeded_draws_with_their_log_probs():
    policy = qforge.open(CARTPOLE)
    obs = observations(256)
    first, log_probs = policy.act(obs, sample=True, seed=7)
    again, _ = policy.act(obs, sample=True, seed=7)
    greedy, _ = policy.act(obs)
    assert np.array_equal(first, again)
    # A trained policy is sure of most states but not all: some draws leave the argmax.
    assert 0 < np.count_nonzero(first != greedy) < len(obs) // 2
    expected = log_softmax(policy.forward(obs))[np.arange(len(obs)), first]
    np.testing.assert_allclose(log_probs, expected, rtol=0, atol=1e-12)


def test_bad_calls_raise_qforge_exceptions_with_the_library_message(tmp_path):
    policy = qforge.open(CARTPOLE)
    with pytest.raises(qforge.UsageError, match="rows of 4 values"):
        policy.act(np.zeros((3, 5), dtype=np.float32))
    with pytest.raises(qforge.UsageError, match="no precision"):
        qforge.open(CARTPOLE, precision="int4")
    with pytest.raises(qforge.QforgeError, match="does not exist"):
        qforge.open(tmp_path / "missing")
    with pytest.raises(qforge.UsageError, match="needs --stats"):
        qforge.open(CARTPOLE, precision="int8-static")
    assert issubclass(qforge.GuardRefused, qforge.QforgeError)
    # Finite observations that overflow the forward: an error, not NaN log-probs.
    huge = np.full((2, 4), 3.4e38, dtype=np.float32)
    for call in (policy.act, policy.forward):
        with pytest.raises(qforge.UsageError, match=r"observation row 0 is NaN \(not finite\)"):
            call(huge)
    write_observations(tmp_path / "huge.jsonl", huge)
    out = subprocess.run([QFORGE, "act", "--model", CARTPOLE, "--observations",
                          tmp_path / "huge.jsonl"], capture_output=True, text=True)
    assert out.returncode == 2 and "not finite" in out.stderr, out.stderr


def test_calibrate_writes_the_cli_bytes_and_report(tmp_path):
    args = dict(samples=256, batch_size=32, seed=3)
    ours = qforge.calibrate(CARTPOLE, ROLLOUTS, tmp_path / "py.qstats", workers=2, **args)
    theirs = json.loads(cli("calibrate", "--model", CARTPOLE, "--data", ROLLOUTS,
                            "-o", tmp_path / "cli.qstats", "--workers", "1",
                            "--samples", 256, "--batch-size", 32, "--seed", 3, "--json"))
    assert (tmp_path / "py.qstats").read_bytes() == (tmp_path / "cli.qstats").read_bytes()
    assert ours["output"] == str(tmp_path / "py.qstats")
    for key in ["planned_batches", "merged_batches", "coverage", "samples", "rows",
                "model_sha256", "data_sha256", "recipe_sha256", "run"]:
        assert ours[key] == theirs[key], key
    with pytest.raises(qforge.UsageError, match="stratify"):
        qforge.calibrate(CARTPOLE, ROLLOUTS, tmp_path / "x.qstats", stratify="rewards")


def test_quantize_writes_the_cli_artifact_byte_for_byte(tmp_path):
    outcome = qforge.quantize(CARTPOLE, ROLLOUTS, tmp_path / "py", workers=2)
    cli("quantize", "--model", CARTPOLE, "--data", ROLLOUTS, "-o", tmp_path / "cli",
        "--workers", "1", "--json")
    for name in ["model.safetensors", "qforge.json", "policy.json", "calibration.json",
                 "transforms.json"]:
        assert (tmp_path / "py" / name).read_bytes() == (tmp_path / "cli" / name).read_bytes(), name
    assert outcome["accepted"] and outcome["output"] == str(tmp_path / "py")
    served = qforge.open(tmp_path / "py")
    assert served.precision == "artifact (stored precisions)"
    with pytest.raises(qforge.UsageError, match="quantized artifact"):
        qforge.open(tmp_path / "py", precision="int8-dynamic")

    # The same weights requantized like the artifact change no int8 weight.
    report = qforge.requantize(CARTPOLE, tmp_path / "py", tmp_path / "again")
    assert report["changed_weights"] == 0 and report["int8_weights"] > 0
    assert (tmp_path / "again/model.safetensors").read_bytes() == \
        (tmp_path / "py/model.safetensors").read_bytes()


def test_a_refused_quantization_raises_guard_refused_and_writes_only_the_report(tmp_path):
    with pytest.raises(qforge.GuardRefused, match="No artifact written"):
        qforge.quantize(CARTPOLE, ROLLOUTS, tmp_path / "out", min_agreement=1.0,
                        max_fp_fraction=0.0)
    assert (tmp_path / "out/report.json").is_file()
    assert not (tmp_path / "out/model.safetensors").exists()
    with pytest.raises(qforge.UsageError, match="recipe"):
        qforge.quantize(CARTPOLE, ROLLOUTS, tmp_path / "bad", min_agreement=2.0)


def test_a_language_model_scores_its_own_tokens_as_one_forward_does():
    lm = qforge.open(SMOLLM2)
    tokens = lm.encode("The quick brown fox jumps over the lazy dog near the river bank.")
    assert lm.decode(tokens) == "The quick brown fox jumps over the lazy dog near the river bank."
    prompt, completion = tokens[:4], tokens[4:]
    together = lm.logprobs(prompt, completion)
    assert together.shape == (len(completion),) and np.all(together < 0)
    # Token by token, each scored after the whole prefix, gives the same figures.
    one_by_one = [lm.logprobs(tokens[:i], [tokens[i]])[0] for i in range(4, len(tokens))]
    np.testing.assert_allclose(together, one_by_one, rtol=0, atol=1e-4)
    question = "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    generated = lm.generate(question, max_tokens=8)
    assert generated["prompt_tokens"] > 0 and 0 < len(generated["tokens"]) <= 8
    assert generated["text"] == lm.decode(generated["tokens"])
    # The CLI's report: the same keys, tokens and precision.
    theirs = json.loads(cli("generate", "--model", SMOLLM2, "--prompt", question,
                            "--max-tokens", "8", "--json"))
    assert theirs.keys() == generated.keys()
    assert (theirs["tokens"], theirs["precision"]) == (generated["tokens"], generated["precision"])


def test_int8_dynamic_rotates_the_residual_as_the_cli_does_and_plain_does_not():
    question = "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"
    runs = {}
    for precision in ["int8-dynamic", "int8-dynamic-plain"]:
        lm = qforge.open(SMOLLM2, precision=precision)
        assert lm.precision == precision
        ours = lm.generate(question, max_tokens=24)
        theirs = json.loads(cli("generate", "--model", SMOLLM2, "--prompt", question,
                                "--max-tokens", "24", "--precision", precision, "--json"))
        assert (ours["tokens"], ours["precision"]) == (theirs["tokens"], theirs["precision"])
        tokens = lm.encode("The quick brown fox jumps over the lazy dog near the river bank.")
        runs[precision] = lm.logprobs(tokens[:4], tokens[4:])
    # The rotation changes the INT8 model: its log-probs of the same text are not plain's.
    assert not np.array_equal(runs["int8-dynamic"], runs["int8-dynamic-plain"])
