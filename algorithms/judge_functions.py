"""The driver-side steps of an LLM judge: render its prompts, parse its verdicts into scores.

``judge_prompts`` decodes each sampled row (the policy's tokenizer), renders it through the judge's template
(:mod:`hybridflow.algorithms.judge_templates`) and encodes the text in the judge's tokenizer (its chat template,
when it has one): ``judge_prompts`` (B, P) left-padded and ``judge_prompts_mask`` (B, P), which a ``generate`` on
the judge's role reads as its prompts. ``judge_scores`` decodes the judge's responses and parses each verdict:
``scores`` (B,) in [0, 1] and ``verdicts`` (the text, for the run's sample tables); a verdict that does not parse
scores ``unparsed_score`` and is counted in the node's ``unparsed`` metric (``unparsed_frac``: its share).

Both read tokenizers, so each keeps a :class:`JudgeText` (``make_state``, with the roles' model directories the
controller passes to a function with ``reads_role_models``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from hybridflow.algorithms.judge_templates import DEFAULT_SCALE, JudgeTemplate, load_template

from hybridflow.models.tiny import TINY_CONFIGS
from hybridflow.models.tokenizer import char_tokenizer, load_tokenizer
from hybridflow.models.vision import VISION_TOKENS
from hybridflow.registry import COMPUTE_FNS


def _tokenizer(model: str) -> Any:
    """A role's tokenizer: saved in its model directory, or a built-in tiny model's character tokenizer."""
    return load_tokenizer(model) if Path(model).is_dir() else char_tokenizer()


def judge_context(model: str) -> int | None:
    """The judge model's context in tokens (``max_position_embeddings`` of its ``config.json``, or of a built-in
    tiny model's config); None when it does not say."""
    if Path(model).is_dir():
        config = Path(model) / "config.json"
        found = json.loads(config.read_text()).get("max_position_embeddings") if config.is_file() else None
        return int(found) if found else None
    return int(TINY_CONFIGS[model][1]["max_position_embeddings"]) if model in TINY_CONFIGS else None


class JudgeText:
    """A judge node's template and tokenizers (the policy's and the judge's), and its last call's counts.

    ``context`` (default: the judge model's, :func:`judge_context`) less ``verdict_tokens`` (the verdict's budget)
    bounds a judge prompt: a longer one keeps the head of the response and marks the cut (``judge_prompts``)."""

    def __init__(self, *, role_models: Mapping[str, str], policy: str, judge: str, template: str,
                 verdict: str | None, rubric: str, scale: int, verdict_tokens: int = 0,
                 context: int | None = None) -> None:
        for role in (policy, judge):
            if role not in role_models:
                raise KeyError(f"judge node: role {role!r} has no model here; roles: {sorted(role_models)}")
        self.template: JudgeTemplate = load_template(template, verdict=verdict, rubric=rubric, scale=scale)
        self.policy_tokenizer = _tokenizer(role_models[policy])
        self.judge_tokenizer = _tokenizer(role_models[judge])
        # A vision-language judge reads the samples' images: their placeholders stay in its prompts.
        self.kept_ids = _image_placeholders(self.policy_tokenizer, role_models[policy], role_models[judge])
        self.context = context if context is not None else judge_context(role_models[judge])
        self.verdict_tokens = verdict_tokens
        self.counts: dict[str, float] = {}

    summed_metrics = frozenset({"unparsed", "truncated"})  # counts: a streamed step's chunks add up

    def metrics(self) -> dict[str, float]:
        return dict(self.counts)

    def state_dict(self) -> dict[str, float]:
        return {}  # nothing to resume: the counts are the last step's

    def load_state_dict(self, state: dict[str, float]) -> None:
        return None


def _make_state(*, role_models: Mapping[str, str], policy: str = "actor", judge: str = "judge",
                template: str = "pointwise", verdict: str | None = None, rubric: str = "",
                scale: int = DEFAULT_SCALE, verdict_tokens: int = 0, **_: Any) -> JudgeText:
    return JudgeText(role_models=role_models, policy=policy, judge=judge, template=template, verdict=verdict,
                     rubric=rubric, scale=scale, verdict_tokens=verdict_tokens)


