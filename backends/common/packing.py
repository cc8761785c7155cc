"""Packed sequences: a micro batch's real tokens as one row, without padding (verl's ``use_remove_padding``).

:func:`pack` lays every row's prompt tokens (``prompt_mask`` 1) and then its response tokens
(``response_mask`` 1) end to end in one (1, N) row, with position ids restarting at 0 per sequence and no
attention mask. Transformers reads such position ids as packed sequences and keeps attention inside each
one: with ``attn_implementation="flash_attention_2"`` (GPU) it derives ``cu_seq_lens`` from them and calls
flash-attention varlen; models loaded through the backends otherwise run :mod:`.varlen` (``sdpa`` sequence by
sequence), and neither builds an N² mask. A model left on plain ``sdpa``/``eager`` gets a block-diagonal causal
mask, bool (1, 1, N, N), and attention over all N² pairs of the micro batch. The outputs are scattered back to
the response-aligned (B, T) layout, so everything downstream reads the same fields as on the padded path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from hybridflow.backends.common import varlen

from hybridflow.runtime.batch import Batch


@dataclass(frozen=True)
class PackedRows:
    """One micro batch packed into a row, and where its outputs go back.

    ``input_ids``/``position_ids`` (1, N). ``rows``/``cols`` (M,): the (row, response column) of every response
    token with a predecessor in its sequence; ``emit`` (M,): the packed index of that predecessor, whose
    output predicts (log-probs) or values the token. ``last`` (B,): the packed index of each row's last real
    token (0 for a row without any: its score is not read). ``shape``: (B, T) of the responses.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    emit: torch.Tensor
    last: torch.Tensor
    shape: tuple[int, int]

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """(M, ...) outputs of the response tokens -> (B, T, ...), 0 elsewhere (differentiable in ``values``)."""
        out = values.new_zeros((*self.shape, *values.shape[1:]))
        return out.index_put((self.rows, self.cols), values)


# Attention implementations that read packed position ids (transformers' masking_utils and flash-attention
# integration); any other would attend across the packed sequences.
PACKED_ATTENTION = frozenset({varlen.NAME, "sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3"})


def check_packable(config: Any) -> None:
    """Raise unless the model's attention keeps packed sequences apart."""
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if implementation not in PACKED_ATTENTION:
        raise ValueError(f"packed sequences need an attention implementation that reads packed position ids "
                         f"({sorted(PACKED_ATTENTION)}); this model runs {implementation!r}: set the role's "
                         "layout padding=true")


def pack(batch: Batch, *, pad_id: int) -> PackedRows:
    """The real tokens of ``batch`` (prompts, then responses, row by row) as one packed row.

    A micro batch without a single real token (padding rows only) packs one ``pad_id`` token that no output
    reads: every rank still runs its forward and backward, which sharded engines take in step.
    """
    prompts, responses = batch["prompts"], batch["responses"]
    ids = torch.cat([prompts, responses], dim=1)  # (B, P + T)
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1).bool()
    positions = mask.long().cumsum(dim=1) - 1  # real token i of a row sits at position i, as on the padded path
    flat = mask.flatten().nonzero().squeeze(1)  # row-major: each row's tokens together, in order
    packed_index = torch.full(mask.shape, -1, dtype=torch.long, device=ids.device)
    packed_index.view(-1)[flat] = torch.arange(flat.numel(), device=ids.device)
    prompt_len = prompts.shape[1]
    # A response token's output comes from the packed token before it, which must belong to its own sequence.
    emits = batch["response_mask"].bool() & (positions[:, prompt_len:] > 0)
    rows, cols = emits.nonzero(as_tuple=True)
    emit = packed_index[:, prompt_len:][rows, cols] - 1
    lengths = mask.sum(dim=1)
    last = (lengths.cumsum(dim=0) - 1).clamp(min=0)
    if flat.numel() == 0:
        input_ids = torch.full((1, 1), pad_id, dtype=ids.dtype, device=ids.device)
        position_ids = torch.zeros((1, 1), dtype=torch.long, device=ids.device)
    else:
        input_ids, position_ids = ids.flatten()[flat][None], positions.flatten()[flat][None]
    return PackedRows(input_ids=input_ids, position_ids=position_ids, rows=rows, cols=cols, emit=emit, last=last,
                      shape=(responses.shape[0], responses.shape[1]))
