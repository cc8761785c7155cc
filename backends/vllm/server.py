"""The ``server`` rollout: a policy generating through N vLLM OpenAI-server replicas behind a router.

hybridflow starts the replicas itself (``python -m vllm.entrypoints.openai.api_server``, one process group
each, loopback, :class:`~hybridflow.runtime.servers.ServerFleet`) and ``vllm-router`` in front. ``generate``
sends one ``/v1/completions`` request per row, token ids in and token ids with their raw-logit log-probs out
(``--logprobs-mode raw_logprobs``, the trainer's definition), each row seeded ``base + i`` as the in-process
``vllm`` rollout does and keyed by its prompt (``X-Session-ID``: the samples of one prompt share a replica and
its prefix cache; an agent trajectory's turns by the trajectory's key). New weights are written once as a
safetensors snapshot (``/dev/shm`` where it exists) and each replica, paused (``/pause?mode=wait``), reloads it
through the dev-mode ``/collective_rpc`` (``reload_weights(weights_path=...)``), empties its prefix cache and
resumes. Every rank of the role runs a fleet of its own.

A replica that dies mid-step costs retries (the router's and the client's), not the step: before and after each
generate call the fleet restarts dead replicas, reloads the last weights snapshot into each before the router
admits it, and the generate node's metrics count it (``rollout/replica_restarts``, ``rollout/requests_retried``:
totals since this rank's fleet started). Every replica dead: one error naming each and its log. A replica that
fails a weight sync is restarted and synced again (the others keep the new weights); a router that exits is
restarted once (the requests of a generate call or of agent turns it broke are sent again; a weight sync goes to
each replica, not through it), a second exit is one error naming its log.

Every response carries the version of the weights that generated it (``policy_version`` per row of ``generate``,
``TurnResult.version`` per turn): the number of weight syncs this fleet has taken, which every replica the router
reaches holds (:meth:`~hybridflow.runtime.servers.ServerFleet.serving_version`). A row whose prompt plus
``max_new_tokens`` exceeds the servers' ``max_model_len`` is refused before it is sent (vLLM would silently cut
its budget to what fits).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from hybridflow.backends.common.hybrid import HybridEngine
from hybridflow.backends.vllm.engine import VllmBackend, sample_seed
from hybridflow.backends.vllm.rollout import (
    materialize_model,
    pack_responses,
    prompt_token_lists,
    sampling_knobs,
)
from hybridflow.backends.vllm.server_replica import (
    ContextLimit,
    ServerOptions,
    check_vllm_server,
    devices_env,
    gpu_env,
    reload_replica,
    served_model,
    server_command,
    server_env,
)
from hybridflow.backends.vllm.weights import write_adapter, write_snapshot

from hybridflow.agents.protocols import TurnRequest, TurnResult
from hybridflow.graph import RoleKind
from hybridflow.planner import LayoutSupport, RoleLayout
from hybridflow.planner.fleet import check_replicas
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.protocols import (
    Engine,
    GenerateBatch,
    RoleSpec,
    SamplingParams,
    WorkerContext,
)
from hybridflow.runtime.servers import (
    AttachedServer,
    Completion,
    CompletionRequest,
    CompletionsClient,
    ServerFleet,
    ServerProcess,
    ServerRequestError,
)
from hybridflow.runtime.servers.shared import RoleFleet, join_role_fleet
from hybridflow.runtime.weights import WeightSyncStats

logger = logging.getLogger(__name__)

AFFINITY_TOKENS = 32  # the session key hashes this many leading token ids: a trajectory's prompt, usually
ROUTER_MOVE_S = 30.0  # how long a follower's failed requests wait for the leader to publish a restarted router


class ServerTurns:
    """The ``generate_batch`` of a server rollout's turn session: each :class:`TurnRequest` one completions request.

    Its session key (``X-Session-ID``) is the request's own (the agent loop gives every turn of a trajectory its
    trajectory's key), so a trajectory's later turns reach the replica that cached its earlier ones; a request
    without one is keyed by the hash of its first ``AFFINITY_TOKENS`` token ids. ``complete`` sends them (the rollout's
    :meth:`ServerRollout.complete`: turns a lost router broke are sent again once it is back)."""

    accepts_concurrent_calls = True

    def __init__(self, complete: Callable[[Sequence[CompletionRequest]], list[Completion]], sampling: SamplingParams,
                 *, eos_id: int, version: int, limit: ContextLimit) -> None:
        self.complete, self.sampling, self.eos_id, self.version, self.limit = complete, sampling, eos_id, version, limit

    def __call__(self, requests: Sequence[TurnRequest]) -> list[TurnResult]:
        for index, request in enumerate(requests):
            self.limit.check(index, len(request.token_ids), request.max_tokens, what="turn")
        done = self.complete([
            CompletionRequest(prompt=request.token_ids, max_tokens=request.max_tokens, seed=request.seed,
                              sampling=sampling_knobs(self.sampling),
                              session=request.session or session_key(request.token_ids))
            for request in requests])
        return [TurnResult.cut(c.token_ids, c.logprobs, eos=self.eos_id, version=self.version) for c in done]


def session_key(token_ids: Sequence[int]) -> str:
    """The router's session key (``X-Session-ID``) of a prompt or trajectory: a hash of its first token ids."""
    return hashlib.sha1(str(list(token_ids[:AFFINITY_TOKENS])).encode()).hexdigest()[:16]


