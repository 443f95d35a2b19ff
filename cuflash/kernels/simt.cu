// Exact float32 kernels on the CUDA cores: the float32 forward, and the backward for every dtype.
//
// Every kernel stages its tiles in shared memory as float32, rows padded by one word so that threads
// of a warp reading one column of different rows hit different banks. All arithmetic is float32 FMA.
//
// Backward (FlashAttention-2 algorithm, no seqlen_q x seqlen_k buffer):
//   delta = rowsum(dout * out)                                   bwd_preprocess
//   P  = exp(scale * Q K^T - lse),  dP = dout V^T,  dS = P * (dP - delta)
//   dV = P^T dout,  dK = scale * dS^T Q   (per key tile, walking query tiles and grouped heads)  bwd_dkdv
//   dQ = scale * dS K                     (per query tile, walking key tiles)                    bwd_dq
// Each output element is written by exactly one thread after a fixed-order sum: the backward is
// bitwise reproducible.
#include "common.cuh"

namespace cuflash {

constexpr int kSimtThreads = 256;

// Shared-memory plan of the SIMT kernels; its byte count is checked against the launch's SMEM_BYTES.
template <int HEAD_DIM, int BLOCK_M, int BLOCK_N> struct SimtTiles {
    static constexpr int kRow = HEAD_DIM + 1;   // padded float32 row of a Q/K/V/dO tile
    static constexpr int kScoreRow = BLOCK_N + 1;
    static constexpr int kFwdFloats = (BLOCK_M + 2 * BLOCK_N) * kRow + BLOCK_M * kScoreRow + 3 * BLOCK_M;
    static constexpr int kBwdFloats = (2 * BLOCK_M + 2 * BLOCK_N) * kRow + 2 * BLOCK_M * kScoreRow + 2 * BLOCK_M;

    // The backward's kBwdFloats, one layout for the dK/dV and the dQ kernels.
    struct Bwd {
        float* q;       // [BLOCK_M][kRow]
        float* dout;    // [BLOCK_M][kRow]
        float* k;       // [BLOCK_N][kRow]
        float* v;       // [BLOCK_N][kRow]
        float* p;       // [BLOCK_M][kScoreRow]
        float* ds;      // [BLOCK_M][kScoreRow]
        float* lse2;    // [BLOCK_M] the rows' lse, base 2
        float* delta;   // [BLOCK_M]
    };
    static __device__ __forceinline__ Bwd bwd_tiles(unsigned char* smem) {
        float* q = reinterpret_cast<float*>(smem);
        float* dout = q + BLOCK_M * kRow;
        float* k = dout + BLOCK_M * kRow;
        float* v = k + BLOCK_N * kRow;
        float* p = v + BLOCK_N * kRow;
        float* ds = p + BLOCK_M * kScoreRow;
        float* lse2 = ds + BLOCK_M * kScoreRow;
        return {q, dout, k, v, p, ds, lse2, lse2 + BLOCK_M};
    }
};

// rows [row0, row0 + ROWS) of one head -> float32 tile; out-of-range rows and columns read as 0.
template <typename T, int ROWS, int HEAD_DIM>
__device__ __forceinline__ void load_rows_f32(float* tile, const T* head_base, long long row_stride, int row0,
                                              int rows_valid, int head_dim) {
    constexpr int kRow = HEAD_DIM + 1;
    for (int i = threadIdx.x; i < ROWS * HEAD_DIM; i += kSimtThreads) {
        const int r = i / HEAD_DIM, e = i % HEAD_DIM;
        const bool ok = row0 + r < rows_valid && e < head_dim;
        tile[r * kRow + e] = ok ? to_float(head_base[static_cast<long long>(row0 + r) * row_stride + e]) : 0.f;
    }
}

template <int HEAD_DIM>
__device__ __forceinline__ float dot_rows(const float* a, const float* b) {
    float s = 0.f;
#pragma unroll 8
    for (int e = 0; e < HEAD_DIM; ++e) s = fmaf(a[e], b[e], s);
    return s;
}

// ---------------------------------------------------------------------------------------------------
// Forward, float32. One block: BLOCK_M query rows of one (batch, head). S and P of the current key tile
// live in shared memory; m_i and l_i per row in shared memory; acc in registers, each thread owning
// one row and every kThreadsPerRow-th column of it. A null lse stores none.
template <typename T, int HEAD_DIM, int MASK, int MODS, int BLOCK_M, int BLOCK_N, int SMEM_BYTES, bool VARLEN>
__global__ void __launch_bounds__(kSimtThreads, 1)
fwd_simt(CUFLASH_PARAMS(CUFLASH_FWD_FIELDS)) {
    using Tiles = SimtTiles<HEAD_DIM, BLOCK_M, BLOCK_N>;
    static_assert(Tiles::kFwdFloats * 4 == SMEM_BYTES, "launch shared memory must match the tile plan");
    constexpr int kRow = Tiles::kRow, kScoreRow = Tiles::kScoreRow;
    constexpr int kThreadsPerRow = kSimtThreads / BLOCK_M;
    constexpr int kColsPerThread = HEAD_DIM / kThreadsPerRow;
    static_assert(kSimtThreads % BLOCK_M == 0 && HEAD_DIM % kThreadsPerRow == 0, "acc ownership must tile");
    static_assert((BLOCK_M * BLOCK_N) % kSimtThreads == 0 && kSimtThreads % BLOCK_N == 0, "score ownership must tile");

    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* q_s = reinterpret_cast<float*>(smem_raw);   // [BLOCK_M][kRow]
    float* k_s = q_s + BLOCK_M * kRow;                 // [BLOCK_N][kRow]
    float* v_s = k_s + BLOCK_N * kRow;                 // [BLOCK_N][kRow]
    float* p_s = v_s + BLOCK_N * kRow;                 // [BLOCK_M][kScoreRow]: scores, then P
    float* m_s = p_s + BLOCK_M * kScoreRow;            // [BLOCK_M] m_i (base 2)
    float* l_s = m_s + BLOCK_M;                        // [BLOCK_M] l_i
    float* alpha_s = l_s + BLOCK_M;                    // [BLOCK_M] rescale factor of this tile

    const QueryBlock blk(BLOCK_M, batch, heads, group, seqlen_q, section_heads);
    const int bh = blk.bh, b = blk.b, h = blk.h, h_kv = blk.h_kv, m0 = blk.m0;
    const Sequence<VARLEN> seq(cu_seqlens_q, cu_seqlens_k, b, batch, seqlen_q, seqlen_k, diagonal);
    if (VARLEN && m0 >= seq.seqlen_q) return;
    const Window<MASK> window{seq.diagonal, window_left, window_right};
    const ScoreMod<MODS, true> mod(scale_log2, softcap_in, softcap_out, alibi_slopes, alibi_batch_stride, b, h);
    const Dropout<(MODS & kModDropout) != 0> dropout(dropout_seed, dropout_offset, dropout_threshold, bh);
    const T* k_head = k + b * k_sb + seq.k_start * k_ss + h_kv * k_sh;
    const T* v_head = v + b * v_sb + seq.k_start * v_ss + h_kv * v_sh;
    const int n_begin = window.key_begin(m0) / BLOCK_N * BLOCK_N;
    const int n_end = window.key_end(m0 + BLOCK_M, seq.seqlen_k);
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

    load_rows_f32<T, BLOCK_M, HEAD_DIM>(q_s, q + b * q_sb + seq.q_start * q_ss + h * q_sh, q_ss, m0, seq.seqlen_q,
                                        head_dim);
    for (int r = tid; r < BLOCK_M; r += kSimtThreads) { m_s[r] = -CUFLASH_INF; l_s[r] = 0.f; }
    const int acc_row = tid / kThreadsPerRow, acc_col0 = tid % kThreadsPerRow;
    float acc[kColsPerThread];
#pragma unroll
    for (int i = 0; i < kColsPerThread; ++i) acc[i] = 0.f;

    for (int n0 = n_begin; n0 < n_end; n0 += BLOCK_N) {
        __syncthreads();   // previous tile's K, V and P are no longer read
        load_rows_f32<T, BLOCK_N, HEAD_DIM>(k_s, k_head, k_ss, n0, seq.seqlen_k, head_dim);
        load_rows_f32<T, BLOCK_N, HEAD_DIM>(v_s, v_head, v_ss, n0, seq.seqlen_k, head_dim);
        __syncthreads();
        for (int i = tid; i < BLOCK_M * BLOCK_N; i += kSimtThreads) {
            const int r = i / BLOCK_N, c = i % BLOCK_N;
            const float x = mod.score(dot_rows<HEAD_DIM>(q_s + r * kRow, k_s + c * kRow), m0 + r, n0 + c, seq.diagonal);
            p_s[r * kScoreRow + c] = window.sees(m0 + r, n0 + c, seq.seqlen_k) ? x : -CUFLASH_INF;
        }
        __syncthreads();
        for (int r = warp; r < BLOCK_M; r += kSimtThreads / 32) {
            float mx = m_s[r];
            for (int c = lane; c < BLOCK_N; c += 32) mx = fmaxf(mx, p_s[r * kScoreRow + c]);
            mx = warp_max(mx);
            const float base = safe_max(mx);
            float sum = 0.f;   // of every P; P.V takes the kept ones
            for (int c = lane; c < BLOCK_N; c += 32) {
                const float p = exp2f(p_s[r * kScoreRow + c] - base);
                p_s[r * kScoreRow + c] = dropout.keeps(m0 + r, n0 + c) ? p : 0.f;
                sum += p;
            }
            sum = warp_sum(sum);
            if (lane == 0) {
                const float alpha = exp2f(m_s[r] - base);
                alpha_s[r] = alpha;
                l_s[r] = l_s[r] * alpha + sum;
                m_s[r] = mx;
            }
        }
        __syncthreads();
        const float alpha = alpha_s[acc_row];
#pragma unroll
        for (int i = 0; i < kColsPerThread; ++i) acc[i] *= alpha;
        // Key loop outside, columns unrolled inside: each P value is read once, and the unrolled body
        // stays kColsPerThread FMAs long (a fully unrolled nest took NVRTC seconds per kernel).
#pragma unroll 2
        for (int c = 0; c < BLOCK_N; ++c) {
            const float p = p_s[acc_row * kScoreRow + c];
#pragma unroll
            for (int i = 0; i < kColsPerThread; ++i) acc[i] = fmaf(p, v_s[c * kRow + acc_col0 + i * kThreadsPerRow], acc[i]);
        }
    }
    __syncthreads();

    const int row = m0 + acc_row;
    if (row < seq.seqlen_q) {
        float l = l_s[acc_row], m = m_s[acc_row], acc_factor = 1.f;
        if constexpr ((MODS & kModSinks) != 0) {   // the sink joins the denominator: rescale to max(m, sink)
            const float sink2 = sinks[h] * kLog2e;
            const float m_new = safe_max(fmaxf(m, sink2));
            acc_factor = exp2f(m - m_new);
            l = l * acc_factor + exp2f(sink2 - m_new);
            m = m_new;
        }
        const float inv_l = l == 0.f ? 0.f : ((MODS & kModDropout) != 0 ? acc_factor * dropout_scale : acc_factor) / l;
        T* out_row = out + b * o_sb + seq.q_start * o_ss + h * o_sh + row * o_ss;
#pragma unroll
        for (int i = 0; i < kColsPerThread; ++i) {
            const int e = acc_col0 + i * kThreadsPerRow;
            if (e < head_dim) out_row[e] = from_float<T>(acc[i] * inv_l);
        }
        if (lse != nullptr && acc_col0 == 0)
            lse[seq.stats(b, heads, h) + row] = l == 0.f ? -CUFLASH_INF : (m + log2f(l)) * kLn2;
    }
}

// ---------------------------------------------------------------------------------------------------
// delta[b, h, i] = sum_e dout[b, i, h, e] * out[b, i, h, e], float32. `lanes` lanes (a power of two up to
// 32, _config.preprocess_lanes: about one per 16 bytes of a row) share a row; consecutive lane groups
// take consecutive rows. With vec_ok (head_dim, strides and pointers 16-byte aligned) a lane reads the
// 16-byte chunks lane, lane + lanes, ... of its row, else single elements. (One warp per row with one
// element per lane read a head_dim 64 row as 128-byte pieces: 2.3x FlashAttention-2's time,
// bench/NOTES.md backward v7.)
template <typename T>
__global__ void __launch_bounds__(kSimtThreads)
bwd_preprocess(const T* __restrict__ dout, const T* __restrict__ out, float* __restrict__ delta,
               long long do_sb, long long do_ss, long long do_sh, long long o_sb, long long o_ss, long long o_sh,
               int batch, int heads, int seqlen_q, int head_dim, int lanes, int vec_ok) {
    constexpr int kVec = 16 / sizeof(T);   // elements per 16-byte chunk
    const long long row_id = (static_cast<long long>(blockIdx.x) * kSimtThreads + threadIdx.x) / lanes;
    const int lane = threadIdx.x % lanes;
    const long long rows = static_cast<long long>(batch) * heads * seqlen_q;
    float s = 0.f;
    if (row_id < rows) {   // no early exit: every lane of the warp takes part in the shuffles below
        const int i = row_id % seqlen_q;
        const int bh = row_id / seqlen_q;
        const int b = bh / heads, h = bh % heads;
        const T* dout_row = dout + b * do_sb + h * do_sh + i * do_ss;
        const T* out_row = out + b * o_sb + h * o_sh + i * o_ss;
        if (vec_ok) {
            for (int e0 = lane * kVec; e0 < head_dim; e0 += lanes * kVec) {
                const uint4 x = *reinterpret_cast<const uint4*>(dout_row + e0);
                const uint4 y = *reinterpret_cast<const uint4*>(out_row + e0);
                const T* xs = reinterpret_cast<const T*>(&x);
                const T* ys = reinterpret_cast<const T*>(&y);
#pragma unroll
                for (int e = 0; e < kVec; ++e) s = fmaf(to_float(xs[e]), to_float(ys[e]), s);
            }
        } else {
            for (int e = lane; e < head_dim; e += lanes) s = fmaf(to_float(dout_row[e]), to_float(out_row[e]), s);
        }
    }
    for (int offset = lanes / 2; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
    if (lane == 0 && row_id < rows) delta[row_id] = s;
}

// The shared step of both backward kernels: for the staged query tile (rows m0..) and key tile (n0..)
// write P and dS to shared memory. Invisible pairs (mask, rows or keys out of range) get P = 0, and so
// do dropped ones (dV reads P; dS is computed from the undropped P).
template <int HEAD_DIM, int MASK, int MODS, int BLOCK_M, int BLOCK_N>
__device__ __forceinline__ void recompute_p_ds(const float* q_s, const float* do_s, const float* k_s,
                                               const float* v_s, const float* lse2_s, const float* delta_s,
                                               float* p_s, float* ds_s, const Window<MASK>& window,
                                               const ScoreMod<MODS, true>& mod,
                                               const Dropout<(MODS & kModDropout) != 0>& dropout,
                                               float dropout_scale, int m0, int n0, int seqlen_q, int seqlen_k) {
    using Tiles = SimtTiles<HEAD_DIM, BLOCK_M, BLOCK_N>;
    constexpr int kRow = Tiles::kRow, kScoreRow = Tiles::kScoreRow;
    for (int i = threadIdx.x; i < BLOCK_M * BLOCK_N; i += kSimtThreads) {
        const int r = i / BLOCK_N, c = i % BLOCK_N;
        const bool visible = m0 + r < seqlen_q && window.sees(m0 + r, n0 + c, seqlen_k);
        float p = 0.f, ds = 0.f;
        if (visible) {
            const float x = dot_rows<HEAD_DIM>(q_s + r * kRow, k_s + c * kRow);
            p = exp2f(mod.score(x, m0 + r, n0 + c, window.diagonal) - lse2_s[r]);
            // under dropout dP reaches a kept P scaled by dropout_scale and a dropped one not at all;
            // dV takes the kept P (unscaled: its epilogue scales)
            const float dp = dot_rows<HEAD_DIM>(do_s + r * kRow, v_s + c * kRow);
            if constexpr ((MODS & kModDropout) != 0) {
                const bool kept = dropout.keeps(m0 + r, n0 + c);
                ds = p * ((kept ? dp * dropout_scale : 0.f) - delta_s[r]);
                if (!kept) p = 0.f;
            } else {
                ds = p * (dp - delta_s[r]);
            }
            if constexpr (ScoreMod<MODS>::kSoftcap) {   // through the softcap: d tanh = 1 - tanh^2
                const float t = mod.tanh(x * mod.softcap_in);
                ds *= 1.f - t * t;
            }
        }
        p_s[r * kScoreRow + c] = p;
        ds_s[r * kScoreRow + c] = ds;
    }
}

// Stage lse (converted to base 2) and delta of rows [m0, m0 + BLOCK_M) of one (batch, head).
template <int BLOCK_M>
__device__ __forceinline__ void load_row_stats(float* lse2_s, float* delta_s, const float* lse_bh,
                                               const float* delta_bh, int m0, int seqlen_q) {
    for (int r = threadIdx.x; r < BLOCK_M; r += kSimtThreads) {
        const bool ok = m0 + r < seqlen_q;
        lse2_s[r] = ok ? lse_bh[m0 + r] * kLog2e : 0.f;
        delta_s[r] = ok ? delta_bh[m0 + r] : 0.f;
    }
}

// dK, dV: one block per (batch, kv head, BLOCK_N keys). It walks every query head of the group and
// every query tile that can see its keys, accumulating in registers (thread: one key row, every
// kThreadsPerRow-th column). dk and dv share strides (both allocated by cuflash).
template <typename T, int HEAD_DIM, int MASK, int MODS, int BLOCK_M, int BLOCK_N, int SMEM_BYTES, bool VARLEN>
__global__ void __launch_bounds__(kSimtThreads, 1) bwd_dkdv_simt(CUFLASH_PARAMS(CUFLASH_BWD_FIELDS)) {
    using Tiles = SimtTiles<HEAD_DIM, BLOCK_M, BLOCK_N>;
    static_assert(Tiles::kBwdFloats * 4 == SMEM_BYTES, "launch shared memory must match the tile plan");
    constexpr int kRow = Tiles::kRow, kScoreRow = Tiles::kScoreRow;
    constexpr int kThreadsPerRow = kSimtThreads / BLOCK_N;
    constexpr int kColsPerThread = HEAD_DIM / kThreadsPerRow;
    static_assert(kSimtThreads % BLOCK_N == 0 && HEAD_DIM % kThreadsPerRow == 0, "dK/dV ownership must tile");

    extern __shared__ __align__(16) unsigned char smem_raw[];
    const auto [q_s, do_s, k_s, v_s, p_s, ds_s, lse2_s, delta_s] = Tiles::bwd_tiles(smem_raw);

    const KeyBlock blk(BLOCK_N, heads / group, seqlen_k, 0, 0);   // the banded grid
    const int b = blk.b, h_kv = blk.h_kv, n0 = blk.n0;
    const Sequence<VARLEN> seq(cu_seqlens_q, cu_seqlens_k, b, batch, seqlen_q, seqlen_k, diagonal);
    if (VARLEN && n0 >= seq.seqlen_k) return;
    const Window<MASK> window{seq.diagonal, window_left, window_right};
    // the query tiles whose rows see some key of the block
    const int m_begin = window.row_begin(n0) / BLOCK_M * BLOCK_M;
    const int m_end = window.row_end(n0 + BLOCK_N, seq.seqlen_q);

    load_rows_f32<T, BLOCK_N, HEAD_DIM>(k_s, k + b * k_sb + seq.k_start * k_ss + h_kv * k_sh, k_ss, n0, seq.seqlen_k,
                                        head_dim);
    load_rows_f32<T, BLOCK_N, HEAD_DIM>(v_s, v + b * v_sb + seq.k_start * v_ss + h_kv * v_sh, v_ss, n0, seq.seqlen_k,
                                        head_dim);
    const int key_row = threadIdx.x / kThreadsPerRow, col0 = threadIdx.x % kThreadsPerRow;
    float dk_acc[kColsPerThread], dv_acc[kColsPerThread];
#pragma unroll
    for (int i = 0; i < kColsPerThread; ++i) dk_acc[i] = dv_acc[i] = 0.f;

    for (int h = h_kv * group; h < (h_kv + 1) * group; ++h) {
        const T* q_head = q + b * q_sb + seq.q_start * q_ss + h * q_sh;
        const T* do_head = dout + b * do_sb + seq.q_start * do_ss + h * do_sh;
        const long long bh = static_cast<long long>(b) * heads + h;
        const ScoreMod<MODS, true> mod(scale_log2, softcap_in, softcap_out, alibi_slopes, alibi_batch_stride, b, h);
        const Dropout<(MODS & kModDropout) != 0> dropout(dropout_seed, dropout_offset, dropout_threshold,
                                                         static_cast<int>(bh));
        for (int m0 = m_begin; m0 < m_end; m0 += BLOCK_M) {
            __syncthreads();
            load_rows_f32<T, BLOCK_M, HEAD_DIM>(q_s, q_head, q_ss, m0, seq.seqlen_q, head_dim);
            load_rows_f32<T, BLOCK_M, HEAD_DIM>(do_s, do_head, do_ss, m0, seq.seqlen_q, head_dim);
            load_row_stats<BLOCK_M>(lse2_s, delta_s, lse + seq.stats(b, heads, h), delta + seq.stats(b, heads, h), m0,
                                    seq.seqlen_q);
            __syncthreads();
            recompute_p_ds<HEAD_DIM, MASK, MODS, BLOCK_M, BLOCK_N>(q_s, do_s, k_s, v_s, lse2_s, delta_s, p_s, ds_s,
                                                                     window, mod, dropout, dropout_scale, m0, n0,
                                                                     seq.seqlen_q, seq.seqlen_k);
            __syncthreads();
#pragma unroll 2
            for (int r = 0; r < BLOCK_M; ++r) {
                const float p = p_s[r * kScoreRow + key_row], ds = ds_s[r * kScoreRow + key_row];
#pragma unroll
                for (int i = 0; i < kColsPerThread; ++i) {
                    const int e = col0 + i * kThreadsPerRow;
                    dv_acc[i] = fmaf(p, do_s[r * kRow + e], dv_acc[i]);
                    dk_acc[i] = fmaf(ds, q_s[r * kRow + e], dk_acc[i]);
                }
            }
        }
    }
    const int key = n0 + key_row;
    if (key < seq.seqlen_k) {
        T* dk_row = dk + b * dk_sb + seq.k_start * dk_ss + h_kv * dk_sh + key * dk_ss;
        T* dv_row = dv + b * dk_sb + seq.k_start * dk_ss + h_kv * dk_sh + key * dk_ss;
#pragma unroll
        for (int i = 0; i < kColsPerThread; ++i) {
            const int e = col0 + i * kThreadsPerRow;
            if (e < head_dim) {
                dk_row[e] = from_float<T>(dk_acc[i] * scale);
                dv_row[e] = from_float<T>((MODS & kModDropout) != 0 ? dv_acc[i] * dropout_scale : dv_acc[i]);
            }
        }
    }
}

// dQ: one block per (batch, head, BLOCK_M queries), walking the key tiles it can see; no atomics.
template <typename T, int HEAD_DIM, int MASK, int MODS, int BLOCK_M, int BLOCK_N, int SMEM_BYTES, bool VARLEN>
__global__ void __launch_bounds__(kSimtThreads, 1) bwd_dq_simt(CUFLASH_PARAMS(CUFLASH_BWD_FIELDS)) {
    using Tiles = SimtTiles<HEAD_DIM, BLOCK_M, BLOCK_N>;
    static_assert(Tiles::kBwdFloats * 4 == SMEM_BYTES, "launch shared memory must match the tile plan");
    constexpr int kRow = Tiles::kRow, kScoreRow = Tiles::kScoreRow;
    constexpr int kThreadsPerRow = kSimtThreads / BLOCK_M;
    constexpr int kColsPerThread = HEAD_DIM / kThreadsPerRow;
    static_assert(kSimtThreads % BLOCK_M == 0 && HEAD_DIM % kThreadsPerRow == 0, "dQ ownership must tile");

    extern __shared__ __align__(16) unsigned char smem_raw[];
    const auto [q_s, do_s, k_s, v_s, p_s, ds_s, lse2_s, delta_s] = Tiles::bwd_tiles(smem_raw);

    const QueryBlock blk(BLOCK_M, batch, heads, group, seqlen_q, batch * heads);   // one section
    const int bh = blk.bh, b = blk.b, h = blk.h, h_kv = blk.h_kv, m0 = blk.m0;
    const Sequence<VARLEN> seq(cu_seqlens_q, cu_seqlens_k, b, batch, seqlen_q, seqlen_k, diagonal);
    if (VARLEN && m0 >= seq.seqlen_q) return;
    const Window<MASK> window{seq.diagonal, window_left, window_right};
    const ScoreMod<MODS, true> mod(scale_log2, softcap_in, softcap_out, alibi_slopes, alibi_batch_stride, b, h);
    const Dropout<(MODS & kModDropout) != 0> dropout(dropout_seed, dropout_offset, dropout_threshold, bh);
    const int n_begin = window.key_begin(m0) / BLOCK_N * BLOCK_N;
    const int n_end = window.key_end(m0 + BLOCK_M, seq.seqlen_k);
    const T* k_head = k + b * k_sb + seq.k_start * k_ss + h_kv * k_sh;
    const T* v_head = v + b * v_sb + seq.k_start * v_ss + h_kv * v_sh;

    load_rows_f32<T, BLOCK_M, HEAD_DIM>(q_s, q + b * q_sb + seq.q_start * q_ss + h * q_sh, q_ss, m0, seq.seqlen_q,
                                        head_dim);
    load_rows_f32<T, BLOCK_M, HEAD_DIM>(do_s, dout + b * do_sb + seq.q_start * do_ss + h * do_sh, do_ss, m0,
                                        seq.seqlen_q, head_dim);
    load_row_stats<BLOCK_M>(lse2_s, delta_s, lse + seq.stats(b, heads, h), delta + seq.stats(b, heads, h), m0,
                            seq.seqlen_q);
    const int q_row = threadIdx.x / kThreadsPerRow, col0 = threadIdx.x % kThreadsPerRow;
    float dq_acc[kColsPerThread];
#pragma unroll
    for (int i = 0; i < kColsPerThread; ++i) dq_acc[i] = 0.f;

    for (int n0 = n_begin; n0 < n_end; n0 += BLOCK_N) {
        __syncthreads();
        load_rows_f32<T, BLOCK_N, HEAD_DIM>(k_s, k_head, k_ss, n0, seq.seqlen_k, head_dim);
        load_rows_f32<T, BLOCK_N, HEAD_DIM>(v_s, v_head, v_ss, n0, seq.seqlen_k, head_dim);
        __syncthreads();
        recompute_p_ds<HEAD_DIM, MASK, MODS, BLOCK_M, BLOCK_N>(q_s, do_s, k_s, v_s, lse2_s, delta_s, p_s, ds_s,
                                                                 window, mod, dropout, dropout_scale, m0, n0,
                                                                 seq.seqlen_q, seq.seqlen_k);
        __syncthreads();
#pragma unroll 2
        for (int c = 0; c < BLOCK_N; ++c) {
            const float ds = ds_s[q_row * kScoreRow + c];
#pragma unroll
            for (int i = 0; i < kColsPerThread; ++i)
                dq_acc[i] = fmaf(ds, k_s[c * kRow + col0 + i * kThreadsPerRow], dq_acc[i]);
        }
    }
    const int row = m0 + q_row;
    if (row < seq.seqlen_q) {
        T* dq_row = dq + b * dq_sb + seq.q_start * dq_ss + h * dq_sh + row * dq_ss;
#pragma unroll
        for (int i = 0; i < kColsPerThread; ++i) {
            const int e = col0 + i * kThreadsPerRow;
            if (e < head_dim) dq_row[e] = from_float<T>(dq_acc[i] * scale);
        }
    }
}

}  // namespace cuflash
