"""The control plane of the torchrun executor: the process world and its requests and replies.

Under ``torchrun`` every process is one logical GPU (global rank = plan GPU id). Rank 0 runs the
controller; every other rank waits for :class:`Request` s from rank 0 and answers each with a
:class:`Reply`. Messages are :mod:`~hybridflow.runtime.safe_wire` frames (tagged JSON plus raw
numpy buffers, never pickle: a peer that reaches the port cannot make a rank run code) sent point to
point over gloo in a uint8 tensor, size first; batches inside them are numpy (:meth:`Batch.to_wire`).
On one machine the gloo sockets bind to loopback (``GLOO_SOCKET_IFNAME=lo``; docs/security.md).

Two gloo groups over all ranks carry the traffic: ``requests`` (rank 0 -> rank r) and ``replies``
(rank r -> rank 0). Each op has its own deadline:

- a serving rank waits up to ``idle_timeout_s`` for its next request: it may idle as long as the
  controller works elsewhere (SFT warm start, other groups, driver-side rewards);
- every other op (sending a request, waiting for a reply) and the data-parallel all-reduces wait up
  to ``timeout_s``: a dead rank surfaces on rank 0 at once (gloo sees the closed connection);
- a serving rank also bumps a heartbeat counter in torchrun's TCP store every ``HEARTBEAT_INTERVAL_S``
  from a thread of its own; while rank 0 waits on a rank it watches that counter (:class:`Heartbeats`),
  so a hung rank (stopped, frozen) fails the wait after ``heartbeat_timeout_s`` rather than ``timeout_s``.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

from hybridflow.runtime import safe_wire

DEFAULT_TIMEOUT_S = 1800.0
IDLE_TIMEOUT_S = 7 * 24 * 3600.0
HEARTBEAT_INTERVAL_S = 0.5
_HEARTBEAT_KEY = "hybridflow/heartbeat/{rank}"
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

RequestKind = Literal["start", "run", "call", "stop", "exit"]


@dataclass(frozen=True, kw_only=True)
class TorchrunWorld:
    """This process's place in the torchrun world and the control-plane groups (see module docstring)."""

    rank: int
    world_size: int
    local_rank: int
    timeout_s: float
    idle_timeout_s: float
    requests: Any  # torch.distributed.ProcessGroup
    replies: Any


@dataclass(frozen=True, kw_only=True)
class Request:
    """One message from rank 0. ``group`` is the plan group it is for (-1: the whole rank)."""

    kind: RequestKind
    group: int = -1
    args: tuple[Any, ...] = ()


@dataclass(frozen=True, kw_only=True)
class RemoteError:
    """An exception raised on a serving rank, carried to rank 0.

    ``exception`` is the original when the control plane can carry it (builtin and hybridflow exceptions,
    so ``except NonFiniteLossError`` still works on rank 0); otherwise None, and rank 0 raises a
    ``RuntimeStepError`` with the same text.
    """

    exception: BaseException | None
    type_name: str
    message: str
    traceback: str

    @classmethod
    def capture(cls, err: BaseException) -> RemoteError:
        text = "".join(traceback.format_exception(err))
        exception = err if safe_wire.encodable(err) else None  # other classes travel as text
        return cls(exception=exception, type_name=type(err).__qualname__, message=str(err), traceback=text)

    def reraise(self, *, where: str, node: str | None) -> NoReturn:
        """Raise on rank 0, with a note naming ``where`` it happened and the remote traceback."""
        from hybridflow.runtime.errors import RuntimeStepError

        note = f"raised on {where}; remote traceback:\n{self.traceback}"
        if self.exception is not None:
            self.exception.add_note(note)
            raise self.exception
        raise RuntimeStepError(f"{where} raised {self.type_name}: {self.message}\n{note}", node=node)


@dataclass(frozen=True, kw_only=True)
class Reply:
    """A serving rank's answer: a value or an error."""

    value: Any = None
    error: RemoteError | None = None


def under_torchrun() -> bool:
    """True when the torchrun (torchelastic) environment variables are set."""
    return all(name in os.environ for name in TORCHRUN_ENV)


