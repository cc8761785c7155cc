"""The native sampling loop takes ended rows out of its decoding batch (backends/common/sampling.py): the outputs
stay HF ``generate``'s (greedy) and each row's own (per-row generators), while the batch it decodes shrinks."""

from __future__ import annotations

from typing import Any

import torch
from harness import VOCAB
from hybridflow.backends.common import sampling

from hybridflow.models import build_tiny_causal_lm
from hybridflow.runtime.batch import Batch

NEVER = -1  # an end token no row samples


def _model() -> Any:
    model = build_tiny_causal_lm("tiny-qwen2", vocab_size=VOCAB, seed=0)
    with torch.no_grad():  # an untied head: greedy decoding of a tied random model repeats its input token
        model.lm_head.weight = torch.nn.Parameter(0.5 * torch.randn_like(model.lm_head.weight))
    return model.eval()


def _common_token(responses: torch.Tensor) -> int:
    """The token whose first occurrences in the rows fall at the most different steps: as the end token, rows
    end at different steps."""
    def spread(token: int) -> int:
        hits = responses == token
        return len({int(row.nonzero()[0]) for row in hits if row.any()})

    return max(range(int(responses.max()) + 1), key=spread)


def _prompts(rows: int = 12) -> Batch:
    gen = torch.Generator().manual_seed(5)
    prompts = torch.randint(4, VOCAB, (rows, 6), generator=gen)
    mask = torch.ones_like(prompts)
    for row in range(rows):
        mask[row, :row % 3] = 0
    return Batch({"prompts": prompts.masked_fill(mask == 0, 0), "prompt_mask": mask})


def _lengths(responses: torch.Tensor, eos: int) -> list[int]:
    is_eos = (responses == eos).long()
    return ((is_eos.cumsum(dim=1) - is_eos) == 0).sum(dim=1).tolist()


def test_ended_rows_leave_the_batch_and_greedy_output_is_hf_generates() -> None:
    model, rows = _model(), _prompts()
    sizes: list[int] = []
    hook = model.register_forward_pre_hook(lambda _m, _a, kw: sizes.append(kw["input_ids"].shape[0]),
                                           with_kwargs=True)
    options = {"max_new_tokens": 24, "greedy": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": 0,
               "pad": 0}
    eos = _common_token(sampling.sample(model, rows["prompts"], rows["prompt_mask"], eos=NEVER, **options)[0])
    sizes.clear()
    native, _ = sampling.sample(model, rows["prompts"], rows["prompt_mask"], eos=eos, **options)
    hook.remove()
    lengths = _lengths(native, eos)
    assert len(set(lengths)) > 2 and min(lengths) < 24  # rows end at different steps
    assert sizes[0] == 12 and min(sizes) < 12 and sizes == sorted(sizes, reverse=True)
    hf = model.generate(input_ids=rows["prompts"], attention_mask=rows["prompt_mask"], max_new_tokens=24,
                        do_sample=False, eos_token_id=eos, pad_token_id=0)[:, 6:]
    width = native.shape[1]
    hf = torch.nn.functional.pad(hf, (0, max(0, width - hf.shape[1])))[:, :width]
    assert torch.equal(native, hf.masked_fill(torch.arange(width)[None] >= torch.tensor(lengths)[:, None], 0))


def test_a_row_with_its_own_generator_samples_the_same_in_any_batch() -> None:
    model, rows = _model(), _prompts()
    options = {"max_new_tokens": 20, "greedy": False, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": 0,
               "pad": 0, "logprobs": True}
    seeds = list(range(100, 112))
    first, _ = sampling.sample(model, rows["prompts"], rows["prompt_mask"], row_seeds=seeds, eos=NEVER, **options)
    options["eos"] = _common_token(first)
    whole, whole_lp = sampling.sample(model, rows["prompts"], rows["prompt_mask"], row_seeds=seeds, **options)
    assert len(set(_lengths(whole, int(options["eos"])))) > 2
    for row in (0, 5, 11):
        alone, alone_lp = sampling.sample(model, rows["prompts"][row:row + 1], rows["prompt_mask"][row:row + 1],
                                          row_seeds=seeds[row:row + 1], **options)
        n = alone.shape[1]
        assert torch.equal(whole[row, :n], alone[0]) and bool((whole[row, n:] == 0).all())
        assert alone_lp is not None and whole_lp is not None
        assert torch.allclose(whole_lp[row, :n], alone_lp[0], atol=1e-5)
