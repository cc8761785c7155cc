"""The dataflow-graph DSL: roles, nodes, validation, introspection and rendering.

Pure Python plus networkx: importing this package never imports torch or ray.
"""

from hybridflow.graph.builder import GraphBuilder
from hybridflow.graph.errors import (
    DeadNodeError,
    DuplicateFieldError,
    GraphCycleError,
    GraphValidationError,
    MissingFieldError,
    NodeSpecError,
    RoleOpError,
    UnknownRoleError,
)
from hybridflow.graph.fields import STANDARD_FIELDS, Extent, FieldSpec, field_spec
from hybridflow.graph.graph import DEFAULT_INPUTS, PAIR_INPUTS, Edge, Graph
from hybridflow.graph.loading import load_graph
from hybridflow.graph.node import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_TEMPERATURE,
    OP_PORTS,
    SAMPLE_IMAGES_OPTION,
    TIMEOUT_KEY_OPTION,
    TIMEOUT_OPTION,
    Node,
)
from hybridflow.graph.render import FORMATS, from_dict, from_json, render, to_dict, to_json
from hybridflow.graph.roles import ALLOWED_OPS, Op, Role, RoleKind
from hybridflow.graph.skipping import DETACHED_LOGPROBS, SkippedPass, prune_unread, with_detached_logprobs
from hybridflow.graph.workload import TEMPLATE_TOKENS_OPTION, NodeLoad, Workload, edge_bytes, field_bytes, node_loads

__all__ = [
    "ALLOWED_OPS",
    "DEFAULT_INPUTS",
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_TEMPERATURE",
    "DETACHED_LOGPROBS",
    "FORMATS",
    "OP_PORTS",
    "PAIR_INPUTS",
    "SAMPLE_IMAGES_OPTION",
    "STANDARD_FIELDS",
    "TEMPLATE_TOKENS_OPTION",
    "TIMEOUT_KEY_OPTION",
    "TIMEOUT_OPTION",
    "DeadNodeError",
    "DuplicateFieldError",
    "Edge",
    "Extent",
    "FieldSpec",
    "Graph",
    "GraphBuilder",
    "GraphCycleError",
    "GraphValidationError",
    "MissingFieldError",
    "Node",
    "NodeLoad",
    "NodeSpecError",
    "Op",
    "Role",
    "RoleKind",
    "RoleOpError",
    "SkippedPass",
    "UnknownRoleError",
    "Workload",
    "edge_bytes",
    "field_bytes",
    "field_spec",
    "from_dict",
    "from_json",
    "load_graph",
    "node_loads",
    "prune_unread",
    "render",
    "to_dict",
    "to_json",
    "with_detached_logprobs",
]
