#!/usr/bin/env bash
# One pass over a GPU machine: warm the kernel cache, run the whole test suite, then the given benchmark
# command. Logs and the benchmark's results (results.tgz) land in $CUFLASH_OUT (default ./gpu-run-out).
# The suite runs as fourteen pytest processes side by side, each under SUITE_TIMEOUT seconds (default 420): the
# dropout cases of test_features, its fuzzed cases and the rest of it, test_attention, test_backward,
# test_kvcache, test_gpu with test_varlen, test_fa_grid (FlashAttention-2's cases), test_distributed (ring
# attention on local groups), then the rest; then test_backward, test_features without its fuzzed
# cases (two groups) and test_varlen once more with an A100's plan (CUFLASH_TEST_PLAN=a100, tests/conftest.py:
# on a Hopper GPU, the portable kernels at an A100's tiles, which its own plan leaves out). On an H200 machine
# of 16 cores the first twelve took 310-390 s, bound by the longest group (test_gpu with test_varlen, over 330 s in
# one run); the float64 reference checks are CPU-bound, so each group's BLAS runs one thread (fourteen groups
# already fill the cores). The compile check is left out: it needs no GPU, and CI runs it.
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
  files="tests/test_features.py tests/test_attention.py tests/test_backward.py tests/test_kvcache.py"
  files="$files tests/test_gpu.py tests/test_varlen.py tests/test_fa_grid.py tests/test_distributed.py"
  rest="--ignore=tests/test_compile.py"
  for f in $files; do rest="$rest --ignore=$f"; done
  status=0
  pids=()
  # group INDEX PYTEST_ARGS...: one pytest process in the background, its pid in pids; PLAN=NAME before it
  # sets its CUFLASH_TEST_PLAN
  group() {
    local index=$1
    shift
    # shellcheck disable=SC2086  # PYTEST_ARGS may be several words
    CUFLASH_TEST_PLAN=${PLAN:-native} OPENBLAS_NUM_THREADS=1 timeout "${SUITE_TIMEOUT:-420}" \
      python3 -m pytest "$@" -q -p no:cacheprovider -rfE ${PYTEST_ARGS} > "$OUT/pytest.$index.log" 2>&1 &
    pids+=($!)
  }
  group 0 tests/test_features.py -k dropout
  group 1 tests/test_features.py -k "not dropout and not fuzzed"
  group 7 tests/test_features.py -k "fuzzed and not dropout"
  group 2 tests/test_attention.py
  group 3 tests/test_backward.py
  group 4 tests/test_kvcache.py
  group 5 tests/test_gpu.py tests/test_varlen.py
  group 12 tests/test_fa_grid.py
  group 13 tests/test_distributed.py
  # shellcheck disable=SC2086  # rest is several words
  group 6 tests $rest
  PLAN=a100 group 8 tests/test_backward.py
  PLAN=a100 group 9 tests/test_features.py -k "not fuzzed and not dropout"
  PLAN=a100 group 10 tests/test_varlen.py
  PLAN=a100 group 11 tests/test_features.py -k "dropout and not fuzzed"
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
