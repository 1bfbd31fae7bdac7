#!/usr/bin/env python3
"""An independent reader of a compressed-tensors W8A8 export (Python `safetensors` and
numpy only: no torch, no qforge code). It checks what vLLM reads, and that every int8
weight dequantizes to the native artifact's:

- `config.json`'s `quantization_config`: `compressed-tensors`, `int-quantized`,
  `compressed`; every config group's weights int8, symmetric, per output channel, static;
  its input activations per tensor and static, or per token and dynamic;
- every target of every group: `NAME.weight` int8 `[out, in]`, `NAME.weight_scale` f32
  `[out, 1]` and positive, `NAME.input_scale` f32 `[1]` and positive exactly when the
  group is static, no zero point; each row of weights reaches at least 63 in magnitude
  (symmetric per channel: a row's largest weight maps near ±127);
- `weight × weight_scale` equals the native artifact's, bit for bit;
- a quantized `lm_head` (a target) comes with `tie_word_embeddings: false`;
- every `ignore`d layer but a tied `lm_head` is present in floating point;
- every other tensor (embedding, norms, full-precision layers) is in `torch_dtype`
  (`bfloat16` or `float32`) and holds the native artifact's values, rounded to nearest
  (ties to even) when bf16;
- `transform_config` (online rotations): every scheme an online `random-hadamard` input
  transform without blocks, permutations or inverse; the modules its `re:` targets match
  (from the start of the name, as Python's `re.match`) are exactly the layers reading the
  inputs the native artifact's `qforge.json` rotates online (`online_rotations`), in every
  decoder layer; each holds `NAME.SCHEME_input.weight`, `[n, n]` for its `n` inputs, every
  entry ±1 and `H Hᵀ = n I` (so `H / √n`, what vLLM applies, is orthogonal); and all of a
  scheme's matrices are the same, because vLLM loads them into one shared tensor.

Tensors are read one at a time, int8 ones whole and floating-point ones a block at a
time, so an 8 GB export needs memory for its largest int8 tensor, not for the file.

Usage: scripts/check_compressed_tensors.py EXPORT_DIR NATIVE_ARTIFACT_DIR
Prints a JSON summary; exits 1 with the first failed check.
"""

import json
import re
import struct
import sys
from pathlib import Path

import numpy as np
from safetensors import safe_open


class ExportError(Exception):
    """An export that vLLM would read wrongly or not at all."""


def require(condition, message):
    if not condition:
        raise ExportError(message)


# Floating-point tensors are compared this many values at a time.
BLOCK = 1 << 24


class RawTensors:
    """A safetensors file's tensors read straight from its header and bytes:
    numpy has no bfloat16, so `safetensors.numpy` cannot read one."""

    def __init__(self, path):
        self.path = path
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            self.header = json.loads(f.read(length))
        self.header.pop("__metadata__", None)
        self.data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + length)

    def dtype(self, name):
        return self.header[name]["dtype"]

    def floats(self, name):
        """The tensor's values as flat float32, in blocks of BLOCK."""
        info = self.header[name]
        begin, end = info["data_offsets"]
        raw = self.data[begin:end]
        if info["dtype"] == "BF16":
            values = raw.view(np.uint16)
        elif info["dtype"] == "F32":
            values = raw.view(np.float32)
        else:
            raise ExportError(f"{name}: {info['dtype']} where a float tensor belongs")
        for start in range(0, len(values), BLOCK):
            block = values[start:start + BLOCK]
            if info["dtype"] == "BF16":
                block = (block.astype(np.uint32) << 16).view(np.float32)
            yield block


def round_to_bf16(values):
    """float32 values rounded to the nearest bfloat16, ties to even, as float32."""
    bits = values.view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) & np.uint32(0xFFFF0000)
    return rounded.view(np.float32)


