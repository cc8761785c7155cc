"""Reward functions in worker processes, each call under a deadline.

A reward function that hangs (a catastrophic regex, a sympy simplification that never ends, a network
call without a timeout) must fail the step, not the run's liveness. A thread cannot be stopped, and
C code holding the GIL (``re``) would freeze every thread of the driver, so the functions run in a few
processes of their own: a call past its deadline has its process killed (and replaced) and the step
fails with :class:`~hybridflow.runtime.errors.RewardTimeoutError`, naming the function and the sample.

Each process is a fresh interpreter running this module (not ``multiprocessing``'s spawn or forkserver,
which re-run the user's ``__main__``: a script without an ``if __name__ == "__main__":`` guard would start
its training again in every worker). It loads the functions the way the driver did: by their
``data.reward`` spec (``file.py:fn`` is imported by path in the child), else by pickling the function (a
module-level function of an importable module). Samples go a chunk per request and each call's value comes
back on its own, so the deadline is per call. On Linux a worker dies with the driver, SIGKILL included.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from hybridflow.data.reward_functions import RewardFunction, Sample, describe
from hybridflow.data.reward_specs import load_reward_functions
from hybridflow.runtime.errors import RewardFunctionError, RewardTimeoutError

START_TIMEOUT_S = 120.0  # a worker imports torch and the reward code before it answers
_PR_SET_PDEATHSIG = 1


def default_workers() -> int:
    """Processes a pool starts by default: up to 4, at most one per CPU."""
    return max(1, min(4, os.cpu_count() or 1))


class RewardPool:
    """``workers`` processes that score with ``rewards``; :meth:`score` bounds each call by ``timeout_s``.

    Thread-safe: concurrent :meth:`score` calls share the processes. :meth:`close` kills them.
    """

    def __init__(self, rewards: Sequence[RewardFunction], *, timeout_s: float, workers: int | None = None,
                 timeout_name: str = "timeout_s") -> None:
        self.rewards, self.timeout_s, self.timeout_name = tuple(rewards), timeout_s, timeout_name
        self.size = workers or default_workers()
        self._payload = pickle.dumps([_portable(reward) for reward in self.rewards])
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._threads = ThreadPoolExecutor(self.size, thread_name_prefix="reward-pool")
        self._closed = False
        self._started = [_Worker.start(self._payload) for _ in range(self.size)]  # every process, to kill on close
        try:
            for worker in self._started:
                worker.wait_ready(self.rewards)
                self._idle.put(worker)
        except BaseException:
            self.close()
            raise

    def score(self, samples: Sequence[Sample]) -> list[list[float | None]]:
        """Each function's unweighted values of ``samples``, in ``rewards`` order."""
        if self._closed:
            raise RuntimeError("the reward pool is closed")
        tasks: list[tuple[int, list[Sample]]] = []
        for position, reward in enumerate(self.rewards):
            if reward.style == "batched":
                tasks.append((position, list(samples)))
            else:  # per-sample calls: contiguous chunks, one per process
                width = max(1, -(-len(samples) // self.size))
                tasks.extend((position, list(samples[i:i + width])) for i in range(0, len(samples), width))
        if not samples:
            return [[] for _ in self.rewards]
        futures = [self._threads.submit(self._run, position, chunk) for position, chunk in tasks]
        values: list[list[float | None]] = [[] for _ in self.rewards]
        for (position, _), future in zip(tasks, futures, strict=True):
            values[position].extend(future.result())
        return values

    def _run(self, position: int, chunk: list[Sample]) -> list[float | None]:
        worker = self._idle.get()
        try:
            worker.wait_ready(self.rewards)
            values = worker.call(position, chunk, self.rewards[position], self.timeout_s, self.timeout_name)
        except BaseException:
            worker.kill()  # it may still be running the call: its reply must never reach the next request
            if not self._closed:
                replacement = _Worker.start(self._payload)  # ready by the time it is needed, most likely
                self._started.append(replacement)
                self._idle.put(replacement)
            raise
        self._idle.put(worker)
        return values

    def close(self) -> None:
        """Kill the processes; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._threads.shutdown(wait=False, cancel_futures=True)
        for worker in self._started:
            worker.kill()


class _Worker:
    """One process and the parent's end of its pipe."""

    def __init__(self, process: subprocess.Popen[bytes], connection: Connection) -> None:
        self.process, self.connection = process, connection
        self.ready = False

    @classmethod
    def start(cls, payload: bytes) -> _Worker:
        """A new worker process, loading the functions of ``payload`` (:meth:`wait_ready` waits for it)."""
        ours, theirs = socket.socketpair()
        path = [entry or os.getcwd() for entry in sys.path]  # the driver's imports, its '' (cwd) made absolute
        code = (f"import sys; sys.path[:0] = {path!r}; "
                f"from {__name__} import serve_fd; serve_fd({theirs.fileno()})")
        with theirs:
            process = subprocess.Popen([sys.executable, "-c", code], pass_fds=(theirs.fileno(),),
                                       stdin=subprocess.DEVNULL)
        worker = cls(process, Connection(ours.detach()))
        worker.connection.send_bytes(payload)
        return worker

    def wait_ready(self, rewards: Sequence[RewardFunction]) -> None:
        if self.ready:
            return
        names = [reward.name for reward in rewards]
        reply = self._receive(START_TIMEOUT_S, sample=0, late=f"reward worker process did not start within "
                              f"{START_TIMEOUT_S:.0f} s (loading reward functions {names})",
                              running=f"loading reward functions {names}")
        if reply[0] != "ready":
            self.kill()
            raise RuntimeError(f"reward functions {names} cannot be loaded in a worker process: {reply[1]}; a "
                               "function given as an object must be importable by module and name, or name it "
                               "as 'path/to/file.py:function'")
        self.ready = True

    def call(self, position: int, chunk: list[Sample], reward: RewardFunction, timeout_s: float,
             timeout_name: str = "timeout_s") -> list[float | None]:
        """``reward``'s values of ``chunk``; every call (one per sample, or one per batch) within ``timeout_s``
        (``timeout_name`` in the error of a late one)."""
        self.connection.send((position, chunk))
        calls = [chunk[:1]] if reward.style == "batched" else [[sample] for sample in chunk]
        values: list[float | None] = []
        for (sample, *_) in calls:
            what = (f"a batch of {len(chunk)} samples (first: {describe(sample)})" if reward.style == "batched"
                    else describe(sample))
            reply = self._receive(
                timeout_s, sample=sample.index, running=f"reward function {reward.name!r} on {what}",
                late=f"reward function {reward.name!r} did not return within {timeout_name}={timeout_s} s "
                     f"on {what}; its worker process was killed. Make the function faster, or raise "
                     f"{timeout_name}")
            if reply[0] == "error":
                raise RewardFunctionError(reply[1], sample=reply[2])
            values.extend(reply[1])
        return values

    def _receive(self, timeout_s: float, *, sample: int, late: str, running: str) -> tuple[Any, ...]:
        try:
            if self.connection.poll(timeout_s):
                reply: tuple[Any, ...] = self.connection.recv()
                return reply
        except (EOFError, OSError):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(1.0)
            raise RewardFunctionError(f"the worker process running {running} died (exit code "
                                      f"{self.process.returncode}; a negative code is the signal that ended it)",
                                      sample=sample) from None
        raise RewardTimeoutError(late, sample=sample)

    def kill(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.connection.close()
        if self.process.poll() is None:
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5.0)


def _portable(reward: RewardFunction) -> tuple[str | None, RewardFunction | None, str, float]:
    """What a worker rebuilds ``reward`` from: its spec, or (no spec) the function itself, pickled."""
    if reward.source is not None:
        return reward.source, None, reward.name, reward.weight
    return None, reward, reward.name, reward.weight


def in_a_worker(fn: Callable[..., Any]) -> bool:
    """Whether a fresh interpreter can load ``fn`` from its pickle (the reward pool's workers): it pickles, and not
    by reference to the ``__main__`` script (which a worker does not run)."""
    try:
        payload = pickle.dumps(fn)
    except (pickle.PicklingError, TypeError, AttributeError):
        return False
    return b"__main__" not in payload


def reward_timeout(rewards: Sequence[Any], timeout_s: float) -> float | None:
    """``timeout_s`` when every reward can run in the worker pool, else None (in-process, unbounded), warning once
    with the names of those that cannot."""
    local = [getattr(fn, "__name__", repr(fn)) for fn in rewards if callable(fn) and not in_a_worker(fn)]
    if not local:
        return timeout_s
    warnings.warn(f"reward functions {local} cannot be loaded by a worker process (a lambda, a nested function or "
                  "one defined in the __main__ script): every reward function runs in this process, without "
                  "a deadline; define them at module level in an importable module to keep the deadline",
                  stacklevel=3)
    return None


def serve_fd(fd: int) -> None:
    """A worker process, on its end of the socket ``fd``: load the functions, answer requests until it closes."""
    _die_with_parent()
    # Ctrl-C reaches the whole process group, and so does a SIGTERM from torchrun (to each rank's group) or a
    # `kill -- -PGID`: the driver handles both, and a SIGTERM lets the step in flight finish, which needs this
    # process. It still dies with the driver (above) and when the pool closes (SIGKILL).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    connection = Connection(fd)
    try:
        rewards = [_rebuild(item) for item in pickle.loads(connection.recv_bytes())]
    except BaseException as err:  # any load failure is reported to the driver, which names the functions
        connection.send(("failed", f"{type(err).__name__}: {err}"))
        return
    connection.send(("ready",))
    while True:
        try:
            position, chunk = connection.recv()
        except (EOFError, OSError):
            return
        reward = rewards[position]
        for one in [chunk] if reward.style == "batched" else [[sample] for sample in chunk]:
            try:
                connection.send(("ok", reward(one)))
            except RewardFunctionError as err:
                connection.send(("error", str(err), err.sample))
                break
            except Exception as err:  # raised around the function (a missing data column): reported, worker kept
                connection.send(("error", err.args[0] if isinstance(err, KeyError) and err.args else str(err),
                                 one[0].index))
                break


def _rebuild(item: tuple[str | None, RewardFunction | None, str, float]) -> RewardFunction:
    source, reward, name, weight = item
    if reward is not None:
        return reward
    assert source is not None
    return dataclasses.replace(load_reward_functions(source)[0], name=name, weight=weight)


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when the driver dies (SIGKILL included), so none is orphaned."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
