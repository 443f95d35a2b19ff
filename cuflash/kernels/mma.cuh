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

// Shared-memory layouts of tiles whose rows hold HEAD_DIM elements, addressed by (row, 16-byte chunk).
// An ldmatrix phase reads one chunk from each of 8 consecutive rows; both layouts put those 8 chunks in
// 8 distinct 4-bank groups (no bank conflicts).
//
// PaddedRow: rows padded by one chunk. HEAD_DIM is a multiple of 16, so a row spans an odd number of
// chunks, which spreads the 8 rows, for every head dim. But every other row then starts 16 bytes into a
// 32-byte sector: a cp.async of such a row splits each global sector over two shared-memory sectors, so
// the tile loads move 1.5x the L2 sectors and 2.6x the shared wavefronts of an aligned layout (ncu
// source counters, bench/NOTES.md forward v7).
template <int HEAD_DIM> struct PaddedRow {
    static_assert(HEAD_DIM % 16 == 0, "tensor-core head dims are multiples of 16");
    static constexpr int kElems = HEAD_DIM + 8;
    static constexpr bool kSwizzled = false;
    __device__ static __forceinline__ int offset(int row, int chunk) { return row * kElems + chunk * 8; }
    // The shared address `chunks` chunks further along a row than `addr` (see SwizzledRow::advance).
    __device__ static __forceinline__ unsigned advance(unsigned addr, int chunks) { return addr + chunks * 16; }
};

// SwizzledRow: rows of exactly HEAD_DIM elements (128-byte aligned: HEAD_DIM is a multiple of 64), chunk
// c of row r stored at chunk c ^ (r % 8) of the same 128 bytes: FlashAttention-2's XOR swizzle. Aligned
// and conflict-free; the forward's tiles use it wherever HEAD_DIM allows (ForwardRow).
template <int HEAD_DIM> struct SwizzledRow {
    static_assert(HEAD_DIM % 64 == 0, "the swizzle permutes the 8 chunks of each 128 bytes of a row");
    static constexpr int kElems = HEAD_DIM;
    static constexpr bool kSwizzled = true;
    __device__ static __forceinline__ int offset(int row, int chunk) {
        return row * kElems + ((chunk ^ (row & 7)) << 3);
    }
    // The shared address of chunk c + chunks of a row, from `addr`, that of its chunk c, where c < 2 and
    // `chunks` is even (the row's base is 128-byte aligned): one XOR and one add of constants once the
    // k-loop is unrolled, so an ldmatrix loop keeps one address register per operand, as with padding.
    // (Written as offset(row, chunk), ptxas kept every chunk's swizzled offset live and spilled.)
    __device__ static __forceinline__ unsigned advance(unsigned addr, int chunks) {
        return (addr ^ ((chunks * 16) & 127)) + ((chunks * 16) & ~127);
    }
};

template <bool SWIZZLED, int HEAD_DIM> struct RowLayoutOf { using type = PaddedRow<HEAD_DIM>; };
template <int HEAD_DIM> struct RowLayoutOf<true, HEAD_DIM> { using type = SwizzledRow<HEAD_DIM>; };
// The forward's layout of its Q, K and V tiles (mirrored by _config.forward_row_elems).
template <int HEAD_DIM> using ForwardRow = typename RowLayoutOf<HEAD_DIM % 64 == 0, HEAD_DIM>::type;

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16-byte asynchronous copy global -> shared; src_bytes = 0 writes zeros (rows or columns out of range).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
                 "r"(src_bytes));
}
// 4-byte asynchronous copy (cp.async.ca: the only form below 16 bytes); src_bytes = 0 writes a zero.
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
                 "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Barrier `id` (1-15; 0 is __syncthreads) over the `threads` threads (whole warps) that name it.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
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
// The same from a shared-state-space address (smem_addr).
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem));
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

