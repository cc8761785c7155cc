"""Packed sequences (issue 22, item 1): forward outputs and gradients equal the padded rows' to 1e-5, on the torch
engine and on FSDP / DeepSpeed over two gloo ranks; ``RoleLayout.padding`` keeps the padded path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import run_ranks
from hybridflow.backends.common import packing
from packing_ranks import PAD, ragged_batch, torch_gaps

from hybridflow.planner import Plan, RoleLayout, colocated_plan

TOLERANCE = 1e-5


def _assert_equal(gaps: dict[str, float]) -> None:
    for name in ("logprobs", "entropy", "values"):
        assert gaps[name] < TOLERANCE, (name, gaps)
    assert gaps["scores"] < TOLERANCE * max(1.0, gaps["scores_scale"]), gaps
    for name, gap in gaps.items():
        if name.endswith("_grads") or name.endswith("_grad_norm"):
            assert gap < TOLERANCE, (name, gaps)


def test_pack_restarts_positions_and_keeps_only_real_tokens() -> None:
    batch = ragged_batch()
    rows = packing.pack(batch, pad_id=PAD)
    lengths = batch["prompt_mask"].sum(1) + batch["response_mask"].sum(1)
    assert rows.input_ids.shape == (1, int(lengths.sum()))
    assert not (rows.input_ids == PAD).any()
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    assert (rows.position_ids[0, starts] == 0).all()
    expected = torch.cat([torch.arange(int(n)) for n in lengths])
    assert torch.equal(rows.position_ids[0], expected)
    # Every real response token is emitted by its predecessor, in its own sequence; the masked row has none.
    assert len(rows.rows) == int(batch["response_mask"].sum())
    assert 3 not in rows.rows.tolist()
    assert torch.equal(rows.input_ids[0, rows.emit + 1], batch["responses"][rows.rows, rows.cols])
    assert torch.equal(rows.last, lengths.cumsum(0) - 1)


def test_pack_of_padding_rows_only_runs_one_pad_token() -> None:
    batch = ragged_batch().slice(0, 2)
    empty = type(batch)({**batch.tensors, "prompt_mask": torch.zeros_like(batch["prompt_mask"]),
                         "response_mask": torch.zeros_like(batch["response_mask"])})
    rows = packing.pack(empty, pad_id=PAD)
    assert rows.input_ids.tolist() == [[PAD]] and rows.position_ids.tolist() == [[0]]
    assert rows.scatter(torch.zeros(0)).shape == (2, batch["responses"].shape[1])


def test_an_attention_that_would_cross_sequences_is_refused() -> None:
    from hybridflow.backends.common import modeling

    from hybridflow.graph import RoleKind

    model = modeling.load_model(RoleKind.FROZEN_POLICY, "tiny-qwen2")
    model.config._attn_implementation_internal = "paged|sdpa"  # masks nothing by position ids
    with pytest.raises(ValueError, match="padding=true"):
        modeling.policy_outputs(model, ragged_batch(), with_entropy=False)
    assert modeling.policy_outputs(model, ragged_batch(), with_entropy=False, packed=False)["logprobs"].shape == (8, 5)


@pytest.mark.parametrize("model", ["tiny-qwen2", "tiny-llama"])
def test_torch_engine_packed_equals_padded(model: str) -> None:
    gaps = torch_gaps(model)
    _assert_equal(gaps)
    assert gaps["logprobs_outside_mask"] == 0 and gaps["entropy_outside_mask"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp", "deepspeed"])
def test_sharded_engines_packed_equal_padded(backend: str) -> None:
    for gaps in run_ranks(__import__("packing_ranks").sharded_gaps, backend):
        _assert_equal(gaps)


def test_layout_padding_round_trips_and_old_plans_read_as_packed() -> None:
    plan = colocated_plan("grpo", ["actor"])
    padded = type(plan)(**{**plan.__dict__, "groups": (type(plan.groups[0])(
        **{**plan.groups[0].__dict__, "layouts": (RoleLayout(role="actor", dp=1, padding=True),)}),)})
    assert Plan.from_json(padded.to_json()).layout("actor").padding is True
    old = plan.to_dict()
    del old["groups"][0]["layouts"][0]["padding"]
    assert Plan.from_dict(old).layout("actor").padding is False


@pytest.mark.gpu
def test_flash_attention_varlen_packed_equals_padded() -> None:
    """GPU: flash-attention varlen (cu_seq_lens from the packed position ids) against padded sdpa rows, bf16."""
    from hybridflow.backends.common import modeling

    from hybridflow.graph import RoleKind

    pytest.importorskip("flash_attn", reason="flash-attention varlen needs the flash-attn package")
    batch = ragged_batch()
    batch = type(batch)({k: v.cuda() for k, v in batch.tensors.items()})
    model = modeling.load_model(RoleKind.FROZEN_POLICY, "tiny-qwen2", dtype="bf16").cuda()
    padded = modeling.policy_outputs(model, batch, with_entropy=False, packed=False)["logprobs"]
    model.set_attn_implementation("flash_attention_2")
    packed = modeling.policy_outputs(model, batch, with_entropy=False, packed=True)["logprobs"]
    assert float(((packed - padded).abs() * batch["response_mask"]).max()) < 5e-2  # bf16 kernels differ


def test_packed_passes_attend_sequence_by_sequence_without_a_mask(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    """The backends' models run :mod:`varlen`: one causal sdpa call per packed sequence, no N² mask, the same
    log-probs and gradients as sdpa over the dense block-diagonal mask; an exported config does not name it."""
    from hybridflow.backends.common import modeling, varlen

    from hybridflow.graph import RoleKind

    model = modeling.load_model(RoleKind.FROZEN_POLICY, "tiny-qwen2")
    assert model.config._attn_implementation == varlen.NAME
    batch = ragged_batch()
    lengths = (batch["prompt_mask"].sum(1) + batch["response_mask"].sum(1)).tolist()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls: list[tuple[int, int, bool]] = []

    def recording(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: object = None,
                  **kwargs: object) -> torch.Tensor:
        calls.append((query.shape[2], key.shape[2], attn_mask is None))
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    ours = modeling.policy_outputs(model, batch, with_entropy=False)["logprobs"]
    (ours * batch["response_mask"]).sum().backward()
    ours_grads = [p.grad.clone() for p in model.parameters()]
    layers = model.config.num_hidden_layers
    assert sorted(q for q, _, _ in calls) == sorted([n for n in lengths if n] * layers)
    assert all(q == k and unmasked for q, k, unmasked in calls)

    model.zero_grad()
    model.set_attn_implementation("sdpa")  # transformers' dense block-diagonal mask over the whole row
    calls.clear()
    dense = modeling.policy_outputs(model, batch, with_entropy=False)["logprobs"]
    (dense * batch["response_mask"]).sum().backward()
    assert {q for q, _, _ in calls} == {sum(lengths)}
    assert (ours - dense).abs().max() < TOLERANCE
    for mine, theirs in zip(ours_grads, (p.grad for p in model.parameters()), strict=True):
        assert (mine - theirs).abs().max() < TOLERANCE

    model.set_attn_implementation(varlen.NAME)
    model.save_pretrained(str(tmp_path))
    assert varlen.NAME not in (tmp_path / "config.json").read_text()


def test_packed_attention_backward_splits_the_row_once() -> None:
    """The per-sequence pieces come from one split of q, k and v, whose backward is one concatenation; a slice per
    sequence would write each piece's gradient into a zeroed copy of the whole row (sequences x N traffic)."""
    from hybridflow.backends.common import varlen

    lengths = [5, 3, 7, 1]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    query, key, value = (torch.randn(1, 2, sum(lengths), 4, requires_grad=True) for _ in range(3))
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = 1, True, True  # type: ignore[assignment]
    out, _ = varlen.attention(module, query, key, value, None, position_ids=position_ids, dropout=0.0,
                              scaling=0.5)
    seen: list[str] = []
    todo, done = [out.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in done:
            continue
        done.add(node)
        seen.append(type(node).__name__)
        todo.extend(parent for parent, _ in node.next_functions)
    assert not [name for name in seen if name.startswith("SliceBackward")]
    assert sum(name.startswith("SplitWithSizesBackward") for name in seen) == 3
    out.sum().backward()
    assert query.grad is not None and query.grad.shape == query.shape


def test_sliding_window_models_keep_sdpa() -> None:
    from hybridflow.backends.common import varlen
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=4,
                         max_window_layers=0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    assert "sliding_attention" in model.config.layer_types
    assert not varlen.enable(model) and model.config._attn_implementation == "sdpa"


def test_cpu_half_precision_packed_attention_goes_backward_in_fp32() -> None:
    """A bf16 packed row on the CPU: forward per sequence in bf16, backward by the fp32 kernel from the saved
    log-sum-exp (the bf16 backward kernel is the slow one); values and gradients match an fp64 reference to bf16
    rounding, with grouped-query heads and sequences of one token."""
    from hybridflow.backends.common import varlen

    lengths, heads, kv_heads, dim = [5, 17, 3, 40, 1, 29], 4, 2, 16
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    generator = torch.Generator().manual_seed(0)
    exact = [torch.randn(1, h, sum(lengths), dim, generator=generator, dtype=torch.float64)
             for h in (heads, kv_heads, kv_heads)]
    upstream = torch.randn(1, sum(lengths), heads, dim, generator=generator, dtype=torch.float64)
    half = [tensor.to(torch.bfloat16).requires_grad_() for tensor in exact]
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = 2, True, True  # type: ignore[assignment]
    out, _ = varlen.attention(module, *half, None, position_ids=position_ids, dropout=0.0, scaling=0.25)
    assert type(out.grad_fn).__name__ == "_HalfForwardFloatBackwardBackward"
    (out * upstream.to(torch.bfloat16)).sum().backward()

    gold = [tensor.clone().requires_grad_() for tensor in exact]
    pieces = [torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
              for q, k, v in zip(*(tensor.split(lengths, dim=2) for tensor in gold), strict=True)]
    reference = torch.cat(pieces, dim=2).transpose(1, 2)
    (reference * upstream).sum().backward()
    for mine, theirs in [(out, reference), *((h.grad, g.grad) for h, g in zip(half, gold, strict=True))]:
        assert mine is not None and theirs is not None
        assert float((mine.double() - theirs).abs().max() / theirs.abs().max()) < 1e-2

    fp32 = [tensor.float().requires_grad_() for tensor in exact]  # fp32 keeps transformers' sdpa per sequence
    out, _ = varlen.attention(module, *fp32, None, position_ids=position_ids, dropout=0.0, scaling=0.25)
    assert type(out.grad_fn).__name__ != "_HalfForwardFloatBackwardBackward"
