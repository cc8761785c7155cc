"""A teacher's term in a policy-gradient graph: on-policy distillation's per-token reverse KL (torch-free).

A ``teacher`` role (a frozen policy with a model of its own, ``roles.teacher.model``, sharing the student's
tokenizer) scores the sampled tokens (a ``ref_logprob`` node writing ``teacher_logprobs``), and a
``teacher_kl_advantages`` compute node turns ``teacher_logprobs - old_logprobs`` on the loss mask into
advantages. :mod:`hybridflow.algorithms.distill` builds a graph on that term alone; ``teacher_kl_coef`` on the
policy-gradient graphs of :mod:`hybridflow.algorithms.graphs` adds it, times the coefficient, to whatever
advantages the graph computes (slime's ``--opd-kl-coef``).
"""

from __future__ import annotations

from hybridflow.graph import GraphBuilder, RoleKind

TEACHER = "teacher"
TEACHER_LOGPROBS = "teacher_logprobs"
TASK_ADVANTAGES = "task_advantages"  # what a graph's own advantage node writes when the teacher's term follows


def check_teacher_kl_coef(teacher_kl_coef: float) -> None:
    if not teacher_kl_coef >= 0:
        raise ValueError(f"algorithm option teacher_kl_coef={teacher_kl_coef} must be >= 0 (0: no teacher); a "
                         "negative coefficient would push the policy away from the teacher")


def advantages_field(teacher_kl_coef: float) -> str:
    """The field a graph's own advantage node writes: ``advantages``, or ``task_advantages`` when the teacher's
    term is added after it (:func:`add_teacher_kl`, which then writes ``advantages``)."""
    check_teacher_kl_coef(teacher_kl_coef)
    return TASK_ADVANTAGES if teacher_kl_coef else "advantages"


def teacher_logprobs(g: GraphBuilder) -> str:
    """Declare the ``teacher`` role and its log-probs of the sampled responses; returns the field."""
    teacher = g.role(TEACHER, RoleKind.FROZEN_POLICY)
    g.ref_logprob(teacher, name="teacher_logprob", outputs=(TEACHER_LOGPROBS,))
    return TEACHER_LOGPROBS


def add_teacher_kl(g: GraphBuilder, teacher_kl_coef: float) -> None:
    """With ``teacher_kl_coef`` > 0: the teacher, and a ``teacher_kl`` node writing ``advantages`` as
    ``task_advantages + teacher_kl_coef * (teacher_logprobs - old_logprobs)`` on the loss mask. Nothing at 0."""
    check_teacher_kl_coef(teacher_kl_coef)
    if not teacher_kl_coef:
        return
    field = teacher_logprobs(g)
    g.compute("teacher_kl", fn="teacher_kl_advantages", inputs=(field, "old_logprobs", "loss_mask", TASK_ADVANTAGES),
              outputs=("advantages",), teacher_kl_coef=teacher_kl_coef)
