"""A hung (SIGSTOPped) Ray worker ends the step with WorkerFailedError within the heartbeat bound; the
locally started cluster refuses clients without its token; the stopped worker's process is gone after."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from hybridflow.data import TASKS, PromptLoader, RuleScorer, char_tokenizer, task_examples
from hybridflow.graph import load_graph
from hybridflow.runtime import Controller, OptimSpec, RoleSpec, WorkerFailedError, default_plan
from hybridflow.runtime.liveness import Liveness

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")
pytestmark = [pytest.mark.ray, pytest.mark.slow]

TOKENIZER = char_tokenizer()
FAST = Liveness(heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0)


def _controller(model_dir: Path, liveness: Liveness, backend: str = "torch") -> tuple[Controller, PromptLoader]:
    from hybridflow.runtime.ray_executor import RayExecutor

    graph = load_graph("grpo", n=2, reward_kind="reward_function", max_new_tokens=6)
    specs = {name: RoleSpec(name=name, kind=graph.role(name).kind, model=str(model_dir), backend=backend,
                            optim=OptimSpec(lr=1e-3) if name == "actor" else None) for name in ("actor", "reference")}
    loader = PromptLoader(records=task_examples("reverse", 32), tokenizer=TOKENIZER, batch_size=4)
    controller = Controller(graph, default_plan(graph, num_gpus=1), specs=specs,
                            executor=RayExecutor(liveness=liveness),
                            driver_roles={"reward": RuleScorer(TASKS.get("reverse").reward, TOKENIZER)})
    return controller, loader


def test_a_stopped_worker_fails_the_step_within_the_heartbeat_bound(local_ray: None, random_model_dir: Path) -> None:
    controller, loader = _controller(random_model_dir, FAST)
    with controller:
        controller.step(loader.batch(0), step=0)
        info = controller.groups[0].info()[0]
        pid = info["pid"]
        stopper = threading.Timer(0.2, os.kill, (pid, signal.SIGSTOP))  # mid-step, or before the next call
        stopper.start()
        began = time.monotonic()
        try:
            with pytest.raises(WorkerFailedError) as failed:
                for step in range(1, 50):
                    controller.step(loader.batch(step), step=step)
            detected = time.monotonic() - began
        finally:
            stopper.cancel()
    error = failed.value
    assert detected < FAST.hang_bound_s + 0.5 + 5, f"hung worker seen after {detected:.1f}s"
    assert error.rank == 0 and error.role in ("actor", "reference")
    assert "no heartbeat" in str(error) and f"pid {pid}" in str(error) and info["host"] in str(error)
    deadline = time.monotonic() + 15  # the controller's exit kills the stopped actor
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"stopped worker {pid} still alive 15 s after the failure"
        time.sleep(0.2)
    print(f"hung worker detected after {detected:.1f}s (bound {FAST.hang_bound_s:.1f}s + one step)")


def test_a_call_that_never_returns_fails_at_its_deadline(local_ray: None, random_model_dir: Path,
                                                         tmp_path: Path) -> None:
    """The worker stays alive (its heartbeat answers) but generate never returns: only the deadline ends it."""
    import shutil

    model = Path(shutil.copytree(random_model_dir, tmp_path / "model"))
    live = Liveness(call_timeout_s=3.0, heartbeat_interval_s=0.5, heartbeat_timeout_s=30.0)
    controller, loader = _controller(model, live, backend=f"{Path(__file__).with_name('stuck_backend.py')}:BACKEND")
    with controller:
        controller.step(loader.batch(0), step=0)
        (model / "STUCK").touch()
        began = time.monotonic()
        with pytest.raises(WorkerFailedError, match=r"past the deadline of 3s") as failed:
            controller.step(loader.batch(1), step=1)
        waited = time.monotonic() - began
    assert failed.value.role == "actor" and failed.value.node == "actor_generate"
    assert 3.0 <= waited < 3.0 + 5.0, f"deadline of 3 s took {waited:.1f}s"


def test_a_hung_worker_ends_a_training_run_naming_the_step(local_ray: None, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """`hybridflow train` on Ray: a worker stopped mid-run ends the run (exit 1) with one line naming the step."""
    from hybridflow.cli import main

    token = os.environ["RAY_AUTH_TOKEN"]
    before = set(_group_workers(token))
    metrics = tmp_path / "run" / "metrics.jsonl"
    stopped: list[int] = []

    def stop_after_first_step() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            fresh = [pid for pid in _group_workers(token) if pid not in before]
            if fresh and metrics.is_file() and metrics.read_text().count("\n") >= 1:
                for pid in fresh:
                    os.kill(pid, signal.SIGSTOP)
                stopped.extend(fresh)
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=stop_after_first_step, daemon=True)
    watcher.start()
    code = main(["train", "executor.name=ray", "steps=200", "model.sft_steps=0", "data.batch_size=4",
                 "data.num_examples=16",
                 "algorithm.options.n=2", "algorithm.options.max_new_tokens=4", "logging.progress=false",
                 "logging.plot=false", "logging.trackers=[]", f"output_dir={tmp_path / 'run'}",
                 "executor.liveness.heartbeat_interval_s=0.5",
                 "executor.liveness.heartbeat_timeout_s=3"])
    err = capsys.readouterr().err
    assert stopped, f"the run ended (exit {code}) before a worker could be stopped: {err[-1500:]}"
    assert code == 1 and "Traceback" not in err
    assert re.search(r"worker of role '\w+' rank 0 \(group 0\) on host .* pid \d+\).*during step \d+ "
                     r"\(last completed step: \d+\): no heartbeat", err), err


def _group_workers(token: str) -> list[int]:
    pids = []
    for process in psutil.process_iter(["name"]):
        try:
            if "GroupWorker" in (process.info["name"] or "") and process.environ().get("RAY_AUTH_TOKEN") == token:
                pids.append(process.pid)
        except psutil.Error:
            continue
    return pids


def test_the_local_cluster_refuses_clients_without_its_token(local_ray: None) -> None:
    from hybridflow.runtime.ray_executor import LOCAL_ONLY_ENV

    address = ray.get_runtime_context().gcs_address
    # The loopback switch as our cluster's processes have it: without it a client rewrites 127.0.0.1 to this
    # machine's routable address, where nothing listens. A refused client retries for the GCS wait time
    # (90 s in tests/conftest.py); 5 s is enough to see the refusal.
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")} | \
        {"RAY_AUTH_MODE": "disabled", LOCAL_ONLY_ENV: "0", "RAY_gcs_server_port_wait_time_s": "5"}
    probe = f"import ray; ray.init(address={address!r}); print('JOINED')"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "JOINED" not in done.stdout
    assert "Authentication" in done.stderr or "auth" in done.stderr.lower()


def test_every_socket_the_cluster_listens_on_is_listed_in_security_md(local_ray: None) -> None:
    """Each listening socket of the run's processes matches a row of docs/security.md's table: its process, its
    address (loopback), its port if the row fixes one; a token row refuses a request without the token, a
    ``none`` row serves only a Prometheus page."""
    from hybridflow.agents.openai_endpoint import openai_endpoint
    from hybridflow.runtime.ray_reaper import holds_session

    rows = _documented_sockets()
    endpoint_port = int(openai_endpoint().url.rsplit(":", 1)[1])  # the driver runs an agent rollout's endpoint
    class Probe:  # defined here, so Ray ships it by value (workers cannot import this test module)
        def pid(self) -> int:
            return os.getpid()

    actor = ray.remote(num_cpus=0)(Probe).remote()  # at least one worker of the kind a run starts
    ray.get(actor.pid.remote(), timeout=60)
    session = {ray._private.worker._global_node.get_session_dir_path()}
    ours = {p.pid: p for p in psutil.process_iter() if p.pid == os.getpid() or holds_session(p, session)}
    seen = set()
    for conn in psutil.net_connections(kind="inet"):
        if conn.status != psutil.CONN_LISTEN or conn.pid not in ours:
            continue
        process, ip = _process_key(ours[conn.pid]), conn.laddr.ip.removeprefix("::ffff:")
        if process == "the driver" and conn.laddr.port == endpoint_port:
            process = "the agents' OpenAI endpoint"
        matching = [row for row in rows if row[0] == process and row[2] in ("any", str(conn.laddr.port))]
        assert matching, f"{process} listens on {ip}:{conn.laddr.port}, which docs/security.md does not list"
        row = min(matching, key=lambda r: r[2] == "any")  # a row fixing this port before the process's 'any' row
        assert ip == row[1], f"{process} listens on {ip}:{conn.laddr.port}, docs/security.md says {row[1]}"
        _check_authentication(ip, conn.laddr.port, row)
        seen.add(process)
    ray.kill(actor)
    assert {"gcs_server", "raylet", "the driver", "ray::<worker or actor>", "the agents' OpenAI endpoint"} <= seen, \
        seen


def _documented_sockets() -> list[tuple[str, str, str, str]]:
    """``(process, address, port, authentication)`` per row of docs/security.md's listening-sockets table."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    table = text.split("<!-- listening-sockets:begin")[1].split("<!-- listening-sockets:end -->")[0]
    rows = []
    for line in table.splitlines()[3:]:  # the marker's tail, the header and the rule
        cells = [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        if len(cells) == 5:
            rows.append((cells[0], cells[1], cells[2], cells[4]))
    assert len(rows) >= 5, f"docs/security.md's socket table did not parse: {table!r}"
    return rows


def _process_key(process: psutil.Process) -> str:
    """The name docs/security.md's table gives a process: Ray's binaries and agents by name, Ray's Python
    services by script, every other ``ray::`` process as a worker, this process as the driver."""
    if process.pid == os.getpid():
        return "the driver"
    name = process.name()
    if name in ("gcs_server", "raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent"):
        return name
    if name.startswith("ray::"):
        return "ray::<worker or actor>"
    scripts = [Path(part).name for part in process.cmdline() if part.endswith(".py")]
    return scripts[0] if scripts else name


def _check_authentication(ip: str, port: int, row: tuple[str, str, str, str]) -> None:
    if row[3] == "trajectory id":  # no token: only a live trajectory's random id is routed
        for path in ("/", f"/t/{uuid.uuid4().hex}/v1/models"):
            status, body = _get(ip, port, path)
            assert status == 404, f"{row[0]} on {ip}:{port} answers {status} {body[:80]!r} to GET {path}"
        return
    status, body = _get(ip, port, "/")
    if row[3] == "none":
        assert status == 200 and body.startswith("# HELP"), f"{row[0]} on {port}: {status} {body[:80]!r}"
    else:
        assert status is None or status in (401, 403), \
            f"{row[0]} on {ip}:{port} answers {status} {body[:80]!r} without the token"


def _get(ip: str, port: int, path: str) -> tuple[int | None, str]:
    """``GET path``'s status and body head, or ``(None, "")`` from a server that does not speak HTTP/1."""
    import http.client

    client = http.client.HTTPConnection(ip, port, timeout=5)
    try:
        client.request("GET", path)
        reply = client.getresponse()
        status, body = reply.status, reply.read(200).decode(errors="replace")
    except (http.client.HTTPException, OSError):
        status, body = None, ""  # not HTTP/1: a gRPC server, which refuses calls without the token (test above)
    finally:
        client.close()
    return status, body
