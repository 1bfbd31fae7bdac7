#!/usr/bin/env python3
"""GRPO on SmolLM2-135M-Instruct with qforge's in-process rollouts: f32 against INT8.

The task is qforge's arithmetic task ("What is A op B? Reply with only the number.",
A and B in 1..20, op one of + - *; reward 1 when the completion's last whole integer is
the result): its 1 200 problems are shuffled once, 300 held out for evaluation and the
rest drawn for training. Each update draws B prompts, samples G completions of each
(temperature 1) with `LanguageModel.generate_batch`, normalises the rewards within each
group (GRPO's advantages), and takes one AdamW step on the full-precision policy
(PyTorch + transformers, full fine-tuning) with a token-level policy-gradient loss; the
new weights go back to the rollout engine with `LanguageModel.load_weights` (no file).

Arms, on the same seeds (prompts, sampler seeds, initial weights):
  f32        rollouts on qforge's f32 engine: the behaviour and trainer log-probs agree
             to float rounding, so no correction is needed.
  int8       rollouts on qforge's INT8 engine, the loss uncorrected.
  int8-tis   the same rollouts, each token's term weighted by min(pi_train / pi_behaviour,
             C), C = 2: token-level truncated importance sampling (FlashRL).
`--rollout-precision` picks the INT8 recipe: `int8-dynamic` (per-token dynamic INT8 on
the residual stream rotated with fixed random signs, no calibration), `int8-dynamic-plain`
(the same without the rotation) or the path of a `qforge quantize` artifact (its recipe).

Every `--eval-every` updates (and before the first and after the last) the trained
weights are loaded into a separate f32 engine and scored greedily on the 300 held-out
problems: the same evaluator for every arm. Per update the script records the rollout
reward, mean |delta log pi| and KL per token between the rollout's behaviour log-probs and
the trainer's, the share of tokens TIS clips, the rollout / train / sync seconds,
rollout tokens per second, and the share of INT8 codes the sync changed; one JSON line
per update in `--out`. `--plot A.jsonl B.jsonl …` draws reward against update and
against wall time as one SVG and prints the table BENCHMARKS.md holds.

The trainer's weights are the GGUF's dequantized values (qforge's own f32 reference),
in Hugging Face layout (llama.cpp's q/k row permutation undone), read with the `gguf`
package. Its environment is its own (torch is ~6 GB; not in CI):
  python3 -m venv .venv-rl && .venv-rl/bin/pip install -r scripts/requirements-rl.txt
  PYO3_BUILD_EXTENSION_MODULE=1 cargo build --release -p qforge-python
  .venv-rl/bin/python scripts/grpo.py --arm int8-tis --out target/grpo/int8-tis.jsonl
"""

import argparse
import json
import math
import random
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GGUF = ROOT / "models/smollm2-135m-instruct-q4_1.gguf"
ARMS = ("f32", "int8", "int8-tis")
HELD_OUT = 300


def problems():
    """Every problem of the task as (question, result), in one seeded order."""
    out = [(a, op, b) for a in range(1, 21) for op in "+-*" for b in range(1, 21)]
    random.Random(0).shuffle(out)
    result = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    return [(f"What is {a} {op} {b}? Reply with only the number.", result[op](a, b))
            for a, op, b in out]


def chat(question):
    """One user turn and the assistant's cue, in SmolLM2's chat format."""
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def reward(text, finish, result):
    """1 when the last whole integer of `text` is `result` (a number cut off by the
    token limit does not count: its last digits may be missing), else 0."""
    if finish == "length" and text and text[-1].isdigit():
        return 0.0
    numbers = re.findall(r"(?<![0-9A-Za-z])-?\d+|\d+", text)
    return float(bool(numbers) and int(numbers[-1]) == result)


