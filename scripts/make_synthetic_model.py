#!/usr/bin/env python3
"""Write a seeded, random Llama of a real model's shape, for measuring qforge at scale.

No trained Llama-3-8B can be downloaded where qforge is tested, and what scale tests
need is the shape, not the knowledge: the tensor sizes the kernels and calibrators see,
bf16 shards, GQA, Llama 3's rotary scaling, and a few outlier channels of the kind that
make INT8 activations hard. This script writes a Hugging Face directory with exactly
that: `config.json` (Llama-3.1-8B's or Llama-3.2-1B's hyper-parameters), bf16
safetensors shards with `model.safetensors.index.json`, and no tokenizer (calibration
data are token ids). Optionally it writes calibration data as `token_ids` JSONL.

Weights are drawn from N(0, 0.02) (Llama's `initializer_range`), norm gains from
N(1, 0.05); then, as in trained models (SmoothQuant, Xiao et al. 2022; "Massive
activations", Sun et al. 2024), a few residual channels carry large norm gains and a
few MLP channels large `up_proj` rows, so the inputs of q/k/v, gate/up and down_proj
have outlier channels. Every tensor is drawn from its own generator seeded by
(--seed, tensor name), so the output depends on the seed and the shape only.

Shapes (parameters, bf16 bytes):
  llama3-8b     32 layers, 4096 wide, MLP 14336, 32 heads / 8 KV, vocab 128256: 8.0 G, 16.1 GB
  llama3.2-1b   16 layers, 2048 wide, MLP 8192, 32 heads / 8 KV, vocab 128256, tied: 1.2 G, 2.5 GB
  tiny          4 layers, 128 wide, MLP 384, 8 heads / 2 KV, vocab 1024 (Llama-3 structure,
                for tests)

Usage:
  python scripts/make_synthetic_model.py --shape llama3.2-1b --out /tmp/llama-1b \\
      --calibration /tmp/llama-1b.jsonl --samples 16 --seq-len 512
"""

import argparse
import hashlib
import json
import struct
import sys
import time
from pathlib import Path

import numpy as np

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

SHAPES = {
    # Llama-3.1-8B's config.json.
    "llama3-8b": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      tie_word_embeddings=False, rope_scaling=LLAMA3_ROPE,
                      max_position_embeddings=131072),
    # Llama-3.2-1B's config.json.
    "llama3.2-1b": dict(num_hidden_layers=16, hidden_size=2048, intermediate_size=8192,
                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                        tie_word_embeddings=True, rope_scaling=dict(LLAMA3_ROPE, factor=32.0),
                        max_position_embeddings=131072),
    "tiny": dict(num_hidden_layers=4, hidden_size=128, intermediate_size=384,
                 num_attention_heads=8, num_key_value_heads=2, vocab_size=1024,
                 tie_word_embeddings=False, rope_scaling=LLAMA3_ROPE,
                 max_position_embeddings=131072),
}

BOS, EOS = 128000, 128001
INIT_STD = 0.02
# Residual channels with large norm gains, and MLP channels with large up_proj rows.
OUTLIER_RESIDUAL_CHANNELS = 4
OUTLIER_RESIDUAL_GAIN = 20.0
OUTLIER_MLP_CHANNELS = 8
OUTLIER_MLP_SCALE = 10.0


def config_json(shape):
    s = SHAPES[shape]
    vocab = s["vocab_size"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "head_dim": s["hidden_size"] // s["num_attention_heads"],
        "initializer_range": INIT_STD,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        # The tiny shape has its own small vocabulary: BOS and EOS are its last ids.
        "bos_token_id": BOS if vocab > BOS else vocab - 2,
        "eos_token_id": EOS if vocab > EOS else vocab - 1,
        "torch_dtype": "bfloat16",
        "qforge_synthetic": f"scripts/make_synthetic_model.py --shape {shape}",
        **s,
    }


def tensors(config):
    """(name, shape) of every tensor, in the order Hugging Face shards them."""
    d, inter = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    out = [("model.embed_tokens.weight", (config["vocab_size"], d))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.input_layernorm.weight", (d,)),
            (f"{p}.self_attn.q_proj.weight", (d, d)),
            (f"{p}.self_attn.k_proj.weight", (kv, d)),
            (f"{p}.self_attn.v_proj.weight", (kv, d)),
            (f"{p}.self_attn.o_proj.weight", (d, d)),
            (f"{p}.post_attention_layernorm.weight", (d,)),
            (f"{p}.mlp.gate_proj.weight", (inter, d)),
            (f"{p}.mlp.up_proj.weight", (inter, d)),
            (f"{p}.mlp.down_proj.weight", (d, inter)),
        ]
    out.append(("model.norm.weight", (d,)))
    if not config["tie_word_embeddings"]:
        out.append(("lm_head.weight", (config["vocab_size"], d)))
    return out


