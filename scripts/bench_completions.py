"""Load benchmark of `qforge serve` /v1/completions, run by scripts/bench.sh: SmolLM2-135M
as an INT8 artifact (`qforge quantize --activations dynamic --no-method-search`, every
linear layer INT8 if the guard accepts it) and as its FP32 reference (the GGUF dequantized to f32), side
by side in one run: each behind its own server on loopback with the serving defaults
(256 sequences per step, a KV budget of 4 GiB), both up, measured in turn at each level.

Clients are threads with one keep-alive http.client connection each. Every request is
one of the 32 arithmetic prompts of fixtures/episodes/arithmetic.jsonl (in turn), sent
raw (no chat template), temperature 0, max_tokens 32. For each model and each
concurrency (1, 4, 16 clients) a fixed number of requests is sent plain, then at 1 and
16 clients streamed (SSE, stream_options.include_usage) for the time to first token;
then both servers are restarted with --engine-threads 1 (the engine's decode steps on one
thread instead of the default, every core) and measured plain at 1 and 16 clients. Generated
tokens are the responses' usage.completion_tokens. The server's /metrics give the mean
sequences per decode step and the prefill time; /proc gives the CPU the server, the
client and everything else used (the last one says whether the figures are noisy).
Client and server share the machine's cores.

Standard library only. Writes target/bench-completions.json; prints a summary on stderr.
"""

import http.client
import json
import math
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

QFORGE = os.environ.get("QFORGE", "target/release/qforge")
GGUF = "models/smollm2-135m-instruct-q4_1.gguf"
DATA = "fixtures/episodes/arithmetic.jsonl"
ARTIFACT = "target/bench-completions-int8"
OUT = "target/bench-completions.json"
MAX_TOKENS = 32
# (clients, requests): 32 requests = each prompt once.
LEVELS = [(1, 32), (4, 64), (16, 128)]
# Passes: the servers' extra arguments, then (streamed, levels) in order. The second
# pass restarts both servers with the engine's decode steps on one thread.
PASSES = [
    ("default", [], [(False, LEVELS), (True, [(1, 32), (16, 128)])]),
    ("--engine-threads 1", ["--engine-threads", "1"], [(False, [(1, 32), (16, 128)])]),
]
QUANTIZE = [QFORGE, "quantize", "--model", GGUF, "--data", DATA, "--samples", "32",
            "--activations", "dynamic", "--eval-data", "fixtures/text/eval.txt", "--ctx", "128",
            "--max-perplexity-increase", "0.1", "--no-method-search", "-o", ARTIFACT]
HTTP_TIMEOUT_S = 120
DEADLINE_S = 900  # the whole script; it stops itself past this


def log(*args):
    print(*args, file=sys.stderr, flush=True)


class Server:
    """`qforge serve --model MODEL --addr 127.0.0.1:0`; the bound address comes from its
    stderr line "listening on http://ADDR". Stopped with SIGTERM."""

    def __init__(self, model, args):
        self.process = subprocess.Popen(
            [QFORGE, "serve", "--model", model, "--addr", "127.0.0.1:0", *args],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True)
        self.lines = queue.Queue()
        self.log = []
        threading.Thread(target=self._drain, daemon=True).start()
        deadline = time.monotonic() + 120
        self.addr = None
        while self.addr is None:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                self.stop()
                raise SystemExit(f"qforge serve {model} did not start:\n" + "".join(self.log))
            match = re.search(r"listening on http://(\S+)", line)
            if match:
                self.addr = match.group(1)
        host, port = self.addr.rsplit(":", 1)
        if host not in ("127.0.0.1", "[::1]"):
            self.stop()
            raise SystemExit(f"qforge serve bound {self.addr}, not loopback")
        self.host, self.port = host, int(port)

    def _drain(self):
        for line in self.process.stderr:
            self.log.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def metrics(self):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=HTTP_TIMEOUT_S)
        try:
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
        finally:
            conn.close()
        values = {}
        for name in ("qforge_batch_rows_sum", "qforge_batch_rows_count",
                     "qforge_time_to_first_token_seconds_sum", "qforge_prompt_tokens_total"):
            match = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
            values[name] = float(match.group(1)) if match else None
        return values


