"""Costs of another framework's runtime, laid over the cost model when the planner prices that framework's runs.

The planner models hybridflow: its :class:`~hybridflow.planner.plan.Plan` and run settings hold only what
hybridflow executes. To calibrate on published runs of another framework, what that framework does and
hybridflow does not is priced here, and only when a caller passes the overlay (``evaluate_mapping(...,
overlay=...)``; ``hybridflow.planner.published`` does for verl's records).

:class:`ControllerOverlay` is verl's single-controller data path: every worker call ships the step's whole
batch from the controller to the workers (``DataProto`` through the Ray object store) and its outputs back,
padded to the length caps. hybridflow's runtime keeps a step's fields on the ranks and ships only what a
group lacks (``hybridflow.runtime.step_store``), which the schedule's cross-group edges price.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybridflow.graph import NodeLoad, Op

if TYPE_CHECKING:
    from hybridflow.planner.costs import Shape

TOKEN_ID_BYTES = 8  # verl's DataProto holds token ids, masks and positions as int64
SCORE_BYTES = 4  # and per-token log-probs, entropies, advantages, returns as fp32
# fp32 per-token fields a call carries in (beside the token tensors) and returns, by op: a forward returns its
# log-probs (the policy's old_log_prob also its entropy); the update takes old log-probs, advantages,
# returns, token-level scores and rewards.
CONTROLLER_FIELDS = {Op.GENERATE: (0, 0), Op.LOGPROB: (0, 2), Op.REF_LOGPROB: (1, 1), Op.VALUES: (1, 1),
                     Op.SCORE: (1, 1), Op.UPDATE: (5, 0)}


@dataclass(frozen=True, kw_only=True)
class ControllerOverlay:
    """verl's single controller: its synchronous trainer makes the step's calls one after another, the driver's
    rule-based reward included (``ray_trainer.fit``: ``reward`` before ``old_log_prob``, unless
    ``launch_reward_fn_async``), where hybridflow's schedule overlaps a driver node with the GPU nodes that do not
    need it (``serial_driver``); and it ships every call's batch, padded to the run's prompt cap
    (``RunSettings.max_prompt_len`` [``data.max_prompt_length``]; None: the mean prompt) and response cap. The rate
    is the calibrated ``Constants.controller_gbs`` (serialise, object store, deserialise), fitted on verl's runs and
    read only here."""

    serial_driver: bool = True


def controller_seconds(load: NodeLoad, shape: Shape, prompt_len: float | None = None) -> float:
    """One worker call's batch through the controller and back, 0 without a :class:`ControllerOverlay`.

    A row carries prompts (``P``), responses and the response mask (``R`` each), input ids, attention mask
    and positions (``P + R`` each) as int64, plus the op's fp32 per-token fields (``CONTROLLER_FIELDS``);
    a generate call returns the token tensors. ``P`` is ``max_prompt_len`` (else the mean prompt), ``R``
    the response cap. The controller serialises and ships them at ``controller_gbs``.
    """
    if shape.overlay is None:
        return 0.0
    run = shape.run
    rows = max(load.sequences, 1)
    prompt = run.max_prompt_len or (prompt_len if prompt_len is not None else load.prompt_tokens / rows)
    response = run.lengths.max if run.lengths is not None else load.response_tokens / rows
    tokens = TOKEN_ID_BYTES * (prompt + 2 * response + 3 * (prompt + response))
    fields_in, fields_out = CONTROLLER_FIELDS.get(load.op, (0, 0))
    per_row = tokens + SCORE_BYTES * response * (fields_in + fields_out)
    return rows * per_row / (shape.constants.controller_gbs * 1e9)
