"""One HTTP server process that hybridflow starts and owns: its port, log file, process group and health.

A server starts in a session of its own (so it leads its own process group: stopping it stops every process
it spawned, e.g. vLLM's engine core) with stdout and stderr in its log file, and is registered with a
:class:`~hybridflow.runtime.servers.guard.ServerGuard` before anything else happens, so a driver that dies
takes it down. :func:`wait_healthy` polls ``GET <url>/health`` until it answers 200, the process exits, or the
start deadline passes; the last two raise :class:`ServerStartError` naming the log file.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from hybridflow.runtime.servers.guard import ServerGuard

PORT_IN_USE = ("Address already in use", "address already in use", "Errno 98")
STOP_GRACE_S = 5.0


class ServerStartError(RuntimeError):
    """A server did not start: its binary is missing or too old, its port was taken, or it never became healthy."""


class PortInUseError(ServerStartError):
    """The port a server was given was taken before it could bind it."""


def port_is_free(host: str, port: int) -> bool:
    """Whether nothing listens on ``host:port`` (a server could bind it now, as servers do, with SO_REUSEADDR:
    connections of an earlier server still in TIME_WAIT do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def pick_port(host: str, start: int, *, taken: set[int]) -> int:
    """A free port on ``host``: the first of ``start``, ``start + 1``... not in ``taken`` (0: one the OS picks).

    Another process may still bind it before the server does; :func:`start_server` retries on that."""
    if start == 0:
        for _ in range(100):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.bind((host, 0))
                port = int(probe.getsockname()[1])
            if port not in taken:
                return port
    else:
        for port in range(start, min(start + 1000, 65536)):
            if port not in taken and port_is_free(host, port):
                return port
    raise ServerStartError(f"no free port on {host} from {start or 'the OS'}: set another port base")


@dataclass
class ServerProcess:
    """A started server: ``name`` (e.g. ``replica-0``), where it listens and logs, and its process."""

    name: str
    host: str
    port: int
    log_path: Path
    process: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 3) -> str:
        """The last ``lines`` non-empty lines of the log, joined with ' | ' (for one-line errors)."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return " | ".join(line.strip() for line in [t for t in text if t.strip()][-lines:])

    def stop(self, *, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the server's process group, SIGKILL it after ``grace_s``; reaps the leader."""
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break  # the whole group is gone
            try:
                self.process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
            if sig == signal.SIGTERM:
                with contextlib.suppress(ProcessLookupError):  # the leader exited: end children left in its group
                    os.killpg(self.process.pid, signal.SIGKILL)
            break
        if self.process.poll() is None:
            self.process.wait()


@dataclass(frozen=True)
class AttachedServer:
    """A server someone else started and owns (``attach``): hybridflow routes to it and syncs it, never stops it."""

    name: str
    url: str
    log_path: Path | None = None  # its log is its owner's


def wait_attached(servers: Sequence[AttachedServer], *, deadline_s: float, poll_s: float = 0.5) -> None:
    """Block until every attached server answers ``/health`` with 200; one that does not by ``deadline_s`` is one
    error naming its URL."""
    started = time.monotonic()
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        for server in servers:
            while True:
                try:
                    if client.get(server.url + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() - started > deadline_s:
                    raise ServerStartError(f"{server.name}: the attached server {server.url} did not answer /health "
                                           f"with 200 within {deadline_s:.0f} s; is it running?")
                time.sleep(poll_s)


def start_server(name: str, command: Callable[[int], Sequence[str]], *, host: str, port: int, log_dir: Path,
                 env: Mapping[str, str], guard: ServerGuard) -> ServerProcess:
    """Start ``command(port)`` as server ``name`` in its own process group, logging to ``log_dir/<name>.log``."""
    log_path = log_dir / f"{name}.log"
    argv = list(command(port))
    try:
        with open(log_path, "ab") as log:
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                       env=dict(env), start_new_session=True)
    except FileNotFoundError as err:
        raise ServerStartError(f"{name}: cannot run {argv[0]!r} ({err.strerror}); is it installed?") from err
    guard.watch(process.pid)
    return ServerProcess(name=name, host=host, port=port, log_path=log_path, process=process)


def wait_healthy(servers: Sequence[ServerProcess], *, deadline_s: float, health_path: str = "/health",
                 poll_s: float = 0.25) -> None:
    """Block until every server answers ``health_path`` with 200; raise :class:`ServerStartError` (or
    :class:`PortInUseError`) for the first that exits or is still unhealthy when ``deadline_s`` has passed."""
    started = time.monotonic()
    pending = list(servers)
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while pending:
            for server in list(pending):
                if not server.alive:
                    tail = server.log_tail()
                    kind = PortInUseError if any(mark in tail for mark in PORT_IN_USE) else ServerStartError
                    raise kind(f"{server.name} ({server.url}) exited with code {server.process.returncode} before "
                               f"it became healthy; its log {server.log_path} ends: {tail}")
                try:
                    healthy = client.get(server.url + health_path).status_code == 200
                except httpx.HTTPError:
                    healthy = False
                if healthy:
                    pending.remove(server)
            if pending and time.monotonic() - started > deadline_s:
                late = pending[0]
                raise ServerStartError(f"{late.name} ({late.url}) was not healthy after {deadline_s:.0f} s (raise the "
                                       f"start timeout if it is only slow); see its log {late.log_path}, which ends: "
                                       f"{late.log_tail()}")
            if pending:
                time.sleep(poll_s)
