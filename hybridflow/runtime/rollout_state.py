"""What a detached rollout holds between steps, saved beside a checkpoint so an overlapped run resumes exactly.

At a checkpoint after step s-1 the trainer holds the weights of version s, but the rollouter of
``one_step_off`` / ``async`` already holds work for the steps after it: batches generated with older weights
(step s's, with version s-1 in ``one_step_off``), and with partial rollouts sequences half generated, each
token tagged with the version that sampled it. Those older weights are gone from the checkpoint, so
regenerating the work would sample with version s (staleness 0 instead of 1) and change every later step.
:class:`RolloutState` is that work, plus what seeds the next generate calls (the segment counter) and how
fields are padded: restored before the rollouter starts, the resumed run continues from the very state the
uninterrupted run had.

The file (:data:`ROLLOUT_STATE`, beside the roles' checkpoints) is a :mod:`~hybridflow.runtime.safe_wire` frame:
loading it rebuilds plain values and arrays and runs no code (unlike a pickle).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridflow.runtime import safe_wire
from hybridflow.runtime.batch import Batch, from_numpy, to_numpy

ROLLOUT_STATE = "rollout_state.bin"  # hybridflow/train/file_checks.py checks it under this name
FORMAT = 1
RESPONSE_FIELD = "responses"


class ResumeWarning(UserWarning):
    """A resume that cannot reproduce the uninterrupted run; the message says what differs and from which step."""


@dataclass
class InFlight:
    """One sample in flight: its step and row, prompt ids, and the response pieces generated so far."""

    step: int
    row: int
    rows: Batch  # the step's rows (the sequence is row ``row``)
    prompt: torch.Tensor  # (P,) the prompt's tokens, padding removed
    pieces: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    versions: list[torch.Tensor] = field(default_factory=list)
    generated: int = 0

    def response(self) -> torch.Tensor:
        pieces = self.pieces.get(RESPONSE_FIELD, [])
        return torch.cat(pieces) if pieces else self.prompt.new_zeros(0)


@dataclass
class Pending:
    """A step's rows while they generate: the rows, and each finished row's sequence."""

    rows: Batch
    done: dict[int, InFlight] = field(default_factory=dict)
    started: int = 0  # rows handed to the engine so far (partial rollouts start a step row by row)


@dataclass(frozen=True, kw_only=True)
class RolloutState:
    """A rollouter's work between two generate calls (see the module docstring)."""

    k: int  # the mode it was generated under: restoring into another mode would break the staleness bound
    segment_tokens: int | None
    weights_version: int
    segments: int  # partial-rollout segments run so far: each one's seed counts them
    pads: dict[str, float]
    ready: dict[int, Batch]
    pending: dict[int, Pending]
    flight: list[InFlight]  # in the engine's order; each is one of its step's pending rows

    @property
    def steps(self) -> list[int]:
        return sorted({*self.ready, *self.pending})


def encode(state: RolloutState) -> bytes:
    """``state`` as a :mod:`safe_wire` frame."""
    return safe_wire.dumps({
        "format": FORMAT, "k": state.k, "segment_tokens": state.segment_tokens,
        "weights_version": state.weights_version, "segments": state.segments, "pads": dict(state.pads),
        "ready": {step: batch.to_wire() for step, batch in state.ready.items()},
        "pending": {step: {"rows": p.rows.to_wire(), "started": p.started,
                           "done": [_sequence(s) for s in p.done.values()]} for step, p in state.pending.items()},
        "flight": [_sequence(s) for s in state.flight]})


def decode(data: bytes) -> RolloutState:
    """The state :func:`encode` wrote; raises ``ValueError`` on anything else."""
    tree = safe_wire.loads(data)
    if not isinstance(tree, dict) or tree.get("format") != FORMAT:
        found = tree.get("format") if isinstance(tree, dict) else type(tree).__name__
        raise ValueError(f"not a rollout state of format {FORMAT} (found {found!r})")
    try:
        pending = {int(step): Pending(rows=Batch.from_wire(p["rows"]), started=int(p["started"]))
                   for step, p in tree["pending"].items()}
        for step, item in tree["pending"].items():
            for done in item["done"]:
                sequence = _sequence_from(done, pending)
                pending[int(step)].done[sequence.row] = sequence
        return RolloutState(k=int(tree["k"]), segment_tokens=tree["segment_tokens"],
                            weights_version=int(tree["weights_version"]), segments=int(tree["segments"]),
                            pads={str(k): float(v) for k, v in tree["pads"].items()},
                            ready={int(step): Batch.from_wire(wire) for step, wire in tree["ready"].items()},
                            pending=pending, flight=[_sequence_from(s, pending) for s in tree["flight"]])
    except (KeyError, TypeError, AttributeError, IndexError) as err:
        raise ValueError(f"a rollout state with a missing or malformed field ({type(err).__name__}: {err})") from err


def write_state(directory: str | Path, state: RolloutState) -> Path:
    """Write ``state`` into ``directory`` (a checkpoint's ``roles/``, itself written atomically)."""
    path = Path(directory) / ROLLOUT_STATE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode(state))
    return path


def read_state(directory: str | Path) -> RolloutState | None:
    """The state saved in ``directory``, None when it holds none (a checkpoint of sync mode, or an older one)."""
    path = Path(directory) / ROLLOUT_STATE
    if not path.is_file():
        return None
    try:
        return decode(path.read_bytes())
    except ValueError as err:  # WireFormatError is one
        raise ValueError(f"{path} is truncated or corrupt ({err}); resume from an older checkpoint, or delete the "
                         "file to resume this one with the batches in flight regenerated (inexactly)") from err


def _tensor(value: torch.Tensor) -> tuple[str, Any]:
    return str(value.dtype), to_numpy(value)


def _sequence(sequence: InFlight) -> dict[str, Any]:
    # The pieces of each field joined: everything that reads them (response(), assembly) concatenates them.
    return {"step": sequence.step, "row": sequence.row, "prompt": _tensor(sequence.prompt),
            "generated": sequence.generated,
            "pieces": {name: _tensor(torch.cat(pieces)) for name, pieces in sequence.pieces.items() if pieces},
            "versions": _tensor(torch.cat(sequence.versions)) if sequence.versions else None}


def _sequence_from(tree: dict[str, Any], pending: dict[int, Pending]) -> InFlight:
    step = int(tree["step"])
    if step not in pending:
        raise KeyError(f"a sequence of step {step}, which has no pending rows")
    versions = tree["versions"]
    return InFlight(step=step, row=int(tree["row"]), rows=pending[step].rows, prompt=from_numpy(*tree["prompt"]),
                    pieces={name: [from_numpy(*value)] for name, value in tree["pieces"].items()},
                    versions=[from_numpy(*versions)] if versions is not None else [],
                    generated=int(tree["generated"]))
