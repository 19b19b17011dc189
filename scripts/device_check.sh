#!/usr/bin/env bash
# The CUDA checks on a GPU machine with no network and no weights, from the repo root: bash scripts/device_check.sh
# Needs .devcarry/ beside the tree (git-ignored, carried): qwen-tok/ (the Qwen2.5 tokenizer), whl/ (trl, datasets,
# peft and their missing deps, for Python 3.12), whl-fallback/ (installed only where the machine lacks them).
# Runs benchmarks/gpu_check.py (skipped with ONLY=post_train) and benchmarks/gpu_post_train_check.py; logs and JSON go to $OUT. Exit 1 if either fails.
set -u -o pipefail
OUT=${OUT:-/tmp/device_check}
mkdir -p "$OUT"
pip_in() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$@"; }
pip_in .devcarry/whl/*.whl || { echo "wheel install failed"; exit 3; }
# mechprobe.stats imports statsmodels; datasets 5.2 needs huggingface_hub >= 1.31.
python3 -c "import statsmodels" 2>/dev/null || pip_in .devcarry/whl-fallback/{statsmodels,patsy}-*.whl
python3 -c "import huggingface_hub as h, sys; sys.exit(tuple(map(int, h.__version__.split('.')[:2])) < (1, 31))" \
  || pip_in .devcarry/whl-fallback/huggingface_hub-*.whl
export PYTHONPATH=/tmp/site:. HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # no network: never wait for a hub timeout
nvidia-smi -L
python3 -c "import sys, torch, transformers, peft, trl, datasets, huggingface_hub as h
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers',
      transformers.__version__, 'peft', peft.__version__, 'trl', trl.__version__, 'datasets', datasets.__version__,
      'hub', h.__version__)" 2>&1 | tee "$OUT/versions.txt"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE 'h100|h200|a100|l40s' | tr 'A-Z' 'a-z')
rc=0
[ "${ONLY:-}" = post_train ] || timeout 240 python3 benchmarks/gpu_check.py --arch qwen2 --tokenizer .devcarry/qwen-tok \
  --out "$OUT/gpu_${GPU:-gpu}_qwen2-0.5b-random.json" 2>&1 | tee "$OUT/gpu_check.log" || { rc=1; echo "gpu_check FAILED"; }
timeout 240 python3 benchmarks/gpu_post_train_check.py --out "$OUT/gpu_post_train.json" 2>&1 \
  | tee "$OUT/gpu_post_train_check.log" || { rc=1; echo "gpu_post_train_check FAILED"; }
exit $rc
