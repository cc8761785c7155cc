"""DPO: the loss against TRL 1.16's own code, the graph's shape, preference data, and a short CPU training run.

TRL's ``DPOTrainer._compute_loss`` is read from the installed package's source and executed on a stub trainer and a
stub model that returns fixed per-token log-probs (importing ``trl.trainer.dpo_trainer`` would pull accelerate and
datasets: seconds of the suite's budget), as tests/algorithms/test_trl_parity.py does for GRPO.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.metadata
import importlib.util
import math
import warnings
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hybridflow.registry import LOSSES

PAIRS, STEPS = 5, 6


def _trl_compute_loss() -> Any:
    spec = importlib.util.find_spec("trl")
    if spec is None or spec.origin is None or not importlib.metadata.version("trl").startswith("1.16"):
        pytest.skip("needs trl 1.16 installed (pip install trl==1.16.0)")
    return _compiled(str(Path(spec.origin).parent / "trainer" / "dpo_trainer.py"))


@functools.cache
def _compiled(path: str) -> Any:
    tree = ast.parse(Path(path).read_text())
    found = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "_compute_loss"
             and any(isinstance(a, ast.arg) and a.arg == "return_outputs" for a in node.args.args)]
    assert len(found) == 1, "TRL's DPOTrainer._compute_loss moved"
    namespace: dict[str, Any] = {"torch": torch, "F": F, "math": math, "warnings": warnings,
                                 "contextlib": contextlib}
    exec(compile(ast.Module(body=found, type_ignores=[]), path, "exec"), namespace)
    return namespace["_compute_loss"]


class _Accelerator:
    device = torch.device("cpu")

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    gather_for_metrics = gather


def _samples(seed: int) -> dict[str, torch.Tensor]:
    """Per-token policy and reference log-probs of PAIRS chosen then PAIRS rejected responses, ragged lengths."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 3, 1, 4, 5, 2, 6, 4, 3, 5])
    mask = (torch.arange(STEPS)[None, :] < lengths[:, None]).float()
    logps = (-1.5 + 0.6 * torch.randn(2 * PAIRS, STEPS, generator=gen)) * mask
    ref = (logps + 0.5 * torch.randn(2 * PAIRS, STEPS, generator=gen)) * mask
    return {"logps": logps, "ref": ref, "mask": mask}


def _trl_loss(loss_type: str, beta: float, label_smoothing: float, samples: dict[str, torch.Tensor],
              live: torch.Tensor) -> tuple[torch.Tensor, dict[str, list[float]]]:
    """TRL's loss: the batch is [chosen; rejected], each row a 1-token prompt then the completion."""
    rows = 2 * PAIRS
    completion_mask = torch.cat([torch.zeros(rows, 1), samples["mask"]], dim=1).long()  # (2P, 1 + T)
    per_token = live  # (2P, T): log-prob of token t+1 from position t, the completion's tokens
    model = SimpleNamespace(training=True)
    outputs = SimpleNamespace(log_probs=per_token, entropy=torch.zeros(rows, STEPS),
                              mean_logits=torch.zeros(rows, STEPS), is_top1=torch.zeros(rows, STEPS, dtype=torch.bool))
    metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list)}
    ref_sums = samples["ref"].sum(dim=1)
    trainer = SimpleNamespace(
        model=model, accelerator=_Accelerator(), aux_loss_enabled=False, precompute_ref_logps=True, ld_alpha=None,
        f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0], beta=beta,
        label_smoothing=label_smoothing, use_weighting=False, _metrics=metrics, _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.ones(rows, STEPS + 1, dtype=torch.long), "attention_mask": torch.ones(rows, STEPS + 1),
              "completion_mask": completion_mask, "ref_chosen_logps": ref_sums[:PAIRS],
              "ref_rejected_logps": ref_sums[PAIRS:]}
    loss = _trl_compute_loss()(trainer, lambda **_: outputs, inputs, False)
    return loss, metrics["train"]


