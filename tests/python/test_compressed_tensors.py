"""An independent reader of qforge's compressed-tensors export (Python `safetensors`
+ numpy, no torch, no qforge code): `qforge quantize` SmolLM2 with static, dynamic
and full-precision layers, `qforge export --format compressed-tensors`, then check
what vLLM reads — the quantization_config, every tensor's name, dtype and shape, no
zero points — and that the dequantized weights equal the native artifact's.
"""

import json
import os
import subprocess
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parents[2]
QFORGE = os.environ.get("QFORGE", str(ROOT / "target/release/qforge"))
FP_POINT = "model.layers.0.mlp.down_proj"


def qforge(*args, cwd):
    out = subprocess.run([QFORGE, *args, "--json"], cwd=cwd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_export_reads_back_as_w8a8(tmp_path):
    qforge("quantize", "--model", str(ROOT / "models/smollm2-135m-instruct-q4_1.gguf"),
           "--data", str(ROOT / "fixtures/episodes/arithmetic.jsonl"), "--samples", "8",
           "--seq-len", "64", "--activations", "static", "--ignore", FP_POINT,
           # Accept the recipe's plan as it is: this test is about the format.
           "--max-perplexity-increase", "1000", "--eval-data", str(ROOT / "fixtures/text/eval.txt"),
           "--ctx", "128", "-o", "artifact", cwd=tmp_path)
    summary = qforge("export", "--model", "artifact", "--format", "compressed-tensors",
                     "-o", "ct", cwd=tmp_path)
    assert summary["lm_head"] == "tied"

    config = json.loads((tmp_path / "ct/config.json").read_text())
    q = config["quantization_config"]
    assert q["quant_method"] == "compressed-tensors"
    assert q["format"] == "int-quantized"
    assert q["quantization_status"] == "compressed"
    assert q["ignore"] == [FP_POINT, "lm_head"]
    assert config["tie_word_embeddings"] is True
    groups = list(q["config_groups"].values())
    static = [g for g in groups if g["input_activations"]["strategy"] == "tensor"]
    dynamic = [g for g in groups if g["input_activations"]["strategy"] == "token"]
    assert len(static) == 1 and len(dynamic) == 0  # lm_head, the only dynamic layer, is ignored
    for g in groups:
        w = g["weights"]
        assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["dynamic"]) == \
            (8, "int", True, "channel", False)
    assert static[0]["input_activations"]["dynamic"] is False
    targets = static[0]["targets"]
    layers = config["num_hidden_layers"]
    assert len(targets) == 7 * layers - 1  # every linear but lm_head and the FP down_proj

    tensors = load_file(str(tmp_path / "ct/model.safetensors"))
    native = load_file(str(tmp_path / "artifact/model.safetensors"))
    assert not any("zero_point" in name for name in tensors)
    assert "lm_head.weight" not in tensors  # tied: vLLM reuses the embedding
    for name in targets:
        weight, scale = tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"]
        input_scale = tensors[f"{name}.input_scale"]
        assert weight.dtype == np.int8 and weight.ndim == 2, name
        assert scale.dtype == np.float32 and scale.shape == (weight.shape[0], 1), name
        assert input_scale.dtype == np.float32 and input_scale.shape == (1,), name
        assert input_scale[0] > 0 and np.all(scale > 0), name
        # Symmetric per-channel: every row uses its whole range on one side.
        assert np.all(np.abs(weight.astype(np.int32)).max(axis=1) >= 63), name
        dequantized = weight.astype(np.float32) * scale
        ours = native[f"{name}.weight"].astype(np.float32) * native[f"{name}.weight_scale"]
        np.testing.assert_array_equal(dequantized, ours)
    assert tensors[f"{FP_POINT}.weight"].dtype == np.float32
    assert f"{FP_POINT}.weight_scale" not in tensors
    hidden = config["hidden_size"]
    assert tensors["model.embed_tokens.weight"].shape == (config["vocab_size"], hidden)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (hidden, hidden)

    verified = qforge("verify", "ct", cwd=tmp_path)
    assert verified["files"] == 4
