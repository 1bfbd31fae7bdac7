"""A short request's time to first token while a long prompt is prefilled beside it, the
long prompt's served prefill speed, and the server's peak memory.

    python3 scripts/bench_ttft.py QFORGE MODEL [--long-tokens 4096] [--prefill-chunk 256]
                                  [--prefill-threads N]

Starts `qforge serve --model MODEL` on a free loopback port, sends the start of the
handbook evaluation text (about --long-tokens tokens, max_tokens 1), and once the server
reports that prompt in prefill (`qforge_prefilling_sequences`), a streamed 8-token
completion whose first token's arrival is timed. Then the same long prompt alone, for its
unshared prefill speed. Prints one JSON object.
"""
import argparse
import json
import socket
import subprocess
import threading
import time
import urllib.request

from bench_long_prompts import CHARS_PER_TOKEN, TEXT


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port, body, stream=False):
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     json.dumps(dict(body, stream=stream)).encode(),
                                     {"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=600)


def metric(port, name):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return None


def peak_rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("qforge")
    parser.add_argument("model")
    parser.add_argument("--long-tokens", type=int, default=4096)
    parser.add_argument("--prefill-chunk", type=int, default=256)
    parser.add_argument("--prefill-threads", type=int, default=None,
                        help="the server's --prefill-threads (default: the server's own)")
    args = parser.parse_args()
    with open(TEXT) as f:
        long_prompt = f.read()[:int(args.long_tokens * CHARS_PER_TOKEN)]
    port = free_port()
    server = subprocess.Popen([args.qforge, "serve", "--model", args.model,
                               "--addr", f"127.0.0.1:{port}",
                               "--prefill-chunk", str(args.prefill_chunk),
                               *(["--prefill-threads", str(args.prefill_threads)]
                                 if args.prefill_threads else []),
                               "--max-prompt-tokens", str(args.long_tokens + 64),
                               "--timeout-ms", "600000"], stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1)
                break
            except OSError:
                if time.time() > deadline or server.poll() is not None:
                    raise SystemExit("the server did not become ready")
                time.sleep(0.1)
        post(port, {"prompt": "Hello", "max_tokens": 1}).read()
        long = {}

        def long_request():
            start = time.perf_counter()
            with post(port, {"prompt": long_prompt, "max_tokens": 1}) as r:
                long["usage"] = json.load(r)["usage"]
            long["seconds"] = time.perf_counter() - start

        thread = threading.Thread(target=long_request)
        thread.start()
        while not metric(port, "qforge_prefilling_sequences"):
            time.sleep(0.01)
        start = time.perf_counter()
        first = None
        with post(port, {"prompt": "What is 2 + 2?", "max_tokens": 8}, stream=True) as r:
            for line in r:
                if first is None and line.startswith(b"data: {"):
                    first = time.perf_counter() - start
        short_total = time.perf_counter() - start
        thread.join()
        alone_start = time.perf_counter()
        with post(port, {"prompt": long_prompt, "max_tokens": 1}) as r:
            tokens = json.load(r)["usage"]["prompt_tokens"]
        alone = time.perf_counter() - alone_start
        print(json.dumps({
            "prefill_chunk": args.prefill_chunk,
            "prefill_threads": args.prefill_threads,
            "long_prompt_tokens": tokens,
            "short_time_to_first_token_s": first,
            "short_total_s": short_total,
            "long_beside_short_s": long["seconds"],
            "long_alone_s": alone,
            "long_alone_prefill_tokens_per_s": tokens / alone,
            "server_peak_rss_mib": peak_rss_mib(server.pid),
        }, indent=1))
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
