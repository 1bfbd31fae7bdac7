#!/usr/bin/env bash
# Runs the benchmarks and peer comparisons and rewrites BENCHMARKS.md with every
# figure and the command that produced it. Needs the venv of scripts/test.sh for the
# ONNX Runtime comparison (it creates it if missing).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/pip install --quiet --disable-pip-version-check -r tests/python/requirements.txt

scripts/fetch-models.sh
cargo bench -p qforge-core --bench observe -- --warm-up-time 2 --measurement-time 5
cargo bench -p qforge-kernels --bench gemm
cargo bench -p qforge-kernels --bench attention
.venv/bin/python scripts/bench_ort_gemm.py
cargo bench -p qforge-model --bench forward
cargo bench -p qforge-decode --bench decode
cargo bench -p qforge-decode --bench grpo
# llama.cpp beside it, when a build is at hand (benchmarks/llamacpp-reference.md says
# how it was built): LLAMA_CPP_BIN=.../build/bin LLAMA_CPP_MODELS=dir-with-f32-and-q8_0-ggufs
if [ -n "${LLAMA_CPP_BIN:-}" ]; then
    LD_LIBRARY_PATH="$LLAMA_CPP_BIN" "$LLAMA_CPP_BIN/llama-bench" \
        -m "$LLAMA_CPP_MODELS/smollm2-135m-instruct-f32.gguf" \
        -m "$LLAMA_CPP_MODELS/smollm2-135m-instruct-q8_0.gguf" \
        -p 128 -n 64 -t 2 -r 5 -o md 2>/dev/null | grep '^|' > target/llamacpp-bench.md
fi
cargo build --release -p qforge-cli
# Calibration throughput on SmolLM2, embedded backend, 1 and 2 worker threads.
for workers in 1 2; do
    target/release/qforge calibrate --model models/smollm2-135m-instruct-q4_1.gguf \
        --data fixtures/episodes/arithmetic.jsonl --samples 32 --seq-len 128 --batch-size 4 \
        --workers "$workers" -o "target/bench-calibrate-$workers.qstats" --json \
        > "target/bench-calibrate-$workers.json"
done
# The same calibration through Redis, and the failover time.
python3 scripts/bench_cluster.py
# The Redis backend at 16, 64 and 256 worker processes with a synthetic forward.
cargo bench -p qforge-core --bench codec
cargo build --release -p qforge-runner --example synthetic_worker
python3 scripts/bench_cluster_scale.py
# Accuracy of SmolLM2 under each W8A8 method on the handbook text (~64 000 tokens).
scripts/fetch-eval-text.sh
QFORGE=target/release/qforge python3 scripts/bench_quality.py
# /v1/act under load (wrk from Debian), INT8 artifact vs FP32 policy.
command -v wrk >/dev/null || { apt-get update -qq && apt-get install -y -qq wrk >/dev/null; }
python3 scripts/bench_serve.py
# /v1/completions under load: SmolLM2 as an INT8 artifact and as its FP32 reference.
python3 scripts/bench_completions.py
# A short request's time to first token while a 4 096-token prompt is prefilled beside
# it, on the INT8 artifact bench_completions.py made.
python3 scripts/bench_ttft.py target/release/qforge target/bench-completions-int8 \
    --long-tokens 4096 > target/bench-ttft.json
# Generation of 64 tokens (llama-bench's tg64) in f32 and on the INT8 decoder, five
# runs each (llama-bench's -r 5), alternating, with llama.cpp's Q8_0 tg64 beside each
# INT8 run when a build is at hand.
rm -f target/bench-generate-*.json target/llamacpp-tg64-*.json
for run in 1 2 3 4 5; do
    for precision in f32 int8-dynamic; do
        target/release/qforge generate --model models/smollm2-135m-instruct-q4_1.gguf \
            --prompt "Once upon a time, in a small village by the sea," --max-tokens 64 \
            --precision "$precision" --json > "target/bench-generate-$precision-$run.json"
    done
    if [ -n "${LLAMA_CPP_BIN:-}" ]; then
        LD_LIBRARY_PATH="$LLAMA_CPP_BIN" "$LLAMA_CPP_BIN/llama-bench" \
            -m "$LLAMA_CPP_MODELS/smollm2-135m-instruct-q8_0.gguf" \
            -p 0 -n 64 -t 2 -r 1 -o json 2>/dev/null > "target/llamacpp-tg64-$run.json"
    fi
done
# Prefill from 128 to 8 192 prompt tokens and decode at a 4 096-token context, beside
# llama.cpp's F32 and Q8_0 when a build is at hand.
QFORGE=target/release/qforge python3 scripts/bench_long_prompts.py >/dev/null
.venv/bin/python tests/python/ort_crosscheck.py --markdown --qforge target/release/qforge \
    > target/ort_crosscheck.md
# Into a new file first: the report reads BENCHMARKS.md for the sections it keeps.
.venv/bin/python scripts/bench_report.py > target/BENCHMARKS.md.new
mv target/BENCHMARKS.md.new BENCHMARKS.md
echo "wrote BENCHMARKS.md"