class ServerRollout:
    """A fleet of vLLM servers as a rollout engine: a :class:`Generator` and :class:`WeightSink` (with
    ``lora_rank``, an :class:`AdapterSink`: the servers start with LoRA enabled and each sync replaces the adapter,
    named ``<role>-lora``, over the base they loaded once)."""

    def __init__(self, spec: RoleSpec, layout: RoleLayout, context: WorkerContext, options: ServerOptions, *,
                 lora_rank: int | None = None, shared: RoleFleet | None = None) -> None:
        """``shared``: this rank's part in its role's one fleet (:mod:`~hybridflow.runtime.servers.shared`); a
        follower starts nothing and sends its rows to the leader's router. None: a fleet of this rank's own."""
        self.spec, self.rank, self.options, self.shared = spec, context.rank, options, shared
        self.weights_version = 0
        self.last_sync: WeightSyncStats | None = None
        self._sync_bytes = 0  # the last snapshot's files, headers included
        self.adapter = f"{spec.name}-lora" if lora_rank is not None else None
        self._recovering = threading.Lock()  # one thread restarts a lost router; the others wait, then resend
        self.fleet: ServerFleet | None = None
        self.model_dir: str | None = None
        self._model_holder: Any = None
        self._snapshot: Path | None = None
        if shared is not None and not shared.leader:
            state = shared.state.wait(lambda state: "url" in state, deadline_s=self._leader_deadline_s,
                                      what="the role's router")
            self.pad_id, self.eos_id = int(state["pad_id"]), int(state["eos_id"])
            self.limit = ContextLimit(spec.name, state["max_model_len"])
            self.client = CompletionsClient(state["url"], state["model"], timeout_s=options.request_timeout_s)
            return
        try:
            self._start(layout, context, options, lora_rank)
        except BaseException as err:
            if shared is not None:
                shared.state.publish(error=f"{type(err).__name__}: {err}")
            self.close()
            raise
        if shared is not None:
            shared.state.publish(url=self.client.base_url, model=self.client.model,
                                 max_model_len=self.limit.max_model_len, pad_id=self.pad_id, eos_id=self.eos_id,
                                 version=0)

    def _start(self, layout: RoleLayout, context: WorkerContext, options: ServerOptions, lora_rank: int | None) -> None:
        """Start the fleet (rank 0 of a shared one: the role's whole fleet, each replica on the GPUs of its ranks)."""
        spec, shared = self.spec, self.shared
        if not options.attach:
            check_vllm_server()
        self.model_dir, self._model_holder = materialize_model(spec.model, seed=spec.seed)
        model_config = json.loads((Path(self.model_dir) / "config.json").read_text())
        self.pad_id = int(model_config.get("pad_token_id") or 0)
        self.eos_id = int(model_config["eos_token_id"])
        shm = Path("/dev/shm")
        self._snapshot = Path(tempfile.mkdtemp(prefix="hybridflow-weights-", dir=shm if shm.is_dir() else None))
        command = server_command(model_dir=self.model_dir, name=spec.name, seed=spec.seed + context.rank,
                                 dtype=options.rollout_dtype or layout.dtype, options=options,
                                 max_num_seqs=layout.rollout_batch_size or None, lora_rank=lora_rank,
                                 tensor_parallel=layout.rollout_tp)
        if shared is not None:  # the role's whole fleet, each replica on the GPUs of its ranks
            config = replace(options, log_dir=shared.log_dir).fleet_config()
            replica_env = None if shared.gpus is None else devices_env(shared.gpus, layout.rollout_tp,
                                                                       whose="the role's")
        else:
            config, replica_env = options.fleet_config(), gpu_env(context.device, layout.rollout_tp)
        self.fleet = ServerFleet(config, command, env=server_env(options), replica_env=replica_env)
        model, max_model_len = served_model(self.fleet.endpoints[0].url)
        self.limit = ContextLimit(spec.name, max_model_len)
        self.client = CompletionsClient(self.fleet.url, model if options.attach else spec.name,
                                        timeout_s=options.request_timeout_s)

    @property
    def _leader_deadline_s(self) -> float:
        """How long a follower waits for rank 0's fleet to come up or take a sync: a replica's start, and a minute."""
        return self.options.start_timeout_s + 60

    @property
    def leads(self) -> bool:
        """Whether this rank runs servers (its own fleet, or its role's as rank 0)."""
        return self.fleet is not None

    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        """``prompts``/``prompt_mask`` -> ``responses``/``response_mask`` (and ``rollout_logprobs``), one request
        per row through the router."""
        prompts = prompt_token_lists(batch)
        for row, prompt in enumerate(prompts):
            self.limit.check(row, len(prompt), sampling.max_new_tokens)
        base = sample_seed(sampling, self.rank)
        requests = [CompletionRequest(prompt=prompt, max_tokens=sampling.max_new_tokens, seed=base + i,
                                      sampling=sampling_knobs(sampling), logprobs=sampling.logprobs,
                                      session=session_key(prompt))
                    for i, prompt in enumerate(prompts)]
        with self._healing():
            version = self.serving_version()
            done = self.complete(requests)
        out = pack_responses([c.token_ids for c in done], [c.logprobs for c in done] if sampling.logprobs else None,
                             pad_id=self.pad_id)
        return out.union(Batch({"policy_version": torch.full((len(done),), version, dtype=torch.long)}))

    @contextlib.contextmanager
    def turn_session(self, sampling: SamplingParams) -> Iterator[GenerateBatch]:
        """Agent turns (:class:`~hybridflow.runtime.protocols.TurnGenerator`) through the router, safe to call from
        many threads at once (each turn is its own HTTP request); results carry the fleet's weights version."""
        with self._healing():
            yield ServerTurns(self.complete, sampling, eos_id=self.eos_id, version=self.serving_version(),
                              limit=self.limit)

    def serving_version(self) -> int:
        """The weights version every replica the router reaches holds. A follower first waits for the leader to
        have synced the fleet as often as this rank was given weights (the ranks are given them at the same step)."""
        if self.fleet is not None:
            return self.fleet.serving_version()
        assert self.shared is not None
        state = self.shared.state.wait(lambda state: int(state["version"]) >= self.weights_version,
                                       deadline_s=self._leader_deadline_s,
                                       what=f"weights version {self.weights_version} on the role's servers")
        self.client.base_url = state["url"]
        return int(state["version"])

    def complete(self, requests: Sequence[CompletionRequest]) -> list[Completion]:
        """Send ``requests`` through the router; those that failed because the router was lost meanwhile are sent
        again (same seeds) once it is back (:meth:`_router_back`), the others' results kept. Safe from many
        threads at once (an agent loop's turns)."""
        router = self.fleet.router if self.fleet is not None else None
        url = self.client.base_url
        done = self.client.complete_each(requests)
        failed = [i for i, result in enumerate(done) if isinstance(result, ServerRequestError)]
        if failed:
            first = done[failed[0]]
            assert isinstance(first, ServerRequestError)
            back = self._router_back(router) if self.fleet is not None else self._router_moved(url)
            if not back:
                raise first
            for i, result in zip(failed, self.client.complete_all([requests[i] for i in failed]), strict=True):
                done[i] = result
        return [result for result in done if isinstance(result, Completion)]

    def _router_back(self, router: ServerProcess | None) -> bool:
        """Whether ``router`` (the one requests were sent through) was lost and a router is up again: started again
        here (once per fleet; a second loss is :class:`~hybridflow.runtime.servers.RouterDownError`) or by another
        thread meanwhile."""
        assert self.fleet is not None
        with self._recovering:
            if router is None or (self.fleet.router is router and router.alive):
                return False  # the router is fine: the failure is the request's own
            self._heal()
            return True

    def _router_moved(self, url: str) -> bool:
        """A follower's requests failed: whether the leader has a router up at another URL than ``url`` by
        :data:`ROUTER_MOVE_S` (it restarts a lost one on its port when it can, and the client's own retries then
        reached it)."""
        assert self.shared is not None
        try:
            state = self.shared.state.wait(lambda state: state["url"] != url, deadline_s=ROUTER_MOVE_S,
                                           what="a restarted router")
        except TimeoutError:
            return False
        self.client.base_url = state["url"]
        return True

    @contextlib.contextmanager
    def _healing(self) -> Iterator[None]:
        """Restart dead replicas before and after the requests; a failed request with every replica dead is one
        error naming their logs (:class:`~hybridflow.runtime.servers.FleetDownError`). A follower heals nothing:
        the leader does, around its own share of the same call."""
        if self.fleet is None:
            yield
            return
        self._heal()
        try:
            yield
        except ServerRequestError:
            self.fleet.check_router()  # a router lost for the second time: one line naming its log
            self.fleet.check_alive()
            raise
        self._heal()

    def _heal(self) -> None:
        assert self.fleet is not None
        self.fleet.heal(self._resync)
        if self.client.base_url != self.fleet.url:  # a restarted router may have had to take another port
            self.client.base_url = self.fleet.url
            if self.shared is not None:
                self.shared.state.publish(url=self.fleet.url)

    def _resync(self, replica: ServerProcess) -> None:
        """A restarted replica loads the last weights sent (it started from the initial ones) before it is routed to."""
        if self.weights_version:
            assert self.fleet is not None and self._snapshot is not None
            reload_replica(replica, self._snapshot, adapter=self.adapter)
            self.fleet.loaded(replica, self.weights_version)

    def rollout_metrics(self) -> dict[str, float]:
        """Replicas and routers restarted and requests sent again since this fleet started, and the last weight
        sync's seconds, snapshot bytes (its files' size, what each replica reads) and replicas (a generate node's
        metrics; the controller logs the planner's estimate of the same sync beside them, ``sync_s_planned``...).
        A follower reports its own retries alone (a role's metrics are the mean over the ranks that report each)."""
        metrics = {"rollout/requests_retried": float(self.client.retried)}
        if self.fleet is None:
            return metrics
        metrics.update({"rollout/replica_restarts": float(self.fleet.restarts),
                        "rollout/router_restarts": float(self.fleet.router_restarts)})
        if self.last_sync is not None:
            metrics.update({"rollout/sync_s": self.last_sync.seconds, "rollout/sync_bytes": float(self._sync_bytes),
                            "rollout/sync_replicas": float(len(self.fleet.endpoints))})
        return metrics

    @property
    def takes_adapters(self) -> bool:
        return self.adapter is not None

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Write the weights once, then have every replica reload them, paused around it (a follower: the leader
        does, from its own copy; this rank's is read through, as a collective gather may need every rank)."""
        if self.adapter is not None:
            raise RuntimeError(f"role {self.spec.name!r}: these servers were started for LoRA adapter syncs "
                               "(load_adapter); whole weights would be overridden by the adapter's base")
        self._sync(lambda snapshot: write_snapshot(named, snapshot), named)

    def load_adapter(self, named: Iterable[tuple[str, torch.Tensor]], config: Mapping[str, Any]) -> None:
        """A new version of the LoRA adapter (peft names and config), written once and loaded by every replica in
        place of the last (``/v1/load_lora_adapter``), paused around it; requests then name the adapter."""
        if self.adapter is None:
            raise RuntimeError(f"role {self.spec.name!r}: these servers were started without LoRA: they take merged "
                               "weights (load_weights), not adapters")
        self._sync(lambda snapshot: write_adapter(named, config, snapshot), named)
        self.client.model = self.adapter

    def _sync(self, write: Callable[[Path], WeightSyncStats], named: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.fleet is None:
            for _ in named:
                pass
            self.weights_version += 1  # generate waits for the leader's sync of it (serving_version)
            return
        start = time.perf_counter()
        try:
            self._heal()  # a replica lost since the last step must not fail the sync
            assert self._snapshot is not None
            self._sync_all(write(self._snapshot), start)
        except BaseException as err:
            if self.shared is not None:
                self.shared.state.publish(error=f"weight sync {self.weights_version + 1}: {type(err).__name__}: {err}")
            raise
        if self.shared is not None:
            self.shared.state.publish(version=self.fleet.serving_version())

    def _sync_all(self, written: WeightSyncStats, start: float) -> None:
        """Every replica loads what was written; one that fails is restarted and synced again, the others keep
        serving the new version."""
        assert self.fleet is not None and self._snapshot is not None
        self._sync_bytes = sum(path.stat().st_size for path in self._snapshot.glob("*.safetensors"))
        endpoints = self.fleet.endpoints
        with ThreadPoolExecutor(max_workers=len(endpoints)) as pool:
            failures = list(pool.map(self._try_reload, endpoints))
        self.weights_version += 1
        for endpoint, failure in zip(endpoints, failures, strict=True):
            if failure is None:
                self.fleet.loaded(endpoint, self.weights_version)
            elif isinstance(endpoint, ServerProcess):  # restarted on the new weights; the others keep serving
                logger.warning("%s; restarting it and loading the weights again", failure)
                self.fleet.replace(endpoint, self._resync)
            else:
                raise failure  # an attached server is its owner's to restart
        self.last_sync = WeightSyncStats(seconds=time.perf_counter() - start, bytes=written.bytes,
                                         tensors=written.tensors, largest_tensor_bytes=written.largest_tensor_bytes)

    def _try_reload(self, endpoint: ServerProcess | AttachedServer) -> RuntimeError | None:
        assert self._snapshot is not None
        try:
            reload_replica(endpoint, self._snapshot, adapter=self.adapter)
        except RuntimeError as failure:
            return failure
        return None

    def close(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
        if self.fleet is not None:
            self.fleet.close()
        if self._snapshot is not None:
            shutil.rmtree(self._snapshot, ignore_errors=True)
        if self._model_holder is not None:
            self._model_holder.cleanup()


class ServerRolloutFactory:
    """``rollout: server``: standalone (a detached rollout is the fleet alone); a trainable policy's trainer is
    wrapped in a :class:`HybridEngine` whose rollout is the fleet: merged whole weights after each update, or a
    LoRA policy's adapter alone (:meth:`ServerOptions.takes_adapter`). The role's ranks share one fleet where they
    share a machine (``fleet``), so a replica of ``rollout_tp`` > 1 may span ranks."""

    standalone = True
    max_rollout_tp = None  # a replica takes the GPUs of rollout_tp ranks (one fleet per role, started by rank 0)
    support = LayoutSupport(backend="vllm-server", max_rollout_tp=None, rollout_batch_size=True, served=True,
                            notes={**VllmBackend.support.notes,
                                   "rollout_tp": "a server replica spans rollout_tp ranks' GPUs on one machine (the "
                                                 "role's one fleet); ranks on several machines run a fleet each, of "
                                                 "replicas within a rank's GPUs"})

    def build(self, spec: RoleSpec, layout: RoleLayout, context: WorkerContext, *,
              trainer: Engine | None) -> Engine:
        options = ServerOptions.parse(spec.rollout_options, spec.name)
        shared = join_role_fleet(context, mode=options.fleet, log_dir=options.log_dir, role=spec.name)
        if not options.attach:  # the plan sizes the fleet; attached servers are the user's own
            logical = context.device.split(":")[0] == "cpu"
            replicas = check_replicas(options.replicas, layout, world_size=context.world_size, logical=logical,
                                      role=spec.name, pooled=shared is not None)
            options = replace(options, replicas=replicas)
        if trainer is None:
            adapter = spec.serves_adapter
            lora_rank = adapter.rank if adapter is not None and options.takes_adapter(spec.name, adapter) else None
            return ServerRollout(spec, layout, context, options, lora_rank=lora_rank, shared=shared)
        if spec.kind is not RoleKind.POLICY:
            raise ValueError(f"role {spec.name!r} is a {spec.kind.value}: rollout: server applies to policies")
        trains_adapters = spec.lora is not None and getattr(trainer, "has_adapters", False)
        adapter_sync = options.takes_adapter(spec.name, spec.lora if trains_adapters else None)
        rollout = ServerRollout(spec, layout, context, options,
                                lora_rank=spec.lora.rank if adapter_sync and spec.lora is not None else None,
                                shared=shared)
        return HybridEngine(trainer, rollout, weight_dtype=options.rollout_dtype or layout.dtype,
                            adapter_sync=adapter_sync)


ROLLOUT = ServerRolloutFactory()
