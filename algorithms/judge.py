"""GRPO with an LLM judge as the reward: a judge is a graph of ordinary nodes, not a special case.

The actor samples ``n`` responses per prompt; a ``judge_prompts`` compute node renders each (prompt, response,
ground truth) through the judge's template (:mod:`hybridflow.algorithms.judge_templates`) into prompt ids in the
judge's tokens; a ``generate`` on the frozen ``judge`` role (its model ``roles.judge.model``, any tokenizer) samples
one verdict per row, greedy by default, within its own budget ``judge_max_new_tokens`` and, with ``judge_timeout_s``,
its own deadline; a ``judge`` compute node parses each verdict into ``scores`` in [0, 1] (``unparsed_score`` where
it does not parse, counted in the ``judge/unparsed`` metric); GRPO's group-relative advantages and clipped update
follow. docs/judges.md shows the
same graph as a user's file. With ``self_judge`` the policy judges its own samples (as self-rewarding LMs do):
no ``judge`` role is declared, and the verdicts are a second generate on the actor's own engine, its current
weights. Imports no torch.
"""

from __future__ import annotations

import math

from hybridflow.algorithms.graphs import Options, _actor_options, _group_relative, _sample, _top
from hybridflow.algorithms.judge_templates import DEFAULT_SCALE, load_template
from hybridflow.algorithms.modes import LossAgg, ScaleRewards

from hybridflow.graph import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_TEMPERATURE,
    SAMPLE_IMAGES_OPTION,
    TEMPLATE_TOKENS_OPTION,
    TIMEOUT_KEY_OPTION,
    TIMEOUT_OPTION,
    Graph,
    GraphBuilder,
    RoleKind,
)
from hybridflow.registry import ALGORITHMS

JUDGE = "judge"
DEFAULT_JUDGE_MAX_NEW_TOKENS = 16
JUDGE_PROMPT_INPUTS = ("prompts", "responses", "response_mask", "ground_truth")


