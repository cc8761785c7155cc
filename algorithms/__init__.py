"""Built-in RL algorithms as graphs, and the tensor maths they use.

Importing this package registers the graphs (torch-free; on-policy distillation's in :mod:`.distill`, GRPO with an
LLM judge's in :mod:`.judge`, DPO's in :mod:`.dpo`); ``hybridflow.algorithms.functions`` registers the compute
functions and losses (needs torch).
"""

from hybridflow.algorithms.distill import on_policy_distill
from hybridflow.algorithms.dpo import dpo
from hybridflow.algorithms.graphs import (
    dr_grpo,
    grpo,
    grpo_no_ref,
    gspo,
    ppo,
    reinforce_pp,
    reinforce_pp_baseline,
    remax,
    rloo,
)
from hybridflow.algorithms.judge import grpo_judge

__all__ = ["dpo", "dr_grpo", "grpo", "grpo_judge", "grpo_no_ref", "gspo", "on_policy_distill", "ppo", "reinforce_pp",
           "reinforce_pp_baseline", "remax", "rloo"]
