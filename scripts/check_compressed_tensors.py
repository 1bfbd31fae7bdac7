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
  (ties to even) when bf16.

Tensors are read one at a time, int8 ones whole and floating-point ones a block at a
time, so an 8 GB export needs memory for its largest int8 tensor, not for the file.

Usage: scripts/check_compressed_tensors.py EXPORT_DIR NATIVE_ARTIFACT_DIR
Prints a JSON summary; exits 1 with the first failed check.
"""

import json
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
    raw_native = RawTensors(native_dir / "model.safetensors")
    quantized = {f"{name}.{part}" for targets, _ in groups for name in targets
                 for part in ("weight", "weight_scale", "input_scale")}
    for name in sorted(names - quantized):
        check_float(name, dtype, raw_export, raw_native)
        summary["float_tensors"] = summary.get("float_tensors", 0) + 1
    summary["ignored"] = config["quantization_config"]["ignore"]
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