def _state(state: JudgeText | None, node: str) -> JudgeText:
    if state is None:
        raise ValueError(f"{node} needs its JudgeText state: run it in a graph, where the controller makes it")
    return state


def _decode(tokenizer: Any, ids: torch.Tensor, mask: torch.Tensor | None = None,
            kept_ids: frozenset[int] = frozenset()) -> str:
    """The text of one row: its masked tokens, or (left-padded prompts) the row after its leading padding. Special
    tokens are dropped except ``kept_ids`` (a vision-language judge's image placeholders)."""
    tokens = ids[mask.bool()] if mask is not None else ids
    if mask is None and tokenizer.pad_token_id is not None:
        kept = (tokens != tokenizer.pad_token_id).nonzero()
        tokens = tokens[int(kept[0]):] if len(kept) else tokens[:0]
    if not kept_ids:
        return str(tokenizer.decode(tokens.tolist(), skip_special_tokens=True))
    dropped = set(tokenizer.all_special_ids) - kept_ids
    return str(tokenizer.decode([token for token in tokens.tolist() if token not in dropped]))


_VISION_SHAPE = ("patch_size", "spatial_merge_size", "temporal_patch_size", "in_channels")
"""The vision-config fields that fix how a tower reads ``pixel_values`` and how many placeholders an image takes."""


def _vision_config(model: str) -> dict[str, Any] | None:
    """A model directory's ``vision_config`` (None for a text model or a built-in tiny one)."""
    config = Path(model) / "config.json"
    if not config.is_file():
        return None
    found = json.loads(config.read_text()).get("vision_config")
    return dict(found) if isinstance(found, dict) else None


def _image_placeholders(policy_tokenizer: Any, policy: str, judge: str) -> frozenset[int]:
    """The policy's image-placeholder ids a judge's prompts keep: those of a vision-language judge of a
    vision-language policy (which then reads the samples' images with them), none otherwise. The judge must read
    the policy's ``pixel_values`` as the policy does, or its placeholders would not match its image features."""
    policy_vision, judge_vision = _vision_config(policy), _vision_config(judge)
    if policy_vision is None or judge_vision is None:
        return frozenset()
    shape = {key: policy_vision.get(key) for key in _VISION_SHAPE}
    theirs = {key: judge_vision.get(key) for key in _VISION_SHAPE}
    if shape != theirs:
        raise ValueError(f"the judge model {judge} reads images as {theirs}, the policy's processor makes them as "
                         f"{shape}: a vision-language judge reads the policy's pixel_values, so give it a model of the "
                         "same image processing (or a text judge, which reads the rendered text alone)")
    ids = {policy_tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}
    return frozenset(token for token in ids if token is not None and token != policy_tokenizer.unk_token_id)


