// Backward pass on the tensor cores (float16 / bfloat16 inputs, float32 accumulation), the
// FlashAttention-2 algorithm without a seqlen_q x seqlen_k buffer:
//   delta = rowsum(dout * out)                                  (bwd_preprocess, simt.cu)
//   P = exp2(S * scale * log2(e) - lse * log2(e)),  S = Q K^T   (recomputed per tile; lse is natural log)
//   dP = dO V^T,  dS = P * (dP - delta)
//   bwd_dkdv_mma: per key tile, walking the query tiles of every head of its kv group:
//                 dV += P^T dO,  dK += dS^T Q  (scale applied at the end)
//   bwd_dq_mma:   per query tile, walking the key tiles it sees:  dQ += dS K
// Every output element is summed in a fixed order by one thread: bitwise reproducible.
#include "mma.cuh"

namespace cuflash {

// Store a warp's 16 x HEAD_DIM accumulator (rows row0 + g and row0 + g + 8) times `factor`.
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void store_rows(T* base, long long row_stride, int row0, int rows_valid, int head_dim,
                                           const float (&acc)[HEAD_DIM / 8][4], float factor, int lane) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row0 + g + 8 * r;
        if (row >= rows_valid) continue;
        T* out_row = base + row * row_stride;
#pragma unroll
        for (int db = 0; db < HEAD_DIM / 8; ++db) {
            const int col = db * 8 + 2 * t;
            if (col < head_dim) out_row[col] = from_float<T>(acc[db][2 * r] * factor);
            if (col + 1 < head_dim) out_row[col + 1] = from_float<T>(acc[db][2 * r + 1] * factor);
        }
    }
}

// Which gradients one launch of bwd_dkdv_mma accumulates. Each warp holds 16 x HEAD_DIM of every
// gradient it accumulates; past HEAD_DIM 128 both would not fit in registers, so the host launches the
// kernel twice, once per gradient (P is recomputed; dP^T is needed for dK only).
enum DkdvPart { kDkAndDv = 0, kDvOnly = 1, kDkOnly = 2 };

