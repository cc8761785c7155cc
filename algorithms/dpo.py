"""Direct preference optimisation (DPO, https://arxiv.org/abs/2305.18290) as a built-in graph, offline: no rollout.

Each step's batch is preference pairs from the dataset, two rows a pair (:data:`~hybridflow.graph.PAIR_INPUTS`:
the chosen and the rejected response, tied by ``pair``, told apart by ``chosen``). The frozen ``reference`` takes
the responses' log-probs once per batch; the ``actor``'s update minimises the ``dpo`` loss
(:mod:`hybridflow.algorithms.preference`) on the summed log-probs of each response under both. Nothing is
generated or scored. Imports no torch.
"""

from __future__ import annotations

from hybridflow.algorithms.graphs import TRAINED, Options
from hybridflow.algorithms.modes import DPOLossType, check_dpo_options

from hybridflow.graph import PAIR_INPUTS, Graph, GraphBuilder, RoleKind
from hybridflow.registry import ALGORITHMS


@ALGORITHMS.register("dpo")
def dpo(*, beta: float = 0.1, loss_type: DPOLossType = "sigmoid", label_smoothing: float = 0.0, sft_coef: float = 0.0,
        reward_kind: RoleKind | str = RoleKind.REWARD_FUNCTION) -> Graph:
    """DPO of ``actor`` against ``reference`` on the dataset's preference pairs (TRL's ``DPOTrainer``).

    ``beta``: the pull to the reference; ``loss_type``: ``sigmoid`` (DPO; with ``label_smoothing`` ε,
    conservative DPO), ``ipo``, ``hinge`` or ``robust`` (TRL's names); ``sft_coef`` > 0 adds that times the chosen
    responses' negative log-likelihood (RPO; TRL's ``"sft"`` loss type beside it). ``reward_kind`` is accepted for a
    uniform call from the config and unused: the graph scores nothing."""
    del reward_kind  # no reward role: the preferences are the signal
    check_dpo_options(beta=beta, loss_type=loss_type, label_smoothing=label_smoothing, sft_coef=sft_coef)
    g = GraphBuilder("dpo", inputs=PAIR_INPUTS)
    actor = g.role("actor", RoleKind.POLICY)
    reference = g.role("reference", RoleKind.FROZEN_POLICY)
    g.ref_logprob(reference)
    options: Options = {key: value for key, value in (("label_smoothing", label_smoothing), ("sft_coef", sft_coef))
                        if value}  # left out at their defaults (0: off)
    g.update(actor, loss="dpo", inputs=(*TRAINED, "ref_logprobs", "pair", "chosen"), beta=beta, loss_type=loss_type,
             **options)
    return g.build()
