"""Shared planner fixtures: the seed scenario (PPO, four Llama-3-8B roles, 1024 x 512 + 512 tokens)."""

from __future__ import annotations

import pytest

from hybridflow.graph import Workload, load_graph
from hybridflow.planner import ModelSpec

SEED_MAPPING = "actor=0-3,critic=0-3,reward=4-5,reference=4-5"


@pytest.fixture(scope="session")
def ppo():
    return load_graph("ppo")


@pytest.fixture(scope="session")
def llama_models():
    spec = ModelSpec.preset("llama3-8b")
    return {role: spec for role in ("actor", "critic", "reward", "reference")}


@pytest.fixture(scope="session")
def seed_workload():
    return Workload(batch_size=1024, prompt_len=512, response_len=512)