def check_float(name, dtype, export, native):
    """An unquantized tensor of the export: in the checkpoint's dtype, with the native
    artifact's values."""
    require(export.dtype(name) == dtype, f"{name}: {export.dtype(name)} in a {dtype} checkpoint")
    require(name in native.header, f"{name}: not in the native artifact")
    ours = native.floats(name)
    for block in export.floats(name):
        expected = next(ours)
        if dtype == "BF16":
            expected = round_to_bf16(expected)
        require(np.array_equal(block, expected),
                f"{name}: values differ from the native artifact's")


def check_groups(quantization):
    """The config groups, checked: (targets, whether their inputs are static) per group."""
    require(quantization.get("quant_method") == "compressed-tensors", "quant_method")
    require(quantization.get("format") == "int-quantized", "format")
    require(quantization.get("quantization_status") == "compressed", "quantization_status")
    groups = []
    for name, group in quantization["config_groups"].items():
        w = group["weights"]
        require((w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["dynamic"])
                == (8, "int", True, "channel", False), f"{name}: weights {w}")
        inputs = group["input_activations"]
        static = inputs["strategy"] == "tensor"
        require((inputs["strategy"], inputs["dynamic"]) in (("tensor", False), ("token", True)),
                f"{name}: input activations {inputs}")
        groups.append((group["targets"], static))
    return groups


def check_layer(name, static, export, native):
    """One quantized linear layer against the native artifact."""
    weight = export.get_tensor(f"{name}.weight")
    scale = export.get_tensor(f"{name}.weight_scale")
    require(weight.dtype == np.int8 and weight.ndim == 2, f"{name}.weight: {weight.dtype}")
    require(scale.dtype == np.float32 and scale.shape == (weight.shape[0], 1),
            f"{name}.weight_scale: {scale.dtype} {scale.shape}")
    require(np.all(scale > 0), f"{name}.weight_scale: a scale is not positive")
    has_input_scale = f"{name}.input_scale" in export.keys()
    require(has_input_scale == static,
            f"{name}: input_scale {'missing' if static else 'present'} for a "
            f"{'static' if static else 'dynamic'} group")
    if static:
        input_scale = export.get_tensor(f"{name}.input_scale")
        require(input_scale.dtype == np.float32 and input_scale.shape == (1,)
                and input_scale[0] > 0, f"{name}.input_scale: {input_scale}")
    require(np.all(np.abs(weight.astype(np.int32)).max(axis=1) >= 63),
            f"{name}: a row does not use its range")
    ours = native.get_tensor(f"{name}.weight").astype(np.float32) \
        * native.get_tensor(f"{name}.weight_scale")
    require(np.array_equal(weight.astype(np.float32) * scale, ours),
            f"{name}: dequantized weights differ from the native artifact's")
    return weight.nbytes


# The modules of a decoder layer that read each input qforge rotates online.
CONSUMERS = {
    "self_attn.q_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
    "self_attn.o_proj": ["self_attn.o_proj"],
    "mlp.gate_proj": ["mlp.gate_proj", "mlp.up_proj"],
    "mlp.down_proj": ["mlp.down_proj"],
}


