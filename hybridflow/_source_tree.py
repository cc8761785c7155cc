"""``hybridflow.backends`` and ``hybridflow.algorithms`` when ``hybridflow`` is imported from a source checkout.

The install maps the top-level folders ``backends/`` and ``algorithms/`` into the package (setuptools
``package-dir``). Python started in the checkout (``python -c``, a notebook, a script in ``examples/``
run from the root) finds the source folder ``hybridflow/`` first, which does not contain them; this
finder resolves the two names to their folders there, so the source tree imports like the install.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType

MAPPED = ("backends", "algorithms")


class SourceTreeFinder(importlib.abc.MetaPathFinder):
    """Finds ``hybridflow.<name>`` in ``<checkout>/<name>`` for each mapped sub-package name."""

    def __init__(self, folders: dict[str, str]) -> None:
        self.folders = folders  # module name -> folder

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        folder = self.folders.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(fullname, os.path.join(folder, "__init__.py"),
                                                      submodule_search_locations=[folder])


def install(package_dir: str) -> None:
    """Map the sub-packages missing from ``package_dir`` (the imported ``hybridflow/``) to its checkout."""
    root = os.path.dirname(package_dir)
    folders = {f"hybridflow.{name}": os.path.join(root, name) for name in MAPPED
               if not os.path.isdir(os.path.join(package_dir, name))
               and os.path.isfile(os.path.join(root, name, "__init__.py"))}
    if folders and not any(isinstance(finder, SourceTreeFinder) for finder in sys.meta_path):
        sys.meta_path.append(SourceTreeFinder(folders))
