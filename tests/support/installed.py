"""The GPU checks' first step: refuse to run where vLLM cannot load actbus.

vLLM loads actbus through its ``vllm.general_plugins`` entry point, which only an
installed actbus has. From a checkout on ``PYTHONPATH`` alone the engine serves with no
capture at all, and a check then fails minutes later with a misleading error (no
publisher, no returned rows). This says so in one line, before any engine starts.
"""

from __future__ import annotations

from importlib.metadata import entry_points

GROUP = "vllm.general_plugins"


def require_actbus_plugin() -> None:
    """Exit with the fix if no ``actbus`` entry point is installed in ``GROUP``."""
    if any(ep.name == "actbus" for ep in entry_points(group=GROUP)):
        return
    raise SystemExit(
        f"actbus is not installed as a vLLM plugin (no 'actbus' entry point in {GROUP}), so "
        "vLLM would serve without it. Install it first: python -m pip install --no-deps "
        "--no-build-isolation --target /tmp/site . && export PYTHONPATH=.:/tmp/site "
        "(docs/gpu.md, 'Running from a checkout')"
    )
