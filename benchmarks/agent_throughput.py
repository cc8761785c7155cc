"""Multi-turn rollouts with slow tools: trajectory-level async (``trajectory``) vs batch-synchronous turns (``turn``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/agent_throughput.py [--turns 1 2 3] [--repeats 3] [--out DIR]

A tiny Qwen2 from random weights (``tiny-qwen2``, positions up to 512) samples ``--batch`` trajectories (32 rows,
``--prompt-len`` random prompt tokens each) through the local executor (``Controller.generate`` on the multi-turn
generate node that ``with_environment`` makes of GRPO's), in the ``simulated_tools`` environment: after every
turn a tool call waits a latency drawn from ``--latency`` (the issue's lognormal, median 100 ms, sigma 1.0),
seeded by the row, the turn and the round, so both schedules wait the same waits; the trajectory ends after
``turns`` turns. A turn is exactly ``--turn-tokens`` sampled tokens: the end token is masked until the last one,
then forced (logit hooks, as the agent tests' EOS boost), so both schedules decode the same tokens and only the
schedule differs. Fixed turn lengths favour ``turn``: a batch-synchronous turn would otherwise also wait for its
longest decode.

Tokens/s counts the sampled tokens (``loss_mask``) per second of wall time of the generate call. How the
measurement is made meaningful on a shared 2-core machine (as ``pipeline_modes.py``): every (schedule, turns,
repeat) in a process of its own (one core: ``OMP_NUM_THREADS=1``), one untimed warm-up round and ``--rounds``
timed rounds per process, repeats interleaved across configurations (the schedule order alternating), the
median over repeats. The engine's busy seconds and batch sizes are recorded by wrapping its turn session.

The planner's prediction is ``predict_agent_schedules`` with the same workload (turns, tokens per turn, the
observation's tokens as the renderer templates them, the latency distribution, batch, prompt length, the native
rollout without prefix caching) on its CPU device model (``1xCPU``: one core, the catalogue's priors); its
ranking of the two schedules at each turn count is compared with the measured one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SCHEDULES = ("trajectory", "turn")
OBSERVATION = "tool output: 42"
TIE = 0.03  # measured tokens/s within 3% of each other rank as a tie (the spread of repeats is larger)
PLANNER_TIE = 0.005  # predicted seconds within 0.5%: the order statistics' quadratures agree to ~0.1%


def build_model(directory: Path) -> Path:
    """The random tiny Qwen2 with the character tokenizer, its positions raised to 512 (three turns of context)."""
    if (directory / "config.json").is_file():
        return directory
    import torch
    from transformers import AutoModelForCausalLM

    from hybridflow.data import char_tokenizer
    from hybridflow.models import save_model_dir
    from hybridflow.models.tiny import tiny_config

    tokenizer = char_tokenizer()
    config = tiny_config("tiny-qwen2", vocab_size=len(tokenizer))
    config.max_position_embeddings = 512
    torch.manual_seed(0)
    save_model_dir(AutoModelForCausalLM.from_config(config), tokenizer, directory)
    return directory


def fixed_turn_length(model: Any, tokens: int) -> None:
    """Every turn samples exactly ``tokens`` tokens, the last the end token: a pre-hook counts the decode steps
    since the request's prefill (a call without a cache), the head's hook masks or forces the end token."""
    eos = model.config.eos_token_id
    step = [0]

    def count(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        step[0] = 0 if kwargs.get("past_key_values") is None else step[0] + 1

    def end_at_the_last(module: Any, inputs: Any, output: Any) -> Any:
        output = output.clone()
        if step[0] >= tokens - 1:
            output[...] = float("-inf")
            output[..., eos] = 0.0
        else:
            output[..., eos] = float("-inf")
        return output

    model.register_forward_pre_hook(count, with_kwargs=True)
    model.lm_head.register_forward_hook(end_at_the_last)


@contextmanager
def engine_timer(engine: Any, record: list[tuple[int, float]]) -> Iterator[None]:
    """Record (requests, seconds) of every batch the engine samples in a turn session."""
    original = engine.turn_session

    @contextmanager
    def timed_session(sampling: Any) -> Iterator[Any]:
        with original(sampling) as generate_batch:
            def timed(requests: Any) -> Any:
                start = time.perf_counter()
                results = generate_batch(requests)
                record.append((len(requests), time.perf_counter() - start))
                return results

            yield timed

    engine.turn_session = timed_session
    try:
        yield
    finally:
        engine.turn_session = original


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One process: a warm-up round, then ``args.rounds`` timed rounds of one (schedule, turns)."""
    import torch

    from hybridflow.graph import load_graph
    from hybridflow.graph.agents import with_environment
    from hybridflow.runtime import Batch, Controller, OptimSpec, RoleSpec, default_plan

    turns, tokens = args.turns, args.turn_tokens
    graph = with_environment(load_graph("grpo_no_ref", reward_kind="reward_function",
                                        max_new_tokens=turns * (tokens + 64)),
                             "simulated_tools", env_options={"turns": turns, "latency": args.latency,
                                                             "seed": 0, "observation": OBSERVATION},
                             max_turns=turns, max_turn_tokens=tokens, schedule=args.schedule)
    node = next(n.name for n in graph.nodes if n.environment)
    specs = {r.name: RoleSpec(name=r.name, kind=r.kind, model=str(args.model),
                              optim=OptimSpec(lr=1e-3) if r.kind.trainable else None)
             for r in graph.roles if r.kind.needs_gpu}
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, 51, (args.batch, args.prompt_len), generator=generator)

    def rows(truth: str) -> Batch:
        return Batch({"prompts": prompts, "prompt_mask": torch.ones_like(prompts)},
                     {"ground_truth": [truth] * args.batch})

    rounds = []
    with Controller(graph, default_plan(graph), specs=specs, driver_roles={"reward": lambda b: b}) as controller:
        engine = controller.executor.groups[0].workers[0].engines["actor"]  # type: ignore[attr-defined]
        fixed_turn_length(engine.model, tokens)
        controller.generate(node, rows("warm-up"), seed=0)
        for index in range(args.rounds):
            batches: list[tuple[int, float]] = []
            with engine_timer(engine, batches):
                start = time.perf_counter()
                out = controller.generate(node, rows(f"r{args.repeat}g{index}"), seed=0)
                seconds = time.perf_counter() - start
            sampled = out["loss_mask"].sum(dim=1)
            observed = (out["response_mask"] - out["loss_mask"]).sum(dim=1)
            if not (bool((out["turns"] == turns).all()) and bool((sampled == turns * tokens).all())):
                raise RuntimeError(f"{args.schedule} x {turns} turns: turns {out['turns'].tolist()}, sampled "
                                   f"{sampled.tolist()}; every row must run {turns} turns of {tokens} tokens")
            rounds.append({"seconds": seconds, "tokens": int(sampled.sum()),
                           "observation_tokens": float(observed.float().mean()) / max(turns - 1, 1),
                           "engine_s": sum(s for _, s in batches), "batches": [n for n, _ in batches]})
    tokens_total, seconds_total = sum(r["tokens"] for r in rounds), sum(r["seconds"] for r in rounds)
    return {"schedule": args.schedule, "turns": turns, "repeat": args.repeat, "tokens_per_s": tokens_total /
            seconds_total, "seconds": seconds_total / len(rounds), "rounds": rounds,
            "engine_busy": sum(r["engine_s"] for r in rounds) / seconds_total,
            "mean_batch": statistics.mean(n for r in rounds for n in r["batches"]),
            "observation_tokens": rounds[0]["observation_tokens"], "load_average": os.getloadavg()[0]}


