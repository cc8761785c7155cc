"""A built-in task a policy must see to solve: ``largest_colour`` (docs/vision.md).

Each example is a small PNG drawn offline with PIL: a grey canvas with a large rectangle of one colour and a small
one of another; the prompt asks for the largest shape's colour, the answer is one of :data:`COLOURS` and the rule
scores an exact answer 1.0, anything else 0.0 (no partial credit, so a policy blind to the image tops out at the
most frequent answer's share, about 1 / 4).
"""

from __future__ import annotations

import io
import random

from hybridflow.data.tasks import TASKS, Task, VisionExample

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 230), "pink": (240, 120, 220)}
CANVAS = 16  # px: a 16 x 16 image is 4 visual tokens of the tiny Qwen2-VL (one per 8 x 8 px)
BACKGROUND = (128, 128, 128)
PROMPT = "<image>largest colour?"


def largest_colour_image(rng: random.Random, *, large: str, small: str, size: int = CANVAS) -> bytes:
    """PNG bytes: a ``large``-coloured rectangle of 9-12 px sides and a ``small``-coloured one of 3-4 px, each at a
    random place on a grey ``size`` x ``size`` canvas (the small one drawn last, so it stays visible)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for colour, lo, hi in ((large, 9, 12), (small, 3, 4)):
        width, height = rng.randint(lo, hi), rng.randint(lo, hi)
        left, top = rng.randint(0, size - width), rng.randint(0, size - height)
        draw.rectangle((left, top, left + width - 1, top + height - 1), fill=COLOURS[colour])
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def _largest_colour(rng: random.Random) -> VisionExample:
    large, small = rng.sample(sorted(COLOURS), 2)
    return VisionExample(PROMPT, large, [largest_colour_image(rng, large=large, small=small)])


def exact_match(response: str, answer: str) -> float:
    """1.0 for exactly the answer (surrounding whitespace aside), else 0.0."""
    return 1.0 if response.strip() == answer else 0.0


TASKS.add("largest_colour", Task(name="largest_colour", make_example=_largest_colour, reward=exact_match,
                                 max_answer_chars=max(len(name) for name in COLOURS)))