def cpu_seconds(pid):
    """(all CPUs busy, process `pid`, this process) in seconds, from /proc; None where
    /proc is not there."""
    try:
        tick = os.sysconf("SC_CLK_TCK")
        with open("/proc/stat") as f:
            # user nice system idle iowait irq softirq steal (guest time is in user)
            fields = [int(v) for v in f.readline().split()[1:9]]
        busy = sum(fields) - fields[3] - fields[4]
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read().rsplit(")", 1)[1].split()
        server = int(stat[11]) + int(stat[12])  # utime, stime
    except (OSError, ValueError, IndexError):
        return None
    own = os.times()
    return busy / tick, server / tick, own.user + own.system


def complete(conn, prompt, stream):
    """One request on `conn`; returns (latency s, time to first text s or None,
    completion tokens, text)."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    started = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    if not stream:
        answer = json.loads(response.read())
        return (time.perf_counter() - started, None, answer["usage"]["completion_tokens"],
                answer["choices"][0]["text"])
    first, tokens, pieces = None, None, []
    while True:
        line = response.readline()
        if not line:
            raise RuntimeError("stream ended without [DONE]")
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            raise RuntimeError(f"stream error: {event['error']}")
        for choice in event.get("choices", []):
            if choice.get("text"):
                if first is None:
                    first = time.perf_counter() - started
                pieces.append(choice["text"])
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    response.read()  # the chunked body's end, so the connection can be reused
    if tokens is None:
        raise RuntimeError("stream without usage")
    return time.perf_counter() - started, first, tokens, "".join(pieces)


def percentile(values, p):
    """Nearest rank."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p * len(ordered)) - 1)]


def load(server, prompts, clients, requests, stream):
    """`requests` requests from `clients` threads; request i sends prompt i mod len."""
    lock = threading.Lock()
    counter = iter(range(requests))
    results, errors = [], []

    def client():
        conn = http.client.HTTPConnection(server.host, server.port, timeout=HTTP_TIMEOUT_S)
        try:
            while True:
                with lock:
                    i = next(counter, None)
                    if i is None or errors:
                        return
                latency, first, tokens, text = complete(conn, prompts[i % len(prompts)], stream)
                with lock:
                    results.append((i, latency, first, tokens, text))
        except Exception as e:  # noqa: BLE001 - reported and fatal below
            with lock:
                errors.append(repr(e))
        finally:
            conn.close()

    before = server.metrics()
    cpu_before = cpu_seconds(server.process.pid)
    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    cpu_after = cpu_seconds(server.process.pid)
    after = server.metrics()
    if errors:
        raise SystemExit(f"{clients} clients: {errors[0]}")
    latencies = [r[1] for r in results]
    tokens = sum(r[3] for r in results)
    row = {
        "clients": clients, "requests": requests, "stream": stream,
        "seconds": seconds,
        "requests_per_s": requests / seconds,
        "completion_tokens": tokens,
        "tokens_per_request": tokens / requests,
        "tokens_per_s": tokens / seconds,
        "p50_ms": 1e3 * percentile(latencies, 0.50),
        "p99_ms": 1e3 * percentile(latencies, 0.99),
    }
    if stream:
        row["ttft_p50_ms"] = 1e3 * percentile([r[2] for r in results if r[2] is not None], 0.50)
    steps = (after["qforge_batch_rows_count"] or 0) - (before["qforge_batch_rows_count"] or 0)
    if steps > 0:
        rows = after["qforge_batch_rows_sum"] - before["qforge_batch_rows_sum"]
        row["decode_steps"] = int(steps)
        row["sequences_per_step"] = rows / steps
        # Prefill runs on the engine thread between steps; the time to first token the
        # server measures is that prefill (from admission to the first token).
        prefill = (after["qforge_time_to_first_token_seconds_sum"]
                   - before["qforge_time_to_first_token_seconds_sum"])
        row["prefill_seconds"] = prefill
        row["prompt_tokens"] = int(after["qforge_prompt_tokens_total"]
                                   - before["qforge_prompt_tokens_total"])
        # Upper bound of one decode step: the wall time the engine did not spend in prefill
        # (exact when the engine is never idle, i.e. under enough load).
        row["ms_per_step_at_most"] = 1e3 * (seconds - prefill) / steps
    if cpu_before and cpu_after:
        busy, served, own = (b - a for a, b in zip(cpu_before, cpu_after))
        cores = os.cpu_count()
        row["cpu_server"] = served / (seconds * cores)
        row["cpu_client"] = own / (seconds * cores)
        # Everything else on the machine (a compile, say): the noise indicator.
        row["cpu_others"] = max(0.0, busy - served - own) / (seconds * cores)
    texts = {r[0]: r[4] for r in results if r[0] < len(prompts)}
    return row, texts


