"""Image rows for the vision tests: two image prompts with responses, and the model's own forward on one alone."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from hybridflow.data.images import ImageRef, open_image, vision_messages
from hybridflow.data.prompts import prepare_records
from hybridflow.data.vision_prompts import encode_vision_prompts
from hybridflow.models.vision import load_processor
from hybridflow.runtime.batch import Batch


def png(size: tuple[int, int], colour: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, "PNG")
    return buffer.getvalue()


def image_rows(vlm_dir: Path) -> tuple[Batch, Any, list[dict[str, Any]]]:
    """Two image prompts of different lengths (one image, then two) with responses, the second one shorter."""
    processor = load_processor(vlm_dir)
    red = ImageRef(png((32, 16), (255, 0, 0)), "r0", "images", 0)
    blue, green = (ImageRef(png(size, colour), "r1", "images", i)
                   for i, (size, colour) in enumerate((((24, 24), (0, 0, 255)), ((8, 40), (0, 255, 0)))))
    records = [{"prompt": vision_messages("<image> which colour?", 1, where="r0"), "ground_truth": "red",
                "images": [red]},
               {"prompt": vision_messages("<image> or <image>, same?", 2, where="r1"), "ground_truth": "no",
                "images": [blue, green]}]
    prepared = prepare_records(records, processor.tokenizer, processor=processor).records
    prompts = encode_vision_prompts(prepared, processor)
    responses = torch.randint(4, 90, (2, 6), generator=torch.Generator().manual_seed(0))
    response_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    return prompts.union(Batch({"responses": responses, "response_mask": response_mask})), processor, prepared


def forward_alone(model: Any, processor: Any, record: dict[str, Any], response: torch.Tensor) -> torch.Tensor:
    """The response's log-probs from the model's own forward on this sample alone (no padding, its own inputs)."""
    images = [open_image(ref) for ref in record["images"]]
    inputs = processor(text=[record["prompt"]], images=images, return_tensors="pt")
    prompt_len = inputs["input_ids"].shape[1]
    types = torch.cat([inputs["mm_token_type_ids"], torch.zeros(1, len(response), dtype=torch.long)], dim=1)
    with torch.no_grad():
        logits = model(input_ids=torch.cat([inputs["input_ids"], response[None]], dim=1),
                       pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                       mm_token_type_ids=types).logits[0, prompt_len - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, response[:, None])[:, 0]


