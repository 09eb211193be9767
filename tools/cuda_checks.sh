#!/usr/bin/env bash
# On a machine with a CUDA GPU (CI has none): the tests that run only there, then the DP step and per-sample
# gradients timed on the device. Any Python with torch will do (no .venv needed):
#   PYTHON=python3 tools/cuda_checks.sh [OUTDIR]
# Logs go to OUTDIR (default: cuda-checks/, ignored by git). The benches' tables are printed too.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
out=${1:-cuda-checks}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, \
torch.cuda.get_device_name())" || exit 1
status=0
workers=$("$PYTHON" -c "import xdist" 2>/dev/null && echo "-n 8")  # the device's 20 s instead of minutes
timeout 300 "$PYTHON" -m pytest -q -p no:randomly -p no:cacheprovider $workers tests/test_cuda.py tests/strategies/test_agreement.py \
    tests/test_api.py tests/core/test_memory.py tests/core/test_tolerances.py -k "cuda or device or tf32" \
    --tb=short >"$out/tests.log" 2>&1 || status=1
tail -n 3 "$out/tests.log"
timeout 300 "$PYTHON" -m pergrad_viz bench --dp --device cuda --no-progress 2>&1 | tee "$out/dp.log" || status=1
for model in mlp transformer resnet18; do
    timeout 120 "$PYTHON" -m pergrad_viz bench --model "$model" --device cuda --strategies torch_func,hooks,auto \
        --no-progress 2>&1 | tee -a "$out/models.log" || status=1
done
exit $status
