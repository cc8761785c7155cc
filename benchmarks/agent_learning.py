"""Learning with a tool: GRPO on ``multiply`` with the calculator vs the same model without it, on CPU.

    .venv/bin/python benchmarks/agent_learning.py [--seeds 3] [--steps 30] [--jobs 2] [--out runs/bench_agent]
        [--rollout server --replicas 2]

A tiny Qwen2 cannot multiply a 3-digit by a 2-digit number, but it can learn to copy. Both arms start from one
SFT warm start (seed 0) on demonstrations of which ``--tool-fraction`` call the calculator exactly as a
trajectory renders it (``123*45=@calculator(123*45)<eos>`` + the observation suffix + ``5535<eos>``, the
observation not trained on) and the rest answer directly. The arms then differ only in ``agent.environment``:
``tool`` rolls out in the calculator environment (compact calls, up to 3 turns), ``no_tool`` samples one turn
(its reward is what the model can do alone; a call it writes is just text, scored on its last number). Each arm
runs in its own process (``--jobs`` at a time) for every RL seed. Prints per arm and seed the reward and the
tool-call rate of the first and last ``WINDOW`` steps, the per-seed gap between the arms' final rewards, and
each quantity's mean, std and mean - 3 std; writes ``agent_learning.json``. ``--rollout`` picks the policy's
rollout (``roles.actor.rollout``; ``server``: ``--replicas`` vLLM replicas behind the router, fp32, so run one
job at a time on a small machine) and names the runs and the JSON after it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 5  # steps averaged at each end of a run
SFT_STEPS = 800
SFT_EXAMPLES = 4000
ARMS = ("tool", "no_tool")
LR = 5e-4
MINI_BATCHES = 2
TOOL_FRACTION = 0.25


def demonstrations(tokenizer: Any, count: int, *, tool_fraction: float, seed: int = 0) -> list[Any]:
    """``count`` multiply demonstrations as token ids; ``tool_fraction`` of them call the calculator."""
    from hybridflow.agents.chat import ChatRenderer
    from hybridflow.data import task_examples
    from hybridflow.train.sft import Demonstration

    eos = tokenizer.eos_token_id
    renderer = ChatRenderer(tokenizer, turn_end_id=eos)
    rng = random.Random(seed)
    demos = []
    for record in task_examples("multiply", count, seed=seed):
        prompt, answer = record["prompt"], record["ground_truth"]
        prompt_ids = tuple(renderer.encode(prompt))
        answer_ids = [*renderer.encode(answer), eos]
        if rng.random() < tool_fraction:
            call = [*renderer.encode(f"@calculator({prompt.rstrip('=')})"), eos]
            observation = renderer.observation_ids([{"role": "tool", "name": "calculator", "content": answer}])
            response = [*call, *observation, *answer_ids]
            trained = [True] * len(call) + [False] * len(observation) + [True] * len(answer_ids)
        else:
            response, trained = answer_ids, [True] * len(answer_ids)
        demos.append(Demonstration(prompt_ids=prompt_ids, response_ids=tuple(response), trained=tuple(trained)))
    return demos


def warm_model(out: Path, *, tool_fraction: float, sft_steps: int = SFT_STEPS) -> Path:
    """The shared starting point: a tiny Qwen2 with the agent's wide tokenizer, SFT-warmed (seed 0)."""
    from hybridflow.models import build_tiny_causal_lm, save_model_dir
    from hybridflow.models.tokenizer import PLAIN_CHAT_TEMPLATE, WIDE_ALPHABET, char_tokenizer
    from hybridflow.train.sft import sft_on_demonstrations

    target = out / f"warm_model_f{tool_fraction:g}_s{sft_steps}"
    if not (target / "config.json").is_file():
        tokenizer = char_tokenizer(WIDE_ALPHABET, chat_template=PLAIN_CHAT_TEMPLATE)
        model = build_tiny_causal_lm("tiny-qwen2", vocab_size=len(tokenizer), seed=0)
        demos = demonstrations(tokenizer, SFT_EXAMPLES, tool_fraction=tool_fraction, seed=0)
        sft_on_demonstrations(model, demos, pad_token_id=tokenizer.pad_token_id, steps=sft_steps, lr=3e-3, seed=0)
        save_model_dir(model, tokenizer, target)
    return target


