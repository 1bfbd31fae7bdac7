"""Peak resident memory of `qforge serve` through one 4000-token prefill, for
several --prefill-chunk values (VmHWM of the server process, before and after).

    python3 scripts/bench_prefill_memory.py QFORGE MODEL 256,4096
"""
import json, subprocess, sys, time, urllib.request, socket, threading
QFORGE, MODEL = sys.argv[1], sys.argv[2]
def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p
def rss(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM"): return int(line.split()[1]) / 1024
for chunk in [int(c) for c in sys.argv[3].split(",")]:
    port = free_port()
    srv = subprocess.Popen([QFORGE, "serve", "--model", MODEL, "--addr", f"127.0.0.1:{port}", "--prefill-chunk", str(chunk), "--timeout-ms", "600000"], stderr=subprocess.DEVNULL)
    for _ in range(600):
        try: urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1); break
        except Exception: time.sleep(0.1)
    body = json.dumps({"prompt": "word " * 3999, "max_tokens": 1, "temperature": 0}).encode()
    before = rss(srv.pid)
    t = time.perf_counter()
    out = json.load(urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}), timeout=900))
    print(f"chunk {chunk}: {out['usage']['prompt_tokens']} tokens in {time.perf_counter()-t:.1f} s; peak RSS {before:.0f} MiB after load, {rss(srv.pid):.0f} MiB after the prefill", flush=True)
    srv.terminate(); srv.wait()