def single_machine() -> bool:
    """True when every rank runs on this machine (torchrun's LOCAL_WORLD_SIZE equals WORLD_SIZE)."""
    return os.environ.get("LOCAL_WORLD_SIZE", "") == os.environ.get("WORLD_SIZE", "-1")


_WORLD: TorchrunWorld | None = None


def init_world(*, timeout_s: float = DEFAULT_TIMEOUT_S, idle_timeout_s: float = IDLE_TIMEOUT_S) -> TorchrunWorld:
    """Join the torchrun process group (gloo on CPU; NCCL for CUDA tensors) and make the control groups.

    Every rank must call this once, before anything else distributed.
    """
    global _WORLD
    import torch
    import torch.distributed as dist

    if not under_torchrun():
        missing = [name for name in TORCHRUN_ENV if name not in os.environ]
        raise RuntimeError(f"not started by torchrun (missing {missing}); launch with "
                           "`torchrun --nproc_per_node=N examples/train_ppo.py --config FILE`")
    local_rank = int(os.environ["LOCAL_RANK"])
    backend = "gloo"
    if single_machine() and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # one machine: nothing beyond loopback needs these sockets
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        backend = "cpu:gloo,cuda:nccl"  # control objects on CPU through gloo, gradients on GPU through NCCL
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout)
    # Every rank creates both control groups in the same order, as torch.distributed requires.
    requests = dist.new_group(backend="gloo", timeout=timeout)
    replies = dist.new_group(backend="gloo", timeout=timeout)
    _WORLD = TorchrunWorld(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                           timeout_s=timeout_s, idle_timeout_s=idle_timeout_s, requests=requests, replies=replies)
    return _WORLD


def current_world() -> TorchrunWorld:
    """The world :func:`init_world` made in this process."""
    if _WORLD is None:
        raise RuntimeError("executor 'torchrun' needs the process world that torchrun starts: launch "
                           "`torchrun --nproc_per_node=N examples/train_ppo.py --config FILE` (it calls "
                           "init_world), or set executor=local / executor=ray")
    return _WORLD


def _store() -> Any:
    """A client of torchrun's TCP store of our own (its own connection, so any thread may use it)."""
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=60), wait_for_workers=False)


class Heartbeat:
    """This rank's counter in the store, bumped every ``HEARTBEAT_INTERVAL_S`` by a thread of its own.

    :meth:`stop` ends and joins the thread: a thread left inside the store's C++ call when the interpreter
    exits is unwound through a ``noexcept`` frame, and the process aborts ("terminate called without an
    active exception") after a run that succeeded.
    """

    def __init__(self, world: TorchrunWorld) -> None:
        self._store, self._key = _store(), _HEARTBEAT_KEY.format(rank=world.rank)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"hybridflow-heartbeat-{world.rank}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        count = 0
        while not self._stopped.is_set():
            count += 1
            try:
                self._store.set(self._key, str(count))
            except RuntimeError:  # the store (rank 0's launcher) is gone: the job is ending
                return
            self._stopped.wait(HEARTBEAT_INTERVAL_S)

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=HEARTBEAT_INTERVAL_S + 60)  # a store call gives up after its 60 s timeout


