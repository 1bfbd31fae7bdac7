"""Schemathesis (PyPI) fuzzes `qforge serve` against the OpenAPI document the server
publishes at /openapi.json: valid and invalid bodies, headers and boundary values for
every operation, with every check (no 5xx, status codes and content types the document
lists, responses and SSE events matching their schemas, invalid data refused).

Two servers: the bundled CartPole artifact (policy endpoints; the document states its
observation width), and SmolLM2 (the completion endpoints, streaming included). For the
language model the `positive_data_acceptance` check is left out: whether a prompt plus
max_tokens fits the context depends on the prompt's token count, which a schema cannot
state, so a schema-valid request can rightly get 400. A small KV budget keeps every
generation short: with 32 positions, 196 of the 681 requests generate (206 with 64) and
the run takes 84 s instead of 225 s, nearly all of it the model's decode steps."""

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QFORGE = os.environ.get("QFORGE", str(ROOT / "target/release/qforge"))
SCHEMATHESIS = str(Path(sys.executable).parent / "st")


def start(model, *args, cwd):
    server = subprocess.Popen(
        [QFORGE, "serve", "--model", str(model), "--addr", "127.0.0.1:0", *args],
        cwd=cwd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    seen = []
    for line in server.stderr:
        if "http://" in line:
            # Keep draining stderr so the server never blocks on a full pipe.
            threading.Thread(target=server.stderr.read, daemon=True).start()
            return server, line.split("http://")[1].strip()
        seen.append(line)
    raise AssertionError(f"qforge serve stopped before listening: {''.join(seen)}")


def fuzz(addr, *extra):
    out = subprocess.run(
        [SCHEMATHESIS, "run", f"http://{addr}/openapi.json", "--checks", "all",
         "--generation-deterministic", "--request-timeout", "30", *extra],
        capture_output=True, text=True, timeout=900)
    summary = out.stdout[-4000:]
    print(summary)
    assert out.returncode == 0, summary
    assert " passed" in summary


@pytest.mark.parametrize("kind", ["policy", "language-model"])
def test_every_operation_keeps_its_published_contract(tmp_path, kind):
    if kind == "policy":
        subprocess.run([QFORGE, "quantize", "-o", "artifact", "--json"], cwd=tmp_path,
                       check=True, capture_output=True)
        server, addr = start("artifact", cwd=tmp_path)
        extra = ["--max-examples", "100"]
    else:
        server, addr = start(ROOT / "models/smollm2-135m-instruct-q4_1.gguf",
                             "--kv-budget-tokens", "32", cwd=tmp_path)
        extra = ["--max-examples", "40", "--exclude-checks", "positive_data_acceptance"]
    try:
        fuzz(addr, *extra)
    finally:
        server.terminate()
        server.wait(timeout=30)
