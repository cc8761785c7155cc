"""Built-in verifiable tasks with rule-based rewards, small enough for a ~0.5M-parameter model.

Each task draws ``(prompt, answer)`` pairs from a seeded generator and scores a decoded response
against the answer. Rewards give partial credit per correct character, so a policy that is sometimes
right has a gradient to climb; an exact answer scores 1.0. A vision task's examples carry images too
(:class:`VisionExample`; ``hybridflow.data.visual_tasks``), as records the data loaders would read.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from hybridflow.data.images import image_refs, vision_messages
from hybridflow.registry import Registry

Example = tuple[str, str]


class VisionExample(NamedTuple):
    """A vision task's example: ``prompt`` with one ``<image>`` marker per image, ``answer``, and the images as
    PNG bytes."""

    prompt: str
    answer: str
    images: list[bytes]


@dataclass(frozen=True, kw_only=True)
class Task:
    """A prompt generator and the rule that scores a response to it."""

    name: str
    make_example: Callable[[random.Random], Example | VisionExample]
    reward: Callable[[str, str], float]
    max_answer_chars: int


TASKS: Registry[Task] = Registry("task")


def char_accuracy(response: str, answer: str) -> float:
    """Fraction of positions where ``response`` matches ``answer``, over the longer of the two."""
    response = response.strip()
    if response == answer:
        return 1.0
    width = max(len(response), len(answer), 1)
    return sum(a == b for a, b in zip(response, answer, strict=False)) / width


def _reverse(rng: random.Random) -> Example:
    word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 5)))
    return f"rev {word}=", word[::-1]


def _sort(rng: random.Random) -> Example:
    digits = "".join(rng.choice(string.digits) for _ in range(rng.randint(3, 5)))
    return f"sort {digits}=", "".join(sorted(digits))


def _add(rng: random.Random) -> Example:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"{a}+{b}=", str(a + b)


def _multiply(rng: random.Random) -> Example:
    a, b = rng.randint(100, 999), rng.randint(10, 99)
    return f"{a}*{b}=", str(a * b)


def _arithmetic_reward(response: str, answer: str) -> float:
    # Exact answers dominate: a digit-wise near miss is worth at most half an exact one.
    return 1.0 if response.strip() == answer else 0.5 * char_accuracy(response, answer)


def _last_number_reward(response: str, answer: str) -> float:
    numbers = re.findall(r"-?\d+", response)
    return _arithmetic_reward(numbers[-1] if numbers else response, answer)


TASKS.add("reverse", Task(name="reverse", make_example=_reverse, reward=char_accuracy, max_answer_chars=5))
TASKS.add("sort", Task(name="sort", make_example=_sort, reward=char_accuracy, max_answer_chars=5))
TASKS.add("arithmetic", Task(name="arithmetic", make_example=_add, reward=_arithmetic_reward,
                             max_answer_chars=3))
# Beyond a tiny model's own arithmetic, within reach with the calculator tool (docs/agents.md); the reward reads
# the last number the policy wrote, so an answer after a tool call counts.
TASKS.add("multiply", Task(name="multiply", make_example=_multiply, reward=_last_number_reward, max_answer_chars=5))


def task_examples(task: str | Task, count: int, *, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` examples of a task as ``{"prompt", "ground_truth"}`` records, reproducible by seed. A vision
    task's records are those a data file's ``images`` column loads as: chat prompts with an image part per image,
    ``images`` as :class:`~hybridflow.data.images.ImageRef` s."""
    found = TASKS.get(task) if isinstance(task, str) else task
    rng = random.Random(seed)
    records: list[dict[str, Any]] = []
    for index in range(count):
        example = found.make_example(rng)
        if isinstance(example, VisionExample):
            where = f"task {found.name!r} example {index}"
            records.append({"prompt": vision_messages(example.prompt, len(example.images), where=where),
                            "ground_truth": example.answer,
                            "images": image_refs({"images": example.images}, "images", where=where)})
        else:
            records.append({"prompt": example[0], "ground_truth": example[1]})
    return records