def _ours(loss_type: str, beta: float, label_smoothing: float, samples: dict[str, torch.Tensor],
          live: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Ours: the same rows interleaved (a pair's rows adjacent, rejected first), paired by ``pair`` / ``chosen``."""
    order = torch.stack([torch.arange(PAIRS, 2 * PAIRS), torch.arange(PAIRS)], dim=1).flatten()
    batch = {"loss_mask": samples["mask"][order], "ref_logprobs": samples["ref"][order],
             "pair": (order % PAIRS) + 10, "chosen": (order < PAIRS).long()}
    return LOSSES.get("dpo")(outputs={"logprobs": live[order]}, batch=batch, beta=beta, loss_type=loss_type,
                             label_smoothing=label_smoothing)


@pytest.mark.parametrize(("loss_type", "beta", "label_smoothing"),
                         [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.0), ("ipo", 0.1, 0.0), ("ipo", 0.8, 0.0),
                          ("hinge", 0.3, 0.0), ("robust", 0.2, 0.1)])
def test_dpo_loss_gradient_and_metrics_match_trl(loss_type: str, beta: float, label_smoothing: float) -> None:
    samples = _samples(0)
    theirs_live = samples["logps"].clone().requires_grad_(True)
    theirs, logged = _trl_loss(loss_type, beta, label_smoothing, samples, theirs_live)
    (theirs_grad,) = torch.autograd.grad(theirs, theirs_live)
    ours_live = samples["logps"].clone().requires_grad_(True)
    ours, metrics = _ours(loss_type, beta, label_smoothing, samples, ours_live)
    (ours_grad,) = torch.autograd.grad(ours, ours_live)
    torch.testing.assert_close(ours, theirs.to(ours.dtype), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours_grad * samples["mask"], theirs_grad * samples["mask"], rtol=0, atol=1e-6)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected"):
        assert float(metrics[key]) == pytest.approx(logged[key][0], abs=1e-6), key
    assert 0.0 < logged["rewards/accuracies"][0] < 1.0  # the samples have pairs won and lost
    assert float(theirs.detach()) > 1e-3 and float(theirs_grad.abs().sum()) > 1e-3


def test_sigmoid_label_smoothing_is_conservative_dpo() -> None:
    """TRL 1.16's sigmoid ignores label_smoothing; ours is conservative DPO (TRL's sigmoid before 1.0), checked
    against its formula."""
    samples, eps, beta = _samples(1), 0.2, 0.3
    ours, _ = _ours("sigmoid", beta, eps, samples, samples["logps"])
    sums, ref = samples["logps"].sum(dim=1), samples["ref"].sum(dim=1)
    delta = (sums[:PAIRS] - ref[:PAIRS]) - (sums[PAIRS:] - ref[PAIRS:])
    want = (-(1 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)).mean()
    torch.testing.assert_close(ours, want, rtol=0, atol=1e-6)
    plain, _ = _ours("sigmoid", beta, 0.0, samples, samples["logps"])
    assert abs(float(ours) - float(plain)) > 1e-3


def test_a_cut_pair_is_refused_naming_it() -> None:
    samples = _samples(2)
    batch = {"loss_mask": samples["mask"][:3], "ref_logprobs": samples["ref"][:3], "pair": torch.tensor([0, 0, 1]),
             "chosen": torch.tensor([1, 0, 1])}
    with pytest.raises(ValueError, match="preference pair 1 has 1 row"):
        LOSSES.get("dpo")(outputs={"logprobs": samples["logps"][:3]}, batch=batch)


@pytest.mark.parametrize(("options", "match"), [({"beta": 0.0}, "beta=0.0"), ({"loss_type": "nca"}, "loss_type"),
                                                ({"loss_type": "ipo", "label_smoothing": 0.1}, "label_smoothing")])
def test_bad_options_are_named(options: dict[str, Any], match: str) -> None:
    samples = _samples(3)
    batch = {"loss_mask": samples["mask"][:2], "ref_logprobs": samples["ref"][:2], "pair": torch.tensor([0, 0]),
             "chosen": torch.tensor([1, 0])}
    with pytest.raises(ValueError, match=match):
        LOSSES.get("dpo")(outputs={"logprobs": samples["logps"][:2]}, batch=batch, **options)
