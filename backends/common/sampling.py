"""A lean KV-cached sampling loop: HF ``generate`` semantics for the options the runtime uses.

On tiny models the per-token bookkeeping of ``generate`` (logits processors, stopping criteria,
cache bookkeeping) costs more than the forward pass itself; this loop keeps only what the
rollout needs: temperature, top-k, top-p, greedy, EOS stop, and (when asked) each sampled token's
log-prob under the trainer's definition.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridflow.logits import token_logprobs


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits outside the top-k and the top-p nucleus (as HF's warpers do). (B, V) -> (B, V)."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return logits


def sample(model: Any, prompts: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens: int, greedy: bool,
           temperature: float, top_p: float, top_k: int, seed: int, eos: int, pad: int,
           logprobs: bool = False, row_seeds: Sequence[int] | None = None,
           prefill: Mapping[str, Any] | None = None,
           suppress: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sampled continuations (B, <= max_new_tokens), ``pad`` after each row's EOS; stops when all ended.

    With ``logprobs`` also each sampled token's log-prob (B, <= max_new_tokens), float32: the log-softmax of
    the raw logits (no temperature, top-k or top-p), :func:`hybridflow.logits.token_logprobs` as the
    trainer's ``logprob`` op computes it; else None.

    ``row_seeds`` gives each row a generator of its own (``seed`` is then unused): a row samples the same
    whichever rows share its batch (agent turns are batched by arrival, not by row).

    Rows that ended leave the decoding batch (:class:`_Decoding`), so a long-tail step decodes about its real
    tokens, not every row to the longest one's length.

    ``prefill`` holds extra inputs of the prompt's forward (a vision-language model's ``pixel_values``,
    ``image_grid_thw`` and 3-D rope ``position_ids`` (3, B, P): :func:`~.vision.padded_inputs`). With 3-D
    positions each decode step takes, on all three axes, one past the row's largest prompt position, then one
    more per step: what Qwen2-VL's own ``generate`` computes (its ``rope_deltas``). ``suppress`` lists token ids
    never sampled (HF's ``suppress_tokens``: a VLM's image placeholders, which a response must not hold); the
    log-probs stay those of the raw logits.
    """
    generator = torch.Generator(device=prompts.device).manual_seed(seed)
    row_generators = None if row_seeds is None else [
        torch.Generator(device=prompts.device).manual_seed(int(row_seed)) for row_seed in row_seeds]
    mask = prompt_mask.long()
    inputs = dict(prefill or {})
    positions = inputs.pop("position_ids", None)
    if positions is None:
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)  # (B, P)
    out = model(input_ids=prompts, attention_mask=mask, position_ids=positions, use_cache=True, **inputs)
    # the next position: (B, 1), or (3, B, 1) past each row's largest 3-D prompt position (0 on padding)
    following = positions.amax(dim=-1, keepdim=True) + 1
    state = _Decoding(past=out.past_key_values, mask=mask, position=following, generators=row_generators,
                      rows=torch.arange(len(prompts), device=prompts.device))
    logits = out.logits[:, -1]
    tokens, chosen = [], []
    banned = torch.tensor(list(suppress), dtype=torch.long, device=prompts.device)
    for _ in range(max_new_tokens):
        choosing = logits.index_fill(-1, banned, float("-inf")) if len(banned) else logits
        if greedy:
            token = choosing.argmax(dim=-1)
        else:
            probs = torch.softmax(_filter(choosing.float() / temperature, top_k, top_p), dim=-1)
            if state.generators is None:
                token = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            else:
                token = torch.cat([torch.multinomial(probs[i:i + 1], 1, generator=row_generator)[0]
                                   for i, row_generator in enumerate(state.generators)])
        token = token.masked_fill(state.finished, pad)
        tokens.append(state.full(token, pad))
        if logprobs:
            chosen.append(state.full(token_logprobs(logits[:, None], token[:, None])[:, 0].float(), 0.0))  # (B,)
        state.finished |= token == eos
        if bool(state.finished.all()) or len(tokens) == max_new_tokens:
            break
        token = state.drop_finished(token)
        state.mask = torch.cat([state.mask, torch.ones_like(state.mask[:, :1])], dim=1)
        out = model(input_ids=token[:, None], attention_mask=state.mask, position_ids=state.position,
                    past_key_values=state.past, use_cache=True)
        state.past, logits, state.position = out.past_key_values, out.logits[:, -1], state.position + 1
    return torch.stack(tokens, dim=1), torch.stack(chosen, dim=1) if logprobs else None


@dataclass
class _Decoding:
    """The rows still in the decoding batch: their KV cache, attention mask, next positions, own generators,
    indices among the prompts (``rows``) and which of them ended (``finished``; they leave at the next
    :meth:`drop_finished` that finds enough of them)."""

    past: Any
    mask: torch.Tensor
    position: torch.Tensor  # (B, 1), or (3, B, 1) for 3-D rope positions
    generators: list[torch.Generator] | None
    rows: torch.Tensor
    finished: torch.Tensor = field(init=False)
    total: int = field(init=False)

    def __post_init__(self) -> None:
        self.total = len(self.rows)
        self.finished = torch.zeros(len(self.rows), dtype=torch.bool, device=self.rows.device)

    def full(self, values: torch.Tensor, fill: float) -> torch.Tensor:
        """(rows still decoding,) -> (B,): ``fill`` for the rows that left."""
        if len(self.rows) == self.total:
            return values
        return values.new_full((self.total,), fill).index_put((self.rows,), values)

    def drop_finished(self, token: torch.Tensor) -> torch.Tensor:
        """Take the ended rows out of the batch once they are an eighth of it (each copy of the cache costs
        about one decode step); a cache that cannot select rows keeps them (they decode padding)."""
        ended = int(self.finished.sum())
        if ended * 8 < len(self.rows) or not hasattr(self.past, "batch_select_indices"):
            return token
        keep = (~self.finished).nonzero().squeeze(1)
        self.past.batch_select_indices(keep)
        self.mask, self.rows = self.mask[keep], self.rows[keep]
        self.position = self.position.index_select(-2, keep)  # rows are the second-last axis of (B, 1), (3, B, 1)
        if self.generators is not None:
            self.generators = [self.generators[int(i)] for i in keep]
        self.finished = self.finished[keep]
        return token[keep]
