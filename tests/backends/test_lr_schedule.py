"""Learning-rate schedules: transformers' definitions, set by the shared update loop, resumed exactly."""

from __future__ import annotations

import pytest
import torch
from harness import context, layout, rollout_batch
from hybridflow.backends.torch.engine import TorchRoleEngine
from transformers import (
    get_constant_schedule_with_warmup,
    get_cosine_with_min_lr_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)

from hybridflow.graph import RoleKind
from hybridflow.registry import LOSSES
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.protocols import OptimSpec, RoleSpec
from hybridflow.train.config import load_config

TOTAL = 20


def _reference(kind: str, warmup: int, min_lr_ratio: float) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    if kind == "constant":
        schedule = get_constant_schedule_with_warmup(optimizer, warmup)
    elif kind == "linear":
        schedule = get_linear_schedule_with_warmup(optimizer, warmup, TOTAL)
    else:
        schedule = get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup, TOTAL, min_lr_rate=min_lr_ratio)
    factors = []
    for _ in range(TOTAL):
        factors.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return factors


@pytest.mark.parametrize(("kind", "warmup", "floor"), [("constant", 3, 0.0), ("linear", 0, 0.0), ("linear", 4, 0.0),
                                                        ("cosine", 5, 0.0), ("cosine", 2, 0.1)])
def test_factors_match_transformers(kind: str, warmup: int, floor: float) -> None:
    spec = OptimSpec(lr=1.0, lr_scheduler=kind, warmup_steps=warmup, min_lr_ratio=floor, total_steps=TOTAL)
    assert [spec.lr_factor(k) for k in range(TOTAL)] == pytest.approx(_reference(kind, warmup, floor), abs=1e-12)


def test_warmup_ratio_rounds_up_as_transformers() -> None:
    assert OptimSpec(lr_scheduler="linear", warmup_ratio=0.12, total_steps=TOTAL).warmup == 3  # ceil(2.4)


@pytest.mark.parametrize(("overrides", "needle"), [
    (["optim.actor.lr_scheduler=step"], "lr_scheduler"),
    (["optim.actor.warmup_steps=2", "optim.actor.warmup_ratio=0.1"], "warmup_steps and warmup_ratio"),
    (["optim.actor.min_lr_ratio=0.1"], "cosine"),
    (["optim.actor.total_steps=5"], "total_steps"),
])
def test_bad_schedule_keys_are_named(overrides: list[str], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        load_config(None, overrides)


def test_config_schedule_spans_the_run() -> None:
    config = load_config(None, ["steps=10", "optim.actor.lr_scheduler=cosine", "optim.actor.warmup_ratio=0.2",
                                "optim.actor.min_lr_ratio=0.5"])
    spec = config.optim.actor.spec(config.steps)
    assert (spec.total_steps, spec.warmup) == (10, 2)
    assert spec.lr_factor(10) == pytest.approx(0.5)


def _engine(optim: OptimSpec) -> TorchRoleEngine:
    spec = RoleSpec(name="actor", kind=RoleKind.POLICY, model="tiny-qwen2", optim=optim, seed=0)
    return TorchRoleEngine(spec, layout(dp=1, micro_batch_size=8), context())


def _update(engine: TorchRoleEngine, step: int) -> float:
    metrics = engine.train_step(rollout_batch(seed=step), loss=LOSSES.get("ppo_policy"), options={})
    return metrics["lr"]


def test_engine_follows_the_schedule_and_resumes_it(tmp_path: object) -> None:
    optim = OptimSpec(lr=1e-3, lr_scheduler="linear", warmup_steps=2, total_steps=6)
    straight = _engine(optim)
    rates = [_update(straight, step) for step in range(5)]
    assert rates == pytest.approx([1e-3 * optim.lr_factor(k) for k in range(5)])
    assert rates[0] == 0.0 and rates[2] == pytest.approx(1e-3)
    first = _engine(optim)
    for step in range(3):
        _update(first, step)
    first.save_checkpoint(str(tmp_path))
    resumed = _engine(optim)
    resumed.load_checkpoint(str(tmp_path))
    assert [_update(resumed, step) for step in (3, 4)] == pytest.approx(rates[3:])
    for name, value in straight.state_dict().items():  # the same rates gave the same weights
        torch.testing.assert_close(resumed.state_dict()[name], value)


def test_entropy_and_kl_are_token_means_of_the_whole_update() -> None:
    """Micro batches of unequal token counts: the logged means weigh each token once (not each micro batch)."""
    from hybridflow.backends.common import modeling

    batch = rollout_batch(rows=8, seed=3)
    lengths = torch.tensor([5, 5, 5, 5, 1, 1, 1, 1])  # the second micro batch holds a fifth of the tokens
    mask = (torch.arange(5)[None, :] < lengths[:, None]).long()
    batch = Batch({**batch.tensors, "response_mask": mask, "loss_mask": mask,
                   "ref_logprobs": batch["old_logprobs"] - 0.5})
    spec = RoleSpec(name="actor", kind=RoleKind.POLICY, model="tiny-qwen2", optim=OptimSpec(lr=1e-6), seed=0)
    engine = TorchRoleEngine(spec, layout(dp=1, micro_batch_size=4), context())
    with torch.no_grad():
        out = modeling.policy_outputs(engine.model, batch, with_entropy=True, packed=True)
    want = float((out["entropy"] * mask).sum() / mask.sum())
    metrics = engine.train_step(batch, loss=LOSSES.get("ppo_policy"), options={"kl_coef": 0.1, "kl_type": "k3",
                                                                              "loss_agg": "seq-mean-token-sum-norm"})
    assert metrics["entropy"] == pytest.approx(want, rel=1e-4)
    kl = torch.exp(batch["ref_logprobs"] - out["logprobs"]) - (batch["ref_logprobs"] - out["logprobs"]) - 1
    assert metrics["kl"] == pytest.approx(float((kl * mask).sum() / mask.sum()), rel=1e-4)
