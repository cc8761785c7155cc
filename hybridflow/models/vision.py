"""A tiny Qwen2-VL (~0.3M parameters, a 2-layer vision tower) built offline from a transformers config, its processor
(image processor + the character tokenizer with Qwen2-VL's vision tokens + a chat template), and the loader of a
model directory's processor.

Qwen2-VL's processor has a video processor too, which needs torchvision; this project's CPU stack leaves torchvision
out (it breaks vLLM's CPU build: shared/notes/cpu-stack.md), so ``AutoProcessor.from_pretrained`` cannot load *any*
Qwen2-VL processor here. :func:`load_processor` loads the whole processor where it can and, where torchvision is
missing, assembles an images-only one from the directory's image processor, tokenizer and chat template.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from hybridflow.models.tokenizer import WIDE_ALPHABET, char_tokenizer, load_tokenizer

log = logging.getLogger(__name__)

# The batch fields of a row's image inputs (hybridflow.data.vision_prompts writes them, the backends read them).
PIXEL_VALUES, IMAGE_GRID_THW = "pixel_values", "image_grid_thw"
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
# PLAIN_CHAT_TEMPLATE (each turn's text on a line, an assistant turn closed by EOS) with content parts: an image part
# renders as Qwen2-VL's placeholder, which the processor expands to one <|image_pad|> per merged patch.
VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    + VISION_START + IMAGE_PAD + VISION_END +
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}")

# Patches of 4 px merged 2 x 2: one visual token per 8 x 8 px; a 32 x 32 image is 16 tokens.
PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH = 4, 2, 2
TINY_MIN_PIXELS, TINY_MAX_PIXELS = 8 * 8, 32 * 32
_TEXT = dict(hidden_size=96, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=1024, attention_dropout=0.0, tie_word_embeddings=True,
             # head_dim 24: the temporal, height and width sections of M-RoPE share its 12 frequencies
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 4, 4]})
_VISION = dict(depth=2, embed_dim=32, mlp_ratio=2, num_heads=2, in_channels=3, patch_size=PATCH_SIZE,
               spatial_merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH)


# The attribute a transformers vision-language model keeps its vision tower under (Qwen-VL's ``visual``, with its patch
# merger; LLaVA-style ``vision_tower``; SigLIP/Idefics-style ``vision_model``), on the model or its inner ``model``.
VISION_TOWER_NAMES = ("visual", "vision_tower", "vision_model")
# peft ``exclude_modules`` (a full-match regex over module paths): every module inside a vision tower. The trainers and
# the LoRA export both write it, so a VLM's adapters go on its language model only.
TOWER_MODULES = r"(.*\.)?(" + "|".join(VISION_TOWER_NAMES) + r")(\..*)?"


def is_vision_language(config: Any) -> bool:
    """Whether a transformers config is a vision-language model's (it has a ``vision_config``)."""
    return getattr(config, "vision_config", None) is not None


def vision_tower(model: Any) -> tuple[str, Any] | None:
    """(module path in ``model``, module) of a transformers vision-language model's vision tower, found as verl finds
    it (``model.model.visual``, then ``model.visual``; also the other :data:`VISION_TOWER_NAMES`); None for a text
    model."""
    import torch

    for owner in (getattr(model, "model", None), model):
        for attribute in VISION_TOWER_NAMES:
            tower = getattr(owner, attribute, None)
            if isinstance(tower, torch.nn.Module):
                return next(name for name, module in model.named_modules() if module is tower), tower
    return None


def vision_tokenizer(alphabet: str = WIDE_ALPHABET) -> Any:
    """The character tokenizer plus Qwen2-VL's vision tokens (special, so they tokenise whole) and the vision chat
    template; ``image_token`` / ``image_token_id`` name the placeholder for processors that read them."""
    tokenizer = char_tokenizer(alphabet, chat_template=VISION_CHAT_TEMPLATE)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    return tokenizer


def tiny_vlm_config(tokenizer: Any) -> Any:
    """A tiny ``Qwen2VLConfig`` for ``tokenizer`` (:func:`vision_tokenizer`): its vocabulary and vision token ids."""
    from transformers import Qwen2VLConfig

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}
    special = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                   eos_token_id=tokenizer.eos_token_id)
    return Qwen2VLConfig(text_config={**_TEXT, **special, "vocab_size": len(tokenizer)},
                         vision_config={**_VISION, "hidden_size": _TEXT["hidden_size"]},
                         image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
                         vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END],
                         tie_word_embeddings=True, **special)


def build_tiny_vlm(tokenizer: Any, *, seed: int = 0) -> Any:
    """A randomly initialised tiny ``Qwen2VLForConditionalGeneration`` (seeded, fp32)."""
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    return Qwen2VLForConditionalGeneration(tiny_vlm_config(tokenizer)).eval()


