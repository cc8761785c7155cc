"""One exception type per way a graph can be wrong; each names the node and the field."""

from __future__ import annotations


class GraphValidationError(ValueError):
    """Base of every graph validation error."""

    def __init__(self, message: str, *, node: str | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.node = node
        self.field = field


class GraphCycleError(GraphValidationError):
    """Nodes depend on each other's outputs in a loop."""


class MissingFieldError(GraphValidationError):
    """A node consumes a field that no node and no graph input produces."""


class DuplicateFieldError(GraphValidationError):
    """Two producers (nodes or graph inputs) write the same field."""


class UnknownRoleError(GraphValidationError):
    """A node runs on a role the graph never declared."""


class RoleOpError(GraphValidationError):
    """A node asks a role for an op its kind cannot do (``update`` on a frozen reference...)."""


class DeadNodeError(GraphValidationError):
    """A node's outputs never reach an ``update``: it would be computed and thrown away."""


class NodeSpecError(GraphValidationError):
    """A node is malformed on its own: bad or duplicate name, bad option, inconsistent ``n``, wrong port
    bindings, or a missing or misplaced ``role``/``fn``/``loss``."""