class Heartbeats:
    """Rank 0's watch on the serving ranks' counters: :meth:`check` raises once one stalls past the timeout."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._store: Any = None
        self._seen: dict[int, tuple[bytes, float]] = {}  # rank -> (counter, when it last changed, our clock)
        self._checked: dict[int, float] = {}

    def check(self, rank: int) -> None:
        now = time.monotonic()
        if now - self._checked.get(rank, float("-inf")) < HEARTBEAT_INTERVAL_S / 2:
            return
        self._checked[rank] = now
        if self._store is None:
            self._store = _store()
        key = _HEARTBEAT_KEY.format(rank=rank)
        value = self._store.get(key) if self._store.check([key]) else b""
        seen = self._seen.get(rank)
        if seen is None or seen[0] != value:
            self._seen[rank] = (value, now)
        elif now - seen[1] > self.timeout_s:
            raise RuntimeError(f"no heartbeat for {now - seen[1]:.0f}s (heartbeat_timeout_s={self.timeout_s:g}): "
                               "the process is stopped, frozen or its host is unreachable")


def send_request(world: TorchrunWorld, dst: int, request: Request, heartbeats: Heartbeats | None = None) -> None:
    _send_object(request, dst, world.requests, world.timeout_s, _watch(heartbeats, dst))


def recv_request(world: TorchrunWorld) -> Request:
    return _checked(_recv_object(0, world.requests, world.idle_timeout_s), Request)


def send_reply(world: TorchrunWorld, reply: Reply) -> None:
    if not safe_wire.encodable(reply):  # say so on rank 0 rather than leave it waiting
        reply = Reply(error=RemoteError.capture(TypeError(
            f"torchrun rank {world.rank}: the reply ({type(reply.value).__name__}) holds a value the control "
            "plane cannot carry (plain values, numpy arrays and hybridflow's own dataclasses only)")))
    _send_object(reply, 0, world.replies, world.timeout_s)


def recv_reply(world: TorchrunWorld, src: int, heartbeats: Heartbeats | None = None) -> Reply:
    return _checked(_recv_object(src, world.replies, world.timeout_s, _watch(heartbeats, src)), Reply)


def _watch(heartbeats: Heartbeats | None, rank: int) -> Callable[[], None] | None:
    return None if heartbeats is None else lambda: heartbeats.check(rank)


# Our own object p2p rather than send_object_list: gloo completes a send only once the peer has posted
# the matching recv, so every op needs its own deadline (a stopped peer would block a send forever).
def _send_object(message: Any, dst: int, group: Any, timeout_s: float,
                 watch: Callable[[], None] | None = None) -> None:
    import torch
    import torch.distributed as dist

    payload = torch.frombuffer(bytearray(safe_wire.dumps(message)), dtype=torch.uint8)
    for tensor in (torch.tensor([payload.numel()], dtype=torch.int64), payload):
        _wait(dist.isend(tensor, dst, group=group), timeout_s, watch)


def _recv_object(src: int, group: Any, timeout_s: float, watch: Callable[[], None] | None = None) -> Any:
    import torch
    import torch.distributed as dist

    size = torch.zeros(1, dtype=torch.int64)
    _wait(dist.irecv(size, src, group=group), timeout_s, watch)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    _wait(dist.irecv(payload, src, group=group), timeout_s, watch)
    return safe_wire.loads(payload.numpy().tobytes())  # rebuilds values, never runs code (safe_wire)


def _wait(work: Any, timeout_s: float, watch: Callable[[], None] | None = None) -> None:
    """Wait for a gloo op; with ``watch`` (rank 0 on a serving rank) check the peer's heartbeat meanwhile.

    gloo's point-to-point works cannot be polled (``is_completed`` stays False until ``wait``) nor safely
    waited on in slices, so a helper thread does the one blocking wait; when the peer's heartbeat stalls
    we raise and leave that thread behind (the world is unusable after a lost rank anyway).
    """
    if work is None:  # torch returns no work for a rank outside the group; the control groups hold every rank
        raise RuntimeError("torchrun control plane: this rank is not in the control group")
    if watch is None:
        work.wait(datetime.timedelta(seconds=timeout_s))
        return
    done, failure = threading.Event(), list[BaseException]()

    def wait() -> None:
        try:
            work.wait(datetime.timedelta(seconds=timeout_s))
        except BaseException as err:  # handed to the caller's thread below
            failure.append(err)
        finally:
            done.set()

    threading.Thread(target=wait, name="hybridflow-control-wait", daemon=True).start()
    while not done.wait(HEARTBEAT_INTERVAL_S / 2):
        watch()
    if failure:
        raise failure[0]


def _checked(message: Any, kind: type[Any]) -> Any:
    if not isinstance(message, kind):
        raise TypeError(f"torchrun control plane: expected a {kind.__name__}, got {type(message).__name__}; "
                        "the ranks run different hybridflow versions or the protocol lost sync")
    return message
