"""Agent turns on a training backend's own model: token ids in, sampled token ids and log-probs out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from hybridflow.backends.common import sampling, vision

from hybridflow.agents.protocols import TurnRequest, TurnResult
from hybridflow.runtime.batch import left_padded
from hybridflow.runtime.protocols import SamplingParams


def sample_turns(model: Any, requests: Sequence[TurnRequest], params: SamplingParams, *, device: torch.device,
                 version: int = 0) -> list[TurnResult]:
    """One batch of turns: each request's context left-padded, sampled with its own seed, cut at its own budget.

    A row's tokens run up to and including its first EOS (``finished``), or stop at ``max_tokens`` without one.
    The log-probs are the trainer's (raw logits), whatever the temperature: ``rollout_logprobs`` semantics.
    """
    config = model.config
    eos, pad = config.eos_token_id, config.pad_token_id
    prompts, mask = left_padded([request.token_ids for request in requests], pad)
    tokens, logprobs = sampling.sample(
        model, prompts.to(device), mask.to(device), max_new_tokens=max(r.max_tokens for r in requests),
        greedy=params.greedy, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=0,
        eos=eos, pad=pad, logprobs=True, row_seeds=[request.seed for request in requests],
        suppress=vision.placeholder_ids(model))  # a VLM's turns carry no images, and never their placeholders
    assert logprobs is not None
    return [TurnResult.cut(tokens[row, :request.max_tokens].tolist(), logprobs[row, :request.max_tokens].tolist(),
                           eos=eos, version=version) for row, request in enumerate(requests)]
