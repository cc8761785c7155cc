"""The update loop every training backend shares: epochs x mini batches x micro batches.

Backends differ only in how one micro batch goes backward, how ranks agree that every loss was finite,
and how an optimizer step is taken (:class:`GradientSteps` hooks); the order of the loops, the loss
weighting and the metric averaging are written once, here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from hybridflow.backends.common import modeling
from hybridflow.backends.common.micro_batches import MicroBatching

from hybridflow.graph import DETACHED_LOGPROBS, RoleKind
from hybridflow.loss_norm import TOKEN_MEAN_METRICS, LossNorm, accepts_norm, loss_norm
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.errors import NonFiniteLossError
from hybridflow.runtime.protocols import LossFn, OptimSpec, RoleSpec, WorkerContext

SCHEDULE_FILE = "schedule.json"  # in each trainable role's checkpoint directory: {"updates": N}


def accumulate(mini: Batch, *, micro_batches: list[Batch], forward: Callable[[Batch], dict[str, torch.Tensor]],
               loss: LossFn, options: Mapping[str, Any], backward: Callable[[torch.Tensor], None],
               norm: LossNorm | None = None, ranks: int = 1,
               detached: str | None = None) -> tuple[dict[str, float], bool]:
    """Forward and backward every micro batch of ``mini`` (``micro_batches``, its consecutive pieces); returns
    (metrics, all losses finite).

    With ``norm`` (the counts of the whole mini batch over all ``ranks``) each micro loss is its additive
    share of the mini batch's loss, so the accumulated gradient is the mini batch's however it is cut;
    it goes backward times ``ranks``, undoing the mean the gradient all-reduce takes over ranks. Without
    one (a loss that takes no ``norm``), micro losses are means weighted by their share of rows. The
    ``loss`` metric is the mini batch's loss on this rank's share, the others are row-weighted means.
    Stops at the first non-finite loss without calling ``backward`` on it. ``detached``: a field the loss reads
    that is this forward's own log-probs, detached (a single on-policy pass: the old log-probs, whose pass the
    graph skipped, :mod:`hybridflow.graph.skipping`).
    """
    sums: dict[str, float] = {}
    kwargs = {**options, "norm": norm} if norm is not None else options
    for micro in micro_batches:
        fields = {name: micro.tensors[name] for name in micro.tensors}
        outputs = forward(micro)
        if detached is not None:
            fields[detached] = outputs["logprobs"].detach()
        value, stats = loss(outputs=outputs, batch=fields, **kwargs)
        if not torch.isfinite(value):
            return sums, False
        weight = len(micro) / len(mini)
        factor = ranks if norm is not None else weight
        backward(value * factor)
        sums["loss"] = sums.get("loss", 0.0) + float(value.detach()) * factor
        tokens = trained_tokens(micro)
        sums[TOKENS] = sums.get(TOKENS, 0.0) + tokens
        for key, stat in stats.items():
            # Per-token means add up as token sums (divided once the update's tokens are counted on every rank).
            share = tokens if key in TOKEN_MEAN_METRICS else weight
            sums[key] = sums.get(key, 0.0) + float(torch.as_tensor(stat).detach()) * share
    return sums, True


TOKENS = "_trained_tokens"  # accumulate's count of loss-mask tokens, folded into the token means by train_step


def trained_tokens(batch: Batch) -> float:
    """Tokens a loss trains on in ``batch``: its ``loss_mask`` (``response_mask`` without one; 0 without either)."""
    name = "loss_mask" if "loss_mask" in batch else "response_mask"
    return float(batch[name].sum()) if name in batch else 0.0


def detached_field(role: str, options: Mapping[str, Any],
                   optim: OptimSpec) -> tuple[Mapping[str, Any], str | None]:
    """The loss's options without ``detached_logprobs`` and the field it names (None: the update reads its old
    log-probs as an input). Refused unless the update is a single pass (one epoch, one mini batch): after a first
    optimizer step the update's own log-probs are no longer the rollout policy's."""
    if DETACHED_LOGPROBS not in options:
        return options, None
    if optim.epochs != 1 or optim.mini_batches != 1:
        raise ValueError(f"role {role!r}: the update computes {options[DETACHED_LOGPROBS]!r} from its own forward "
                         f"(option {DETACHED_LOGPROBS}), which holds for a single pass only, but it runs "
                         f"epochs={optim.epochs}, mini_batches={optim.mini_batches}: keep the log-prob node "
                         "(build the graph without with_detached_logprobs for this role)")
    rest = {key: value for key, value in options.items() if key != DETACHED_LOGPROBS}
    return rest, str(options[DETACHED_LOGPROBS])


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters an optimizer steps: all of a fully trained model, a LoRA policy's adapters alone."""
    return [param for param in model.parameters() if param.requires_grad]


