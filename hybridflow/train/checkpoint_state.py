"""A policy's whole weights read back from a checkpoint on disk, whichever backend wrote it (no workers started).

| backend | files under ``checkpoints/step_N/roles/<role>/`` | read with | unpickles |
|---|---|---|---|
| torch | ``state.pt`` (``{"model", "optimizer"}``) | ``torch.load(weights_only=True)`` | no |
| fsdp | DCP shards and ``.metadata`` | ``dcp_to_torch_save`` (no process group) | yes (``.metadata``) |
| deepspeed | ``hybridflow/`` tag with ZeRO shards | DeepSpeed's ``zero_to_fp32`` | yes (``torch.load``) |

The format read is the one the checkpoint's ``trainer.json`` recorded when it was written, never one
guessed from the files present; the unpickling ones need ``trust=True`` (``hybridflow export
--trust-checkpoint``). A checkpoint from before formats were recorded is read as torch when it has a
``state.pt`` and otherwise needs ``trust=True`` too, whatever its files look like.
"""

from __future__ import annotations

import json
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from hybridflow.train.checkpoint import DEEPSPEED_TAG, FORMAT_MARKERS, files_format
from hybridflow.train.file_checks import file_problem, manifest_problem

UNPICKLING = {"fsdp": "its DCP .metadata is a pickle",
              "deepspeed": "DeepSpeed's model states are read with torch.load(weights_only=False)"}
TRUST_FLAG = "--trust-checkpoint"


class UntrustedCheckpointError(ValueError):
    """Reading this checkpoint would unpickle (run code from) one of its files, and nobody said it is trusted."""


def role_dir(checkpoint: str | Path, role: str = "actor") -> Path:
    """The directory holding ``role``'s state: ``CHECKPOINT/roles/<role>``, or ``CHECKPOINT`` itself."""
    path = Path(checkpoint)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {str(path)!r} is not a directory")
    for candidate in (path / "roles" / role, path):
        if files_format(candidate) is not None:  # only where to look; the format read is the recorded one
            return candidate
    raise FileNotFoundError(f"{path} holds no {role!r} weights: expected roles/{role}/ with state.pt (torch), "
                            f".metadata (fsdp, DCP) or {DEEPSPEED_TAG}/ (deepspeed); found "
                            f"{sorted(p.name for p in path.iterdir())}")


def checkpoint_state(directory: str | Path, *, trust: bool = False) -> dict[str, torch.Tensor]:
    """Whole fp32-or-saved-dtype weights from one role's checkpoint directory (see :func:`role_dir`), read in
    the format its checkpoint recorded; an unpickling format is refused unless ``trust``."""
    path = Path(directory)
    kind = checkpoint_format(path)
    if kind in UNPICKLING and not trust:
        raise UntrustedCheckpointError(
            f"{path} holds a {kind} checkpoint and {UNPICKLING[kind]}: reading it runs whatever code the file "
            f"carries. Pass {TRUST_FLAG} only if you or your own job wrote it (else ask for its hf/ safetensors "
            "view, which carries no code)")
    if kind == "torch":
        try:
            state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
        except (RuntimeError, EOFError, OSError, ValueError) as err:  # torch's reader: truncated or not a zip
            raise ValueError(f"{path / 'state.pt'} cannot be loaded ({str(err).splitlines()[0]}); it is truncated "
                             "or corrupt: use an older checkpoint of the run") from err
        return dict(state["model"])
    return _sharded_state(path, kind)


def checkpoint_format(directory: Path) -> str:
    """The format ``trainer.json`` of the checkpoint holding this role directory recorded for it.

    Checkpoints written before formats were recorded: ``torch`` when a ``state.pt`` is there (read without
    unpickling), else the format the files look like, which :func:`checkpoint_state` reads only if trusted.
    """
    recorded = _recorded_formats(directory)
    if recorded is None:
        legacy = files_format(directory)
        if legacy is None:
            raise FileNotFoundError(f"{directory}: not a torch, fsdp or deepspeed role checkpoint")
        if legacy != "torch":
            print(f"note: {directory}'s checkpoint records no format (written by an older hybridflow); its files "
                  f"look like {legacy}", file=sys.stderr)
        return legacy
    kind = recorded.get(directory.name)
    if kind not in FORMAT_MARKERS:
        raise ValueError(f"{directory}: trainer.json records format {kind!r} for role {directory.name!r}; "
                         f"export reads {sorted(FORMAT_MARKERS)} (a custom backend's checkpoint is its own to read)")
    if not (directory / FORMAT_MARKERS[kind]).exists():
        raise FileNotFoundError(f"{directory}: trainer.json records a {kind} checkpoint but "
                                f"{FORMAT_MARKERS[kind]} is missing; the checkpoint is incomplete: use an older one")
    return kind


