#!/usr/bin/env bash
# GPU check of image previews: an SD 1.5-sized random-weight pipeline, fp16, 512x512, 30 steps;
# plain call vs .stream() with "latent", "x0" and "vae" previews every step (see gpu_check.py).
# Needs about a minute on an H200; nothing is downloaded.
#
#   bash benchmarks/gpu_check.sh            # on a CUDA machine
#   bash benchmarks/gpu_check.sh --tiny     # anywhere: a narrow model on the CPU, to check the script
#   bash benchmarks/gpu_check.sh --text     # text: bf16 / int8 / int4 on SmolLM2-1.7B's layout (gpu_text.py)
#   bash benchmarks/gpu_check.sh --video    # video: the embedded model on CUDA, Wan 2.1 1.3B's layout (gpu_video.py)
#
# A machine without diffusers can get it as wheels in .whl/ (pure Python), fetched beforehand:
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl diffusers==0.42.1
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PY=${PYTHON:-python3}
if ! "$PY" -c "import diffusers" 2>/dev/null; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/ms-site .whl/*.whl
    export PYTHONPATH="/tmp/ms-site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "gpu_check: diffusers is not installed and there is no .whl/ folder with its wheel" >&2
    exit 2
  fi
fi
if [[ " $* " != *" --tiny "* ]] && command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
exec "$PY" benchmarks/gpu_check.py "$@"
