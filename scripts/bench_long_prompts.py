"""Prefill speed by prompt length and decode speed deep into a context: qforge's
FP32 reference and INT8 engine (`qforge generate --json`) beside llama.cpp's F32 and
Q8_0 (`llama-bench`) when a llama.cpp build is at hand, in one run, length by length.

    QFORGE=target/release/qforge [LLAMA_CPP_BIN=.../build/bin LLAMA_CPP_MODELS=DIR] \
        python3 scripts/bench_long_prompts.py [--lengths 128,512,2048,4096,8192]

Writes target/bench-long-prompts.json and prints its Markdown table. The prompts are the
start of the handbook evaluation text (scripts/fetch-eval-text.sh), cut to about the
asked number of tokens (the table gives the count qforge's tokenizer made); llama-bench
prefills exactly that many tokens of its own. Decode is 64 tokens after a prompt of
--decode-depth tokens (llama-bench `-d`). LLAMA_CPP_MODELS holds
smollm2-135m-instruct-f32.gguf and smollm2-135m-instruct-q8_0.gguf, both made from the
SmolLM2 GGUF by `llama-quantize --allow-requantize` (benchmarks/llamacpp-reference.md).
"""
import argparse
import json
import os
import subprocess
import sys

MODEL = "models/smollm2-135m-instruct-q4_1.gguf"
TEXT = "models/debian-handbook-eval.txt"
OUT = "target/bench-long-prompts.json"
# Characters per SmolLM2 token at the start of the handbook text: 9600 characters make
# 2023 tokens, 38 900 make 8387, so 4.6 keeps an asked 8 192 inside SmolLM2's context.
CHARS_PER_TOKEN = 4.6
LLAMA_MODELS = (("llama.cpp F32", "smollm2-135m-instruct-f32.gguf"),
                ("llama.cpp Q8_0", "smollm2-135m-instruct-q8_0.gguf"))
QFORGE_PRECISIONS = (("qforge FP32", "f32"), ("qforge INT8", "int8-dynamic"))


def qforge_generate(qforge, text, tokens, precision, max_tokens):
    prompt = text[:int(tokens * CHARS_PER_TOKEN)]
    run = subprocess.run([qforge, "generate", "--model", MODEL, "--prompt", prompt,
                          "--max-tokens", str(max_tokens), "--precision", precision, "--json"],
                         capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"qforge generate ({precision}, {len(prompt)} characters of {TEXT}) failed: "
                 f"{run.stderr.strip()}")
    return json.loads(run.stdout)


def llama_bench(binary, model, args):
    env = dict(os.environ, LD_LIBRARY_PATH=binary)
    out = subprocess.run([os.path.join(binary, "llama-bench"), "-m", model, "-t", "2", "-r", "1",
                          "-o", "json", *args],
                         check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out)[0]["avg_ts"]


def measure(args):
    qforge = os.environ.get("QFORGE", "target/release/qforge")
    llama_bin, llama_models = os.environ.get("LLAMA_CPP_BIN"), os.environ.get("LLAMA_CPP_MODELS")
    with open(TEXT) as f:
        text = f.read()
    prefill, decode = [], []
    # llama-bench warms up before it measures; so does qforge, once per precision, so
    # that the first length does not pay for reading the model file (the FP32 row at
    # 128 tokens was 414 tokens/s cold and 588-634 warm on one machine).
    for _, precision in QFORGE_PRECISIONS:
        qforge_generate(qforge, text, 128, precision, 1)
    for length in args.lengths:
        for engine, precision in QFORGE_PRECISIONS:
            run = qforge_generate(qforge, text, length, precision, 1)
            prefill.append({"engine": engine, "asked": length, "tokens": run["prompt_tokens"],
                            "tokens_per_s": run["prefill_tokens_per_s"]})
            print(f"{engine} prefill {run['prompt_tokens']}: {run['prefill_tokens_per_s']:.1f} tok/s",
                  file=sys.stderr)
        if llama_bin:
            for engine, name in LLAMA_MODELS:
                rate = llama_bench(llama_bin, os.path.join(llama_models, name),
                                   ["-p", str(length), "-n", "0"])
                prefill.append({"engine": engine, "asked": length, "tokens": length,
                                "tokens_per_s": rate})
                print(f"{engine} prefill {length}: {rate:.1f} tok/s", file=sys.stderr)
    for engine, precision in QFORGE_PRECISIONS:
        run = qforge_generate(qforge, text, args.decode_depth, precision, 64)
        decode.append({"engine": engine, "depth": run["prompt_tokens"],
                       "tokens_per_s": run["decode_tokens_per_s"]})
    if llama_bin:
        for engine, name in LLAMA_MODELS:
            rate = llama_bench(llama_bin, os.path.join(llama_models, name),
                               ["-p", "0", "-n", "64", "-d", str(args.decode_depth)])
            decode.append({"engine": engine, "depth": args.decode_depth, "tokens_per_s": rate})
    return {"qforge": qforge, "prefill": prefill, "decode": decode}


def markdown(results):
    lines = ["| prompt tokens | " + " | ".join(e for e, _ in QFORGE_PRECISIONS + LLAMA_MODELS)
             + " | INT8 / Q8_0 | FP32 / F32 |", "|---" * 7 + "|"]
    for length in sorted({r["asked"] for r in results["prefill"]}):
        rows = {r["engine"]: r for r in results["prefill"] if r["asked"] == length}
        cells = []
        for engine, _ in QFORGE_PRECISIONS + LLAMA_MODELS:
            r = rows.get(engine)
            if r is None:
                cells.append("—")
            elif engine.startswith("qforge"):
                cells.append(f"{r['tokens_per_s']:.1f} ({r['tokens']})")
            else:
                cells.append(f"{r['tokens_per_s']:.1f}")

        def ratio(ours, peer):
            if ours in rows and peer in rows:
                return f"{rows[ours]['tokens_per_s'] / rows[peer]['tokens_per_s']:.2f}×"
            return "—"
        cells += [ratio("qforge INT8", "llama.cpp Q8_0"), ratio("qforge FP32", "llama.cpp F32")]
        lines.append(f"| {length} | " + " | ".join(cells) + " |")
    lines += ["", "| decode, 64 tokens after | engine | tokens/s |", "|---|---|---|"]
    for r in results["decode"]:
        lines.append(f"| {r['depth']} | {r['engine']} | {r['tokens_per_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="128,512,2048,4096,8192",
                        type=lambda s: [int(n) for n in s.split(",")])
    parser.add_argument("--decode-depth", type=int, default=4096)
    results = measure(parser.parse_args())
    os.makedirs("target", exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(results, f, indent=1)
    print(markdown(results))


if __name__ == "__main__":
    main()