def judge_sampling(max_new_tokens: int, temperature: float) -> Options:
    """The judge's generate options: greedy at temperature 0 (the default), else sampled at that temperature."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"algorithm option judge_max_new_tokens={max_new_tokens!r} must be a positive integer "
                         "(the verdict's token budget)")
    if not temperature >= 0:
        raise ValueError(f"algorithm option judge_temperature={temperature} must be >= 0 (0: greedy)")
    if not temperature:
        return {"max_new_tokens": max_new_tokens, "greedy": True}
    return {"max_new_tokens": max_new_tokens, "temperature": temperature}


def add_judge(g: GraphBuilder, *, template: str = "pointwise", verdict: str | None = None, rubric: str = "",
              scale: int = DEFAULT_SCALE, max_new_tokens: int = DEFAULT_JUDGE_MAX_NEW_TOKENS,
              temperature: float = 0.0, unparsed_score: float = 0.0, policy: str = "actor",
              self_judge: bool = False, timeout_s: float | None = None) -> str:
    """Declare the ``judge`` role and the three nodes that turn sampled rows into ``scores``; returns the field.
    The template is loaded here, so a bad one (a field it cannot fill) fails when the graph is built.

    ``self_judge``: the role ``policy`` (declared already) judges instead, a second generate on its own engine
    (no ``judge`` role, no second model). ``timeout_s``: the judge's generate fails the step past it
    (:data:`~hybridflow.graph.TIMEOUT_OPTION`), naming ``judge_timeout_s``."""
    loaded = load_template(template, verdict=verdict, rubric=rubric, scale=scale)
    if not (math.isfinite(unparsed_score) and 0 <= unparsed_score <= 1):
        raise ValueError(f"algorithm option unparsed_score={unparsed_score} must be in [0, 1] (a verdict's scores "
                         "are)")
    if not isinstance(self_judge, bool):
        raise ValueError(f"algorithm option self_judge={self_judge!r} must be true or false")
    judge = policy if self_judge else g.role(JUDGE, RoleKind.FROZEN_POLICY)
    text: Options = {"template": template, "rubric": rubric, "scale": scale, "policy": policy, "judge": judge,
                     **({"verdict": verdict} if verdict is not None else {})}
    g.compute("judge_prompts", fn="judge_prompts", inputs=JUDGE_PROMPT_INPUTS,
              outputs=("judge_prompts", "judge_prompts_mask"), verdict_tokens=max_new_tokens,
              **{TEMPLATE_TOKENS_OPTION: loaded.estimated_tokens()}, **text)
    images: Options = {SAMPLE_IMAGES_OPTION: True}  # a VLM judge's prompts keep the samples' image placeholders
    g.generate(judge, name="judge_generate", inputs=("judge_prompts",), outputs=("verdict_ids", "verdict_mask"),
               **judge_sampling(max_new_tokens, temperature), **judge_deadline(timeout_s), **images)
    g.compute(JUDGE, fn="judge_scores", inputs=("verdict_ids", "verdict_mask"), outputs=("scores", "verdicts"),
              unparsed_score=unparsed_score, **text)
    return "scores"


def judge_deadline(timeout_s: float | None) -> Options:
    """The judge generate's deadline options (none when ``timeout_s`` is unset: the executor's own bounds)."""
    if timeout_s is None:
        return {}
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not (
            math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"algorithm option judge_timeout_s={timeout_s!r} must be a positive number of seconds (or "
                         "unset: no deadline of the judge's own)")
    return {TIMEOUT_OPTION: float(timeout_s), TIMEOUT_KEY_OPTION: "algorithm option judge_timeout_s"}


@ALGORITHMS.register("grpo_judge")
def grpo_judge(*, n: int = 4, kl_coef: float = 0.04, clip_ratio: float = 0.2, clip_ratio_high: float | None = None,
               loss_agg: LossAgg = "token-mean", entropy_coef: float = 0.0, norm_by_std: bool = True,
               temperature: float = DEFAULT_TEMPERATURE, top_p: float = 1.0, top_k: int = 0,
               max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, scale_rewards: ScaleRewards = "group",
               mask_truncated: bool = False, judge_template: str = "pointwise", judge_verdict: str | None = None,
               judge_rubric: str = "", judge_scale: int = DEFAULT_SCALE,
               judge_max_new_tokens: int = DEFAULT_JUDGE_MAX_NEW_TOKENS, judge_temperature: float = 0.0,
               unparsed_score: float = 0.0, teacher_kl_coef: float = 0.0, self_judge: bool = False,
               judge_timeout_s: float | None = None) -> Graph:
    """GRPO whose scores are an LLM judge's verdicts (see the module). ``judge_template``: ``pointwise``,
    ``reference``, ``rubric`` (with ``judge_rubric``: ``"text=weight; ..."``), a file or Jinja text;
    ``judge_verdict`` (``score``, ``binary``, ``rubric``, ``marks``): how a user's template's verdicts parse;
    ``self_judge``: the actor judges its own samples on its own engine; ``judge_timeout_s``: the judge's deadline per
    step; ``teacher_kl_coef`` as on every policy-gradient graph (:mod:`hybridflow.algorithms.teacher`)."""
    g = GraphBuilder("grpo_judge")
    actor = g.role("actor", RoleKind.POLICY)
    g.role("reference", RoleKind.FROZEN_POLICY)
    _sample(g, actor, n=n, temperature=temperature, max_new_tokens=max_new_tokens, mask_truncated=mask_truncated,
            **_top(top_p, top_k))
    add_judge(g, template=judge_template, verdict=judge_verdict, rubric=judge_rubric, scale=judge_scale,
              max_new_tokens=judge_max_new_tokens, temperature=judge_temperature, unparsed_score=unparsed_score,
              self_judge=self_judge, timeout_s=judge_timeout_s)
    g.ref_logprob("reference")
    g.logprob(actor)
    return _group_relative(g, actor, n=n, norm_by_std=norm_by_std, loss="ppo_policy", kl_coef=kl_coef,
                           options=_actor_options(clip_ratio, clip_ratio_high, loss_agg, entropy_coef),
                           scale_rewards=scale_rewards, teacher_kl_coef=teacher_kl_coef)
