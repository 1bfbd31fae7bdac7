"""Return of a quantized policy across the real serving boundary.

Starts `qforge serve` for the INT8 artifact and for its full-precision source (the
path its manifest records), drives each with a gymnasium client over HTTP `/v1/act`
for N seeded episodes (env.reset(seed=s), s = seed_start …), measures uniform random
actions on the same seeds, and prints one JSON object:
{"env", "episodes", "fp_return", "int8_return", "random_return", "consistency"}, with
consistency = 1 − |int8 − fp| / |fp − random| (meaningful for negative returns too).
"""

import argparse
import http.client
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np

ROOT = Path(__file__).resolve().parents[1]


class Server:
    def __init__(self, qforge, model):
        self.process = subprocess.Popen(
            [qforge, "serve", "--model", str(model), "--addr", "127.0.0.1:0"],
            stderr=subprocess.PIPE, text=True)
        line = self.process.stderr.readline()
        match = re.search(r"http://([\d.]+):(\d+)", line)
        if not match:
            self.process.kill()
            sys.exit(f"qforge serve did not start for {model}: {line.strip()}")
        self.connection = http.client.HTTPConnection(match.group(1), int(match.group(2)), timeout=30)

    def act(self, observation):
        body = json.dumps({"observations": [np.asarray(observation, dtype=np.float32).tolist()]})
        self.connection.request("POST", "/v1/act", body, {"Content-Type": "application/json"})
        response = self.connection.getresponse()
        payload = response.read()
        if response.status != 200:
            sys.exit(f"/v1/act answered {response.status}: {payload.decode(errors='replace')}")
        return json.loads(payload)["actions"][0]

    def close(self):
        self.connection.close()
        self.process.terminate()
        self.process.wait()


def episode_return(env, seed, choose):
    observation, _ = env.reset(seed=seed)
    total, done = 0.0, False
    while not done:
        action = choose(observation)
        if isinstance(action, list):
            action = np.asarray(action, dtype=np.float32)
        observation, reward, terminated, truncated, _ = env.step(action)
        total += float(reward)
        done = terminated or truncated
    return total


def random_return(env, seed):
    env.reset(seed=seed)
    env.action_space.seed(seed)
    return episode_return(env, seed, lambda _: env.action_space.sample())


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("env", help="gymnasium environment id, e.g. CartPole-v1")
    parser.add_argument("artifact", type=Path, help="native artifact (qforge quantize -o DIR)")
    parser.add_argument("--episodes", type=int, default=20)
    parser.add_argument("--seed-start", type=int, default=1000)
    parser.add_argument("--qforge", default=os.environ.get("QFORGE", str(ROOT / "target/release/qforge")))
    args = parser.parse_args()
    if args.episodes < 1:
        sys.exit("--episodes must be at least 1")

    manifest_path = args.artifact / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
        source = Path(manifest["info"]["source_model"]["path"])
    except (OSError, KeyError, ValueError) as e:
        sys.exit(f"{manifest_path}: not a qforge artifact manifest with a source model ({e})")
    policy = json.loads((args.artifact / "policy.json").read_text())
    if policy.get("env") not in (None, args.env):
        sys.exit(f"the artifact's policy was trained on {policy['env']}, not {args.env}")

    env = gym.make(args.env)
    seeds = range(args.seed_start, args.seed_start + args.episodes)
    returns = {}
    for name, model in [("int8", args.artifact), ("fp", source)]:
        server = Server(args.qforge, model)
        try:
            returns[name] = float(np.mean([episode_return(env, s, server.act) for s in seeds]))
        finally:
            server.close()
    random = float(np.mean([random_return(env, s) for s in seeds]))
    spread = abs(returns["fp"] - random)
    consistency = 1.0 - abs(returns["int8"] - returns["fp"]) / spread if spread > 0 else float("nan")
    print(json.dumps({
        "env": args.env,
        "episodes": args.episodes,
        "fp_return": returns["fp"],
        "int8_return": returns["int8"],
        "random_return": random,
        "consistency": consistency,
    }))


if __name__ == "__main__":
    main()
