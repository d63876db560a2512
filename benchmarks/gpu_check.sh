#!/usr/bin/env bash
# The one prepared run for a lent CUDA machine (issue 18), from the repository root, with the
# machine's own python3 / torch / triton / transformers (nothing is installed or downloaded):
#   1. the Triton kernel and backend tests compiled for the GPU (KVFLOW_TEST_DEVICE=cuda),
#   2. benchmarks/gpu_offline.py: greedy equivalence with HF, offline throughput vs HF generate,
#      decode step with and without CUDA graphs.
# Results go to $OUT (or /tmp/kvflow-gpu): env.txt, tests.txt, gpu_results.json, gpu_log.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/kvflow-gpu}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys, torch, triton, transformers; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__, transformers.__version__)"
} 2>&1 | tee "$OUT/env.txt"
KVFLOW_TEST_DEVICE=cuda timeout 180 python3 -m pytest -q -p no:cacheprovider -x tests/kernels/test_triton_attention.py 2>&1 \
  | tail -40 | tee "$OUT/tests.txt"
timeout 420 python3 benchmarks/gpu_offline.py --out "$OUT/gpu_results.json" "$@" 2>&1 | tee "$OUT/gpu_log.txt"