def _judge_text(tokenizer: Any, text: str) -> list[int]:
    """The judge's prompt ids: through its chat template as a user turn when it has one."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _left_padded(rows: Sequence[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, longest) ids and mask, padded on the left (generation continues every row at its end)."""
    width = max(max((len(row) for row in rows), default=1), 1)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        if row:
            ids[index, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[index, width - len(row):] = 1
    return ids, mask


@COMPUTE_FNS.register("judge_prompts")
def judge_prompts(prompts: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor,
                  ground_truth: Sequence[Any], *, state: JudgeText | None = None,
                  **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's judge prompt: prompts (B, P), responses and response_mask (B, T), ground_truth (B,) ->
    ``judge_prompts`` and ``judge_prompts_mask`` (B, P'), left-padded in the judge's tokens."""
    text = _state(state, "judge_prompts")
    template, policy, judge = text.template, text.policy_tokenizer, text.judge_tokenizer
    truths = [str(truth) for truth in ground_truth]
    if "ground_truth" in template.fields and any(not truth for truth in truths):
        raise ValueError("the judge's template reads field 'ground_truth', but rows of this batch have none: give the "
                         "dataset a ground_truth column, or use a template without it")
    fitted = [_fitted(text, _decode(policy, prompt, kept_ids=text.kept_ids), _decode(policy, response, mask), truth)
              for prompt, response, mask, truth in zip(prompts, responses, response_mask, truths, strict=True)]
    text.counts = {"truncated": float(sum(cut for _, cut in fitted))}
    rows = [ids for ids, _ in fitted]
    pad = judge.pad_token_id if judge.pad_token_id is not None else judge.eos_token_id
    return _left_padded(rows, int(pad or 0))


CUT = " [...]"  # where a response too long for the judge's context was cut


def _fitted(text: JudgeText, prompt: str, response: str, truth: str) -> tuple[list[int], bool]:
    """One row's judge prompt ids within the judge's context less its verdict budget, and whether the response had
    to be cut (its longest head that fits, found by bisection, then :data:`CUT`)."""
    def render(kept: str) -> list[int]:
        return _judge_text(text.judge_tokenizer, text.template.render(prompt=prompt, response=kept, ground_truth=truth))

    ids = render(response)
    if text.context is None or len(ids) <= text.context - text.verdict_tokens:
        return ids, False
    limit = text.context - text.verdict_tokens
    shortest = render(CUT)
    if len(shortest) > limit:
        raise ValueError(f"a judge prompt without its response is {len(shortest)} tokens, beyond the judge's context "
                         f"of {text.context} less the verdict budget of {text.verdict_tokens}: give the judge a model "
                         "with a longer context, or a shorter template or prompt")
    low, high = 0, len(response)  # render(response[:low] + CUT) fits, response[:high] + CUT does not
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if len(render(response[:middle] + CUT)) <= limit else (low, middle)
    return render(response[:low] + CUT), True


def _template_tokens(*, tokenizer: Any, ground_truths: Sequence[str], template: str = "pointwise",
                     verdict: str | None = None, rubric: str = "", scale: int = DEFAULT_SCALE, **_: Any) -> int:
    """The tokens a judge prompt holds beside the prompt and response, in the judge's ``tokenizer``: the template
    rendered with them empty, through the judge's chat template (as :func:`judge_prompts` renders), its ground truth
    each of ``ground_truths`` where it shows one (their mean); what the planner adds to a judge prompt."""
    loaded = load_template(template, verdict=verdict, rubric=rubric, scale=scale)
    truths = [str(truth) for truth in ground_truths] if "ground_truth" in loaded.fields else []
    counts = [len(_judge_text(tokenizer, loaded.render(prompt="", response="", ground_truth=truth)))
              for truth in truths or [""]]
    return round(sum(counts) / len(counts))


@COMPUTE_FNS.register("judge_scores")
def judge_scores(verdict_ids: torch.Tensor, verdict_mask: torch.Tensor, *, unparsed_score: float = 0.0,
                 state: JudgeText | None = None, **_: Any) -> tuple[torch.Tensor, list[str]]:
    """The judge's responses (B, T) and their mask -> ``scores`` (B,) float32 in [0, 1] (``unparsed_score`` where
    a verdict does not parse) and ``verdicts``, the decoded texts."""
    text = _state(state, "judge_scores")
    verdicts = [_decode(text.judge_tokenizer, ids, mask) for ids, mask in zip(verdict_ids, verdict_mask, strict=True)]
    parsed = [text.template.parse(verdict) for verdict in verdicts]
    unparsed = sum(score is None for score in parsed)
    text.counts = {"unparsed": float(unparsed), "unparsed_frac": unparsed / max(len(parsed), 1)}
    scores = torch.tensor([unparsed_score if score is None else score for score in parsed], dtype=torch.float32)
    return scores, verdicts


for _fn in (judge_prompts, judge_scores):
    _fn.make_state = _make_state  # type: ignore[attr-defined]
    _fn.reads_role_models = True  # type: ignore[attr-defined]
judge_prompts.template_tokens = _template_tokens  # type: ignore[attr-defined]
