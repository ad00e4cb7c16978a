"""Make actbus's entry points visible from a plain checkout, without pip.

The lent GPU machine has no index to build or install from; there the checkout is
put on PYTHONPATH, but vLLM finds the plugin and ``actbus run`` finds consumers only
through entry points. This writes the metadata an install would (from
pyproject.toml) into a folder that is on the path:

    python scripts/register_entry_points.py /tmp/site
"""

from __future__ import annotations

import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def main(target: str) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    info = Path(target) / f"{project['name']}-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    lines = []
    for group, eps in project.get("entry-points", {}).items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {value}" for name, value in eps.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    print(f"entry points of {project['name']} registered in {info}")


if __name__ == "__main__":
    main(sys.argv[1])
