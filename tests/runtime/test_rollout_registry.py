"""The rollout-engine seam: an engine written here, outside ``backends/``, registered in ``ROLLOUTS`` (by name,
by ``file.py:name``, by entry point) and used by a policy, colocated (a hybrid engine) and detached."""

from __future__ import annotations

import importlib.metadata
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import hybridflow.registry
from hybridflow.data import TASKS, PromptLoader, RuleScorer, char_tokenizer, task_examples
from hybridflow.graph import Graph, load_graph
from hybridflow.planner import GroupPlan, Plan, RoleLayout
from hybridflow.registry import ROLLOUTS, Registry, RegistryError
from hybridflow.runtime import Batch, Controller, OptimSpec, RoleSpec, default_plan
from hybridflow.runtime.protocols import AdapterSpec, Engine, SamplingParams, WorkerContext, parse_options

TOKENIZER = char_tokenizer()
LOADER = PromptLoader(records=task_examples("reverse", 64), tokenizer=TOKENIZER, batch_size=4)
NAME = "test_loop"  # registered by ROLLOUTS.add (fixture below)
BY_PATH = f"{__file__}:FACTORY"  # the same factory, loaded from this file by the registry


@dataclass(frozen=True, kw_only=True)
class LoopOptions:
    pad_id: int = 0


class LoopRollout:
    """A rollout engine from the protocols alone: an HF causal LM sampled by a plain (cache-free) loop.

    Counts its generations and weight loads, so the tests can tell it, and not the trainer, did the work.
    """

    def __init__(self, spec: RoleSpec, context: WorkerContext, options: LoopOptions) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(spec.model, dtype=torch.float32).eval()
        self.rank, self.pad_id = context.rank, options.pad_id
        self.generations, self.loads, self.closed = 0, 0, False

    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        self.generations += 1
        generator = torch.Generator().manual_seed(sampling.rank_seed(self.rank))
        ids, mask = batch["prompts"], batch["prompt_mask"]
        done = torch.zeros(len(ids), dtype=torch.bool)
        tokens, alive = [], []
        with torch.no_grad():
            for _ in range(sampling.max_new_tokens):
                positions = (mask.cumsum(-1) - 1).clamp(min=0)
                logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1]
                if sampling.greedy:
                    token = logits.argmax(-1)
                else:
                    probs = torch.softmax(logits / sampling.temperature, dim=-1)
                    token = torch.multinomial(probs, 1, generator=generator).squeeze(1)
                token = token.masked_fill(done, self.pad_id)
                tokens.append(token)
                alive.append(~done)
                done = done | (token == self.model.config.eos_token_id)
                ids = torch.cat([ids, token[:, None]], dim=1)
                mask = torch.cat([mask, torch.ones_like(token)[:, None]], dim=1)
        return Batch({"responses": torch.stack(tokens, dim=1), "response_mask": torch.stack(alive, dim=1).long()})

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        state = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in named:
                state[name].copy_(tensor)  # a KeyError names a weight this model does not have
        self.loads += 1

    def close(self) -> None:
        self.closed = True


class AdapterLoopRollout(LoopRollout):
    """A :class:`LoopRollout` that takes a LoRA policy's adapters over the base it loaded once (an ``AdapterSink``,
    as vLLM with ``enable_lora``): each version is merged here, ``W + (alpha / r) B A``, onto that base."""

    takes_adapters = True

    def __init__(self, spec: RoleSpec, context: WorkerContext, options: LoopOptions) -> None:
        super().__init__(spec, context, options)
        self.base = {name: tensor.clone() for name, tensor in self.model.state_dict().items()}
        self.policy_versions, self.adapters = spec.policy_versions, []  # (tensor names, config) per version

    def load_adapter(self, named: Iterable[tuple[str, torch.Tensor]], config: dict[str, Any]) -> None:
        tensors = dict(named)
        self.adapters.append((sorted(tensors), config))
        scale = config["lora_alpha"] / config["r"]
        merged = dict(self.base)
        for name, lora_a in tensors.items():
            if ".lora_A." in name:
                module = name.removeprefix("base_model.model.").split(".lora_A.")[0]
                lora_b = tensors[name.replace(".lora_A.", ".lora_B.")]
                merged[module + ".weight"] = self.base[module + ".weight"] + scale * lora_b @ lora_a
        self.model.load_state_dict(merged)


