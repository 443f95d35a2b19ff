// Tensor-core building blocks (sm_80 and newer): cp.async, ldmatrix and mma.sync m16n8k16 via inline PTX.
//
// Fragment layouts of mma.m16n8k16.row.col (g = lane / 4, t = lane % 4):
//   A 16x16 : a0 (row g,   k 2t..2t+1)  a1 (row g+8, k 2t..)  a2 (row g, k 2t+8..)  a3 (row g+8, k 2t+8..)
//   B 16x8  : b0 (k 2t..2t+1, col g)    b1 (k 2t+8.., col g)
//   C 16x8  : c0 c1 (row g, cols 2t, 2t+1)                c2 c3 (row g+8, cols 2t, 2t+1)
// Two adjacent C tiles of a 16 x 16 block are therefore exactly the A fragment of that block: the
// forward pass reuses its score accumulators, converted, as the A operand of P.V.
#pragma once
#include "common.cuh"

namespace cuflash {

// Shared-memory rows of HEAD_DIM elements are padded by one 16-byte chunk. HEAD_DIM is a multiple of
// 16, so a row spans an odd number of 16-byte chunks, and the 8 row addresses of one ldmatrix phase
// fall into 8 distinct 4-bank groups: no bank conflicts, for every head dim.
template <int HEAD_DIM> struct PaddedRow {
    static_assert(HEAD_DIM % 16 == 0, "tensor-core head dims are multiples of 16");
    static constexpr int kElems = HEAD_DIM + 8;
};

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16-byte asynchronous copy global -> shared; src_bytes = 0 writes zeros (rows or columns out of range).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
                 "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(smem)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(smem)));
}

template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}

// c += a . b with float32 accumulation.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1);
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                                  unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&c)[4], const unsigned (&a)[4],
                                                         unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Copy rows [row0, row0 + ROWS) of one head, HEAD_DIM columns, into a padded shared tile.
// Rows at or past `rows_valid` and columns at or past `head_dim` are zero-filled, so a kernel
// specialized for a larger head dim serves a smaller one. With `vec_ok` (head_dim, the row stride
// and the base pointer all 16-byte aligned) every chunk is one cp.async; otherwise element loads.
template <typename T, int ROWS, int HEAD_DIM, int NTHREADS>
__device__ __forceinline__ void load_tile_async(T* tile, const T* head_base, long long row_stride,
                                                int row0, int rows_valid, int head_dim, bool vec_ok,
                                                int tid) {
    constexpr int kChunks = HEAD_DIM / 8;
    constexpr int kRow = PaddedRow<HEAD_DIM>::kElems;
#pragma unroll
    for (int i = tid; i < ROWS * kChunks; i += NTHREADS) {
        const int r = i / kChunks;
        const int d0 = (i % kChunks) * 8;
        T* dst = tile + r * kRow + d0;
        const bool row_ok = row0 + r < rows_valid;
        const T* src = head_base + static_cast<long long>(row0 + r) * row_stride + d0;
        if (vec_ok) {
            const bool ok = row_ok && d0 < head_dim;
            cp_async_16(dst, ok ? src : head_base, ok ? 16 : 0);
        } else {
            uint4 packed;
            T* vals = reinterpret_cast<T*>(&packed);
#pragma unroll
            for (int e = 0; e < 8; ++e) vals[e] = (row_ok && d0 + e < head_dim) ? src[e] : from_float<T>(0.f);
            *reinterpret_cast<uint4*>(dst) = packed;
        }
    }
}

}  // namespace cuflash
