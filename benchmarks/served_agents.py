"""A multi-turn agent workload on three rollouts side by side: ``server`` (vLLM replicas behind vllm-router),
in-worker ``vllm`` and the ``native`` torch loop; the router's added latency per request and a weight sync's time.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 nice -n 5 python benchmarks/served_agents.py [--rows 64] [--rounds 3]

The workload is the calculator agent of ``benchmarks/agent_learning.py``: its SFT-warmed tiny Qwen2 (built, or
reused from ``--out``; ``--tool-fraction`` 1.0 makes nearly every trajectory call the tool), ``multiply``
prompts, the ``calculator`` environment (compact calls, up to 3 turns of at most 24 tokens, 64 response tokens),
``--rows`` trajectories (``--prompts`` prompts x the rest as samples) at temperature 1, the ``trajectory``
schedule. The three engines are trainable policies built as a worker builds
them (``build_engine``; ``server``: ``--replicas`` single-thread replicas, fp32) and live in this one process; each
timed round runs every engine once on the same prompts, the engines' order rotating, so load from other jobs falls
on all three alike. One untimed warm-up round first. Tokens/s counts the tokens the policy sampled (``loss_mask``)
per second of the rank's multi-turn generate (``run_agent_op``, the worker's path); ratios are per round.

The router: ``--pings`` one-token requests, one at a time, through the router and straight to a replica,
interleaved (``benchmarks/rollout_servers.py``). A weight sync: the hybrid engine's ``sync_weights`` (trainer
weights gathered, written, reloaded by the rollout) for ``vllm`` and ``server``, median of 3. The 1-, 5- and
15-minute load averages are read before and after. Prints one JSON object (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_learning import TOOL_FRACTION, warm_model
from rollout_servers import _latencies, _pct

from hybridflow.graph import load_graph
from hybridflow.graph.agents import with_environment
from hybridflow.planner import RoleLayout, Sharding
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.protocols import OptimSpec, RoleSpec, WorkerContext
from hybridflow.runtime.worker import SoloCollective

ROOT = Path(__file__).resolve().parents[1]
ROLLOUTS = ("server", "vllm", "native")


def workload(model: Path, *, rows: int, prompts: int) -> tuple[Any, Batch]:
    """The calculator agent's generate node and ``rows`` rows: ``prompts`` multiply prompts, each repeated."""
    from hybridflow.data import task_examples
    from hybridflow.data.dataset import encode_prompts
    from hybridflow.models.tokenizer import load_tokenizer

    graph = with_environment(load_graph("grpo_no_ref", max_new_tokens=64, temperature=1.0), "calculator",
                             env_options={"format": "compact"}, max_turns=3, max_turn_tokens=24,
                             schedule="trajectory")
    node = next(n for n in graph.nodes if n.environment)
    records = task_examples("multiply", prompts, seed=7)
    encoded = encode_prompts([r for r in records for _ in range(rows // prompts)], load_tokenizer(str(model)))
    return node, encoded


def build(rollout: str, model: Path, replicas: int) -> Any:
    from hybridflow.graph import RoleKind
    from hybridflow.runtime.engines import build_engine

    options = {"replicas": replicas, "rollout_dtype": "fp32"} if rollout == "server" else {}
    spec = RoleSpec(name="actor", kind=RoleKind.POLICY, model=str(model), optim=OptimSpec(lr=5e-4), seed=0,
                    rollout=rollout, rollout_options=options)
    layout = RoleLayout(role="actor", dp=1, sharding=Sharding.NO_SHARD, dtype="fp32", micro_batch_size=8)
    return build_engine(spec, layout, WorkerContext(group=0, rank=0, world_size=1, device="cpu",
                                                    collective=SoloCollective()))


def one_round(engine: Any, node: Any, batch: Batch, seed: int, model: Path) -> dict[str, float]:
    from hybridflow.runtime.worker import run_agent_op

    start = time.perf_counter()
    out = run_agent_op(engine, node, batch, seed, model=str(model), rank=0)
    seconds = time.perf_counter() - start
    sampled = int(out["loss_mask"].sum()) if "loss_mask" in out else int(out["response_mask"].sum())
    turns = out["turns"].float().mean().item() if "turns" in out else float("nan")
    return {"seconds": seconds, "tokens": sampled, "tokens_per_s": sampled / seconds, "turns": turns}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--pings", type=int, default=100)
    parser.add_argument("--tool-fraction", type=float, default=TOOL_FRACTION,
                        help="the warm start's share of tool-calling demonstrations (1.0: nearly every row calls)")
    parser.add_argument("--rollouts", default=",".join(ROLLOUTS))
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_agent")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"load_before": os.getloadavg(), "nproc": os.cpu_count(), "rows": args.rows,
                              "replicas": args.replicas, "tool_fraction": args.tool_fraction}
    model = warm_model(args.out, tool_fraction=args.tool_fraction)
    node, batch = workload(model, rows=args.rows, prompts=args.prompts)
    rollouts = args.rollouts.split(",")
    engines: dict[str, Any] = {}
    try:
        for name in rollouts:
            start = time.perf_counter()
            engines[name] = build(name, model, args.replicas)
            report[f"{name}_start_s"] = round(time.perf_counter() - start, 1)
        for name in rollouts:
            one_round(engines[name], node, batch, 0, model)  # warm-up
        rounds: list[dict[str, dict[str, float]]] = []
        for r in range(args.rounds):
            order = rollouts[r % len(rollouts):] + rollouts[:r % len(rollouts)]
            rounds.append({name: one_round(engines[name], node, batch, 1 + r, model) for name in order})
            print(json.dumps({"round": r, **{n: round(v["tokens_per_s"]) for n, v in rounds[-1].items()}}),
                  flush=True)
        for name in rollouts:
            rates = [row[name]["tokens_per_s"] for row in rounds]
            report[f"{name}_tokens_per_s"] = round(statistics.median(rates))
            report[f"{name}_tokens_per_s_all"] = [round(v) for v in rates]
            report[f"{name}_turns"] = round(statistics.mean(row[name]["turns"] for row in rounds), 2)
            report[f"{name}_tokens_per_round"] = round(statistics.mean(row[name]["tokens"] for row in rounds))
        for other in ("vllm", "native"):
            if "server" in engines and other in engines:
                ratios = [row["server"]["tokens_per_s"] / row[other]["tokens_per_s"] for row in rounds]
                report[f"server_over_{other}"] = round(statistics.median(ratios), 2)
                report[f"server_over_{other}_all"] = [round(v, 2) for v in ratios]
        if "server" in engines:
            server = engines["server"].rollout
            from hybridflow.runtime.servers import CompletionsClient

            direct = [CompletionsClient(url, server.spec.name) for url in server.fleet.replica_urls]
            via, straight = _latencies(server.client, direct, args.pings)
            for client in direct:
                client.close()
            for label, values in (("router", via), ("direct", straight)):
                report[f"{label}_p50_ms"] = round(1000 * _pct(values, 0.5), 2)
                report[f"{label}_p99_ms"] = round(1000 * _pct(values, 0.99), 2)
            report["router_added_p50_ms"] = round(report["router_p50_ms"] - report["direct_p50_ms"], 2)
            report["router_added_p99_ms"] = round(report["router_p99_ms"] - report["direct_p99_ms"], 2)
            paired = sorted(a - b for a, b in zip(via, straight, strict=True))
            report["router_added_paired_p50_ms"] = round(1000 * _pct(paired, 0.5), 2)
        for name in ("server", "vllm"):
            if name in engines:
                syncs = [engines[name].sync_weights() for _ in range(3)]
                report[f"{name}_sync_s"] = round(statistics.median(s.seconds for s in syncs), 3)
                report[f"{name}_sync_bytes"] = syncs[-1].bytes
    finally:
        for engine in engines.values():
            engine.close()
    report["load_after"] = os.getloadavg()
    (args.out / "served_agents.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
