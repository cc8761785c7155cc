"""Rank function of the LoRA-to-vLLM tests: a LoRA policy (torch trainer) generating on a colocated vLLM engine
that takes its adapter alone after every update."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from harness import context, layout, role_spec, rollout_batch

from hybridflow.agents.protocols import TurnRequest
from hybridflow.registry import LOSSES
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.engines import build_engine
from hybridflow.runtime.protocols import AdapterSpec, SamplingParams
from hybridflow.runtime.weights import full_weights

ADAPTERS = AdapterSpec(rank=16, alpha=32.0)
SAMPLED = SamplingParams(max_new_tokens=8, temperature=0.7, top_k=12, seed=5, logprobs=True)


def _gaps(engine: Any, prompts: Batch) -> dict[str, float]:
    """Largest |vLLM's behaviour log-prob - the trainer's| over sampled tokens, with adapters and without."""
    rollout = engine.generate(prompts, SAMPLED)
    rows = prompts.union(rollout.select(["responses", "response_mask"]))
    mask = rollout["response_mask"].bool()
    adapted = engine.trainer.log_probs(rows)["logprobs"]
    base = engine.trainer.log_probs(rows, adapters=False)["logprobs"]
    scored = engine.rollout.log_probs(rows)["logprobs"]
    return {"adapted": float((rollout["rollout_logprobs"] - adapted)[mask].abs().max()),
            "base": float((rollout["rollout_logprobs"] - base)[mask].abs().max()),
            "scored": float((scored - adapted)[mask].abs().max())}


def _train(engine: Any, batch: Batch, steps: int) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for _ in range(steps):
        metrics = engine.train_step(batch, loss=LOSSES.get("ppo_policy"), options={})
    return metrics


def _nbytes(named: Any) -> int:
    return sum(tensor.numel() * tensor.element_size() for _, tensor in named)


def _exported_gap(engine: Any, prompts: Batch) -> float:
    """The trainer's adapter exported as ``hybridflow export`` writes it, loaded into the running vLLM engine as a
    LoRA of its own: the largest |vLLM's log-prob under it - the trainer's| over sampled tokens."""
    import tempfile

    from hybridflow.backends.common.peft_lora import is_adapter_key
    from vllm import SamplingParams as VllmSampling
    from vllm.lora.request import LoRARequest

    from hybridflow.train.adapter_export import save_adapter_dir

    vllm_engine = engine.rollout.rollout
    state = {name: tensor for name, tensor in engine.trainer.model.state_dict().items() if is_adapter_key(name)}
    rows = prompts.union(engine.generate(prompts, SAMPLED).select(["responses", "response_mask"]))
    trainer = engine.trainer.log_probs(rows)["logprobs"]
    with tempfile.TemporaryDirectory() as tmp:
        out = save_adapter_dir(state, ADAPTERS, vllm_engine.config.model_dir, Path(tmp) / "adapter")
        request = LoRARequest("exported", 99, str(out))
        gap = 0.0
        for i in range(len(rows)):
            head = rows["prompts"][i][rows["prompt_mask"][i].bool()].tolist()
            tail = rows["responses"][i][rows["response_mask"][i].bool()].tolist()
            result = vllm_engine.llm.generate([{"prompt_token_ids": head + tail}], VllmSampling(
                max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False, lora_request=request)[0]
            for t, token in enumerate(tail):
                logprob = result.prompt_logprobs[len(head) + t][token].logprob
                gap = max(gap, abs(logprob - float(trainer[i, t])))
    return gap


def hybrid_lora_vllm(rank: int, world_size: int) -> dict[str, Any]:
    spec = dataclasses.replace(role_spec(lr=2e-2, grad_clip=1.0, rollout="vllm",
                                         rollout_options={"rollout_dtype": "fp32", "kv_cache_gib": 1,
                                                          "lora_versions": 2}),
                               lora=ADAPTERS)
    engine = build_engine(spec, layout(dp=1), context(rank, world_size))
    batch = rollout_batch(8, seed=3)
    prompts = batch.select(["prompts", "prompt_mask"])
    versions = engine.rollout.rollout.adapters
    out: dict[str, Any] = {"adapter_sync": engine.adapter_sync, "before": _gaps(engine, prompts),
                           "lora_before": engine.rollout.rollout.lora_request}
    _train(engine, batch, 3)
    out["after"] = _gaps(engine, prompts)  # the first generate after the update loads adapter v1
    out["adapter_bytes"] = _nbytes(engine.trainer.iter_adapter_weights())
    out["full_bytes"] = _nbytes(full_weights(engine.trainer, "fp32"))
    out["sync_metrics"] = _train(engine, batch, 1)
    engine.generate(prompts, SAMPLED)  # v2
    out["loaded_v2"] = versions.loaded_ids()
    # A turn session opened under v2 keeps sampling under v2 after v3 is loaded (an in-flight trajectory
    # finishes under the adapter it started with); new generations use v3.
    requests = [TurnRequest(token_ids=tuple(int(t) for t in row), max_tokens=6, seed=11 + i)
                for i, row in enumerate(prompts["prompts"][:4])]
    with engine.rollout.turn_session(SAMPLED) as turns:
        first = turns(requests)
        _train(engine, batch, 1)
        engine.sync_weights()  # v3, while the session is open
        out["loaded_v3"] = versions.loaded_ids()
        second = turns(requests)
    with engine.rollout.turn_session(SAMPLED) as turns:
        third = turns(requests)
    out["in_flight_same"] = [r.token_ids for r in first] == [r.token_ids for r in second] and \
        [r.logprobs for r in first] == [r.logprobs for r in second]
    out["new_session_differs"] = [r.logprobs for r in first] != [r.logprobs for r in third]
    out["versions"] = ([r.version for r in second], [r.version for r in third])
    out["adapter_dirs"] = sorted(path.name for path in versions.root.iterdir())
    out["sync_after_v3"] = engine.last_sync.metrics() if engine.last_sync else {}
    out["after_v3"] = _gaps(engine, prompts)
    out["exported"] = _exported_gap(engine, prompts)
    root = versions.root
    engine.close()
    out["root_removed"] = not Path(root).exists()
    torch.manual_seed(0)
    return out
