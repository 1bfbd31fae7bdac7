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
cargo bench -p qforge-model --bench forward
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
.venv/bin/python tests/python/ort_crosscheck.py --markdown --qforge target/release/qforge \
    > target/ort_crosscheck.md
.venv/bin/python scripts/bench_report.py > BENCHMARKS.md
echo "wrote BENCHMARKS.md"
