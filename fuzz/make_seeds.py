#!/usr/bin/env python3
"""Writes the seed inputs of qforge's fuzz targets into fuzz/corpus/<target>/.

Standard library only. Run from the repository root, after
`cargo build --release -p qforge-cli` (the .qstats seeds are made by
`qforge stats observe`, `stats merge` and `demo`):

    python3 fuzz/make_seeds.py

The seeds are where the committed corpora started; fuzzing grew them and
`cargo fuzz cmin` renamed and thinned them (see fuzz/README.md).
"""

import json
import math
import pathlib
import struct
import subprocess
import tempfile
import zlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
SEEDS = ROOT / "fuzz" / "corpus"


def write(target, name, data):
    d = SEEDS / target
    d.mkdir(parents=True, exist_ok=True)
    assert len(data) <= 64 * 1024, (target, name, len(data))
    (d / name).write_bytes(data)


# ---------------------------------------------------------------- GGUF

GGUF_TYPES = {"u8": 0, "i8": 1, "u16": 2, "i16": 3, "u32": 4, "i32": 5, "f32": 6,
              "bool": 7, "str": 8, "arr": 9, "u64": 10, "i64": 11, "f64": 12}
FMT = {"u8": "<B", "i8": "<b", "u16": "<H", "i16": "<h", "u32": "<I", "i32": "<i",
       "f32": "<f", "bool": "<?", "u64": "<Q", "i64": "<q", "f64": "<d"}
# GGML type: (code, block size, bytes per block)
GGML = {"F32": (0, 1, 4), "F16": (1, 1, 2), "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20),
        "Q8_0": (8, 32, 34), "BF16": (30, 1, 2)}