class LoopRolloutFactory:
    """Standalone (a detached rollout is this engine alone, taking adapters when its policy trains them);
    colocated, the trainer's weights reach it before the first generation (it loads its own copy, which need
    not match the trainer's)."""

    standalone = True

    def build(self, spec: RoleSpec, layout: RoleLayout, context: WorkerContext, *,
              trainer: Engine | None) -> Engine:
        from hybridflow.backends.common.hybrid import HybridEngine

        engine = AdapterLoopRollout if trainer is None and spec.serves_adapter is not None else LoopRollout
        rollout = engine(spec, context, parse_options(LoopOptions, spec.rollout_options, role=spec.name,
                                                      owner="loop rollout"))
        if trainer is None:
            return rollout
        return HybridEngine(trainer, rollout, weight_dtype=layout.dtype, synced=False)


FACTORY = LoopRolloutFactory()


@pytest.fixture(scope="module", autouse=True)
def registered() -> None:
    if NAME not in ROLLOUTS:
        ROLLOUTS.add(NAME, FACTORY)


def _graph() -> Graph:
    return load_graph("grpo", reward_kind="reward_function", max_new_tokens=6)


def _controller(model: Path, plan: Plan, rollout: str, **rollout_options: Any) -> Controller:
    graph = _graph()
    specs = {r.name: RoleSpec(name=r.name, kind=r.kind, model=str(model),
                              optim=OptimSpec(lr=1e-2) if r.kind.trainable else None,
                              rollout=rollout if r.kind.trainable else "native",
                              rollout_options=rollout_options if r.kind.trainable else {})
             for r in graph.roles if r.kind.needs_gpu}
    return Controller(graph, plan, specs=specs,
                      driver_roles={"reward": RuleScorer(TASKS.get("reverse").reward, TOKENIZER)})


def _engine(controller: Controller, group: int, role: str) -> Any:
    return controller.executor.groups[group].workers[0].engines[role]  # type: ignore[attr-defined]


def _same_weights(a: Any, b: Any) -> bool:
    left, right = a.state_dict(), b.state_dict()
    return left.keys() == right.keys() and all(torch.equal(left[name], right[name]) for name in left)


def test_a_colocated_policy_generates_on_the_registered_engine_with_each_update(random_model_dir: Path,
                                                                                monkeypatch: pytest.MonkeyPatch):
    graph = _graph()
    with _controller(random_model_dir, default_plan(graph), NAME, pad_id=0) as controller:
        hybrid = _engine(controller, 0, "actor")
        rollout, trainer = hybrid.rollout, hybrid.trainer
        assert isinstance(rollout, LoopRollout)

        def refuse(batch: Batch, sampling: Any) -> Batch:
            raise AssertionError("the trainer generated although the policy names another rollout engine")

        monkeypatch.setattr(trainer, "generate", refuse)
        before = {name: t.clone() for name, t in trainer.model.state_dict().items()}
        first = controller.step(LOADER.batch(0), step=0)
        assert (rollout.generations, rollout.loads) == (1, 1)  # its own copy got the trainer's weights first
        second = controller.step(LOADER.batch(1), step=1)
    assert (rollout.generations, rollout.loads) == (2, 2)  # and again after the first update
    assert not all(torch.equal(before[n], t) for n, t in trainer.model.state_dict().items()), "no update"
    params = sum(t.numel() * t.element_size() for _, t in trainer.iter_full_weights())  # fp32: one full copy
    assert first.metrics["actor/weight_sync/bytes"] == second.metrics["actor/weight_sync/bytes"] == params
    assert len(second.batch) == 4 * graph.samples_per_prompt
    assert rollout.closed


def _group(gpus: Sequence[int], roles: Sequence[str]) -> GroupPlan:
    layouts = tuple(RoleLayout(role=role, dp=len(gpus), dtype="fp32", micro_batch_size=8) for role in roles)
    return GroupPlan(gpus=tuple(gpus), hosts=(0,) * len(gpus), device="cpu", roles=tuple(roles), layouts=layouts,
                     memory_per_gpu_bytes=0, capacity_bytes=0)


