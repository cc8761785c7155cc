"""Make this checkout importable as an installed ``hybridflow`` with nothing but the standard library.

    python3 benchmarks/gpu_check_site.py SITE     # then PYTHONPATH=<checkout>:SITE

``hybridflow/_source_tree.py`` already maps ``backends/`` and ``algorithms/`` into the package when it is imported
from the checkout; what a source tree lacks is the distribution's metadata, whose entry points register the
built-in algorithms, functions, backends and rollouts. This writes that metadata (``METADATA`` and the
``entry_points.txt`` of ``pyproject.toml``) into SITE. ``make gpu-check`` uses it on a lent GPU machine, where the
image's Python may have no network and a setuptools too old to build an editable install (65.x cannot:
no ``bdist_wheel``), and ``make gpu-check-cpu`` uses it the same way.
"""

from __future__ import annotations

import re
import shutil
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_metadata(site: Path, root: Path = ROOT) -> Path:
    """``SITE/hybridflow-<version>.dist-info`` with the checkout's name, version and entry points."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    found = re.search(r'__version__ = "([^"]+)"', (root / "hybridflow" / "_version.py").read_text())
    if found is None:
        raise ValueError(f"{root / 'hybridflow' / '_version.py'}: no __version__ = \"...\" line")
    version = found.group(1)
    for old in site.glob(f"{project['name']}-*.dist-info"):
        shutil.rmtree(old)
    info = site / f"{project['name']}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {version}\n")
    groups = {"console_scripts": project.get("scripts", {}), **project.get("entry-points", {})}
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in points.items()) + "\n"
        for group, points in groups.items() if points))
    (info / "top_level.txt").write_text("hybridflow\n")
    return info


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python3 benchmarks/gpu_check_site.py SITE_FOLDER")
    print(write_metadata(Path(sys.argv[1]).resolve()))
