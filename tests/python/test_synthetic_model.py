"""A model of Llama 3's structure from `scripts/make_synthetic_model.py` (the tiny
shape: bf16 shards, GQA, Llama 3's rotary scaling, outlier channels, no tokenizer),
quantized as the large shapes are: calibration data as token ids, static W8A8 with
GPTQ, the same artifact bytes for 1 worker and for 2 whose Hessian passes resume from kept
hidden states; generation from token ids; text
refused with a message that names what is missing; and the export read back by an
independent reader.
"""

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from check_compressed_tensors import check  # noqa: E402
QFORGE = os.environ.get("QFORGE", str(ROOT / "target/release/qforge"))


def run(*args, cwd):
    return subprocess.run([QFORGE, *args], cwd=cwd, capture_output=True, text=True)


def qforge(*args, cwd):
    out = run(*args, "--json", cwd=cwd)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def spawn(*args, log):
    """qforge in the background, its stderr written to `log` (in the log's folder)."""
    with open(log, "w") as stderr:
        return subprocess.Popen([QFORGE, *args], cwd=log.parent, stdout=subprocess.DEVNULL,
                                stderr=stderr)


@contextlib.contextmanager
def redis_server(tmp_path):
    """A real redis-server on a free loopback port, without persistence; its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                               "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                              stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while subprocess.run(["redis-cli", "-u", url, "PING"], capture_output=True,
                             text=True).stdout.strip() != "PONG":
            assert server.poll() is None and time.monotonic() < deadline, "redis-server"
            time.sleep(0.05)
        yield url
    finally:
        server.kill()
        server.wait()


def redis_get(url, key):
    out = subprocess.run(["redis-cli", "-u", url, "--raw", "GET", key], capture_output=True,
                         text=True, check=True).stdout.strip()
    return out or None


def redis_keys(url, pattern):
    out = subprocess.run(["redis-cli", "-u", url, "--raw", "KEYS", pattern],
                         capture_output=True, text=True, check=True).stdout
    return out.split()


def int8_weights(artifact):
    """The artifact's int8 weights by name (`safetensors.numpy` cannot read the bf16
    embedding beside them: numpy has no bf16)."""
    with safe_open(artifact / "model.safetensors", framework="numpy") as f:
        return {n: f.get_tensor(n) for n in f.keys() if f.get_slice(n).get_dtype() == "I8"}


def make_model(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts/make_synthetic_model.py"),
                    "--shape", "tiny", "--out", str(tmp_path / "model"),
                    "--shard-bytes", "400000", "--calibration", str(tmp_path / "ids.jsonl"),
                    "--samples", "40", "--seq-len", "64"], check=True)
    return tmp_path / "model"


def test_token_ids_quantize_exactly_on_any_worker_count_and_export(tmp_path):
    model = make_model(tmp_path)
    index = json.loads((model / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded, as the large shapes are
    assert not (model / "tokenizer.json").exists()

    args = ["quantize", "--model", str(model), "--data", "ids.jsonl", "--samples", "24",
            "--seq-len", "64", "--activations", "static", "--gptq"]
    # Two workers, and Hessians cut into a pass per layer or so: the activation pass
    # sums the first group's, and each Hessian pass after the first resumes every
    # batch from the hidden state the one before kept.
    (tmp_path / "small.toml").write_text("[gptq]\nhessian_memory_mib = 1\n")
    reports = [qforge(*args, "--workers", "1", "-o", "w1", cwd=tmp_path),
               qforge(*args, "--workers", "2", "--recipe", "small.toml", "-o", "w2", cwd=tmp_path)]
    for report in reports:
        assert report["accepted"] and report["total_layers"] == 4 * 7 + 1
        assert "tokens of 16 episodes not drawn for calibration" in report["held_out"]
    passes = [[p["pass"] for p in
               json.loads((tmp_path / out / "report.json").read_text())["calibration"]["passes"]]
              for out in ("w1", "w2")]
    assert passes[0] == ["activation+hessian"], passes
    assert passes[1][0] == "activation+hessian" and passes[1].count("hessian") >= 3, passes
    assert (tmp_path / "w1/model.safetensors").read_bytes() == \
        (tmp_path / "w2/model.safetensors").read_bytes()
    assert not (tmp_path / "w1/tokenizer.json").exists()

    # Text needs a tokenizer: refused with the file that is missing and what to do.
    (tmp_path / "eval.txt").write_text("Some held-out text. " * 50)
    refused = run(*args, "--eval-data", "eval.txt", "-o", "text", cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert "tokenizer.json does not exist" in refused.stderr
    assert "token_ids" in refused.stderr
    assert not (tmp_path / "text").exists()

    # The artifact generates from token ids, and answers in token ids.
    generated = qforge("generate", "--model", "w1", "--prompt-ids", "1022,5,17,300",
                       "--max-tokens", "6", cwd=tmp_path)
    assert generated["text"] is None and generated["prompt_tokens"] == 4
    assert 1 <= len(generated["tokens"]) <= 6
    assert all(0 <= t < 1024 for t in generated["tokens"])
    plain = run("generate", "--model", "w1", "--prompt-ids", "1022,5,17,300", "--max-tokens",
                "6", cwd=tmp_path)
    assert plain.stdout.strip() == ",".join(map(str, generated["tokens"]))
    text = run("generate", "--model", "w1", "--prompt", "Hello", cwd=tmp_path)
    assert text.returncode == 2 and "tokenizer.json does not exist" in text.stderr

    # bf16 shards that nothing rescaled (no smoothing, no rotation): the checkpoint is
    # bf16 like its source, its embedding and norms the source's values exactly.
    exported = qforge("export", "--model", "w1", "--format", "compressed-tensors", "-o", "ct",
                      cwd=tmp_path)
    assert exported["dtype"] == "bfloat16"
    config = json.loads((tmp_path / "ct/config.json").read_text())
    assert config["quantization_config"]["format"] == "int-quantized"
    assert config["rope_scaling"]["rope_type"] == "llama3"
    assert not (tmp_path / "ct/tokenizer.json").exists()
    summary = check(tmp_path / "ct", tmp_path / "w1")
    assert summary["torch_dtype"] == "bfloat16"
    # The embedding, 2 norms per layer and the final norm; lm_head is int8, untied.
    assert summary["float_tensors"] == 1 + 2 * config["num_hidden_layers"] + 1
    assert exported["lm_head"] == "int8" and config["tie_word_embeddings"] is False
    name = "model.layers.3.mlp.down_proj.weight"
    for artifact in ("ct", "w1"):  # the artifact keeps the source's bf16 too
        with safe_open(tmp_path / artifact / "model.safetensors", framework="numpy") as f:
            assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
    weight = int8_weights(tmp_path / "ct")[name]
    assert weight.dtype == np.int8 and weight.shape == (128, 384)
    assert np.array_equal(weight, int8_weights(tmp_path / "w1")[name])


def test_sequential_gptq_propagates_its_rounding_exactly_on_any_worker_count(tmp_path):
    """--sequential: one Hessian pass per layer input after the activation pass, each
    running the layers rounded before it with their rounding. The first input's Hessian
    (layer 0's q/k/v, summed by the activation pass) is the full-precision model's, so
    its rounding is plain GPTQ's; every later layer's rounding differs from it. Two workers
    resuming each pass from the hidden states the one before kept write the one-worker
    artifact's bytes. So does a cluster of three worker processes, one SIGKILLed in a
    pass that runs rounded layers: every worker fetches GPTQ's roundings from Redis, and
    the batches whose hidden states died with it are computed again from the embedding."""
    model = make_model(tmp_path)
    # Batches of 2: enough of them that every worker of the cluster below holds some.
    args = ["quantize", "--model", str(model), "--data", "ids.jsonl", "--samples", "24",
            "--seq-len", "64", "--batch-size", "2", "--activations", "static"]
    for out, extra in (("s1", ["--sequential", "--workers", "1"]),
                       ("s2", ["--sequential", "--workers", "2"]),
                       ("plain", ["--gptq", "--workers", "1"])):
        assert qforge(*args, *extra, "-o", out, cwd=tmp_path)["accepted"]
    passes = [p["pass"] for p in
              json.loads((tmp_path / "s1/report.json").read_text())["calibration"]["passes"]]
    # 4 layers × 4 inputs (q/k/v, o, gate/up, down) and lm_head.
    assert passes == ["activation+hessian"] + ["hessian"] * 16, passes
    assert (tmp_path / "s1/model.safetensors").read_bytes() == \
        (tmp_path / "s2/model.safetensors").read_bytes()

    sequential = int8_weights(tmp_path / "s1")
    plain = int8_weights(tmp_path / "plain")
    for proj in ("q_proj", "k_proj", "v_proj"):
        name = f"model.layers.0.self_attn.{proj}.weight"
        assert np.array_equal(sequential[name], plain[name]), name
    for name in ("model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight",
                 "model.layers.3.self_attn.q_proj.weight", "model.layers.3.mlp.down_proj.weight"):
        assert sequential[name].dtype == np.int8
        assert not np.array_equal(sequential[name], plain[name]), name

    with redis_server(tmp_path) as url:
        cluster = ["--cluster", url, "--run", "seq", "--heartbeat-ms", "100",
                   "--heartbeat-timeout-ms", "500"]
        coordinator = spawn(*args, "--sequential", *cluster, "-o", "cluster",
                            log=tmp_path / "coordinator.log")
        workers = {name: spawn("worker", "--cluster", url, "--run", "seq", "--name", name,
                               "--wait", "120", log=tmp_path / f"{name}.log")
                   for name in ("victim", "a", "b")}
        try:
            # Killed while it observes a batch of a pass after the first, which runs
            # layers GPTQ rounded.
            deadline = time.monotonic() + 600
            while True:
                active = redis_get(url, "qforge:active")
                if active not in (None, "seq") and \
                        redis_get(url, f"qforge:{{{active}}}:hb:victim") not in (None, "-"):
                    break
                assert coordinator.poll() is None and time.monotonic() < deadline, \
                    "the victim never held a task of a pass after the first"
                time.sleep(0.005)
            workers.pop("victim").kill()
            log = (tmp_path / "coordinator.log").read_text
            assert coordinator.wait(timeout=600) == 0, log()
            for name, worker in workers.items():
                assert worker.wait(timeout=60) == 0, (tmp_path / f"{name}.log").read_text()
                followed = (tmp_path / f"{name}.log").read_text()
                assert "roundings for run seq.pass" in followed, followed
            # The coordinator deleted the roundings once the last pass was done.
            assert redis_keys(url, "qforge:{seq}:rounding:*") == []
        finally:
            for process in [coordinator, *workers.values()]:
                process.kill()
    assert (tmp_path / "cluster/model.safetensors").read_bytes() == \
        (tmp_path / "s1/model.safetensors").read_bytes()
