// Forward pass on the tensor cores (float16 / bfloat16 inputs, float32 accumulation).
//
// One thread block owns BLOCK_M query rows of one (batch, head); each warp owns 16 of those rows.
// The Q tile stays on chip throughout (in registers for HEAD_DIM <= 128, else in shared memory) while
// the block walks the key/value tiles, BLOCK_N keys at a time, double-buffered with cp.async: tile j+1
// is in flight while tile j is used. Per row the online-softmax state is m_i (running max of the
// base-2 scores), l_i (running sum of exp2(score - m_i), per-thread partial until the epilogue) and acc
// (the unnormalized output, 16 x HEAD_DIM per warp in mma accumulator layout).
//
// Scores are kept in base 2: x = (q . k) * scale * log2(e), so p = exp2(x - m_i). The stored lse is
// converted back to natural log: lse = (m_i + log2(l_i)) * ln(2).
#include "mma.cuh"

namespace cuflash {

template <typename T, int HEAD_DIM, bool CAUSAL, int BLOCK_M, int BLOCK_N>
__global__ void __launch_bounds__(BLOCK_M / 16 * 32)
fwd_mma(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ out,
        float* __restrict__ lse, long long q_sb, long long q_ss, long long q_sh, long long k_sb,
        long long k_ss, long long k_sh, long long v_sb, long long v_ss, long long v_sh, long long o_sb,
        long long o_ss, long long o_sh, int batch, int heads, int group, int seqlen_q, int seqlen_k,
        int head_dim, float scale_log2, int vec_ok) {
    constexpr int kWarps = BLOCK_M / 16;
    constexpr int kThreads = kWarps * 32;
    constexpr int kRow = PaddedRow<HEAD_DIM>::kElems;
    constexpr int kKSteps = HEAD_DIM / 16;   // k16 steps of Q.K^T
    constexpr int kNTiles = BLOCK_N / 8;     // n8 accumulator tiles of S per warp
    constexpr int kDTiles = HEAD_DIM / 8;    // n8 accumulator tiles of acc per warp
    constexpr bool kQInRegisters = HEAD_DIM <= 128;
    static_assert(BLOCK_M % 16 == 0 && BLOCK_N % 16 == 0, "tiles are made of 16 x 16 mma blocks");

    // Shared memory: Q [BLOCK_M][kRow], then K and V, two stages each [2][BLOCK_N][kRow].
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* q_s = reinterpret_cast<T*>(smem_raw);
    T* k_s = q_s + BLOCK_M * kRow;
    T* v_s = k_s + 2 * BLOCK_N * kRow;

    const int bh_count = batch * heads;
    const int num_m_blocks = (seqlen_q + BLOCK_M - 1) / BLOCK_M;
    // Highest query blocks first: under the causal mask they have the most key tiles to walk.
    const int m_block = num_m_blocks - 1 - static_cast<int>(blockIdx.x / bh_count);
    const int bh = blockIdx.x % bh_count;
    const int b = bh / heads, h = bh % heads, h_kv = h / group;
    const int m0 = m_block * BLOCK_M;
    const int causal_offset = seqlen_k - seqlen_q;

    const T* q_head = q + b * q_sb + h * q_sh;
    const T* k_head = k + b * k_sb + h_kv * k_sh;
    const T* v_head = v + b * v_sb + h_kv * v_sh;
    const int n_end = visible_key_end<CAUSAL>(m0 + BLOCK_M, seqlen_k, causal_offset);
    const int n_tiles = (n_end + BLOCK_N - 1) / BLOCK_N;   // causal tiles above the diagonal: skipped

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;

    load_tile_async<T, BLOCK_M, HEAD_DIM, kThreads>(q_s, q_head, q_ss, m0, seqlen_q, head_dim, vec_ok, tid);
    if (n_tiles > 0) {
        load_tile_async<T, BLOCK_N, HEAD_DIM, kThreads>(k_s, k_head, k_ss, 0, seqlen_k, head_dim, vec_ok, tid);
        load_tile_async<T, BLOCK_N, HEAD_DIM, kThreads>(v_s, v_head, v_ss, 0, seqlen_k, head_dim, vec_ok, tid);
    }
    cp_async_commit();

    float acc[kDTiles][4];
#pragma unroll
    for (int i = 0; i < kDTiles; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    float m_i[2] = {-CUFLASH_INF, -CUFLASH_INF};   // rows g and g + 8 of this warp's 16
    float l_i[2] = {0.f, 0.f};
    unsigned q_frag[kQInRegisters ? kKSteps : 1][4];

    // ldmatrix lane -> row/column offsets (see mma.cuh): A and V.trans pair (lane%8 + 8*(lane/8%2),
    // 8*(lane/16)); K as B pairs (lane%8 + 8*(lane/16), 8*(lane/8%2)).
    const int a_row = warp * 16 + (lane % 8) + 8 * ((lane / 8) % 2), a_col = 8 * (lane / 16);
    const int kb_row = (lane % 8) + 8 * (lane / 16), kb_col = 8 * ((lane / 8) % 2);
    const int vb_row = (lane % 8) + 8 * ((lane / 8) % 2), vb_col = 8 * (lane / 16);
    const int row_a = m0 + warp * 16 + g, row_b = row_a + 8;

    for (int j = 0; j < n_tiles; ++j) {
        const int stage = j & 1;
        if (j + 1 < n_tiles) {
            const int nxt = (j + 1) * BLOCK_N;
            load_tile_async<T, BLOCK_N, HEAD_DIM, kThreads>(k_s + (stage ^ 1) * BLOCK_N * kRow, k_head, k_ss,
                                                             nxt, seqlen_k, head_dim, vec_ok, tid);
            load_tile_async<T, BLOCK_N, HEAD_DIM, kThreads>(v_s + (stage ^ 1) * BLOCK_N * kRow, v_head, v_ss,
                                                             nxt, seqlen_k, head_dim, vec_ok, tid);
        }
        cp_async_commit();   // possibly empty, so that "all but the newest group" is always tile j
        cp_async_wait<1>();
        __syncthreads();
        const T* k_tile = k_s + stage * BLOCK_N * kRow;
        const T* v_tile = v_s + stage * BLOCK_N * kRow;

        if (kQInRegisters && j == 0) {
#pragma unroll
            for (int ks = 0; ks < kKSteps; ++ks) ldmatrix_x4(q_frag[kQInRegisters ? ks : 0], q_s + a_row * kRow + ks * 16 + a_col);
        }

        // S = Q K^T for this warp's 16 rows and BLOCK_N keys.
        float s[kNTiles][4];
#pragma unroll
        for (int i = 0; i < kNTiles; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < kKSteps; ++ks) {
            unsigned a_local[4];
            if (!kQInRegisters) ldmatrix_x4(a_local, q_s + a_row * kRow + ks * 16 + a_col);
            const unsigned(&a)[4] = kQInRegisters ? q_frag[kQInRegisters ? ks : 0] : a_local;
#pragma unroll
            for (int nb = 0; nb < kNTiles; nb += 2) {
                unsigned kf[4];
                ldmatrix_x4(kf, k_tile + (nb * 8 + kb_row) * kRow + ks * 16 + kb_col);
                mma_16816<T>(s[nb], a, kf[0], kf[1]);
                mma_16816<T>(s[nb + 1], a, kf[2], kf[3]);
            }
        }

        // Online softmax, base 2. Only the tiles that straddle the causal diagonal or the end of the
        // keys are masked; the first row of the block sees the fewest keys.
        const int n0 = j * BLOCK_N;
        const bool need_mask = n0 + BLOCK_N > seqlen_k || (CAUSAL && n0 + BLOCK_N - 1 > m0 + causal_offset);
        float row_max[2] = {m_i[0], m_i[1]};
#pragma unroll
        for (int nb = 0; nb < kNTiles; ++nb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = s[nb][e] * scale_log2;
                if (need_mask) {
                    const int key = n0 + nb * 8 + 2 * t + (e & 1);
                    const int row = e < 2 ? row_a : row_b;
                    if (!key_visible(CAUSAL, row, key, seqlen_k, causal_offset)) x = -CUFLASH_INF;
                }
                s[nb][e] = x;
                row_max[e / 2] = fmaxf(row_max[e / 2], x);
            }
        }
        float base[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            row_max[r] = quad_max(row_max[r]);
            base[r] = safe_max(row_max[r]);
            const float alpha = exp2f(m_i[r] - base[r]);
            m_i[r] = row_max[r];
            l_i[r] *= alpha;
#pragma unroll
            for (int i = 0; i < kDTiles; ++i) {
                acc[i][2 * r] *= alpha;
                acc[i][2 * r + 1] *= alpha;
            }
        }

        // P = exp2(S - m_i), packed straight into A fragments of P.V (no trip through shared memory).
        unsigned p_frag[BLOCK_N / 16][4];
#pragma unroll
        for (int nb = 0; nb < kNTiles; ++nb) {
            const float p0 = exp2f(s[nb][0] - base[0]), p1 = exp2f(s[nb][1] - base[0]);
            const float p2 = exp2f(s[nb][2] - base[1]), p3 = exp2f(s[nb][3] - base[1]);
            l_i[0] += p0 + p1;
            l_i[1] += p2 + p3;
            p_frag[nb / 2][(nb % 2) * 2 + 0] = pack2<T>(p0, p1);
            p_frag[nb / 2][(nb % 2) * 2 + 1] = pack2<T>(p2, p3);
        }

        // acc += P V
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
#pragma unroll
            for (int db = 0; db < kDTiles; db += 2) {
                unsigned vf[4];
                ldmatrix_x4_trans(vf, v_tile + (kk * 16 + vb_row) * kRow + db * 8 + vb_col);
                mma_16816<T>(acc[db], p_frag[kk], vf[0], vf[1]);
                mma_16816<T>(acc[db + 1], p_frag[kk], vf[2], vf[3]);
            }
        }
        __syncthreads();   // this stage is refilled by the loads issued at the top of iteration j + 1
    }
    cp_async_wait<0>();

    // Epilogue: normalize and store. A row that saw no key has l = 0: output 0, lse = -inf.
    T* out_head = out + b * o_sb + h * o_sh;
    float* lse_head = lse + static_cast<long long>(bh) * seqlen_q;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float l = quad_sum(l_i[r]);
        const float inv_l = l == 0.f ? 0.f : 1.f / l;
        const int row = r == 0 ? row_a : row_b;
        if (row >= seqlen_q) continue;
        if (t == 0) lse_head[row] = l == 0.f ? -CUFLASH_INF : (m_i[r] + log2f(l)) * kLn2;
        T* out_row = out_head + row * o_ss;
#pragma unroll
        for (int db = 0; db < kDTiles; ++db) {
            const int col = db * 8 + 2 * t;
            if (col < head_dim) out_row[col] = from_float<T>(acc[db][2 * r] * inv_l);
            if (col + 1 < head_dim) out_row[col + 1] = from_float<T>(acc[db][2 * r + 1] * inv_l);
        }
    }
}

}  // namespace cuflash
