"""Serving a role's forward nodes under its limits: reward cache hits first, then bounded requests.

A forward node (score, log-probs, values) of a role with limits is cut into requests of
``request_rows`` rows; at most ``max_concurrent_requests`` of them are in flight to the role's
workers at once. A score node consults the reward cache first and only sends the misses. Generate
and update nodes are never cut: an update is one optimizer step, and rollout seeds are per call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from hybridflow.graph import Node, Op
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.limits import RequestLimiter, RewardCache, pair_keys

FORWARD_OPS = frozenset({Op.SCORE, Op.LOGPROB, Op.REF_LOGPROB, Op.VALUES})
# A request runner: rows in, (outputs, metrics) out.
Runner = Callable[[Batch], tuple[Batch, Mapping[str, float]]]


@dataclass(kw_only=True)
class RoleServices:
    """The limits of each role and the shared reward cache; ``request_rows`` sizes a role's requests."""

    reward_cache: RewardCache | None = None
    limiters: dict[str, RequestLimiter] = field(default_factory=dict)
    request_rows: dict[str, int] = field(default_factory=dict)

    def applies(self, node: Node) -> bool:
        if node.op not in FORWARD_OPS:
            return False
        return (node.op is Op.SCORE and self.reward_cache is not None) or str(node.role) in self.limiters

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.reward_cache is not None:
            out["reward_cache/hit_rate"] = self.reward_cache.hit_rate
            out["reward_cache/hits"] = float(self.reward_cache.hits)
        for role, limiter in self.limiters.items():
            out[f"{role}/peak_in_flight_requests"] = float(limiter.peak)
        return out


def serve(node: Node, inputs: Batch, run: Runner, services: RoleServices) -> tuple[Batch, dict[str, float]]:
    """Run ``node`` over ``inputs`` through the cache and the role's request bound."""
    cache = services.reward_cache if node.op is Op.SCORE else None
    keys = _keys(node, inputs) if cache is not None else []
    known = cache.lookup(keys) if cache is not None else [None] * len(inputs)
    missing = [row for row, score in enumerate(known) if score is None]
    outputs, metrics = Batch.from_fields({}), dict[str, float]()
    if missing:
        todo = inputs if len(missing) == len(inputs) else inputs.index(torch.tensor(missing))
        outputs, metrics = _requests(node, todo, run, services)
    if cache is None:
        return outputs, metrics
    name = node.outputs[0]
    scores = torch.tensor([0.0 if score is None else score for score in known])
    if missing:
        fresh = outputs[name].float()
        scores[torch.tensor(missing)] = fresh
        cache.store([keys[row] for row in missing], fresh.tolist())
    return Batch.from_fields({name: scores}), metrics


def _keys(node: Node, inputs: Batch) -> list[bytes]:
    ports = node.port_inputs()
    prompts, responses, mask = (inputs[ports[p]] for p in ("prompts", "responses", "response_mask"))
    prompt_mask = inputs["prompt_mask"] if "prompt_mask" in inputs else None  # noqa: SIM401 (Batch has no get)
    return pair_keys(prompts, prompt_mask, responses, mask)


def _requests(node: Node, rows: Batch, run: Runner, services: RoleServices) -> tuple[Batch, dict[str, float]]:
    limiter = services.limiters.get(str(node.role))
    if limiter is None:
        outputs, metrics = run(rows)
        return outputs, dict(metrics)
    size = services.request_rows.get(str(node.role)) or len(rows)
    pieces = rows.split(size)

    def one(piece: Batch) -> tuple[Batch, Mapping[str, float]]:
        with limiter.slot():
            return run(piece)

    with ThreadPoolExecutor(max(1, min(len(pieces), limiter.limit))) as pool:
        results = list(pool.map(one, pieces))
    keys = {key for _, metrics in results for key in metrics}
    merged = {key: sum(m[key] for _, m in results if key in m) / sum(key in m for _, m in results) for key in keys}
    return Batch.concat([outputs for outputs, _ in results]), merged
