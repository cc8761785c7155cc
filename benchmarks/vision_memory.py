"""Where a vision-language model's memory goes, from the planner's cost model (docs/vision.md, memory notes).

Prints, for a planner preset (default ``qwen2.5-vl-7b``) on one GPU, bf16, micro batches of ``--micro-batch``
rows of ``--text`` prompt tokens, ``--image-tokens`` visual tokens (one image) and ``--response`` response tokens:
the tower's weights (and its gradients and Adam states when it trains), the activations an update's micro batch
adds for its images (the language model reading the visual tokens as prompt positions, and the tower's own), and
the bytes of a row's ``pixel_values`` as hybridflow's batch carries them (float32, ``patch_inputs`` values per
patch, ``spatial_merge²`` patches per visual token), which the planner does not count. No torch, no GPU:

    python benchmarks/vision_memory.py [--model qwen2.5-vl-7b] [--image-tokens 1024] [--micro-batch 4]
"""

from __future__ import annotations

import argparse
import dataclasses

from hybridflow.graph import NodeLoad, Op, RoleKind
from hybridflow.planner import ModelSpec, RoleLayout
from hybridflow.planner.costs import Shape, batching, state_bytes, update_cost, vision_activation_bytes
from hybridflow.planner.devices import GIB, get_device

PIXEL_BYTES = 4  # hybridflow.data.vision_prompts keeps pixel_values as float32


def _gib(value: float) -> str:
    return f"{value / GIB:.2f} GiB"


def memory_rows(model_name: str, *, text: int, image_tokens: int, response: int, micro_batch: int,
                device: str = "H100-80G") -> list[tuple[str, str, str]]:
    """(what, bytes per GPU without gradient checkpointing, with it) rows of the table, each from the planner's own
    functions (the weights and states do not depend on checkpointing)."""
    model = ModelSpec.preset(model_name)
    if model.vision is None:
        raise ValueError(f"--model {model_name}: not a vision-language preset (no vision tower)")
    shape = Shape(get_device(device), (1,))
    load = NodeLoad("update", Op.UPDATE, micro_batch, micro_batch * (text + image_tokens), micro_batch * response,
                    micro_batch * image_tokens, image_tokens)
    text_model = dataclasses.replace(model, vision=None)
    trained = dataclasses.replace(model, vision=model.vision.with_trainable(True))
    whole = RoleLayout(role="actor", dp=1)
    lm_weights = state_bytes(text_model, RoleKind.POLICY, whole, shape)[0]
    tower_weights = state_bytes(model, RoleKind.POLICY, whole, shape)[0] - lm_weights
    tower_states = (sum(state_bytes(trained, RoleKind.POLICY, whole, shape)[1:])
                    - sum(state_bytes(model, RoleKind.POLICY, whole, shape)[1:]))
    columns: list[list[float]] = []
    for checkpointing in (False, True):
        layout = RoleLayout(role="actor", dp=1, micro_batch_size=micro_batch, gradient_checkpointing=checkpointing)
        batch = batching(load, layout, shape, train=True)
        plain = update_cost(text_model, RoleKind.POLICY, load.text_only(), layout, shape).transient_bytes
        frozen = update_cost(model, RoleKind.POLICY, load, layout, shape).transient_bytes
        tower_frozen = vision_activation_bytes(model, load, batch, layout, train=True)
        tower_trained = vision_activation_bytes(trained, load, batch, layout, train=True)
        columns.append([plain, frozen - plain - tower_frozen, tower_frozen, tower_trained])
    per_row = image_tokens * model.vision.patches_per_token * model.vision.patch_inputs * PIXEL_BYTES
    same = [("language model weights (bf16)", lm_weights),
            (f"tower weights ({model.vision_params / 1e6:.0f}M params, bf16)", tower_weights),
            ("tower gradients + Adam states, when it trains (none frozen)", tower_states)]
    table = [(what, _gib(value), _gib(value)) for what, value in same]
    names = ("update peak of the micro batch without its images (text tokens only)",
             "+ the visual tokens' activations in the language model",
             "+ the tower's activations, tower frozen (forward only)",
             "+ the tower's activations, tower trained (instead of the frozen row)")
    table += [(name, _gib(off), _gib(on)) for name, off, on in zip(names, *columns, strict=True)]
    pixels = f"{per_row / 2**20:.1f} MiB"
    table.append(("pixel_values of one row (float32, in the batch; not in the planner)", pixels, pixels))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-vl-7b")
    parser.add_argument("--text", type=int, default=256, help="text tokens of a prompt")
    parser.add_argument("--image-tokens", type=int, default=1024, help="visual tokens of its image")
    parser.add_argument("--response", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=4, help="rows per micro batch")
    parser.add_argument("--device", default="H100-80G")
    args = parser.parse_args()
    rows = memory_rows(args.model, text=args.text, image_tokens=args.image_tokens, response=args.response,
                       micro_batch=args.micro_batch, device=args.device)
    print(f"{args.model} on one {args.device}, bf16; a micro batch of {args.micro_batch} rows of {args.text} text + "
          f"{args.image_tokens} visual prompt tokens and {args.response} response tokens")
    print("| what | per GPU | with gradient checkpointing |\n| --- | ---: | ---: |")
    for what, off, on in rows:
        print(f"| {what} | {off} | {on} |")


if __name__ == "__main__":
    main()