def run_process(args: argparse.Namespace, schedule: str, turns: int, repeat: int) -> dict[str, Any]:
    """One measured (schedule, turns, repeat) in a process of its own; a finished one is reused."""
    path = args.out / f"{schedule}-t{turns}-r{repeat}.json"
    if not path.is_file():
        command = [sys.executable, __file__, "--measure", "--schedule", schedule, "--turns-one", str(turns),
                   "--repeat", str(repeat), "--model", str(args.model), "--result", str(path),
                   *[f"--{key.replace('_', '-')}={getattr(args, key)}"
                     for key in ("batch", "prompt_len", "turn_tokens", "latency", "rounds")]]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        subprocess.run(command, check=True, timeout=600, env=env)
    return json.loads(path.read_text())


def predicted(args: argparse.Namespace, turns: int, observation_tokens: float) -> dict[str, float]:
    """The planner's seconds per generate of each schedule for this workload (CPU priors, native rollout)."""
    from hybridflow.planner import AgentWorkload, ModelSpec, predict_agent_schedules

    workload = AgentWorkload(turns=f"fixed:{turns}", tool_latency=args.latency, calls_per_turn=1.0,
                             observation_tokens=observation_tokens, turn_tokens=args.turn_tokens,
                             prefix_caching=False)
    return predict_agent_schedules(model=ModelSpec.from_hf_config(args.model), workload=workload, batch=args.batch,
                                   prompt_len=args.prompt_len, max_turns=turns,
                                   max_new_tokens=turns * (args.turn_tokens + 64), max_turn_tokens=args.turn_tokens,
                                   cluster="1xCPU", rollout="native")


def ranking(trajectory: float, turn: float, tie: float = 0.0) -> str:
    """Which schedule is faster given a speed of each (higher is faster); '=' within ``tie`` of each other."""
    if abs(trajectory - turn) <= tie * max(trajectory, turn):
        return "="
    return "trajectory" if trajectory > turn else "turn"


