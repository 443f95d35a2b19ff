#!/usr/bin/env bash
# One pass over a GPU machine: warm the kernel cache, run the whole test suite, then the given benchmark
# command. Logs and the benchmark's results (results.tgz) land in $CUFLASH_OUT (default ./gpu-run-out).
# PYTEST_ARGS adds pytest options; SKIP_TESTS=1 skips the tests. Run from the repository's root:
#   bash tools/gpu_run.sh [bench args...]      e.g. bash tools/gpu_run.sh grid memory
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${CUFLASH_OUT:-gpu-run-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
start=$SECONDS
python3 -m cuflash warmup > "$OUT/warmup.log" 2>&1
tail -n 1 "$OUT/warmup.log"
echo "warmup: $((SECONDS - start)) s"
if [ -z "$SKIP_TESTS" ]; then
  start=$SECONDS
  python3 -m pytest tests -q -p no:cacheprovider -rfE ${PYTEST_ARGS} 2>&1 | tee "$OUT/pytest.log" | tail -n 25
  echo "tests: $((SECONDS - start)) s"
fi
if [ $# -gt 0 ]; then
  start=$SECONDS
  python3 -m bench "$@" 2>&1 | tee "$OUT/bench.log" | tail -n 60
  echo "bench: $((SECONDS - start)) s"
  tar czf "$OUT/results.tgz" bench/results
fi
