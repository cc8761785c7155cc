"""The server fleet's lifecycle with fake OpenAI-style replicas behind the real router (vllm-router).

Start, health, session affinity, token ids passed through untouched, a killed replica dropped by the router,
teardown (close, and a driver killed with SIGKILL) leaving nothing listening, and the one-line start errors.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from hybridflow.runtime.servers import (
    CompletionRequest,
    CompletionsClient,
    FleetConfig,
    FleetDownError,
    PortInUseError,
    ServerFleet,
    ServerRequestError,
    ServerStartError,
)
from hybridflow.runtime.servers.guard import ServerGuard
from hybridflow.runtime.servers.process import pick_port, port_is_free, start_server, wait_healthy

FAKE = str(Path(__file__).with_name("fake_openai_server.py"))
needs_router = pytest.mark.skipif(
    __import__("importlib").util.find_spec("vllm_router") is None, reason="needs vllm-router (hybridflow[servers])")


def fake(*flags: str):  # type: ignore[no-untyped-def]
    return lambda index, port: [sys.executable, FAKE, str(port), *flags]


def served_by(client: CompletionsClient, session: str) -> str:
    reply = client._http.post(f"{client.base_url}/v1/completions", json=client.body(
        CompletionRequest(prompt=[3], max_tokens=1, seed=0)), headers={"X-Session-ID": session})
    assert reply.status_code == 200, reply.text
    return str(reply.json()["id"])


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_until(condition, timeout_s: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return bool(condition())


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[ServerFleet]:
    with ServerFleet(FleetConfig(replicas=2, log_dir=str(tmp_path), start_timeout_s=60), fake("--spawn-child")) as f:
        yield f


@needs_router
def test_router_spreads_sessions_keeps_each_on_one_replica_and_passes_tokens_through(fleet: ServerFleet) -> None:
    client = CompletionsClient(fleet.url, "policy")
    try:
        owners = {f"s{i}": served_by(client, f"s{i}") for i in range(16)}
        assert all(served_by(client, session) == owner for session, owner in owners.items())  # affinity
        assert set(owners.values()) == {url.rsplit(":", 1)[1] for url in fleet.replica_urls}  # both replicas used
        results = client.complete_all([CompletionRequest(prompt=[5, 9 + i], max_tokens=3, seed=i, session=f"s{i}")
                                       for i in range(8)])
        assert [r.token_ids for r in results] == [[10 + i, 11 + i, 12 + i] for i in range(8)]
        assert results[0].logprobs == pytest.approx([-0.1, -0.2, -0.3])
        with pytest.raises(ServerRequestError, match="400: prompt must be a non-empty list"):
            client.complete(CompletionRequest(prompt=[], max_tokens=1, seed=0))
    finally:
        client.close()


@needs_router
def test_a_killed_replica_is_dropped_and_close_leaves_nothing_listening(fleet: ServerFleet) -> None:
    ports = [int(url.rsplit(":", 1)[1]) for url in [*fleet.replica_urls, fleet.url]]
    children = [int(line.split()[1]) for replica in fleet.replicas
                for line in replica.log_path.read_text().splitlines() if line.startswith("child ")]
    assert len(children) == 2
    client = CompletionsClient(fleet.url, "policy", timeout_s=10)
    survivor = str(ports[1])
    os.killpg(fleet.replicas[0].process.pid, signal.SIGKILL)
    # At once, before the router's health check: a request whose replica died is sent again and succeeds.
    results = client.complete_all([CompletionRequest(prompt=[5, 9 + i], max_tokens=2, seed=i, session=f"s{i}")
                                   for i in range(16)])
    assert [r.token_ids for r in results] == [[10 + i, 11 + i] for i in range(16)]

    def all_on_survivor() -> bool:
        try:
            return all(served_by(client, f"s{i}") == survivor for i in range(16))
        except AssertionError:
            return False
    try:
        assert wait_until(all_on_survivor, 20), "the router kept sending sessions to the dead replica"
    finally:
        client.close()
    fleet.close()
    assert all(port_is_free("127.0.0.1", port) for port in ports)
    assert all(gone(pid) for pid in children)  # a replica's own children went with its process group


@needs_router
def test_a_driver_killed_with_sigkill_leaves_nothing_listening(tmp_path: Path) -> None:
    driver = textwrap.dedent(f"""
        import json, sys, time
        from hybridflow.runtime.servers import FleetConfig, ServerFleet
        fleet = ServerFleet(FleetConfig(replicas=2, log_dir={str(tmp_path)!r}, start_timeout_s=60),
                            lambda i, port: [sys.executable, {FAKE!r}, str(port), "--spawn-child"])
        print(json.dumps([fleet.url, *fleet.replica_urls]), flush=True)
        time.sleep(600)
    """)
    process = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    urls = json.loads(process.stdout.readline())
    ports = [int(url.rsplit(":", 1)[1]) for url in urls]
    children = [int(line.split()[1]) for log in tmp_path.glob("replica-*.log")
                for line in log.read_text().splitlines() if line.startswith("child ")]
    assert not any(port_is_free("127.0.0.1", port) for port in ports)
    process.kill()
    process.wait()
    assert wait_until(lambda: all(port_is_free("127.0.0.1", p) for p in ports), 5.0), "a server outlived its driver"
    assert wait_until(lambda: all(gone(pid) for pid in children), 1.0)


def test_a_replica_that_never_becomes_healthy_is_one_error_naming_its_log(tmp_path: Path) -> None:
    config = FleetConfig(replicas=1, router=False, log_dir=str(tmp_path), start_timeout_s=1.5)
    with pytest.raises(ServerStartError, match=rf"replica-0 .* not healthy after 2 s.*{tmp_path}/replica-0.log"):
        ServerFleet(config, fake("--unhealthy"))
    port = int((tmp_path / "replica-0.log").read_text().split("listening on ")[1].split()[0])
    assert port_is_free("127.0.0.1", port)  # and it was stopped


def test_each_replica_gets_its_own_environment(tmp_path: Path) -> None:
    """``replica_env``: what a replica adds to the fleet's environment (the server rollout: its GPUs)."""
    config = FleetConfig(replicas=1, router=False, log_dir=str(tmp_path))
    with ServerFleet(config, fake(), env={**os.environ, "SHARED": "1"},
                     replica_env=lambda i: {"CUDA_VISIBLE_DEVICES": f"{2 * i},{2 * i + 1}"}) as fleet:
        environ = Path(f"/proc/{fleet.replicas[0].process.pid}/environ").read_bytes().split(b"\0")
        assert b"CUDA_VISIBLE_DEVICES=0,1" in environ and b"SHARED=1" in environ