def non_finite(role: str, what: str = "loss on a rank") -> NonFiniteLossError:
    return NonFiniteLossError(f"role {role!r}: non-finite {what}; the step was aborted before the optimizer step "
                              "(lower the learning rate or check the inputs)")


def clip_and_step(role: str, model: Any, optimizer: torch.optim.Optimizer, grad_clip: float, *, set_to_none: bool,
                  whole: Callable[[torch.Tensor], torch.Tensor] = lambda norm: norm,
                  clip: Callable[[list[torch.nn.Parameter], float], torch.Tensor] | None = None) -> dict[str, float]:
    """Clip the gradients to ``grad_clip`` and take the optimizer step; a non-finite norm zeroes the gradients and
    raises instead. ``whole`` turns a sharded norm into the whole one (FSDP's DTensor); ``clip`` replaces
    ``clip_grad_norm_`` (returning the norm before clipping), for parameters it cannot norm together."""
    params = list(model.parameters())
    norm = clip or torch.nn.utils.clip_grad_norm_
    grad_norm = whole(norm(params, grad_clip))
    if not torch.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=set_to_none)
        raise non_finite(role, "gradient norm")
    optimizer.step()
    return {"grad_norm": float(grad_norm), "lr": float(optimizer.param_groups[0]["lr"])}


