// Device helpers shared by every cuflash kernel.
//
// Layout conventions (all kernels):
//   q, out, dout, dq : (batch, seqlen_q, heads,    head_dim), last axis contiguous, other strides given
//   k, v, dk, dv     : (batch, seqlen_k, heads_kv, head_dim), same
//   lse, delta       : float32 (batch, heads, seqlen_q), contiguous; lse is the natural-log logsumexp
// Query head h reads kv head h / (heads / heads_kv).
// The causal mask is aligned to the bottom-right corner: query i sees key j when
// j <= i + (seqlen_k - seqlen_q).
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define CUFLASH_INF __int_as_float(0x7f800000)

namespace cuflash {

constexpr float kLog2e = 1.4426950408889634f;  // log2(e): scores are kept in base 2 inside kernels
constexpr float kLn2 = 0.6931471805599453f;    // ln(2): converts a base-2 logsumexp back to natural log

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
    return __bfloat162float(x);
}

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// Reduce over the 4 lanes of a quad (the lanes that share one accumulator row of an mma tile).
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// The offset to add to the base-2 running maximum before exponentiating: a row that has seen only
// masked keys has m_i = -inf, and exp2(-inf - (-inf)) would be NaN; use 0 so every p is exp2(-inf) = 0.
__device__ __forceinline__ float safe_max(float m) { return m == -CUFLASH_INF ? 0.f : m; }

// Number of key positions, from 0, that any of the query rows [row_begin, row_end) may see.
template <bool CAUSAL>
__device__ __forceinline__ int visible_key_end(int row_end, int seqlen_k, int causal_offset) {
    if (!CAUSAL) return seqlen_k;
    return max(0, min(seqlen_k, row_end + causal_offset));
}

__device__ __forceinline__ bool key_visible(bool causal, int row, int key, int seqlen_k,
                                            int causal_offset) {
    return key < seqlen_k && (!causal || key <= row + causal_offset);
}

}  // namespace cuflash