// dK, dV. Block: BLOCK_N keys of one (batch, kv head), 16 keys per warp; K and V stay in shared memory.
// Query tiles (Q, dO, lse, delta) of BLOCK_M rows stream through two cp.async stages. The warp computes
// the transposed tiles S^T = K Q^T and dP^T = V dO^T (16 keys x BLOCK_M queries), so P^T and dS^T sit
// in accumulator layout and feed dV and dK as A fragments without a trip through shared memory.
template <typename T, int HEAD_DIM, bool CAUSAL, int BLOCK_M, int BLOCK_N, int PART>
__global__ void __launch_bounds__(BLOCK_N / 16 * 32, 1) bwd_dkdv_mma(CUFLASH_BWD_PARAMS) {
    constexpr bool kDk = PART != kDvOnly, kDv = PART != kDkOnly;
    constexpr int kThreads = BLOCK_N / 16 * 32;
    constexpr int kRow = PaddedRow<HEAD_DIM>::kElems;
    constexpr int kMTiles = BLOCK_M / 8;     // n8 tiles of S^T per warp
    constexpr int kDTiles = HEAD_DIM / 8;
    static_assert(BLOCK_M % 16 == 0 && BLOCK_N % 16 == 0, "tiles are made of 16 x 16 mma blocks");

    // Shared memory: K, V [BLOCK_N][kRow]; Q, dO [2][BLOCK_M][kRow]; lse2, delta [2][BLOCK_M] float32.
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* k_s = reinterpret_cast<T*>(smem_raw);
    T* v_s = k_s + BLOCK_N * kRow;
    T* q_s = v_s + BLOCK_N * kRow;
    T* do_s = q_s + 2 * BLOCK_M * kRow;
    float* lse2_s = reinterpret_cast<float*>(do_s + 2 * BLOCK_M * kRow);
    float* delta_s = lse2_s + 2 * BLOCK_M;

    const KeyBlock blk(BLOCK_N, batch, heads / group);
    const int b = blk.b, h_kv = blk.h_kv, n0 = blk.n0;
    const int causal_offset = seqlen_k - seqlen_q;
    const int m_begin = CAUSAL ? max(0, n0 - causal_offset) / BLOCK_M * BLOCK_M : 0;
    const int m_tiles = m_begin < seqlen_q ? (seqlen_q - m_begin + BLOCK_M - 1) / BLOCK_M : 0;
    const int steps = m_tiles * group;   // (head in group, query tile), query tile fastest

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    const int key_a = n0 + warp * 16 + g, key_b = key_a + 8;

    // Issue the copies of step `s` into stage `s & 1`.
    auto load_step = [&](int s) {
        const int h = h_kv * group + s / m_tiles;
        const int m0 = m_begin + (s % m_tiles) * BLOCK_M;
        const int stage = s & 1;
        load_tile_async<T, BLOCK_M, HEAD_DIM, kThreads>(q_s + stage * BLOCK_M * kRow, q + b * q_sb + h * q_sh, q_ss,
                                                         m0, seqlen_q, head_dim, vec_ok, tid);
        load_tile_async<T, BLOCK_M, HEAD_DIM, kThreads>(do_s + stage * BLOCK_M * kRow, dout + b * do_sb + h * do_sh,
                                                         do_ss, m0, seqlen_q, head_dim, vec_ok, tid);
        const long long row_base = (static_cast<long long>(b) * heads + h) * seqlen_q;
        for (int r = tid; r < BLOCK_M; r += kThreads) {
            const bool ok = m0 + r < seqlen_q;
            lse2_s[stage * BLOCK_M + r] = ok ? lse[row_base + m0 + r] * kLog2e : 0.f;
            delta_s[stage * BLOCK_M + r] = ok ? delta[row_base + m0 + r] : 0.f;
        }
    };

    load_tile_async<T, BLOCK_N, HEAD_DIM, kThreads>(k_s, k + b * k_sb + h_kv * k_sh, k_ss, n0, seqlen_k, head_dim,
                                                     vec_ok, tid);
    load_tile_async<T, BLOCK_N, HEAD_DIM, kThreads>(v_s, v + b * v_sb + h_kv * v_sh, v_ss, n0, seqlen_k, head_dim,
                                                     vec_ok, tid);
    if (steps > 0) load_step(0);
    cp_async_commit();

    float dk_acc[kDk ? kDTiles : 1][4], dv_acc[kDv ? kDTiles : 1][4];
    zero(dk_acc);
    zero(dv_acc);

    for (int s = 0; s < steps; ++s) {
        if (s + 1 < steps) load_step(s + 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const int stage = s & 1;
        const int m0 = m_begin + (s % m_tiles) * BLOCK_M;
        const T* q_tile = q_s + stage * BLOCK_M * kRow;
        const T* do_tile = do_s + stage * BLOCK_M * kRow;
        const float* lse2_tile = lse2_s + stage * BLOCK_M;
        const float* delta_tile = delta_s + stage * BLOCK_M;

        // S^T = K Q^T -> P^T (16 keys x BLOCK_M queries per warp)
        float p[kMTiles][4];
        zero(p);
        warp_gemm_rows_rows<T, HEAD_DIM, kMTiles>(p, k_s + warp * 16 * kRow, q_tile, lane);
        const bool need_mask = m0 + BLOCK_M > seqlen_q || n0 + BLOCK_N > seqlen_k ||
                               (CAUSAL && n0 + BLOCK_N - 1 > m0 + causal_offset);
#pragma unroll
        for (int mb = 0; mb < kMTiles; ++mb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = mb * 8 + 2 * t + (e & 1);
                float x = exp2f(p[mb][e] * scale_log2 - lse2_tile[col]);
                if (need_mask) {
                    const int key = e < 2 ? key_a : key_b;
                    if (m0 + col >= seqlen_q || !key_visible(CAUSAL, m0 + col, key, seqlen_k, causal_offset)) x = 0.f;
                }
                p[mb][e] = x;
            }
        }
        unsigned a[BLOCK_M / 16][4];
        if constexpr (kDv) {
            pack_a_fragments<T, kMTiles>(a, p);
            warp_gemm_frag_rows<T, HEAD_DIM, BLOCK_M / 16>(dv_acc, a, do_tile, lane);   // dV += P^T dO
        }
        if constexpr (kDk) {
            // dP^T = V dO^T -> dS^T = P^T * (dP^T - delta)
            float ds[kMTiles][4];
            zero(ds);
            warp_gemm_rows_rows<T, HEAD_DIM, kMTiles>(ds, v_s + warp * 16 * kRow, do_tile, lane);
#pragma unroll
            for (int mb = 0; mb < kMTiles; ++mb) {
#pragma unroll
                for (int e = 0; e < 4; ++e) ds[mb][e] = p[mb][e] * (ds[mb][e] - delta_tile[mb * 8 + 2 * t + (e & 1)]);
            }
            pack_a_fragments<T, kMTiles>(a, ds);
            warp_gemm_frag_rows<T, HEAD_DIM, BLOCK_M / 16>(dk_acc, a, q_tile, lane);    // dK += dS^T Q
        }
        __syncthreads();   // this stage is refilled by the copies issued at the top of step s + 1
    }
    cp_async_wait<0>();

    const long long kv_head = b * dk_sb + h_kv * dk_sh;
    if constexpr (kDk) store_rows<T, HEAD_DIM>(dk + kv_head, dk_ss, n0 + warp * 16, seqlen_k, head_dim, dk_acc, scale, lane);
    if constexpr (kDv) store_rows<T, HEAD_DIM>(dv + kv_head, dk_ss, n0 + warp * 16, seqlen_k, head_dim, dv_acc, 1.f, lane);
}