// Copy rows [row0, row0 + ROWS) of one head, HEAD_DIM columns, into a shared tile of layout Layout.
// Rows at or past `rows_valid` and columns at or past `head_dim` are zero-filled, so a kernel
// specialized for a larger head dim serves a smaller one. With `vec_ok` (head_dim, the row stride
// and the base pointer all 16-byte aligned) every chunk is one cp.async; otherwise element loads.
template <typename T, int ROWS, int HEAD_DIM, int NTHREADS, typename Layout = PaddedRow<HEAD_DIM>>
__device__ __forceinline__ void load_tile_async(T* tile, const T* head_base, long long row_stride,
                                                int row0, int rows_valid, int head_dim, bool vec_ok,
                                                int tid) {
    constexpr int kChunks = HEAD_DIM / 8;   // 16-byte chunks per row
    constexpr int kRow = Layout::kElems;
    if constexpr (NTHREADS % kChunks == 0) {
        // Each thread keeps one column chunk and steps down the rows kRowsPerPass at a time: one
        // 64-bit pointer add, one compare against a precomputed bound and one cp.async per chunk. The
        // index arithmetic of the general loop below cost ~25 instructions per chunk in the SASS, and
        // an address computed from each chunk's row index ~12, a third of the forward's instructions
        // at head_dim 128 (bench/NOTES.md, forward v3 and v5).
        constexpr int kRowsPerPass = NTHREADS / kChunks;
        const int r0 = tid / kChunks, d0 = (tid % kChunks) * 8;
        if (vec_ok) {
            const int rows_left = d0 < head_dim ? rows_valid - row0 - r0 : 0;
            const T* src = head_base + static_cast<long long>(row0 + r0) * row_stride + d0;
            const long long pass_stride = kRowsPerPass * row_stride;
            // Padded tiles keep the plain row * kRow arithmetic here and below: Layout::offset, equal in
            // value, changed the SASS of 112 of the 128 backward kernels (longer loaders in some).
            T* dst = tile + r0 * kRow + d0;
            if constexpr (Layout::kSwizzled) dst = tile + Layout::offset(r0, d0 / 8);
#pragma unroll
            for (int it = 0; it < (ROWS + kRowsPerPass - 1) / kRowsPerPass; ++it) {
                if (ROWS % kRowsPerPass != 0 && r0 + it * kRowsPerPass >= ROWS) break;
                const bool ok = it * kRowsPerPass < rows_left;
                // swizzled: a pass of a multiple of 8 rows keeps the thread's chunk (r0 % 8 is constant)
                T* chunk_dst = dst + it * kRowsPerPass * kRow;
                if constexpr (Layout::kSwizzled && kRowsPerPass % 8 != 0)
                    chunk_dst = tile + Layout::offset(r0 + it * kRowsPerPass, d0 / 8);
                cp_async_16(chunk_dst, ok ? src : head_base, ok ? 16 : 0);
                src += pass_stride;
            }
            return;
        }
    }
    for (int i = tid; i < ROWS * kChunks; i += NTHREADS) {
        const int r = i / kChunks;
        const int d0 = (i % kChunks) * 8;
        T* dst = Layout::kSwizzled ? tile + Layout::offset(r, d0 / 8) : tile + r * kRow + d0;
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

// Store rows [0, ROWS) of a shared tile of layout Layout to rows row0.. of one head in global memory, as
// 16-byte chunks, consecutive threads (`thread` of NTHREADS) on consecutive chunks of a row; rows at or
// past rows_valid and columns at or past head_dim are not written. The epilogue of every kernel whose
// accumulators are staged in shared memory: a thread's accumulator holds pairs of adjacent columns,
// and storing them straight from registers takes 8x the store instructions. `tile` is the tile's row 0,
// a multiple of 8 rows into a swizzled tile.
template <typename T, int ROWS, int HEAD_DIM, int NTHREADS, typename Layout = PaddedRow<HEAD_DIM>>
__device__ __forceinline__ void store_rows(T* head_base, long long row_stride, int row0, int rows_valid,
                                           int head_dim, const T* tile, int thread) {
    constexpr int kChunks = HEAD_DIM / 8;
    constexpr int kRow = Layout::kElems;
#pragma unroll 1   // unrolled, this loop made ptxas spill in the forward at head_dim 128
    for (int i = thread; i < ROWS * kChunks; i += NTHREADS) {
        const int r = i / kChunks, col = (i % kChunks) * 8;
        if (row0 + r >= rows_valid || col >= head_dim) continue;
        const T* src = Layout::kSwizzled ? tile + Layout::offset(r, col / 8) : tile + r * kRow + col;
        T* dst = head_base + (row0 + r) * row_stride + col;
        if (col + 8 <= head_dim && reinterpret_cast<unsigned long long>(dst) % 16 == 0) {
            *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
        } else {
            for (int e = 0; e < 8 && col + e < head_dim; ++e) dst[e] = src[e];
        }
    }
}

// The same two copies for tiles whose rows are not one stride apart (the KV-cache forward's packed query
// heads): row r of the tile is the row at row_src(r), null for a row past the data (zero-filled on load,
// not stored); `any_row` is any valid global address (the source of the zero-byte copies). A tile loaded
// once per block, so the general loop of load_tile_async serves.
template <typename T, int ROWS, int HEAD_DIM, int NTHREADS, typename Layout, typename RowSrc>
__device__ __forceinline__ void load_rows_async(T* tile, RowSrc row_src, const T* any_row, int head_dim,
                                                bool vec_ok, int tid) {
    constexpr int kChunks = HEAD_DIM / 8;
    for (int i = tid; i < ROWS * kChunks; i += NTHREADS) {
        const int r = i / kChunks, d0 = (i % kChunks) * 8;
        T* dst = tile + Layout::offset(r, d0 / 8);
        const T* src = row_src(r);
        if (vec_ok) {
            const bool ok = src != nullptr && d0 < head_dim;
            cp_async_16(dst, ok ? src + d0 : any_row, ok ? 16 : 0);
        } else {
            uint4 packed;
            T* vals = reinterpret_cast<T*>(&packed);
#pragma unroll
            for (int e = 0; e < 8; ++e) vals[e] = (src != nullptr && d0 + e < head_dim) ? src[d0 + e] : from_float<T>(0.f);
            *reinterpret_cast<uint4*>(dst) = packed;
        }
    }
}
// Rows of HEAD_DIM bytes (float8 e4m3) into a staging tile [ROWS][HEAD_DIM] by 16-byte cp.async: row r from
// row_src(r) (null: zeros), its bytes from head_dim on as zeros. head_dim is a multiple of 16 and the rows 16-byte
// aligned (the plan refuses float8 caches otherwise); any_row is a readable address for the copies of zeros.
template <int ROWS, int HEAD_DIM, int NTHREADS, typename RowSrc>
__device__ __forceinline__ void load_byte_rows_async(unsigned char* staged, RowSrc row_src, const void* any_row,
                                                     int head_dim, int tid) {
    constexpr int kChunks = HEAD_DIM / 16, kCopies = ROWS * kChunks;
#pragma unroll
    for (int it = 0; it < (kCopies + NTHREADS - 1) / NTHREADS; ++it) {
        const int i = tid + it * NTHREADS;
        if (kCopies % NTHREADS != 0 && i >= kCopies) break;
        const int r = i / kChunks, c = 16 * (i % kChunks);
        const unsigned char* src = row_src(r);
        const bool ok = src != nullptr && c < head_dim;
        cp_async_16(staged + r * HEAD_DIM + c, ok ? static_cast<const void*>(src + c) : any_row, ok ? 16 : 0);
    }
}

// Rows row0.. of a head's HEAD_DIM-byte rows (float8 e4m3, row_stride bytes apart from head_base) into a staging
// tile [ROWS][HEAD_DIM], as load_byte_rows_async, rows from rows_valid on as zeros: each thread keeps one column
// chunk and steps down the rows (one pointer add per copy, as load_tile_async).
template <int ROWS, int HEAD_DIM, int NTHREADS>
__device__ __forceinline__ void load_byte_tile_async(unsigned char* staged, const unsigned char* head_base,
                                                     long long row_stride, int row0, int rows_valid, int head_dim,
                                                     int tid) {
    constexpr int kChunks = HEAD_DIM / 16, kRowsPerPass = NTHREADS / kChunks;
    static_assert(NTHREADS % kChunks == 0 && ROWS % kRowsPerPass == 0, "whole passes of whole rows");
    const int r0 = tid / kChunks, c = 16 * (tid % kChunks);
    const int rows_left = c < head_dim ? rows_valid - row0 - r0 : 0;
    const unsigned char* src = head_base + (row0 + r0) * row_stride + c;
#pragma unroll
    for (int it = 0; it < ROWS / kRowsPerPass; ++it) {
        const bool ok = it * kRowsPerPass < rows_left;
        cp_async_16(staged + (r0 + it * kRowsPerPass) * HEAD_DIM + c, ok ? src : head_base, ok ? 16 : 0);
        src += kRowsPerPass * row_stride;
    }
}

// Two e4m3 values (the low byte first) as a float16 pair (the low half first), exactly.
__device__ __forceinline__ unsigned e4m3x2_to_half2(unsigned pair) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair), __NV_E4M3);
    return static_cast<unsigned>(h.x) | static_cast<unsigned>(h.y) << 16;
}

