#!/usr/bin/env bash
# Nsight Compute on one bench cell per (impl, pass) pair: the sections that say where a kernel's time
# goes (speed of light, pipes, shared-memory wavefronts and conflicts, warp stalls, issue slots).
#   bash tools/ncu_compare.sh HEAD_DIM SEQLEN [--causal] [--feature NAME] [--portable] -- IMPL:PASS ...
# e.g. bash tools/ncu_compare.sh 128 4096 -- cuflash:fwd torch-flash:fwd cuflash:bwd torch-flash:bwd
#      bash tools/ncu_compare.sh 128 8192 --feature dropout0.1 -- cuflash:fwd   (a features-suite column, causal)
#      bash tools/ncu_compare.sh 256 8192 --portable -- cuflash:bwd   (cuflash without the Hopper kernels)
# Writes $CUFLASH_OUT/ncu-<impl>-<pass>-d<head_dim>-<seqlen>[-<options>].txt (default ./ncu-out). The clocks
# are left as the GPU runs them (--clock-control none), as the benchmark measures them.
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${CUFLASH_OUT:-ncu-out}
mkdir -p "$OUT"
dim=$1 seqlen=$2; shift 2
extra=()
while [ "$1" != "--" ] && [ $# -gt 0 ]; do extra+=("$1"); shift; done
shift
metrics=sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,\
l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,\
smsp__inst_executed.sum,smsp__inst_executed_pipe_tensor.sum,sm__cycles_elapsed.avg,\
l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed,\
'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
for job in "$@"; do
  impl=${job%%:*} pass=${job##*:}
  options="${extra[*]}"; options="${options//--/}"
  name="ncu-${impl}-${pass//+/_}-d${dim}-${seqlen}${options:+-${options// /-}}.txt"
  ncu --clock-control none --profile-from-start off --target-processes all \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --section SchedulerStats --section WarpStateStats --section InstructionStats --section Occupancy \
      --section LaunchStats --metrics "$metrics" \
      python3 tools/ncu_probe.py --impl "$impl" --pass "$pass" --head-dim "$dim" --seqlen "$seqlen" "${extra[@]}" \
      > "$OUT/$name" 2>&1
  echo "$name: $(grep -c '==PROF==\|Section' "$OUT/$name") lines of sections"
done
