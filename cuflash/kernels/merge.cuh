// The merge of partial attention states by their log-sum-exp, one row at a time: merge_parts (merge.cu,
// cuflash.merge_states) and the KV-cache forward's key splits (fwd_mma with KVCACHE, whose last block per
// row group merges its group's parts) run this one function.
//
// Over parts i with outputs out_i (float32, normalized over the part's keys) and lse_i (natural log, -inf
// where the part saw no key):
//     lse = log(sum_i exp(lse_i)),  out = sum_i exp(lse_i - lse) out_i,
// with the largest lse_i so far subtracted; a part with lse -inf counts for nothing (its out is never
// counted, whatever it holds), and a sink (one logit) joins as a part with output 0. A row no part saw gets
// output 0 and lse -inf.
#pragma once
#include "common.cuh"

namespace cuflash {

// One warp merges one row: part i's lse is lse_row[i * lse_stride] and its output the head_dim floats
// at out_row + i * out_stride; sink is the row's sink logit (-inf: none). Writes dst[0, head_dim) and, where
// lse_dst is not null, *lse_dst. Each lane takes kColumns adjacent columns and walks the parts once, keeping
// the largest lse so far (m), the sum of exp(lse_i - m) and its columns' weighted sum, rescaled when m
// grows, as the forward's online softmax does: no load waits on another or on a warp reduction, so the
// loads of several parts are in flight at once (the KV-cache forward's last block merges on the critical
// path of a decoding step). The parts are read through L2 (ld.global.cg), never a stale L1 line: in the
// KV-cache forward other blocks of the running kernel wrote them.
template <typename T>
__device__ __forceinline__ void merge_row(const float* out_row, long long out_stride, const float* lse_row,
                                          long long lse_stride, int parts, float sink, T* dst, float* lse_dst,
                                          int head_dim, int lane) {
    constexpr int kColumns = 4;
    for (int c0 = lane * kColumns; c0 < head_dim; c0 += 32 * kColumns) {
        float m = sink, total = sink == -CUFLASH_INF ? 0.f : 1.f, acc[kColumns] = {};
#pragma unroll 4
        for (int i = 0; i < parts; ++i) {
            const float lse_i = __ldcg(lse_row + i * lse_stride);
            const float* src = out_row + i * out_stride + c0;
            float x[kColumns];
#pragma unroll
            for (int e = 0; e < kColumns; ++e) x[e] = c0 + e < head_dim ? __ldcg(src + e) : 0.f;
            // a part that saw no key (lse -inf) counts for nothing: selects, not branches, so its row (never
            // written) is read but not used, whatever it holds
            const bool seen = lse_i != -CUFLASH_INF;
            const float m_new = seen ? fmaxf(m, lse_i) : m;
            const float rescale = seen ? expf(m - m_new) : 1.f;   // exp(-inf) = 0 while no part counted
            const float weight = seen ? expf(lse_i - m_new) : 0.f;
            total = total * rescale + weight;
#pragma unroll
            for (int e = 0; e < kColumns; ++e) acc[e] = acc[e] * rescale + (seen ? weight * x[e] : 0.f);
            m = m_new;
        }
        if (lse_dst != nullptr && c0 == 0) *lse_dst = total > 0.f ? m + logf(total) : -CUFLASH_INF;
        const float inv_total = total > 0.f ? 1.f / total : 0.f;
#pragma unroll
        for (int e = 0; e < kColumns; ++e)
            if (c0 + e < head_dim) dst[c0 + e] = from_float<T>(acc[e] * inv_total);
    }
}

}  // namespace cuflash