def arm_overrides(arm: str, *, steps: int, seed: int, model: Path, run_dir: Path, lr: float = LR,
                  mini_batches: int = MINI_BATCHES, rollout: str = "native", replicas: int = 2) -> dict[str, Any]:
    """The run's dotted config: both arms share everything but the environment and the response budget."""
    served: dict[str, Any] = {} if rollout == "native" else {"roles.actor.rollout": rollout}
    if rollout == "server":
        served["roles.actor.rollout_options"] = {"replicas": replicas, "rollout_dtype": "fp32"}
    common: dict[str, Any] = {**served,
        "algorithm": "grpo_no_ref", "seed": seed, "steps": steps, "model.path": str(model),
        "output_dir": str(run_dir), "data.task": "multiply", "data.num_examples": 2000, "data.batch_size": 8,
        "algorithm.options.n": 8, "algorithm.options.temperature": 1.0, "optim.actor.lr": lr,
        "optim.actor.mini_batches": mini_batches, "logging.progress": False, "logging.plot": False,
        "checkpoint.every": 0, "logging.trackers": ["jsonl"]}
    if arm == "tool":
        return {**common, "algorithm.options.max_new_tokens": 64, "agent.environment": "calculator",
                "agent.options": {"format": "compact"}, "agent.max_turns": 3, "agent.max_turn_tokens": 24}
    if arm == "no_tool":
        return {**common, "algorithm.options.max_new_tokens": 24}
    raise ValueError(f"arm {arm!r} is not one of {list(ARMS)}")


def window_means(history: Sequence[dict[str, float]], key: str,
                 window: int = WINDOW) -> tuple[float | None, float | None]:
    """Mean of ``key`` over the first and the last ``window`` steps (None: a run without that metric)."""
    if not all(key in row for row in history):
        return None, None
    values = [float(row[key]) for row in history]
    return sum(values[:window]) / window, sum(values[-window:]) / window


