"""One fleet for all of a role's ranks: rank 0 starts the replicas and the router, the other ranks send their rows
to that router.

A served rollout's ranks are its data-parallel shards; the servers need not be split the same way. Where the ranks
share a machine, rank 0 (the *leader*) starts the whole fleet the plan sized, ``dp * tp / rollout_tp`` replicas of
``rollout_tp`` GPUs each (on CUDA replica ``i`` gets the GPUs of ranks ``i * rollout_tp`` onwards, so a
tensor-parallel replica spans ranks), and one router in front; the other ranks (*followers*) start nothing and
send their requests to it. Every rank still calls ``generate`` on its own share of the rows, so the data plane
is unchanged and the router balances the whole role's requests over the whole fleet.

The ranks agree once, through the group's collective, at start (:func:`join_role_fleet`: each rank's machine and
GPU, and the leader's log directory); after that the leader publishes the fleet's state in a small JSON file
there (:class:`FleetState`: the router's URL, the model it serves, the weights version every replica holds, or
the error that ended the fleet), written whole and atomically, and the followers read it. A follower therefore
never waits in a collective on the leader's slow work (starting servers takes minutes on CPU; a group's
collective times out in 60 s on Ray): it waits on the file, with a deadline, and fails with the leader's error if
the leader published one.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.runtime.protocols import WorkerContext

FLEET_MODES = ("role", "rank")
STATE_FILE = "fleet.json"
POLL_S = 0.05


@dataclass(frozen=True)
class RankPlace:
    """Where a rank runs: its machine, its GPU (the ``CUDA_VISIBLE_DEVICES`` entry of its device; None on CPU) and,
    for rank 0, the directory its fleet logs to."""

    host: str
    gpu: str | None = None
    log_dir: str | None = None


def visible_gpus() -> list[str]:
    """The ids of the GPUs this process sees, as another process's ``CUDA_VISIBLE_DEVICES`` names them."""
    import torch

    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    return listed.split(",") if listed else [str(i) for i in range(torch.cuda.device_count())]


def physical_gpu(device: str) -> str | None:
    """The GPU id a CUDA ``device`` of this process stands for (what another process's ``CUDA_VISIBLE_DEVICES``
    names it by); None off CUDA."""
    if not device.startswith("cuda"):
        return None
    import torch

    _, _, index = device.partition(":")
    visible = visible_gpus()
    number = int(index) if index else torch.cuda.current_device()
    return visible[number] if number < len(visible) else str(number)


class FleetState:
    """The leader's word to its followers: a JSON object in one file, replaced whole at each change."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)

    def publish(self, **fields: Any) -> None:
        """Merge ``fields`` into the state and write it atomically (readers see the old state or the new one)."""
        state = {**(self.read() or {}), **fields}
        handle, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=".fleet-")
        with os.fdopen(handle, "w") as out:
            json.dump(state, out)
        os.replace(temporary, self.path)

    def read(self) -> dict[str, Any] | None:
        try:
            return dict(json.loads(self.path.read_text()))
        except FileNotFoundError:
            return None

    def wait(self, ready: Callable[[dict[str, Any]], bool], *, deadline_s: float, what: str) -> dict[str, Any]:
        """The state once ``ready`` holds of it; the leader's published error, or ``deadline_s`` passing first, is
        one error naming ``what`` was awaited and the leader's logs."""
        give_up = time.monotonic() + deadline_s
        while True:
            state = self.read()
            if state is not None and state.get("error"):
                raise RuntimeError(f"rank 0, which runs the role's rollout servers, failed: {state['error']} "
                                   f"(logs in {self.path.parent})")
            if state is not None and ready(state):
                return state
            if time.monotonic() > give_up:
                raise TimeoutError(f"waited {deadline_s:.0f} s for {what} from rank 0, which runs the role's rollout "
                                   f"servers (its state file {self.path}: {state}); see its error and the logs in "
                                   f"{self.path.parent}")
            time.sleep(POLL_S)


@dataclass(frozen=True)
class RoleFleet:
    """This rank's part in its role's one fleet: ``leader`` starts it, publishing to ``state``; ``gpus`` are the
    role's GPUs in rank order (None on CPU), ``log_dir`` the leader's."""

    leader: bool
    state: FleetState
    log_dir: str
    gpus: tuple[str, ...] | None


def join_role_fleet(context: WorkerContext, *, mode: str | None, log_dir: str | None, role: str) -> RoleFleet | None:
    """Agree with the role's other ranks on one fleet (``mode`` ``role``, or unset where every rank is on one
    machine); None: this rank runs a fleet of its own (``rank``, one rank, or ranks on several machines). Every rank
    of the role calls it, at the same point of its build."""
    if context.world_size == 1 or mode == "rank":
        return None
    own_dir = None
    if context.rank == 0:
        own_dir = log_dir or tempfile.mkdtemp(prefix="hybridflow-servers-")
        Path(own_dir).mkdir(parents=True, exist_ok=True)
        FleetState(Path(own_dir) / STATE_FILE).clear()  # a last run's state must not be read as this one's
    places: Sequence[RankPlace] = context.collective.all_gather_object(
        RankPlace(host=socket.gethostname(), gpu=physical_gpu(context.device), log_dir=own_dir))
    hosts = sorted({place.host for place in places})
    if len(hosts) > 1:
        if mode == "role":
            raise ValueError(f"role {role!r}: rollout_options.fleet=role runs one fleet for the role's ranks, started "
                             f"by rank 0 on its machine, but the ranks are on {len(hosts)} machines "
                             f"({', '.join(hosts)}); set fleet: rank (a fleet per rank) or place the role on one "
                             "machine")
        return None
    leader_dir = str(places[0].log_dir)
    gpus = [place.gpu for place in places]
    return RoleFleet(leader=context.rank == 0, state=FleetState(Path(leader_dir) / STATE_FILE), log_dir=leader_dir,
                     gpus=None if None in gpus else tuple(str(gpu) for gpu in gpus))
