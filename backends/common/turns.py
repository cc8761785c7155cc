"""Agent turns on a training backend's own model: token ids in, sampled token ids and log-probs out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from hybridflow.backends.common import sampling

from hybridflow.agents.protocols import TurnRequest, TurnResult
from hybridflow.runtime.protocols import SamplingParams


def sample_turns(model: Any, requests: Sequence[TurnRequest], params: SamplingParams, *, device: torch.device,
                 version: int = 0) -> list[TurnResult]:
    """One batch of turns: each request's context left-padded, sampled with its own seed, cut at its own budget.

    A row's tokens run up to and including its first EOS (``finished``), or stop at ``max_tokens`` without one.
    The log-probs are the trainer's (raw logits), whatever the temperature: ``rollout_logprobs`` semantics.
    """
    config = model.config
    eos, pad = config.eos_token_id, config.pad_token_id
    width = max(len(request.token_ids) for request in requests)
    prompts = torch.full((len(requests), width), pad, dtype=torch.long)
    mask = torch.zeros((len(requests), width), dtype=torch.long)
    for row, request in enumerate(requests):
        prompts[row, width - len(request.token_ids):] = torch.tensor(request.token_ids, dtype=torch.long)
        mask[row, width - len(request.token_ids):] = 1
    tokens, logprobs = sampling.sample(
        model, prompts.to(device), mask.to(device), max_new_tokens=max(r.max_tokens for r in requests),
        greedy=params.greedy, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=0,
        eos=eos, pad=pad, logprobs=True, row_seeds=[request.seed for request in requests])
    assert logprobs is not None
    results = []
    for row, request in enumerate(requests):
        ids = tokens[row, :request.max_tokens].tolist()
        ends = ids.index(eos) + 1 if eos in ids else len(ids)
        results.append(TurnResult(token_ids=tuple(ids[:ends]), logprobs=tuple(logprobs[row, :ends].tolist()),
                                  finished=eos in ids, version=version))
    return results
