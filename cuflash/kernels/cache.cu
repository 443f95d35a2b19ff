// The KV cache's side of attention_with_kvcache on the GPU, before the KV-cache forward, in one launch:
// the new keys and values written into the cache, the keys (and the queries) turned by the rotary
// embedding first where its tables are given. cuflash._kvcache holds the same steps as array operations
// (the NumPy path and the reference).
//
// Layouts (element strides, last axis contiguous): q (batch, seqlen_q, heads, head_dim) is read through
// q_sb, q_ss, q_sh and, where q_out is not null, written rotated into q_out (batch, seqlen_q, heads,
// head_dim), C-contiguous; k and v (batch, seqlen_new, heads_kv, head_dim) through k_*, v_*; the caches
// through kc_* and vc_*, whose first stride is a sequence's (contiguous cache) or a page's (block_table
// not null: key n of sequence b is row n % page_size of page block_table[b * block_table_stride + n /
// page_size]). Sequence b holds cache_seqlens[b] keys before the call (cache_seqlen for every sequence
// where cache_seqlens is null): new key i goes to row cache_seqlens[b] + i. Positions count from the
// sequence's first key, row cache_leftpad[b] (0 where cache_leftpad is null). The rotary tables cos and
// sin are (seqlen_ro, rotary_dim / 2), C-contiguous, float32 where cos_f32 / sin_f32 and T otherwise; a
// pair (x1, x2) of channels ((2i, 2i + 1) where interleaved (GPT-J), (i, i + rotary_dim / 2) otherwise
// (GPT-NeoX)) at position pos becomes (x1 c - x2 s, x1 s + x2 c) with c = cos[pos][i], s = sin[pos][i],
// computed in float32; the channels past rotary_dim are copied. Key i rotates at its position, query i at
// new key i's position where q_advances (causal or windowed) and at new key 0's otherwise (FlashAttention's
// rule). rotary_dim 0: no tables, q_out null, the keys copied as they are.
#include "common.cuh"

namespace cuflash {

// Rows per thread block of 128 threads: one warp per row (a query row of one head, or a new key and value
// row of one kv head), its lanes over the channels.
constexpr int kAppendWarps = 4;

// Entry i of a rotary table, float32 or T.
template <typename T>
__device__ __forceinline__ float table_at(const void* table, bool is_float32, long long i) {
    return is_float32 ? static_cast<const float*>(table)[i] : to_float(static_cast<const T*>(table)[i]);
}

// One row of head_dim channels from src to dst, rotated at position pos where rotary_dim > 0.
template <typename T>
__device__ __forceinline__ void rotate_row(const T* src, T* dst, int pos, const void* cos, const void* sin,
                                           bool cos_f32, bool sin_f32, int rotary_dim, bool interleaved,
                                           int head_dim, int lane) {
    const int half = rotary_dim / 2;
    for (int p = lane; p < half; p += 32) {
        const long long at = static_cast<long long>(pos) * half + p;
        const float c = table_at<T>(cos, cos_f32, at), s = table_at<T>(sin, sin_f32, at);
        const int i1 = interleaved ? 2 * p : p, i2 = interleaved ? 2 * p + 1 : p + half;
        const float x1 = to_float(src[i1]), x2 = to_float(src[i2]);
        dst[i1] = from_float<T>(x1 * c - x2 * s);
        dst[i2] = from_float<T>(x1 * s + x2 * c);
    }
    for (int col = rotary_dim + lane; col < head_dim; col += 32) dst[col] = src[col];
}

template <typename T>
__global__ void __launch_bounds__(kAppendWarps * 32)
append_rotary(const T* __restrict__ q, T* __restrict__ q_out, const T* __restrict__ k, const T* __restrict__ v,
              T* __restrict__ k_cache, T* __restrict__ v_cache, const void* __restrict__ cos,
              const void* __restrict__ sin, const int* __restrict__ cache_seqlens,
              const int* __restrict__ block_table, const int* __restrict__ cache_leftpad, int cache_seqlen, long long q_sb, long long q_ss, long long q_sh,
              long long k_sb, long long k_ss, long long k_sh, long long v_sb, long long v_ss, long long v_sh,
              long long kc_sb, long long kc_ss, long long kc_sh, long long vc_sb, long long vc_ss, long long vc_sh,
              long long block_table_stride, int batch, int seqlen_q, int heads, int seqlen_new, int heads_kv,
              int head_dim, int rotary_dim, int page_size, int interleaved, int q_advances, int cos_f32,
              int sin_f32) {
    const int lane = threadIdx.x % 32;
    long long row = static_cast<long long>(blockIdx.x) * kAppendWarps + threadIdx.x / 32;
    // rows: the queries' (where q_out is not null), (b, i, head) order, heads fastest; then the new keys'
    const long long q_rows = q_out != nullptr ? static_cast<long long>(batch) * seqlen_q * heads : 0;
    if (row < q_rows) {
        const int h = static_cast<int>(row % heads), i = static_cast<int>(row / heads % seqlen_q);
        const int b = static_cast<int>(row / heads / seqlen_q);
        const int start = (cache_seqlens != nullptr ? cache_seqlens[b] : cache_seqlen)
                          - (cache_leftpad != nullptr ? cache_leftpad[b] : 0);   // new key 0's position
        rotate_row(q + b * q_sb + i * q_ss + h * q_sh, q_out + row * head_dim, q_advances ? start + i : start, cos,
                   sin, cos_f32 != 0, sin_f32 != 0, rotary_dim, interleaved != 0, head_dim, lane);
        return;
    }
    row -= q_rows;
    if (row >= static_cast<long long>(batch) * seqlen_new * heads_kv) return;
    const int h = static_cast<int>(row % heads_kv), i = static_cast<int>(row / heads_kv % seqlen_new);
    const int b = static_cast<int>(row / heads_kv / seqlen_new);
    const int n = (cache_seqlens != nullptr ? cache_seqlens[b] : cache_seqlen) + i;   // the key's cache row
    long long base = b, at = n;   // the cache's (sequence or page, row)
    if (block_table != nullptr) {
        base = block_table[b * block_table_stride + n / page_size];
        at = n % page_size;
    }
    const int pos = n - (cache_leftpad != nullptr ? cache_leftpad[b] : 0);
    rotate_row(k + b * k_sb + i * k_ss + h * k_sh, k_cache + base * kc_sb + at * kc_ss + h * kc_sh, pos, cos, sin,
               cos_f32 != 0, sin_f32 != 0, rotary_dim, interleaved != 0, head_dim, lane);
    const T* v_row = v + b * v_sb + i * v_ss + h * v_sh;
    T* v_dst = v_cache + base * vc_sb + at * vc_ss + h * vc_sh;
    for (int col = lane; col < head_dim; col += 32) v_dst[col] = v_row[col];
}

}  // namespace cuflash
