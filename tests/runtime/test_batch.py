"""The batch container: row operations keep fields aligned; the numpy wire format round-trips."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.runtime import Batch


def _batch(rows: int = 6) -> Batch:
    return Batch({"tokens": torch.arange(rows * 3).reshape(rows, 3), "scores": torch.arange(rows).float()},
                 {"truth": [f"t{i}" for i in range(rows)]})


def test_rows_must_agree_and_missing_fields_are_named() -> None:
    with pytest.raises(ValueError, match="disagree"):
        Batch({"a": torch.zeros(3), "b": torch.zeros(4)})
    with pytest.raises(KeyError, match=r"nope.*fields"):
        _batch().select(["nope"])


def test_chunk_concat_round_trip_and_uneven_chunk_refused() -> None:
    batch = _batch(6)
    again = Batch.concat(batch.chunk(3))
    assert torch.equal(again["tokens"], batch["tokens"]) and list(again["truth"]) == list(batch["truth"])
    with pytest.raises(ValueError, match="pad_to_multiple"):
        batch.chunk(4)
    assert [len(b) for b in batch.split(4)] == [4, 2]


def test_pad_to_multiple_repeats_last_row() -> None:
    padded, pad = _batch(5).pad_to_multiple(4)
    assert pad == 3 and len(padded) == 8
    assert torch.equal(padded["tokens"][-1], padded["tokens"][4]) and padded["truth"][-1] == "t4"


def test_repeat_interleave_keeps_samples_of_a_prompt_adjacent() -> None:
    repeated = _batch(2).repeat_interleave(3)
    assert repeated["scores"].tolist() == [0, 0, 0, 1, 1, 1]
    assert list(repeated["truth"]) == ["t0"] * 3 + ["t1"] * 3


def test_concat_right_pads_token_fields_of_different_widths() -> None:
    a = Batch({"responses": torch.ones(2, 3, dtype=torch.long)})
    b = Batch({"responses": torch.ones(1, 5, dtype=torch.long)})
    out = Batch.concat([a, b])["responses"]
    assert out.shape == (3, 5) and out[0].tolist() == [1, 1, 1, 0, 0]


def test_union_select_rename() -> None:
    batch = _batch(4)
    extra = Batch({"adv": torch.ones(4)})
    joined = batch.union(extra)
    assert set(joined.keys()) == {"tokens", "scores", "truth", "adv"}
    assert joined.select(["adv"]).rename({"adv": "advantages"}).keys() == ["advantages"]
    with pytest.raises(ValueError, match="differs"):
        batch.union(Batch({"scores": torch.zeros(4)}))


def test_wire_format_is_numpy_and_round_trips_dtypes() -> None:
    batch = Batch({"bf16": torch.randn(4, 2).to(torch.bfloat16), "ids": torch.arange(4)}, {"truth": list("abcd")})
    wire = batch.to_wire()
    assert all(isinstance(array, np.ndarray) for _, array in wire.values())
    back = Batch.from_wire(wire)
    assert back["bf16"].dtype == torch.bfloat16 and torch.equal(back["bf16"], batch["bf16"])
    assert torch.equal(back["ids"], batch["ids"]) and list(back["truth"]) == list("abcd")


def test_char_tokenizer_round_trips_through_save_and_load(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from hybridflow.data import char_tokenizer, load_tokenizer

    tokenizer = char_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    text = "rev ab c="
    assert loaded(text, add_special_tokens=False).input_ids == tokenizer(text, add_special_tokens=False).input_ids
    assert loaded.decode(tokenizer(text).input_ids) == text


def test_lean_sampler_matches_hf_generate_greedily() -> None:
    from hybridflow.backends.common import modeling

    from hybridflow.data import char_tokenizer, encode_prompts, task_examples
    from hybridflow.models import build_tiny_causal_lm

    tokenizer = char_tokenizer()
    model = build_tiny_causal_lm("tiny-qwen2", vocab_size=len(tokenizer)).eval()
    batch = encode_prompts(task_examples("reverse", 6), tokenizer)
    with torch.no_grad():
        outs = [modeling.generate(model, batch, max_new_tokens=8, greedy=True, temperature=1.0, top_p=1.0, top_k=0,
                                  seed=0, use_hf_generate=hf) for hf in (True, False)]
    assert torch.equal(outs[0]["responses"], outs[1]["responses"])
    assert torch.equal(outs[0]["response_mask"], outs[1]["response_mask"])
