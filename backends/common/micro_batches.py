"""How an engine cuts a pass into micro batches: by rows (``RoleLayout.micro_batch_size``) or by a token budget
(``RoleLayout.max_tokens_per_micro_batch``, verl's dynamic batch size)."""

from __future__ import annotations

from hybridflow.runtime.balancing import token_micro_batches
from hybridflow.runtime.batch import Batch


def row_tokens(batch: Batch, *, padding: bool) -> list[int]:
    """The tokens each row costs a pass: its real prompt and response tokens when packed, the whole
    (P + T) row when padded."""
    if padding:
        return [batch["prompts"].shape[1] + batch["responses"].shape[1]] * len(batch)
    return (batch["prompt_mask"].sum(dim=1) + batch["response_mask"].sum(dim=1)).tolist()


class MicroBatching:
    """The cut both the forward ops and the update loop use. Engines set ``padding`` (the layout's) and, when
    their ranks must run the same number of passes (sharded engines gather parameters per forward), override
    :meth:`most_over_ranks`."""

    padding: bool = False  # the layout's: passes over padded (B, P + T) rows instead of packed sequences

    def micro_batches(self, batch: Batch, *, rows: int, max_tokens: int) -> list[Batch]:
        """``batch`` in micro batches of ``rows`` rows, or, with ``max_tokens`` > 0, of consecutive rows of at most
        that many tokens (each at least one row), as many on every rank as on the rank that needs the most."""
        if not max_tokens:
            return batch.split(rows)
        tokens = row_tokens(batch, padding=self.padding)
        count = self.most_over_ranks(len(token_micro_batches(tokens, max_tokens)))
        return [batch.slice(cut.start, cut.stop) for cut in token_micro_batches(tokens, max_tokens, count=count)]

    def most_over_ranks(self, value: int) -> int:
        """The largest ``value`` of the ranks that must run in step; replicas run on their own."""
        return value

