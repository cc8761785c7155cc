"""Every role that reads a sample sees its images (issue 41): a vision-language critic and reward model (the VLM with
a one-wide head) read the rows' images in their passes and their update, as a teacher's log-probs do."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import context, layout, role_spec, run_ranks
from vision_rows import forward_alone, image_rows

from hybridflow.data.images import open_image
from hybridflow.graph import RoleKind
from hybridflow.models.vision import build_tiny_vlm, save_vlm_dir, tiny_vlm_processor
from hybridflow.runtime.batch import Batch

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    processor = tiny_vlm_processor()
    return save_vlm_dir(build_tiny_vlm(processor.tokenizer, seed=0), processor, tmp_path_factory.mktemp("vlm"))


def _engine(vlm_dir: Path, kind: RoleKind, *, padding: bool, name: str = "critic", **fields: Any) -> Any:
    from hybridflow.backends.torch.engine import TorchRoleEngine

    spec = dataclasses.replace(role_spec(name, kind), model=str(vlm_dir))
    return TorchRoleEngine(spec, layout(name, dp=1, sharding="NO_SHARD", padding=padding, **fields), context())


def _blank(batch: Batch) -> Batch:
    """The same rows with every image black (same sizes, same placeholders)."""
    return Batch(batch.tensors, {**batch.non_tensors, "pixel_values": [0 * p for p in batch["pixel_values"]]})


def _head_alone(model: Any, processor: Any, record: dict[str, Any], response: torch.Tensor
                ) -> tuple[torch.Tensor, int]:
    """The scalar head's outputs (P + T,) over one sample's prompt + response alone (the model's own forward), and
    the prompt's length P."""
    inputs = processor(text=[record["prompt"]], images=[open_image(r) for r in record["images"]], return_tensors="pt")
    types = torch.cat([inputs["mm_token_type_ids"], torch.zeros(1, len(response), dtype=torch.long)], dim=1)
    with torch.no_grad():
        return model(input_ids=torch.cat([inputs["input_ids"], response[None]], dim=1),
                     pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                     mm_token_type_ids=types).logits[0, :, 0], inputs["input_ids"].shape[1]


def test_a_vlm_critic_reads_the_images_in_its_values_and_update(vlm_dir: Path) -> None:
    batch, processor, records = image_rows(vlm_dir)
    padded, packed = (_engine(vlm_dir, RoleKind.VALUE, padding=padding) for padding in (True, False))
    assert padded.model.get_output_embeddings().out_features == 1  # a value head, untied from the embeddings
    assert padded.model.get_input_embeddings().weight.shape[0] > 1
    values = padded.values(batch)["values"]
    mask = batch["response_mask"].bool()
    assert (packed.values(batch)["values"] - values)[mask].abs().max() < TOLERANCE
    for row, record in enumerate(records):  # the head at the position emitting each response token
        length = int(mask[row].sum())
        alone, prompt_len = _head_alone(padded.model, processor, record, batch["responses"][row, :length])
        assert (values[row, :length] - alone[prompt_len - 1:-1]).abs().max() < TOLERANCE
    assert (padded.values(_blank(batch))["values"] - values)[mask].abs().max() > 1e-3  # the images count
    tower = {name: param.detach().clone() for name, param in padded.model.named_parameters() if ".visual." in name}
    returns = values + torch.linspace(-1.0, 1.0, values.shape[1])
    rows = batch.union(Batch({"values": values, "returns": returns, "loss_mask": batch["response_mask"]}))
    from hybridflow.registry import LOSSES

    metrics = padded.train_step(rows, loss=LOSSES.get("value"), options={})
    assert metrics["vf_loss"] > 0
    moved = [name for name, param in padded.model.named_parameters() if name in tower
             and not torch.equal(param, tower[name])]
    assert moved  # the value loss trains through the vision tower


def test_a_vlm_reward_model_scores_with_the_images(vlm_dir: Path) -> None:
    batch, processor, records = image_rows(vlm_dir)
    padded, packed = (_engine(vlm_dir, RoleKind.REWARD_MODEL, padding=padding, name="reward")
                      for padding in (True, False))
    scores = padded.score(batch)["scores"]
    assert scores.shape == (2,)
    assert (packed.score(batch)["scores"] - scores).abs().max() < TOLERANCE
    for row, record in enumerate(records):  # the head at the row's last real token
        length = int(batch["response_mask"][row].sum())
        alone, _ = _head_alone(padded.model, processor, record, batch["responses"][row, :length])
        assert abs(float(scores[row] - alone[-1])) < TOLERANCE
    assert (padded.score(_blank(batch))["scores"] - scores).abs().max() > 1e-4


def test_a_text_critic_over_image_rows_is_refused_naming_the_fix(vlm_dir: Path) -> None:
    from hybridflow.backends.torch.engine import TorchRoleEngine

    batch, _, _ = image_rows(vlm_dir)
    critic = TorchRoleEngine(role_spec("critic", RoleKind.VALUE), layout("critic", dp=1, sharding="NO_SHARD"),
                             context())
    with pytest.raises(NotImplementedError, match="vision-language model"):
        critic.values(batch)


def test_a_vlm_teachers_logprobs_read_the_images(vlm_dir: Path, tmp_path: Path) -> None:
    """on_policy_distill's teacher node reads the sampled rows' images; its log-probs are the teacher model's own
    forward on the sample with its images, and differ with the images blanked."""
    from transformers import AutoModelForImageTextToText

    from hybridflow.graph import load_graph
    from hybridflow.runtime.worker import companion_fields, run_role_op

    processor = tiny_vlm_processor()
    teacher_dir = save_vlm_dir(build_tiny_vlm(processor.tokenizer, seed=1), processor, tmp_path / "teacher")
    node = load_graph("on_policy_distill").node("teacher_logprob")
    assert {"pixel_values", "image_grid_thw"} <= set(companion_fields(node))
    batch, processor, records = image_rows(vlm_dir)
    teacher = _engine(teacher_dir, RoleKind.FROZEN_POLICY, padding=False, name="teacher")
    got = run_role_op(teacher, node, batch, seed=0)["teacher_logprobs"]
    model = AutoModelForImageTextToText.from_pretrained(teacher_dir).eval()
    for row, record in enumerate(records):
        length = int(batch["response_mask"][row].sum())
        alone = forward_alone(model, processor, record, batch["responses"][row, :length])
        assert (got[row, :length] - alone).abs().max() < TOLERANCE
    blank = run_role_op(teacher, node, _blank(batch), seed=0)["teacher_logprobs"]
    assert (blank - got)[batch["response_mask"].bool()].abs().max() > 1e-3


def test_a_vlm_judge_reads_the_samples_images(vlm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """grpo_judge with a vision-language judge: its rendered prompts keep each sample's image placeholders, its
    generate gets the samples' pixel_values, and its verdict's log-probs change when the images are blanked."""
    from hybridflow.algorithms.judge_functions import JudgeText, judge_prompts
    from hybridflow.backends.common import vision

    from hybridflow.graph import load_graph
    from hybridflow.models.vision import IMAGE_PAD
    from hybridflow.runtime.worker import run_role_op

    processor = tiny_vlm_processor()
    judge_dir = save_vlm_dir(build_tiny_vlm(processor.tokenizer, seed=2), processor, tmp_path / "judge")
    batch, processor, records = image_rows(vlm_dir)
    truths = [record["ground_truth"] for record in records]

    def rendered(judge: str) -> tuple[torch.Tensor, torch.Tensor]:
        state = JudgeText(role_models={"actor": str(vlm_dir), "judge": judge}, policy="actor", judge="judge",
                          template="reference", verdict=None, rubric="", scale=10)
        return judge_prompts(batch["prompts"], batch["responses"], batch["response_mask"], truths, state=state)

    ids, mask = rendered(str(judge_dir))
    pad = processor.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    visual = [int(grid.prod(axis=1).sum()) // 4 for grid in batch["image_grid_thw"]]  # merged 2 x 2
    assert [int((row == pad).sum()) for row in ids] == visual == [int((row == pad).sum()) for row in batch["prompts"]]
    assert not (rendered("tiny-qwen2")[0] == pad).any()  # a text judge reads the text alone

    node = load_graph("grpo_judge", kl_coef=0.01).node("judge_generate")
    images = batch.select(["pixel_values", "image_grid_thw"])
    rows = images.union(Batch({"judge_prompts": ids, "judge_prompts_mask": mask}))
    seen: list[bool] = []
    original = vision.padded_inputs
    monkeypatch.setattr(vision, "padded_inputs", lambda model, b, *a: seen.append("pixel_values" in b) or
                        original(model, b, *a))
    judge = _engine(judge_dir, RoleKind.FROZEN_POLICY, padding=False, name="judge")
    verdicts = run_role_op(judge, node, rows, seed=0)
    assert seen == [True]  # the verdict's prefill read the images
    scored = images.union(Batch({"prompts": ids, "prompt_mask": mask, "responses": verdicts["verdict_ids"],
                                 "response_mask": verdicts["verdict_mask"]}))
    logprobs = judge.log_probs(scored)["logprobs"]
    blank = judge.log_probs(_blank(scored))["logprobs"]
    assert (blank - logprobs)[verdicts["verdict_mask"].bool()].abs().max() > 1e-3


def test_a_vlm_judge_that_reads_images_otherwise_is_refused_naming_both(vlm_dir: Path, tmp_path: Path) -> None:
    import json
    import shutil

    from hybridflow.algorithms.judge_functions import JudgeText

    judge_dir = Path(shutil.copytree(vlm_dir, tmp_path / "judge"))
    config = json.loads((judge_dir / "config.json").read_text())
    config["vision_config"]["patch_size"] = 8
    (judge_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"judge model .*patch_size': 8.*policy's processor.*patch_size': 4"):
        JudgeText(role_models={"actor": str(vlm_dir), "judge": str(judge_dir)}, policy="actor", judge="judge",
                  template="pointwise", verdict=None, rubric="", scale=10)


@pytest.mark.slow  # two spawned gloo ranks: ~40 s on 2 shared cores
def test_an_fsdp_vlm_critic_gives_the_torch_engines_values_and_update(vlm_dir: Path) -> None:
    """FULL_SHARD over two ranks, one image row each: the values equal the torch engine's over both rows, and one
    value update lands on the torch engine's weights."""
    import vision_ranks

    batch, _, _ = image_rows(vlm_dir)
    engine = _engine(vlm_dir, RoleKind.VALUE, padding=True)
    values = engine.values(batch)["values"]
    returns = values + torch.linspace(-1.0, 1.0, values.shape[1])
    rows = batch.union(Batch({"values": values, "returns": returns, "loss_mask": batch["response_mask"]}))
    ranks = run_ranks(vision_ranks.fsdp_critic, str(vlm_dir), rows.to_wire())
    mask = batch["response_mask"].bool()
    assert (torch.cat([rank["values"] for rank in ranks]) - values)[mask].abs().max() < TOLERANCE
    # Adam's first step moves every weight by about lr (1e-3); the sharded one lands within float noise of it
    assert ranks[0]["step"] > 5e-4 and max(rank["weight_gap"] for rank in ranks) < 2e-5
