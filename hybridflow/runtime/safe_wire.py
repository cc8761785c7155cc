"""A message codec that cannot run code on the receiver: tagged JSON plus raw numpy buffers.

The torchrun control plane used to pickle its messages, so anyone able to reach a rank's gloo port
could make it run arbitrary code. This codec only rebuilds plain values (None, bools, numbers,
strings, lists, tuples, dicts, sets, bytes), numpy arrays (numeric ones as raw bytes; object arrays
element by element), and instances of *hybridflow's own* dataclasses, enums, exceptions and str
subclasses, by field, without calling anything but ``__new__`` (exceptions, str subclasses) or the
dataclass constructor (which validates). A class outside ``hybridflow`` (and the builtin exceptions)
is refused when decoding; encoding anything else raises ``TypeError`` naming the type.

Frame: 8-byte little-endian header length, the header (UTF-8 JSON), then the buffers back to back.
"""

from __future__ import annotations

import builtins
import dataclasses
import enum
import importlib
import json
import struct
from typing import Any

import numpy as np

TAG = "__t"
_TRUSTED_PREFIX = "hybridflow."
_HEADER = struct.Struct("<Q")


class WireFormatError(ValueError):
    """A message that is not a well-formed frame, or names a class this codec will not rebuild."""


def dumps(value: Any) -> bytes:
    """``value`` as one frame (see the module docstring)."""
    buffers: list[bytes] = []
    header = json.dumps(_encode(value, buffers), separators=(",", ":")).encode()
    return b"".join([_HEADER.pack(len(header)), header, *buffers])


def loads(frame: bytes | bytearray | memoryview) -> Any:
    """The value :func:`dumps` framed; raises :class:`WireFormatError` on anything else."""
    data = memoryview(frame)
    if len(data) < _HEADER.size:
        raise WireFormatError("control message shorter than its header")
    (size,) = _HEADER.unpack(data[:_HEADER.size])
    if _HEADER.size + size > len(data):
        raise WireFormatError("control message header runs past the frame")
    try:
        tree = json.loads(bytes(data[_HEADER.size:_HEADER.size + size]))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WireFormatError(f"control message header is not JSON: {err}") from err
    return _Decoder(data[_HEADER.size + size:]).decode(tree)


def encodable(value: Any) -> bool:
    """True when :func:`dumps` can carry ``value`` (so a receiver can rebuild it)."""
    try:
        _encode(value, [])
    except (TypeError, ValueError):
        return False
    return True


def _name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _trusted(cls: type) -> bool:
    return cls.__module__.startswith(_TRUSTED_PREFIX) or (
        cls.__module__ == "builtins" and issubclass(cls, BaseException))


def _encode(value: Any, buffers: list[bytes]) -> Any:
    if value is None or type(value) in (bool, int, float, str):
        return value
    if isinstance(value, np.ndarray):
        return _encode_array(value, buffers)
    if isinstance(value, np.generic):
        return {TAG: "np", "dtype": value.dtype.str, "v": value.item()}
    if type(value) in (list, tuple, set, frozenset):
        return {TAG: type(value).__name__, "v": [_encode(item, buffers) for item in value]}
    if type(value) is dict:
        return {TAG: "dict", "v": [[_encode(k, buffers), _encode(v, buffers)] for k, v in value.items()]}
    if type(value) in (bytes, bytearray):
        buffers.append(bytes(value))
        return {TAG: "bytes", "n": len(value)}
    cls = type(value)
    if not _trusted(cls):
        raise TypeError(f"the control plane carries no {_name(cls)} (only plain values, numpy arrays and "
                        "hybridflow's own dataclasses, enums and exceptions)")
    if isinstance(value, enum.Enum):
        return {TAG: "enum", "cls": _name(cls), "v": _encode(value.value, buffers)}
    if isinstance(value, BaseException):
        state = {k: v for k, v in vars(value).items() if not k.startswith("__")}
        return {TAG: "exc", "cls": _name(cls), "args": _encode(tuple(value.args), buffers),
                "state": _encode(state, buffers), "notes": list(getattr(value, "__notes__", []))}
    if dataclasses.is_dataclass(value):
        fields = {f.name: _encode(getattr(value, f.name), buffers) for f in dataclasses.fields(value) if f.init}
        return {TAG: "dc", "cls": _name(cls), "v": fields}
    if isinstance(value, str):  # e.g. GroundTruth: a string with attributes
        return {TAG: "str", "cls": _name(cls), "v": str(value), "state": _encode(dict(vars(value)), buffers)}
    raise TypeError(f"the control plane cannot carry a {_name(cls)}: not a dataclass, enum or exception")