def _recorded_formats(directory: Path) -> dict[str, str] | None:
    """``trainer.json``'s ``formats`` for the checkpoint ``<checkpoint>/roles/<role>``; None if it records none."""
    trainer = directory.resolve().parent.parent / "trainer.json"
    if not trainer.is_file():
        return None
    try:
        formats = json.loads(trainer.read_text()).get("formats")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
        raise ValueError(f"{trainer} is not a JSON object ({err}); the checkpoint is unusable: use an older "
                         "one") from err
    return formats if isinstance(formats, dict) else None


def base_model_dir(checkpoint: str | Path) -> Path:
    """The model directory a checkpoint's weights fit (config, tokenizer): its ``hf/`` view, else the run's
    starting model (``model.path`` in the run's ``config.json``, or its SFT-warmed ``init_model``)."""
    path = Path(checkpoint).resolve()
    if (path / "hf" / "config.json").is_file():
        return path / "hf"
    start = recorded_base_model(path)
    if start is not None and (start / "config.json").is_file():
        return start
    raise FileNotFoundError(f"cannot tell which model {path} belongs to (no hf/ view, no run config.json two "
                            "levels up); pass --model DIR, the run's starting HF directory")


def checkpoint_of(path: str | Path) -> Path:
    """``path`` itself, or a run directory's newest complete checkpoint (``RUN_DIR/checkpoints/step_N``)."""
    from hybridflow.train.checkpoint import latest_checkpoint

    path = Path(path)
    if (path / "checkpoints").is_dir() and (path / "config.json").is_file():
        latest = latest_checkpoint(path)
        if latest is None:
            raise FileNotFoundError(f"run {path} has no complete checkpoint under checkpoints/ (set "
                                    f"checkpoint.every); its final policy is {path / 'final'}")
        return latest
    return path


def run_config(checkpoint: str | Path) -> dict[str, Any] | None:
    """The ``config.json`` of the run a checkpoint (``step_N/`` or ``step_N/roles/<role>/``) belongs to."""
    path = Path(checkpoint).resolve()
    for run_dir in (path.parent.parent, path.parent.parent.parent.parent):
        config = run_dir / "config.json"
        if config.is_file():
            found: dict[str, Any] = json.loads(config.read_text())
            found["_run_dir"] = str(run_dir)
            return found
    return None


def recorded_base_model(checkpoint: str | Path) -> Path | None:
    """The starting model the run's ``config.json`` names (``model.path``, else the run's ``init_model``),
    whether or not it is still on disk; None without a run config."""
    config = run_config(checkpoint)
    if config is None:
        return None
    model = config.get("model", {})
    return Path(model["path"]) if model.get("path") else Path(config["_run_dir"]) / "init_model"


def _sharded_state(path: Path, kind: str) -> dict[str, torch.Tensor]:
    """An fsdp or deepspeed role's weights; a truncated or corrupt shard is named (checked before reading)."""
    from torch.distributed.checkpoint.api import CheckpointException

    problem = next((f"{file} {found}" for file in sorted(path.rglob("*")) if file.is_file()
                    and (found := file_problem(file)) is not None), None)
    if problem is None and path.parent.name == "roles":
        problem = manifest_problem(path.parent.parent, under=f"roles/{path.name}/")
    if problem is not None:
        raise ValueError(f"{problem}; the {kind} checkpoint cannot be loaded: use an older checkpoint of the run")
    try:
        return _dcp_state(path) if kind == "fsdp" else _deepspeed_state(path)
    except (CheckpointException, RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as err:
        first = str(err).strip().splitlines()
        raise ValueError(f"the {kind} checkpoint {path} cannot be loaded ({type(err).__name__}: "
                         f"{first[0] if first else ''}); it is truncated or corrupt: use an older checkpoint of the "
                         "run") from err


def _dcp_state(path: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "state.pt"
        dcp_to_torch_save(str(path), str(target))
        state = torch.load(target, map_location="cpu", weights_only=True)
    model = state["model"] if isinstance(state.get("model"), dict) else {
        key.removeprefix("model."): value for key, value in state.items() if key.startswith("model.")}
    return {name: tensor for name, tensor in model.items() if isinstance(tensor, torch.Tensor)}


def _deepspeed_state(path: Path) -> dict[str, torch.Tensor]:
    tag = path / DEEPSPEED_TAG
    if not list(tag.glob("*zero_pp_rank_*")):  # ZeRO stage 0: the model states file holds whole weights
        files = sorted(tag.glob("mp_rank_*_model_states.pt"))
        if not files:
            raise FileNotFoundError(f"{tag}: no DeepSpeed model states (mp_rank_*_model_states.pt)")
        state = torch.load(files[0], map_location="cpu", weights_only=False)["module"]
    else:  # stages 1-3: the fp32 master weights, merged from every rank's optimizer shards
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=DEEPSPEED_TAG)
    return {name: tensor.float() if tensor.is_floating_point() else tensor for name, tensor in state.items()}
