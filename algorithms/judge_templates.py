"""An LLM judge's templates and the strict parsing of its verdicts (torch-free).

A template is Jinja text the driver renders once per sampled response, from the fields ``prompt`` (the policy's
prompt, decoded), ``response`` (its sampled response, decoded) and ``ground_truth`` (the dataset row's), plus
``scale`` and ``rubric`` (the template's own settings). Three are built in:

- ``pointwise``: "score the response 0-``scale``", a ``Score: <n>`` line, mapped to ``n / scale`` in [0, 1];
- ``reference``: correct or incorrect against the ground truth, a ``Verdict: correct|incorrect`` line, 1 or 0;
- ``rubric``: numbered criteria with weights (``"is correct=2; is concise=1"``), one ``<i>: yes|no`` line each,
  scored as the weighted share of yeses.

A user's template is a file path or a Jinja string (any text holding ``{{`` or ``{%``); ``verdict`` says how its
verdicts parse (``score``, ``binary``, ``rubric``, or ``marks``: a row of ``ok``/``no`` marks, one per item the
judge checks, however many, scored as the share of ``ok``; a graded verdict a line-less character tokenizer can
write, where a rubric needs numbered lines and a fixed list of criteria). A template naming any other field is
refused when the graph is built, in one line naming the field. A verdict that does not parse strictly (no such line,
two different answers, a score out of range, a word that is no mark) parses to None: the caller scores it
``unparsed_score`` and counts it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

FIELDS = ("prompt", "response", "ground_truth")
SETTINGS = ("scale", "rubric")
VERDICTS = ("score", "binary", "rubric", "marks")

POINTWISE = """You are a strict grader. Rate how well the response answers the task, from 0 (useless) to {{ scale }} \
(perfect).

Task:
{{ prompt }}

Response:
{{ response }}

Reply with one line: Score: <an integer from 0 to {{ scale }}>
"""

REFERENCE = """You are a strict grader. Decide whether the response reaches the reference answer.

Task:
{{ prompt }}

Reference answer:
{{ ground_truth }}

Response:
{{ response }}

Reply with one line: Verdict: correct, or Verdict: incorrect
"""

RUBRIC = """You are a strict grader. Check the response against each criterion.

Task:
{{ prompt }}

Response:
{{ response }}

