// Attention over disjoint key sets, combined by their log-sum-exp: cuflash.merge_states on CuPy and the
// KV-cache forward's key splits (fwd_mma with KVCACHE writes one part per split).
//
// Part i of row (b, s, head) is outs[i, b, s, head, :] (float32, normalized over its keys) with lse
// lses[i, b, head, s] (natural log, -inf where the part saw no key). Over the union
//     lse = log(sum_i exp(lse_i)),  out = sum_i exp(lse_i - lse) out_i,
// with the largest lse_i subtracted first; a part with lse -inf counts for nothing (its out is never read),
// and a sink (one logit per head, sinks non-null) joins as a part with output 0. A row no part saw gets
// output 0 and lse -inf. cuflash._merge.merge_states is the same rule as array operations.
#include "common.cuh"

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
    float shift = sink;
    for (int i = lane; i < parts; i += 32) shift = fmaxf(shift, lse_row[i * part_rows]);
    shift = safe_max(warp_max(shift));   // no part saw a key: every weight below is exp(-inf) = 0
    float total = 0.f;
    for (int i = lane; i < parts; i += 32) total += expf(lse_row[i * part_rows] - shift);
    total = warp_sum(total) + expf(sink - shift);
    const float inv_total = total > 0.f ? 1.f / total : 0.f;
    if (lse != nullptr && lane == 0)
        lse[(static_cast<long long>(b) * heads + h) * seqlen_q + s] = total > 0.f ? shift + logf(total) : -CUFLASH_INF;

    // Each lane sums kColumns adjacent columns over the parts; the loads of several parts are in flight at
    // once (the sum is a select, not a branch: a part of weight 0 is read but never counted, whatever it
    // holds). One load at a time, a warp waited out the latency of each part's row in turn.
    constexpr int kColumns = 4;
    T* dst = out + b * o_sb + s * o_ss + h * o_sh;
    for (int c0 = lane * kColumns; c0 < head_dim; c0 += 32 * kColumns) {
        float acc[kColumns] = {};
#pragma unroll 4
        for (int i = 0; i < parts; ++i) {
            const float weight = expf(lse_row[i * part_rows] - shift);   // exp(-inf) = 0 for an unseen part
            const float* src = out_row + i * part_rows * head_dim + c0;
#pragma unroll
            for (int e = 0; e < kColumns; ++e) {
                const float x = c0 + e < head_dim ? src[e] : 0.f;
                acc[e] += weight > 0.f ? weight * x : 0.f;
            }
        }
#pragma unroll
        for (int e = 0; e < kColumns; ++e)
            if (c0 + e < head_dim) dst[c0 + e] = from_float<T>(acc[e] * inv_total);
    }
}

}  // namespace cuflash