def tiny_vlm_processor(tokenizer: Any | None = None, *, min_pixels: int = TINY_MIN_PIXELS,
                       max_pixels: int = TINY_MAX_PIXELS) -> Any:
    """The tiny model's processor: a PIL ``Qwen2VLImageProcessor`` of its patch sizes (images resized to between
    ``min_pixels`` and ``max_pixels``), ``tokenizer`` (default :func:`vision_tokenizer`) and the vision template."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil(patch_size=PATCH_SIZE, merge_size=MERGE_SIZE,
                                               temporal_patch_size=TEMPORAL_PATCH, min_pixels=min_pixels,
                                               max_pixels=max_pixels)
    tokenizer = tokenizer if tokenizer is not None else vision_tokenizer()
    return images_only_processor(image_processor, tokenizer, tokenizer.chat_template)


def images_only_processor(image_processor: Any, tokenizer: Any, chat_template: str | None) -> Any:
    """A ``Qwen2VLProcessor`` without a video processor (which needs torchvision): it processes text and images.

    transformers checks each sub-processor's class on construction, and a missing video processor fails that check
    though the processor never reads it for images; the check is skipped for this one instance.
    """
    from transformers import Qwen2VLProcessor

    processor = Qwen2VLProcessor.__new__(Qwen2VLProcessor)
    processor.check_argument_for_proper_class = lambda name, value: None  # type: ignore[method-assign]
    Qwen2VLProcessor.__init__(processor, image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                              chat_template=chat_template)
    del processor.check_argument_for_proper_class
    return processor


def save_vlm_dir(model: Any, processor: Any, directory: str | Path) -> Path:
    """Save a VLM and its processor side by side (model, image processor, tokenizer, chat template and
    ``processor_config.json``), so a role loads both from one local path with :func:`load_processor`."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return save_processor(processor, path)


def save_processor(processor: Any, directory: str | Path) -> Path:
    """The processor's files in ``directory``: ``preprocessor_config.json`` (the image processor), the tokenizer's,
    ``chat_template.jinja`` and ``processor_config.json``: what ``AutoProcessor.from_pretrained`` reads (where
    torchvision is installed) and :func:`load_processor` reads anywhere."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    if getattr(processor, "video_processor", None) is not None:  # a whole processor (torchvision installed)
        processor.save_pretrained(path)
        return path
    processor.image_processor.save_pretrained(path)
    processor.tokenizer.save_pretrained(path)
    if processor.chat_template:
        (path / "chat_template.jinja").write_text(processor.chat_template)
    # The processor's own save_pretrained would also save its (absent) video processor.
    (path / "processor_config.json").write_text(json.dumps({"processor_class": type(processor).__name__}, indent=2))
    return path


def load_processor(path: str | Path, *, min_pixels: int | None = None, max_pixels: int | None = None) -> Any:
    """The processor saved in ``path``, images resized to between ``min_pixels`` and ``max_pixels`` (the saved
    bounds where None). Without torchvision a Qwen2-VL processor is assembled images-only (module docstring)."""
    from transformers import AutoImageProcessor, AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(path)
        _ = processor.image_processor
    except ImportError as err:  # the video processor's torchvision
        if "torchvision" not in str(err).lower():
            raise
        log.info("%s: torchvision is not installed, so the processor handles images only (no video)", path)
        template_file = Path(path) / "chat_template.jinja"
        tokenizer = load_tokenizer(path)
        template = template_file.read_text() if template_file.is_file() else tokenizer.chat_template
        processor = images_only_processor(AutoImageProcessor.from_pretrained(path), tokenizer, template)
    set_pixel_bounds(processor.image_processor, min_pixels=min_pixels, max_pixels=max_pixels)
    return processor


def set_pixel_bounds(image_processor: Any, *, min_pixels: int | None, max_pixels: int | None) -> None:
    """Resize images to between ``min_pixels`` and ``max_pixels`` (Qwen2-VL's ``size`` shortest/longest edge,
    which count pixels, not edges); None keeps the processor's own bound."""
    size = dict(image_processor.size)
    for key, value in (("shortest_edge", min_pixels), ("longest_edge", max_pixels)):
        if value is not None:
            size[key] = value
    if size["shortest_edge"] > size["longest_edge"]:
        raise ValueError(f"min_pixels={size['shortest_edge']} is above max_pixels={size['longest_edge']}")
    image_processor.size = type(image_processor.size)(**size) if not isinstance(image_processor.size, dict) else size
    for key, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
        if value is not None and hasattr(image_processor, key):
            setattr(image_processor, key, value)
