#!/usr/bin/env bash
# One pass over a GPU machine: warm the kernel cache, run the whole test suite, then the given benchmark
# command. Logs and the benchmark's results (results.tgz) land in $CUFLASH_OUT (default ./gpu-run-out).
# The suite runs as four pytest processes side by side (the three largest files, then the rest; about 290 s
# on an H200 machine of 16 cores against 600 s and more in one process: the float64 reference checks are
# CPU-bound). The compile check is left out: it needs no GPU, and CI runs it.
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
  big="tests/test_features.py tests/test_attention.py tests/test_backward.py"
  rest="--ignore=tests/test_compile.py"
  for f in $big; do rest="$rest --ignore=$f"; done
  status=0
  pids=()
  i=0
  for group in $big "tests $rest"; do
    python3 -m pytest $group -q -p no:cacheprovider -rfE ${PYTEST_ARGS} > "$OUT/pytest.$i.log" 2>&1 &
    pids+=($!)
    i=$((i + 1))
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  for log in "$OUT"/pytest.*.log; do
    echo "$log: $(tail -n 1 "$log")"
    grep -E "^(FAILED|ERROR)" "$log" | head -n 20
  done
  echo "tests: $((SECONDS - start)) s, status $status"
fi
if [ $# -gt 0 ]; then
  start=$SECONDS
  python3 -m bench "$@" 2>&1 | tee "$OUT/bench.log" | tail -n 60
  echo "bench: $((SECONDS - start)) s"
  tar czf "$OUT/results.tgz" bench/results
fi
