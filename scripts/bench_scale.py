#!/usr/bin/env python3
"""Quantize a synthetic Llama of a real model's shape and measure what it costs.

The model and its token-id calibration data come from scripts/make_synthetic_model.py
(generated once into --workdir, never committed). For each worker count the script runs
`qforge quantize` with the recipe flags given (default: static W8A8 with GPTQ, the recipe
vLLM's fastest INT8 format needs), and reports:

- wall time, and each pass's time as qforge prints it;
- a timeline: every progress line qforge writes, with the time and the memory then
  (echoed as the run goes, and kept in the JSON);
- peak memory, sampled from /proc every 100 ms: the whole resident set, and its anonymous
  part (the process's own memory, without the pages of the memory-mapped weight files,
  which the kernel can drop and re-read);
- whether every worker count wrote the same artifact bytes;
- the artifact's INT8 decode speed (`qforge generate --prompt-ids`, 128 prompt tokens, 64
  generated) and the rate at which it reads its linear weights, to set beside the
  machine's read bandwidth (`cargo bench -p qforge-kernels --bench gemm -- memory`);
- for the first worker count, `qforge export --format compressed-tensors` (time, peak
  memory, bytes) and the verdict of the independent reader,
  scripts/check_compressed_tensors.py (a rejected export stops the script).

Needs numpy and safetensors: run it with the test venv's Python (`.venv/bin/python`,
made by scripts/test.sh).

With --calibrate-only it runs `qforge calibrate` instead (the activation pass alone: what
a model too slow to quantize whole here still shows of time and memory).

Usage:
  python3 scripts/bench_scale.py [--shape llama3.2-1b] [--workers 1,2] [--calibrate-only]

Writes target/bench-scale-SHAPE.json and prints a Markdown table for BENCHMARKS.md.
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import shutil
import threading
import time
from pathlib import Path

import check_compressed_tensors

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


def file_sha256(path):
    """SHA-256 of a file, read a block at a time (an 8B artifact is 9 GB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


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
    """Runs `args`; returns (wall seconds, peak VmRSS GiB, peak RssAnon GiB, stdout,
    timeline). The timeline holds each line qforge writes to stderr (its progress) with
    the seconds since the start and the resident and anonymous memory then; each is also
    echoed, so that a long run can be followed. The peaks are sampled every 100 ms."""
    started = time.monotonic()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peaks = {"VmRSS": 0, "RssAnon": 0}
    stop = threading.Event()
    gib = 1 << 20

    def sample():
        while not stop.is_set():
            for field in peaks:
                value = status_kib(proc.pid, field)
                if value is not None:
                    peaks[field] = max(peaks[field], value)
            stop.wait(0.1)

    output = []
    reader = threading.Thread(target=lambda: output.append(proc.stdout.read()), daemon=True)
    sampler = threading.Thread(target=sample, daemon=True)
    reader.start()
    sampler.start()
    timeline = []
    for line in proc.stderr:
        at = {"s": round(time.monotonic() - started, 1),
              "rss_gib": round((status_kib(proc.pid, "VmRSS") or 0) / gib, 2),
              "anon_gib": round((status_kib(proc.pid, "RssAnon") or 0) / gib, 2),
              "line": line.rstrip()}
        timeline.append(at)
        print(f"  [{at['s']:7.1f} s, {at['anon_gib']:5.2f} GiB anonymous] {at['line']}",
              file=sys.stderr, flush=True)
    proc.wait()
    reader.join()
    stop.set()
    sampler.join()
    wall = time.monotonic() - started
    if proc.returncode != 0:
        sys.exit(f"{' '.join(args)} failed ({proc.returncode})")
    return wall, peaks["VmRSS"] / gib, peaks["RssAnon"] / gib, output[0], timeline


def calibrate(args, model, data):
    rows = []
    for workers in [int(w) for w in args.workers.split(",")]:
        out = args.workdir / f"{args.shape}-w{workers}.qstats"
        command = [QFORGE, "calibrate", "--model", str(model), "--data", str(data),
                   "--samples", str(args.samples), "--seq-len", str(args.seq_len),
                   "--workers", str(workers), "-o", str(out), "--json"]
        wall, rss, anon, stdout, _ = run_measured(command)
        summary = json.loads(stdout)
        rows.append({"workers": workers, "wall_s": round(wall, 1),
                     "pass_s": round(summary["seconds"], 1),
                     "tokens_per_s": round(summary["rows_per_s"], 1),
                     "peak_rss_gib": round(rss, 2), "peak_anon_gib": round(anon, 2),
                     "qstats_sha256": file_sha256(out)})
        print(json.dumps(rows[-1]), file=sys.stderr)
    (ROOT / f"target/bench-scale-{args.shape}-calibrate.json").write_text(
        json.dumps({"shape": args.shape, "samples": args.samples, "seq_len": args.seq_len,
                    "runs": rows}, indent=2))
    print("| workers | wall | activation pass | tokens/s | peak RSS | peak anonymous |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workers']} | {r['wall_s']:.0f} s | {r['pass_s']:.0f} s "
              f"| {r['tokens_per_s']:.1f} | {r['peak_rss_gib']:.2f} GiB "
              f"| {r['peak_anon_gib']:.2f} GiB |")


def export(artifact, out):
    """`qforge export --format compressed-tensors` of the artifact, timed, and its
    verdict from the independent reader (scripts/check_compressed_tensors.py)."""
    shutil.rmtree(out, ignore_errors=True)
    wall, rss, anon, _, _ = run_measured([QFORGE, "export", "--model", str(artifact), "--format",
                                       "compressed-tensors", "-o", str(out), "--json"])
    started = time.monotonic()
    summary = check_compressed_tensors.check(out, artifact)
    return {"export_s": round(wall, 1), "export_peak_anon_gib": round(anon, 2),
            "export_bytes": summary["file_bytes"],
            "export_quantized_layers": summary["quantized_layers"],
            "reader_s": round(time.monotonic() - started, 1)}


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
    parser.add_argument("--calibrate-only", action="store_true",
                        help="run qforge calibrate (the activation pass) instead of quantize")
    args = parser.parse_args()

    model, data = make_model(args.shape, args.workdir, args.samples, args.held_out,
                             args.seq_len)
    if args.calibrate_only:
        calibrate(args, model, data)
        return
    rows, digests = [], set()
    for workers in [int(w) for w in args.workers.split(",")]:
        out = args.workdir / f"{args.shape}-q{workers}"
        command = [QFORGE, "quantize", "--model", str(model), "--data", str(data),
                   "--samples", str(args.samples), "--seq-len", str(args.seq_len),
                   *args.recipe.split(), "--workers", str(workers), "-o", str(out)]
        # Without --json, which would silence the progress the timeline records.
        wall, rss, anon, _, timeline = run_measured(command)
        recorded = json.loads((out / "report.json").read_text())
        report = recorded["decision"]
        passes = [(p["pass"], p["seconds"]) for p in recorded["calibration"]["passes"]]
        gptq = recorded.get("gptq") or {}
        digest = file_sha256(out / "model.safetensors")
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
            "timeline": timeline,
        }
        prompt = json.loads(data.read_text().splitlines()[0])["token_ids"][:128]
        generated = subprocess.run(
            [QFORGE, "generate", "--model", str(out), "--prompt-ids", ",".join(map(str, prompt)),
             "--max-tokens", "64", "--json"], capture_output=True, text=True, check=True)
        decode = json.loads(generated.stdout)
        row["decode_tokens_per_s"] = round(decode["decode_tokens_per_s"], 2)
        row["weight_read_gb_per_s"] = round(
            decode["decode_tokens_per_s"] * decode["linear_weight_bytes"] / 1e9, 1)
        if not rows:
            row.update(export(out, args.workdir / f"{args.shape}-compressed-tensors"))
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "timeline"}), file=sys.stderr)
    result = {"shape": args.shape, "samples": args.samples, "seq_len": args.seq_len,
              "recipe": args.recipe, "identical": len(digests) == 1, "runs": rows}
    (ROOT / "target").mkdir(exist_ok=True)
    (ROOT / f"target/bench-scale-{args.shape}.json").write_text(json.dumps(result, indent=2))
    print(f"| workers | wall | activation pass | Hessian passes | GPTQ rounding | peak RSS "
          f"| peak anonymous | FP layers | INT8 decode | weight reads |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        # The activation pass also sums the first group of Hessians.
        activation = sum(s for kind, s in r["passes"] if kind.startswith("activation"))
        hessian = sum(s for kind, s in r["passes"] if kind == "hessian")
        print(f"| {r['workers']} | {r['wall_s']:.0f} s | {activation:.0f} s | {hessian:.0f} s "
              f"| {r['gptq_s'] or 0:.0f} s | {r['peak_rss_gib']:.2f} GiB "
              f"| {r['peak_anon_gib']:.2f} GiB | {r['fp_layers']} of {r['total_layers']} "
              f"| {r['decode_tokens_per_s']:.1f} tok/s | {r['weight_read_gb_per_s']:.1f} GB/s |")
    print(f"artifacts identical across worker counts: {result['identical']}")
    first = rows[0]
    print(f"compressed-tensors export of the {first['workers']}-worker artifact: "
          f"{first['export_bytes'] / 1e9:.2f} GB in {first['export_s']:.0f} s, peak anonymous "
          f"{first['export_peak_anon_gib']:.2f} GiB; the independent reader accepted its "
          f"{first['export_quantized_layers']} int8 layers in {first['reader_s']:.0f} s")


if __name__ == "__main__":
    main()