def _encode_array(array: np.ndarray, buffers: list[bytes]) -> dict[str, Any]:
    if array.dtype.hasobject:
        return {TAG: "ndo", "shape": list(array.shape), "v": [_encode(item, buffers) for item in array.ravel()]}
    data = np.ascontiguousarray(array).tobytes()
    buffers.append(data)
    return {TAG: "nd", "dtype": array.dtype.str, "shape": list(array.shape), "n": len(data)}


class _Decoder:
    def __init__(self, payload: memoryview) -> None:
        self.payload, self.offset = payload, 0

    def _take(self, size: Any) -> bytes:
        if not isinstance(size, int) or size < 0 or self.offset + size > len(self.payload):
            raise WireFormatError("control message buffer sizes do not match its payload")
        chunk = bytes(self.payload[self.offset:self.offset + size])
        self.offset += size
        return chunk

    def decode(self, node: Any) -> Any:
        if node is None or isinstance(node, bool | int | float | str):
            return node
        if isinstance(node, list):  # only headers we wrote: plain lists are always tagged
            raise WireFormatError("untagged list in a control message")
        if not isinstance(node, dict) or TAG not in node:
            raise WireFormatError("untagged value in a control message")
        return self._tagged(node[TAG], node)

    def _tagged(self, tag: str, node: dict[str, Any]) -> Any:
        if tag in ("list", "tuple", "set", "frozenset"):
            items = [self.decode(item) for item in node["v"]]
            return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
        if tag == "dict":
            return {self.decode(k): self.decode(v) for k, v in node["v"]}
        if tag == "bytes":
            return self._take(node["n"])
        if tag == "nd":
            dtype = np.dtype(node["dtype"])
            if dtype.hasobject:
                raise WireFormatError("object dtype in a raw array")
            return np.frombuffer(self._take(node["n"]), dtype=dtype).reshape(node["shape"]).copy()
        if tag == "ndo":
            out = np.empty(len(node["v"]), dtype=object)
            for i, item in enumerate(node["v"]):
                out[i] = self.decode(item)
            return out.reshape(node["shape"])
        if tag == "np":
            return np.dtype(node["dtype"]).type(node["v"])
        return self._instance(tag, node)

    def _instance(self, tag: str, node: dict[str, Any]) -> Any:
        cls = _resolve(node.get("cls"))
        if tag == "enum" and issubclass(cls, enum.Enum):
            return cls(self.decode(node["v"]))
        if tag == "dc" and dataclasses.is_dataclass(cls):
            return cls(**{name: self.decode(value) for name, value in node["v"].items()})
        if tag == "exc" and issubclass(cls, BaseException):
            err = cls.__new__(cls)
            err.args = self.decode(node["args"])
            for key, value in self.decode(node["state"]).items():
                setattr(err, key, value)
            for note in node.get("notes", []):
                err.add_note(str(note))
            return err
        if tag == "str" and issubclass(cls, str):
            made = str.__new__(cls, node["v"])
            for key, value in self.decode(node["state"]).items():
                setattr(made, key, value)
            return made
        raise WireFormatError(f"control message tag {tag!r} does not fit class {_name(cls)}")


def _resolve(name: Any) -> type:
    """A hybridflow class (or builtin exception) by ``module:qualname``; anything else is refused."""
    if not isinstance(name, str) or ":" not in name:
        raise WireFormatError(f"bad class name {name!r} in a control message")
    module, qualname = name.split(":", 1)
    if module == "builtins":
        found = getattr(builtins, qualname, None)
        if isinstance(found, type) and issubclass(found, BaseException):
            return found
        raise WireFormatError(f"control message names builtins.{qualname}, which is not an exception")
    if not module.startswith(_TRUSTED_PREFIX):
        raise WireFormatError(f"control message names class {name}, outside hybridflow: refused")
    target: Any = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part, None)
    if not isinstance(target, type) or not _trusted(target):  # not a class re-exported from elsewhere
        raise WireFormatError(f"control message names {name}, which is not one of hybridflow's classes")
    return target
