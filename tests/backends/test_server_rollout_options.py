"""The ``server`` rollout's options, replica command and weight-reload errors, without starting vLLM."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hybridflow.backends.vllm.server import ServerOptions, reload_replica, server_command, server_env

from hybridflow.runtime.servers import FleetConfig, ServerFleet

FAKE = str(Path(__file__).parents[1] / "runtime" / "fake_openai_server.py")


def test_options_are_checked_by_name() -> None:
    with pytest.raises(ValueError, match=r"replicas"):
        ServerOptions.parse({"replica": 2}, "actor")  # a misspelt key
    with pytest.raises(ValueError, match=r"role 'actor': server option replicas=0 must be an integer >= 1"):
        ServerOptions.parse({"replicas": 0}, "actor")
    with pytest.raises(ValueError, match=r"server option rollout_dtype='fp8'"):
        ServerOptions.parse({"rollout_dtype": "fp8"}, "actor")
    assert ServerOptions.parse({"replicas": 2, "port_base": 18000}, "actor").fleet().replicas == 2


def test_the_replica_command_states_what_token_exactness_needs() -> None:
    options = ServerOptions(server_args={"max_num_batched_tokens": 512, "enable_prefix_caching": True})
    command = server_command(model_dir="/m", name="actor", dtype="fp32", seed=3, options=options, max_num_seqs=16)
    argv = command(1, 18001)
    line = " ".join(argv)
    assert "--host 127.0.0.1 --port 18001" in line and "--served-model-name actor" in line
    assert "--logprobs-mode raw_logprobs" in line and "--dtype float32" in line and "--seed 3" in line
    assert "--max-num-seqs 16" in line and "--max-num-batched-tokens 512" in line
    assert argv[-1] == "--enable-prefix-caching"  # a True value is a bare flag
    env = server_env(ServerOptions(threads=2))
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["OMP_NUM_THREADS"] == "2"


def test_a_replica_that_refuses_a_weight_reload_is_named_with_its_log(tmp_path: Path) -> None:
    config = FleetConfig(router=False, log_dir=str(tmp_path))
    refusal = rf"weight sync: replica-0 .*/pause\) -> 404.*{tmp_path}/replica-0.log"
    with ServerFleet(config, lambda i, port: [sys.executable, FAKE, str(port)]) as fleet, \
            pytest.raises(RuntimeError, match=refusal):
        reload_replica(fleet.replicas[0], tmp_path)
