"""``hybridflow export RUN_DIR|CHECKPOINT OUT``: a checkpoint (torch, FSDP or DeepSpeed) as a Hugging Face directory.

Only the format the checkpoint's ``trainer.json`` recorded is read; fsdp and deepspeed checkpoints are
unpickled, so they need ``--trust-checkpoint``. A full fine-tuning checkpoint becomes an HF model directory. A LoRA
run's checkpoint (adapters only) becomes a peft adapter directory naming the run's base model; ``--merged`` also
writes the base with the adapters merged in, an HF model directory, to ``OUT/merged``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("export", help="convert a training checkpoint to a Hugging Face model directory "
                                                  "(a peft adapter directory for a LoRA run)")
    parser.add_argument("checkpoint", help="a run directory (its newest checkpoint), a checkpoint "
                                           "(RUN_DIR/checkpoints/step_N) or one role's folder in it")
    parser.add_argument("out", help="the directory to write: an HF model (safetensors, config, tokenizer, "
                                    "generation config), or for a LoRA run a peft adapter (adapter_model.safetensors, "
                                    "adapter_config.json)")
    parser.add_argument("--role", default="actor", help="the trainable role to export (default: actor)")
    parser.add_argument("--model", default=None, help="the run's starting HF directory (config and tokenizer; the "
                                                      "base of a LoRA run); default: the checkpoint's hf/ view or "
                                                      "the run's model")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                        help="weight dtype of the export (default: the model config's)")
    parser.add_argument("--merged", action="store_true",
                        help="LoRA runs: also write the base model with the adapters merged in to OUT/merged "
                             "(needs the base model's weights)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace OUT if it holds a previous export (a directory with hybridflow_export.json); "
                             "any other non-empty OUT is refused")
    parser.add_argument("--trust-checkpoint", action="store_true",
                        help="read an fsdp or deepspeed checkpoint, whose files are unpickled (they can run code): "
                             "only for checkpoints you or your own job wrote. torch checkpoints need no trust")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hybridflow.models.tokenizer import load_tokenizer
    from hybridflow.train.adapter_export import is_adapter_state, run_lora
    from hybridflow.train.checkpoint_state import (
        base_model_dir,
        checkpoint_of,
        checkpoint_state,
        role_dir,
        run_config,
    )
    from hybridflow.train.export import check_export_target, save_hf_dir

    checkpoint = checkpoint_of(args.checkpoint)
    source = role_dir(checkpoint, args.role)
    state = checkpoint_state(source, trust=getattr(args, "trust_checkpoint", False))
    check_export_target(Path(args.out), checkpoint, overwrite=getattr(args, "overwrite", False))
    config = run_config(source)
    spec = run_lora(config, args.role)
    if spec is not None or is_adapter_state(state):
        return _export_lora(args, source, state, config)
    if args.merged:
        raise ValueError(f"--merged: {source} is a full fine-tuning checkpoint (no roles.{args.role}.lora in its run): "
                         f"it holds the whole model already; export it without --merged")
    base = args.model or base_model_dir(checkpoint)
    out = save_hf_dir(state, base, load_tokenizer(base), args.out, dtype=args.dtype)
    print(f"wrote {out} from {source} (config and tokenizer from {base})")
    return 0


def _export_lora(args: argparse.Namespace, source: Path, state: Any, config: dict[str, Any] | None) -> int:
    from hybridflow.models.tokenizer import load_tokenizer
    from hybridflow.train.adapter_export import merged_state, run_lora, save_adapter_dir
    from hybridflow.train.checkpoint_state import recorded_base_model
    from hybridflow.train.export import save_hf_dir

    spec = run_lora(config, args.role)
    if spec is None:
        raise ValueError(f"{source} holds LoRA adapters but no run config.json names their settings "
                         f"(roles.{args.role}.lora): export it from inside its run directory")
    base = Path(args.model) if args.model else recorded_base_model(source)
    assert base is not None  # a run config was found
    base = base.resolve()
    if args.merged and not (base / "config.json").is_file():
        raise FileNotFoundError(f"--merged needs the base model the adapters were trained on, {base}, which is not "
                                "there (no config.json): pass --model DIR, or export the adapter alone without "
                                "--merged")
    out = Path(args.out)
    if spec.keeps_base:
        save_adapter_dir(state, spec, base, out, role=args.role)
        print(f"wrote the LoRA adapter {out} from {source} (base model {base})")
    if args.merged or not spec.keeps_base:
        if not (base / "config.json").is_file():
            raise FileNotFoundError(f"roles.{args.role}.lora.init={spec.init!r}: only the merged model can be "
                                    f"exported, and it needs the base model {base}, which is not there: pass --model")
        merged = out / "merged" if spec.keeps_base else out
        seed = int((config or {}).get("seed", 0))
        save_hf_dir(merged_state(state, spec, base, seed=seed, role=args.role), base, load_tokenizer(base), merged,
                    dtype=args.dtype)
        print(f"wrote the merged model {merged} (base {base} with the adapters of {source})")
    return 0
