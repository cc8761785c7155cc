"""A math answer checker: extract the final answer (``\\boxed{}``, GSM8K's ``####``, "the answer is") and
compare it with the ground truth as numbers (integers, decimals, fractions, ``\\frac``) or normalised text.

Our own, not ``math-verify``: that package is not in this environment's offline package set, and
GSM8K-style numeric answers need only what is here. Symbolic equivalence (``\\sqrt{8}`` = ``2\\sqrt{2}``)
is out of scope; such answers match only when written the same way.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any, Literal

Fallback = Literal["none", "whole", "last_number"]

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASHES = re.compile(r"####\s*([^\n]+)")
_ANSWER_IS = re.compile(r"answer is\s*:?\s*([^\n]+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}|\\[dt]?frac(\d)(\d)")
_TEXT = re.compile(r"\\(?:text|mathrm|textbf|mbox)\s*\{([^{}]*)\}")
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
_UNIT_TAIL = re.compile(r"^(-?[\d.,/]+)\s*[A-Za-z][A-Za-z .]*$")
# Relative tolerance for a decimal against a fraction (0.333333 vs 1/3); exact numbers compare exactly.
TOLERANCE = 1e-6


def extract_answer(text: str, *, fallback: Fallback = "whole") -> str | None:
    """The final answer in ``text``: the last ``\\boxed{...}``, else the last ``#### ...`` line, else the last
    "answer is ...". ``fallback`` when none is there: ``"whole"`` takes ``text`` if it is one number,
    ``"last_number"`` its last number (verl's flexible GSM8K mode), ``"none"`` gives up.
    """
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    for pattern in (_HASHES, _ANSWER_IS):
        found = pattern.findall(text)
        if found:
            return str(found[-1]).strip().rstrip(".").strip()
    stripped = text.strip().rstrip(".")
    if fallback == "whole":
        return stripped if _as_number(normalize_answer(stripped)) is not None else None
    if fallback == "last_number":
        numbers = _NUMBER.findall(text)
        return numbers[-1] if numbers else None
    return None


def _last_boxed(text: str) -> str | None:
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for position in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        if depth == 0:
            return text[start:position]
    return None  # unbalanced: the response was cut off inside the box


def normalize_answer(answer: str) -> str:
    """``answer`` without LaTeX spacing, ``$``, ``\\text{}`` wrappers, ``x =`` prefixes and trailing dots."""
    text = answer.strip()
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\%", "%"),
                     ("\\$", ""), ("$", ""), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("^\\circ", ""),
                     ("^{\\circ}", "")):
        text = text.replace(old, new)
    text = _TEXT.sub(r"\1", text)
    text = re.sub(r"^[A-Za-z]\s*=\s*", "", text.strip())  # "x = 5" -> "5"
    text = _FRAC.sub(lambda m: f"({m[1] or m[3]})/({m[2] or m[4]})", text)
    return text.strip().rstrip(".").strip()


def _as_number(text: str) -> Fraction | None:
    """``text`` as an exact number if it is one (``1,000``, ``-2.5``, ``3/4``, ``(3)/(4)``, ``50%``, ``18 dollars``)."""
    text = text.replace(" ", "").removesuffix("%")
    if _THOUSANDS.match(text):
        text = text.replace(",", "")
    unit = _UNIT_TAIL.match(text)
    if unit:
        text = unit[1]
    if text.count("/") == 1:
        top, bottom = (part.strip("()") for part in text.split("/"))
        numerator, denominator = _plain(top), _plain(bottom)
        if numerator is None or not denominator:
            return None
        return numerator / denominator
    return _plain(text.strip("()") if text.startswith("(") and text.endswith(")") else text)


def _plain(text: str) -> Fraction | None:
    if not re.fullmatch(r"[-+]?(\d+(\.\d*)?|\.\d+)", text):
        return None
    return Fraction(text)


def answers_equivalent(predicted: str, truth: str) -> bool:
    """Whether two final answers agree: as numbers (exactly, or to :data:`TOLERANCE` for decimals), else as text."""
    left, right = normalize_answer(predicted), normalize_answer(truth)
    a, b = _as_number(left), _as_number(right)
    if a is not None and b is not None:
        return a == b or abs(a - b) <= TOLERANCE * max(Fraction(1), abs(b))
    return left.replace(" ", "").lower() == right.replace(" ", "").lower()


def math_reward(response: str, ground_truth: str, *, data_source: str | None = None,
                extra_info: Mapping[str, Any] | None = None) -> float:
    """1.0 when the response's final answer equals the ground truth's, else 0.0.

    The ground truth may be the bare answer (verl's ``reward_model.ground_truth``) or a full GSM8K
    solution ending in ``#### answer``. ``data_source`` and ``extra_info`` are accepted and unused.
    """
    predicted = extract_answer(response)
    truth = extract_answer(ground_truth, fallback="none") or ground_truth
    return 1.0 if predicted is not None and answers_equivalent(predicted, truth) else 0.0


def math_reward_flexible(response: str, ground_truth: str, *, data_source: str | None = None,
                         extra_info: Mapping[str, Any] | None = None) -> float:
    """:func:`math_reward`, but a response with no marked answer is judged by its last number."""
    predicted = extract_answer(response, fallback="last_number")
    truth = extract_answer(ground_truth, fallback="none") or ground_truth
    return 1.0 if predicted is not None and answers_equivalent(predicted, truth) else 0.0
