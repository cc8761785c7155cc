"""A vision-language model's vision tower: its shape, weights and what one visual token costs it.

A Qwen2-VL / Qwen2.5-VL tower (transformers' ``Qwen2_5_VisionTransformerPretrainedModel``) cuts an image into
``patch_size`` x ``patch_size`` patches (a still image is repeated to ``temporal_patch_size`` frames, which one
3-D patch covers), embeds them with a bias-free Conv3d, runs ``depth`` pre-norm blocks (RMSNorm, qkv with bias,
output projection, a gated SiLU MLP with biases) and merges each ``spatial_merge`` x ``spatial_merge`` square of
patches into one visual token (RMSNorm, Linear(h·m², h·m²), GELU, Linear(h·m², LM hidden)). So a visual token is
``spatial_merge²`` patches through the blocks. Most blocks attend inside windows of ``window_size`` pixels
(``window_size / patch_size`` patches a side); the ``full_attention_blocks`` attend over the whole image.

The language model reads each visual token as one prompt position (its ``<|image_pad|>`` placeholder), so the
cost model adds a sample's visual tokens to its prompt for every pass of a role whose model has a tower
(:mod:`hybridflow.planner.costs`); the tower's own FLOPs are :func:`hybridflow.planner.flops.vision_flops_per_token`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridflow.planner.settings import check_positive_int


@dataclass(frozen=True, kw_only=True)
class VisionSpec:
    """A ViT vision tower's shape (Hugging Face ``vision_config`` names in comments). ``trainable``: its weights
    are trained with the language model (verl and hybridflow freeze it by default: forward only, no gradients or
    optimizer states)."""

    depth: int  # depth
    hidden: int  # hidden_size
    heads: int  # num_heads
    intermediate: int  # intermediate_size (the gated MLP's width)
    out_hidden: int  # out_hidden_size: the language model's hidden size
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge: int = 2  # spatial_merge_size: patches per visual token = spatial_merge²
    in_channels: int = 3
    window_size: int = 0  # pixels a side of an attention window; 0: every block attends over the whole image
    full_attention_blocks: int = 0  # len(fullatt_block_indexes); every block when window_size is 0
    trainable: bool = False

    def __post_init__(self) -> None:
        for name in ("depth", "hidden", "heads", "intermediate", "out_hidden", "patch_size", "temporal_patch_size",
                     "spatial_merge", "in_channels"):
            check_positive_int("VisionSpec", name, getattr(self, name), allow_none=False)
        for name in ("window_size", "full_attention_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"VisionSpec.{name}={value!r} must be an integer >= 0")
        if self.full_attention_blocks > self.depth:
            raise ValueError(f"VisionSpec.full_attention_blocks={self.full_attention_blocks} exceeds "
                             f"depth={self.depth}")

    @property
    def patches_per_token(self) -> int:
        """Patches the blocks run for one visual token (one merged square)."""
        return self.spatial_merge * self.spatial_merge

    @property
    def window_patches(self) -> int:
        """Patches one windowed block attends over (0: no windows)."""
        side = self.window_size // self.patch_size
        return side * side

    @property
    def windowed_blocks(self) -> int:
        return self.depth - self.full_attention_blocks if self.window_size else 0

    @property
    def patch_inputs(self) -> int:
        """Pixel values of one 3-D patch (channels x frames x patch²): the Conv3d's input width."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def block_matmul_params(self) -> int:
        """Weights one patch is multiplied by in a block: qkv (3h²), output projection (h²), gated MLP (3hI)."""
        return 4 * self.hidden * self.hidden + 3 * self.hidden * self.intermediate

    @property
    def merged_width(self) -> int:
        return self.hidden * self.patches_per_token

    @property
    def merger_matmul_params(self) -> int:
        """The merger MLP's weights, which run once per visual token."""
        return self.merged_width * self.merged_width + self.merged_width * self.out_hidden

    @property
    def params(self) -> int:
        """Every weight of the tower: patch embedding, blocks (with biases and two RMSNorms), merger."""
        h, width = self.hidden, self.intermediate
        block = self.block_matmul_params + 5 * h + 2 * width + 2 * h  # biases: qkv 3h, proj h, gate/up 2I, down h
        merger = self.merger_matmul_params + self.merged_width + self.out_hidden + h
        return self.patch_inputs * h + self.depth * block + merger

    def with_trainable(self, trainable: bool) -> VisionSpec:
        """This tower, trained with the language model or frozen."""
        return VisionSpec(**{**self.__dict__, "trainable": trainable})


def vision_from_config(config: dict[str, Any], *, out_hidden: int, name: str) -> VisionSpec:
    """A :class:`VisionSpec` from a Hugging Face ``vision_config`` (Qwen2-VL and Qwen2.5-VL names: Qwen2-VL's
    ``embed_dim``/``mlp_ratio`` and its ungated MLP are read as a width, Qwen2.5-VL's ``hidden_size``,
    ``intermediate_size``, ``window_size`` and ``fullatt_block_indexes``)."""
    try:
        depth = int(config["depth"])
        heads = int(config["num_heads"])
        if "embed_dim" in config:  # Qwen2-VL: hidden_size there is the LM's width; an fc1/fc2 MLP of mlp_ratio
            hidden = int(config["embed_dim"])
            # Two matrices of h x (ratio·h) hold what a gated MLP of width 2/3 of that holds in three.
            intermediate = round(2 * hidden * float(config.get("mlp_ratio", 4)) / 3)
        elif "num_position_embeddings" in config:  # Qwen3-VL / Qwen3.5: learned positions, an fc1/fc2 GELU MLP
            hidden = int(config["hidden_size"])
            intermediate = round(2 * int(config["intermediate_size"]) / 3)  # as a gated MLP's width, as above
        else:
            hidden, intermediate = int(config["hidden_size"]), int(config["intermediate_size"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"HF config of {name!r}: vision_config lacks a usable {err}; need depth, num_heads and "
                         "hidden_size/intermediate_size (or embed_dim)") from err
    window = int(config.get("window_size") or 0)
    full = len(config.get("fullatt_block_indexes") or ()) if window else 0
    return VisionSpec(depth=depth, hidden=hidden, heads=heads, intermediate=intermediate,
                      out_hidden=int(config.get("out_hidden_size") or out_hidden),
                      patch_size=int(config.get("patch_size") or config.get("spatial_patch_size") or 14),
                      temporal_patch_size=int(config.get("temporal_patch_size") or 2),
                      spatial_merge=int(config.get("spatial_merge_size") or 2),
                      in_channels=int(config.get("in_channels") or config.get("in_chans") or 3),
                      window_size=window, full_attention_blocks=full)


def qwen2_5_vl_tower(out_hidden: int) -> VisionSpec:
    """The Qwen2.5-VL tower, the same at every size but for its merger's output width (the LM's hidden size):
    ``vision_config`` of Qwen/Qwen2.5-VL-{3B,7B,32B,72B}-Instruct (config.json on the Hugging Face Hub): depth 32,
    hidden_size 1280, num_heads 16, intermediate_size 3420, patch_size 14, temporal_patch_size 2,
    spatial_merge_size 2, window_size 112, fullatt_block_indexes [7, 15, 23, 31]."""
    return VisionSpec(depth=32, hidden=1280, heads=16, intermediate=3420, out_hidden=out_hidden, patch_size=14,
                      temporal_patch_size=2, spatial_merge=2, window_size=112, full_attention_blocks=4)
