#!/usr/bin/env bash
# qforge's INT8 engine beside llama.cpp's Q8_0 on the machine it runs on: made for an
# Arm board (Raspberry Pi 5, Jetson Orin, Graviton), where no one on the team could
# measure. Needs only the release binary (scripts/release.sh) and Python 3:
#
#   QFORGE=./qforge-0.1.0-aarch64-linux scripts/bench-arm-board.sh
#   LLAMA_CPP_BIN=~/llama.cpp/build/bin LLAMA_CPP_Q8_0=smollm2-q8_0.gguf \
#       QFORGE=./qforge-0.1.0-aarch64-linux scripts/bench-arm-board.sh
#
# SmolLM2-135M-Instruct (scripts/fetch-models.sh, or MODEL=path): generation of 64
# tokens (llama-bench's tg64) and the prefill of a 128-token prompt (pp128), five runs
# each, on THREADS threads (default: every core), with llama-bench's figures for the
# same model in Q8_0 on the same threads when LLAMA_CPP_BIN is set. llama.cpp's Q8_0
# of this model: `llama-quantize --allow-requantize smollm2-135m-instruct-q4_1.gguf
# smollm2-q8_0.gguf Q8_0`. Prints `qforge info` (the tiers this CPU runs) and a
# Markdown table with the medians and ratios; please send it to us.
set -euo pipefail
cd "$(dirname "$0")/.."

QFORGE=${QFORGE:-target/release/qforge}
MODEL=${MODEL:-models/smollm2-135m-instruct-q4_1.gguf}
THREADS=${THREADS:-$(nproc)}
RUNS=5
[ -f "$MODEL" ] || scripts/fetch-models.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$QFORGE" info
# A 127-token prompt in SmolLM2's tokenizer (nine times this sentence), llama-bench's
# pp128 within a token.
prompt=$(printf 'The robot arm lifts the red block and places it on the shelf. %.0s' {1..9})
for run in $(seq "$RUNS"); do
    RAYON_NUM_THREADS=$THREADS "$QFORGE" generate --model "$MODEL" --prompt "$prompt" \
        --max-tokens 64 --precision int8-dynamic --json >"$work/qforge-$run.json"
    if [ -n "${LLAMA_CPP_BIN:-}" ]; then
        LD_LIBRARY_PATH="$LLAMA_CPP_BIN" "$LLAMA_CPP_BIN/llama-bench" -m "$LLAMA_CPP_Q8_0" \
            -p 128 -n 64 -t "$THREADS" -r 1 -o json 2>/dev/null >"$work/llamacpp-$run.json"
    fi
done

python3 - "$work" "$THREADS" <<'PY'
import glob, json, statistics, sys

work, threads = sys.argv[1], sys.argv[2]
runs = [json.load(open(p)) for p in sorted(glob.glob(f"{work}/qforge-*.json"))]
ours = {
    "pp": statistics.median(r["prefill_tokens_per_s"] for r in runs),
    "tg": statistics.median(r["decode_tokens_per_s"] for r in runs),
}
prompt_tokens = runs[0]["prompt_tokens"]
theirs = {}
for path in sorted(glob.glob(f"{work}/llamacpp-*.json")):
    for test in json.load(open(path)):
        kind = "pp" if test["n_prompt"] > 0 else "tg"
        theirs.setdefault(kind, []).append(test["avg_ts"])
theirs = {kind: statistics.median(v) for kind, v in theirs.items()}
print(f"\nSmolLM2-135M-Instruct, {threads} threads, median of {len(runs)} runs")
print("| | qforge int8-dynamic tok/s | llama.cpp Q8_0 tok/s | ratio |")
print("|---|---|---|---|")
for kind, label in [("pp", f"prefill ({prompt_tokens} tokens; llama.cpp pp128)"),
                    ("tg", "decode (64 tokens; llama.cpp tg64)")]:
    if kind in theirs:
        print(f"| {label} | {ours[kind]:.1f} | {theirs[kind]:.1f} | {ours[kind] / theirs[kind]:.2f}x |")
    else:
        print(f"| {label} | {ours[kind]:.1f} | (LLAMA_CPP_BIN not set) | |")
PY