def generator(seed, name):
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:16], "little"))


def outlier_channels(seed, what, width, count):
    return np.sort(generator(seed, f"outliers/{what}").choice(width, count, replace=False))


def bf16_bytes(values):
    """f32 → bf16 by rounding to nearest even (what torch's `.to(torch.bfloat16)` does)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype("<u2").tobytes()


def write_tensor(f, seed, name, shape, config):
    """Draws tensor `name` and writes it as bf16, a block of rows at a time."""
    rng = generator(seed, name)
    if len(shape) == 1:
        gains = rng.normal(1.0, 0.05, size=shape).astype(np.float32)
        if name.endswith("layernorm.weight"):
            channels = outlier_channels(seed, "residual", shape[0], OUTLIER_RESIDUAL_CHANNELS)
            gains[channels] = OUTLIER_RESIDUAL_GAIN
        f.write(bf16_bytes(gains))
        return
    rows, cols = shape
    scaled_rows = None
    if name.endswith("mlp.up_proj.weight"):
        scaled_rows = outlier_channels(seed, "mlp", rows, OUTLIER_MLP_CHANNELS)
    block = max(1, (16 << 20) // cols)
    for start in range(0, rows, block):
        stop = min(rows, start + block)
        values = rng.normal(0.0, INIT_STD, size=(stop - start, cols)).astype(np.float32)
        if scaled_rows is not None:
            inside = scaled_rows[(scaled_rows >= start) & (scaled_rows < stop)]
            values[inside - start] *= OUTLIER_MLP_SCALE
        f.write(bf16_bytes(values))


def shard(tensor_list, shard_bytes):
    shards, current, size = [], [], 0
    for name, shape in tensor_list:
        nbytes = 2 * int(np.prod(shape))
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += nbytes
    shards.append(current)
    return shards


def write_model(shape, seed, out, shard_bytes):
    config = config_json(shape)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shards = shard(tensors(config), shard_bytes)
    weight_map, total = {}, 0
    started = time.monotonic()
    for k, members in enumerate(shards):
        file = (f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1
                else "model.safetensors")
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape_ in members:
            nbytes = 2 * int(np.prod(shape_))
            header[name] = {"dtype": "BF16", "shape": list(shape_),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = file
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        with open(out / file, "wb") as f:
            f.write(struct.pack("<Q", len(encoded)))
            f.write(encoded)
            for name, shape_ in members:
                write_tensor(f, seed, name, shape_, config)
        total += offset
        print(f"{file}: {offset / 1e9:.2f} GB ({time.monotonic() - started:.0f} s)",
              file=sys.stderr)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return config


def write_calibration(config, seed, path, samples, seq_len):
    """`samples` episodes of `seq_len` token ids: BOS, then ids drawn from a Zipf
    law over the vocabulary (as word frequencies are), so some tokens recur."""
    rng = generator(seed, "calibration")
    vocab, bos = config["vocab_size"], config["bos_token_id"]
    ranks = np.arange(1, vocab - 1, dtype=np.float64)
    p = 1.0 / ranks
    p /= p.sum()
    permutation = rng.permutation(vocab - 2)  # ids below BOS/EOS in the tiny shape
    with open(path, "w") as f:
        for _ in range(samples):
            ids = permutation[rng.choice(len(p), size=seq_len - 1, p=p)]
            f.write(json.dumps({"token_ids": [bos, *map(int, ids)]}) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--out", type=Path, required=True, help="the model directory to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-bytes", type=float, default=5e9,
                        help="largest shard, bytes (default 5e9, as Hugging Face shards)")
    parser.add_argument("--calibration", type=Path,
                        help="also write calibration episodes as token_ids JSONL here")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()
    if args.samples < 1 or args.seq_len < 2:
        parser.error("--samples must be at least 1 and --seq-len at least 2")
    config = write_model(args.shape, args.seed, args.out, int(args.shard_bytes))
    if args.calibration:
        write_calibration(config, args.seed, args.calibration, args.samples, args.seq_len)


if __name__ == "__main__":
    main()
