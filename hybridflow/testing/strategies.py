"""Hypothesis strategies for planner inputs: clusters, models, workloads, graphs (needs ``hypothesis``)."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from hybridflow.graph import Graph, Workload, load_graph
from hybridflow.planner.cluster import Cluster
from hybridflow.planner.models import PRESETS, ModelSpec

ALGORITHMS = ("ppo", "grpo", "rloo", "remax", "reinforce_pp", "reinforce_pp_baseline")
SMALL_DEVICES = ("A100-80G", "A100-40G", "H100-80G", "L40S", "T4", "V100-32G", "RTX-4090")


@st.composite
def clusters(draw: st.DrawFn, *, max_gpus: int = 16, max_machines: int = 3,
             devices: Sequence[str] = SMALL_DEVICES, mixed: bool = True) -> Cluster:
    """One to ``max_machines`` machines (one device type each) with at most ``max_gpus`` GPUs in all."""
    count = draw(st.integers(1, max_machines))
    kinds = draw(st.lists(st.sampled_from(list(devices)), min_size=count, max_size=count)) if mixed else \
        [draw(st.sampled_from(list(devices)))] * count
    parts, left = [], max_gpus
    for host, device in enumerate(kinds):
        if left < 1:
            break
        gpus = draw(st.sampled_from([n for n in (1, 2, 4, 8) if n <= left]))
        parts.append((host, device, gpus))
        left -= gpus
    return Cluster.of(parts)


def models(*, max_params: float = 8.5e9) -> st.SearchStrategy[ModelSpec]:
    """Presets up to ``max_params`` weights, or Llama-like shapes from a parameter count."""
    presets = sorted((spec for spec in PRESETS.values() if spec.params <= max_params), key=lambda s: s.name)
    counts = st.floats(min_value=1e8, max_value=max_params).map(lambda n: ModelSpec.from_params(n))
    return st.one_of(st.sampled_from(presets), counts)


def workloads(*, max_batch: int = 512, max_len: int = 1024) -> st.SearchStrategy[Workload]:
    return st.builds(lambda b, p, r: Workload(batch_size=b, prompt_len=p, response_len=r),
                     st.sampled_from([n for n in (8, 32, 64, 128, 256, 512, 1024) if n <= max_batch]),
                     st.sampled_from([n for n in (64, 128, 256, 512, 1024, 2048) if n <= max_len]),
                     st.sampled_from([n for n in (64, 128, 256, 512, 1024, 2048) if n <= max_len]))


@st.composite
def graphs(draw: st.DrawFn, *, algorithms: Sequence[str] = ALGORITHMS) -> Graph:
    """A built-in algorithm with its reward as a model or (sometimes) a rule on the driver."""
    name = draw(st.sampled_from(list(algorithms)))
    kind = draw(st.sampled_from(["reward_model", "reward_model", "reward_function"]))
    return load_graph(name, reward_kind=kind)


@st.composite
def role_models(draw: st.DrawFn, graph: Graph, *, max_params: float = 8.5e9) -> dict[str, ModelSpec]:
    """A model for every GPU role; the reference shares the actor's (as in RLHF), others vary."""
    chosen: dict[str, ModelSpec] = {}
    for role in graph.roles:
        if not role.kind.needs_gpu:
            continue
        if role.name == "reference" and "actor" in chosen:
            chosen[role.name] = chosen["actor"]
        else:
            chosen[role.name] = draw(models(max_params=max_params))
    return chosen
