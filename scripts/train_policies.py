#!/usr/bin/env python3
"""Train the small MLP policy fixtures used by qforge's tests and benchmarks.

numpy + gymnasium only (no torch). Training uses the cross-entropy method
(CEM, diagonal Gaussian over the flattened MLP parameters). To keep CPU cost
low, candidate policies are scored on a *batched numpy re-implementation* of
the CartPole-v1 / Pendulum-v1 dynamics (copied from gymnasium 1.x; checked
against gymnasium by --check-sim). The final policy is always evaluated in the
real gymnasium environment (see record_rollouts.py).

Output, per environment, in OUT/<name>/:
  policy.json         format description (see fixtures/policies/README.md)
  model.safetensors   float32 tensors layers.{i}.weight [out, in], layers.{i}.bias [out]

Deterministic for a given --seed: a single numpy Generator drives everything
and BLAS is restricted to one thread.

Usage:
  python scripts/train_policies.py --env all --seed 0 --out fixtures/policies
"""

import os

# Single-threaded, deterministic BLAS. Must happen before numpy is imported.
for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
           "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402


# --------------------------------------------------------------------------
# Batched environments (training only). State arrays have shape [..., n].
# --------------------------------------------------------------------------

class BatchedCartPole:
    """CartPole-v1 dynamics (gymnasium 1.x, euler integrator), 500-step limit."""

    obs_dim = 4
    max_steps = 500
    gravity, masscart, masspole, length, force_mag, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    total_mass = masscart + masspole
    polemass_length = masspole * length
    theta_threshold = 12 * 2 * math.pi / 360
    x_threshold = 2.4

    def initial_states(self, rng, n):
        return rng.uniform(-0.05, 0.05, size=(n, 4))

    def observe(self, s):
        return s.astype(np.float32)

    def step(self, s, action):
        """action: int array (0/1). Returns (new_state, reward, terminated)."""
        x, x_dot, th, th_dot = s[..., 0], s[..., 1], s[..., 2], s[..., 3]
        force = np.where(action == 1, self.force_mag, -self.force_mag)
        c, si = np.cos(th), np.sin(th)
        temp = (force + self.polemass_length * th_dot ** 2 * si) / self.total_mass
        thacc = (self.gravity * si - c * temp) / (
            self.length * (4.0 / 3.0 - self.masspole * c ** 2 / self.total_mass))
        xacc = temp - self.polemass_length * thacc * c / self.total_mass
        x = x + self.tau * x_dot
        x_dot = x_dot + self.tau * xacc
        th = th + self.tau * th_dot
        th_dot = th_dot + self.tau * thacc
        ns = np.stack([x, x_dot, th, th_dot], axis=-1)
        term = ((x < -self.x_threshold) | (x > self.x_threshold)
                | (th < -self.theta_threshold) | (th > self.theta_threshold))
        return ns, np.ones_like(x), term


class BatchedPendulum:
    """Pendulum-v1 dynamics (gymnasium 1.x, g=10), 200-step limit, never terminates."""

    obs_dim = 3
    max_steps = 200
    g, m, l, dt, max_speed, max_torque = 10.0, 1.0, 1.0, 0.05, 8.0, 2.0

    def initial_states(self, rng, n):
        return rng.uniform([-np.pi, -1.0], [np.pi, 1.0], size=(n, 2))

    def observe(self, s):
        th, thdot = s[..., 0], s[..., 1]
        return np.stack([np.cos(th), np.sin(th), thdot], axis=-1).astype(np.float32)

    def step(self, s, u):
        """u: float array [..., 1] (already clipped by the policy)."""
        th, thdot = s[..., 0], s[..., 1]
        u = np.clip(u[..., 0], -self.max_torque, self.max_torque)
        thn = ((th + np.pi) % (2 * np.pi)) - np.pi
        cost = thn ** 2 + 0.1 * thdot ** 2 + 0.001 * u ** 2
        newthdot = thdot + (3 * self.g / (2 * self.l) * np.sin(th)
                            + 3.0 / (self.m * self.l ** 2) * u) * self.dt
        newthdot = np.clip(newthdot, -self.max_speed, self.max_speed)
        newth = th + newthdot * self.dt
        return np.stack([newth, newthdot], axis=-1), -cost, np.zeros_like(th, dtype=bool)


# --------------------------------------------------------------------------
# MLP parameter handling
# --------------------------------------------------------------------------

def layer_shapes(obs_dim, hidden, out_dim):
    dims = [obs_dim] + list(hidden) + [out_dim]
    return [(dims[i + 1], dims[i]) for i in range(len(dims) - 1)]


def n_params(shapes):
    return sum(o * i + o for o, i in shapes)


