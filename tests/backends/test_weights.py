"""Weight shipping between groups: state dicts through numpy (the Ray object store's cheap format)."""

from __future__ import annotations

import numpy as np
import torch

from hybridflow.runtime.weights import state_from_wire, state_to_wire


def test_a_state_dict_survives_the_numpy_wire_in_every_dtype() -> None:
    state = {"a": torch.randn(3, 4), "b": torch.randn(5).to(torch.bfloat16), "c": torch.randn(2, 2).half()}
    wire = state_to_wire(state.items())
    assert all(isinstance(array, np.ndarray) for _, array in wire.values())
    for array in (array for _, array in wire.values()):
        array.flags.writeable = False  # as Ray's object store hands them out
    back = state_from_wire(wire)
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype
        assert torch.equal(back[name], tensor)
