"""A vision-language model's extra inputs for a pass over prompt + response rows (docs/vision.md).

Rows carry their images as ``pixel_values`` (each row's flattened patches) and ``image_grid_thw`` (each row's
(t, h, w) per image), non-tensor fields that travel with the rows (``hybridflow.data.vision_prompts``). A pass
joins its micro batch's rows into the model's flat layout and computes the 3-D rope positions (temporal, height,
width) with the model's own ``get_rope_index`` over the whole prompt + response rows: the responses are text, so
their positions continue from the prompt's, as the model computes them when it generates.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hybridflow.models.vision import IMAGE_GRID_THW, PIXEL_VALUES
from hybridflow.runtime.batch import Batch

TEXT, IMAGE, VIDEO = 0, 1, 2  # transformers' mm_token_type_ids


def has_images(batch: Batch) -> bool:
    """Whether ``batch`` carries image inputs (a vision-language policy's rows)."""
    return PIXEL_VALUES in batch


def reads_images(model: Any, batch: Batch) -> bool:
    """Whether a generate of ``model`` over ``batch`` reads images: the rows carry them and the model takes them. A
    text model's rows can carry them only as an LLM judge's, whose rendered prompts then hold no placeholders (the
    judge reads the text alone)."""
    return has_images(batch) and bool(placeholder_ids(model))


def image_inputs(batch: Batch, *, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The rows' ``pixel_values`` (all patches, row after row) and ``image_grid_thw`` (N images, 3) as the model
    takes them; (None, None) when no row has an image."""
    grids = [np.asarray(grid).reshape(-1, 3) for grid in batch[IMAGE_GRID_THW]]
    pixels = [np.asarray(rows) for rows, grid in zip(batch[PIXEL_VALUES], grids, strict=True) if len(grid)]
    if not pixels:
        return None, None
    pixel_values = torch.from_numpy(np.concatenate(pixels)).to(device)
    return pixel_values, torch.from_numpy(np.concatenate(grids)).to(device=device, dtype=torch.long)


def placeholder_ids(model: Any) -> tuple[int, ...]:
    """A vision-language model's image and video placeholder ids (and their start / end markers): tokens its
    responses must not hold, since a pass reads each placeholder as a visual token; () for a text model."""
    config = model.config
    if getattr(config, "image_token_id", None) is None:
        return ()
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return tuple(int(value) for name in names if (value := getattr(config, name, None)) is not None)


def token_types(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """``mm_token_type_ids`` (B, L): 1 on image placeholders, 2 on video ones, 0 on text."""
    config = model.config
    types = torch.zeros_like(input_ids)
    types[input_ids == config.image_token_id] = IMAGE
    video = getattr(config, "video_token_id", None)
    if video is not None:
        types[input_ids == video] = VIDEO
    return types


def rope_positions(model: Any, input_ids: torch.Tensor, mask: torch.Tensor,
                   grid_thw: torch.Tensor | None) -> torch.Tensor:
    """The model's 3-D rope positions (3, B, L) of padded rows (``get_rope_index``; 0 on padding)."""
    inner = model.model if hasattr(model, "model") and hasattr(model.model, "get_rope_index") else model
    positions, _ = inner.get_rope_index(input_ids, token_types(model, input_ids), image_grid_thw=grid_thw,
                                        attention_mask=mask)
    return positions


def padded_inputs(model: Any, batch: Batch, input_ids: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    """Keyword inputs of the model for padded (B, P + T) rows with images: ``pixel_values``, ``image_grid_thw``
    and ``position_ids`` (3, B, P + T)."""
    pixel_values, grid_thw = image_inputs(batch, device=input_ids.device)
    positions = rope_positions(model, input_ids, mask, grid_thw)
    inputs: dict[str, Any] = {"position_ids": positions}
    if pixel_values is not None:
        inputs.update(pixel_values=pixel_values, image_grid_thw=grid_thw)
    return inputs


def packed_inputs(model: Any, batch: Batch, input_ids: torch.Tensor, mask: torch.Tensor,
                  text_positions: torch.Tensor) -> dict[str, Any]:
    """Keyword inputs of the model for ``batch`` packed into one row (``hybridflow.backends.common.packing``):
    ``position_ids`` (4, 1, N), the packed text positions (restarting per sequence, which keep attention inside
    each one) over each sequence's 3-D rope positions as the model computes them for its padded row, then the
    rows' ``pixel_values`` and ``image_grid_thw`` (their images in the packed order: row after row)."""
    pixel_values, grid_thw = image_inputs(batch, device=input_ids.device)
    real = mask.flatten().bool().nonzero().squeeze(1)  # the packed tokens, in pack()'s row-major order
    if real.numel() == 0:  # a micro batch of padding rows packs one token that no output reads
        return {"position_ids": text_positions}
    positions = rope_positions(model, input_ids, mask, grid_thw).flatten(1)[:, real]  # (3, N)
    inputs: dict[str, Any] = {"position_ids": torch.cat([text_positions, positions])[:, None]}
    if pixel_values is not None:
        inputs.update(pixel_values=pixel_values, image_grid_thw=grid_thw)
    return inputs
