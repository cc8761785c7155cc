"""Behaviour log-probs from the training backends' rollouts (the native loop and HF generate).

On the same weights, ``rollout_logprobs`` must equal the trainer's ``logprob`` op (the log-softmax of the raw
logits) to float noise, whatever temperature, top-k or top-p sampled the tokens; only asked for do they appear.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import VOCAB, context, layout, role_spec
from hybridflow.backends.common.modeling import sequence_inputs

from hybridflow.logits import token_logprobs
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.engines import build_engine
from hybridflow.runtime.protocols import SamplingParams

SAMPLINGS = {
    "greedy": SamplingParams(max_new_tokens=10, greedy=True),
    "t0.7_top_k": SamplingParams(max_new_tokens=10, temperature=0.7, top_k=12, seed=3),
    "t1.5_top_p": SamplingParams(max_new_tokens=10, temperature=1.5, top_p=0.9, seed=5),
    "t1": SamplingParams(max_new_tokens=10, seed=7),
}


def _engine(rollout: str) -> Any:
    engine = build_engine(role_spec(rollout=rollout), layout(dp=1), context())
    with torch.no_grad():  # sharper logits than a random init's near-uniform ones, so temperature matters
        engine.model.model.norm.weight.mul_(4.0)
    return engine


def _prompts(rows: int = 6) -> Batch:
    """Left-padded prompts of different lengths (positions must match the trainer's full forward)."""
    gen = torch.Generator().manual_seed(11)
    prompts = torch.randint(4, VOCAB, (rows, 7), generator=gen)
    mask = torch.ones_like(prompts)
    for row in range(rows):
        mask[row, :row % 4] = 0
    return Batch({"prompts": prompts.masked_fill(mask == 0, 0), "prompt_mask": mask})


@pytest.fixture(scope="module", params=["native", "hf_generate"])
def engine(request: pytest.FixtureRequest) -> Any:
    return _engine(request.param)


@pytest.mark.parametrize("name", sorted(SAMPLINGS))
def test_rollout_logprobs_equal_the_trainers_on_policy(engine: Any, name: str) -> None:
    sampling, prompts = SAMPLINGS[name], _prompts()
    out = engine.generate(prompts, SamplingParams(**{**vars(sampling), "logprobs": True}))
    responses, mask, behaviour = out["responses"], out["response_mask"], out["rollout_logprobs"]
    assert behaviour.dtype == torch.float32 and behaviour.shape == responses.shape
    assert bool((behaviour[mask == 0] == 0).all()) and bool((behaviour[mask == 1] <= 0).all())
    rows = prompts.union(out.select(["responses", "response_mask"]))
    trainer = engine.log_probs(rows)["logprobs"]
    gap = float((behaviour - trainer)[mask == 1].abs().max())
    assert gap < 1e-5, f"{engine.spec.rollout} {name}: max |rollout - trainer| = {gap:.2e}"
    if not sampling.greedy and sampling.temperature != 1.0:
        # The definition is the raw logits', not the sampling distribution's: that one is far away here.
        input_ids, attention_mask, positions = sequence_inputs(rows)
        with torch.no_grad():
            logits = engine.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions).logits
        width = prompts["prompts"].shape[1]
        scaled = token_logprobs(logits[:, width - 1:-1] / sampling.temperature, responses)
        assert float((behaviour - scaled)[mask == 1].abs().max()) > 1e-2


@pytest.mark.parametrize("name", ["greedy", "t0.7_top_k"])
def test_logprobs_only_when_asked_and_sampling_unchanged(engine: Any, name: str) -> None:
    sampling, prompts = SAMPLINGS[name], _prompts()
    plain = engine.generate(prompts, sampling)
    asked = engine.generate(prompts, SamplingParams(**{**vars(sampling), "logprobs": True}))
    assert set(plain.keys()) == {"responses", "response_mask"}
    assert set(asked.keys()) == {"responses", "response_mask", "rollout_logprobs"}
    assert torch.equal(plain["responses"], asked["responses"])
    assert torch.equal(plain["response_mask"], asked["response_mask"])


@pytest.mark.parametrize("rollout", ["native", "hf_generate"])
def test_rows_that_end_early_have_zero_logprobs_after_their_eos(rollout: str) -> None:
    engine, prompts = _engine(rollout), _prompts()
    greedy = SamplingParams(max_new_tokens=10, greedy=True, logprobs=True)
    engine.model.config.eos_token_id = int(engine.generate(prompts, greedy)["responses"][0, 3])  # row 0 ends there
    out = engine.generate(prompts, greedy)
    mask, behaviour = out["response_mask"], out["rollout_logprobs"]
    assert int(mask[0].sum()) <= 4 and bool((mask == 0).any())
    assert bool((behaviour[mask == 0] == 0).all())
    trainer = engine.log_probs(prompts.union(out.select(["responses", "response_mask"])))["logprobs"]
    assert float((behaviour - trainer)[mask == 1].abs().max()) < 1e-5
