"""A two-process torchrun world driven by hand (test helper, run by test_torchrun.py, not collected).

Rank 0 runs a GRPO controller on both ranks, then probes the executor: replicas agree after
updates on different shards, a rank's exception comes back naming it, and a hung rank fails the
next call within the timeout. Results go to ``OUT/result.json``. Launched without torchrun (plain
processes with torchrun's environment) so that killing rank 1 does not make a launcher end rank 0.

    python tests/torchrun/probe_world.py OUT    # with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT set
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hybridflow.data import PromptLoader, char_tokenizer, task_examples
from hybridflow.graph import load_graph
from hybridflow.models import build_tiny_causal_lm, save_model_dir
from hybridflow.runtime import Batch, Controller, OptimSpec, RoleSpec, RuntimeStepError, WorkerFailedError
from hybridflow.runtime.liveness import Liveness
from hybridflow.runtime.placement import default_plan
from hybridflow.runtime.torchrun_executor import TorchrunExecutor, TorchrunWorkerGroup, serve, stop_serving
from hybridflow.runtime.torchrun_protocol import init_world

TIMEOUT_S = 8.0  # short, so the hung-rank check is quick; every op here takes well under a second
HEARTBEAT = Liveness(heartbeat_interval_s=0.5, heartbeat_timeout_s=2.0)  # a stopped rank is seen before TIMEOUT_S


def preload() -> None:
    """Import what the first requests would, on both ranks at once and before the short timeout applies
    (lazy imports take seconds on a busy 2-core machine; GroupWorker.info imports ray)."""
    import hybridflow.backends.torch.engine  # noqa: F401
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401

    if importlib.util.find_spec("ray") is not None:
        import ray  # noqa: F401


def alternating_scores(batch: Batch) -> Batch:
    """1 for every other sample: a prompt's two samples always differ, so every shard has a gradient."""
    return Batch({"scores": (torch.arange(len(batch)) % 2).float()})


def logprobs_on_both(group: TorchrunWorkerGroup, batch: Batch, node: Any) -> list[torch.Tensor]:
    """The actor's log-probs of the same rows on each rank (equal iff the replicas are equal)."""
    rows = batch.select([*node.inputs, "prompt_mask"])
    return [r.outputs["old_logprobs"] for r in group.run(node, [rows, rows], seed=0)]


def probe(out: Path, world: Any) -> dict[str, Any]:
    tokenizer = char_tokenizer()
    model_dir = save_model_dir(build_tiny_causal_lm("tiny-qwen2", vocab_size=len(tokenizer), seed=0), tokenizer,
                               out / "model")
    graph = load_graph("grpo", n=2, reward_kind="reward_function", max_new_tokens=4)
    specs = {"actor": RoleSpec(name="actor", kind=graph.role("actor").kind, model=str(model_dir),
                               optim=OptimSpec(lr=1e-2)),
             "reference": RoleSpec(name="reference", kind=graph.role("reference").kind, model=str(model_dir))}
    loader = PromptLoader(records=task_examples("reverse", 64), tokenizer=tokenizer, batch_size=4)
    executor = TorchrunExecutor(world, liveness=HEARTBEAT)
    result: dict[str, Any] = {}
    controller = Controller(graph, default_plan(graph, num_gpus=2), specs=specs, executor=executor,
                            driver_roles={"reward": alternating_scores})
    with controller:
        group = executor.groups[0]
        result["listening"] = _listening()
        result["gloo_interface"] = os.environ.get("GLOO_SOCKET_IFNAME")
        result["pids"] = [info["pid"] for info in executor.worker_info]
        batch = controller.step(loader.batch(0), step=0).batch
        node = graph.node("actor_logprob")
        first = logprobs_on_both(group, batch, node)
        controller.step(loader.batch(1), step=1)
        second = logprobs_on_both(group, batch, node)
        result["replicas_equal"] = bool(torch.equal(first[0], first[1]) and torch.equal(second[0], second[1]))
        result["params_moved"] = not (torch.equal(first[0], second[0]) or torch.equal(first[1], second[1]))
        try:
            group.run(node, [batch.select([*node.inputs, "prompt_mask"]), batch.select(["prompts"])], seed=0)
        except Exception as err:  # the probe records whatever came back
            result["remote_error"] = {"type": type(err).__name__, "notes": getattr(err, "__notes__", [])}
        result["in_sync_after_error"] = group.ping() == [True, True]
        os.kill(result["pids"][1], signal.SIGSTOP)  # rank 1 hangs: alive, but never answers
        start = time.perf_counter()
        try:
            group.ping()
        except WorkerFailedError as err:
            result["hung"] = {"seconds": time.perf_counter() - start, "message": str(err), "rank": err.rank}
        os.kill(result["pids"][1], signal.SIGKILL)
        try:
            group.ping()
        except RuntimeStepError as err:
            result["after_lost"] = str(err)
    start = time.perf_counter()
    stop_serving(world)  # must not hang on the dead rank
    result["stop_serving_seconds"] = time.perf_counter() - start
    return result


def _listening() -> list[list[object]]:
    """``[ip, port]`` this rank's process listens on: gloo's sockets, and the rendezvous store on rank 0."""
    import psutil

    return sorted([conn.laddr.ip, conn.laddr.port] for conn in psutil.Process().net_connections(kind="tcp")
                  if conn.status == psutil.CONN_LISTEN)


def main() -> None:
    out = Path(sys.argv[1])
    preload()
    world = init_world(timeout_s=TIMEOUT_S)
    if world.rank != 0:
        serve(world)
        return
    result = probe(out, world)
    (out / "result.json").write_text(json.dumps(result, indent=2))
    sys.stdout.flush()
    os._exit(0)  # the process group has a dead member: skip its teardown


if __name__ == "__main__":
    main()
