#!/usr/bin/env python3
"""INT8 rollouts inside an RL loop, measured: a policy-gradient learner trains a
CartPole-v1 policy from scratch while its rollouts come from `qforge serve`.

Three ways to roll out, each trained from the same seeds:

  fp        the learner samples its own full-precision policy (numpy): the baseline.
  int8      rollouts sampled by `qforge serve` from the INT8 artifact; after every
            update the new weights are requantized with the first calibration's
            frozen scales (`qforge requantize --like`) and hot-reloaded
            (`POST /admin/reload`). The learner treats the samples as its own.
  int8-tis  the same rollouts, with truncated importance sampling: every sample's
            policy-gradient term is weighted by w = min(pi_train / pi_rollout, C),
            where pi_rollout is the log-probability `/v1/act` returned for the
            action it sampled (FlashRL's correction; C = --tis-cap).

The learner is REINFORCE with reward-to-go, a per-timestep mean baseline,
normalized advantages and Adam; its policy is the fixture's shape (4-32-32-2 tanh).
The artifact the loop starts from is quantized once (`qforge quantize`, the
default static W8A8 recipe) on rollouts of the freshly initialized policy, as
FlashRL calibrates once; every later artifact keeps those activation scales.

Per run it records the mean return of every update's episodes, the first update
whose episodes average >= --target (475), the weight-sync time (from the start
of requantize until the first `/v1/act` answer carrying the new
X-Qforge-Model-Version) and the mean |log pi_train - log pi_rollout|. It writes
results JSON, an SVG plot of return against update step (median and range over
seeds) and prints a Markdown table for BENCHMARKS.md.

Usage:
  python scripts/rl_loop.py --qforge target/release/qforge --seeds 5 --out rl-loop
"""

import os

# Single-threaded, deterministic BLAS. Must happen before numpy is imported.
for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import http.client  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import secrets  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODES = ("fp", "int8", "int8-tis")
HIDDEN = (32, 32)


# --------------------------------------------------------------------------
# The policy: an MLP with tanh hidden layers and a categorical head.
# --------------------------------------------------------------------------

def init_policy(rng, sizes):
    """Orthogonal-style init (scaled Gaussian), the last layer 100x smaller so
    the first policy is close to uniform, as PPO implementations do."""
    params = []
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        scale = 0.01 if i == len(sizes) - 2 else 1.0
        weight = rng.normal(0.0, scale / np.sqrt(fan_in), size=(fan_out, fan_in))
        params += [weight, np.zeros(fan_out)]
    return params


def forward(params, obs):
    """Logits and the hidden activations the gradient needs."""
    activations = [obs]
    x = obs
    layers = len(params) // 2
    for i in range(layers):
        x = x @ params[2 * i].T + params[2 * i + 1]
        if i < layers - 1:
            x = np.tanh(x)
        activations.append(x)
    return x, activations


