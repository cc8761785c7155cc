"""Package list only; everything else is in pyproject.toml.

``backends/`` and ``algorithms/`` install as ``hybridflow.backends`` / ``hybridflow.algorithms``
(``package-dir`` in pyproject.toml); setuptools cannot discover mapped sub-packages itself, so
they are listed here, renamed, and new sub-packages are picked up without editing this file.
"""

from setuptools import find_packages, setup


def _mapped(folder: str) -> list[str]:
    return [f"hybridflow.{name}" for name in find_packages(include=[folder, f"{folder}.*"])]


setup(packages=find_packages(include=["hybridflow", "hybridflow.*"]) + _mapped("backends") + _mapped("algorithms")
      + _mapped("configs"))  # the starter YAML files, as package data of hybridflow.configs
