"""A fleet of inference-server replicas behind a router, started and owned by hybridflow on loopback.

:class:`ServerFleet` starts ``replicas`` processes of a server command (vLLM's OpenAI server for the ``server``
rollout; any command that serves ``/health`` in tests), each on its own free port with its own log file and
process group, waits until all are healthy, then starts the router in front of them (``vllm-router``, a Rust
load balancer from PyPI, ``consistent_hash`` policy: requests carrying the same ``X-Session-ID`` header reach
the same replica, so a multi-turn trajectory's turns find their prefix cache). The router health-checks the
replicas every ``health_interval_s`` and stops routing to one that fails. Every process is registered with one
:class:`~hybridflow.runtime.servers.guard.ServerGuard`: a driver that dies, even by SIGKILL, takes the fleet
down within the guard's grace. :meth:`ServerFleet.close` stops the router first, then the replicas.

A replica that dies costs a retry, not the run: the client sends a request whose replica failed again after a
5xx or a lost connection (bounded, see :class:`~hybridflow.runtime.servers.client.CompletionsClient`; the
router's own retries are off, so every retry is the client's and is counted), by then to another replica.
:meth:`ServerFleet.heal` then takes the dead replica out of the router (``POST /remove_worker``), starts it
again on a new port, lets the caller re-sync it (the current weights) and only then adds it to the router
(``POST /add_worker``), so it takes no traffic on old weights. With every replica dead, :class:`FleetDownError`
names each one and its log. A router that exits is started again once, on its port (:meth:`ServerFleet.heal`, or
a router call of :meth:`ServerFleet.replace` that finds it gone), with the replicas it routed to (not one still
being re-synced); a second exit is :class:`RouterDownError`, one line naming its log.

Weights versions: :attr:`ServerFleet.versions` holds the version of the weights each replica last loaded (0: the
ones it started with), set by whoever syncs it (:meth:`ServerFleet.loaded`); :meth:`ServerFleet.serving_version`
is the version every routed replica holds, the one each response is tagged with, and refuses replicas that
disagree rather than tag a response with a version that may not have generated it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import httpx

from hybridflow.runtime.servers.guard import ServerGuard
from hybridflow.runtime.servers.process import (
    AttachedServer,
    PortInUseError,
    ServerProcess,
    ServerStartError,
    pick_port,
    port_is_free,
    start_server,
    wait_attached,
    wait_healthy,
)

logger = logging.getLogger(__name__)

ROUTER_PACKAGE, ROUTER_MIN_VERSION = "vllm-router", (0, 1, 17)
ROUTER_POLICIES = ("consistent_hash", "round_robin", "power_of_two", "random", "cache_aware")
PORT_TRIES = 3
ROUTER_EXIT_WAIT_S = 2.0
ReplicaCommand = Callable[[int, int], Sequence[str]]
"""``(replica index, port) -> argv`` of one replica."""


@dataclass(frozen=True, kw_only=True)
class FleetConfig:
    """How many replicas, where they listen and log, and how long they may take to start.

    ``attach``: URLs of servers already running (started by you, on this machine for weight syncs): hybridflow
    starts no replica, puts the router in front of them, and never stops them. ``port_base`` 0 lets the OS pick
    free ports; otherwise replica ports are the first free ones from it (the router's after them). ``router``: put
    the router in front (default); without it the fleet has one replica and its URL is the replica's. ``log_dir``
    None: a new directory under the system's temporary one (kept after :meth:`ServerFleet.close`, so a failure's
    log can still be read)."""

    replicas: int = 1
    host: str = "127.0.0.1"
    port_base: int = 0
    start_timeout_s: float = 600.0
    router: bool = True
    router_policy: str = "consistent_hash"
    health_interval_s: int = 1
    log_dir: str | None = None
    attach: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "attach", tuple(url.rstrip("/") for url in self.attach))
        if self.attach and self.replicas not in (1, len(self.attach)):
            raise ValueError(f"replicas={self.replicas} and attach={list(self.attach)} disagree: attached servers are "
                             "the replicas (hybridflow starts none); leave replicas unset")
        if self.attach and not self.router and len(self.attach) > 1:
            raise ValueError(f"attach={list(self.attach)} needs the router (router=True) to spread requests")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"replicas={self.replicas!r} must be an integer >= 1")
        if not self.router and self.replicas > 1:
            raise ValueError(f"replicas={self.replicas} needs the router (router=True) to spread requests over them")
        if self.router_policy not in ROUTER_POLICIES:
            raise ValueError(f"router_policy={self.router_policy!r} must be one of {list(ROUTER_POLICIES)}")
        if not 0 <= self.port_base < 65536:
            raise ValueError(f"port_base={self.port_base} must be 0 (any free port) or a port number")
        if self.start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s={self.start_timeout_s} must be > 0")
        if self.host not in ("127.0.0.1", "localhost"):
            raise ValueError(f"host={self.host!r}: servers listen on loopback only (127.0.0.1); they serve "
                             "unauthenticated control endpoints (weight reload)")


def check_router_installed() -> None:
    """Raise one line when ``vllm-router`` is missing or older than the oldest version tested."""
    try:
        version = importlib.metadata.version(ROUTER_PACKAGE)
    except importlib.metadata.PackageNotFoundError as err:
        raise ServerStartError("the server router needs vllm-router: install the `servers` extra "
                               "(`pip install hybridflow[servers]`, i.e. vllm-router>=0.1.17)") from err
    if _release(version) < ROUTER_MIN_VERSION:
        raise ServerStartError(f"vllm-router {version} is older than 0.1.17, the oldest tested here: "
                               "`pip install -U 'vllm-router>=0.1.17'`")
    if importlib.util.find_spec("vllm_router") is None:
        raise ServerStartError("vllm-router is installed but its module `vllm_router` does not import here; "
                               "reinstall it (`pip install --force-reinstall vllm-router`)")


def _release(version: str) -> tuple[int, ...]:
    """The leading numeric release of a version string ("0.32.0+cpu" -> (0, 32, 0))."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def router_command(*, host: str, port: int, workers: Sequence[str], policy: str,
                   health_interval_s: int, metrics_port: int) -> list[str]:
    """``vllm-router``'s command line, run by this interpreter (its console script may not be on PATH). Its
    Prometheus exporter gets a port of its own (the default, 29000 for every router, makes a second router on the
    machine, e.g. another rank's, exit at start)."""
    return [sys.executable, "-m", "vllm_router.launch_router", "--host", host, "--port", str(port),
            "--prometheus-host", host, "--prometheus-port", str(metrics_port),
            "--worker-urls", *workers, "--policy", policy,
            "--health-check-interval-secs", str(health_interval_s), "--health-failure-threshold", "1",
            "--disable-retries", "--log-level", "warning"]  # the client retries, and counts it


