"""Rollout servers on a CPU: replica start time, tokens/s through the router vs straight to the replicas, the
router's added latency per request, and a weight sync's seconds.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 nice -n 5 python benchmarks/rollout_servers.py [--replicas 2] [--rows 64]

The tiny Qwen2 (``tiny-qwen2``, fp32) served by ``--replicas`` vLLM OpenAI-server replicas (``OMP_NUM_THREADS=1``
each) behind vllm-router (``rollout: server``, ``backends/vllm/server.py``). ``generate``: ``--rows`` prompts of
16 tokens, ``--tokens`` new tokens sampled at temperature 1, median of 3 after a warm-up, through the router and
with the same requests split evenly over the replicas by the client (no router). ``latency``: ``--pings`` one-token
requests one at a time, through the router and straight to a replica, interleaved: p50/p99 and their difference.
``sync``: new
weights written once and reloaded by every replica (median of 3). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from hybridflow.graph import RoleKind
from hybridflow.planner import RoleLayout, Sharding
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.protocols import RoleSpec, SamplingParams, WorkerContext
from hybridflow.runtime.servers import CompletionRequest, CompletionsClient
from hybridflow.runtime.worker import SoloCollective

VOCAB = 51


def _requests(rows: int, tokens: int, seed: int) -> list[CompletionRequest]:
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(4, VOCAB, (rows, 16), generator=gen).tolist()
    return [CompletionRequest(prompt=p, max_tokens=tokens, seed=seed * 1000 + i, sampling={"temperature": 1.0},
                              session=f"r{i}") for i, p in enumerate(prompts)]


def _throughput(clients: list[CompletionsClient], requests: list[CompletionRequest]) -> float:
    """Generated tokens per second, the requests dealt round-robin over ``clients``, all in flight at once."""
    from concurrent.futures import ThreadPoolExecutor

    start = time.perf_counter()
    with ThreadPoolExecutor(len(requests)) as pool:
        done = list(pool.map(lambda ir: clients[ir[0] % len(clients)].complete(ir[1]), enumerate(requests)))
    return sum(len(c.token_ids) for c in done) / (time.perf_counter() - start)


def _latencies(router: CompletionsClient, direct: list[CompletionsClient], pings: int) -> tuple[list[float], ...]:
    """One-token request times through the router and straight to a replica, interleaved so that load from other
    jobs falls on both alike (10 unmeasured of each first)."""
    via: list[float] = []
    straight: list[float] = []
    for i in range(pings + 10):
        for client, out in ((router, via), (direct[i % len(direct)], straight)):
            start = time.perf_counter()
            client.complete(CompletionRequest(prompt=[5, 6, 7], max_tokens=1, seed=i, session=f"ping{i}"))
            if i >= 10:
                out.append(time.perf_counter() - start)
    return via, straight


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--pings", type=int, default=100)
    args = parser.parse_args()
    from hybridflow.backends.vllm.server import ROLLOUT

    spec = RoleSpec(name="actor_rollout", kind=RoleKind.FROZEN_POLICY, model="tiny-qwen2", rollout="server",
                    rollout_options={"replicas": args.replicas})
    layout = RoleLayout(role="actor_rollout", dp=1, sharding=Sharding.NO_SHARD, dtype="fp32", micro_batch_size=1)
    start = time.perf_counter()
    engine: Any = ROLLOUT.build(spec, layout, WorkerContext(group=0, rank=0, world_size=1, device="cpu",
                                                            collective=SoloCollective()), trainer=None)
    report: dict[str, Any] = {"replicas": args.replicas, "start_s": round(time.perf_counter() - start, 1)}
    try:
        prompts = torch.randint(4, VOCAB, (8, 16))
        engine.generate(Batch({"prompts": prompts, "prompt_mask": torch.ones_like(prompts)}),
                        SamplingParams(max_new_tokens=8))  # warm-up
        router = [engine.client]
        direct = [CompletionsClient(url, spec.name) for url in engine.fleet.replica_urls]
        for name, clients in (("router", router), ("direct", direct)):
            rates = [_throughput(clients, _requests(args.rows, args.tokens, seed)) for seed in range(3)]
            report[f"{name}_tokens_per_s"] = round(statistics.median(rates))
        via, straight = _latencies(router[0], direct, args.pings)
        for name, values in (("router", via), ("direct", straight)):
            report[f"{name}_p50_ms"] = round(1000 * _pct(values, 0.5), 2)
            report[f"{name}_p99_ms"] = round(1000 * _pct(values, 0.99), 2)
        report["router_added_p50_ms"] = round(report["router_p50_ms"] - report["direct_p50_ms"], 2)
        state = {name: tensor for name, tensor in _tiny_state().items()}
        syncs = []
        for _ in range(3):
            engine.load_weights(iter(state.items()))
            syncs.append(engine.last_sync.seconds)
        report["sync_s"] = round(statistics.median(syncs), 3)
        report["sync_bytes"] = engine.last_sync.bytes
        for client in direct:
            client.close()
    finally:
        engine.close()
    print(json.dumps(report))


def _tiny_state() -> dict[str, torch.Tensor]:
    from hybridflow.models import build_tiny_causal_lm

    return dict(build_tiny_causal_lm("tiny-qwen2", vocab_size=VOCAB, seed=1).state_dict())


if __name__ == "__main__":
    main()
