"""The torchrun control plane's codec: every message kind round-trips, and a crafted frame cannot run code."""

from __future__ import annotations

import json
import pickle
import struct

import numpy as np
import pytest
import torch

from hybridflow.data.records import GroundTruth
from hybridflow.graph import load_graph
from hybridflow.runtime import NonFiniteLossError, OptimSpec, RoleSpec, WorkerFailedError, default_plan
from hybridflow.runtime.batch import Batch
from hybridflow.runtime.safe_wire import WireFormatError, dumps, encodable, loads
from hybridflow.runtime.torchrun_protocol import RemoteError, Reply, Request


def test_start_and_run_requests_round_trip() -> None:
    graph = load_graph("grpo", n=2, max_new_tokens=4)
    plan = default_plan(graph, num_gpus=2)
    specs = {"actor": RoleSpec(name="actor", kind=graph.role("actor").kind, model="/m", optim=OptimSpec(lr=1e-3),
                               options={"x": [1, 2]})}
    start = Request(kind="start", args=(plan, specs))
    assert loads(dumps(start)) == start
    truth = GroundTruth("42", data_source="gsm8k", extra_info={"i": 1}, columns={"c": "d"}, prompt="q?")
    batch = Batch({"prompts": torch.arange(6).reshape(2, 3), "logprobs": torch.ones(2, 3, dtype=torch.bfloat16)},
                  non_tensors={"ground_truth": np.array(["a", truth], dtype=object)})
    run = Request(kind="run", group=0, args=(graph.nodes[0], batch.to_wire(), 7, 3, ("prompts",)))
    back = loads(dumps(run))
    assert back.args[0] == graph.nodes[0] and back.args[2:] == (7, 3, ("prompts",))
    rebuilt = Batch.from_wire(back.args[1])
    assert torch.equal(rebuilt["prompts"], batch["prompts"]) and rebuilt["logprobs"].dtype == torch.bfloat16
    got = rebuilt["ground_truth"][1]
    assert isinstance(got, GroundTruth) and got == "42" and got.extra_info == {"i": 1} and got.prompt == "q?"


def test_errors_cross_as_their_own_class() -> None:
    for err in (NonFiniteLossError("role 'actor': non-finite loss", node="actor_update"), KeyError("k"),
                WorkerFailedError(role="actor", rank=1, group=0, cause="gone", where="host h (pid 3)", step=4)):
        reply = loads(dumps(Reply(error=RemoteError.capture(err))))
        assert type(reply.error.exception) is type(err) and str(reply.error.exception) == str(err)
    assert loads(dumps(Reply(value={"metrics": np.float32(1.5), "n": np.int64(3)}))).value["n"] == 3


class _Foreign(Exception):
    pass


def test_a_foreign_exception_travels_as_text() -> None:
    captured = RemoteError.capture(_Foreign("boom"))
    assert captured.exception is None and captured.message == "boom"
    assert loads(dumps(Reply(error=captured))).error.message == "boom"


def _frame(header: object) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text


@pytest.mark.parametrize("header", [
    {"__t": "dc", "cls": "os:system", "v": {}},
    {"__t": "exc", "cls": "builtins:eval", "args": {"__t": "tuple", "v": ["1"]}, "state": {"__t": "dict", "v": []}},
    {"__t": "dc", "cls": "hybridflow.runtime.torchrun_protocol:os.system", "v": {}},
    {"__t": "dc", "cls": "hybridflow.registry:load_object", "v": {"spec": "evil.py:f"}},
    {"__t": "nd", "dtype": "|O", "shape": [1], "n": 8},
    ["untagged"],
])
def test_a_crafted_frame_is_refused(header: object) -> None:
    with pytest.raises(WireFormatError):
        loads(_frame(header))


def test_a_pickle_is_not_unpickled(tmp_path: object) -> None:
    class Exploit:
        def __reduce__(self) -> tuple[object, ...]:
            return (print, ("pickle ran code",))

    with pytest.raises(WireFormatError):
        loads(pickle.dumps(Exploit()))


def test_values_the_codec_cannot_carry_are_named() -> None:
    assert not encodable(lambda: 1) and not encodable(torch.ones(1))
    with pytest.raises(TypeError, match=r"torch:Tensor"):
        dumps({"x": torch.ones(1)})
