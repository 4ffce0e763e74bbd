#!/usr/bin/env bash
# E/P/D (and E+PD) on vLLM on a CUDA GPU, encoders on the reference engine and on vLLM, checked
# against the reference runtime's tokens (the golden check) and reported beside vLLM's own unsplit
# run of the same checkpoint and media. Exits non-zero on any mismatch or failure.
#
#   deploy/gpu/check_vllm_epd.sh                 # from the repository root, on a machine with a GPU
#   VENV=/opt/epd-cuda CUDA_MAJOR=13 deploy/gpu/check_vllm_epd.sh
#
# What it does (docs/vllm-operations.md, "Another device: install variants"):
#   1. a venv of its own ($VENV): the CUDA build of vLLM (PyPI's default `vllm` wheel, same version
#      as the CPU lock), its CUDA torch, the NIXL build for the machine's CUDA, then the project's
#      other pins without their torch lines (vLLM's torch stays);
#   2. the tiny checkpoints (generated locally: no model hub);
#   3. tests/benchmarks/vllm_tokens.py --check with every vLLM service on `--device cuda` (float32,
#      eager: token-identical settings; vLLM unsplit runs with the same ones).
# Written for a GPU host; not run here (this repository's hosts have no GPU).
set -euo pipefail

cd "$(dirname "$0")/../.."
VENV=${VENV:-.venv-cuda}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
NIXL_VERSION=${NIXL_VERSION:-1.5.1}
CUDA_MAJOR=${CUDA_MAJOR:-12}
FAMILIES=${FAMILIES:-qwen2_5_omni qwen2_5_vl qwen3_vl}
LAYOUTS=${LAYOUTS:-e+pd e/p/d}
SERVICE_ARGS=${SERVICE_ARGS:---device cuda --dtype float32 --enforce-eager --kv-cache-mib 512}

command -v nvidia-smi >/dev/null || { echo "check_vllm_epd: no nvidia-smi: not a CUDA machine" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip install --disable-pip-version-check"
$PIP --upgrade pip
$PIP "vllm==$VLLM_VERSION"
$PIP "nixl==$NIXL_VERSION" "nixl-cu$CUDA_MAJOR==$NIXL_VERSION"
# The project's pins, less torch's family (vLLM's CUDA torch stays) and anything vLLM already pinned.
grep -vE '^(torch|torchvision|torchaudio|nvidia-|triton)' requirements.lock > "$VENV/requirements-project.txt"
$PIP --no-deps -r "$VENV/requirements-project.txt"
$PIP --no-deps --no-build-isolation -e .
"$VENV/bin/python" -m pip check || echo "check_vllm_epd: pip check reports the above (informational)" >&2
"$VENV/bin/python" - <<'PY'
from vllm.platforms import current_platform
from libs.transfer.nixl_package import nixl_package
assert current_platform.device_type == "cuda", f"vLLM build is {current_platform.device_type!r}, not cuda"
print("vLLM platform:", current_platform.device_type, "| NIXL build:", nixl_package())
PY

# shellcheck disable=SC2086  # word splitting of FAMILIES / LAYOUTS is intended
"$VENV/bin/python" tests/benchmarks/vllm_tokens.py --check --families $FAMILIES --layouts $LAYOUTS \
    --encoder-engines reference vllm --service-args "$SERVICE_ARGS"
echo "check_vllm_epd: EPD on vLLM (--device cuda) equals the reference for every family, layout, encoder and mix"
