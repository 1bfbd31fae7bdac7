"""Attacks on what qforge reads outside its server: a Redis run's keys and an artifact's
files (scripts/attack.py runs them beside the server attacks, into the same table).

Each attack starts what it needs on 127.0.0.1 (a `redis-server`, `qforge calibrate
--cluster`, `qforge worker`s) in a scratch directory, bounds every wait, and stops
everything it started. Standard library only; Redis is spoken in RESP over a socket.
"""

import hashlib
import json
import os
import shutil
import socket
import struct
import subprocess
import tempfile
import time

HOST = "127.0.0.1"
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CARTPOLE = os.path.join(ROOT, "fixtures", "policies", "cartpole")
ROLLOUTS = os.path.join(CARTPOLE, "rollouts.jsonl")
# Fast heartbeats, a small plan: each run takes seconds.
RUN_FLAGS = ["--heartbeat-ms", "100", "--heartbeat-timeout-ms", "600", "--samples", "512",
             "--batch-size", "64"]
# A cluster key of the attacks' own, handed to coordinator and workers by the variable.
KEY = "attack-cluster-key-" + "0123456789abcdef" * 2


class Redis:
    """A RESP client: `redis("XADD", key, "*", field, value)` returns the reply."""

    def __init__(self, port):
        self.socket = socket.create_connection((HOST, port), timeout=10)
        self.reader = self.socket.makefile("rb")

    def __call__(self, *args):
        out = b"*%d\r\n" % len(args)
        for arg in args:
            arg = arg if isinstance(arg, bytes) else str(arg).encode()
            out += b"$%d\r\n%s\r\n" % (len(arg), arg)
        self.socket.sendall(out)
        return self.read()

    def read(self):
        line = self.reader.readline()
        kind, rest = line[:1], line[1:-2]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise RuntimeError(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else self.reader.read(n + 2)[:-2]
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self.read() for _ in range(n)]
        raise RuntimeError(f"unexpected reply {line!r}")


class RedisServer:
    """A `redis-server` on a free loopback port in `directory`."""

    def __init__(self, directory):
        with socket.socket() as probe:
            probe.bind((HOST, 0))
            self.port = probe.getsockname()[1]
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", HOST, "--save", "",
             "--appendonly", "no", "--dir", directory],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                if Redis(self.port)("PING") == "PONG":
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)
        self.url = f"redis://{HOST}:{self.port}"

    def stop(self):
        self.process.kill()
        self.process.wait()


class Scratch:
    """A scratch directory with a Redis server, and every process started in it."""

    def __init__(self, qforge, with_redis=True):
        self.qforge = qforge
        self.dir = tempfile.mkdtemp(prefix="qforge-attack-")
        self.redis = RedisServer(self.dir) if with_redis else None
        self.processes = []

    def start(self, *args, key=KEY):
        env = dict(os.environ, QFORGE_CLUSTER_KEY=key, RAYON_NUM_THREADS="1")
        log = open(os.path.join(self.dir, f"{len(self.processes)}.log"), "w+")
        process = subprocess.Popen([self.qforge, *args], env=env, stdout=subprocess.PIPE,
                                   stderr=log, text=True)
        process.log = log
        self.processes.append(process)
        return process

    def coordinator(self, run, *extra):
        out = os.path.join(self.dir, f"{run}.qstats")
        process = self.start("calibrate", "--model", CARTPOLE, "--data", ROLLOUTS,
                             "--cluster", self.redis.url, "--run", run, *RUN_FLAGS, *extra,
                             "--json", "-o", out)
        process.out = out
        return process

    def worker(self, run, name, *extra, key=KEY, wait=60):
        return self.start("worker", "--cluster", self.redis.url, "--run", run, "--name", name,
                          "--wait", str(wait), *extra, key=key)

    def clean_bytes(self):
        """A single-threaded run's statistics: what every cluster run must equal."""
        out = os.path.join(self.dir, "clean.qstats")
        subprocess.run([self.qforge, "calibrate", "--model", CARTPOLE, "--data", ROLLOUTS,
                        *RUN_FLAGS[4:], "--workers", "1", "-o", out], check=True,
                       capture_output=True)
        with open(out, "rb") as f:
            return f.read()

    def wait_for(self, predicate, seconds):
        deadline = time.monotonic() + seconds
        while not predicate():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def close(self):
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()
            process.log.close()
        if self.redis:
            self.redis.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def ended_within(process, seconds):
    """The exit status, or None when still running after `seconds` (then killed)."""
    try:
        return process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return None


