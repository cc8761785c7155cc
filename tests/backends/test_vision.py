"""A tiny Qwen2-VL built offline (issue 41) and the torch backend's passes over rows with images: the padded
log-probs equal the model's own forward on each sample alone, the packed ones (each sequence keeping its 3-D rope
positions) the padded ones, and an update trains through the vision tower alike in both layouts."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import context, layout, role_spec, run_ranks
from PIL import Image
from vision_rows import forward_alone, image_rows

from hybridflow.data.images import open_image
from hybridflow.graph import RoleKind
from hybridflow.models.vision import build_tiny_vlm, load_processor, save_vlm_dir, tiny_vlm_processor
from hybridflow.runtime.batch import Batch

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    processor = tiny_vlm_processor()
    return save_vlm_dir(build_tiny_vlm(processor.tokenizer, seed=0), processor, tmp_path_factory.mktemp("vlm"))


def test_the_tiny_vlm_builds_offline_runs_and_generates(vlm_dir: Path) -> None:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vlm_dir).eval()
    params = sum(p.numel() for p in model.parameters())
    assert 200_000 < params < 500_000, params
    assert len(model.model.visual.blocks) == 2
    processor = load_processor(vlm_dir)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[Image.new("RGB", (32, 16), (255, 0, 0))], return_tensors="pt")
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 8]]  # 4 px patches: 32 px wide is 8 of them
    with torch.no_grad():
        logits = model(**inputs).logits
        generated = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert logits.shape == (1, inputs["input_ids"].shape[1], model.config.text_config.vocab_size)
    assert generated.shape == (1, inputs["input_ids"].shape[1] + 6)
    # The image is read: another image changes the logits.
    blue = processor(text=[text], images=[Image.new("RGB", (32, 16), (0, 0, 255))], return_tensors="pt")
    with torch.no_grad():
        assert (model(**blue).logits - logits).abs().max() > 1e-3


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None,
                    reason="Qwen2-VL's video processor needs torchvision, left out of the CPU stack")
def test_auto_processor_loads_the_saved_processor(vlm_dir: Path) -> None:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(vlm_dir)
    assert processor.image_processor.patch_size == 4 and "<|image_pad|>" in processor.tokenizer.get_vocab()


@pytest.mark.parametrize("micro_batch", [1, 2])
def test_padded_logprobs_over_image_rows_equal_each_sample_alone(vlm_dir: Path, micro_batch: int) -> None:
    from hybridflow.backends.torch.engine import TorchRoleEngine
    from transformers import AutoModelForImageTextToText

    batch, processor, records = image_rows(vlm_dir)
    spec = dataclasses.replace(role_spec("ref", RoleKind.FROZEN_POLICY), model=str(vlm_dir))
    engine = TorchRoleEngine(spec, layout("ref", dp=1, sharding="NO_SHARD", padding=True,
                                          forward_micro_batch_size=micro_batch), context())
    out = engine.log_probs(batch, with_entropy=True)
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir).eval()
    assert int(batch["prompt_mask"][0].sum()) < batch["prompts"].shape[1]  # the first row is left-padded
    for row, record in enumerate(records):
        length = int(batch["response_mask"][row].sum())
        alone = forward_alone(model, processor, record, batch["responses"][row, :length])
        assert (out["logprobs"][row, :length] - alone).abs().max() < TOLERANCE
    # Controls: the same pass reads the images and their 3-D positions, so without them it differs.
    blank = Batch(batch.tensors, {**batch.non_tensors,
                                  "pixel_values": [0 * p for p in batch["pixel_values"]]})
    assert (engine.log_probs(blank)["logprobs"] - out["logprobs"]).abs().max() > 1e-3
    record, response = records[1], batch["responses"][1, :4]
    inputs = processor(text=[record["prompt"]], images=[open_image(r) for r in record["images"]], return_tensors="pt")
    ids = torch.cat([inputs["input_ids"], response[None]], dim=1)
    with torch.no_grad():  # 1-D positions instead of the model's rope index
        flat = model(input_ids=ids, pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                     position_ids=torch.arange(ids.shape[1])[None]).logits[0, inputs["input_ids"].shape[1] - 1:-1]
    flat_logprobs = torch.log_softmax(flat, dim=-1).gather(-1, response[:, None])[:, 0]
    assert (flat_logprobs - out["logprobs"][1, :4]).abs().max() > 1e-4


def test_packed_logprobs_keep_each_sequences_rope_positions(vlm_dir: Path) -> None:
    from hybridflow.backends.torch.engine import TorchRoleEngine

    batch, _, _ = image_rows(vlm_dir)
    spec = dataclasses.replace(role_spec("ref", RoleKind.FROZEN_POLICY), model=str(vlm_dir))
    packed, padded = (TorchRoleEngine(spec, layout("ref", dp=1, sharding="NO_SHARD", padding=padding,
                                                   forward_micro_batch_size=2), context()).log_probs(batch)
                      for padding in (False, True))
    mask = batch["response_mask"].bool()
    assert (packed["logprobs"] - padded["logprobs"])[mask].abs().max() < TOLERANCE
    assert not packed["logprobs"][~mask].any()  # the packed layout writes only real response tokens


def _update_grads(vlm_dir: Path, batch: Batch, micro_batch: int, padding: bool = True) -> dict[str, torch.Tensor]:
    from hybridflow.backends.torch.engine import TorchRoleEngine

    from hybridflow.registry import LOSSES

    spec = dataclasses.replace(role_spec("actor", RoleKind.POLICY), model=str(vlm_dir))
    engine = TorchRoleEngine(spec, layout("actor", dp=1, sharding="NO_SHARD", padding=padding,
                                          micro_batch_size=micro_batch), context())
    grads: dict[str, torch.Tensor] = {}
    step = engine.optimizer.step

    def record(*args: Any, **kwargs: Any) -> Any:
        grads.update({name: param.grad.detach().clone() for name, param in engine.model.named_parameters()})
        return step(*args, **kwargs)

    engine.optimizer.step = record
    engine.train_step(batch, loss=LOSSES.get("ppo_policy"), options={})
    return grads


def test_a_padded_update_over_image_rows_trains_through_the_vision_tower(vlm_dir: Path) -> None:
    batch, _, _ = image_rows(vlm_dir)
    old = -4.6 + 0.1 * torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(1))
    batch = batch.union(Batch({"old_logprobs": old, "advantages": torch.tensor([[1.0] * 6, [-1.0] * 6])}))
    whole, per_row = (_update_grads(vlm_dir, batch, micro_batch) for micro_batch in (2, 1))
    tower = [name for name in whole if ".visual." in name]
    assert tower and all(float(whole[name].abs().max()) > 0 for name in tower if name.endswith("weight"))
    # Micro batches of one row (each with its own images) accumulate to the whole batch's gradient, and the packed
    # layout's (the rows' sequences in one row, each with its own rope positions) is the padded one's.
    packed = _update_grads(vlm_dir, batch, 2, padding=False)
    for other in (per_row, packed):
        assert max(float((whole[name] - other[name]).abs().max()) for name in whole) < TOLERANCE


def test_image_rows_survive_the_runtimes_moves(vlm_dir: Path) -> None:
    """n samples per prompt (repeat_interleave), the Ray wire format, padding to a multiple and concatenation keep
    each row's images with its tokens: the pass over the moved rows equals the pass over the originals."""
    from hybridflow.backends.torch.engine import TorchRoleEngine

    batch, _, _ = image_rows(vlm_dir)
    spec = dataclasses.replace(role_spec("ref", RoleKind.FROZEN_POLICY), model=str(vlm_dir))
    engine = TorchRoleEngine(spec, layout("ref", dp=1, sharding="NO_SHARD", padding=False,
                                          forward_micro_batch_size=3), context())
    moved = Batch.from_wire(batch.repeat_interleave(2).to_wire())
    moved = Batch.concat([moved.slice(0, 3), moved.slice(3, 4)]).pad_to_multiple(5)[0]
    assert len(moved) == 5 and moved["image_grid_thw"][2].shape == (2, 3)
    expected = engine.log_probs(batch)["logprobs"]
    got = engine.log_probs(moved)["logprobs"]
    assert (got[:4] - expected.repeat_interleave(2, dim=0)).abs().max() < TOLERANCE


@pytest.mark.slow  # two spawned gloo ranks: ~40 s on 2 shared cores
def test_fsdp_logprobs_over_image_rows_equal_the_torch_engines(vlm_dir: Path) -> None:
    """FULL_SHARD over two ranks, a row with its images on each: padded and packed log-probs equal the torch
    engine's over the whole batch (both rows have images, so both ranks run the vision tower's all-gathers)."""
    import vision_ranks
    from hybridflow.backends.torch.engine import TorchRoleEngine

    batch, _, _ = image_rows(vlm_dir)
    spec = dataclasses.replace(role_spec("ref", RoleKind.FROZEN_POLICY), model=str(vlm_dir))
    expected = TorchRoleEngine(spec, layout("ref", dp=1, sharding="NO_SHARD", padding=True),
                               context()).log_probs(batch)["logprobs"]
    ranks = run_ranks(vision_ranks.fsdp_logprobs, str(vlm_dir), batch.to_wire())
    mask = batch["response_mask"].bool()
    for name in ("padded", "packed"):
        got = torch.cat([rank[name] for rank in ranks])
        assert (got - expected)[mask].abs().max() < TOLERANCE, name
