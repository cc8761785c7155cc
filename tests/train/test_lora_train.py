"""``roles.actor.lora`` in a run: adapter-only checkpoints, exact resume, and the reference for free."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("peft", reason="needs peft (the `lora` extra)")
import torch
from hybridflow.backends.common import modeling
from hybridflow.backends.common.peft_lora import is_adapter_key

from hybridflow.cli import main
from hybridflow.graph import Op, RoleKind
from hybridflow.planner import RoleLayout
from hybridflow.runtime import default_plan
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.engines import SharedBaseReference
from hybridflow.runtime.protocols import RoleSpec
from hybridflow.runtime.worker import GroupWorker
from hybridflow.train.config import load_config
from hybridflow.train.loop import train
from hybridflow.train.setup import build_graph, role_specs

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "grpo_reverse.yaml"
LORA = "roles.actor.lora={rank: 4, alpha: 8.0}"
QUICK = ["model.sft_steps=5", "data.batch_size=4", "data.num_examples=64", "algorithm.options.n=2",
         "algorithm.options.max_new_tokens=6", "algorithm.options.kl_coef=0.05", "logging.progress=false",
         "logging.plot=false"]
TIMING_KEYS = ("time/", "timeline/", "memory/", "throughput/")


def _specs(*overrides: str) -> dict[str, RoleSpec]:
    config = load_config(CONFIG, [*QUICK, *overrides])
    return role_specs(config, build_graph(config), "tiny-qwen2")


def test_the_reference_shares_a_lora_policys_base_model() -> None:
    specs = _specs(LORA)
    assert specs["actor"].lora is not None and specs["actor"].lora.rank == 4
    assert specs["reference"].shares_policy == "actor" and specs["reference"].lora is None
    assert _specs()["reference"].shares_policy is None  # full fine-tuning: the reference is a copy
    assert _specs("roles.actor.lora={init: pissa}")["reference"].shares_policy is None  # pissa moves the base
    assert _specs(LORA, "roles.reference.model=/elsewhere")["reference"].shares_policy is None


def test_bad_lora_keys_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"roles\.actor\.lora.*lora\.rank"):
        load_config(CONFIG, ["roles.actor.lora.rank=0"])
    with pytest.raises(KeyError, match=r"roles\.actor\.lora\.rnak"):
        load_config(CONFIG, ["roles.actor.lora.rnak=4"])
    with pytest.raises(ValueError, match=r"config key 'roles\.reference\.lora'"):
        _specs("roles.reference.lora={rank: 4}")
    ppo = load_config(CONFIG.parent / "ppo_reverse.yaml", ["roles.critic.lora={rank: 4}"])
    with pytest.raises(ValueError, match=r"config key 'roles\.critic\.lora'.*LoRA critics are not supported"):
        role_specs(ppo, build_graph(ppo), "tiny-qwen2")


def test_the_reference_runs_on_the_policys_engine_with_adapters_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_config(CONFIG, [*QUICK, LORA])
    graph = build_graph(config)
    specs = role_specs(config, graph, "tiny-qwen2")
    plan = default_plan(graph, num_gpus=1)
    loads = _count_loads(monkeypatch)
    worker = GroupWorker(group=0, rank=0, world_size=1, device="cpu", specs=[specs["actor"], specs["reference"]],
                         layouts=[plan.layout("actor"), plan.layout("reference")])
    worker.setup()
    assert loads == ["actor"] and isinstance(worker.engines["reference"], SharedBaseReference)
    batch = _rollout_rows()
    base = modeling.load_model(RoleKind.POLICY, "tiny-qwen2", seed=config.seed)  # the base, loaded apart
    nodes = {node.op: node for node in graph.nodes}
    ref_before = worker.run(nodes[Op.REF_LOGPROB], batch).outputs["ref_logprobs"]
    assert torch.equal(ref_before, _log_probs(base, batch, plan.layout("actor")))
    old = worker.run(nodes[Op.LOGPROB], batch).outputs["old_logprobs"]
    assert torch.equal(old, ref_before)  # adapters start as a no-op (B = 0)
    update_rows = batch.union(Batch({"old_logprobs": old, "ref_logprobs": ref_before,
                                     "advantages": torch.randn(old.shape, generator=torch.Generator().manual_seed(1)),
                                     "loss_mask": batch["response_mask"]}))
    for _ in range(2):
        worker.run(nodes[Op.UPDATE], update_rows)
    after = worker.run(nodes[Op.LOGPROB], batch).outputs["old_logprobs"]
    assert not torch.equal(after, old)
    assert torch.equal(worker.run(nodes[Op.REF_LOGPROB], batch).outputs["ref_logprobs"], ref_before)
    worker.close()


def test_a_lora_run_trains_end_to_end_with_adapter_sized_checkpoints(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    loads = _count_loads(monkeypatch)
    code = main(["train", "--config", str(CONFIG), "steps=2", "checkpoint.every=2", f"output_dir={tmp_path}",
                 *QUICK, LORA])
    assert code == 0 and loads == ["actor"]  # the reference is the actor's engine, adapters off
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and "kl" in rows[0]
    step = tmp_path / "checkpoints" / "step_000002"
    saved = torch.load(step / "roles" / "actor" / "state.pt", weights_only=True)
    assert saved["model"] and all(is_adapter_key(name) for name in saved["model"])
    assert not (step / "hf").exists()  # no merged copy beside an adapter checkpoint
    model_bytes = (tmp_path / "init_model" / "model.safetensors").stat().st_size
    assert (step / "roles" / "actor" / "state.pt").stat().st_size < model_bytes / 3
    assert (tmp_path / "final" / "model.safetensors").is_file()  # the merged policy, as for full fine-tuning


def test_a_lora_run_resumes_as_the_uninterrupted_run(tmp_path: Path) -> None:
    quick = [*QUICK, LORA, "checkpoint.every=2"]
    full = train(load_config(CONFIG, ["steps=4", f"output_dir={tmp_path / 'full'}", *quick]))
    part = tmp_path / "part"
    train(load_config(CONFIG, ["steps=2", f"output_dir={part}", *quick]))
    resumed = train(load_config(CONFIG, ["steps=4", f"output_dir={part}", *quick]), resume=True)
    assert resumed.start_step == 2
    assert [_deterministic(h) for h in resumed.history] == [_deterministic(h) for h in full.history[2:]]
    from safetensors.torch import load_file

    assert resumed.export_path is not None and full.export_path is not None
    final_full, final_resumed = (load_file(path / "model.safetensors") for path in (full.export_path,
                                                                                   resumed.export_path))
    assert all(torch.equal(final_full[n], final_resumed[n]) for n in final_full)


def _count_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The roles whose engines load a model from now on (a spy on the shared loading)."""
    loads: list[str] = []
    load = modeling.load_model

    def counted(*args: Any, **kwargs: Any) -> Any:
        loads.append(kwargs.get("role", ""))
        return load(*args, **kwargs)

    monkeypatch.setattr(modeling, "load_model", counted)
    return loads


