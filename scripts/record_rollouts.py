#!/usr/bin/env python3
"""Record calibration rollouts and evaluation returns for a qforge MLP policy.

Reads only the policy directory (policy.json + model.safetensors), runs the
deterministic FP32 policy in gymnasium and writes, into the same directory:

  rollouts.jsonl  one episode per line:
                  {"observations": [[...], ...], "actions": [...], "rewards": [...]}
                  episodes use env.reset(seed=s) for s = seed_start, seed_start+1, ...
                  and stop once --max-observations observations were recorded
                  (the last episode is cut short to hit the cap exactly).
  returns.json    mean/std (population std) return of the deterministic policy and
                  of uniform random actions over --eval-episodes episodes seeded
                  --eval-seed-start.. (default 1000..1019).

Forward pass (exactly the qforge-mlp-policy format):
  x = observation (float32)
  for every layer but the last: x = act(W @ x + b)   (act = tanh or relu)
  last layer: logits/mean = W @ x + b                (linear)
  discrete head: action = argmax(logits), ties -> lowest index
  gaussian head: action = clip(mean, low, high)

Usage:
  python scripts/record_rollouts.py --policy fixtures/policies/cartpole
"""

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
           "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import json  # noqa: E402

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402


class MlpPolicy:
    def __init__(self, policy_dir):
        with open(os.path.join(policy_dir, "policy.json")) as f:
            self.meta = json.load(f)
        m = self.meta
        if m.get("format") != "qforge-mlp-policy" or m.get("version") != 1:
            raise ValueError(f"unsupported policy format: {m.get('format')} v{m.get('version')}")
        if m["activation"] not in ("tanh", "relu"):
            raise ValueError(f"unsupported activation {m['activation']}")
        head = m["head"]
        if head["kind"] == "discrete":
            out = int(head["actions"])
        elif head["kind"] == "gaussian":
            out = int(head["action_dim"])
            self.low = np.asarray(head["low"], dtype=np.float32)
            self.high = np.asarray(head["high"], dtype=np.float32)
            if self.low.shape != (out,) or self.high.shape != (out,):
                raise ValueError("gaussian head low/high must have action_dim entries")
        else:
            raise ValueError(f"unsupported head kind {head['kind']}")
        self.head = head
        tensors = load_file(os.path.join(policy_dir, "model.safetensors"))
        dims = [int(m["observation_dim"])] + [int(h) for h in m["hidden"]] + [out]
        self.layers = []
        expected = set()
        for i in range(len(dims) - 1):
            W = tensors[f"layers.{i}.weight"]
            b = tensors[f"layers.{i}.bias"]
            expected |= {f"layers.{i}.weight", f"layers.{i}.bias"}
            if W.dtype != np.float32 or b.dtype != np.float32:
                raise ValueError(f"layer {i}: expected float32 tensors")
            if W.shape != (dims[i + 1], dims[i]) or b.shape != (dims[i + 1],):
                raise ValueError(f"layer {i}: shapes {W.shape}, {b.shape} do not match "
                                 f"[{dims[i + 1]}, {dims[i]}], [{dims[i + 1]}]")
            self.layers.append((W, b))
        if "log_std" in head and (head["kind"] != "gaussian" or len(head["log_std"]) != out):
            raise ValueError("the head's log_std does not match it")
        extra = set(tensors) - expected
        if extra:
            raise ValueError(f"unexpected tensors in model.safetensors: {sorted(extra)}")
        self.dims = dims

    def forward(self, obs):
        x = np.asarray(obs, dtype=np.float32)
        n = len(self.layers)
        for i, (W, b) in enumerate(self.layers):
            x = W @ x + b
            if i < n - 1:
                x = np.tanh(x) if self.meta["activation"] == "tanh" else np.maximum(x, np.float32(0))
        return x.astype(np.float32)

    def act(self, obs):
        out = self.forward(obs)
        if self.head["kind"] == "discrete":
            return int(np.argmax(out))  # first maximum = lowest index
        return np.clip(out, self.low, self.high).astype(np.float32)


