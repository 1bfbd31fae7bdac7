"""qforge's compressed-tensors export read by an independent reader
(`scripts/check_compressed_tensors.py`: Python `safetensors` + numpy, no torch, no
qforge code): `qforge quantize` SmolLM2 with static, dynamic and full-precision
layers, `qforge export --format compressed-tensors`, then check what vLLM reads — the
quantization_config, every tensor's name, dtype and shape, no zero points — and that
the dequantized weights equal the native artifact's.
"""

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from check_compressed_tensors import ExportError, check  # noqa: E402
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
    # The int8 head the guard measured, untied, rather than the tied embedding.
    assert summary["lm_head"] == "int8"

    config = json.loads((tmp_path / "ct/config.json").read_text())
    q = config["quantization_config"]
    assert q["quant_method"] == "compressed-tensors"
    assert q["format"] == "int-quantized"
    assert q["quantization_status"] == "compressed"
    assert q["ignore"] == [FP_POINT]
    assert config["tie_word_embeddings"] is False
    groups = list(q["config_groups"].values())
    static = [g for g in groups if g["input_activations"]["strategy"] == "tensor"]
    dynamic = [g for g in groups if g["input_activations"]["strategy"] == "token"]
    assert len(static) == 1 and len(dynamic) == 1
    assert dynamic[0]["targets"] == ["lm_head"]  # the static recipe's one dynamic layer
    targets = static[0]["targets"]
    layers = config["num_hidden_layers"]
    assert len(targets) == 7 * layers - 1  # every linear but lm_head and the FP down_proj

    # The reader vLLM's side of the format needs: every target's tensors, and
    # dequantized weights equal to the native artifact's.
    summary = check(tmp_path / "ct", tmp_path / "artifact")
    assert summary["quantized_layers"] == len(targets) + 1
    assert summary["static_layers"] == len(targets)

    tensors = load_file(str(tmp_path / "ct/model.safetensors"))
    assert tensors["lm_head.weight"].dtype == np.int8
    assert tensors[f"{FP_POINT}.weight"].dtype == np.float32
    assert f"{FP_POINT}.weight_scale" not in tensors
    hidden = config["hidden_size"]
    assert tensors["model.embed_tokens.weight"].shape == (config["vocab_size"], hidden)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (hidden, hidden)

    verified = qforge("verify", "ct", cwd=tmp_path)
    assert verified["files"] == 4

    # The reader refuses what vLLM would read wrongly: one row's scale off by
    # a factor of two, and weights declared asymmetric.
    name = targets[3]
    tampered = tmp_path / "tampered"
    tampered.mkdir()
    (tampered / "config.json").write_text((tmp_path / "ct/config.json").read_text())
    tensors[f"{name}.weight_scale"] = tensors[f"{name}.weight_scale"].copy()
    tensors[f"{name}.weight_scale"][5, 0] *= 2
    save_file(tensors, str(tampered / "model.safetensors"))
    with pytest.raises(ExportError, match=f"{name}: dequantized weights differ"):
        check(tampered, tmp_path / "artifact")
    first_group = next(iter(config["quantization_config"]["config_groups"].values()))
    first_group["weights"]["symmetric"] = False
    (tampered / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="weights"):
        check(tampered, tmp_path / "artifact")


def test_online_rotations_export_as_transforms(tmp_path):
    """QuaRot (`--hadamard quarot`: the residual rotated offline, down_proj's input online)
    exports its online rotation as a compressed-tensors transform vLLM applies: one
    `random-hadamard` input scheme on every layer's down_proj, its ±1 matrix stored per
    layer (the reader checks them against the artifact's `online_rotations`); a matrix that
    differs from the others, which vLLM would load into its one shared tensor, is refused;
    and a rotation of lm_head's input, which vLLM cannot apply, is not exported."""
    common = ["--model", str(ROOT / "models/smollm2-135m-instruct-q4_1.gguf"),
              "--data", str(ROOT / "fixtures/episodes/arithmetic.jsonl"), "--samples", "8",
              "--seq-len", "64", "--activations", "dynamic",
              "--max-perplexity-increase", "1000", "--eval-data",
              str(ROOT / "fixtures/text/eval.txt"), "--ctx", "128"]
    qforge("quantize", *common, "--hadamard", "quarot", "-o", "artifact", cwd=tmp_path)
    summary = qforge("export", "--model", "artifact", "--format", "compressed-tensors",
                     "-o", "ct", cwd=tmp_path)
    assert summary["online_rotations"] == ["mlp.down_proj"]
    config = json.loads((tmp_path / "ct/config.json").read_text())
    schemes = config["quantization_config"]["transform_config"]["config_groups"]
    assert list(schemes) == ["hadamard_mlp_down_proj"]
    assert schemes["hadamard_mlp_down_proj"]["type"] == "random-hadamard"

    checked = check(tmp_path / "ct", tmp_path / "artifact")
    assert checked["transform_schemes"] == ["hadamard_mlp_down_proj"]
    assert checked["transform_tensors"] == config["num_hidden_layers"]

    # One sign flipped in layer 3's matrix: bf16 stores the sign in its high byte.
    tampered = tmp_path / "tampered"
    shutil.copytree(tmp_path / "ct", tampered)
    weights = tampered / "model.safetensors"
    data = bytearray(weights.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    key = "model.layers.3.mlp.down_proj.hadamard_mlp_down_proj_input.weight"
    assert header[key]["dtype"] == "BF16"
    data[8 + length + header[key]["data_offsets"][0] + 1] ^= 0x80
    weights.write_bytes(bytes(data))
    with pytest.raises(ExportError, match=f"{key}: differs from the scheme's other matrices"):
        check(tampered, tmp_path / "artifact")

    qforge("quantize", *common, "--hadamard", "lm_head", "-o", "head", cwd=tmp_path)
    out = subprocess.run([QFORGE, "export", "--model", "head", "--format",
                          "compressed-tensors", "-o", "head-ct"], cwd=tmp_path,
                         capture_output=True, text=True)
    assert out.returncode != 0
    assert "rotates lm_head's input online, which vLLM cannot apply" in out.stderr