def check_transforms(config, native_dir, export, raw_export, in_features):
    """The online transforms against the native artifact's online rotations; gives the
    names of the transform tensors and each scheme's modules."""
    native = json.loads((native_dir / "qforge.json").read_text())
    rotated = native.get("online_rotations", [])
    expected = {f"model.layers.{i}.{m}" for i in range(config["num_hidden_layers"])
                for r in rotated for m in CONSUMERS[r]}
    groups = (config["quantization_config"].get("transform_config") or {}).get("config_groups")
    groups = groups or {}
    tensors, transformed = set(), {}
    for scheme, group in groups.items():
        require((group["type"], group.get("head_dim"), group.get("randomize", False))
                == ("random-hadamard", None, False), f"transform {scheme}: {group}")
        first = None
        for args in group["apply"]:
            require((args["location"], args.get("inverse", False)) == ("input", False),
                    f"transform {scheme}: {args}")
            patterns = [re.compile(t[3:]) for t in args["targets"]]
            require(all(t.startswith("re:") for t in args["targets"]),
                    f"transform {scheme}: targets {args['targets']}")
            for module in in_features:
                if not any(p.match(module) for p in patterns):
                    continue
                require(module not in transformed, f"{module}: two online input transforms")
                transformed[module] = scheme
                key = f"{module}.{scheme}_input.weight"
                require(key in export.keys(), f"{key}: missing")
                n = in_features[module]
                h = np.concatenate(list(raw_export.floats(key)))
                require(h.size == n * n, f"{key}: {h.size} values, not {n}×{n}")
                h = h.reshape(n, n)
                if first is None:
                    require(np.all(np.abs(h) == 1), f"{key}: an entry is not ±1")
                    gram = h.astype(np.float64) @ h.T.astype(np.float64)
                    require(np.array_equal(gram, n * np.eye(n)), f"{key}: H Hᵀ ≠ n I")
                    first = h
                require(np.array_equal(h, first),
                        f"{key}: differs from the scheme's other matrices (vLLM shares one)")
                tensors.add(key)
    require(set(transformed) == expected,
            f"online transforms on {sorted(set(transformed) ^ expected)[:4]}…: the artifact "
            f"rotates {rotated} online")
    return tensors, sorted(set(transformed.values()))


def check(export_dir, native_dir):
    config = json.loads((export_dir / "config.json").read_text())
    groups = check_groups(config["quantization_config"])
    summary = {"quantized_layers": 0, "static_layers": 0, "int8_bytes": 0,
               "file_bytes": (export_dir / "model.safetensors").stat().st_size}
    dtypes = {"bfloat16": "BF16", "float32": "F32"}
    require(config.get("torch_dtype") in dtypes, f"torch_dtype {config.get('torch_dtype')}")
    dtype = dtypes[config["torch_dtype"]]
    with safe_open(export_dir / "model.safetensors", framework="numpy") as export, \
            safe_open(native_dir / "model.safetensors", framework="numpy") as native:
        names = set(export.keys())
        require(not any("zero_point" in n for n in names), "a zero point is written")
        for targets, static in groups:
            # A quantized head is its own matrix: tied, vLLM would use the embedding.
            require("lm_head" not in targets or config.get("tie_word_embeddings") is False,
                    "lm_head is quantized but tie_word_embeddings is not false")
            for name in targets:
                summary["int8_bytes"] += check_layer(name, static, export, native)
                summary["quantized_layers"] += 1
                summary["static_layers"] += static
        for name in config["quantization_config"]["ignore"]:
            if name == "lm_head" and config.get("tie_word_embeddings"):
                require("lm_head.weight" not in names, "a tied lm_head is written")
                continue
            require(f"{name}.weight" in names, f"{name}: ignored but not written")
        raw_export = RawTensors(export_dir / "model.safetensors")
        in_features = {n[:-len(".weight")]: raw_export.header[n]["shape"][1] for n in names
                       if n.endswith("_proj.weight")}
        transforms, schemes = check_transforms(config, native_dir, export, raw_export,
                                               in_features)
    raw_native = RawTensors(native_dir / "model.safetensors")
    quantized = {f"{name}.{part}" for targets, _ in groups for name in targets
                 for part in ("weight", "weight_scale", "input_scale")}
    for name in sorted(names - quantized - transforms):
        check_float(name, dtype, raw_export, raw_native)
        summary["float_tensors"] = summary.get("float_tensors", 0) + 1
    summary["ignored"] = config["quantization_config"]["ignore"]
    summary["transform_schemes"] = schemes
    summary["transform_tensors"] = len(transforms)
    summary["torch_dtype"] = config["torch_dtype"]
    return summary


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__.strip().splitlines()[-2])
    try:
        print(json.dumps(check(Path(sys.argv[1]), Path(sys.argv[2]))))
    except ExportError as e:
        sys.exit(f"export rejected: {e}")


if __name__ == "__main__":
    main()
