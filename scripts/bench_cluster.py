"""Redis backend benchmarks, run by scripts/bench.sh after the embedded calibration runs.

1. Overhead: the same SmolLM2 calibration as the embedded rows of BENCHMARKS.md, through a
   local redis-server with N `qforge worker --forever` processes (N = 1, 2; each given
   cores / N matmul threads, as the embedded backend's N threads share one pool), side by
   side with the embedded backend's N threads. Cold: the workers' first run, so they load
   the model and compute their fingerprint inside the timed window. Warm: the next run of
   the same job, with the model already loaded. All write the same bytes (checked here).
2. Failover: a worker is SIGKILLed while it observes a batch; the time until another worker
   has claimed that batch is measured by polling Redis (goal: at most the heartbeat timeout
   + 1 s).

Writes target/bench-cluster.json.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

QFORGE = os.environ.get("QFORGE", "target/release/qforge")
CALIBRATE = ["calibrate", "--model", "models/smollm2-135m-instruct-q4_1.gguf",
             "--data", "fixtures/episodes/arithmetic.jsonl", "--samples", "32",
             "--seq-len", "128", "--batch-size", "4"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(port, *args):
    out = subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True)
    return out.stdout.strip()


def start_workers(url, count, *extra):
    env = dict(os.environ, RAYON_NUM_THREADS=str(max(1, os.cpu_count() // count)))
    return [subprocess.Popen([QFORGE, "worker", "--cluster", url, "--name", f"w{i}", *extra],
                             stderr=subprocess.DEVNULL, env=env) for i in range(count)]


def coordinate(url, run):
    """Runs a coordinator to the end; returns its JSON summary and output bytes."""
    out = f"target/bench-cluster-{run}.qstats"
    done = subprocess.run([QFORGE, *CALIBRATE, "--cluster", url, "--run", run, "-o", out,
                           "--json"], stdout=subprocess.PIPE, check=True)
    with open(out, "rb") as f:
        return json.loads(done.stdout), f.read()


def main():
    if shutil.which("redis-server") is None:
        sys.exit("redis-server is not installed (scripts/test.sh installs it)")
    port = free_port()
    data_dir = tempfile.mkdtemp(prefix="qforge-bench-redis-")
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                               "--dir", data_dir, "--appendonly", "yes", "--appendfsync",
                               "everysec", "--save", ""], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}"
    try:
        for _ in range(100):
            if cli(port, "PING") == "PONG":
                break
            time.sleep(0.05)
        result = {"overhead": [], "failover": []}
        for workers in (1, 2):
            pool = start_workers(url, workers, "--forever")
            cold, cold_bytes = coordinate(url, f"cold-{workers}")
            warm, warm_bytes = coordinate(url, f"warm-{workers}")
            for p in pool:
                p.kill()
                p.wait()
            with open(f"target/bench-calibrate-{workers}.json") as f:
                embedded = json.load(f)
            with open(f"target/bench-calibrate-{workers}.qstats", "rb") as f:
                reference = f.read()
            result["overhead"].append({"workers": workers, "tokens": cold["rows"],
                                       "cold_seconds": cold["seconds"],
                                       "warm_seconds": warm["seconds"],
                                       "embedded_seconds": embedded["seconds"],
                                       "identical": cold_bytes == warm_bytes == reference})
        timeout_ms = 2000
        for attempt in range(3):
            run = f"failover-{attempt}"
            pool = start_workers(url, 2, "--run", run)
            coordinator = subprocess.Popen([QFORGE, *CALIBRATE, "--cluster", url, "--run", run,
                                            "-o", f"target/bench-cluster-{run}.qstats"],
                                           stdout=subprocess.DEVNULL)
            victim, entry = None, None
            while entry is None:
                for i in (0, 1):
                    beat = cli(port, "GET", f"qforge:{{{run}}}:hb:w{i}")
                    if beat and beat != "-":
                        victim, entry = i, beat
                        break
                time.sleep(0.005)
            # Let the batch get under way, then kill its worker.
            time.sleep(0.2)
            os.kill(pool[victim].pid, signal.SIGKILL)
            killed = time.monotonic()
            claimed = None
            while claimed is None and time.monotonic() - killed < 30:
                pending = cli(port, "XPENDING", f"qforge:{{{run}}}:tasks", "workers", entry,
                              entry, "1").split("\n")
                if len(pending) >= 2 and pending[1] != f"w{victim}":
                    claimed = time.monotonic() - killed
                elif pending == [""]:
                    # Acknowledged already: only possible if the victim finished first.
                    break
                time.sleep(0.01)
            coordinator.communicate()
            for p in pool:
                p.wait()
            if claimed is not None:
                result["failover"].append({"seconds": claimed, "timeout_seconds": timeout_ms / 1000})
        with open("target/bench-cluster.json", "w") as f:
            json.dump(result, f, indent=2)
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
