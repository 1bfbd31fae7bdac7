"""Load benchmark of `qforge serve` /v1/act, run by scripts/bench.sh: wrk (Debian) on
loopback against the INT8 artifact of the CartPole policy and against its FP source,
side by side, with 1 and 32 observations per request. Server and client share the
machine's cores, so the figures are what one box sustains, not the server alone.

Writes target/bench-serve.json.
"""

import json
import os
import re
import subprocess

QFORGE = os.environ.get("QFORGE", "target/release/qforge")
ARTIFACT = "target/bench-serve-artifact"
CONNECTIONS = 16
SECONDS = 8


def start(model):
    server = subprocess.Popen([QFORGE, "serve", "--model", model, "--addr", "127.0.0.1:0"],
                              stderr=subprocess.PIPE, text=True)
    line = server.stderr.readline()
    match = re.search(r"http://(\S+)", line)
    if not match:
        server.kill()
        raise SystemExit(f"qforge serve did not start: {line}")
    return server, match.group(1)


def to_ms(value, unit):
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]


def wrk(addr, body):
    env = dict(os.environ, QFORGE_BODY=body)
    out = subprocess.run(["wrk", "-t1", f"-c{CONNECTIONS}", f"-d{SECONDS}s", "--latency",
                          "-s", "scripts/wrk_act.lua", f"http://{addr}/v1/act"],
                         env=env, capture_output=True, text=True, check=True).stdout
    if "Non-2xx" in out:
        raise SystemExit(f"wrk saw errors:\n{out}")
    latency = {p: to_ms(v, u) for p, v, u in
               re.findall(r"^\s+(50|99)%\s+([\d.]+)(us|ms|s)$", out, re.M)}
    return {"requests_per_s": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
            "p50_ms": latency["50"], "p99_ms": latency["99"]}


def main():
    subprocess.run([QFORGE, "quantize", "-o", ARTIFACT, "--json"], check=True,
                   capture_output=True)
    first = json.loads(open("fixtures/policies/cartpole/rollouts.jsonl").readline())
    rows = first["observations"]
    results = []
    for label, model in [("INT8 artifact", ARTIFACT), ("FP32 policy", "fixtures/policies/cartpole")]:
        server, addr = start(model)
        try:
            for per_request in [1, 32]:
                body = json.dumps({"observations": rows[:per_request]})
                r = wrk(addr, body)
                r.update({"model": label, "observations_per_request": per_request,
                          "observations_per_s": r["requests_per_s"] * per_request})
                results.append(r)
        finally:
            server.terminate()
            server.wait()
    with open("target/bench-serve.json", "w") as f:
        json.dump({"connections": CONNECTIONS, "seconds": SECONDS, "rows": results}, f, indent=2)


if __name__ == "__main__":
    main()