Criteria:
{% for criterion in rubric %}{{ loop.index }}. {{ criterion }}
{% endfor %}
Reply with one line per criterion, <number>: yes or <number>: no
"""

# A dry run's estimate of a template's tokens: English text runs ~4 characters a token in the BPE vocabularies of
# today's models (OpenAI's tokenizer guide: "~4 characters of common English text"; Llama 3 and Qwen2 tokenizers
# are close). A run counts the template with its judge's own tokenizer instead (``JudgeText.template_tokens``).
CHARS_PER_TOKEN = 4

BUILTINS = {"pointwise": (POINTWISE, "score"), "reference": (REFERENCE, "binary"), "rubric": (RUBRIC, "rubric")}
DEFAULT_SCALE = 10

_SCORE = re.compile(r"\bscore\s*[:=]\s*(-?\d+(?:\.\d+)?)(?:\s*/\s*(\d+))?", re.IGNORECASE)
_BARE_SCORE = re.compile(r"^\s*(-?\d+(?:\.\d+)?)(?:\s*/\s*(\d+))?\s*[.!]?\s*$")
_VERDICT = re.compile(r"\bverdict\s*[:=]\s*\**\s*(correct|incorrect)\b", re.IGNORECASE)
_BARE_VERDICT = re.compile(r"^\s*\**\s*(correct|incorrect)\s*\**\s*[.!]?\s*$", re.IGNORECASE)
_RUBRIC_LINE = re.compile(r"^\s*[-*]?\s*(\d+)\s*[.:)=]\s*(yes|no)\b", re.IGNORECASE | re.MULTILINE)
_MARKS = re.compile(r"^\s*(?:ok|no)(?:(?:\s+|\s*,\s*)(?:ok|no))*\s*\.?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class JudgeTemplate:
    """A loaded template: its Jinja ``source``, how its verdicts parse, the fields it reads, the score ``scale``
    and the rubric's (criterion, weight) pairs."""

    source: str
    verdict: str
    fields: frozenset[str]
    scale: int = DEFAULT_SCALE
    rubric: tuple[tuple[str, float], ...] = ()

    def render(self, *, prompt: str, response: str, ground_truth: str = "") -> str:
        """The judge's prompt for one response."""
        values = {"prompt": prompt, "response": response, "ground_truth": ground_truth, "scale": self.scale,
                  "rubric": [criterion for criterion, _ in self.rubric]}
        return str(_compiled(self.source).render(**values))

    def estimated_tokens(self) -> int:
        """A dry run's count of the tokens this template adds around a prompt and response: its text rendered with
        empty fields, at :data:`CHARS_PER_TOKEN` (no ground truth, no chat markup: a run counts those)."""
        return -(-len(self.render(prompt="", response="")) // CHARS_PER_TOKEN)

    def parse(self, verdict: str) -> float | None:
        """The verdict's score in [0, 1], or None when it does not parse strictly."""
        if self.verdict == "score":
            return parse_score(verdict, self.scale)
        if self.verdict == "binary":
            return parse_binary(verdict)
        if self.verdict == "marks":
            return parse_marks(verdict)
        return parse_rubric(verdict, tuple(weight for _, weight in self.rubric))


def parse_score(verdict: str, scale: int = DEFAULT_SCALE) -> float | None:
    """``Score: 7`` (or ``Score: 7/10``, or a verdict that is the bare number) -> 0.7 for ``scale`` 10; None for
    no score, two different scores, a denominator other than ``scale`` or a score outside [0, scale]."""
    found = set(_SCORE.findall(verdict))
    if not found:
        bare = _BARE_SCORE.match(verdict)
        found = {bare.groups(default="")} if bare else set()
    scores = {(float(value), total) for value, total in found}
    if len(scores) != 1:
        return None
    ((value, total),) = scores
    if total not in ("", str(scale)) or not 0 <= value <= scale:
        return None
    return value / scale


def parse_binary(verdict: str) -> float | None:
    """``Verdict: correct`` -> 1.0, ``Verdict: incorrect`` -> 0.0 (or a verdict that is the bare word); None for
    neither, or both."""
    found = {word.lower() for word in _VERDICT.findall(verdict)}
    if not found:
        bare = _BARE_VERDICT.match(verdict)
        found = {bare.group(1).lower()} if bare else set()
    if len(found) != 1:
        return None
    return 1.0 if found == {"correct"} else 0.0


def parse_rubric(verdict: str, weights: tuple[float, ...]) -> float | None:
    """One ``<i>: yes|no`` line per criterion (numbered from 1) -> the weighted share of yeses; None when a
    criterion has no answer or two different ones, or a line numbers no criterion."""
    answers: dict[int, set[str]] = {}
    for number, answer in _RUBRIC_LINE.findall(verdict):
        answers.setdefault(int(number), set()).add(answer.lower())
    if set(answers) != set(range(1, len(weights) + 1)) or any(len(found) != 1 for found in answers.values()):
        return None
    yes = sum(weight for index, weight in enumerate(weights, start=1) if answers[index] == {"yes"})
    return yes / sum(weights)


def parse_marks(verdict: str) -> float | None:
    """``ok ok no`` (marks separated by spaces, new lines or commas, any case, an optional final period) -> the
    share of ``ok`` marks, 2/3; None for no mark or any other word (``ok ok maybe``, ``ok verdict: correct``)."""
    if not _MARKS.match(verdict):
        return None
    marks = re.findall(r"ok|no", verdict, re.IGNORECASE)
    return sum(mark.lower() == "ok" for mark in marks) / len(marks)


def parse_rubric_option(rubric: str) -> tuple[tuple[str, float], ...]:
    """``"is correct=2; is concise"`` -> (("is correct", 2.0), ("is concise", 1.0)): criteria split on ``;`` or
    new lines, each with an optional ``=weight`` (default 1, must be > 0)."""
    criteria = []
    for item in filter(None, (part.strip() for part in re.split(r"[;\n]", rubric))):
        name, has_weight, weight = item.rpartition("=") if "=" in item else (item, "", "1")
        try:
            value = float(weight)
        except ValueError:
            value = float("nan")
        if not name.strip() or not value > 0 or (has_weight and not weight.strip()):
            raise ValueError(f"algorithm option judge_rubric: criterion {item!r} must be 'text' or 'text=weight' "
                             "with a weight > 0; criteria are separated by ';'")
        criteria.append((name.strip(), value))
    return tuple(criteria)


def load_template(template: str, *, verdict: str | None = None, rubric: str = "",
                  scale: int = DEFAULT_SCALE) -> JudgeTemplate:
    """The template ``template`` names: a built-in (``pointwise``, ``reference``, ``rubric``), a file, or Jinja
    text. Raises a ValueError naming the option for a template that cannot be read, a field it cannot fill, a
    verdict kind it cannot parse or a rubric it lacks."""
    source, kind = _source(template)
    if verdict is not None and kind is not None and verdict != kind:
        raise ValueError(f"algorithm option judge_verdict={verdict!r} does not fit judge_template={template!r}, "
                         f"whose verdicts are {kind!r}; leave judge_verdict unset for a built-in template")
    kind = kind or verdict or "score"
    if kind not in VERDICTS:
        raise ValueError(f"algorithm option judge_verdict={kind!r} must be one of {list(VERDICTS)}")
    if isinstance(scale, bool) or not isinstance(scale, int) or scale < 1:
        raise ValueError(f"algorithm option judge_scale={scale!r} must be a positive integer (the top score)")
    criteria = parse_rubric_option(rubric)
    if (kind == "rubric") != bool(criteria):
        raise ValueError("algorithm option judge_rubric must list the criteria of a rubric judge (and only of one): "
                         f"judge_rubric={rubric!r} with verdicts {kind!r}")
    fields = _fields(source, template)
    return JudgeTemplate(source=source, verdict=kind, fields=fields, scale=scale, rubric=criteria)


def _source(template: str) -> tuple[str, str | None]:
    """The Jinja source and, for a built-in, its verdict kind."""
    if template in BUILTINS:
        return BUILTINS[template]
    if "{{" in template or "{%" in template:
        return template, None
    path = Path(template).expanduser()
    if not path.is_file():
        raise ValueError(f"algorithm option judge_template={template!r} is no built-in template "
                         f"({', '.join(BUILTINS)}), no file and no Jinja text (none holds '{{{{')")
    return path.read_text(encoding="utf-8"), None


def _fields(source: str, template: str) -> frozenset[str]:
    """The fields ``source`` reads; one it cannot fill is refused, named."""
    from jinja2 import TemplateSyntaxError, meta

    try:
        names = meta.find_undeclared_variables(_environment().parse(source))
    except TemplateSyntaxError as err:
        raise ValueError(f"algorithm option judge_template={_short(template)}: Jinja syntax error line {err.lineno}: "
                         f"{err.message}") from err
    unknown = sorted(set(names) - {*FIELDS, *SETTINGS})
    if unknown:
        raise ValueError(f"algorithm option judge_template={_short(template)} names field {unknown[0]!r}, which a "
                         f"judge's template cannot fill (fields: {', '.join(FIELDS)}; settings: {', '.join(SETTINGS)})")
    return frozenset(names) & frozenset(FIELDS)


def _short(template: str) -> str:
    return repr(template if len(template) <= 40 else template[:37] + "...")


@cache
def _environment() -> Any:
    """A sandboxed Jinja environment where an undefined name raises instead of rendering empty."""
    from jinja2 import StrictUndefined
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment(undefined=StrictUndefined, keep_trailing_newline=True, autoescape=False)


@cache
def _compiled(source: str) -> Any:
    return _environment().from_string(source)