def test_taken_ports_are_skipped_or_named(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        with ServerFleet(FleetConfig(router=False, port_base=taken, log_dir=str(tmp_path)), fake()) as fleet:
            assert fleet.url != f"http://127.0.0.1:{taken}"  # the next free port from the base
        # A port taken between the probe and the bind: the server's exit is recognised as such (retried by a fleet).
        guard = ServerGuard()
        server = start_server("replica-9", lambda port: [sys.executable, FAKE, str(port)], host="127.0.0.1",
                              port=taken, log_dir=tmp_path, env=os.environ, guard=guard)
        with pytest.raises(PortInUseError, match=r"replica-9 .*exited with code 1.*Address already in use"):
            wait_healthy([server], deadline_s=30)
        guard.close()


def test_missing_binary_and_router_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ServerStartError, match=r"replica-0: cannot run '/nonexistent/vllm' .*is it installed"):
        ServerFleet(FleetConfig(router=False, log_dir=str(tmp_path)), lambda i, port: ["/nonexistent/vllm"])
    import importlib.metadata

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(ServerStartError, match=r"install the `servers` extra"):
        ServerFleet(FleetConfig(log_dir=str(tmp_path)), fake())
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.1.3")
    with pytest.raises(ServerStartError, match=r"vllm-router 0.1.3 is older than 0.1.17"):
        ServerFleet(FleetConfig(log_dir=str(tmp_path)), fake())
    with pytest.raises(ValueError, match=r"host='0.0.0.0': servers listen on loopback only"):
        FleetConfig(host="0.0.0.0")


def test_a_guard_told_to_stop_ends_its_groups_first() -> None:
    """Ray's reaper SIGTERMs every process of a run, the guard included: it must not leave the servers behind."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    guard = ServerGuard()
    guard.watch(sleeper.pid)
    def catches_sigterm() -> bool:  # the watcher's handler is in place (SigCgt bit 15), so it started reading
        status = Path(f"/proc/{guard._watcher.pid}/status").read_text()
        caught = next(line for line in status.splitlines() if line.startswith("SigCgt:"))
        return bool(int(caught.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    assert wait_until(catches_sigterm, 10.0)
    time.sleep(0.2)  # the line written before the handler was in place is read by now
    guard._watcher.terminate()
    assert wait_until(lambda: sleeper.poll() is not None, 5.0)
    guard._watcher.wait(timeout=5)


@needs_router
def test_attached_servers_get_the_router_and_outlive_the_fleet(tmp_path: Path) -> None:
    """Servers you started yourself: hybridflow routes to them and leaves them running when it closes."""
    ports = [pick_port("127.0.0.1", 0, taken=set()) for _ in range(2)]
    owned = [subprocess.Popen([sys.executable, FAKE, str(port)]) for port in ports]
    try:
        urls = tuple(f"http://127.0.0.1:{port}" for port in ports)
        with ServerFleet(FleetConfig(attach=urls, log_dir=str(tmp_path), start_timeout_s=30), fake()) as fleet:
            assert fleet.replica_urls == list(urls) and fleet.replicas == []  # none started here
            client = CompletionsClient(fleet.url, "policy")
            assert {served_by(client, f"s{i}") for i in range(16)} == {str(port) for port in ports}
            client.close()
        assert all(process.poll() is None for process in owned)  # still running
        with pytest.raises(ServerStartError, match=r"attached-0: the attached server http://127.0.0.1:1 did not"):
            ServerFleet(FleetConfig(attach=("http://127.0.0.1:1",), start_timeout_s=1, log_dir=str(tmp_path)),
                        fake())
    finally:
        for process in owned:
            process.kill()
            process.wait()


def since_start(log: Path) -> list[str]:
    """The lines a replica's log got from its latest start (a restarted replica appends to the same log)."""
    lines = log.read_text().splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("listening on "))
    return lines[start + 1:]


