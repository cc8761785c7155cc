"""Vision prompt records as a batch, through the model's processor (a Qwen2-VL-style ``AutoProcessor``).

The batch holds the usual left-padded ``prompts`` / ``prompt_mask`` (each image's placeholder expanded to its
visual tokens) and, per row, the model's image inputs: ``pixel_values`` (a float32 numpy array of the row's
flattened patches, (patches, channels x temporal x patch x patch)) and ``image_grid_thw`` (an int64 array, one
(t, h, w) row per image); a text-only row holds empty ones. They are non-tensor fields (one object a row), so they
travel, split and concatenate with the rows whatever their sizes; a pass joins its micro batch's rows into the
model's flat layout (``hybridflow.backends.common.vision``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hybridflow.data.images import open_image
from hybridflow.data.records import IMAGES, PROMPT, Record, render_prompt, reward_target
from hybridflow.models.vision import IMAGE_GRID_THW, PIXEL_VALUES
from hybridflow.runtime.batch import Batch


def image_tokens(processor: Any, size: tuple[int, int]) -> int:
    """The visual tokens a (width, height) image becomes in the model's prompt, after the processor's resize."""
    image_processor = processor.image_processor
    width, height = size
    patches = image_processor.get_number_of_image_patches(height, width)
    return int(patches // image_processor.merge_size ** 2)


def encode_vision_prompts(records: Sequence[Record], processor: Any) -> Batch:
    """Records with images (and text-only ones) as a batch: prompts tokenised by ``processor`` with their images
    decoded and resized, ``pixel_values`` / ``image_grid_thw`` per row (module docstring), ``ground_truth``."""
    texts = [render_prompt(r[PROMPT], processor, f"record {i}") for i, r in enumerate(records)]
    images = [[open_image(ref) for ref in record.get(IMAGES, ())] for record in records]
    flat = [image for row in images for image in row]
    encoded = processor(text=texts, images=flat or None, padding=True, padding_side="left", return_tensors="pt")
    pixel_rows, grid_rows = per_row(encoded.get(PIXEL_VALUES), encoded.get(IMAGE_GRID_THW),
                                    [len(row) for row in images])
    return Batch({"prompts": encoded["input_ids"], "prompt_mask": encoded["attention_mask"].to(torch.long)},
                 {"ground_truth": [reward_target(r) for r in records], PIXEL_VALUES: pixel_rows,
                  IMAGE_GRID_THW: grid_rows})


def per_row(pixel_values: torch.Tensor | None, grid_thw: torch.Tensor | None,
            counts: Sequence[int]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The processor's flat ``pixel_values`` (all images' patches, in order) and ``image_grid_thw`` cut per row,
    ``counts[i]`` images in row ``i``."""
    if grid_thw is None or pixel_values is None:
        return [np.zeros((0, 0), np.float32) for _ in counts], [np.zeros((0, 3), np.int64) for _ in counts]
    grids = grid_thw.to(torch.long)
    patches = grids.prod(dim=1).tolist()  # each image's patches
    pixel_rows, grid_rows = [], []
    image = start = 0
    for count in counts:
        stop = start + sum(patches[image:image + count])
        pixel_rows.append(pixel_values[start:stop].to(torch.float32).numpy())
        grid_rows.append(grids[image:image + count].numpy())
        image, start = image + count, stop
    return pixel_rows, grid_rows
