"""A trained vision-language policy exports with its processor (issue 41 item 6): ``hybridflow export`` of a torch
checkpoint of a tiny Qwen2-VL, fully trained or with LoRA adapters (merged), loads with transformers'
``AutoModelForImageTextToText`` and generates greedily from an image the tokens the trainer's model generates; the
processor's files load through the image processor class and the tokenizer (``AutoProcessor`` needs torchvision,
left out of this CPU stack)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from hybridflow.cli import main
from hybridflow.data.images import ImageRef, vision_messages
from hybridflow.data.prompts import prepare_records
from hybridflow.data.vision_prompts import encode_vision_prompts
from hybridflow.graph import RoleKind
from hybridflow.models.vision import (
    build_tiny_vlm,
    images_only_processor,
    load_processor,
    save_vlm_dir,
    tiny_vlm_processor,
)
from hybridflow.planner import RoleLayout, Sharding
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.protocols import AdapterSpec, OptimSpec, RoleSpec, WorkerContext
from hybridflow.runtime.worker import SoloCollective

PROCESSOR_FILES = ("preprocessor_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "processor_config.json")
MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "which colour?"}]}]


def _png(colour: tuple[int, int, int]) -> bytes:
    import io

    buffer = io.BytesIO()
    Image.new("RGB", (24, 16), colour).save(buffer, "PNG")
    return buffer.getvalue()


def _update_rows(processor: Any) -> Batch:
    records = [{"prompt": vision_messages("<image> which colour?", 1, where=f"r{i}"), "ground_truth": "x",
                "images": [ImageRef(_png(colour), f"r{i}", "images", 0)]}
               for i, colour in enumerate(((255, 0, 0), (0, 0, 255)))]
    prompts = encode_vision_prompts(prepare_records(records, processor.tokenizer, processor=processor).records,
                                    processor)
    responses = torch.randint(4, 90, (2, 6), generator=torch.Generator().manual_seed(0))
    return prompts.union(Batch({"responses": responses, "response_mask": torch.ones_like(responses),
                                "old_logprobs": torch.full((2, 6), -4.6),
                                "advantages": torch.tensor([[1.0] * 6, [-1.0] * 6])}))


def _trained_checkpoint(root: Path, lora: AdapterSpec | None) -> tuple[Any, Path, Path]:
    """(the trainer's engine after 3 updates, the base model directory, its torch checkpoint in a run folder)."""
    from hybridflow.backends.torch.engine import TorchRoleEngine

    from hybridflow.registry import LOSSES

    processor = tiny_vlm_processor()
    base = save_vlm_dir(build_tiny_vlm(processor.tokenizer, seed=0), processor, root / "base")
    spec = RoleSpec(name="actor", kind=RoleKind.POLICY, model=str(base), optim=OptimSpec(lr=1e-2), lora=lora)
    context = WorkerContext(group=0, rank=0, world_size=1, device="cpu", collective=SoloCollective())
    engine = TorchRoleEngine(spec, RoleLayout(role="actor", dp=1, sharding=Sharding.NO_SHARD, micro_batch_size=2,
                                              padding=True), context)
    rows = _update_rows(load_processor(base))
    for _ in range(3):
        engine.train_step(rows, loss=LOSSES.get("ppo_policy"), options={})
    run = root / "run"
    step = run / "checkpoints" / "step_000003"
    engine.save_checkpoint(str(step / "roles" / "actor"))
    (step / "trainer.json").write_text(json.dumps({"step": 3, "seed": 0, "formats": {"actor": "torch"}}))
    roles = {"actor": {"lora": dataclasses.asdict(lora)}} if lora is not None else {}
    (run / "config.json").write_text(json.dumps({"seed": 0, "model": {"path": str(base)}, "roles": roles}))
    return engine.model.eval(), base, step


def _image_inputs(model_dir: Path, colour: tuple[int, int, int] = (0, 160, 0)) -> dict[str, torch.Tensor]:
    processor = load_processor(model_dir)
    text = processor.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[Image.new("RGB", (32, 24), colour)], return_tensors="pt")
    return dict(inputs)


def _greedy(model: Any, inputs: dict[str, torch.Tensor]) -> list[int]:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=10, do_sample=False, min_new_tokens=10)
    tokens: list[int] = out[0, inputs["input_ids"].shape[1]:].tolist()
    return tokens


def _check_processor_files(out: Path, base: Path) -> None:
    """The processor's files are there and load through the image processor class and the tokenizer into a
    processor that encodes an image prompt as the base model's does."""
    from transformers import AutoImageProcessor, AutoTokenizer

    assert all((out / name).is_file() for name in PROCESSOR_FILES), sorted(p.name for p in out.iterdir())
    image_processor, tokenizer = AutoImageProcessor.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    template = (out / "chat_template.jinja").read_text()
    rebuilt = images_only_processor(image_processor, tokenizer, template)
    text = rebuilt.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    got = rebuilt(text=[text], images=[Image.new("RGB", (32, 24), (0, 160, 0))], return_tensors="pt")
    expected = _image_inputs(base)
    assert set(got) == set(expected)
    assert all(torch.equal(got[key], expected[key]) for key in expected)


@pytest.fixture(scope="module")
def full_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, Path]:
    root = tmp_path_factory.mktemp("vlm-export")
    model, base, step = _trained_checkpoint(root, lora=None)
    assert main(["export", str(step), str(root / "out")]) == 0
    return model, base, root / "out"


def test_an_exported_vlm_generates_from_an_image_as_the_trainer(full_export: tuple[Any, Path, Path]) -> None:
    from transformers import AutoModelForImageTextToText, Qwen2VLForConditionalGeneration

    trained, base, out = full_export
    exported = AutoModelForImageTextToText.from_pretrained(out).eval()
    assert isinstance(exported, Qwen2VLForConditionalGeneration)
    start = AutoModelForImageTextToText.from_pretrained(base).eval()
    moved = [name for name, tensor in start.state_dict().items()
             if not torch.equal(tensor, exported.state_dict()[name])]
    assert any(".visual." in name for name in moved) and any(".language_model." in name for name in moved)
    inputs = _image_inputs(out)
    assert _greedy(exported, inputs) == _greedy(trained, inputs)
    with torch.no_grad():  # the image is read: another image changes the logits
        other = exported(**_image_inputs(out, colour=(200, 0, 200))).logits
        assert (exported(**inputs).logits - other).abs().max() > 1e-4


def test_the_export_carries_the_processor_files(full_export: tuple[Any, Path, Path]) -> None:
    _, base, out = full_export
    _check_processor_files(out, base)


def test_a_lora_vlm_exports_its_adapter_and_the_merged_model(tmp_path: Path) -> None:
    pytest.importorskip("peft", reason="needs peft (the `lora` extra)")
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    trained, base, step = _trained_checkpoint(tmp_path, lora=AdapterSpec(rank=4, alpha=8.0))
    out = tmp_path / "out"
    assert main(["export", str(step), str(out), "--merged"]) == 0
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    assert adapter_config["exclude_modules"]  # the vision tower takes no adapters, as in the trainer
    merged = AutoModelForImageTextToText.from_pretrained(out / "merged").eval()
    inputs = _image_inputs(out / "merged")
    expected = _greedy(trained, inputs)
    assert _greedy(merged, inputs) == expected
    adapted = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(base), out).eval()
    assert not any(".visual." in name for name, _ in adapted.named_parameters() if ".lora_" in name)
    with torch.no_grad():
        assert (adapted(**inputs).logits - merged(**inputs).logits).abs().max() < 1e-4
    _check_processor_files(out / "merged", base)