def log_softmax(logits):
    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def policy_gradient(params, obs, actions, weights):
    """Gradient of -mean(weights * log pi(actions | obs)) and the log-probs."""
    logits, activations = forward(params, obs)
    logp = log_softmax(logits)
    chosen = logp[np.arange(len(actions)), actions]
    # d(-mean(w log p_a))/dlogits = -(w / n) (onehot(a) - softmax).
    grad = np.exp(logp)
    grad[np.arange(len(actions)), actions] -= 1.0
    grad *= (weights / len(actions))[:, None]
    grads = [None] * len(params)
    for i in reversed(range(len(params) // 2)):
        grads[2 * i] = grad.T @ activations[i]
        grads[2 * i + 1] = grad.sum(axis=0)
        if i > 0:
            grad = (grad @ params[2 * i]) * (1.0 - activations[i] ** 2)
    return grads, chosen


class Adam:
    def __init__(self, params, lr):
        self.lr, self.t = lr, 0
        self.m = [np.zeros_like(p) for p in params]
        self.v = [np.zeros_like(p) for p in params]

    def step(self, params, grads, beta1=0.9, beta2=0.999, eps=1e-8):
        self.t += 1
        for p, g, m, v in zip(params, grads, self.m, self.v):
            m *= beta1
            m += (1 - beta1) * g
            v *= beta2
            v += (1 - beta2) * g * g
            m_hat = m / (1 - beta1 ** self.t)
            v_hat = v / (1 - beta2 ** self.t)
            p -= self.lr * m_hat / (np.sqrt(v_hat) + eps)


def write_policy(params, directory):
    """The policy in qforge's `qforge-mlp-policy` format (float32 weights)."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i in range(len(params) // 2):
        tensors[f"layers.{i}.weight"] = np.ascontiguousarray(params[2 * i], dtype=np.float32)
        tensors[f"layers.{i}.bias"] = np.ascontiguousarray(params[2 * i + 1], dtype=np.float32)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "policy.json").write_text(json.dumps({
        "format": "qforge-mlp-policy", "version": 1, "env": "CartPole-v1",
        "observation_dim": 4, "hidden": list(HIDDEN), "activation": "tanh",
        "head": {"kind": "discrete", "actions": 2}}))


# --------------------------------------------------------------------------
# qforge: the server and the weight sync.
# --------------------------------------------------------------------------

class Server:
    """`qforge serve` on a free loopback port; its log goes to a file (a pipe
    nobody drains would stall the server once full)."""

    def __init__(self, qforge, model, log_path, token):
        self.token = token
        env = dict(os.environ, QFORGE_SERVE_TOKEN=token)
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(
            [qforge, "serve", "--model", str(model), "--addr", "127.0.0.1:0"],
            stderr=subprocess.PIPE, text=True, env=env)
        self.address = None
        listening = threading.Event()

        def pump():
            for line in self.process.stderr:
                self.log.write(line)
                self.log.flush()
                match = re.search(r"listening on http://([\d.]+):(\d+)", line)
                if match and self.address is None:
                    self.address = (match.group(1), int(match.group(2)))
                    listening.set()
            listening.set()

        threading.Thread(target=pump, daemon=True).start()
        listening.wait(timeout=120)
        if self.address is None:
            self.process.kill()
            sys.exit(f"qforge serve did not start for {model}: see {log_path}")
        self.connection = http.client.HTTPConnection(*self.address, timeout=60)

    def post(self, path, body):
        # With a token set (reloading needs one) every endpoint asks for it.
        self.connection.request("POST", path, json.dumps(body),
                                {"Content-Type": "application/json",
                                 "Authorization": f"Bearer {self.token}"})
        response = self.connection.getresponse()
        payload = json.loads(response.read())
        if response.status != 200:
            sys.exit(f"{path} answered {response.status}: {payload}")
        return payload, response.getheader("X-Qforge-Model-Version")

    def act(self, observations, seed):
        answer, version = self.post("/v1/act", {
            "observations": np.asarray(observations, dtype=np.float32).tolist(),
            "sample": True, "seed": seed})
        return np.asarray(answer["actions"]), np.asarray(answer["log_probs"]), int(version)

    def reload(self, artifact):
        answer, _ = self.post("/admin/reload", {"model": str(artifact)})
        return answer["version"]

    def close(self):
        self.connection.close()
        self.process.terminate()
        self.process.wait()
        self.log.close()


def run_qforge(qforge, *args):
    done = subprocess.run([qforge, *args], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"qforge {' '.join(args)} failed ({done.returncode}):\n{done.stderr}")
    return done


def write_rollouts(path, episodes):
    with open(path, "w") as f:
        for observations, actions, rewards in episodes:
            f.write(json.dumps({"observations": observations.tolist(),
                                "actions": actions.tolist(), "rewards": rewards.tolist()}) + "\n")


# --------------------------------------------------------------------------
# Rollouts and the learner.
# --------------------------------------------------------------------------

def collect(envs, reset_seeds, choose):
    """Runs one episode in every env; `choose(obs_batch)` returns the actions
    and their rollout log-probs. Returns per-episode (obs, actions, rewards,
    rollout log-probs)."""
    n = len(envs)
    obs = np.stack([env.reset(seed=int(s))[0] for env, s in zip(envs, reset_seeds)])
    running = np.ones(n, dtype=bool)
    trajectories = [([], [], [], []) for _ in range(n)]
    while running.any():
        active = np.flatnonzero(running)
        actions, log_probs = choose(obs[active])
        for j, i in enumerate(active):
            o, a = obs[i].copy(), int(actions[j])
            next_obs, reward, terminated, truncated, _ = envs[i].step(a)
            t = trajectories[i]
            t[0].append(o)
            t[1].append(a)
            t[2].append(reward)
            t[3].append(log_probs[j])
            obs[i] = next_obs
            if terminated or truncated:
                running[i] = False
    return [tuple(np.asarray(x) for x in t) for t in trajectories]


def advantages(episodes):
    """Reward-to-go minus the mean reward-to-go at the same timestep across
    the batch's episodes, normalized over the batch."""
    to_go = [np.cumsum(r[::-1])[::-1] for _, _, r, _ in episodes]
    longest = max(len(g) for g in to_go)
    sums, counts = np.zeros(longest), np.zeros(longest)
    for g in to_go:
        sums[:len(g)] += g
        counts[:len(g)] += 1
    baseline = sums / counts
    adv = np.concatenate([g - baseline[:len(g)] for g in to_go])
    return (adv - adv.mean()) / (adv.std() + 1e-8)


def train(mode, seed, args, work):
    rng = np.random.default_rng(seed)
    params = init_policy(rng, (4, *HIDDEN, 2))
    optimizer = Adam(params, args.lr)
    envs = [gym.make("CartPole-v1") for _ in range(args.episodes)]
    server = None
    record = {"mode": mode, "seed": seed, "returns": [], "sync_ms": [], "logprob_mismatch": [],
              "changed_share": [], "drift_warnings": 0, "clipped_share": []}
    sample_seed = iter(rng.integers(0, 2**63, size=10**7))

    def fp_choose(obs):
        logp = log_softmax(forward(params, obs)[0])
        u = rng.random(len(obs))
        actions = (u > np.exp(logp[:, 0])).astype(int)
        return actions, logp[np.arange(len(obs)), actions]

    expected_version = [0]

    def int8_choose(obs):
        actions, log_probs, version = server.act(obs, int(next(sample_seed)))
        if version != expected_version[0]:
            sys.exit(f"/v1/act answered with model version {version}, expected {expected_version[0]}")
        return actions, log_probs

    if mode != "fp":
        first = work / "policy-0"
        write_policy(params, first)
        calibration = collect(envs, rng.integers(0, 2**31, size=args.episodes), fp_choose)
        write_rollouts(work / "calibration.jsonl", [(o, a, r) for o, a, r, _ in calibration])
        # A fresh policy's greedy actions are coin flips (logits within 1e-2
        # of each other): agreement with FP says nothing about it, so the
        # guard is off (its held-out data are then only reported) and every
        # layer stays INT8.
        run_qforge(args.qforge, "quantize", "--model", str(first), "--data",
                   str(work / "calibration.jsonl"), "--eval-data", str(work / "calibration.jsonl"),
                   "-o", str(work / "artifact-0"),
                   "--min-agreement", "0", "--json")
        server = Server(args.qforge, work / "artifact-0", work / "serve.log", secrets.token_hex(16))

    try:
        if server:
            expected_version[0] = server.act(np.zeros((1, 4)), 0)[2]
        for update in range(args.updates):
            reset_seeds = rng.integers(0, 2**31, size=args.episodes)
            episodes = collect(envs, reset_seeds, fp_choose if mode == "fp" else int8_choose)
            mean_return = float(np.mean([r.sum() for _, _, r, _ in episodes]))
            record["returns"].append(mean_return)
            obs = np.concatenate([o for o, _, _, _ in episodes])
            actions = np.concatenate([a for _, a, _, _ in episodes])
            rollout_logp = np.concatenate([lp for _, _, _, lp in episodes])
            adv = advantages(episodes)
            train_logp = log_softmax(forward(params, obs)[0])[np.arange(len(actions)), actions]
            gap = np.abs(train_logp - rollout_logp)
            record["logprob_mismatch"].append(float(gap.mean()))
            weights = adv
            if mode == "int8-tis":
                ratio = np.exp(train_logp - rollout_logp)
                record["clipped_share"].append(float((ratio > args.tis_cap).mean()))
                weights = adv * np.minimum(ratio, args.tis_cap)
            grads, _ = policy_gradient(params, obs, actions, weights)
            optimizer.step(params, grads)
            if mode != "fp":
                started = time.perf_counter()
                slot = work / f"policy-{update % 2 + 1}"
                write_policy(params, slot)
                artifact = work / f"artifact-{update % 2 + 1}"
                done = run_qforge(args.qforge, "requantize", "--model", str(slot), "--like",
                                  str(work / "artifact-0"), "-o", str(artifact), "--json")
                requantized = json.loads(done.stdout)
                record["changed_share"].append(requantized["changed_share"])
                record["drift_warnings"] += len(requantized["drift"])
                expected_version[0] = server.reload(artifact)
                # The sync ends when an answer comes from the new weights.
                server.act(np.zeros((1, 4)), 0)
                record["sync_ms"].append(1e3 * (time.perf_counter() - started))
            if args.verbose:
                print(f"{mode} seed {seed} update {update}: return {mean_return:.1f}", file=sys.stderr)
    finally:
        if server:
            server.close()
    reached = next((i for i, r in enumerate(record["returns"]) if r >= args.target), None)
    record["updates_to_target"] = reached
    return record


# --------------------------------------------------------------------------
# Report.
# --------------------------------------------------------------------------

def svg_plot(results, modes, updates, target):
    width, height, left, bottom, top, right = 720, 400, 60, 40, 20, 140
    colors = {"fp": "#1f77b4", "int8": "#d62728", "int8-tis": "#2ca02c"}

    def x(u):
        return left + (width - left - right) * u / max(updates - 1, 1)

    def y(r):
        return top + (height - top - bottom) * (1 - r / 500)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             'font-family="sans-serif" font-size="12">',
             f'<rect width="{width}" height="{height}" fill="white"/>']
    for r in range(0, 501, 100):
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(r):.1f}" y2="{y(r):.1f}" '
                     'stroke="#ddd"/>')
        parts.append(f'<text x="{left - 6}" y="{y(r) + 4:.1f}" text-anchor="end">{r}</text>')
    parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(target):.1f}" '
                 f'y2="{y(target):.1f}" stroke="#888" stroke-dasharray="4 3"/>')
    step = max(1, updates // 8 // 10 * 10)
    for u in range(0, updates, step):
        parts.append(f'<text x="{x(u):.1f}" y="{height - bottom + 16}" text-anchor="middle">{u}</text>')
    parts.append(f'<text x="{(left + width - right) / 2}" y="{height - 6}" text-anchor="middle">'
                 'update step</text>')
    parts.append(f'<text x="14" y="{(top + height - bottom) / 2}" text-anchor="middle" '
                 f'transform="rotate(-90 14 {(top + height - bottom) / 2})">mean episode return</text>')
    for k, mode in enumerate(modes):
        curves = np.array([r["returns"] for r in results if r["mode"] == mode])
        if not len(curves):
            continue
        median, low, high = np.median(curves, 0), curves.min(0), curves.max(0)
        band = " ".join(f"{x(u):.1f},{y(v):.1f}" for u, v in enumerate(high))
        band += " " + " ".join(f"{x(u):.1f},{y(v):.1f}" for u, v in reversed(list(enumerate(low))))
        parts.append(f'<polygon points="{band}" fill="{colors[mode]}" fill-opacity="0.12"/>')
        line = " ".join(f"{x(u):.1f},{y(v):.1f}" for u, v in enumerate(median))
        parts.append(f'<polyline points="{line}" fill="none" stroke="{colors[mode]}" '
                     'stroke-width="2"/>')
        parts.append(f'<line x1="{width - right + 10}" x2="{width - right + 30}" y1="{top + 20 * k + 10}" '
                     f'y2="{top + 20 * k + 10}" stroke="{colors[mode]}" stroke-width="2"/>')
        parts.append(f'<text x="{width - right + 36}" y="{top + 20 * k + 14}">{mode}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def summary(results, modes, args):
    lines = ["| rollouts | updates to return ≥ %d (median; per seed) | final return (median) | "
             "mean \\|log π_train − log π_rollout\\| | weight sync ms (median; p95) | "
             "int8 weights changed per sync | TIS-clipped share |" % args.target,
             "|---|---|---|---|---|---|---|"]
    for mode in modes:
        runs = [r for r in results if r["mode"] == mode]
        if not runs:
            continue
        reached = [r["updates_to_target"] for r in runs]
        done = [u for u in reached if u is not None]
        median_reached = (f"{np.median(done):.0f}" if len(done) == len(runs)
                          else f"{len(done)}/{len(runs)} reached")
        per_seed = ", ".join("—" if u is None else str(u) for u in reached)
        final = np.median([np.mean(r["returns"][-5:]) for r in runs])
        gap = np.mean([np.mean(r["logprob_mismatch"]) for r in runs])
        sync = np.concatenate([r["sync_ms"] for r in runs]) if mode != "fp" else None
        sync_text = "—" if sync is None else f"{np.median(sync):.1f}; {np.percentile(sync, 95):.1f}"
        changed = ("—" if mode == "fp" else
                   f"{100 * np.mean([np.mean(r['changed_share']) for r in runs]):.1f} %")
        clipped = ("—" if mode != "int8-tis" else
                   f"{100 * np.mean([np.mean(r['clipped_share']) for r in runs]):.3f} %")
        lines.append(f"| {mode} | {median_reached} ({per_seed}) | {final:.1f} | {gap:.2e} | "
                     f"{sync_text} | {changed} | {clipped} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--qforge", default=str(ROOT / "target/release/qforge"))
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated subset of " + ", ".join(MODES))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--updates", type=int, default=120)
    parser.add_argument("--episodes", type=int, default=16, help="episodes per update")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--tis-cap", type=float, default=2.0)
    parser.add_argument("--target", type=float, default=475.0)
    parser.add_argument("--out", type=Path, default=Path("rl-loop"))
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode {unknown[0]!r}: choose from {', '.join(MODES)}")
    if any(m != "fp" for m in modes) and not Path(args.qforge).is_file():
        parser.error(f"{args.qforge} does not exist: build it with `cargo build --release` "
                     "or pass --qforge")
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for mode in modes:
        for seed in range(args.seeds):
            work = args.out / f"{mode}-seed{seed}"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            started = time.perf_counter()
            record = train(mode, seed, args, work)
            record["seconds"] = time.perf_counter() - started
            results.append(record)
            print(f"{mode} seed {seed}: updates to {args.target:g}: {record['updates_to_target']}, "
                  f"final return {np.mean(record['returns'][-5:]):.1f}, "
                  f"{record['seconds']:.0f} s", file=sys.stderr)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    (args.out / "returns.svg").write_text(svg_plot(results, modes, args.updates, args.target))
    print(summary(results, modes, args))


if __name__ == "__main__":
    main()
