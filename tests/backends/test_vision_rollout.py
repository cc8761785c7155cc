"""The native rollout generates from image prompts: the tokens of Qwen2-VL's own ``generate``, 3-D rope positions
continued through decoding, and rollout log-probs that the log-prob pass reproduces (docs/vision.md)."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import context, layout, role_spec
from hybridflow.backends.common.vision import placeholder_ids
from PIL import Image

from hybridflow.data.images import ImageRef, open_image, vision_messages
from hybridflow.data.prompts import prepare_records
from hybridflow.data.vision_prompts import encode_vision_prompts
from hybridflow.graph import RoleKind
from hybridflow.models.vision import build_tiny_vlm, load_processor, save_vlm_dir, tiny_vlm_processor
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.specs import SamplingParams

NEW_TOKENS = 8


def _png(size: tuple[int, int], colour: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    processor = tiny_vlm_processor()
    model = build_tiny_vlm(processor.tokenizer, seed=1)
    # Its default init greedily repeats one token whatever the image; wider weights make each step's token vary.
    torch.manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim > 1:
                param.normal_(0.0, 0.5)
    return save_vlm_dir(model, processor, tmp_path_factory.mktemp("vlm"))


def _prompts(vlm_dir: Path) -> tuple[Batch, Any, list[dict[str, Any]]]:
    """Three prompts: one image, two images (a longer row), and one image of another size."""
    processor = load_processor(vlm_dir)
    refs = [ImageRef(_png(size, colour), f"r{row}", "images", index) for row, index, size, colour in (
        (0, 0, (32, 16), (255, 0, 0)), (1, 0, (24, 24), (0, 0, 255)), (1, 1, (8, 40), (0, 255, 0)),
        (2, 0, (16, 16), (250, 250, 0)))]
    records = [{"prompt": vision_messages("<image> which colour?", 1, where="r0"), "images": [refs[0]]},
               {"prompt": vision_messages("<image> or <image>, same?", 2, where="r1"), "images": refs[1:3]},
               {"prompt": vision_messages("<image> name it", 1, where="r2"), "images": [refs[3]]}]
    for record in records:
        record["ground_truth"] = "x"
    prepared = prepare_records(records, processor.tokenizer, processor=processor).records
    return encode_vision_prompts(prepared, processor), processor, prepared


def _engine(vlm_dir: Path, rollout: str = "native") -> Any:
    from hybridflow.backends.torch.engine import TorchRoleEngine

    spec = dataclasses.replace(role_spec("actor", RoleKind.POLICY, rollout=rollout), model=str(vlm_dir))
    return TorchRoleEngine(spec, layout("actor", dp=1, sharding="NO_SHARD", padding=True,
                                        forward_micro_batch_size=3), context())


def _own_generate(model: Any, processor: Any, record: dict[str, Any], eos: int) -> list[int]:
    """Qwen2-VL's own greedy ``generate`` on the sample alone (no padding), cut after its first EOS."""
    inputs = processor(text=[record["prompt"]], images=[open_image(r) for r in record["images"]],
                       return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos,
                             suppress_tokens=list(placeholder_ids(model)),
                             pad_token_id=model.config.text_config.pad_token_id)
    tokens = out[0, inputs["input_ids"].shape[1]:].tolist()
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def _rows(out: Batch) -> list[list[int]]:
    return [row[mask.bool()].tolist() for row, mask in zip(out["responses"], out["response_mask"], strict=True)]


def test_native_greedy_rollout_from_images_is_the_models_own_generate(vlm_dir: Path) -> None:
    from transformers import AutoModelForImageTextToText

    batch, processor, records = _prompts(vlm_dir)
    assert int(batch["prompt_mask"][0].sum()) < batch["prompts"].shape[1]  # left padding shifts the rows
    engine = _engine(vlm_dir)
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir).eval()
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, greedy=True)
    eos = engine.model.config.eos_token_id
    native = _rows(engine.generate(batch, greedy))
    assert native == [_own_generate(model, processor, record, eos) for record in records]
    assert _rows(_engine(vlm_dir, "hf_generate").generate(batch, greedy)) == native
    # The images steer the tokens: the same prompts with blank images decode otherwise.
    blank = Batch(batch.tensors, {**batch.non_tensors, "pixel_values": [0 * p for p in batch["pixel_values"]]})
    assert _rows(engine.generate(blank, greedy)) != native

    # A row that ends early leaves the decoding batch; the others keep their 3-D positions (the compaction path).
    stop = native[0][2]
    engine.model.config.eos_token_id = stop
    early = _rows(engine.generate(batch, greedy))
    assert len(early[0]) == 3
    assert early == [_own_generate(model, processor, record, stop) for record in records]


def test_sampled_rollout_logprobs_from_images_match_the_logprob_pass(vlm_dir: Path) -> None:
    batch, _, _ = _prompts(vlm_dir)
    engine = _engine(vlm_dir)
    out = engine.generate(batch, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, logprobs=True, seed=3))
    rows = batch.union(Batch({"responses": out["responses"], "response_mask": out["response_mask"]}))
    mask = out["response_mask"].bool()
    assert not torch.isin(out["responses"], torch.tensor(placeholder_ids(engine.model)))[mask].any()
    passed = engine.log_probs(rows)["logprobs"]
    assert (out["rollout_logprobs"] - passed)[mask].abs().max() < 1e-4
