"""The training engines share one construction path (``backends/common/engine.py::TrainingEngine``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import context, layout, role_spec
from hybridflow.backends.common.engine import TrainingBackend, TrainingEngine
from hybridflow.backends.torch import TorchRoleEngine

from hybridflow.graph import RoleKind
from hybridflow.registry import BACKENDS


@pytest.mark.parametrize("name", ["torch", "fsdp", "deepspeed"])
def test_every_training_backend_builds_a_training_engine(name: str) -> None:
    backend = BACKENDS.get(name)
    assert isinstance(backend, TrainingBackend)
    assert issubclass(backend.engine_type, TrainingEngine)
    assert not backend.engine_type.__abstractmethods__, f"{name} leaves hooks unimplemented"


def test_a_build_that_fails_closes_what_it_took() -> None:
    calls: list[str] = []

    class Failing(TorchRoleEngine):
        def join_group(self) -> None:
            calls.append("join")

        def wrap_model(self, model: torch.nn.Module, layout: Any) -> Any:
            calls.append("wrap")
            raise RuntimeError("out of device memory")

        def close(self) -> None:
            calls.append("close")

    with pytest.raises(RuntimeError, match="out of device memory"):
        Failing(role_spec(), layout(dp=1), context())
    assert calls == ["join", "wrap", "close"]


def test_a_layout_the_backend_cannot_run_is_refused_before_the_model_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the layout was checked")

    monkeypatch.setattr("hybridflow.backends.common.modeling.load_model", never)
    with pytest.raises(ValueError, match=r"RoleLayout\(actor\)\.tp=2: the torch backend has no tensor parallelism"):
        TorchRoleEngine(role_spec(), layout(dp=1, tp=2, rollout_tp=2), context())


def test_a_frozen_role_has_no_optimizer_and_no_trainable_parameters() -> None:
    engine = TorchRoleEngine(role_spec("reference", RoleKind.FROZEN_POLICY), layout("reference", dp=1), context())
    assert engine.optimizer is None
    assert not any(param.requires_grad for param in engine.model.parameters())
    assert not engine.model.training
    trainable = TorchRoleEngine(role_spec(), layout(dp=1), context())
    assert trainable.optimizer is not None
    assert all(param.requires_grad for param in trainable.model.parameters())