def log_of(process):
    process.log.seek(0)
    return process.log.read()


def published(scratch, run):
    redis = Redis(scratch.redis.port)
    return lambda: redis("GET", f"qforge:{{{run}}}:spec") is not None


def cluster_exhausted_stream(ctx):
    scratch = Scratch(ctx.qforge)
    try:
        coordinator = scratch.coordinator("exhausted")
        scratch.wait_for(published(scratch, "exhausted"), 60)
        Redis(scratch.redis.port)("XADD", "qforge:{exhausted}:results",
                                  "18446744073709551615-18446744073709551615", "batches", "0")
        status = ended_within(coordinator, 30)
        said = log_of(coordinator)
        ctx.row("cluster: results entry 18446744073709551615-18446744073709551615",
                "coordinator fails at once, saying no worker can append",
                "still waiting after 30 s" if status is None else
                f"exit {status}: …{said.strip()[-70:]}",
                status not in (None, 0) and "no worker can append" in said)
    finally:
        scratch.close()


def cluster_unsealed_result(ctx):
    scratch = Scratch(ctx.qforge)
    try:
        clean = scratch.clean_bytes()
        coordinator = scratch.coordinator("unsealed")
        redis = Redis(scratch.redis.port)
        # What anyone who can write to Redis can forge: a result for a planned batch,
        # named as the tasks stream names it, under a worker name of its choosing.
        scratch.wait_for(lambda: redis("XLEN", "qforge:{unsealed}:tasks"), 60)
        _, fields = redis("XRANGE", "qforge:{unsealed}:tasks", "-", "+", "COUNT", "1")[0]
        task = dict(zip(fields[::2], fields[1::2]))
        redis("XADD", "qforge:{unsealed}:results", "*", "batches", task[b"batches"],
              "ids", task[b"ids"], "worker", "forger", "fingerprint", "0" * 64,
              "elapsed_us", "1", "speculative", "0", "stats", b"QFSTATS\0" + b"\0" * 40)
        scratch.worker("unsealed", "w1")
        status = ended_within(coordinator, 120)
        # The warnings: on stderr, and in the --json report.
        warnings = coordinator.stdout.read() + log_of(coordinator)
        with open(coordinator.out, "rb") if status == 0 else open(os.devnull, "rb") as f:
            same = f.read() == clean
        ctx.row("cluster: a result appended without the cluster key",
                "refused by its MAC and named; the output is the clean run's bytes",
                f"exit {status}; MAC named: {'fails its MAC' in warnings}, "
                f"forger named: {'forger' in warnings}; clean bytes: {same}",
                status == 0 and "fails its MAC" in warnings and "forger" in warnings and same)
    finally:
        scratch.close()


def cluster_foreign_key(ctx):
    scratch = Scratch(ctx.qforge)
    try:
        coordinator = scratch.coordinator("foreign-key")
        scratch.wait_for(published(scratch, "foreign-key"), 60)
        stranger = scratch.worker("foreign-key", "stranger", key="another-key-" + "x" * 32)
        status = ended_within(stranger, 60)
        said = log_of(stranger)
        differ = "another cluster key" in said
        ctx.row("cluster: a worker holding another cluster key",
                "refused before observing, saying the keys differ",
                "still running after 60 s" if status is None else
                f"exit {status}, " + ("says the keys differ" if differ else said.strip()[-60:]),
                status not in (None, 0) and differ)
        coordinator.kill()
    finally:
        scratch.close()