def report(args: argparse.Namespace, results: list[dict[str, Any]]) -> dict[str, Any]:
    print("| turns | schedule | tokens/s (median; min-max) | s per generate | engine busy | mean batch | planner s "
          "(tokens/s) |")
    print("|---|---|---|---|---|---|---|")
    summary: dict[str, Any] = {"settings": {k: str(v) for k, v in vars(args).items()}, "turns": {}}
    for turns in args.turns:
        rows = {s: [r for r in results if r["turns"] == turns and r["schedule"] == s] for s in SCHEDULES}
        obs = rows["turn"][0]["observation_tokens"]
        plan = predicted(args, turns, obs)
        tokens = args.batch * turns * args.turn_tokens
        entry: dict[str, Any] = {"observation_tokens": obs, "planner_seconds": plan}
        for schedule in SCHEDULES:
            rates = [r["tokens_per_s"] for r in rows[schedule]]
            entry[schedule] = {"tokens_per_s": statistics.median(rates), "tokens_per_s_all": rates,
                               "seconds": statistics.median(r["seconds"] for r in rows[schedule]),
                               "engine_busy": statistics.median(r["engine_busy"] for r in rows[schedule]),
                               "mean_batch": statistics.median(r["mean_batch"] for r in rows[schedule]),
                               "planner_tokens_per_s": tokens / plan[schedule]}
            e = entry[schedule]
            print(f"| {turns} | {schedule} | {e['tokens_per_s']:.0f} ({min(rates):.0f}-{max(rates):.0f}) | "
                  f"{e['seconds']:.2f} | {e['engine_busy']:.2f} | {e['mean_batch']:.1f} | "
                  f"{plan[schedule]:.2f} ({e['planner_tokens_per_s']:.0f}) |")
        ratio = entry["trajectory"]["tokens_per_s"] / entry["turn"]["tokens_per_s"]
        paired = [t["tokens_per_s"] / u["tokens_per_s"] for t, u in
                  zip(sorted(rows["trajectory"], key=lambda r: r["repeat"]),
                      sorted(rows["turn"], key=lambda r: r["repeat"]), strict=True)]
        entry.update(ratio=ratio, ratio_per_repeat=paired, ratio_paired_median=statistics.median(paired),
                     planner_ratio=plan["turn"] / plan["trajectory"],
                     measured_ranking=ranking(entry["trajectory"]["tokens_per_s"], entry["turn"]["tokens_per_s"],
                                              TIE),
                     planner_ranking=ranking(1 / plan["trajectory"], 1 / plan["turn"], PLANNER_TIE))
        summary["turns"][str(turns)] = entry
    print()
    print("| turns | trajectory / turn, measured: medians (per repeat; their median) | planner | faster, measured | "
          "faster, planner | target >= 1.7x |")
    print("|---|---|---|---|---|---|")
    for turns, e in summary["turns"].items():
        print(f"| {turns} | {e['ratio']:.2f}x ({', '.join(f'{r:.2f}' for r in e['ratio_per_repeat'])}; "
              f"{e['ratio_paired_median']:.2f}) | "
              f"{e['planner_ratio']:.2f}x | {e['measured_ranking']} | {e['planner_ranking']} | "
              f"{'met' if e['ratio'] >= 1.7 else 'not met'} |")
    agree = all(e["measured_ranking"] in ("=", e["planner_ranking"]) or
                (e["measured_ranking"] == "=" and e["planner_ranking"] == "=") for e in summary["turns"].values())
    summary["rankings_agree"] = agree
    print(f"\nrankings agree (a measured tie, within {TIE:.0%}, agrees with either): {agree}; "
          f"load average {os.getloadavg()[0]:.1f}")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--repeats", type=int, default=3, help="processes per (schedule, turns), interleaved")
    parser.add_argument("--rounds", type=int, default=2, help="timed generate calls per process")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--turn-tokens", type=int, default=64)
    parser.add_argument("--latency", default="lognormal:median=0.1,sigma=1.0")
    parser.add_argument("--out", type=Path, default=Path("runs/agent_throughput"))
    parser.add_argument("--model", type=Path, default=None, help="(default: OUT/model, built once)")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--schedule", choices=SCHEDULES, help=argparse.SUPPRESS)
    parser.add_argument("--turns-one", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--repeat", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        args.turns = args.turns_one
        args.result.write_text(json.dumps(measure(args)))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    args.model = (args.model or build_model(args.out / "model")).resolve()
    results = []
    for repeat in range(args.repeats):  # interleaved: every configuration once before any twice
        for turns in args.turns:
            order = SCHEDULES if (repeat + turns) % 2 == 0 else SCHEDULES[::-1]
            for schedule in order:
                print(f"{schedule} x {turns} turns (repeat {repeat}); load average {os.getloadavg()[0]:.1f}",
                      file=sys.stderr, flush=True)
                results.append(run_process(args, schedule, turns, repeat))
    summary = report(args, results)
    (args.out / "agent_throughput.json").write_text(json.dumps({"summary": summary, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
