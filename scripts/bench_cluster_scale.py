"""The Redis backend at scale: one coordinator, one redis-server and 16, 64 or 256 worker
processes whose forward is synthetic (crates/runner/examples/synthetic_worker.rs: a fixed
delay, then the tensors of a real SmolLM2 batch's statistics, 121 tensors).

Per worker count it measures, over one run of BATCHES batches:
- batches merged per second at the coordinator (planned batches / the coordinator's own wall
  clock); a worker handed a task of several batches merges them and publishes one result, so
  also the results published and the mean batches per result;
- bytes per result on the wire (the results stream's newest 16 entries, read mid-run);
- Redis peak memory (`used_memory_peak`, a fresh server per worker count; on a Redis
  Cluster, of the master that holds the run: a run's keys share one hash slot);
- reclaim: 10 % of the workers SIGKILLed at once mid-run; the time until every task they
  held is pending on another worker or merged (goal: heartbeat timeout + 1 s);
- whether the merged statistics are byte-identical to a one-worker run.

The coordinator is the real `qforge calibrate --cluster` over the CartPole fixture's
observations (batch size 1, so BATCHES batches), which the synthetic workers also load and
plan; only their observations are synthetic.

Usage: python3 scripts/bench_cluster_scale.py [--workers 16,64,256] [--batches 10000]
           [--delay-ms 100] [--batches-per-task N]   (default: the coordinator sizes tasks)
           [--redis-cluster-masters N]   (a Redis Cluster of N masters in place of one server)
Writes target/bench-cluster-scale.json and the plot target/bench-cluster-scale.svg.
"""

import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

QFORGE = os.environ.get("QFORGE", "target/release/qforge")
WORKER = os.environ.get("SYNTHETIC_WORKER", "target/release/examples/synthetic_worker")
POLICY = "fixtures/policies/cartpole"
TIMEOUT_MS = 2000


class Resp:
    """A minimal Redis client (RESP2 over a socket), binary-safe, for polling."""

    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.buf = self.sock.makefile("rb")

    def call(self, *args):
        parts = [b"*%d\r\n" % len(args)]
        for a in args:
            a = a if isinstance(a, bytes) else str(a).encode()
            parts.append(b"$%d\r\n%s\r\n" % (len(a), a))
        self.sock.sendall(b"".join(parts))
        return self._read()

    def _read(self):
        line = self.buf.readline()[:-2]
        kind, rest = line[:1], line[1:]
        if kind in (b"+", b":"):
            return int(rest) if kind == b":" else rest.decode()
        if kind == b"-":
            raise RuntimeError(rest.decode())
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else self.buf.read(n + 2)[:-2]
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self._read() for _ in range(n)]
        raise RuntimeError(f"unexpected reply {line!r}")