def hf_weights(path):
    """The GGUF's tensors dequantized to float32 numpy arrays, by Hugging Face name,
    q/k rows back in Hugging Face order; and the model's hyper-parameters."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(path))

    def field(key):
        return reader.fields[key].parts[-1][0].item()

    config = dict(
        hidden_size=field("llama.embedding_length"),
        intermediate_size=field("llama.feed_forward_length"),
        num_hidden_layers=field("llama.block_count"),
        num_attention_heads=field("llama.attention.head_count"),
        num_key_value_heads=field("llama.attention.head_count_kv"),
        rms_norm_eps=field("llama.attention.layer_norm_rms_epsilon"),
        rope_theta=field("llama.rope.freq_base"),
        max_position_embeddings=field("llama.context_length"),
    )
    top = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
    block = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    weights = {}
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        values = values.reshape([int(d) for d in reversed(tensor.shape.tolist())])
        if tensor.name in top:
            name = top[tensor.name]
        else:
            _, layer, module, kind = tensor.name.split(".")
            name = f"model.layers.{layer}.{block[module]}.{kind}"
        heads = {"q_proj": config["num_attention_heads"],
                 "k_proj": config["num_key_value_heads"]}.get(name.split(".")[-2])
        if heads and name.endswith(".weight"):
            # llama.cpp stores row 2j + s of each head where Hugging Face has s·half + j.
            rows = values.shape[0]
            head_dim = rows // heads
            half = head_dim // 2
            order = [h * head_dim + 2 * (w % half) + w // half
                     for h in range(heads) for w in range(head_dim)]
            values = values[order]
        weights[name] = np.ascontiguousarray(values)
    config["vocab_size"] = weights["model.embed_tokens.weight"].shape[0]
    config["tie_word_embeddings"] = "lm_head.weight" not in weights
    return weights, config


def trainer_model(weights, config):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**config, attention_bias=False, mlp_bias=False))
    state = {name: torch.from_numpy(values.copy()) for name, values in weights.items()}
    if config["tie_word_embeddings"]:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model


def numpy_weights(model):
    """The trainer's weights as float32 numpy arrays (views, no copy)."""
    return {name: tensor.detach().numpy() for name, tensor in model.state_dict().items()}


def token_log_probs(model, prompts, completions, grad):
    """log pi(token) of every completion token after its prompt (one padded forward);
    a list of 1-d tensors."""
    import torch

    rows = [p + c for p, c in zip(prompts, completions)]
    width = max(map(len, rows))
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
    with torch.set_grad_enabled(grad):
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        # lm_head only where a completion token is predicted: the prompt positions'
        # 49 152-wide logits were most of the step's time and memory.
        rows = torch.cat([torch.full((len(c),), i) for i, c in enumerate(completions)])
        cols = torch.cat([torch.arange(len(p) - 1, len(p) + len(c) - 1)
                          for p, c in zip(prompts, completions)])
        logits = model.lm_head(hidden[rows, cols]).float()
        targets = torch.tensor([t for c in completions for t in c])
        picked = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]
    return list(picked.split([len(c) for c in completions]))


def evaluate(evaluator, model, eval_set, max_tokens):
    """Greedy reward of the trainer's weights on the held-out problems (qforge's f32
    engine with those weights)."""
    evaluator.load_weights(numpy_weights(model))
    outputs = evaluator.generate_batch([chat(q) for q, _ in eval_set], n=1,
                                       max_tokens=max_tokens, temperature=0.0)
    rewards = [reward(o.outputs[0].text, o.outputs[0].finish_reason, r)
               for o, (_, r) in zip(outputs, eval_set)]
    mean = sum(rewards) / len(rewards)
    return mean, math.sqrt(mean * (1 - mean) / len(rewards))


