// Attention over disjoint key sets, combined by their log-sum-exp: cuflash.merge_states on CuPy (merge_parts,
// through merge_row, merge.cuh), and ring attention's merge of each block into its running state (merge_into).
// Part i of row (b, s, head) is outs[i, b, s, head, :] with lse lses[i, b, head, s]; a sink (one logit per
// head, sinks non-null) joins as a part with output 0. cuflash._merge.merge_states and
// cuflash.distributed._merge_into are the same rules as array operations.
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

// Ring attention's running state (cuflash.distributed): acc (batch, acc_rows, heads, head_dim) float32, the
// output normalized over the keys merged so far, and acc_lse (batch, heads, acc_rows) float32 (-inf: no key
// yet), both contiguous. Rows row0 .. row0 + rows of it take one more part in place: part (batch, rows, heads,
// head_dim) of T with element strides p_sb, p_ss, p_sh (last axis contiguous), normalized over its keys, with
// part_lse (batch, heads, rows) contiguous; or, where part is null, a part of output 0 with lse sinks[head] (the
// attention sink, joining each row once). With m the larger lse, keep = exp(lse_acc - m) and share =
// exp(lse_part - m): acc = (keep acc + share part) / (keep + share), lse = m + log(keep + share). A part with
// lse -inf changes nothing; its output is never read.
template <typename T>
__global__ void __launch_bounds__(kMergeWarps * 32)
merge_into(float* __restrict__ acc, float* __restrict__ acc_lse, const T* __restrict__ part,
           const float* __restrict__ part_lse, const float* __restrict__ sinks, long long p_sb, long long p_ss,
           long long p_sh, int row0, int acc_rows, int batch, int rows, int heads, int head_dim) {
    constexpr int kColumns = 4;
    const int lane = threadIdx.x % 32;
    const long long row = static_cast<long long>(blockIdx.x) * kMergeWarps + threadIdx.x / 32;
    if (row >= static_cast<long long>(batch) * rows * heads) return;
    // rows in (b, s, head) order, heads fastest: a block's warps read neighbouring rows of the part
    const int h = static_cast<int>(row % heads), s = static_cast<int>(row / heads % rows);
    const int b = static_cast<int>(row / heads / rows);
    float* lse_at = acc_lse + (static_cast<long long>(b) * heads + h) * acc_rows + row0 + s;
    const float old = *lse_at;
    const float added = part != nullptr ? part_lse[(static_cast<long long>(b) * heads + h) * rows + s] : sinks[h];
    const float m = fmaxf(old, added);
    if (m == -CUFLASH_INF) return;   // neither saw a key: the state stays 0 with lse -inf
    const float keep = expf(old - m), share = expf(added - m);   // exp(-inf) = 0
    const float total = keep + share, inv_total = 1.f / total;
    float* dst = acc + ((static_cast<long long>(b) * acc_rows + row0 + s) * heads + h) * head_dim;
    const T* src = part == nullptr ? nullptr : part + b * p_sb + s * p_ss + h * p_sh;
    for (int c0 = lane * kColumns; c0 < head_dim; c0 += 32 * kColumns) {
#pragma unroll
        for (int e = 0; e < kColumns; ++e) {
            if (c0 + e >= head_dim) break;
            const float x = src != nullptr && share > 0.f ? to_float(src[c0 + e]) : 0.f;
            dst[c0 + e] = (dst[c0 + e] * keep + share * x) * inv_total;
        }
    }
    __syncwarp();
    if (lane == 0) *lse_at = m + logf(total);
}

}  // namespace cuflash