def gguf_str(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def gguf_code(kind):
    return GGUF_TYPES["arr"] if kind.startswith("arr:") else GGUF_TYPES[kind]


def gguf_value(kind, value):
    if kind == "str":
        return gguf_str(value)
    if kind.startswith("arr:"):
        item = kind[4:]
        out = struct.pack("<IQ", gguf_code(item), len(value))
        return out + b"".join(gguf_value(item, v) for v in value)
    return struct.pack(FMT[kind], value)


def gguf(metadata, tensors, version=3, alignment=32):
    """metadata: [(key, kind, value)]; tensors: [(name, dims innermost first, ggml type)]."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(metadata))
    for key, kind, value in metadata:
        out += gguf_str(key) + struct.pack("<I", gguf_code(kind)) + gguf_value(kind, value)
    data = b""
    for name, dims, ty in tensors:
        code, block, size = GGML[ty]
        n = 1
        for d in dims:
            n *= d
        nbytes = n // block * size
        while len(data) % alignment:
            data += b"\0"
        out += gguf_str(name) + struct.pack("<I", len(dims))
        out += b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", code, len(data))
        data += bytes((i * 7) % 251 for i in range(nbytes))
    while len(out) % alignment:
        out += b"\0"
    return out + data


def gguf_seeds():
    # The unit test's file: one F32 tensor.
    write("gguf_header", "tiny_f32", gguf([("general.architecture", "str", "llama")],
                                          [("w", [3, 2], "F32")]))
    # Version 2, a custom alignment, and one of every scalar type.
    scalars = [(f"t.{k}", k, v) for k, v in [
        ("u8", 200), ("i8", -3), ("u16", 60000), ("i16", -300), ("u32", 4_000_000_000),
        ("i32", -70000), ("f32", 1.5), ("bool", True), ("u64", 1 << 40), ("i64", -(1 << 40)),
        ("f64", 2.25), ("str", "héllo")]]
    write("gguf_header", "v2_all_scalars", gguf(
        [("general.alignment", "u32", 64)] + scalars,
        [("a", [32], "F16"), ("b", [64, 2], "Q8_0"), ("c", [32], "BF16")],
        version=2, alignment=64))
    # Arrays, nested arrays, and quantized tensors.
    write("gguf_header", "arrays_quantized", gguf(
        [("general.architecture", "str", "llama"),
         ("a.u32", "arr:u32", [1, 2, 3]),
         ("a.str", "arr:str", ["x", "yz", ""]),
         ("a.f32", "arr:f32", [0.5, -1.0]),
         ("a.nested", "arr:arr:u8", [[1, 2], []]),
         ("a.i64", "arr:i64", [-1, 1])],
        [("q4", [64, 2], "Q4_0"), ("q41", [32], "Q4_1")]))
    # A complete (tiny) llama with a byte-level BPE tokenizer, so
    # LlamaConfig::from_gguf and TextTokenizer::from_gguf both succeed.
    tokens = ["a", "b", "c", "ab", "abc", "Ġ", "<s>", "</s>"]
    types = [1, 1, 1, 1, 1, 1, 3, 3]
    hidden, heads, ffn, vocab = 8, 2, 16, len(tokens)
    meta = [
        ("general.architecture", "str", "llama"),
        ("llama.embedding_length", "u32", hidden),
        ("llama.attention.head_count", "u32", heads),
        ("llama.attention.head_count_kv", "u32", 1),
        ("llama.feed_forward_length", "u32", ffn),
        ("llama.block_count", "u32", 1),
        ("llama.context_length", "u32", 64),
        ("llama.attention.layer_norm_rms_epsilon", "f32", 1e-5),
        ("llama.rope.freq_base", "f32", 10000.0),
        ("llama.rope.scaling.type", "str", "llama3"),
        ("llama.rope.scaling.factor", "f32", 8.0),
        ("llama.rope.scaling.low_freq_factor", "f32", 1.0),
        ("llama.rope.scaling.high_freq_factor", "f32", 4.0),
        ("llama.rope.scaling.original_context_length", "u32", 8192),
        ("tokenizer.ggml.model", "str", "gpt2"),
        ("tokenizer.ggml.pre", "str", "smollm"),
        ("tokenizer.ggml.tokens", "arr:str", tokens),
        ("tokenizer.ggml.token_type", "arr:i32", types),
        ("tokenizer.ggml.merges", "arr:str", ["a b", "ab c"]),
        ("tokenizer.ggml.bos_token_id", "u32", 6),
        ("tokenizer.ggml.eos_token_id", "u32", 7),
        ("tokenizer.ggml.add_bos_token", "bool", False),
    ]
    tensors = [("token_embd.weight", [hidden, vocab], "F32"),
               ("output_norm.weight", [hidden], "F32"),
               ("blk.0.attn_q.weight", [hidden, hidden], "F32"),
               ("blk.0.ffn_down.weight", [ffn, hidden], "F16")]
    write("gguf_header", "tiny_llama_gpt2_tokenizer", gguf(meta, tensors))
    # The same for Qwen2 (llama3-style pre-tokenizer regex).
    qmeta = [(k.replace("llama.", "qwen2."), t, v) for k, t, v in meta
             if "rope.scaling" not in k]
    qmeta = [(k, t, "qwen2" if k in ("general.architecture", "tokenizer.ggml.pre") else v)
             for k, t, v in qmeta]
    write("gguf_header", "tiny_qwen2_tokenizer", gguf(qmeta, tensors[:2]))
    # Truncated real model: the header of SmolLM2 is far longer than 64 KiB
    # (its 49152-token vocabulary), so parsing must fail cleanly.
    model = ROOT / "models" / "smollm2-135m-instruct-q4_1.gguf"
    if model.exists():
        with open(model, "rb") as f:
            write("gguf_header", "seed-smollm2-first-64KiB", f.read(64 * 1024))


# ---------------------------------------------------------------- policies

def safetensors(tensors):
    """tensors: [(name, dtype, shape, raw bytes)]"""
    header, data = {}, b""
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def f32s(n, scale=0.1):
    return struct.pack(f"<{n}f", *[scale * ((i * 37) % 11 - 5) for i in range(n)])


def mlp(widths, dtype="F32"):
    out = []
    for i, (inp, o) in enumerate(zip(widths, widths[1:])):
        if dtype == "F32":
            w, b = f32s(o * inp), f32s(o)
        else:  # F16 / BF16: 2 bytes each
            w, b = bytes(2 * o * inp), bytes(2 * o)
        out += [(f"layers.{i}.weight", dtype, [o, inp], w), (f"layers.{i}.bias", dtype, [o], b)]
    return safetensors(out)


def policy_json(obs, hidden, activation, head):
    return json.dumps({"format": "qforge-mlp-policy", "version": 1, "observation_dim": obs,
                       "hidden": hidden, "activation": activation, "head": head}).encode()


def policy_seeds():
    for name in ("cartpole", "pendulum"):
        d = ROOT / "fixtures" / "policies" / name
        write("policy", f"fixture_{name}",
              (d / "policy.json").read_bytes() + b"\xff" + (d / "model.safetensors").read_bytes())
    write("policy", "linear_value", policy_json(2, [], "relu", {"kind": "value"})
          + b"\xff" + mlp([2, 1]))
    write("policy", "relu_discrete", policy_json(3, [4], "relu", {"kind": "discrete", "actions": 2})
          + b"\xff" + mlp([3, 4, 2]))
    write("policy", "gaussian_f16", policy_json(
        2, [3, 3], "tanh", {"kind": "gaussian", "action_dim": 2, "low": [-1, -2], "high": [1, 2]})
        + b"\xff" + mlp([2, 3, 3, 2], "F16"))
    write("policy", "missing_tensor", policy_json(1, [2], "tanh", {"kind": "discrete", "actions": 1})
          + b"\xff" + mlp([1, 2]))


# ---------------------------------------------------------------- HF configs

def hf_seeds():
    configs = {
        "llama3_1_8b": {
            "architectures": ["LlamaForCausalLM"], "attention_bias": False,
            "attention_dropout": 0.0, "bos_token_id": 128000,
            "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
            "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
            "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
            "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
            "pretraining_tp": 1, "rms_norm_eps": 1e-05,
            "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192,
                             "rope_type": "llama3"},
            "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256},
        "qwen2_5_0_5b": {
            "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
            "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
            "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
            "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2",
            "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
            "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
            "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False,
            "vocab_size": 151936},
        "smollm2_135m": {
            "architectures": ["LlamaForCausalLM"], "attention_bias": False,
            "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "head_dim": 64,
            "hidden_act": "silu", "hidden_size": 576, "initializer_range": 0.041666666666666664,
            "intermediate_size": 1536, "is_llama_config": True, "max_position_embeddings": 8192,
            "mlp_bias": False, "model_type": "llama", "num_attention_heads": 9,
            "num_hidden_layers": 30, "num_key_value_heads": 3, "pad_token_id": 2,
            "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_interleaved": False,
            "rope_scaling": None, "rope_theta": 100000, "tie_word_embeddings": True,
            "torch_dtype": "bfloat16", "transformers_version": "4.42.3", "use_cache": True,
            "vocab_size": 49152},
        "mistral_7b": {
            "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
            "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
            "max_position_embeddings": 32768, "model_type": "mistral",
            "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32768},
        "model_type_only_default_rope": {
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100,
            "rope_scaling": {"type": "default"}},
        "unknown_rope_type": {
            "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 1,
            "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 1,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
    }
    for name, c in configs.items():
        write("hf_config", name, json.dumps(c, indent=2).encode())


# ---------------------------------------------------------------- .qstats

def seal(body):
    """A .qstats file around `body`: magic, version 1, length, body, CRC-32."""
    out = b"QFSTATS\0" + struct.pack("<IQ", 1, len(body)) + body
    return out + struct.pack("<I", zlib.crc32(out))


def qstats_seeds():
    qforge = ROOT / "target" / "release" / "qforge"
    if not qforge.exists():
        raise SystemExit("build the CLI first: cargo build --release -p qforge-cli")
    nan, inf = float("nan"), float("inf")
    inputs = {  # name: (tensor name, channels, values)
        "small": ("act.small", None, [1.0, -2.0, 0.0, nan, 7.5, -0.25, inf, -inf]),
        "rows": ("model.layers.0.mlp.down_proj", 4, [math.sin(i) * 3 for i in range(12)]),
        "one": ("values", None, [1e-30]),
        "zeros": ("values", 2, [0.0] * 4),
        "wide": ("values", 8, [math.exp(i % 64 - 32) * (-1) ** i for i in range(256)]),
    }
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        run = lambda *args: subprocess.run([str(qforge), *args], check=True,
                                           stdout=subprocess.DEVNULL)
        for name, (tensor, channels, values) in inputs.items():
            raw = tmp / f"{name}.f32"
            raw.write_bytes(struct.pack(f"<{len(values)}f", *values))
            extra = ["--channels", str(channels)] if channels else []
            run("stats", "observe", "--input", str(raw), "--name", tensor, *extra,
                "-o", str(tmp / f"{name}.qstats"))
        run("stats", "merge", "--force", *(str(tmp / f"{n}.qstats") for n in
                                           ("small", "rows", "one")),
            "-o", str(tmp / "merged.qstats"))
        run("demo", "--values", "20000", "--batches", "4", "--workers", "2",
            "-o", str(tmp / "demo"))
        for name in [*inputs, "merged"]:
            write("qstats_decode", f"observe_{name}", (tmp / f"{name}.qstats").read_bytes())
        write("qstats_decode", "demo_20k", (tmp / "demo" / "demo.qstats").read_bytes())
        # Bodies alone: the target also decodes its input sealed as a body.
        for name in ("rows", "merged"):
            write("qstats_decode", f"observe_{name}_body",
                  (tmp / f"{name}.qstats").read_bytes()[20:-4])
    # No provenance, no tensors: flags, five empty sets, zero tensors.
    empty = bytes(7)
    write("qstats_decode", "empty_stats", seal(empty))
    write("qstats_decode", "empty_stats_body", empty)
    write("qstats_decode", "truncated_header", b"QFSTATS\0\x01\x00")
    write("qstats_decode", "bad_magic", b"PK\x03\x04rest")


# ---------------------------------------------------------------- ONNX

def pb_varint(n):
    n &= (1 << 64) - 1
    out = b""
    while n >= 0x80:
        out += bytes([(n & 0x7F) | 0x80])
        n >>= 7
    return out + bytes([n])


def pb_int(field, n):
    return pb_varint(field << 3) + pb_varint(n)


def pb_bytes(field, b):
    if isinstance(b, str):
        b = b.encode()
    return pb_varint(field << 3 | 2) + pb_varint(len(b)) + b


def onnx_model(nodes, initializers):
    """A ModelProto (opset 13) whose graph maps input `x` to output `y`.

    nodes: [(op, inputs, output, {attribute: int})];
    initializers: [(name, dims, float values)]."""
    graph = b""
    for op, inputs, output, attributes in nodes:
        node = b"".join(pb_bytes(1, i) for i in inputs) + pb_bytes(2, output) + pb_bytes(4, op)
        for name, value in attributes.items():
            node += pb_bytes(5, pb_bytes(1, name) + pb_int(3, value) + pb_int(20, 2))
        graph += pb_bytes(1, node)
    for name, dims, values in initializers:
        tensor = b"".join(pb_int(1, d) for d in dims) + pb_int(2, 1) + pb_bytes(8, name)
        if values:
            tensor += pb_bytes(9, struct.pack(f"<{len(values)}f", *values))
        graph += pb_bytes(5, tensor)
    graph += pb_bytes(11, pb_bytes(1, "x")) + pb_bytes(12, pb_bytes(1, "y"))
    return pb_int(1, 8) + pb_bytes(7, graph) + pb_bytes(8, pb_int(2, 13))


def onnx_seeds():
    for path in sorted((ROOT / "fixtures" / "onnx").glob("*.onnx")):
        write("onnx_import", path.stem, path.read_bytes())
    # Small hand-made graphs, quicker to mutate than the fixtures.
    write("onnx_import", "gemm_relu_gemm_softmax", onnx_model(
        [("Gemm", ["x", "W0", "b0"], "h", {"transB": 1}), ("Relu", ["h"], "r", {}),
         ("Gemm", ["r", "W1"], "z", {}), ("Softmax", ["z"], "y", {"axis": -1})],
        [("W0", [3, 2], [0.5, -1, 2, 0.25, -0.5, 1]), ("b0", [3], [0.1, 0.2, 0.3]),
         ("W1", [3, 2], [1, -1, 0.5, 0.5, -2, 2])]))
    write("onnx_import", "matmul_add", onnx_model(
        [("MatMul", ["x", "W"], "m", {}), ("Add", ["m", "b"], "y", {})],
        [("W", [4, 2], [1, 2, 3, 4, 5, 6, 7, 8]), ("b", [2], [0.5, -0.5])]))
    # A zero-by-2^40 weight holds no values, so it passed the dims-vs-data
    # check, and the layer's zero bias asked for 2^40 floats (found while
    # fuzzing; onnx.rs now refuses weights with a zero dim).
    for op in ("Gemm", "MatMul"):
        write("onnx_import", f"{op.lower()}_zero_by_huge",
              onnx_model([(op, ["x", "W"], "y", {})], [("W", [0, 1 << 40], [])]))


if __name__ == "__main__":
    gguf_seeds()
    policy_seeds()
    hf_seeds()
    onnx_seeds()
    qstats_seeds()
    for d in sorted(SEEDS.iterdir()):
        files = list(d.iterdir())
        print(f"{d.name}: {len(files)} seeds, {sum(f.stat().st_size for f in files)} bytes")