class FleetDownError(RuntimeError):
    """Every replica of a fleet has exited: nothing is left to retry on."""


class RouterDownError(FleetDownError):
    """The router exited again after it was restarted once."""


Resync = Callable[[ServerProcess], None]


class ServerFleet:
    """``config.replicas`` processes of ``command`` behind a router; :attr:`url` is where requests go."""

    def __init__(self, config: FleetConfig, command: ReplicaCommand, *, env: Mapping[str, str] | None = None,
                 replica_env: Callable[[int], Mapping[str, str]] | None = None, health_path: str = "/health") -> None:
        """``env``: every server's environment; ``replica_env``: what replica ``i``'s adds to it (its GPUs)."""
        if config.router:
            check_router_installed()
        self.config, self.command, self.health_path = config, command, health_path
        self.env = dict(os.environ if env is None else env)
        self.replica_env = replica_env
        self.log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="hybridflow-servers-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.replicas: list[ServerProcess] = []
        self.attached = [AttachedServer(name=f"attached-{i}", url=url) for i, url in enumerate(config.attach)]
        self.router: ServerProcess | None = None
        self._ports: set[int] = set()
        self._commands: dict[str, Callable[[int], Sequence[str]]] = {}
        self._envs: dict[str, Mapping[str, str]] = {}  # a replica's own environment, where it has one
        self._guard = ServerGuard()
        self.restarts = 0  # replicas started again after they died (:meth:`heal`) or failed a sync (:meth:`replace`)
        self.router_restarts = 0
        self.versions: dict[str, int] = {}  # replica name -> version of the weights it last loaded
        self._unrouted: set[str] = set()  # replicas out of the router while :meth:`replace` restarts them
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        """The router's URL (the only replica's without a router)."""
        return self.router.url if self.router is not None else self.endpoints[0].url

    @property
    def endpoints(self) -> list[ServerProcess | AttachedServer]:
        """Every replica requests may reach: those started here, or the attached ones."""
        return [*self.replicas, *self.attached]

    @property
    def replica_urls(self) -> list[str]:
        return [replica.url for replica in self.endpoints]

    def _routed_urls(self) -> list[str]:
        """The replicas a (re)started router routes to: all but those :meth:`replace` has not admitted yet."""
        return [endpoint.url for endpoint in self.endpoints if endpoint.name not in self._unrouted]

    def _start(self) -> None:
        if self.attached:
            wait_attached(self.attached, deadline_s=self.config.start_timeout_s)
        for index in range(0 if self.attached else self.config.replicas):
            self._commands[f"replica-{index}"] = functools.partial(self.command, index)
            if self.replica_env is not None:
                self._envs[f"replica-{index}"] = {**self.env, **self.replica_env(index)}
            self.replicas.append(self._launch(f"replica-{index}"))
        if self.replicas:
            self._await(self.replicas)
        self.versions = {endpoint.name: 0 for endpoint in self.endpoints}
        if self.config.router:
            self._commands["router"] = self._router_command(self.replica_urls)
            self.router = self._launch("router")
            self._await([self.router])
        logger.info("server fleet up: %d replica(s) %s behind %s; logs in %s", len(self.replicas),
                    self.replica_urls, self.url, self.log_dir)

    def _router_command(self, workers: Sequence[str]) -> Callable[[int], Sequence[str]]:
        def command(port: int) -> Sequence[str]:
            metrics_port = pick_port(self.config.host, 0, taken=self._ports | {port})
            self._ports.add(metrics_port)
            return router_command(host=self.config.host, port=port, workers=list(workers),
                                  policy=self.config.router_policy, health_interval_s=self.config.health_interval_s,
                                  metrics_port=metrics_port)
        return command

    def _launch(self, name: str, *, port: int | None = None) -> ServerProcess:
        """Start server ``name`` on ``port`` (default: a new free one)."""
        if port is None:
            port = pick_port(self.config.host, self.config.port_base and self.config.port_base + len(self._ports),
                             taken=self._ports)
        self._ports.add(port)
        return start_server(name, self._commands[name], host=self.config.host, port=port, log_dir=self.log_dir,
                            env=self._envs.get(name, self.env), guard=self._guard)

    def _await(self, servers: list[ServerProcess]) -> None:
        """Wait for ``servers``; one whose port was taken meanwhile restarts on another port (``PORT_TRIES``)."""
        health = "/health" if servers[0] is self.router else self.health_path
        for attempt in range(PORT_TRIES):
            try:
                wait_healthy(servers, deadline_s=self.config.start_timeout_s, health_path=health)
                return
            except PortInUseError:
                if attempt == PORT_TRIES - 1:
                    raise
                for i, server in enumerate(servers):
                    if not server.alive:
                        logger.warning("%s: port %d was taken; starting it on another", server.name, server.port)
                        server.stop()
                        servers[i] = self._launch(server.name)
                        if server is self.router:
                            self.router = servers[i]

    def dead(self) -> list[ServerProcess]:
        """The replicas started here whose process has exited."""
        return [replica for replica in self.replicas if not replica.alive]

    def check_alive(self) -> None:
        """Raise :class:`FleetDownError` when every replica started here has exited, naming each and its log."""
        if self.replicas and not any(replica.alive for replica in self.replicas):
            raise FleetDownError("every rollout server replica has exited: " + "; ".join(
                f"{r.name} ({r.url}, exit code {r.process.returncode}) log {r.log_path} ends: {r.log_tail()}"
                for r in self.replicas) + " (the step failed; `hybridflow train --resume` continues from the last "
                "checkpoint)")

    def heal(self, resync: Resync | None = None) -> int:
        """Start the router again if it exited (once: :meth:`check_router`), then every dead replica (a new port),
        ``resync`` it (e.g. load the current weights) and add it to the router; returns how many replicas were
        restarted. All of them dead: :class:`FleetDownError`."""
        self.check_router()
        dead = self.dead()
        if not dead:
            return 0
        self.check_alive()
        for old in dead:
            logger.warning("%s (%s) exited with code %s; restarting it (its log: %s)", old.name, old.url,
                           old.process.returncode, old.log_path)
            self.replace(old, resync)
        return len(dead)

    def replace(self, old: ServerProcess, resync: Resync | None = None) -> ServerProcess:
        """Take replica ``old`` out of the router, stop it, start it again on a new port, ``resync`` it and only then
        add it to the router (a replica that died, or one that failed a weight sync); returns the new one."""
        self._unrouted.add(old.name)
        self._router_call("remove_worker", old.url)
        old.stop()
        index, started = self.replicas.index(old), [self._launch(old.name)]
        self.replicas[index] = started[0]  # close() stops it even if it never becomes healthy
        self.versions[old.name] = 0  # it starts from the weights on disk
        try:
            self._await(started)  # may start it again on another port
        finally:
            self.replicas[index] = started[0]
        fresh = started[0]
        if resync is not None:
            resync(fresh)
        self._router_call("add_worker", fresh.url)
        self._unrouted.discard(old.name)
        self.restarts += 1
        return fresh

    def check_router(self) -> None:
        """A router that exited is started again, on its port, with the current replicas, once per fleet; a second
        exit is :class:`RouterDownError` naming its log (the step fails; ``--resume`` continues the run)."""
        router = self.router
        if router is None or router.alive:
            return
        what = f"the router ({router.url}) exited with code {router.process.returncode}"
        if self.router_restarts >= 1:
            raise RouterDownError(f"{what} again after one restart; its log {router.log_path} ends: "
                                  f"{router.log_tail()} (the step failed; `hybridflow train --resume` continues from "
                                  "the last checkpoint)")
        logger.warning("%s; restarting it once (its log: %s)", what, router.log_path)
        router.stop()
        self._commands["router"] = self._router_command(self._routed_urls())
        # Its port, so clients holding its URL reach it again (another port if something took it meanwhile).
        port = router.port if port_is_free(self.config.host, router.port) else None
        self.router = self._launch("router", port=port)
        self.router_restarts += 1
        self._await([self.router])

    def loaded(self, endpoint: ServerProcess | AttachedServer, version: int) -> None:
        """Record that ``endpoint`` now holds the weights of ``version``."""
        self.versions[endpoint.name] = version

    def serving_version(self) -> int:
        """The weights version every replica requests may reach holds; replicas that disagree are one error naming
        each one's version (a response could not be tagged with the version that generated it)."""
        held = {endpoint.name: self.versions.get(endpoint.name, 0) for endpoint in self.endpoints}
        if len(set(held.values())) > 1:
            raise RuntimeError("rollout server replicas hold different weights versions " + ", ".join(
                f"{name}: v{version}" for name, version in held.items()) + "; a response's version would be unknown "
                "(a weight sync failed part-way: see the replicas' logs in " + str(self.log_dir) + ")")
        return next(iter(held.values()), 0)

    def _router_call(self, action: str, worker: str) -> None:
        """``POST /<action>?url=<worker>`` on the router (``add_worker``/``remove_worker``); a refusal is an error. A
        router found gone is started again (once, :meth:`check_router`) and asked again."""
        if self.router is None:
            return
        for attempt in range(2):
            router = self.router
            try:
                with httpx.Client(timeout=30.0, trust_env=False) as http:
                    reply = http.post(f"{router.url}/{action}", params={"url": worker})
                break
            except httpx.TransportError as err:
                with contextlib.suppress(subprocess.TimeoutExpired):  # a killed router's exit is seen a moment late
                    router.process.wait(timeout=ROUTER_EXIT_WAIT_S)
                if router.alive or attempt:
                    raise ServerStartError(f"router {action} {worker} failed: {type(err).__name__}: {err}; see its "
                                           f"log {router.log_path}") from err
                self.check_router()  # started again once, or RouterDownError naming its log
        if reply.status_code != 200 and not (action == "remove_worker" and reply.status_code == 404):
            raise ServerStartError(f"router {action} {worker} -> {reply.status_code}: {reply.text[:300]}; see its "
                                   f"log {router.log_path}")

    def close(self) -> None:
        """Stop the router, then the replicas started here (each its whole process group; attached ones run on);
        idempotent."""
        for server in ([self.router] if self.router is not None else []) + self.replicas:
            server.stop()
        self.router, self.replicas = None, []
        self._guard.close()

    def __enter__(self) -> ServerFleet:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()