def unflatten(theta, shapes):
    """theta: [P, n] -> list of (W [P, out, in], b [P, out])."""
    layers, k = [], 0
    for o, i in shapes:
        W = theta[:, k:k + o * i].reshape(-1, o, i)
        k += o * i
        b = theta[:, k:k + o]
        k += o
        layers.append((W, b))
    return layers


def act_fn(name):
    return np.tanh if name == "tanh" else (lambda z: np.maximum(z, 0.0))


def batched_forward(layers, obs, activation):
    """obs: [P, E, in] -> [P, E, out]. Same forward as the policy format."""
    f = act_fn(activation)
    x = obs
    for li, (W, b) in enumerate(layers):
        x = np.einsum("pei,poi->peo", x, W) + b[:, None, :]
        if li < len(layers) - 1:
            x = f(x)
    return x


def init_params(rng, shapes, activation):
    """Scaled init for the CEM mean (fan-in scaling, small last layer)."""
    parts = []
    for li, (o, i) in enumerate(shapes):
        scale = (1.0 if activation == "tanh" else math.sqrt(2.0)) / math.sqrt(i)
        if li == len(shapes) - 1:
            scale *= 0.1
        parts.append(rng.normal(0.0, scale, size=o * i))
        parts.append(np.zeros(o))
    return np.concatenate(parts)


# --------------------------------------------------------------------------
# Evaluation of a population on shared initial states
# --------------------------------------------------------------------------

def evaluate(env, spec, theta, starts):
    """theta [P, n], starts [E, state] -> mean return per candidate [P]."""
    P, E = theta.shape[0], starts.shape[0]
    layers = unflatten(theta.astype(np.float32), spec["shapes"])
    s = np.broadcast_to(starts, (P,) + starts.shape).copy()
    ret = np.zeros((P, E))
    alive = np.ones((P, E), dtype=bool)
    for _ in range(env.max_steps):
        out = batched_forward(layers, env.observe(s), spec["activation"])
        if spec["head"]["kind"] == "discrete":
            a = np.argmax(out, axis=-1)  # ties -> lowest index
        else:
            a = np.clip(out, spec["head"]["low"], spec["head"]["high"])
        s, r, term = env.step(s, a)
        ret += np.where(alive, r, 0.0)
        alive &= ~term
        if not alive.any():
            break
    return ret.mean(axis=1)


# --------------------------------------------------------------------------
# CEM
# --------------------------------------------------------------------------

def cem(env, spec, rng, iters, pop, elite_frac, episodes, sigma0, extra_noise,
        val_episodes, val_every, target=None, noise_floor=0.0):
    shapes = spec["shapes"]
    n = n_params(shapes)
    mu = init_params(rng, shapes, spec["activation"])
    sigma = np.full(n, sigma0)
    n_elite = max(2, int(round(pop * elite_frac)))
    val_starts = env.initial_states(rng, val_episodes)
    best = (-np.inf, mu.copy(), 0)
    t0 = time.time()
    for it in range(1, iters + 1):
        starts = env.initial_states(rng, episodes)
        # antithetic sampling around the mean; candidate 0 is the mean itself
        half = (pop - 1) // 2
        eps = rng.standard_normal((half, n))
        eps = np.concatenate([eps, -eps], axis=0)
        cand = np.concatenate([mu[None], mu + sigma * eps], axis=0)
        scores = evaluate(env, spec, cand, starts)
        order = np.argsort(-scores, kind="stable")[:n_elite]
        elite = cand[order]
        mu = elite.mean(axis=0)
        # extra exploration noise (keeps sigma from collapsing), decays linearly
        # to noise_floor * extra_noise at the last iteration
        noise = extra_noise * max(noise_floor, 1.0 - it / iters)
        sigma = np.sqrt(elite.var(axis=0) + noise ** 2)
        if it % val_every == 0 or it == iters:
            v = evaluate(env, spec, mu[None], val_starts)[0]
            if v > best[0]:
                best = (v, mu.copy(), it)
            print(f"[{spec['name']}] iter {it:4d}  pop mean {scores.mean():9.2f}  "
                  f"elite mean {scores[order].mean():9.2f}  val(mu) {v:9.2f}  "
                  f"best {best[0]:9.2f}@{best[2]}  sigma {sigma.mean():.4f}  "
                  f"{time.time() - t0:6.1f}s", flush=True)
            if target is not None and v >= target:
                print(f"[{spec['name']}] reached target {target} on validation", flush=True)
                break
    return best


# --------------------------------------------------------------------------
# Fixture configs
# --------------------------------------------------------------------------