def _rollout_rows() -> Batch:
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, 51, (4, 5), generator=gen)
    responses = torch.randint(4, 51, (4, 6), generator=gen)
    return Batch({"prompts": prompts, "prompt_mask": torch.ones_like(prompts), "responses": responses,
                  "response_mask": torch.ones_like(responses)})


def _log_probs(model: Any, batch: Batch, layout: RoleLayout) -> torch.Tensor:
    with torch.no_grad():
        return modeling.policy_outputs(model.eval(), batch, with_entropy=False, packed=not layout.padding)["logprobs"]


def _deterministic(row: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in row.items() if not k.startswith(TIMING_KEYS)}


def test_placement_auto_plans_the_reference_on_the_lora_policys_weights() -> None:
    from hybridflow.train.config import config_from_dotted
    from hybridflow.train.prepare import prepare_run

    config = config_from_dotted({"data.batch_size": 4, "data.num_examples": 16, "algorithm": "grpo",
                                 "algorithm.options.n": 2, "algorithm.options.max_new_tokens": 6,
                                 "roles.actor.lora": {"rank": 4}, "placement.mode": "auto", "placement.num_gpus": 2,
                                 "logging.progress": False})
    plan = prepare_run(config).plan
    group = plan.groups[plan.group_index("actor")]
    assert plan.group_index("reference") == plan.group_index("actor")
    assert {layout.role: layout.shares_weights_with for layout in group.layouts} == {"actor": "",
                                                                                     "reference": "actor"}
    assert "reference run(s) on its engine" in dict(plan.extra)["lora"]
