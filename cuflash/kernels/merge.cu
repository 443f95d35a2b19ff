// Attention over disjoint key sets, combined by their log-sum-exp (merge_row, merge.cuh): cuflash.merge_states
// on CuPy. Part i of row (b, s, head) is outs[i, b, s, head, :] with lse lses[i, b, head, s]; a sink (one
// logit per head, sinks non-null) joins as a part with output 0. cuflash._merge.merge_states is the same
// rule as array operations.
#include "merge.cuh"

namespace cuflash {

// Rows merged per thread block of 128 threads: one warp per row, its lanes over the head dim.
constexpr int kMergeWarps = 4;

// outs: (parts, batch, seqlen_q, heads, head_dim) and lses: (parts, batch, heads, seqlen_q), both
// contiguous float32; out: (batch, seqlen_q, heads, head_dim) with element strides o_sb, o_ss, o_sh (last
// axis contiguous); lse: (batch, heads, seqlen_q) contiguous, or null (not stored).
template <typename T>
__global__ void __launch_bounds__(kMergeWarps * 32)
merge_parts(const float* __restrict__ outs, const float* __restrict__ lses, T* __restrict__ out,
            float* __restrict__ lse, const float* __restrict__ sinks, long long o_sb, long long o_ss,
            long long o_sh, int parts, int batch, int seqlen_q, int heads, int head_dim) {
    const int lane = threadIdx.x % 32;
    const long long row = static_cast<long long>(blockIdx.x) * kMergeWarps + threadIdx.x / 32;
    if (row >= static_cast<long long>(batch) * seqlen_q * heads) return;
    // rows in (b, s, head) order, heads fastest: a block's warps read neighbouring rows of outs
    const int h = static_cast<int>(row % heads), s = static_cast<int>(row / heads % seqlen_q);
    const int b = static_cast<int>(row / heads / seqlen_q);
    const long long part_rows = static_cast<long long>(batch) * seqlen_q * heads;   // rows per part, either array
    const float* lse_row = lses + (static_cast<long long>(b) * heads + h) * seqlen_q + s;
    const float* out_row = outs + row * head_dim;

    const float sink = sinks != nullptr ? sinks[h] : -CUFLASH_INF;
    float* lse_dst = lse == nullptr ? nullptr : lse + (static_cast<long long>(b) * heads + h) * seqlen_q + s;
    merge_row(out_row, part_rows * head_dim, lse_row, part_rows, parts, sink, out + b * o_sb + s * o_ss + h * o_sh,
              lse_dst, head_dim, lane);
}

}  // namespace cuflash