def train(args):
    import numpy as np
    import torch

    import qforge

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    weights, config = hf_weights(GGUF)
    model = trainer_model(weights, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    precision = "f32" if args.arm == "f32" else args.rollout_precision
    policy = open_policy(precision, max(256, args.prompts * args.group))
    evaluator = qforge.open(GGUF, precision="f32", max_sequences=HELD_OUT)
    everything = problems()
    eval_set, train_set = everything[:HELD_OUT], everything[HELD_OUT:]
    draw = random.Random(args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    records = []

    def record(entry):
        entry["wall_s"] = time.time() - started
        records.append(entry)
        print(json.dumps(entry), flush=True)

    score, stderr = evaluate(evaluator, model, eval_set, args.max_tokens)
    record({"update": 0, "eval_reward": score, "eval_stderr": stderr})
    for update in range(1, args.updates + 1):
        batch = draw.sample(train_set, args.prompts)
        t = time.time()
        outputs = policy.generate_batch([chat(q) for q, _ in batch], n=args.group,
                                        max_tokens=args.max_tokens, temperature=1.0,
                                        seed=update * args.prompts * args.group)
        rollout_s = time.time() - t
        prompts, completions, behaviour, advantages, rewards = [], [], [], [], []
        for request, (_, result) in zip(outputs, batch):
            group = [reward(o.text, o.finish_reason, result) for o in request.outputs]
            mean, std = np.mean(group), np.std(group)
            for sample, r in zip(request.outputs, group):
                prompts.append(request.prompt_token_ids)
                completions.append(sample.token_ids)
                behaviour.append(torch.from_numpy(sample.logprobs).float())
                advantages.append(0.0 if std == 0 else (r - mean) / (std + 1e-6))
                rewards.append(r)
        generated = sum(map(len, completions))
        t = time.time()
        optimizer.zero_grad()
        trained = token_log_probs(model, prompts, completions, grad=True)
        tokens = torch.cat(trained)
        old = torch.cat(behaviour)
        delta = tokens.detach() - old  # log pi_train - log pi_behaviour
        ratio = delta.exp()
        weight = ratio.clamp(max=args.tis_clip) if args.arm == "int8-tis" else torch.ones_like(ratio)
        per_token = torch.cat([torch.full((len(c),), a) for c, a in zip(completions, advantages)])
        loss = -(weight * per_token * tokens).sum() / len(tokens)
        loss.backward()
        optimizer.step()
        train_s = time.time() - t
        t = time.time()
        synced = policy.load_weights(numpy_weights(model))
        sync_s = time.time() - t
        entry = {
            "update": update,
            "rollout_reward": float(np.mean(rewards)),
            "mean_abs_delta_log_pi": float(delta.abs().mean()),
            # KL(behaviour || trainer) per token: the k3 estimator on behaviour samples.
            "kl_per_token": float((ratio - 1 - delta).mean()),
            "tis_clip_share": float((ratio > args.tis_clip).float().mean()),
            "rollout_s": rollout_s, "train_s": train_s, "sync_s": sync_s,
            "rollout_tokens_per_s": generated / rollout_s,
            "generated_tokens": generated,
            "codes_changed_share": synced["changed_share"],
            "engine_sync_s": synced["seconds"],
            "groups_with_signal": sum(1 for a in advantages[::args.group] if a),
        }
        if update % args.eval_every == 0 or update == args.updates:
            entry["eval_reward"], entry["eval_stderr"] = evaluate(evaluator, model, eval_set,
                                                                  args.max_tokens)
        record(entry)
    meta = {"arm": args.arm, "rollout_precision": precision, "prompts": args.prompts,
            "group": args.group, "max_tokens": args.max_tokens, "lr": args.lr,
            "tis_clip": args.tis_clip, "seed": args.seed, "threads": args.threads}
    with open(args.out, "w") as f:
        f.write(json.dumps({"meta": meta}) + "\n")
        for entry in records:
            f.write(json.dumps(entry) + "\n")


def open_policy(precision, max_sequences):
    """The rollout engine: qforge's f32 or INT8 engine on the GGUF, or an artifact."""
    import qforge

    if Path(precision).exists():
        return qforge.open(precision, max_sequences=max_sequences)
    return qforge.open(GGUF, precision=precision, max_sequences=max_sequences)


def mismatch(args):
    """Per rollout precision, how far the behaviour log-probs of the untrained policy's
    samples lie from the full-precision trainer's: one rollout batch of every
    precision on the same prompts and seeds, scored by the trainer (no update)."""
    import torch

    torch.set_num_threads(args.threads)
    weights, config = hf_weights(GGUF)
    model = trainer_model(weights, config)
    batch = random.Random(args.seed).sample(problems()[HELD_OUT:], args.prompts)
    print("| rollout precision | tokens | mean abs Δlog π | max abs Δlog π | KL/token (k3) | "
          f"tokens TIS clips (C = {args.tis_clip:g}) |")
    print("|---|---|---|---|---|---|")
    for precision in args.mismatch:
        policy = open_policy(precision, args.prompts * args.group)
        outputs = policy.generate_batch([chat(q) for q, _ in batch], n=args.group,
                                        max_tokens=args.max_tokens, temperature=1.0,
                                        seed=args.seed)
        prompts = [r.prompt_token_ids for r in outputs for _ in r.outputs]
        completions = [o.token_ids for r in outputs for o in r.outputs]
        behaviour = torch.cat([torch.from_numpy(o.logprobs).float()
                               for r in outputs for o in r.outputs])
        trained = torch.cat(token_log_probs(model, prompts, completions, grad=False))
        delta = trained - behaviour
        ratio = delta.exp()
        print(f"| {precision} | {len(delta)} | {delta.abs().mean():.2e} | {delta.abs().max():.2e} | "
              f"{(ratio - 1 - delta).mean():.2e} | {100 * (ratio > args.tis_clip).float().mean():.2f} % |",
              flush=True)
        del policy


COLOURS = {"f32": "#1f77b4", "int8": "#d62728", "int8-tis": "#2ca02c"}


def plot(paths, svg):
    """Eval reward against update and against wall time, one line per arm, as SVG;
    prints the per-arm summary table in Markdown."""
    runs = []
    for path in paths:
        lines = [json.loads(line) for line in Path(path).read_text().splitlines()]
        runs.append((lines[0]["meta"], lines[1:]))
    width, height, pad = 420, 260, 48
    panels = [("update", "update"), ("wall_s", "wall time (s)")]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * width}" height="{height}" '
             'font-family="sans-serif" font-size="11">']
    for k, (key, label) in enumerate(panels):
        x0 = k * width
        xs = [e[key] for _, entries in runs for e in entries if "eval_reward" in e]
        ys = [e["eval_reward"] for _, entries in runs for e in entries if "eval_reward" in e]
        xmax, ymin, ymax = max(xs) or 1, min(ys) - 0.02, max(ys) + 0.02

        top, side = pad - 20, height - 2 * pad  # the frame: its top edge, its height

        def at(x, y):
            return (x0 + pad + (width - 2 * pad) * x / xmax,
                    top + side - side * (y - ymin) / (ymax - ymin))
        parts.append(f'<rect x="{x0 + pad}" y="{top}" width="{width - 2 * pad}" '
                     f'height="{side}" fill="none" stroke="#999"/>')
        parts.append(f'<text x="{x0 + width / 2}" y="{top + side + 30}" '
                     f'text-anchor="middle">{label}</text>')
        for frac in (0, 0.5, 1):
            y = ymin + frac * (ymax - ymin)
            px, py = at(0, y)
            parts.append(f'<text x="{px - 4}" y="{py + 4}" text-anchor="end">{y:.2f}</text>')
            px, py = at(frac * xmax, ymin)
            parts.append(f'<text x="{px}" y="{py + 14}" text-anchor="middle">{frac * xmax:.0f}</text>')
        for meta, entries in runs:
            points = [at(e[key], e["eval_reward"]) for e in entries if "eval_reward" in e]
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
            parts.append(f'<polyline points="{path}" fill="none" stroke-width="2" '
                         f'stroke="{COLOURS.get(meta["arm"], "#000")}"/>')
    for i, (meta, _) in enumerate(runs):
        parts.append(f'<text x="{pad + 110 * i}" y="14" fill="{COLOURS.get(meta["arm"], "#000")}">'
                     f'{meta["arm"]}</text>')
    parts.append('<text x="{}" y="14">eval reward (greedy, {} held-out problems)</text>'.format(
        pad + 110 * len(runs), HELD_OUT))
    parts.append("</svg>")
    Path(svg).parent.mkdir(parents=True, exist_ok=True)
    Path(svg).write_text("\n".join(parts) + "\n")
    print("| arm | eval reward, first → last (± s.e.) | rollout tokens/s | rollout / train / sync s "
          "(median) | mean abs Δlog π | KL/token | TIS-clipped tokens | int8 codes changed a sync "
          "(median, last) |")
    print("|---|---|---|---|---|---|---|---|")
    for meta, entries in runs:
        evals = [e for e in entries if "eval_reward" in e]
        steps = [e for e in entries if e["update"] > 0]

        def median(key):
            values = sorted(e[key] for e in steps)
            return values[len(values) // 2]
        print(f'| {meta["arm"]} ({meta["rollout_precision"]}) | {evals[0]["eval_reward"]:.3f} → '
              f'{evals[-1]["eval_reward"]:.3f} ± {evals[-1]["eval_stderr"]:.3f} | '
              f'{median("rollout_tokens_per_s"):.0f} | {median("rollout_s"):.2f} / '
              f'{median("train_s"):.2f} / {median("sync_s"):.2f} | '
              f'{median("mean_abs_delta_log_pi"):.2e} | {median("kl_per_token"):.2e} | '
              f'{100 * median("tis_clip_share"):.2f} % | '
              f'{100 * median("codes_changed_share"):.3f} %, '
              f'{100 * steps[-1]["codes_changed_share"]:.3f} % |')


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arm", choices=ARMS)
    parser.add_argument("--rollout-precision", default="int8-dynamic",
                        help="the INT8 arms' engine: int8-dynamic, int8-dynamic-plain, or a "
                             "qforge artifact's path")
    parser.add_argument("--updates", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per update (B)")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=5e-6)
    parser.add_argument("--tis-clip", type=float, default=2.0)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch's threads")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", nargs="+", metavar="RUN.jsonl",
                        help="draw these runs (benchmarks/grpo.svg) and print their table")
    parser.add_argument("--svg", default=str(ROOT / "benchmarks/grpo.svg"))
    parser.add_argument("--mismatch", nargs="+", metavar="PRECISION",
                        help="measure these rollout precisions' log-prob mismatch against the "
                             "trainer on one untrained rollout batch each (f32, int8-dynamic, "
                             "an artifact's path), and print the table")
    args = parser.parse_args()
    if args.plot:
        plot(args.plot, args.svg)
        return
    if args.mismatch:
        mismatch(args)
        return
    if not args.arm or not args.out:
        parser.error("--arm and --out are needed to train (or --plot to draw runs)")
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        import qforge  # noqa: F401
    except ImportError as e:
        sys.exit(f"error: {e}: run in the venv of scripts/requirements-rl.txt, with the qforge "
                 "module on PYTHONPATH (see this script's docstring)")
    train(args)


if __name__ == "__main__":
    main()
