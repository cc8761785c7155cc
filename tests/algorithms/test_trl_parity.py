"""Loss, KL and entropy definitions against TRL 1.16's own code, on identical samples.

TRL's ``GRPOTrainer._compute_loss`` and helpers are read from the installed package's source and executed on
a stub trainer (importing ``trl.trainer.grpo_trainer`` would pull vLLM and accelerate: a minute of the suite's
budget); the same per-token log-probs, reference log-probs, advantages and entropies then go through our
``ppo_policy`` loss with the options docs/algorithms.md maps each TRL ``loss_type`` to. Value, gradient and the
``kl`` / ``entropy`` metrics must agree.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hybridflow.algorithms import core

from hybridflow.registry import LOSSES

ROWS, STEPS, BETA, MAX_LEN = 6, 5, 0.04, 8


def _trl_source() -> Path:
    spec = importlib.util.find_spec("trl")
    if spec is None or spec.origin is None or not importlib.metadata.version("trl").startswith("1.16"):
        pytest.skip("needs trl 1.16 installed (pip install trl==1.16.0)")
    return Path(spec.origin).parent / "trainer"


def _functions(path: Path, names: set[str], namespace: dict[str, Any]) -> dict[str, Any]:
    """The top-level or method definitions ``names`` of ``path``, compiled into ``namespace`` (TRL's own code)."""
    tree = ast.parse(path.read_text())
    found = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name in names]
    for node in found:
        node.decorator_list = []
    exec(compile(ast.Module(body=found, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


class _Accelerator:
    num_processes, sync_gradients = 1, True

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return tensor

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    gather_for_metrics = gather


@functools.cache
def _trl_code() -> dict[str, Any]:
    folder = _trl_source()
    namespace = _functions(folder / "utils.py", {"nanmin", "nanmax"}, {"torch": torch})
    return _functions(folder / "grpo_trainer.py", {"_compute_loss"}, namespace)


def _trl_loss(loss_type: str, batch: dict[str, torch.Tensor], live: torch.Tensor, entropy: torch.Tensor
              ) -> tuple[torch.Tensor, dict[str, list[float]]]:
    namespace = _trl_code()
    metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list)}
    trainer = SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=BETA,
        loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.2, use_vllm=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=MAX_LEN, accelerator=_Accelerator(),
        _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics=metrics,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        _get_per_token_logps_and_entropies=lambda *a, **k: (live, entropy, None))
    mask = batch["response_mask"]
    inputs = {"prompt_ids": torch.ones(ROWS, 2, dtype=torch.long), "prompt_mask": torch.ones(ROWS, 2),
              "completion_ids": torch.ones(ROWS, STEPS, dtype=torch.long), "completion_mask": mask,
              "advantages": batch["advantages"][:, 0], "ref_per_token_logps": batch["ref_logprobs"],
              "num_items_in_batch": mask.sum()}
    loss = namespace["_compute_loss"](trainer, None, inputs)
    return loss, metrics["train"]


OURS = {"grpo": {"loss_agg": "seq-mean-token-mean"}, "bnpo": {"loss_agg": "token-mean"},
        "dr_grpo": {"loss_agg": "seq-mean-token-sum-norm", "loss_scale_factor": MAX_LEN},
        "dapo": {"loss_agg": "token-mean"}}


def _samples(seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 3, 1, 4, 2, 5])  # ragged, none empty (TRL's grpo counts empty rows, ours skips them)
    mask = (torch.arange(STEPS)[None, :] < lengths[:, None]).float()
    logps = -1.5 + 0.5 * torch.randn(ROWS, STEPS, generator=gen)
    ref = logps + 0.4 * torch.randn(ROWS, STEPS, generator=gen)  # a policy that moved: KL well above 0
    advantages = torch.randn(ROWS, 1, generator=gen).expand(ROWS, STEPS) * mask
    entropy = 2.0 * torch.rand(ROWS, STEPS, generator=gen)
    batch = {"response_mask": mask, "loss_mask": mask, "old_logprobs": logps, "ref_logprobs": ref,
             "advantages": advantages}
    return batch, logps, entropy


@pytest.mark.parametrize("loss_type", sorted(OURS))
def test_loss_gradient_kl_and_entropy_match_trl(loss_type: str) -> None:
    batch, logps, entropy = _samples(0)
    theirs_live = logps.clone().requires_grad_(True)
    theirs, logged = _trl_loss(loss_type, batch, theirs_live, entropy)
    (theirs_grad,) = torch.autograd.grad(theirs, theirs_live)
    ours_live = logps.clone().requires_grad_(True)
    norm = core.loss_norm(batch["loss_mask"])  # the whole batch in one micro batch on one rank
    ours, metrics = LOSSES.get("ppo_policy")(outputs={"logprobs": ours_live, "entropy": entropy}, batch=batch,
                                             kl_coef=BETA, kl_type="k3", norm=norm, **OURS[loss_type])
    (ours_grad,) = torch.autograd.grad(ours, ours_live)
    torch.testing.assert_close(ours, theirs.to(ours.dtype), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_grad, theirs_grad, rtol=1e-5, atol=1e-7)
    assert float(metrics["kl"]) == pytest.approx(logged["kl"][0], rel=1e-5)  # true per-token means, both
    assert float(metrics["entropy"]) == pytest.approx(logged["entropy"][0], rel=1e-5)
    assert logged["kl"][0] > 0.05  # the samples exercise the KL term


def test_entropy_and_kl_metrics_do_not_depend_on_the_loss_aggregation() -> None:
    batch, logps, entropy = _samples(1)
    logged = {mode: LOSSES.get("ppo_policy")(outputs={"logprobs": logps, "entropy": entropy}, batch=batch,
                                             kl_coef=BETA, loss_agg=mode)[1] for mode in core.LOSS_AGGS}
    want = float((entropy * batch["loss_mask"]).sum() / batch["loss_mask"].sum())
    for mode, metrics in logged.items():
        assert float(metrics["entropy"]) == pytest.approx(want, rel=1e-6), mode
        assert float(metrics["kl"]) == pytest.approx(float(logged["token-mean"]["kl"]), rel=1e-6), mode