// dQ. Block: BLOCK_M queries of one (batch, head), 16 per warp; Q and dO stay in shared memory while K and
// V tiles of BLOCK_N keys stream through two cp.async stages (the forward's structure). dS stays in
// registers as the A operand of dS K.
template <typename T, int HEAD_DIM, bool CAUSAL, int BLOCK_M, int BLOCK_N>
__global__ void __launch_bounds__(BLOCK_M / 16 * 32, 1) bwd_dq_mma(CUFLASH_BWD_PARAMS) {
    constexpr int kThreads = BLOCK_M / 16 * 32;
    constexpr int kRow = PaddedRow<HEAD_DIM>::kElems;
    constexpr int kNTiles = BLOCK_N / 8;
    constexpr int kDTiles = HEAD_DIM / 8;
    static_assert(BLOCK_M % 16 == 0 && BLOCK_N % 16 == 0, "tiles are made of 16 x 16 mma blocks");

    // Shared memory: Q, dO [BLOCK_M][kRow]; K, V [2][BLOCK_N][kRow].
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* q_s = reinterpret_cast<T*>(smem_raw);
    T* do_s = q_s + BLOCK_M * kRow;
    T* k_s = do_s + BLOCK_M * kRow;
    T* v_s = k_s + 2 * BLOCK_N * kRow;

    const QueryBlock blk(BLOCK_M, batch, heads, group, seqlen_q);
    const int bh = blk.bh, b = blk.b, h = blk.h, h_kv = blk.h_kv, m0 = blk.m0;
    const int causal_offset = seqlen_k - seqlen_q;
    const int n_end = visible_key_end<CAUSAL>(m0 + BLOCK_M, seqlen_k, causal_offset);
    const int n_tiles = (n_end + BLOCK_N - 1) / BLOCK_N;
    const T* k_head = k + b * k_sb + h_kv * k_sh;
    const T* v_head = v + b * v_sb + h_kv * v_sh;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    const int row_a = m0 + warp * 16 + g, row_b = row_a + 8;
    const long long row_base = static_cast<long long>(bh) * seqlen_q;
    // lse (base 2) and delta of this thread's two rows; rows past the end see nothing
    float lse2[2], dlt[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = r ? row_b : row_a;
        lse2[r] = row < seqlen_q ? lse[row_base + row] * kLog2e : 0.f;
        dlt[r] = row < seqlen_q ? delta[row_base + row] : 0.f;
    }

    load_tile_async<T, BLOCK_M, HEAD_DIM, kThreads>(q_s, q + b * q_sb + h * q_sh, q_ss, m0, seqlen_q, head_dim, vec_ok, tid);
    load_tile_async<T, BLOCK_M, HEAD_DIM, kThreads>(do_s, dout + b * do_sb + h * do_sh, do_ss, m0, seqlen_q, head_dim,
                                                     vec_ok, tid);
    if (n_tiles > 0) {
        load_tile_async<T, BLOCK_N, HEAD_DIM, kThreads>(k_s, k_head, k_ss, 0, seqlen_k, head_dim, vec_ok, tid);
        load_tile_async<T, BLOCK_N, HEAD_DIM, kThreads>(v_s, v_head, v_ss, 0, seqlen_k, head_dim, vec_ok, tid);
    }
    cp_async_commit();

    float dq_acc[kDTiles][4];
    zero(dq_acc);
    for (int j = 0; j < n_tiles; ++j) {
        const int stage = j & 1;
        if (j + 1 < n_tiles) {
            const int nxt = (j + 1) * BLOCK_N;
            load_tile_async<T, BLOCK_N, HEAD_DIM, kThreads>(k_s + (stage ^ 1) * BLOCK_N * kRow, k_head, k_ss, nxt,
                                                             seqlen_k, head_dim, vec_ok, tid);
            load_tile_async<T, BLOCK_N, HEAD_DIM, kThreads>(v_s + (stage ^ 1) * BLOCK_N * kRow, v_head, v_ss, nxt,
                                                             seqlen_k, head_dim, vec_ok, tid);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const T* k_tile = k_s + stage * BLOCK_N * kRow;
        const T* v_tile = v_s + stage * BLOCK_N * kRow;
        const int n0 = j * BLOCK_N;

        float p[kNTiles][4];
        zero(p);
        warp_gemm_rows_rows<T, HEAD_DIM, kNTiles>(p, q_s + warp * 16 * kRow, k_tile, lane);   // S = Q K^T
        const bool need_mask = m0 + BLOCK_M > seqlen_q || n0 + BLOCK_N > seqlen_k ||
                               (CAUSAL && n0 + BLOCK_N - 1 > m0 + causal_offset);
#pragma unroll
        for (int nb = 0; nb < kNTiles; ++nb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = exp2f(p[nb][e] * scale_log2 - lse2[e / 2]);
                if (need_mask) {
                    const int row = e < 2 ? row_a : row_b;
                    const int key = n0 + nb * 8 + 2 * t + (e & 1);
                    if (row >= seqlen_q || !key_visible(CAUSAL, row, key, seqlen_k, causal_offset)) x = 0.f;
                }
                p[nb][e] = x;
            }
        }
        float ds[kNTiles][4];
        zero(ds);
        warp_gemm_rows_rows<T, HEAD_DIM, kNTiles>(ds, do_s + warp * 16 * kRow, v_tile, lane);   // dP = dO V^T
#pragma unroll
        for (int nb = 0; nb < kNTiles; ++nb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) ds[nb][e] = p[nb][e] * (ds[nb][e] - dlt[e / 2]);
        }
        unsigned a[BLOCK_N / 16][4];
        pack_a_fragments<T, kNTiles>(a, ds);
        warp_gemm_frag_rows<T, HEAD_DIM, BLOCK_N / 16>(dq_acc, a, k_tile, lane);   // dQ += dS K
        __syncthreads();
    }
    cp_async_wait<0>();
    store_rows<T, HEAD_DIM>(dq + b * dq_sb + h * dq_sh, dq_ss, m0 + warp * 16, seqlen_q, head_dim, dq_acc, scale, lane);
}

}  // namespace cuflash
