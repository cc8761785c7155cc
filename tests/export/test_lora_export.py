"""A LoRA run exports as a peft adapter and a merged HF model; both give the checkpointed trainer's log-probs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("peft", reason="needs peft (the `lora` extra)")
import torch
from hybridflow.backends.common import modeling
from hybridflow.backends.common.peft_lora import load_adapter_state

from hybridflow.cli import main
from hybridflow.graph import RoleKind
from hybridflow.models import build_tiny_causal_lm
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.protocols import AdapterSpec

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "grpo_reverse.yaml"
LORA = "roles.actor.lora={rank: 16, alpha: 32.0}"
QUICK = ["model.sft_steps=5", "data.batch_size=4", "data.num_examples=64", "algorithm.options.n=2",
         "algorithm.options.max_new_tokens=6", "logging.progress=false", "logging.plot=false"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("lora") / "run"
    code = main(["train", "--config", str(CONFIG), "steps=2", "checkpoint.every=2", f"output_dir={run}", *QUICK,
                 LORA, "optim.actor.lr=0.01"])
    assert code == 0
    return run


def _sequences() -> torch.Tensor:
    return torch.randint(4, 51, (4, 12), generator=torch.Generator().manual_seed(0))  # (rows, tokens)


def _logprobs(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """Log-probs of tokens 1.. of each row under ``model``: (rows, tokens - 1)."""
    with torch.no_grad():
        logits = model(ids).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(2, ids[:, 1:, None])[..., 0]


def _trainer_logprobs(run: Path, ids: torch.Tensor) -> torch.Tensor:
    """The checkpointed trainer's log-probs: its own loading (peft model over the run's base) and forward."""
    config = json.loads((run / "config.json").read_text())
    model = modeling.load_model(RoleKind.POLICY, str(run / "init_model"), lora=AdapterSpec(rank=16, alpha=32.0),
                                seed=config["seed"], role="actor")
    saved = torch.load(run / "checkpoints" / "step_000002" / "roles" / "actor" / "state.pt", weights_only=True)
    load_adapter_state(model, saved["model"], role="actor")
    rows = Batch({"prompts": ids[:, :1], "prompt_mask": torch.ones_like(ids[:, :1]), "responses": ids[:, 1:],
                  "response_mask": torch.ones_like(ids[:, 1:])})
    with torch.no_grad():
        found: torch.Tensor = modeling.policy_outputs(model.eval(), rows, with_entropy=False, packed=False)["logprobs"]
    return found


def test_the_adapter_and_the_merged_model_load_in_transformers_with_the_trainers_logprobs(
        lora_run: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "adapter"
    assert main(["export", str(lora_run), str(out), "--merged"]) == 0  # the run dir: its newest checkpoint
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in out.iterdir()}
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((lora_run / "init_model").resolve())
    assert config["r"] == 16 and config["lora_alpha"] == 32.0
    ids = _sequences()
    expected = _trainer_logprobs(lora_run, ids)
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32)
    assert not torch.allclose(_logprobs(base.eval(), ids), expected, atol=1e-3)  # the adapters changed the policy
    adapted = PeftModel.from_pretrained(base, out).eval()
    assert (_logprobs(adapted, ids) - expected).abs().max() < 1e-5
    merged = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32).eval()
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (out / "merged").iterdir()}
    assert (_logprobs(merged, ids) - expected).abs().max() < 1e-5
    from safetensors.torch import load_file

    final, exported = (load_file(p / "model.safetensors") for p in (lora_run / "final", out / "merged"))
    assert final.keys() == exported.keys()  # the run's own final/ merge, by the trainer's stream
    assert all(torch.allclose(final[n], exported[n], atol=1e-6) for n in final)


def test_merged_export_without_the_base_model_is_refused_by_name(lora_run: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    shutil.copytree(lora_run, run, ignore=shutil.ignore_patterns("final", "init_model"))
    assert main(["export", str(run), str(tmp_path / "merged"), "--merged"]) != 0
    assert "--merged needs the base model" in capsys.readouterr().err
    assert main(["export", str(run), str(tmp_path / "adapter")]) == 0  # the adapter alone needs no base weights
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        (run / "init_model").resolve())


def test_merged_export_of_a_full_fine_tuning_checkpoint_is_refused_by_name(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hybridflow.data import char_tokenizer
    from hybridflow.models import save_model_dir

    tokenizer = char_tokenizer()
    model = build_tiny_causal_lm("tiny-qwen2", vocab_size=len(tokenizer), seed=0)
    model_dir = save_model_dir(model, tokenizer, tmp_path / "model")
    run = tmp_path / "run"
    role = run / "checkpoints" / "step_000001" / "roles" / "actor"
    role.mkdir(parents=True)
    torch.save({"model": model.state_dict(), "optimizer": {}}, role / "state.pt")
    (role.parent.parent / "trainer.json").write_text(json.dumps({"step": 1}))
    (run / "config.json").write_text(json.dumps({"model": {"path": str(model_dir)}, "roles": {"actor": {}}}))
    assert main(["export", str(run), str(tmp_path / "out"), "--merged"]) != 0
    assert "--merged: " in (err := capsys.readouterr().err) and "full fine-tuning checkpoint" in err
    assert main(["export", str(run), str(tmp_path / "out")]) == 0  # the whole model, as before
    assert (tmp_path / "out" / "model.safetensors").is_file()

