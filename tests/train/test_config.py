"""The training config: YAML + dotted overrides onto frozen dataclasses; bad keys and types are named."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.train.config import TrainConfig, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_shipped_configs_load(name: str) -> None:
    assert isinstance(load_config(CONFIGS / name), TrainConfig)


def test_overrides_are_parsed_as_yaml_and_nested() -> None:
    config = load_config(CONFIGS / "grpo_reverse.yaml", ["optim.actor.lr=3e-4", "steps=7", "executor.name=ray",
                                                         "algorithm.options.n=2"])
    assert config.optim.actor.lr == 3e-4 and config.steps == 7 and config.executor.name == "ray"
    assert config.algorithm.options["n"] == 2


def test_unknown_key_is_named_with_its_section(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("optim:\n  actor: {lr: 0.001, learning_rate: 0.1}\n")
    with pytest.raises(KeyError, match=r"'optim\.actor\.learning_rate'.*valid keys"):
        load_config(path)


@pytest.mark.parametrize(("override", "message"), [
    ("steps=ten", "'steps'='ten' must be a int"),
    ("data.batch_size=1.5", "'data.batch_size'=1.5 must be a int"),
    ("executor.name=slurm", "'executor.name'='slurm' must be one of"),
    ("model=3", "'model' must be a mapping"),
    ("logging.plot=1", "'logging.plot'=1 must be a bool"),
])
def test_wrong_types_are_named(override: str, message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        load_config(None, [override])


def test_malformed_override_is_refused() -> None:
    with pytest.raises(ValueError, match=r"dotted\.key=value"):
        load_config(None, ["steps"])


def test_a_partial_optimizer_section_keeps_the_roles_default_lr(tmp_path: Path) -> None:
    """``optim.actor: {grad_clip: ...}`` changes the clip only: the actor's lr stays 1e-3 and the critic's 3e-3 (the
    section class's own default, OptimSpec's 1e-4, used to replace them)."""
    path = tmp_path / "config.yaml"
    path.write_text("optim:\n  actor:\n    grad_clip: 0.5\n  critic:\n    warmup_steps: 2\n")
    config = load_config(path)
    assert (config.optim.actor.lr, config.optim.actor.grad_clip) == (TrainConfig().optim.actor.lr, 0.5) == (1e-3, 0.5)
    assert (config.optim.critic.lr, config.optim.critic.warmup_steps) == (3e-3, 2)
    assert load_config(path, ["optim.actor.lr=2e-5"]).optim.actor.lr == 2e-5


@pytest.mark.parametrize("value", ["-1", ".inf", "soon"])
def test_a_bad_sigterm_grace_is_named(value: str) -> None:
    with pytest.raises((ValueError, TypeError), match=r"'checkpoint\.sigterm_grace_s'"):
        load_config(None, [f"checkpoint.sigterm_grace_s={value}"])


def test_trls_jit_checkpoint_maps_onto_the_sigterm_grace() -> None:
    assert load_config(None, ["checkpoint.sigterm_grace_s=5"]).checkpoint.sigterm_grace_s == 5.0
    default = TrainConfig().checkpoint.sigterm_grace_s
    assert load_config(None, ["enable_jit_checkpoint=true"]).checkpoint.sigterm_grace_s == default > 0
    assert load_config(None,
                       ["enable_jit_checkpoint=false"]).checkpoint.sigterm_grace_s == 0  # TRL's: SIGTERM stops at once
