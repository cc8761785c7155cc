"""`hybridflow train` with a vision-language policy: GRPO on the largest_colour task, images in every pass."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import torch
from hybridflow.backends.common import vision

from hybridflow.graph import load_graph
from hybridflow.models.vision import build_tiny_vlm, save_vlm_dir, tiny_vlm_processor
from hybridflow.runtime.worker import companion_fields
from hybridflow.train import loop, placement
from hybridflow.train.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_nodes_reading_the_prompts_read_their_images_too() -> None:
    nodes = {node.name: node for node in load_graph("grpo_judge", kl_coef=0.01).nodes}
    images = {"pixel_values", "image_grid_thw"}
    for name in ("actor_generate", "reference_ref_logprob", "actor_logprob", "actor_update"):
        assert images <= set(companion_fields(nodes[name])), name
    # the judge reads its own rendered prompts, which keep the image placeholders for a vision-language judge
    assert images <= set(companion_fields(nodes["judge_generate"]))


@pytest.mark.slow
def test_grpo_trains_a_vlm_policy_on_image_prompts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    processor = tiny_vlm_processor()
    model_dir = save_vlm_dir(build_tiny_vlm(processor.tokenizer), processor, tmp_path / "vlm")
    passes: collections.Counter[tuple[str, bool]] = collections.Counter()
    for name in ("padded_inputs", "packed_inputs"):
        original = getattr(vision, name)

        def counted(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            passes[(_name, torch.is_grad_enabled())] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(vision, name, counted)
    loads: list[Any] = []
    monkeypatch.setattr(placement, "workload", lambda *a, _w=placement.workload, **k: loads.append(_w(*a, **k))
                        or loads[-1])
    config = load_config(ROOT / "configs" / "grpo_vision.yaml",
                         [f"model.path={model_dir}", f"output_dir={tmp_path / 'run'}", "steps=2", "data.batch_size=4",
                          "data.num_examples=16", "algorithm.options.n=2", "algorithm.options.kl_coef=0.01",
                          "placement.mode=auto", "placement.cluster=1xA100-80G",
                          "logging.progress=false", "logging.plot=false"])
    result = loop.train(config)
    assert [row["step"] for row in result.history] == [0, 1]
    assert all("reward/mean" in row for row in result.history)
    assert loads and all(load.image_tokens == 4 for load in loads)  # the plan costed the images
    # images in the rollout's prefill (no grad), the reference's log-probs (no grad) and the update (grad)
    assert passes[("padded_inputs", False)] >= 2 and passes[("packed_inputs", False)] >= 2
    assert passes[("packed_inputs", True)] >= 2


@pytest.mark.slow
@pytest.mark.ray
def test_a_ray_run_of_a_vlm_policy_samples_and_scores_as_a_local_one(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    processor = tiny_vlm_processor()
    model = build_tiny_vlm(processor.tokenizer)
    torch.manual_seed(0)
    with torch.no_grad():  # wider weights than the default init, whose samples hardly vary with the image
        for param in model.parameters():
            if param.ndim > 1:
                param.normal_(0.0, 0.5)
    model_dir = save_vlm_dir(model, processor, tmp_path / "vlm")
    rewards = {}
    for executor in ("local", "ray"):
        config = load_config(ROOT / "configs" / "grpo_vision.yaml",
                             [f"model.path={model_dir}", f"output_dir={tmp_path / executor}", "steps=2",
                              "data.batch_size=4", "data.num_examples=16", "algorithm.options.n=4",
                              "algorithm.options.kl_coef=0.01", f"executor.name={executor}",
                              "logging.progress=false", "logging.plot=false"])
        history = loop.train(config).history
        rewards[executor] = [row[key] for row in history for key in METRICS]
    assert rewards["local"][METRICS.index("actor/entropy")] > 0  # the update pass read image rows
    assert rewards["ray"] == pytest.approx(rewards["local"], abs=1e-5)  # the images crossed the Ray wire intact


METRICS = ("reward/mean", "response_length/mean", "actor/entropy", "actor/ref_kl")


@pytest.mark.slow  # 15 s alone on 2 cores, more beside other jobs
def test_ppo_runs_a_step_with_a_vlm_critic_that_reads_the_images(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import yaml
    from hybridflow.backends.common import modeling

    processor = tiny_vlm_processor()
    model_dir = save_vlm_dir(build_tiny_vlm(processor.tokenizer), processor, tmp_path / "vlm")
    passes: list[tuple[bool, bool, int]] = []  # (images in the rows, grad enabled, the head's width)
    original = modeling.value_outputs

    def counted(model: Any, batch: Any, **kwargs: Any) -> Any:
        width = modeling.hf_model(model).get_output_embeddings().out_features
        passes.append((vision.has_images(batch), torch.is_grad_enabled(), width))
        return original(model, batch, **kwargs)

    monkeypatch.setattr(modeling, "value_outputs", counted)
    raw = yaml.safe_load((ROOT / "configs" / "grpo_vision.yaml").read_text())
    raw["algorithm"] = {"name": "ppo", "options": {"kl_coef": 0.01, "max_new_tokens": 6, "temperature": 1.0}}
    raw["optim"]["critic"] = {"lr": 0.001, "micro_batch_size": 128}
    (tmp_path / "ppo.yaml").write_text(yaml.safe_dump(raw))
    config = load_config(tmp_path / "ppo.yaml",
                         [f"model.path={model_dir}", f"output_dir={tmp_path / 'run'}", "steps=1", "data.batch_size=4",
                          "data.num_examples=8", "logging.progress=false", "logging.plot=false"])
    history = loop.train(config).history
    assert [row["step"] for row in history] == [0]
    assert "critic/vf_loss" in history[0], sorted(history[0])
    # the values pass (no grad) and the critic's update (grad) both read the images, through a one-wide value head
    assert (True, False, 1) in passes and (True, True, 1) in passes and all(images for images, _, _ in passes)


@pytest.mark.slow  # ~15 s alone on 2 cores
def test_grpo_judge_with_a_vlm_judge_sends_it_the_samples_images(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridflow.models.vision import IMAGE_PAD

    processor = tiny_vlm_processor()
    model_dir = save_vlm_dir(build_tiny_vlm(processor.tokenizer), processor, tmp_path / "vlm")
    judge_dir = save_vlm_dir(build_tiny_vlm(processor.tokenizer, seed=3), processor, tmp_path / "judge")
    pad = processor.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    prefills: list[tuple[int, int]] = []  # per generate with images: (placeholders in its prompts, visual tokens)
    original = vision.padded_inputs

    def counted(model: Any, batch: Any, input_ids: torch.Tensor, mask: torch.Tensor) -> Any:
        if not torch.is_grad_enabled() and input_ids.shape[1] == batch["prompts"].shape[1]:
            grids = [grid for grid in batch["image_grid_thw"] if len(grid)]
            prefills.append((int((input_ids == pad).sum()), sum(int(g.prod(axis=1).sum()) // 4 for g in grids)))
        return original(model, batch, input_ids, mask)

    monkeypatch.setattr(vision, "padded_inputs", counted)
    config = load_config(ROOT / "configs" / "grpo_vision.yaml",
                         [f"model.path={model_dir}", f"output_dir={tmp_path / 'run'}", "steps=1", "data.batch_size=2",
                          "data.num_examples=4", "algorithm.name=grpo_judge", "algorithm.options.n=2",
                          "algorithm.options.judge_template=reference", f"roles.judge.model={judge_dir}",
                          "logging.progress=false", "logging.plot=false"])
    history = loop.train(config).history
    assert [row["step"] for row in history] == [0]
    # two generates read the images: the actor's prefill, then the judge's over its rendered prompts (longer, with
    # the same placeholders, one per visual token)
    assert len(prefills) == 2 and all(placeholders == visual > 0 for placeholders, visual in prefills), prefills