def test_a_detached_rollout_is_the_engine_alone_and_receives_every_update(random_model_dir: Path):
    plan = Plan(algorithm="grpo", groups=(_group((0,), ["actor"]), _group((1,), ["actor:rollout", "reference"])),
                driver_roles=("reward",), weight_sync_bytes=1, weight_sync_seconds=0.5)
    with _controller(random_model_dir, plan, BY_PATH) as controller:
        rollout, trainer = _engine(controller, 1, "actor:rollout"), _engine(controller, 0, "actor")
        # Loaded from this file by path: the registry's copy of the class, not this module's.
        assert type(rollout).__name__ == "LoopRollout" and not hasattr(rollout, "trainer")
        for step in range(2):
            controller.step(LOADER.batch(step), step=step)
        assert rollout.generations == 2 and rollout.loads == 3  # shipped at start, then after each update
        assert _same_weights(rollout.model, trainer.model)


def test_a_lora_policys_detached_rollout_takes_the_adapter_alone_and_generates_with_the_merged_policy(
        random_model_dir: Path):
    graph = _graph()
    specs = {"actor": RoleSpec(name="actor", kind="policy", model=str(random_model_dir), optim=OptimSpec(lr=1e-2),
                               rollout=NAME, lora=AdapterSpec(rank=4, alpha=8.0)),
             "reference": RoleSpec(name="reference", kind="frozen_policy", model=str(random_model_dir))}
    plan = Plan(algorithm="grpo", groups=(_group((0,), ["actor"]), _group((1,), ["actor:rollout", "reference"])),
                driver_roles=("reward",), weight_sync_bytes=4321, weight_sync_seconds=0.5)
    scorer = RuleScorer(TASKS.get("reverse").reward, TOKENIZER)
    with Controller(graph, plan, specs=specs, driver_roles={"reward": scorer}) as controller:
        rollout, trainer = _engine(controller, 1, "actor:rollout"), _engine(controller, 0, "actor")
        assert isinstance(rollout, AdapterLoopRollout) and rollout.policy_versions == 1  # sync: k = 0
        for step in range(2):
            result = controller.step(LOADER.batch(step), step=step)
        adapter = dict(trainer.iter_adapter_weights())
        merged = dict(trainer.iter_full_weights())
        shipped = rollout.model.state_dict()
    assert rollout.loads == 0 and len(rollout.adapters) == 3  # no whole weights: at start, then after each update
    assert rollout.adapters[-1] == (sorted(adapter), trainer.adapter_config())
    assert result.metrics["actor/weight_sync/bytes"] == sum(t.numel() * t.element_size() for t in adapter.values())
    assert result.metrics["actor/weight_sync/tensors"] == len(adapter)
    assert result.metrics["weight_sync/planned_bytes"] == 4321  # the plan's estimate, logged beside it
    assert any(not torch.equal(merged[n], rollout.base[n]) for n in merged if n in rollout.base), "no update"
    assert all(torch.allclose(shipped[name], merged[name], atol=1e-6) for name in shipped)


def test_the_controller_gives_rollouts_k_plus_one_policy_versions(random_model_dir: Path):
    from hybridflow.planner.execution import ExecutionMode

    specs = {"actor": RoleSpec(name="actor", kind="policy", model=str(random_model_dir), optim=OptimSpec(lr=1e-2),
                               rollout=NAME, lora=AdapterSpec(rank=4)),
             "reference": RoleSpec(name="reference", kind="frozen_policy", model=str(random_model_dir))}
    plan = Plan(algorithm="grpo", groups=(_group((0,), ["actor"]), _group((1,), ["actor:rollout", "reference"])),
                driver_roles=("reward",))
    scorer = RuleScorer(TASKS.get("reverse").reward, TOKENIZER)
    for mode, versions in ((ExecutionMode(pipeline="one_step_off"), 2), (ExecutionMode(pipeline="async",
                                                                                       max_staleness=2), 3)):
        with Controller(_graph(), plan, specs=specs, driver_roles={"reward": scorer}, mode=mode) as controller:
            assert _engine(controller, 1, "actor:rollout").policy_versions == versions


def test_the_factory_checks_its_own_options(random_model_dir: Path):
    graph = _graph()
    with (pytest.raises(ValueError, match=r"unknown loop rollout option\(s\) \['pad'\]; valid options are "
                                          r"\['pad_id'\]"),
          _controller(random_model_dir, default_plan(graph), NAME, pad=1)):
        pass


