"""Rank function of the vLLM tests: an FSDP actor with a colocated vLLM rollout (the hybrid engine)."""

from __future__ import annotations

from typing import Any

import torch
from harness import context, layout, rank_rows, role_spec, rollout_batch

from hybridflow.registry import LOSSES
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.engines import build_engine
from hybridflow.runtime.protocols import SamplingParams

GREEDY = SamplingParams(max_new_tokens=8, greedy=True)
# Sampled with temperature and top-k: the behaviour log-probs must still be the raw logits' (the trainer's).
SAMPLED = SamplingParams(max_new_tokens=8, temperature=0.7, top_k=12, seed=5, logprobs=True)


def _gap(engine: Any, prompts: Batch, rollout: Batch) -> float:
    """Largest |vLLM's behaviour log-prob - the trainer's log-prob| over the response tokens."""
    rows = prompts.union(rollout.select(["responses", "response_mask"]))
    trainer_lp = engine.trainer.log_probs(rows)["logprobs"]
    mask = rollout["response_mask"].bool()
    return float((rollout["rollout_logprobs"] - trainer_lp)[mask].abs().max())


def _agreement(engine: Any, prompts: Batch) -> dict[str, Any]:
    """vLLM vs the trainer on the same prompts: greedy tokens and the sampled tokens' log-probs."""
    rollout = engine.generate(prompts, SamplingParams(**{**vars(GREEDY), "logprobs": True}))
    trainer = engine.trainer.generate(prompts, GREEDY)
    rows = prompts.union(rollout.select(["responses", "response_mask"]))
    trainer_lp = engine.trainer.log_probs(rows)["logprobs"]
    mask = rollout["response_mask"].bool()
    scored = engine.rollout.log_probs(rows)["logprobs"]  # vLLM prompt log-probs of given responses
    return {"responses": rollout["responses"], "same_tokens": torch.equal(rollout["responses"], trainer["responses"]),
            "logprob_gap": _gap(engine, prompts, rollout), "sampled_gap": _gap(engine, prompts,
                                                                               engine.generate(prompts, SAMPLED)),
            "scored_gap": float((scored - trainer_lp)[mask].abs().max()),
            "padding_zero": bool((rollout["rollout_logprobs"][~mask] == 0).all())}


def hybrid_fsdp_vllm(rank: int, world_size: int) -> dict[str, Any]:
    spec = role_spec(lr=2e-2, grad_clip=1.0, rollout="vllm",
                     rollout_options={"rollout_dtype": "fp32", "kv_cache_gib": 1})
    engine = build_engine(spec, layout(), context(rank, world_size))
    batch = rank_rows(rollout_batch(8, seed=3), rank, world_size)
    prompts = batch.select(["prompts", "prompt_mask"])
    out: dict[str, Any] = {"before": _agreement(engine, prompts)}
    for _ in range(3):
        metrics = engine.train_step(batch, loss=LOSSES.get("ppo_policy"), options={})
    out["after"] = _agreement(engine, prompts)  # the first generate after the update syncs weights
    out["sync_metrics"] = engine.train_step(batch, loss=LOSSES.get("ppo_policy"), options={})
    out["first_metrics"] = metrics
    out["param_bytes"] = sum(t.numel() * t.element_size() for t in engine.state_dict().values())
    engine.generate(prompts, GREEDY)  # sync the last update
    engine.rollout.sleep(2)  # weights discarded: the next generate must reload them
    out["after_sleep_same"] = torch.equal(engine.generate(prompts, GREEDY)["responses"],
                                          engine.trainer.generate(prompts, GREEDY)["responses"])
    repeated = prompts.slice(0, 1).repeat_interleave(4)
    out["plain_fields"] = sorted(engine.generate(repeated, GREEDY).keys())  # no log-probs unless asked
    sampled = engine.generate(repeated, SamplingParams(max_new_tokens=8, temperature=1.0, seed=7, logprobs=True))
    out["distinct_samples"] = len({tuple(r.tolist()) for r in sampled["responses"]})
    out["sampled_logprobs_finite"] = bool(torch.isfinite(sampled["rollout_logprobs"]).all())
    torch.distributed.barrier()
    engine.close()
    return out
