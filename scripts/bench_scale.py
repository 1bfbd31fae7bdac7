#!/usr/bin/env python3
"""Quantize a synthetic Llama of a real model's shape and measure what it costs.

The model and its token-id calibration data come from scripts/make_synthetic_model.py
(generated once into --workdir, never committed). For each worker count the script runs
`qforge quantize` with the recipe flags given (default: static W8A8 with GPTQ, the recipe
vLLM's fastest INT8 format needs), and reports:

- wall time, and each pass's time as qforge prints it;
- peak memory, sampled from /proc every 100 ms: the whole resident set, and its anonymous
  part (the process's own memory, without the pages of the memory-mapped weight files,
  which the kernel can drop and re-read);
- whether every worker count wrote the same artifact bytes.

Usage:
  python3 scripts/bench_scale.py [--shape llama3.2-1b] [--workers 1,2]

Writes target/bench-scale-SHAPE.json and prints a Markdown table for BENCHMARKS.md.
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QFORGE = os.environ.get("QFORGE", str(ROOT / "target/release/qforge"))


def make_model(shape, workdir, samples, held_out, seq_len):
    model, data = workdir / shape, workdir / f"{shape}.jsonl"
    if not (model / "config.json").exists() or not data.exists():
        subprocess.run([sys.executable, str(ROOT / "scripts/make_synthetic_model.py"),
                        "--shape", shape, "--out", str(model), "--calibration", str(data),
                        "--samples", str(samples + held_out), "--seq-len", str(seq_len)],
                       check=True)
    return model, data


def status_kib(pid, field):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def run_measured(args):
    """Runs `args`; returns (wall seconds, peak VmRSS GiB, peak RssAnon GiB, stdout)."""
    started = time.monotonic()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peaks = {"VmRSS": 0, "RssAnon": 0}
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            for field in peaks:
                value = status_kib(proc.pid, field)
                if value is not None:
                    peaks[field] = max(peaks[field], value)
            stop.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate()
    stop.set()
    sampler.join()
    wall = time.monotonic() - started
    if proc.returncode != 0:
        sys.exit(f"{' '.join(args)} failed ({proc.returncode}):\n{stderr}")
    gib = 1 << 20
    return wall, peaks["VmRSS"] / gib, peaks["RssAnon"] / gib, stdout


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama3.2-1b")
    parser.add_argument("--workdir", type=Path, default=ROOT / "target/synthetic")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--held-out", type=int, default=8,
                        help="episodes beyond --samples, left for the guard")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--recipe", default="--activations static --gptq",
                        help="recipe flags of qforge quantize")
    args = parser.parse_args()

    model, data = make_model(args.shape, args.workdir, args.samples, args.held_out,
                             args.seq_len)
    rows, digests = [], set()
    for workers in [int(w) for w in args.workers.split(",")]:
        out = args.workdir / f"{args.shape}-q{workers}"
        command = [QFORGE, "quantize", "--model", str(model), "--data", str(data),
                   "--samples", str(args.samples), "--seq-len", str(args.seq_len),
                   *args.recipe.split(), "--workers", str(workers), "-o", str(out), "--json"]
        wall, rss, anon, stdout = run_measured(command)
        report = json.loads(stdout)
        recorded = json.loads((out / "report.json").read_text())
        passes = [(p["pass"], p["seconds"]) for p in recorded["calibration"]["passes"]]
        gptq = recorded.get("gptq") or {}
        digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
        digests.add(digest)
        row = {
            "workers": workers, "wall_s": round(wall, 1), "peak_rss_gib": round(rss, 2),
            "peak_anon_gib": round(anon, 2),
            "passes": passes,
            "gptq_s": gptq.get("seconds"),
            "fp_layers": report["fp_layers"], "total_layers": report["total_layers"],
            "perplexity_change": report["after"]["perplexity_increase"]
            if report.get("after") else None,
            "artifact_sha256": digest,
        }
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    result = {"shape": args.shape, "samples": args.samples, "seq_len": args.seq_len,
              "recipe": args.recipe, "identical": len(digests) == 1, "runs": rows}
    (ROOT / "target").mkdir(exist_ok=True)
    (ROOT / f"target/bench-scale-{args.shape}.json").write_text(json.dumps(result, indent=2))
    print(f"| workers | wall | activation pass | Hessian passes | GPTQ rounding | peak RSS "
          f"| peak anonymous | FP layers |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        activation = sum(s for kind, s in r["passes"] if kind == "activation")
        hessian = sum(s for kind, s in r["passes"] if kind == "hessian")
        print(f"| {r['workers']} | {r['wall_s']:.0f} s | {activation:.0f} s | {hessian:.0f} s "
              f"| {r['gptq_s'] or 0:.0f} s | {r['peak_rss_gib']:.2f} GiB "
              f"| {r['peak_anon_gib']:.2f} GiB | {r['fp_layers']} of {r['total_layers']} |")
    print(f"artifacts identical across worker counts: {result['identical']}")


if __name__ == "__main__":
    main()
