"""How `qforge serve --prefill-chunk` trades prefill speed against the wait of
the others: for each chunk size, the time of a 2000-token prompt alone, then
of an 8-token completion sent one second into another such prefill.

    python3 scripts/bench_prefill_chunk.py QFORGE MODEL 64,128,256,512,2048

A chunk as long as the prompt is the unchunked engine."""
import json, subprocess, sys, threading, time, urllib.request, socket

QFORGE = sys.argv[1]
MODEL = sys.argv[2]
CHUNKS = [int(c) for c in sys.argv[3].split(',')]
LONG = "word " * 1999

def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

def post(port, prompt, max_tokens):
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.load(r)
    return time.perf_counter() - t, out

for chunk in CHUNKS:
    port = free_port()
    server = subprocess.Popen([QFORGE, "serve", "--model", MODEL, "--addr", f"127.0.0.1:{port}",
                               "--prefill-chunk", str(chunk), "--timeout-ms", "600000"],
                              stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1); break
            except Exception:
                time.sleep(0.1)
        post(port, "Hello", 1)  # warm up
        alone, out = post(port, LONG, 1)
        tokens = out["usage"]["prompt_tokens"]
        result = {}
        def long_request():
            result["long"] = post(port, LONG, 1)[0]
        t = threading.Thread(target=long_request); t.start()
        time.sleep(1.0)
        short, _ = post(port, "What is 2 + 2?", 8)
        t.join()
        print(f"chunk {chunk:5d}: {tokens} prompt tokens alone {alone:6.2f} s ({tokens/alone:6.1f} tok/s); "
              f"short request (8 tokens) during it {short:6.2f} s; long beside it {result['long']:6.2f} s", flush=True)
    finally:
        server.terminate(); server.wait()
