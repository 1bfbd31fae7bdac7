#!/usr/bin/env python3
"""Starts two `qforge serve` commands (for example the x86-64 build and the aarch64
build under qemu-aarch64) on free loopback ports, sends each the same `/v1/act`
requests, and exits non-zero unless every answer is the same, actions and head
outputs alike.

    scripts/serve_same_answers.py OBSERVATIONS.jsonl \\
        --reference 'target/release/qforge serve --model ART' \\
        --candidate 'qemu-aarch64 -cpu max target/aarch64/.../qforge serve --model ART'

`--addr 127.0.0.1:0` is appended to each command; the port each server chose is
read from the line it logs when it listens. Standard library only.
"""

import argparse
import json
import shlex
import subprocess
import sys
import threading
import time
import urllib.request

# Generous: a server under emulation on a machine whose cores are busy starts slowly.
LISTEN_DEADLINE_S = 300


def start(command):
    """Starts `command` and returns (process, base URL) once it listens."""
    process = subprocess.Popen(
        shlex.split(command) + ["--addr", "127.0.0.1:0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    found = {}

    def read_log():
        for line in process.stderr:
            if "http://" in line and "url" not in found:
                found["url"] = "http://" + line.split("http://", 1)[1].strip()
                listening.set()
        listening.set()

    listening = threading.Event()
    threading.Thread(target=read_log, daemon=True).start()
    if not listening.wait(LISTEN_DEADLINE_S) or "url" not in found:
        process.kill()
        sys.exit(f"{command!r} did not start listening within {LISTEN_DEADLINE_S} s")
    return process, found["url"]


def act(url, observations):
    request = urllib.request.Request(
        url + "/v1/act",
        data=json.dumps({"observations": observations}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=LISTEN_DEADLINE_S) as response:
        return json.load(response)


def first_difference(reference, candidate):
    """Where two answers first differ, for the error message."""
    for key in sorted(set(reference) | set(candidate)):
        a, b = reference.get(key), candidate.get(key)
        if a == b:
            continue
        if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            row = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            return f"{key}[{row}] is {a[row]} on the reference and {b[row]} on the candidate"
        return f"{key} is {json.dumps(a)[:200]} on the reference, {json.dumps(b)[:200]} on the candidate"
    return "the answers differ"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("observations", help="JSONL, one episode's observations per line")
    parser.add_argument("--reference", required=True, help="a qforge serve command")
    parser.add_argument("--candidate", required=True, help="a qforge serve command")
    parser.add_argument("--episodes", type=int, default=2, help="episodes to send (default 2)")
    args = parser.parse_args()

    with open(args.observations) as f:
        episodes = [json.loads(line)["observations"] for line in f if line.strip()]
    episodes = episodes[: args.episodes]
    servers = [start(args.reference), start(args.candidate)]
    try:
        started = time.monotonic()
        rows = 0
        for number, observations in enumerate(episodes):
            reference, candidate = (act(url, observations) for _, url in servers)
            if reference != candidate:
                sys.exit(f"episode {number}: {first_difference(reference, candidate)}")
            rows += len(observations)
        print(
            f"{rows} observations in {len(episodes)} requests: the same answers "
            f"({time.monotonic() - started:.1f} s)"
        )
    finally:
        for process, _ in servers:
            process.terminate()
            process.wait()


if __name__ == "__main__":
    main()