// A staged float8 e4m3 tile [ROWS][HEAD_DIM] (bytes) into a float16 tile of Layout's rows, exactly: each 16
// staged bytes become two 16-byte chunks of the tile.
template <int ROWS, int HEAD_DIM, int NTHREADS, typename Layout>
__device__ __forceinline__ void convert_e4m3_tile(__half* tile, const unsigned char* staged, int tid) {
    constexpr int kChunks = HEAD_DIM / 16, kConversions = ROWS * kChunks;
    // not unrolled: the caller holds its accumulators across the conversion (unrolled, ptxas spilled at head_dim 256)
#pragma unroll 1
    for (int it = 0; it < (kConversions + NTHREADS - 1) / NTHREADS; ++it) {
        const int i = tid + it * NTHREADS;
        if (kConversions % NTHREADS != 0 && i >= kConversions) break;
        const int r = i / kChunks, c = i % kChunks;
        const uint4 bytes = *reinterpret_cast<const uint4*>(staged + r * HEAD_DIM + 16 * c);
        const unsigned words[4] = {bytes.x, bytes.y, bytes.z, bytes.w};
        unsigned halves[8];
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            halves[2 * w] = e4m3x2_to_half2(words[w] & 0xffffu);
            halves[2 * w + 1] = e4m3x2_to_half2(words[w] >> 16);
        }
        *reinterpret_cast<uint4*>(tile + Layout::offset(r, 2 * c)) =
            make_uint4(halves[0], halves[1], halves[2], halves[3]);
        *reinterpret_cast<uint4*>(tile + Layout::offset(r, 2 * c + 1)) =
            make_uint4(halves[4], halves[5], halves[6], halves[7]);
    }
}
template <typename T, int ROWS, int HEAD_DIM, int NTHREADS, typename Layout, typename RowDst>
__device__ __forceinline__ void store_rows_to(RowDst row_dst, int head_dim, const T* tile, int thread) {
    constexpr int kChunks = HEAD_DIM / 8;
#pragma unroll 1
    for (int i = thread; i < ROWS * kChunks; i += NTHREADS) {
        const int r = i / kChunks, col = (i % kChunks) * 8;
        T* row = row_dst(r);
        if (row == nullptr || col >= head_dim) continue;
        const T* src = tile + Layout::offset(r, col / 8);
        T* dst = row + col;
        if (col + 8 <= head_dim && reinterpret_cast<unsigned long long>(dst) % 16 == 0) {
            *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
        } else {
            for (int e = 0; e < 8 && col + e < head_dim; ++e) dst[e] = src[e];
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Warp-level products on padded shared tiles (rows of HEAD_DIM elements, kRow apart).

// acc[NB][4] += A . B^T: A is 16 rows of a tile (k = head dim), B is NB * 8 rows of a tile (k = head dim).
// Used for S = Q K^T and dP = dO V^T (and their transposes, swapping the tiles).
template <typename T, int HEAD_DIM, int NB>
__device__ __forceinline__ void warp_gemm_rows_rows(float (&acc)[NB][4], const T* a_rows, const T* b_rows,
                                                    int lane) {
    constexpr int kRow = PaddedRow<HEAD_DIM>::kElems;
    static_assert(NB % 2 == 0, "B is read 16 rows per ldmatrix.x4");
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
        unsigned a[4];
        ldmatrix_x4(a, a_rows + ((lane % 8) + 8 * ((lane / 8) % 2)) * kRow + ks * 16 + 8 * (lane / 16));
#pragma unroll
        for (int nb = 0; nb < NB; nb += 2) {
            unsigned b[4];
            ldmatrix_x4(b, b_rows + (nb * 8 + (lane % 8) + 8 * (lane / 16)) * kRow + ks * 16 + 8 * ((lane / 8) % 2));
            mma_16816<T>(acc[nb], a, b[0], b[1]);
            mma_16816<T>(acc[nb + 1], a, b[2], b[3]);
        }
    }
}

// acc[NCOLS / 8][4] += A . B: A is KK k16-fragments in registers (an accumulator packed by
// pack_a_fragments, or loaded by load_a_transposed), B is KK * 16 rows of a padded HEAD_DIM tile, read
// transposed (k = row, n = column), NCOLS columns from b_rows on (all of them by default).
// Used for P.V, dV += P^T dO, dK += dS^T Q and dQ += dS K.
template <typename T, int HEAD_DIM, int KK, int NCOLS = HEAD_DIM>
__device__ __forceinline__ void warp_gemm_frag_rows(float (&acc)[NCOLS / 8][4], const unsigned (&a)[KK][4],
                                                    const T* b_rows, int lane) {
    constexpr int kRow = PaddedRow<HEAD_DIM>::kElems;
    static_assert(NCOLS % 16 == 0 && NCOLS <= HEAD_DIM, "B columns are read 16 per ldmatrix.x4");
#pragma unroll
    for (int kk = 0; kk < KK; ++kk) {
#pragma unroll
        for (int db = 0; db < NCOLS / 8; db += 2) {
            unsigned b[4];
            ldmatrix_x4_trans(b, b_rows + (kk * 16 + (lane % 8) + 8 * ((lane / 8) % 2)) * kRow + db * 8 + 8 * (lane / 16));
            mma_16816<T>(acc[db], a[kk], b[0], b[1]);
            mma_16816<T>(acc[db + 1], a[kk], b[2], b[3]);
        }
    }
}

// The A fragment of a 16 x 16 block of M^T, where M is stored row-major in shared memory (rows of
// row_elems elements) and m points at the block's first element: M's rows are the fragment's k.
template <typename T>
__device__ __forceinline__ void load_a_transposed(unsigned (&a)[4], const T* m, int row_elems, int lane) {
    ldmatrix_x4_trans(a, m + ((lane % 8) + 8 * (lane / 16)) * row_elems + 8 * ((lane / 8) % 2));
}

// Fragments of one 16 x 16 block of a row-major shared tile (rows of row_elems elements, p at the
// block's first element), for the block-tiled kernels:
//   load_a       : A, the block's rows are the fragment's m, its columns k
//   load_b       : two n8 B fragments (b[0..1] columns n 0..7, b[2..3] n 8..15), the block's rows are n
//   load_b_trans : the same, the block's rows are k (ldmatrix.trans)
// (load_a_transposed above: A of the block's transpose, the block's rows are k.)
template <typename T>
__device__ __forceinline__ void load_a(unsigned (&a)[4], const T* p, int row_elems, int lane) {
    ldmatrix_x4(a, p + ((lane % 8) + 8 * ((lane / 8) % 2)) * row_elems + 8 * (lane / 16));
}
template <typename T>
__device__ __forceinline__ void load_b(unsigned (&b)[4], const T* p, int row_elems, int lane) {
    ldmatrix_x4(b, p + ((lane % 8) + 8 * (lane / 16)) * row_elems + 8 * ((lane / 8) % 2));
}
template <typename T>
__device__ __forceinline__ void load_b_trans(unsigned (&b)[4], const T* p, int row_elems, int lane) {
    ldmatrix_x4_trans(b, p + ((lane % 8) + 8 * ((lane / 8) % 2)) * row_elems + 8 * (lane / 16));
}

// acc[MA][NB][4] += A . B over KSTEPS k16 steps, a warp tile of MA 16-row atoms by NB 8-column tiles.
// load_a_frag(a, ma, ks) and load_b_frag(b, nb, ks) fetch the fragments (load_b_frag: the two n8 tiles
// nb, nb + 1); each A fragment feeds NB mma instructions and each B fragment 2 * MA.
template <typename T, int MA, int NB, int KSTEPS, typename LoadA, typename LoadB>
__device__ __forceinline__ void warp_mma(float (&acc)[MA][NB][4], LoadA load_a_frag, LoadB load_b_frag) {
    static_assert(NB % 2 == 0, "B is read 16 columns per ldmatrix.x4");
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
        unsigned a[MA][4];
#pragma unroll
        for (int ma = 0; ma < MA; ++ma) load_a_frag(a[ma], ma, ks);
#pragma unroll
        for (int nb = 0; nb < NB; nb += 2) {
            unsigned b[4];
            load_b_frag(b, nb, ks);
#pragma unroll
            for (int ma = 0; ma < MA; ++ma) {
                mma_16816<T>(acc[ma][nb], a[ma], b[0], b[1]);
                mma_16816<T>(acc[ma][nb + 1], a[ma], b[2], b[3]);
            }
        }
    }
}

// Two adjacent 16 x 8 accumulator tiles are one 16 x 16 A fragment (layouts at the top of this file).
template <typename T, int NB>
__device__ __forceinline__ void pack_a_fragments(unsigned (&a)[NB / 2][4], const float (&c)[NB][4]) {
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
        a[nb / 2][(nb % 2) * 2 + 0] = pack2<T>(c[nb][0], c[nb][1]);
        a[nb / 2][(nb % 2) * 2 + 1] = pack2<T>(c[nb][2], c[nb][3]);
    }
}

template <int N> __device__ __forceinline__ void zero(float (&c)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.f;
}
template <int M, int N> __device__ __forceinline__ void zero(float (&c)[M][N][4]) {
#pragma unroll
    for (int i = 0; i < M; ++i) zero(c[i]);
}

}  // namespace cuflash
