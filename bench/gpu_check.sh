#!/usr/bin/env bash
# The prepared GPU check (issue 12): CUDA-only tests, the demo on CUDA, calibrate, the paired step
# ratio of trinity against Inductor at 50%, and predicted-versus-measured step time and peak of the
# demo model at 100%, 50% and 25%; one JSON under bench/results/. Under 8 minutes on one H200.
#
#   bench/gpu_check.sh [--quick] [--out FILE] [--deadline SECONDS] [--parts a,b,...]
#
# Without CUDA it is a dry run on the CPU (the JSON's "skipped" says what did not run as on a GPU);
# --quick or TRINITY_GPU_CHECK_QUICK=1 shrinks every part. It installs nothing: it uses $PYTHON,
# else this checkout's .venv/bin/python when that has torch, else python3 (on the GPU machine the
# one that holds PyTorch). Where trinity is not installed, a metadata-only shim on PYTHONPATH
# registers its torch_dynamo_backends entry point (what `pip install -e .` would), so that
# backend="trinity" resolves. TRINITY_COMMIT names the commit where the copy has no .git.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]] && .venv/bin/python -c "import torch" 2>/dev/null; then
    PYTHON=.venv/bin/python
  else
    PYTHON=python3
  fi
fi
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  echo "gpu_check: $PYTHON cannot import torch; set PYTHON to an interpreter that has it (nothing is installed here)" >&2
  exit 2
fi

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PYTHON" - <<'PY'
import importlib.metadata as md, sys
sys.exit(0 if any(e.name == "trinity" for e in md.entry_points(group="torch_dynamo_backends")) else 1)
PY
then
  SHIM="$(mktemp -d)"
  trap 'rm -rf "$SHIM"' EXIT
  mkdir -p "$SHIM/trinity_offload-0.0.0+checkout.dist-info"
  printf 'Metadata-Version: 2.1\nName: trinity-offload\nVersion: 0.0.0+checkout\n' \
    > "$SHIM/trinity_offload-0.0.0+checkout.dist-info/METADATA"
  printf '[torch_dynamo_backends]\ntrinity = offload_compiler.backend:trinity\n' \
    > "$SHIM/trinity_offload-0.0.0+checkout.dist-info/entry_points.txt"
  export PYTHONPATH="$PYTHONPATH:$SHIM"
  echo "gpu_check: trinity is not installed; registered its backend entry point from $SHIM"
fi

export PYTHONUNBUFFERED=1
export TRINITY_GPU_CHECK_COMMAND="bench/gpu_check.sh${*:+ $*}"
"$PYTHON" -c "import torch; print('gpu_check: torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
exec "$PYTHON" -m bench.gpu_check "$@"