def cpu_seconds(pid):
    """User + system CPU time of a live process, from /proc (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError):
        return None


class CpuMeter(threading.Thread):
    """The last CPU time seen of each named process, polled until stopped."""

    def __init__(self, pids):
        super().__init__(daemon=True)
        self.pids, self.seen, self.done = pids, {}, threading.Event()

    def run(self):
        while not self.done.wait(0.25):
            for name, pid in self.pids.items():
                seconds = cpu_seconds(pid)
                if seconds is not None:
                    self.seen[name] = seconds


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(data_dir, *args):
    """A redis-server (AOF everysec, as the deploy docs recommend) and a client once it answers."""
    port = free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                               "--dir", data_dir, "--appendonly", "yes", "--appendfsync",
                               "everysec", "--save", "", *args], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            client = Resp(port)
            if client.call("PING") == "PONG":
                return server, port, client
        except OSError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.05)


def start_redis(data_dir, masters, run):
    """One redis-server (masters 0), or a Redis Cluster of `masters` masters without
    replicas, its slots split evenly. Returns the servers, the URL the coordinator and
    workers are given, and a client of the node that holds run `run`'s keys. On a cluster
    the URL is a node that does not hold them, so every connection follows a redirection."""
    if masters == 0:
        server, port, client = start_node(data_dir)
        return [server], f"redis://127.0.0.1:{port}", client
    nodes = []
    for i in range(masters):
        node_dir = os.path.join(data_dir, f"node{i}")
        os.makedirs(node_dir)
        bus = free_port()  # the default, port + 10 000, may be past 65 535
        nodes.append(start_node(node_dir, "--cluster-enabled", "yes", "--cluster-config-file",
                                "nodes.conf", "--cluster-port", str(bus)) + (bus,))
    ranges = [(16384 * i // masters, 16384 * (i + 1) // masters - 1) for i in range(masters)]
    for (_, _, client, _), (first, last) in zip(nodes, ranges):
        client.call("CLUSTER", "ADDSLOTSRANGE", first, last)
    for _, port, _, bus in nodes[1:]:
        nodes[0][2].call("CLUSTER", "MEET", "127.0.0.1", port, bus)
    deadline = time.monotonic() + 60
    for _, _, client, _ in nodes:
        while not (info := client.call("CLUSTER", "INFO").decode()).startswith("cluster_state:ok") \
                or f"cluster_known_nodes:{masters}\r" not in info:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Redis Cluster did not form: {info}")
            time.sleep(0.05)
    slot = nodes[0][2].call("CLUSTER", "KEYSLOT", f"qforge:{{{run}}}:tasks")
    owner = next(i for i, (first, last) in enumerate(ranges) if first <= slot <= last)
    seed = nodes[(owner + 1) % masters][1]
    return [n[0] for n in nodes], f"redis://127.0.0.1:{seed}", nodes[owner][2]


def make_inputs(work, batches):
    """A template (one real SmolLM2 batch's statistics) and enough CartPole observations."""
    template = os.path.join(work, "template.qstats")
    subprocess.run([QFORGE, "calibrate", "--model", "models/smollm2-135m-instruct-q4_1.gguf",
                    "--data", "fixtures/episodes/arithmetic.jsonl", "--samples", "8",
                    "--seq-len", "128", "--batch-size", "8", "-o", template],
                   check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(POLICY, "rollouts.jsonl")) as f:
        lines = [line for line in f if line.strip()]
    observations = sum(len(json.loads(line)["observations"]) for line in lines)
    data = os.path.join(work, "observations.jsonl")
    with open(data, "w") as f:
        for _ in range(batches // observations + 1):
            f.writelines(lines)
    return template, data


def run_once(work, template, data, batches, workers, delay_ms, kill, per_task=None,
             masters=0):
    data_dir = tempfile.mkdtemp(prefix="redis-", dir=work)
    run = f"scale-{workers}"
    servers, url, client = start_redis(data_dir, masters, run)
    out = os.path.join(work, f"{run}.qstats")
    pool = [subprocess.Popen([WORKER, url, run, f"w{i}", template, str(delay_ms)],
                             stderr=subprocess.DEVNULL) for i in range(workers)]
    coordinator = subprocess.Popen(
        [QFORGE, "calibrate", "--model", POLICY, "--data", data, "--samples", str(batches),
         "--batch-size", "1", "--cluster", url, "--run", run, "--heartbeat-timeout-ms",
         str(TIMEOUT_MS), "-o", out, "--json"]
        + (["--batches-per-task", str(per_task)] if per_task else []),
        stdout=subprocess.PIPE)
    tasks, results = f"qforge:{{{run}}}:tasks", f"qforge:{{{run}}}:results"
    launched = time.monotonic()
    meter = CpuMeter({"coordinator": coordinator.pid,
                      **{f"redis{i}": s.pid for i, s in enumerate(servers)},
                      **{f"w{i}": p.pid for i, p in enumerate(pool)}})
    meter.start()
    row = {"workers": workers, "batches": batches, "delay_ms": delay_ms,
           "batches_per_task": per_task or "auto", "redis_cluster_masters": masters}
    # Mid-run: a third of the time the workers would take if nothing else bounded them.
    offered = workers * 1000 / max(delay_ms, 1)
    try:
        started = None
        while coordinator.poll() is None:
            if started is None and client.call("XLEN", results):
                started = time.monotonic()
            if started is not None and time.monotonic() - started >= batches / offered / 3:
                break
            time.sleep(0.05)
        # The coordinator trims what it has merged: wait for entries to sample.
        entries = []
        while not entries and coordinator.poll() is None:
            entries = client.call("XREVRANGE", results, "+", "-", "COUNT", "16")
        if entries:
            sizes = [sum(len(v) for v in fields) for _, fields in entries]
            row["bytes_per_result"] = round(sum(sizes) / len(sizes))
        if kill and coordinator.poll() is None:
            # 10 % of the workers: those that took a task last first (they hold it longest).
            # While the coordinator is what bounds the run, workers wait for tasks
            # most of the time: kill when some hold one.
            entries = []
            while not entries and coordinator.poll() is None:
                entries = client.call("XPENDING", tasks, "workers", "-", "+", 100000)
            holding = [e[1].decode() for e in sorted(entries, key=lambda e: e[2])]
            order = list(dict.fromkeys(holding + [f"w{i}" for i in range(workers)]))
            names = {n.encode() for n in order[: max(1, workers // 10)]}
            victims = [int(n[1:]) for n in order[: max(1, workers // 10)]]
            held = None
            for i in victims:
                os.kill(pool[i].pid, signal.SIGKILL)
            killed = time.monotonic()
            reclaim = None
            while time.monotonic() - killed < 60:
                entries = client.call("XPENDING", tasks, "workers", "-", "+", 100000)
                mine = [e[0] for e in entries if e[1] in names]
                if held is None:
                    held = len(mine)
                if not mine:
                    reclaim = time.monotonic() - killed
                    break
                time.sleep(0.02)
            row["killed"] = len(victims)
            row["tasks_held_by_killed"] = held
            row["reclaim_seconds"] = reclaim
        summary_bytes, _ = coordinator.communicate(timeout=3600)
        ended = time.monotonic()
        meter.done.set()
        meter.join()
        seen = dict(meter.seen)
        redis = [seen.pop(f"redis{i}") for i in range(len(servers))]
        row["cpu_seconds"] = {
            "coordinator": seen.pop("coordinator"), "redis": round(sum(redis), 2),
            "workers": round(sum(seen.values()), 2)}
        if started is not None:
            # Before the first result, the workers start: each loads and plans the files.
            row["first_result_after_s"] = round(started - launched, 2)
            row["merged_per_s_from_first_result"] = batches / (ended - started)
        summary = json.loads(summary_bytes)
        row["seconds"] = summary["seconds"]
        row["merged_per_s"] = summary["merged_batches"] / summary["seconds"]
        stream = client.call("XINFO", "STREAM", results)
        published = dict(zip(stream[::2], stream[1::2]))[b"entries-added"]
        row["results_published"] = published
        row["batches_per_result"] = (summary["merged_batches"] + summary["duplicates"]) / published
        row["duplicates"] = summary["duplicates"]
        row["speculative_executions"] = summary["speculative_executions"]
        memory = client.call("INFO", "memory").decode()
        stats = dict(line.split(":", 1) for line in memory.splitlines() if ":" in line)
        row["redis_peak_bytes"] = int(stats["used_memory_peak"])
        with open(out, "rb") as f:
            row["output"] = f.read()
    finally:
        for p in pool:
            p.kill()
            p.wait()
        if coordinator.poll() is None:
            coordinator.kill()
        for server in servers:
            server.kill()
            server.wait()
        shutil.rmtree(data_dir, ignore_errors=True)
    return row


def svg_plot(rows):
    """Batches merged/s against workers beside the load they offer (log-log)."""
    width, height, left, bottom, top, right = 560, 360, 70, 50, 20, 150
    workers = [r["workers"] for r in rows]
    offered = [r["workers"] * 1000 / r["delay_ms"] for r in rows]
    merged = [r["merged_per_s"] for r in rows]
    lo_x, hi_x = math.log2(min(workers) / 2), math.log2(max(workers) * 2)
    lo_y = math.floor(math.log10(min(merged) / 2))
    hi_y = math.ceil(math.log10(max(offered + [1000])))

    def x(w):
        return left + (width - left - right) * (math.log2(w) - lo_x) / (hi_x - lo_x)

    def y(v):
        return top + (height - top - bottom) * (1 - (math.log10(v) - lo_y) / (hi_y - lo_y))

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             'font-family="sans-serif" font-size="12">',
             f'<rect width="{width}" height="{height}" fill="white"/>']
    for e in range(lo_y, hi_y + 1):
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(10 ** e):.1f}" '
                     f'y2="{y(10 ** e):.1f}" stroke="#ddd"/>')
        parts.append(f'<text x="{left - 6}" y="{y(10 ** e) + 4:.1f}" text-anchor="end">'
                     f'{10 ** e:g}</text>')
    for w in workers:
        parts.append(f'<text x="{x(w):.1f}" y="{height - bottom + 16}" text-anchor="middle">'
                     f'{w}</text>')
    parts.append(f'<text x="{(left + width - right) / 2}" y="{height - 8}" '
                 'text-anchor="middle">worker processes</text>')
    parts.append(f'<text x="16" y="{(top + height - bottom) / 2}" text-anchor="middle" '
                 f'transform="rotate(-90 16 {(top + height - bottom) / 2})">batches/s</text>')
    series = [("offered", offered, "#888", ' stroke-dasharray="4 3"'),
              ("merged", merged, "#d62728", ""),
              ("goal", [1000] * len(rows), "#2ca02c", ' stroke-dasharray="1 3"')]
    for k, (name, values, color, dash) in enumerate(series):
        line = " ".join(f"{x(w):.1f},{y(v):.1f}" for w, v in zip(workers, values))
        parts.append(f'<polyline points="{line}" fill="none" stroke="{color}" '
                     f'stroke-width="2"{dash}/>')
        for w, v in zip(workers, values):
            parts.append(f'<circle cx="{x(w):.1f}" cy="{y(v):.1f}" r="3" fill="{color}"/>')
        ly = top + 20 * k + 10
        parts.append(f'<line x1="{width - right + 10}" x2="{width - right + 30}" y1="{ly}" '
                     f'y2="{ly}" stroke="{color}" stroke-width="2"{dash}/>')
        parts.append(f'<text x="{width - right + 36}" y="{ly + 4}">{name}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="16,64,256")
    parser.add_argument("--batches", type=int, default=10000)
    parser.add_argument("--delay-ms", type=int, default=100)
    parser.add_argument("--batches-per-task", type=int, default=None)
    parser.add_argument("--redis-cluster-masters", type=int, default=0,
                        help="run against a Redis Cluster of N masters (0: one redis-server)")
    args = parser.parse_args()
    for tool in (QFORGE, WORKER):
        if not os.path.exists(tool):
            sys.exit(f"{tool} is missing: cargo build --release -p qforge-cli && "
                     "cargo build --release -p qforge-runner --example synthetic_worker")
    if shutil.which("redis-server") is None:
        sys.exit("redis-server is not installed (scripts/test.sh installs it)")
    work = tempfile.mkdtemp(prefix="qforge-bench-scale-")
    try:
        template, data = make_inputs(work, args.batches)
        reference = run_once(work, template, data, args.batches, 1, 0, kill=False)["output"]
        rows = []
        for workers in (int(w) for w in args.workers.split(",")):
            row = run_once(work, template, data, args.batches, workers, args.delay_ms,
                           kill=True, per_task=args.batches_per_task,
                           masters=args.redis_cluster_masters)
            row["identical_to_one_worker"] = row.pop("output") == reference
            print(json.dumps(row), flush=True)
            rows.append(row)
        with open("target/bench-cluster-scale.json", "w") as f:
            json.dump({"rows": rows, "template_bytes": os.path.getsize(template)}, f, indent=2)
        with open("target/bench-cluster-scale.svg", "w") as f:
            f.write(svg_plot(rows))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