def main():
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(
        SystemExit(f"bench_completions: past {DEADLINE_S} s, stopping")))
    signal.alarm(DEADLINE_S)
    begun = time.monotonic()
    load_before = os.getloadavg()
    with open(DATA) as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]

    out = subprocess.run([*QUANTIZE, "--json"], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"qforge quantize failed ({out.returncode}):\n{out.stderr}")
    quantized = json.loads(out.stdout)
    log(f"quantize: accepted={quantized['accepted']} ppl {quantized['after']['perplexity']:.2f} "
        f"(FP {quantized['reference']['perplexity']:.2f}), "
        f"{quantized['fp_layers']}/{quantized['total_layers']} layers FP")

    models = [("INT8 artifact", ARTIFACT), ("FP32 reference", GGUF)]
    rows, texts = [], {}
    for config, args, runs in PASSES:
        # Both servers up at once (an idle one sleeps), measured in turn at each level, so
        # that a change in what else runs on the machine hits both alike.
        servers = {}
        try:
            for label, model in models:
                servers[label] = Server(model, args)
                load(servers[label], prompts, 1, 2, False)  # warm-up, not measured
            for stream, levels in runs:
                for clients, requests in levels:
                    for label, _ in models:
                        row, level_texts = load(servers[label], prompts, clients, requests,
                                                stream)
                        row.update(model=label, config=config,
                                   load_avg_1m=os.getloadavg()[0])
                        rows.append(row)
                        if clients == 1 and not stream and config == "default":
                            texts[label] = level_texts
                        log(f"{config[:7]:7} {label:15} {'stream' if stream else 'plain ':6} "
                            f"c={clients:<2} "
                            f"{row['requests_per_s']:6.2f} req/s {row['tokens_per_s']:6.1f} tok/s "
                            f"p50 {row['p50_ms']:6.0f} ms p99 {row['p99_ms']:6.0f} ms "
                            f"{row['tokens_per_request']:.1f} tok/req "
                            f"{row.get('sequences_per_step', 0):.1f} seq/step "
                            f"{row.get('ms_per_step_at_most', 0):.1f} ms/step "
                            f"prefill {row.get('prefill_seconds', 0):.2f} s "
                            f"cpu srv/cli/other {row.get('cpu_server', 0):.2f}/"
                            f"{row.get('cpu_client', 0):.2f}/{row.get('cpu_others', 0):.2f}"
                            + (f" ttft p50 {row['ttft_p50_ms']:.0f} ms" if stream else ""))
        finally:
            for server in servers.values():
                server.stop()
    same = sum(texts[models[0][0]].get(i) == texts[models[1][0]].get(i) for i in range(len(prompts)))
    result = {
        "command": "python3 scripts/bench_completions.py",
        "quantize_command": " ".join(QUANTIZE),
        "quantize": {k: quantized[k] for k in ("accepted", "after", "reference", "fp_layers",
                                              "total_layers", "fallback_steps", "held_out")},
        "prompts": len(prompts), "max_tokens": MAX_TOKENS, "temperature": 0,
        "passes": [{"config": c, "args": e,
                    "runs": [{"stream": st, "levels": [{"clients": n, "requests": r}
                                                       for n, r in lv]} for st, lv in runs]}
                   for c, e, runs in PASSES],
        "same_text_at_1_client": same,
        "cores": os.cpu_count(),
        "load_avg_before": load_before[0], "load_avg_after": os.getloadavg()[0],
        "seconds": time.monotonic() - begun,
        "rows": rows,
    }
    with open(OUT, "w") as f:
        json.dump(result, f, indent=2)
    log(f"INT8 and FP32 gave the same text for {same}/{len(prompts)} prompts; "
        f"load average {load_before[0]:.2f} -> {os.getloadavg()[0]:.2f}; "
        f"{result['seconds']:.0f} s; wrote {OUT}")


if __name__ == "__main__":
    main()