def f32(x):
    """Shortest decimal string that round-trips the float32 value of x (valid JSON)."""
    v = np.float32(x)
    if not np.isfinite(v):
        raise ValueError(f"non-finite value {x}")
    return str(v)  # numpy prints the shortest float32 round-trip repr


def run_episode(env, policy, seed, max_steps=None):
    obs, _ = env.reset(seed=seed)
    observations, actions, rewards = [], [], []
    total, done = 0.0, False
    while not done:
        if max_steps is not None and len(observations) >= max_steps:
            break
        a = policy.act(obs)
        observations.append(np.asarray(obs, dtype=np.float32))
        actions.append(a)
        obs, r, term, trunc, _ = env.step(a)
        rewards.append(float(r))
        total += float(r)
        done = term or trunc
    return observations, actions, rewards, total


def episode_json(observations, actions, rewards, discrete):
    obs_s = ",".join("[" + ",".join(f32(v) for v in o) + "]" for o in observations)
    if discrete:
        act_s = ",".join(str(int(a)) for a in actions)
    else:
        act_s = ",".join("[" + ",".join(f32(v) for v in a) + "]" for a in actions)
    rew_s = ",".join(f32(r) for r in rewards)
    return f'{{"observations":[{obs_s}],"actions":[{act_s}],"rewards":[{rew_s}]}}'


def random_return(env, seed):
    env.reset(seed=seed)
    env.action_space.seed(seed)
    total, done = 0.0, False
    while not done:
        _, r, term, trunc, _ = env.step(env.action_space.sample())
        total += float(r)
        done = term or trunc
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", required=True, help="policy directory")
    ap.add_argument("--episodes", type=int, default=20, help="max rollout episodes")
    ap.add_argument("--seed-start", type=int, default=0, help="seed of the first rollout episode")
    ap.add_argument("--max-observations", type=int, default=4000,
                    help="cap on the total number of recorded observations")
    ap.add_argument("--eval-episodes", type=int, default=20)
    ap.add_argument("--eval-seed-start", type=int, default=1000)
    ap.add_argument("--out", default=None, help="output directory (default: --policy)")
    args = ap.parse_args()

    policy = MlpPolicy(args.policy)
    out_dir = args.out or args.policy
    os.makedirs(out_dir, exist_ok=True)
    env_id = policy.meta["env"]
    env = gym.make(env_id)
    discrete = policy.head["kind"] == "discrete"
    print(f"{env_id}: layers {policy.dims}, {policy.meta['activation']}, head {policy.head}")

    # calibration rollouts
    lines, n_obs, seeds_used = [], 0, []
    for k in range(args.episodes):
        if n_obs >= args.max_observations:
            break
        seed = args.seed_start + k
        o, a, r, ret = run_episode(env, policy, seed, max_steps=args.max_observations - n_obs)
        lines.append(episode_json(o, a, r, discrete))
        seeds_used.append(seed)
        n_obs += len(o)
        print(f"  rollout seed {seed}: {len(o)} steps, return {ret:.3f}")
    path = os.path.join(out_dir, "rollouts.jsonl")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path}: {len(lines)} episodes (seeds {seeds_used[0]}..{seeds_used[-1]}), "
          f"{n_obs} observations, {os.path.getsize(path)} bytes")

    # evaluation returns
    seeds = list(range(args.eval_seed_start, args.eval_seed_start + args.eval_episodes))
    fp = np.array([run_episode(env, policy, s)[3] for s in seeds])
    rnd = np.array([random_return(env, s) for s in seeds])
    returns = {
        "env": env_id,
        "episodes": len(seeds),
        "seeds": seeds,
        "fp_return": float(fp.mean()),
        "fp_return_std": float(fp.std()),
        "random_return": float(rnd.mean()),
        "random_return_std": float(rnd.std()),
    }
    path = os.path.join(out_dir, "returns.json")
    with open(path, "w") as f:
        json.dump(returns, f, indent=2)
        f.write("\n")
    print(f"wrote {path}: fp {fp.mean():.3f} ± {fp.std():.3f} (min {fp.min():.3f}), "
          f"random {rnd.mean():.3f} ± {rnd.std():.3f}")


if __name__ == "__main__":
    main()