def run_arm(arm: str, seed: int, steps: int, model: Path, out: Path, lr: float = LR,
            mini_batches: int = MINI_BATCHES, rollout: str = "native", replicas: int = 2) -> dict[str, Any]:
    """One GRPO run; reward and tool-call rate at both ends, wall and CPU seconds."""
    from hybridflow.train.config import config_from_dotted
    from hybridflow.train.loop import train

    name = f"{arm}_{seed}" if rollout == "native" else f"{arm}_{seed}_{rollout}"
    config = config_from_dotted(arm_overrides(arm, steps=steps, seed=seed, model=model, run_dir=out / name,
                                           lr=lr, mini_batches=mini_batches, rollout=rollout, replicas=replicas))
    wall, cpu = time.perf_counter(), time.process_time()
    history = train(config, overwrite=True).history
    first, last = window_means(history, "reward/mean")
    assert first is not None and last is not None
    calls_first, calls_last = window_means(history, "agent/tool_call_rate")
    return {"arm": arm, "seed": seed, "first": first, "last": last, "gain": last - first, "calls_first": calls_first,
            "calls_last": calls_last, "wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)  # two arm processes share the machine's cores


def spread(values: Sequence[float]) -> dict[str, float]:
    mean = statistics.mean(values)
    std = statistics.stdev(values) if len(values) > 1 else float("nan")
    return {"mean": mean, "std": std, "mean_minus_3std": mean - 3 * std}


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per arm: spread of gain, final reward and final tool-call rate; per seed: tool final - no_tool final."""
    by_arm = {arm: sorted((r for r in rows if r["arm"] == arm), key=lambda r: r["seed"]) for arm in ARMS}
    result: dict[str, Any] = {arm: {key: spread([r[key] for r in arm_rows]) for key in ("gain", "last", "calls_last")
                                    if all(r[key] is not None for r in arm_rows)}
                              for arm, arm_rows in by_arm.items() if arm_rows}
    if all(by_arm.values()):
        result["final_gap"] = spread([t["last"] - n["last"] for t, n in zip(by_arm["tool"], by_arm["no_tool"],
                                                                              strict=True)])
    return result


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def table(rows: Sequence[dict[str, Any]], stats: dict[str, Any]) -> list[str]:
    lines = ["| arm | seed | reward first 5 | last 5 | gain | tool-call rate first 5 | last 5 | wall s | CPU s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (ARMS.index(r["arm"]), r["seed"])):
        lines.append(f"| {r['arm']} | {r['seed']} | {r['first']:.3f} | {r['last']:.3f} | {r['gain']:+.3f} | "
                     f"{_rate(r['calls_first'])} | {_rate(r['calls_last'])} | {r['wall_s']:.0f} | {r['cpu_s']:.0f} |")
    lines += ["", "| quantity | mean | std | mean - 3 std |", "|---|---|---|---|"]
    for arm in ARMS:
        for key in ("gain", "last", "calls_last"):
            if key in stats.get(arm, {}):
                s = stats[arm][key]
                lines.append(f"| {arm} {key} | {s['mean']:+.3f} | {s['std']:.3f} | {s['mean_minus_3std']:+.3f} |")
    if "final_gap" in stats:
        s = stats["final_gap"]
        lines.append(f"| final reward, tool - no_tool | {s['mean']:+.3f} | {s['std']:.3f} | "
                     f"{s['mean_minus_3std']:+.3f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--jobs", type=int, default=2, help="arm processes at a time")
    parser.add_argument("--tool-fraction", type=float, default=TOOL_FRACTION)
    parser.add_argument("--sft-steps", type=int, default=SFT_STEPS)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--lr", type=float, default=LR)
    parser.add_argument("--mini-batches", type=int, default=MINI_BATCHES)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--rollout", default="native", help="roles.actor.rollout: native, vllm or server")
    parser.add_argument("--replicas", type=int, default=2, help="rollout: server's replicas")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_agent")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    model = warm_model(args.out, tool_fraction=args.tool_fraction, sft_steps=args.sft_steps)
    sft_s = time.perf_counter() - start
    print(f"warm model {model} ({sft_s:.0f} s)", flush=True)
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    jobs = [(arm, seed) for seed in seeds for arm in args.arms.split(",")]
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=get_context("spawn"),
                             initializer=_one_thread) as pool:
        futures = [pool.submit(run_arm, arm, seed, args.steps, model, args.out, args.lr, args.mini_batches,
                               args.rollout, args.replicas) for arm, seed in jobs]
        rows = []
        for future in futures:
            rows.append(future.result())
            r = rows[-1]
            print(f"{r['arm']} seed {r['seed']}: reward {r['first']:.3f} -> {r['last']:.3f}, tool calls "
                  f"{_rate(r['calls_first'])} -> {_rate(r['calls_last'])} ({r['wall_s']:.0f} s)", flush=True)
    stats = summary(rows)
    report = {"steps": args.steps, "seeds": list(seeds), "tool_fraction": args.tool_fraction,
              "sft_steps": args.sft_steps, "lr": args.lr, "mini_batches": args.mini_batches, "window": WINDOW,
              "sft_s": sft_s, "total_s": time.perf_counter() - start, "runs": rows, "summary": stats,
              "rollout": args.rollout, "load_after": os.getloadavg()}
    suffix = "" if args.rollout == "native" else f"_{args.rollout}"
    (args.out / f"agent_learning{suffix}.json").write_text(json.dumps(report, indent=2))
    print("\n".join(table(rows, stats)))
    print(f"total {report['total_s']:.0f} s")


if __name__ == "__main__":
    main()
