"""The Python package as an RL trainer's rollout policy, on a small synthetic Llama
(`scripts/make_synthetic_model.py --shape tiny`, quantized by `qforge quantize`):
`generate_batch` draws n samples of many prompts on the serving engine, `score`
gives back their behaviour log-probs bit for bit whatever ran beside either call,
and `load_weights` swaps in a trainer's weights from memory, refusing malformed ones
without touching what serves."""

import json
import struct
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import qforge

ROOT = Path(__file__).resolve().parents[2]
QFORGE = str(ROOT / "target/debug/qforge")
# Token ids of the tiny model's vocabulary (1024; 1022 is its BOS, 1023 its EOS).
PROMPTS = [[1022, 5, 17, 300], [1022, 9], list(range(100, 140)), [1022, 77, 78, 79, 80, 81]]
EOS = 1023


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The synthetic model's directory and its dynamic INT8 artifact."""
    tmp = tmp_path_factory.mktemp("rollouts")
    subprocess.run([sys.executable, str(ROOT / "scripts/make_synthetic_model.py"),
                    "--shape", "tiny", "--out", str(tmp / "model"),
                    "--calibration", str(tmp / "ids.jsonl"), "--samples", "40",
                    "--seq-len", "64"], check=True, capture_output=True)
    recipes = {
        "art": ["--activations", "dynamic"],
        # Recorded transforms a sync must repeat: an offline and an online rotation;
        # SmoothQuant's factors with static scales.
        "quarot": ["--activations", "dynamic", "--hadamard", "quarot", "--no-method-search"],
        "smoothquant": ["--activations", "static", "--smoothquant", "--no-method-search",
                        "--max-perplexity-increase", "1000"],
    }
    for out_dir, recipe in recipes.items():
        out = subprocess.run([QFORGE, "quantize", "--model", "model", "--data", "ids.jsonl",
                              "--samples", "24", "--seq-len", "64", *recipe, "-o", out_dir,
                              "--json"], cwd=tmp, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["accepted"]
    return tmp / "model", tmp / "art"


def bf16_tensors(model_dir):
    """Every tensor of a bf16 safetensors file as uint16 arrays (bf16 bit patterns:
    numpy has no bf16), read from the format's header."""
    raw = (model_dir / "model.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + size])
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        assert entry["dtype"] == "BF16", (name, entry["dtype"])
        start, end = entry["data_offsets"]
        data = raw[8 + size + start:8 + size + end]
        tensors[name] = np.frombuffer(data, dtype="<u2").reshape(entry["shape"]).copy()
    return tensors


def widened(bits):
    """bf16 bit patterns as float32 values (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def samples(outputs):
    """(prompt ids, token ids, behaviour log-probs) of every sample, in order."""
    return [(r.prompt_token_ids, o.token_ids, o.logprobs) for r in outputs for o in r.outputs]


def test_generate_batch_draws_n_samples_that_score_back_bit_for_bit(tiny):
    _, artifact = tiny
    lm = qforge.open(artifact)
    outputs = lm.generate_batch(PROMPTS, n=4, max_tokens=12, temperature=1.0, seed=7)
    assert len(outputs) == len(PROMPTS)
    for prompt, request in zip(PROMPTS, outputs):
        assert request.prompt_token_ids == prompt and request.prompt is None
        assert request.model_version == 1 and len(request.outputs) == 4
        assert [o.index for o in request.outputs] == [0, 1, 2, 3]
        for sample in request.outputs:
            assert 1 <= len(sample.token_ids) <= 12
            assert sample.logprobs.dtype == np.float64
            assert sample.logprobs.shape == (len(sample.token_ids),)
            assert np.all(np.isfinite(sample.logprobs)) and np.all(sample.logprobs <= 0)
            assert sample.text is None  # the model has no tokenizer
            ended_by_eos = sample.token_ids[-1] == EOS
            assert sample.finish_reason == ("stop" if ended_by_eos else "length")
        # Four draws with their own seeds, from one prefill: not one sample four times.
        assert len({tuple(o.token_ids) for o in request.outputs}) > 1

    drawn = samples(outputs)
    # Scored all together, and each pair alone: the behaviour log-probs, bit for bit.
    together = lm.score([p for p, _, _ in drawn], [t for _, t, _ in drawn])
    alone = [lm.score([p], [t])[0] for p, t, _ in drawn[:6]]
    for (_, _, behaviour), scored in zip(drawn, together):
        assert np.array_equal(scored, behaviour)
    for (_, _, behaviour), scored in zip(drawn, alone):
        assert np.array_equal(scored, behaviour)

    # Prompt p's sample i drew with seed 7 + 4p + i: the same prompt alone, with its
    # seed, draws the same tokens with the same log-probs.
    for p in (0, 2):
        by_itself = lm.generate_batch([PROMPTS[p]], n=4, max_tokens=12, seed=7 + 4 * p)[0]
        for mine, theirs in zip(by_itself.outputs, outputs[p].outputs):
            assert mine.token_ids == theirs.token_ids
            assert np.array_equal(mine.logprobs, theirs.logprobs)

    # Greedy: every sample of a prompt is the argmax path.
    greedy = lm.generate_batch(PROMPTS[:2], n=3, max_tokens=8, temperature=0.0)
    for request in greedy:
        assert len({tuple(o.token_ids) for o in request.outputs}) == 1


def test_bad_rollout_calls_raise_usage_errors_naming_the_problem(tiny):
    _, artifact = tiny
    lm = qforge.open(artifact, max_sequences=8, kv_budget_tokens=256)
    cases = [
        (dict(prompts=[[1, 2, 5000]]), "prompt 0: token id 5000 is outside the vocabulary"),
        (dict(prompts=[[]]), "prompt 0 has no tokens"),
        (dict(prompts=[[1]], n=0), "n and max_tokens"),
        (dict(prompts=[[1]], top_p=0.9), "top_p"),
        (dict(prompts=[[1]], temperature=float("nan")), "temperature"),
        (dict(prompts=[[1]], stop=[""]), "stop string"),
        (dict(prompts=["text"]), "tokenizer"),
    ]
    for kwargs, message in cases:
        with pytest.raises(qforge.QforgeError, match=message):
            lm.generate_batch(**kwargs)
    # More samples than the engine ever holds: refused, not queued forever.
    with pytest.raises(qforge.QforgeError, match="can never run"):
        lm.generate_batch([[1, 2, 3]], n=9, max_tokens=4)
    with pytest.raises(qforge.QforgeError, match="can never run"):
        lm.generate_batch([[1, 2, 3]], n=2, max_tokens=200)
    with pytest.raises(qforge.UsageError, match="2 prompts and 1 completions"):
        lm.score([[1], [2]], [[3]])
    with pytest.raises(qforge.UsageError, match="end-of-sequence token at position 1"):
        lm.score([[1, 2]], [[3, EOS, 4]])
    # A completion ending with the end of sequence is scored, that token included.
    assert lm.score([[1, 2]], [[3, EOS]])[0].shape == (2,)
    assert lm.score([[1, 2]], [[]])[0].shape == (0,)
    # The engine still serves after every refusal.
    assert len(lm.generate_batch([[1, 2, 3]], n=2, max_tokens=4)[0].outputs) == 2


def greedy_run(lm):
    """Greedy samples of every prompt: tokens and log-probs."""
    outputs = lm.generate_batch(PROMPTS, n=1, max_tokens=10, temperature=0.0)
    return [(o.token_ids, o.logprobs) for r in outputs for o in r.outputs]


def same_run(a, b, exact=True):
    """Whether two runs drew the same tokens with the same log-probs: bit for bit, or
    (the f32 engine, whose matrix products depend on how many sequences share a
    step, and that depends on when each request reached the engine) to 1e-5."""
    def close(x, y):
        return np.array_equal(x, y) if exact else np.allclose(x, y, rtol=0, atol=1e-5)
    return all(x[0] == y[0] and close(x[1], y[1]) for x, y in zip(a, b))


def test_load_weights_swaps_in_memory_and_reports_the_codes_changed(tiny):
    model, artifact = tiny
    lm = qforge.open(artifact)
    weights = bf16_tensors(model)
    before = greedy_run(lm)

    # The same weights (bf16 as uint16 views): a new version, nothing changed.
    report = lm.load_weights(weights)
    assert report["model_version"] == 2 == lm.model_version
    assert report["int8_weights"] > 0 and report["changed"] == 0
    assert report["changed_share"] == 0.0 and set(report["tensors"].values()) == {0.0}
    assert "model.layers.3.mlp.down_proj.weight" in report["tensors"]
    assert same_run(greedy_run(lm), before)
    assert lm.generate_batch([PROMPTS[0]], max_tokens=2)[0].model_version == 2

    # Perturbed weights, as float32: codes change, and so do the outputs.
    rng = np.random.default_rng(0)
    perturbed = {name: widened(bits) * (1 + 0.05 * rng.standard_normal(bits.shape,
                                                                      dtype=np.float32))
                 if bits.ndim == 2 else widened(bits)
                 for name, bits in weights.items()}
    report = lm.load_weights(perturbed)
    assert report["model_version"] == 3
    assert 0.01 < report["changed_share"] < 1.0, report["changed_share"]
    assert all(0 < share < 1 for share in report["tensors"].values())
    after = greedy_run(lm)
    assert not same_run(after, before)

    # Malformed weights: refused by name, and the perturbed model keeps serving.
    missing = dict(perturbed)
    del missing["model.layers.2.self_attn.k_proj.weight"]
    unknown = dict(perturbed, **{"model.layers.9.mlp.up_proj.weight": perturbed[
        "model.layers.0.mlp.up_proj.weight"]})
    misshapen = dict(perturbed)
    misshapen["model.layers.1.mlp.gate_proj.weight"] = misshapen[
        "model.layers.1.mlp.gate_proj.weight"][:-1]
    poisoned = dict(perturbed)
    poisoned["model.layers.0.self_attn.o_proj.weight"] = poisoned[
        "model.layers.0.self_attn.o_proj.weight"].copy()
    poisoned["model.layers.0.self_attn.o_proj.weight"][3, 4] = np.nan
    wrong_dtype = dict(perturbed, **{"model.norm.weight": np.ones(128, dtype=np.int64)})
    for bad, message in [
        (missing, "missing tensor model.layers.2.self_attn.k_proj.weight"),
        (unknown, "unknown tensor model.layers.9.mlp.up_proj.weight"),
        (misshapen, r"model.layers.1.mlp.gate_proj.weight is \[383, 128\]"),
        (poisoned, "model.layers.0.self_attn.o_proj.weight holds NaN"),
        (wrong_dtype, "model.norm.weight: dtype int64"),
        ({"model.norm.weight": [1.0] * 128}, "model.norm.weight: not a numpy array"),
        (42, "dict of name"),
    ]:
        with pytest.raises(qforge.QforgeError, match=message):
            lm.load_weights(bad)
        assert lm.model_version == 3
    assert same_run(greedy_run(lm), after)


def test_the_same_weights_through_an_artifacts_recorded_transforms_change_nothing(tiny):
    model, artifact = tiny
    weights = bf16_tensors(model)
    for name in ("quarot", "smoothquant"):
        recorded = json.loads((artifact.parent / name / "transforms.json").read_text())
        assert recorded, name
        lm = qforge.open(artifact.parent / name)
        before = greedy_run(lm)
        report = lm.load_weights(weights)
        assert report["int8_weights"] > 0 and report["changed"] == 0, name
        assert same_run(greedy_run(lm), before), name


def test_load_weights_keeps_each_run_precision(tiny, tmp_path):
    model, _ = tiny
    weights = bf16_tensors(model)
    # int8-dynamic rotates the residual stream: the sync rotates the new weights
    # with the same fixed signs.
    for precision, int8 in [("f32", False), ("int8-dynamic", True),
                            ("int8-dynamic-plain", True)]:
        lm = qforge.open(model, precision=precision)
        before = greedy_run(lm)
        report = lm.load_weights(weights)
        assert (report["int8_weights"] > 0) == int8 and report["changed"] == 0
        assert same_run(greedy_run(lm), before, exact=int8), precision
    # A directory of safetensors files takes the same path as a dict.
    lm = qforge.open(model, precision="int8-dynamic")
    assert lm.load_weights(str(model))["changed"] == 0
    with pytest.raises(qforge.UsageError, match="holds no .safetensors file"):
        lm.load_weights(str(tmp_path))


def test_another_python_thread_runs_while_generate_batch_does(tiny):
    _, artifact = tiny
    lm = qforge.open(artifact)
    entering, returned = threading.Event(), threading.Event()

    def rollouts():
        entering.set()
        lm.generate_batch(PROMPTS * 8, n=4, max_tokens=48, temperature=1.0)
        returned.set()

    worker = threading.Thread(target=rollouts)
    worker.start()
    entering.wait()
    # This thread runs Python (and a call of its own) while the long call is in the
    # engine: the GIL was released. Held, this line would run only after it returned.
    small = lm.generate_batch([[1, 2, 3]], n=1, max_tokens=1)
    progressed_during = not returned.is_set()
    worker.join()
    assert small[0].outputs[0].token_ids and progressed_during


def test_concurrent_syncs_take_turns(tiny):
    """Two threads sync at once: the second waits for the first's lock without holding
    the GIL the first needs to return, so both finish, as versions 2 and 3. In a child
    process with a deadline: a deadlock there holds the GIL, so no thread of this
    process could notice it."""
    model, artifact = tiny
    child = f"""
import sys, threading
sys.path.insert(0, {str(Path(__file__).parent)!r})
import qforge
from pathlib import Path
from test_rollouts import bf16_tensors
lm = qforge.open({str(artifact)!r})
weights = bf16_tensors(Path({str(model)!r}))
reports = []
threads = [threading.Thread(target=lambda: reports.append(lm.load_weights(weights)))
           for _ in range(2)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(sorted(r["model_version"] for r in reports), lm.model_version)
"""
    try:
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                             timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("two concurrent load_weights calls deadlocked")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[2, 3] 3", out.stdout