class GradientSteps(MicroBatching):
    """``train_step`` for an engine: the shared loop over the hooks below.

    Engines set ``spec``, ``micro_batch_size``, ``max_tokens`` (a token budget per micro batch, 0: rows) and
    ``padding`` and implement :meth:`training_forward` (what the loss
    reads), :meth:`zero_grad`, :meth:`backward` and :meth:`optimizer_step`, which makes every rank agree
    on ``finite`` (raising :func:`non_finite` when a rank saw a bad loss), clips and steps, returning
    ``grad_norm``/``lr`` metrics (``engine.TrainingEngine`` declares the hooks a training backend fills in).
    """

    spec: RoleSpec
    context: WorkerContext
    micro_batch_size: int
    max_tokens: int = 0  # the layout's token budget of an update micro batch (0: rows)
    weights_version: int = 0  # train_step calls that stepped the optimizer: the version of the current weights

    def train_step(self, batch: Batch, *, loss: LossFn, options: Mapping[str, Any]) -> dict[str, float]:
        if not self.spec.kind.trainable:
            raise TypeError(f"role {self.spec.name!r} ({self.spec.kind}) is frozen and cannot be updated")
        optim = self.spec.optim or OptimSpec()
        options, detached = detached_field(self.spec.name, options, optim)
        totals: dict[str, float] = {}
        steps = 0
        global_norm = accepts_norm(loss)
        if optim.lr_scheduler != "constant" or optim.warmup:  # a constant rate stays the optimizer's own
            for group in self.param_groups():  # the schedule's rate for this update, whatever the backend
                group["lr"] = optim.lr * optim.lr_factor(self.weights_version)
        self.train_mode(True)
        try:
            for _ in range(optim.epochs):
                padded, _pad = batch.pad_to_multiple(optim.mini_batches)
                for mini in padded.chunk(optim.mini_batches):
                    self.zero_grad()
                    micros = self.micro_batches(mini, rows=self.micro_batch_size, max_tokens=self.max_tokens)
                    norm = self.mini_batch_norm(mini) if global_norm else None
                    sums, finite = accumulate(mini, micro_batches=micros,
                                              forward=self.training_forward, loss=loss, options=options,
                                              backward=self._backward_calls(len(micros)), norm=norm,
                                              ranks=self.data_parallel_ranks(), detached=detached)
                    for key, value in {**sums, **self.optimizer_step(finite, optim)}.items():
                        totals[key] = totals.get(key, 0.0) + value
                    steps += 1
        finally:
            self.train_mode(False)
            if steps:
                self.weights_version += 1
        return self.update_metrics(totals, steps)

    def update_metrics(self, totals: dict[str, float], steps: int) -> dict[str, float]:
        """Means over the update's optimizer steps; the :data:`TOKEN_MEAN_METRICS` as exact means over every trained
        token of the update on all ranks (whatever the loss aggregation, micro batches or ranks)."""
        tokens = totals.pop(TOKENS, 0.0)
        means = {key: value / steps for key, value in totals.items() if key not in TOKEN_MEAN_METRICS}
        keys = sorted(key for key in totals if key in TOKEN_MEAN_METRICS)
        if keys:
            *sums, count = self.sum_over_ranks([*(totals[key] for key in keys), tokens])
            means.update({key: value / count if count > 0 else 0.0 for key, value in zip(keys, sums, strict=True)})
        return means

    def mini_batch_norm(self, mini: Batch) -> LossNorm | None:
        """The counts of the whole mini batch: this rank's rows plus every other rank's (the same T everywhere:
        the controller cuts one batch into rows). Tokens are those of ``loss_mask`` when the update reads it (the
        mask the built-in losses aggregate with), else of ``response_mask``."""
        name = "loss_mask" if "loss_mask" in mini else "response_mask"
        if name not in mini:
            return None
        local = loss_norm(mini[name])
        tokens, seqs = self.sum_over_ranks([local.tokens, local.seqs])
        return LossNorm(tokens=tokens, seqs=seqs, horizon=local.horizon)

    def data_parallel_ranks(self) -> int:
        """The ranks the gradient all-reduce averages over: the group's, unless tensor-parallel peers share rows."""
        return self.context.world_size

    def sum_over_ranks(self, values: list[float]) -> list[float]:
        """``values`` summed over the group's ranks (through the context's collective)."""
        flat = torch.tensor(values, dtype=torch.float64)
        self.context.collective.all_reduce_mean([flat])
        return (flat * self.context.world_size).tolist()

    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups, whose ``lr`` the schedule sets before each update (default: those
        of an ``optimizer`` attribute)."""
        optimizer = getattr(self, "optimizer", None)
        if optimizer is None:
            raise TypeError(f"role {self.spec.name!r}: the engine exposes no optimizer parameter groups for the "
                            "learning-rate schedule (implement GradientSteps.param_groups)")
        groups: list[dict[str, Any]] = optimizer.param_groups
        return groups

    def save_schedule(self, directory: str) -> None:
        """Write the updates taken so far (the schedule's position) beside the role's checkpoint (rank 0)."""
        if self.context.rank == 0:
            path = Path(directory)
            path.mkdir(parents=True, exist_ok=True)
            (path / SCHEDULE_FILE).write_text(json.dumps({"updates": self.weights_version}))

    def load_schedule(self, directory: str) -> None:
        """Resume the schedule where the checkpoint left it (a checkpoint from before schedules: at update 0)."""
        path = Path(directory) / SCHEDULE_FILE
        if path.is_file():
            self.weights_version = int(json.loads(path.read_text())["updates"])

    def training_forward(self, micro: Batch) -> dict[str, torch.Tensor]:
        """What a trainable role's loss reads: values for a critic, log-probs and entropy for a policy."""
        model = self.training_module()
        if self.spec.kind is RoleKind.VALUE:
            return modeling.value_outputs(model, micro, packed=not self.padding)
        return modeling.policy_outputs(model, micro, with_entropy=True, packed=not self.padding)

    def training_module(self) -> Any:
        """The module whose forward builds the graph ``backward`` differentiates."""
        raise NotImplementedError

    def train_mode(self, training: bool) -> None:
        self.training_module().train(training)

    def zero_grad(self) -> None:
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def before_last_backward(self) -> None:
        """Called before a mini-batch's last backward, where a data-parallel engine may start reducing each
        gradient bucket as the backward completes it (default: nothing)."""

    def _backward_calls(self, count: int) -> Callable[[torch.Tensor], None]:
        left = count

        def backward(loss: torch.Tensor) -> None:
            nonlocal left
            left -= 1
            if left == 0:
                self.before_last_backward()
            self.backward(loss)

        return backward

    def optimizer_step(self, finite: bool, optim: OptimSpec) -> dict[str, float]:
        raise NotImplementedError