def cluster_frozen_redis(ctx):
    scratch = Scratch(ctx.qforge)
    try:
        worker = scratch.worker("never", "w1", "--outage-limit", "3", wait=600)
        redis = Redis(scratch.redis.port)
        # The worker waits for its run, connected (this client is the other one).
        scratch.wait_for(lambda: len(redis("CLIENT", "LIST").splitlines()) >= 2, 60)
        os.kill(scratch.redis.process.pid, 19)  # SIGSTOP: a hung Redis host
        frozen = time.monotonic()
        status = ended_within(worker, 30)
        waited = time.monotonic() - frozen
        ctx.row("cluster: Redis frozen (SIGSTOP) under a worker with --outage-limit 3",
                "the worker gives up within 4.5 s, naming the limit",
                "still waiting after 30 s" if status is None else
                f"exit {status} after {waited:.1f} s",
                status not in (None, 0) and waited < 4.5
                and "unreachable for more than 3 s" in log_of(worker))
    finally:
        scratch.close()


def reseal(artifact):
    """Rewrites manifest.json's hashes, as an attacker who edits files can."""
    path = os.path.join(artifact, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    for name, entry in manifest["files"].items():
        with open(os.path.join(artifact, name), "rb") as f:
            data = f.read()
        entry.update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    with open(path, "w") as f:
        json.dump(manifest, f, indent=2)


def artifact_tiny_scale(ctx):
    scratch = Scratch(ctx.qforge, with_redis=False)
    try:
        artifact = os.path.join(scratch.dir, "artifact")
        made = subprocess.run([ctx.qforge, "quantize", "-o", artifact], capture_output=True,
                              cwd=scratch.dir)
        if made.returncode != 0:
            ctx.row("artifact: a weight scale of 1e-40", "(needs an INT8 CartPole artifact)",
                    "skipped: qforge quantize refused CartPole here", True)
            return
        # A subnormal scale: its reciprocal is inf in f32, so every answer was action 0.
        weights = os.path.join(artifact, "model.safetensors")
        with open(weights, "rb") as f:
            raw = bytearray(f.read())
        (length,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + length])
        name = next(k for k in header if k.endswith(".weight_scale"))
        start = 8 + length + header[name]["data_offsets"][0]
        raw[start:start + 4] = struct.pack("<f", 1e-40)
        with open(weights, "wb") as f:
            f.write(raw)
        reseal(artifact)
        commands = {
            "verify": ["verify", artifact],
            "export": ["export", "--model", artifact, "--format", "onnx",
                       "-o", os.path.join(scratch.dir, "onnx")],
            "requantize": ["requantize", "--model", CARTPOLE, "--like", artifact,
                           "-o", os.path.join(scratch.dir, "requantized")],
            "act": ["act", "--model", artifact, "--observations", ROLLOUTS],
            "serve": ["serve", "--model", artifact, "--addr", f"{HOST}:0"],
        }
        refused = []
        for command, args in commands.items():
            try:
                out = subprocess.run([ctx.qforge, *args], capture_output=True, text=True,
                                     timeout=20)
                if out.returncode != 0 and f"{name} holds 1e-40" in out.stderr:
                    refused.append(command)
            except subprocess.TimeoutExpired:
                pass  # serve started on it: not refused
        ctx.row("artifact: a weight scale of 1e-40, manifest rewritten",
                "verify, export, requantize, act and serve refuse it naming the tensor",
                f"refused by {', '.join(refused) or 'none'}", len(refused) == len(commands))
    finally:
        scratch.close()


def needs_redis(attack):
    """`attack`, which reports itself skipped where `redis-server` is not installed."""
    def run(ctx):
        if shutil.which("redis-server") is None:
            ctx.row(attack.__name__.replace("_", " "), "(needs redis-server)",
                    "skipped: redis-server is not installed", True)
            return
        attack(ctx)
    run.__name__ = attack.__name__
    return run


ATTACKS = (*map(needs_redis, (cluster_exhausted_stream, cluster_unsealed_result,
                              cluster_foreign_key, cluster_frozen_redis)),
           artifact_tiny_scale)
