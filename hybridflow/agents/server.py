"""A :class:`~hybridflow.agents.protocols.TurnServer` that batches the turn requests ready at the same time.

Trajectories submit from their own threads; one server thread takes every pending request (at most
``max_batch``) and samples them together with ``generate_batch``, so while some trajectories wait on
their tools the engine keeps decoding the turns of the others. Engines with continuous batching (vLLM)
take the same requests; this server only groups them for engines that sample a fixed batch at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from types import TracebackType

from hybridflow.agents.protocols import TurnRequest, TurnResult

GenerateBatch = Callable[[Sequence[TurnRequest]], list[TurnResult]]


class BatchingTurnServer:
    """Runs ``generate_batch`` on a thread of its own over the requests pending when it is free.

    Use as a context manager: the thread stops, and requests still pending fail, when the block ends.
    A failure of ``generate_batch`` fails the futures of that batch (the trajectories see the error).
    """

    def __init__(self, generate_batch: GenerateBatch, *, max_batch: int = 0) -> None:
        self.generate_batch = generate_batch
        self.max_batch = max_batch  # 0: no bound
        self._pending: list[tuple[TurnRequest, Future[TurnResult]]] = []
        self._ready = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="turn-server", daemon=True)
        self.batches: list[int] = []  # the size of every batch sampled (for metrics and tests)

    def __enter__(self) -> BatchingTurnServer:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()

    def submit(self, request: TurnRequest) -> Future[TurnResult]:
        return self.submit_many([request])[0]

    def submit_many(self, requests: Sequence[TurnRequest]) -> list[Future[TurnResult]]:
        futures: list[Future[TurnResult]] = [Future() for _ in requests]
        with self._ready:
            if self._closed:
                raise RuntimeError("the turn server is closed")
            self._pending.extend(zip(requests, futures, strict=True))
            self._ready.notify()
        return futures

    def close(self) -> None:
        with self._ready:
            self._closed = True
            pending, self._pending = self._pending, []
            self._ready.notify()
        for _, future in pending:
            future.set_exception(RuntimeError("the turn server closed before this turn was sampled"))
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _serve(self) -> None:
        while True:
            with self._ready:
                while not self._pending and not self._closed:
                    self._ready.wait()
                if self._closed:
                    return
                size = self.max_batch or len(self._pending)
                batch, self._pending = self._pending[:size], self._pending[size:]
            self.batches.append(len(batch))
            for future in [future for _, future in batch]:
                future.set_running_or_notify_cancel()
            try:
                results = self.generate_batch([request for request, _ in batch])
                if len(results) != len(batch):
                    raise RuntimeError(f"generate_batch returned {len(results)} results for {len(batch)} requests")
            except BaseException as err:  # every waiting trajectory must see it, or it would wait forever
                for _, future in batch:
                    future.set_exception(err)
                continue
            for (_, future), result in zip(batch, results, strict=True):
                future.set_result(result)


class DirectTurnServer:
    """A :class:`~hybridflow.agents.protocols.TurnServer` for engines that batch continuously themselves (vLLM's
    turn loop: ``accepts_concurrent_calls``): each trajectory's thread calls the engine with its own request, and
    a turn sent while others decode joins them at the engine's next step, instead of waiting for a whole batch."""

    def __init__(self, generate_batch: GenerateBatch) -> None:
        self.generate_batch = generate_batch
        self.batches: list[int] = []

    def __enter__(self) -> DirectTurnServer:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        return None

    def submit(self, request: TurnRequest) -> Future[TurnResult]:
        return self.submit_many([request])[0]

    def submit_many(self, requests: Sequence[TurnRequest]) -> list[Future[TurnResult]]:
        futures: list[Future[TurnResult]] = [Future() for _ in requests]
        self.batches.append(len(requests))
        try:
            results = self.generate_batch(requests)
        except BaseException as err:  # the caller's future carries it, as the batching server's do
            for future in futures:
                future.set_exception(err)
            return futures
        for future, result in zip(futures, results, strict=True):
            future.set_result(result)
        return futures


def turn_server(generate_batch: GenerateBatch, *, max_batch: int = 0) -> BatchingTurnServer | DirectTurnServer:
    """The server for an engine's turns: direct calls where the engine batches continuously, else batching."""
    if getattr(generate_batch, "accepts_concurrent_calls", False):
        return DirectTurnServer(generate_batch)
    return BatchingTurnServer(generate_batch, max_batch=max_batch)