CONFIGS = {
    "cartpole": dict(
        env_id="CartPole-v1", env_cls=BatchedCartPole, hidden=[32, 32],
        activation="tanh", head={"kind": "discrete", "actions": 2},
        cem=dict(iters=60, pop=64, elite_frac=0.125, episodes=8, sigma0=0.5,
                 extra_noise=0.05, val_episodes=64, val_every=5, target=500.0),
    ),
    "pendulum": dict(
        env_id="Pendulum-v1", env_cls=BatchedPendulum, hidden=[32, 32],
        activation="tanh",
        head={"kind": "gaussian", "action_dim": 1, "low": [-2.0], "high": [2.0]},
        cem=dict(iters=700, pop=101, elite_frac=0.1, episodes=24, sigma0=0.3,
                 extra_noise=0.02, noise_floor=0.1, val_episodes=200, val_every=10,
                 target=None),
    ),
}


def out_dim(head):
    return head["actions"] if head["kind"] == "discrete" else head["action_dim"]


def save_policy(dirpath, cfg, theta):
    os.makedirs(dirpath, exist_ok=True)
    env = cfg["env_cls"]
    shapes = layer_shapes(env.obs_dim, cfg["hidden"], out_dim(cfg["head"]))
    layers = unflatten(theta[None].astype(np.float32), shapes)
    tensors = {}
    for i, (W, b) in enumerate(layers):
        tensors[f"layers.{i}.weight"] = np.ascontiguousarray(W[0], dtype=np.float32)
        tensors[f"layers.{i}.bias"] = np.ascontiguousarray(b[0], dtype=np.float32)
    save_file(tensors, os.path.join(dirpath, "model.safetensors"))
    meta = {
        "format": "qforge-mlp-policy",
        "version": 1,
        "env": cfg["env_id"],
        "observation_dim": env.obs_dim,
        "hidden": list(cfg["hidden"]),
        "activation": cfg["activation"],
        "head": cfg["head"],
    }
    with open(os.path.join(dirpath, "policy.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")


def check_sim(name, cfg, theta, n=5):
    """Compare the batched sim with gymnasium for the given policy (sanity)."""
    import gymnasium as gym
    env_cls = cfg["env_cls"]()
    spec = make_spec(name, cfg)
    layers = unflatten(theta[None].astype(np.float32), spec["shapes"])
    genv = gym.make(cfg["env_id"])
    for seed in range(n):
        obs, _ = genv.reset(seed=seed)
        start = np.array(genv.unwrapped.state, dtype=np.float64)[None]
        sim = evaluate(env_cls, spec, theta[None], start)[0]
        total, done = 0.0, False
        while not done:
            out = batched_forward(layers, obs[None, None].astype(np.float32), spec["activation"])[0, 0]
            if spec["head"]["kind"] == "discrete":
                a = int(np.argmax(out))
            else:
                a = np.clip(out, spec["head"]["low"], spec["head"]["high"]).astype(np.float32)
            obs, r, term, trunc, _ = genv.step(a)
            total += float(r)
            done = term or trunc
        print(f"[{name}] check-sim seed {seed}: batched {sim:.4f}  gymnasium {total:.4f}")


def make_spec(name, cfg):
    env = cfg["env_cls"]
    return dict(name=name, activation=cfg["activation"], head=cfg["head"],
                shapes=layer_shapes(env.obs_dim, cfg["hidden"], out_dim(cfg["head"])))


def train(name, seed, out_root, iters=None, do_check=False):
    cfg = CONFIGS[name]
    rng = np.random.default_rng(seed)
    env = cfg["env_cls"]()
    spec = make_spec(name, cfg)
    params = dict(cfg["cem"])
    if iters is not None:
        params["iters"] = iters
    print(f"[{name}] {cfg['env_id']} hidden={cfg['hidden']} {cfg['activation']} "
          f"params={n_params(spec['shapes'])} seed={seed} cem={params}", flush=True)
    t0 = time.time()
    val, theta, it = cem(env, spec, rng, **params)
    dt = time.time() - t0
    print(f"[{name}] done in {dt:.1f}s: best validation return {val:.2f} at iter {it}", flush=True)
    if do_check:
        check_sim(name, cfg, theta)
    dirpath = os.path.join(out_root, name)
    save_policy(dirpath, cfg, theta)
    print(f"[{name}] wrote {dirpath}/policy.json, model.safetensors", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", choices=["cartpole", "pendulum", "all"], default="all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "fixtures", "policies"))
    ap.add_argument("--iters", type=int, default=None, help="override CEM iteration count")
    ap.add_argument("--check-sim", action="store_true",
                    help="compare the batched training sim with gymnasium for the trained policy")
    args = ap.parse_args()
    names = ["cartpole", "pendulum"] if args.env == "all" else [args.env]
    for name in names:
        train(name, args.seed, args.out, iters=args.iters, do_check=args.check_sim)


if __name__ == "__main__":
    main()