def test_a_duplicate_rollout_name_raises():
    with pytest.raises(RegistryError, match=f"rollout engine '{NAME}' is already registered"):
        ROLLOUTS.add(NAME, LoopRolloutFactory())
    with pytest.raises(RegistryError, match="rollout engine 'vllm' is already registered"):
        ROLLOUTS.register("vllm")(LoopRolloutFactory())
    assert ROLLOUTS.get(NAME) is FACTORY


def test_an_unknown_rollout_is_refused_at_config_check_naming_the_key_and_the_registered_ones():
    from hybridflow.train.config import load_config
    from hybridflow.train.preflight import check_config

    config = load_config(None, ["roles.actor.rollout=sglang"])
    graph = load_graph(config.algorithm.name, **config.algorithm.options)
    with pytest.raises(KeyError, match=r"config key 'roles.actor.rollout'='sglang': unknown rollout engine 'sglang'; "
                                       r"valid names: \[.*'hf_generate'.*'native'.*'vllm'"):
        check_config(config, graph, default_plan(graph))
    not_a_factory = load_config(None, [f"roles.actor.rollout={__file__}:LoopOptions"])
    with pytest.raises(KeyError, match=r"config key 'roles.actor.rollout'=.*LoopOptions.* not a RolloutFactory"):
        check_config(not_a_factory, graph, default_plan(graph))


def test_a_rollout_plugin_registers_through_the_entry_point_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "loop_rollout_plugin.py").write_text(
        "from hybridflow.registry import ROLLOUTS\n"
        "from hybridflow.registry import load_object\n"
        f"ROLLOUTS.add('from_entry_point', load_object({BY_PATH!r}))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    advertised = importlib.metadata.EntryPoint("loop", "loop_rollout_plugin", "hybridflow.rollouts")

    def entry_points(*, group: str) -> list[importlib.metadata.EntryPoint]:
        return [advertised] if group == "hybridflow.rollouts" else []

    fresh: Registry[Any] = Registry(ROLLOUTS.kind, entry_point_group=ROLLOUTS.entry_point_group)
    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    monkeypatch.setattr(hybridflow.registry, "ROLLOUTS", fresh)  # what the plugin imports when it loads
    assert type(fresh.get("from_entry_point")).__name__ == "LoopRolloutFactory"
    assert fresh.names() == ["from_entry_point"]


def test_the_builtins_are_declared_under_the_rollouts_entry_point_group():
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    declared = pyproject["project"]["entry-points"]["hybridflow.rollouts"]
    assert ROLLOUTS.entry_point_group == "hybridflow.rollouts"
    builtins = {"native", "hf_generate", "vllm", "server"}
    assert builtins <= set(declared) and builtins <= set(ROLLOUTS)
    for name in sorted(builtins):
        assert isinstance(ROLLOUTS.get(name).standalone, bool)


def test_a_detached_rollout_takes_the_policys_rollout_and_a_config_entry_may_set_its_options():
    from hybridflow.runtime.placement import with_rollout_specs
    from hybridflow.train import setup
    from hybridflow.train.config import load_config

    plan = Plan(algorithm="grpo", groups=(_group((0,), ["actor"]), _group((1,), ["actor:rollout", "reference"])),
                driver_roles=("reward",))
    vllm = {"rollout_dtype": "fp32"}
    policy = RoleSpec(name="actor", kind="policy", model="m", backend="fsdp", rollout="vllm", rollout_options=vllm)
    specs = with_rollout_specs(plan, {"actor": policy})
    rollout = specs["actor:rollout"]
    assert (rollout.kind.value, rollout.backend, rollout.rollout, rollout.rollout_options) == (
        "frozen_policy", "fsdp", "vllm", vllm)
    assert (specs["actor"].rollout, specs["actor"].rollout_options) == ("native", {})  # the trainer generates nothing
    config = load_config(None, ["roles.actor.rollout=vllm", "roles.actor.rollout_options={rollout_dtype: fp32}",
                                "roles.actor:rollout.rollout_options={rollout_dtype: bf16}"])
    graph = load_graph(config.algorithm.name, **config.algorithm.options)
    own = setup.role_specs(config, graph, "m", plan)["actor:rollout"]
    assert (own.rollout, own.rollout_options) == ("vllm", {"rollout_dtype": "bf16"})