@needs_router
def test_a_replica_lost_mid_burst_costs_retries_and_comes_back_resynced(tmp_path: Path) -> None:
    config = FleetConfig(replicas=2, log_dir=str(tmp_path), start_timeout_s=60)
    fleet = ServerFleet(config, fake("--slow", "--dev-mode"))
    client = CompletionsClient(fleet.url, "policy", timeout_s=10, retry_wait_s=0.2)
    lost = fleet.replicas[0]
    requests = [CompletionRequest(prompt=[5, 9 + i], max_tokens=2, seed=i, session=f"s{i}") for i in range(32)]
    try:
        with ThreadPoolExecutor(1) as driver:
            burst = driver.submit(client.complete_all, requests)
            assert wait_until(lambda: "served" in lost.log_path.read_text(), 10)
            os.killpg(lost.process.pid, signal.SIGKILL)  # with requests in flight on it (each takes 0.5 s)
            assert [r.token_ids for r in burst.result(timeout=60)] == [[10 + i, 11 + i] for i in range(32)]
        assert client.retried >= 1  # its in-flight requests were lost and sent again, to the survivor
        assert fleet.dead() == [lost]

        synced: list[str] = []

        def resync(replica) -> None:  # type: ignore[no-untyped-def]
            with httpx.Client(trust_env=False) as http:  # what the server rollout's reload does, in short
                reply = http.post(replica.url + "/collective_rpc", json={"method": "reload_weights",
                                                                         "kwargs": {"weights_path": "/snap/v3"}})
            assert reply.status_code == 200
            synced.append(replica.url)
        assert fleet.heal(resync) == 1 and fleet.restarts == 1 and fleet.dead() == []
        fresh = fleet.replicas[0]
        assert synced == [fresh.url] and fresh.url != lost.url and fresh.alive
        assert set(fleet.replica_urls) == {fresh.url, fleet.replicas[1].url}
        # The router admits it again: sessions reach it, and only after it loaded the weights.
        def owners() -> set[str]:  # each reply takes 0.5 s: ask for all the sessions at once
            return set(client._pool.map(lambda i: served_by(client, f"s{i}"), range(32)))
        assert wait_until(lambda: str(fresh.port) in owners(), 20)
        lines = since_start(fresh.log_path)
        assert lines[0] == "sync /collective_rpc /snap/v3" and "served" in lines
        assert fleet.heal(resync) == 0  # nothing more to do
    finally:
        client.close()
        fleet.close()


@needs_router
def test_every_replica_dead_is_one_error_naming_each_log(fleet: ServerFleet) -> None:
    for replica in fleet.replicas:
        os.killpg(replica.process.pid, signal.SIGKILL)
    assert wait_until(lambda: not any(r.alive for r in fleet.replicas), 5)
    logs = [str(r.log_path) for r in fleet.replicas]
    with pytest.raises(FleetDownError, match=rf"replica-0 .*{logs[0]}.*replica-1 .*{logs[1]}.*--resume"):
        fleet.heal()
    client = CompletionsClient(fleet.url, "policy", timeout_s=5, retries=2, retry_wait_s=0.1, retry_deadline_s=30)
    try:
        with pytest.raises(ServerRequestError, match=r"after 2 retries"):
            client.complete(CompletionRequest(prompt=[5], max_tokens=1, seed=0))
        assert client.retried == 2
    finally:
        client.close()


@needs_router
def test_two_fleets_on_one_machine_each_get_a_router(tmp_path: Path) -> None:
    """Two ranks' fleets on one machine: each router's metrics exporter takes a port of its own (vllm-router's
    default, 29000 for every router, made the second one exit at start)."""
    config = FleetConfig(replicas=1, start_timeout_s=60)
    with ServerFleet(replace(config, log_dir=str(tmp_path / "a")), fake()) as first, \
            ServerFleet(replace(config, log_dir=str(tmp_path / "b")), fake()) as second:
        assert first.router is not None and second.router is not None
        assert first.router.alive and second.router.alive and first.url != second.url
        lines = [" ".join(fleet.router.process.args) for fleet in (first, second)]  # type: ignore[union-attr]
        ports = {line.split("--prometheus-port ")[1].split()[0] for line in lines}
        assert len(ports) == 2 and all("--prometheus-host 127.0.0.1" in line for line in lines)
