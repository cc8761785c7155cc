"""``hybridflow export CHECKPOINT OUT``: a checkpoint (torch, FSDP or DeepSpeed) as a Hugging Face directory."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("export", help="convert a training checkpoint to a Hugging Face model directory")
    parser.add_argument("checkpoint", help="a checkpoint (RUN_DIR/checkpoints/step_N) or one role's folder in it")
    parser.add_argument("out", help="the HF directory to write (safetensors, config, tokenizer, generation config)")
    parser.add_argument("--role", default="actor", help="the trainable role to export (default: actor)")
    parser.add_argument("--model", default=None, help="the run's starting HF directory (config and tokenizer); "
                                                      "default: the checkpoint's hf/ view or the run's model")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                        help="weight dtype of the export (default: the model config's)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hybridflow.data.tokenizer import load_tokenizer
    from hybridflow.train.checkpoint_state import base_model_dir, checkpoint_state, role_dir
    from hybridflow.train.export import save_hf_dir

    source = role_dir(args.checkpoint, args.role)
    base = args.model or base_model_dir(args.checkpoint)
    out = save_hf_dir(checkpoint_state(source), base, load_tokenizer(base), args.out, dtype=args.dtype)
    print(f"wrote {out} from {source} (config and tokenizer from {base})")
    return 0
