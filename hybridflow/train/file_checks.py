"""Cheap integrity checks of the files a run reads back: a checkpoint's ``trainer.json``, its roles' torch
files (``state.pt``, DeepSpeed's model states), safetensors weights (a checkpoint's ``hf/`` view, a model
directory) and an overlapped run's rollout state. Each returns what is wrong with a file, or None, without
unpickling anything or reading the tensors: the structure a truncated or overwritten file loses (a zip's
central directory, a safetensors header and its data extent, JSON) is enough to tell it from an intact one
before a worker loads it."""

from __future__ import annotations

import json
import pickletools
import struct
import zipfile
from pathlib import Path
from typing import Any

SAFETENSORS_MAX_HEADER = 100 << 20  # the format's own bound on its JSON header


def json_problem(path: Path) -> str | None:
    """What is wrong with ``path`` as a JSON mapping (unreadable, not JSON, not a mapping), or None."""
    try:
        loaded = json.loads(path.read_bytes())
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
        return f"is not JSON ({err})"
    if not isinstance(loaded, dict):
        return f"holds a {type(loaded).__name__}, not a JSON mapping"
    return None


def torch_file_problem(path: Path) -> str | None:
    """What is wrong with a ``torch.save`` file (a zip archive), or None; a truncated one has no central directory."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    except zipfile.BadZipFile as err:
        return f"is truncated or corrupt (not a whole torch.save archive: {err})"
    if not any(name.endswith("data.pkl") for name in names):
        return "is not a torch.save archive (no data.pkl in it)"
    return None


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with a safetensors file (its header, or tensors reaching past the file's end), or None."""
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                return f"is truncated ({size} bytes, shorter than a safetensors header)"
            (length,) = struct.unpack("<Q", prefix)
            if length > min(SAFETENSORS_MAX_HEADER, size - 8):
                return f"is truncated or corrupt (its header claims {length} bytes; the file has {size})"
            header = json.loads(handle.read(length))
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    except (ValueError, UnicodeDecodeError) as err:
        return f"is corrupt (its safetensors header is not JSON: {err})"
    if not isinstance(header, dict):
        return "is corrupt (its safetensors header is not a mapping)"
    ends = [entry.get("data_offsets", [0, 0])[1] for name, entry in header.items()
            if name != "__metadata__" and isinstance(entry, dict)]
    needed = 8 + length + max(ends, default=0)
    if not all(isinstance(end, int) for end in ends) or needed > size:
        return f"is truncated ({size} bytes; its tensors need {needed})"
    return None


def wire_problem(path: Path) -> str | None:
    """What is wrong with a :mod:`~hybridflow.runtime.safe_wire` frame (a checkpoint's rollout state): its
    header, or buffers that do not add up to the file's size; None when whole."""
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                return f"is truncated ({size} bytes, shorter than its header)"
            (length,) = struct.unpack("<Q", prefix)
            if length > size - 8:
                return f"is truncated or corrupt (its header claims {length} bytes; the file has {size})"
            header = json.loads(handle.read(length))
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    except (ValueError, UnicodeDecodeError) as err:
        return f"is corrupt (its header is not JSON: {err})"
    needed = 8 + length + _buffer_bytes(header)
    if needed != size:
        return f"is truncated or corrupt ({size} bytes; its header describes {needed})"
    return None


def _buffer_bytes(node: object) -> int:
    """The raw bytes a safe_wire header's arrays and byte strings take (each tagged node carries its size)."""
    if isinstance(node, list):
        return sum(_buffer_bytes(item) for item in node)
    if not isinstance(node, dict):
        return 0
    own = node["n"] if node.get("__t") in ("nd", "bytes") and isinstance(node.get("n"), int) else 0
    return own + sum(_buffer_bytes(value) for key, value in node.items() if key != "n")


ROLLOUT_STATE = "rollout_state.bin"  # hybridflow.runtime.rollout_state.ROLLOUT_STATE (train must stay light here)
MANIFEST = "files.json"  # every file of a checkpoint and its size, written last (train/checkpoint.py)


def pickle_problem(path: Path) -> str | None:
    """What is wrong with a pickle (DCP's ``.metadata``), read opcode by opcode without running any, or None."""
    try:
        data = path.read_bytes()
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    try:
        for _ in pickletools.genops(data):
            pass
    except ValueError as err:  # genops: truncated data, an unknown opcode
        return f"is truncated or corrupt (not a whole pickle: {err})"
    return None


def manifest_problem(checkpoint: Path, *, under: str = "") -> str | None:
    """The first file of ``checkpoint`` (those whose path starts with ``under``) missing or of another size than
    its manifest records, or None (also for a checkpoint written before manifests): truncation in any
    backend's format, shards included."""
    manifest = checkpoint / MANIFEST
    if not manifest.is_file():
        return None
    problem = json_problem(manifest)
    files = json.loads(manifest.read_text()).get("files") if problem is None else None
    if not isinstance(files, dict):
        return f"{manifest} {problem or 'has no files mapping'}"
    for name, size in sorted(files.items()):
        if not name.startswith(under):
            continue
        path = checkpoint / name
        if not path.is_file():
            return f"{path} is missing (the checkpoint wrote it)"
        if path.stat().st_size != size:
            return f"{path} is truncated or was rewritten ({path.stat().st_size} bytes; the checkpoint wrote {size})"
    return None


def file_problem(path: Path) -> str | None:
    """What is wrong with one checkpoint file of a format checked here, or None (also for other files)."""
    if path.name == "state.pt" or path.name.endswith(("_model_states.pt", "_optim_states.pt")):
        return torch_file_problem(path)
    if path.suffix == ".safetensors":
        return safetensors_problem(path)
    if path.name == ROLLOUT_STATE:
        return wire_problem(path)
    if path.name == ".metadata" and any(path.parent.glob("*.distcp")):
        return pickle_problem(path)
    return None


def checkpoint_problem(checkpoint: Path) -> str | None:
    """The first broken file of a checkpoint directory, named with what is wrong with it, or None when intact."""
    trainer = checkpoint / "trainer.json"
    problem = json_problem(trainer)
    if problem is None:
        step = json.loads(trainer.read_text()).get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            problem = f"has no integer 'step' (got {step!r})"
    if problem is not None:
        return f"{trainer} {problem}"
    for path in sorted(checkpoint.rglob("*")):
        problem = file_problem(path) if path.is_file() else None
        if problem is not None:
            return f"{path} {problem}"
    return manifest_problem(checkpoint)


def model_config(key: str, path: Path) -> dict[str, Any]:
    """The model directory's ``config.json`` as a mapping; a file that is not JSON is named with the fix."""
    file = path / "config.json"
    try:
        loaded = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
        raise ValueError(f"config key {key!r}: {file} is not JSON ({err}); restore it from the model's source "
                         "(it is the Hugging Face config the model was saved with)") from err
    if not isinstance(loaded, dict):
        raise ValueError(f"config key {key!r}: {file} holds a {type(loaded).__name__}, not the mapping of a Hugging "
                         "Face model config; restore it from the model's source")
    return loaded
