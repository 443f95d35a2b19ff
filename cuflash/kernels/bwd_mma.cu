// Backward pass on the tensor cores (float16 / bfloat16 inputs, float32 accumulation), the
// FlashAttention-2 algorithm without a seqlen_q x seqlen_k buffer:
//   delta = rowsum(dout * out)                                  (bwd_preprocess, simt.cu)
//   P = exp2(S * scale * log2(e) - lse * log2(e)),  S = Q K^T   (recomputed per tile; lse is natural log)
//   dP = dO V^T,  dS = P * (dP - delta)
//   bwd_dkdv_mma (where its tiles fit in shared memory) or bwd_dkdv_rows_mma (the others): per key
//                 tile, walking the query tiles of every head of its kv group:
//                 dV += P^T dO,  dK += dS^T Q  (scale applied at the end)
//   dQ += dS K, one of three ways:
//     default (ATOMIC_DQ): inside the dK/dV kernel, dS goes through shared memory and every key block
//       adds its share of dQ into a float32 buffer with atomics; bwd_dq_convert scales and casts it. Five
//       matrix products per tile, as in FlashAttention-2, but the order of the float32 sums varies.
//     deterministic (_config.deterministic_dq_splits picks one of the two):
//       split grid: the same dK/dV kernel (bwd_dkdv_mma), but each thread block walks a fixed set of key
//         blocks of one (batch, kv head) in order and adds into its own copy of the float32 buffer
//         (KeyBlock), so each element of each copy is summed by one thread in a fixed order;
//         bwd_dq_convert sums the copies in order. Five products per tile, the copies cost memory.
//       dQ kernel (where too few (batch, kv head) pairs would leave SMs idle): bwd_dq_mma, per query
//         tile, walks the key tiles it sees and recomputes S and dP: seven products per tile, every
//         element summed in a fixed order by one thread.
// dK and dV are summed in a fixed order by one thread in both modes: bitwise reproducible.
// Dropout (kModDropout; Dropout in common.cuh draws the forward's mask again): dV += (P * Z)^T dO and
// dS = P * (Z * dP / (1 - p) - delta), Z the keep mask; dV's epilogue applies the 1 / (1 - p).
#include "mma.cuh"

namespace cuflash {

// dst[0..3] += c in global memory: one 16-byte vector reduction on sm_90, four scalar ones before.
__device__ __forceinline__ void atomic_add4(float* dst, const float (&c)[4]) {
#if __CUDA_ARCH__ >= 900
    atomicAdd(reinterpret_cast<float4*>(dst), make_float4(c[0], c[1], c[2], c[3]));
#else
#pragma unroll
    for (int e = 0; e < 4; ++e) atomicAdd(dst + e, c[e]);
#endif
}

// Copy the lse and delta of query rows [m0, m0 + BLOCK_M) of one (batch, head) (row_base: its row 0)
// into shared memory, in the caller's cp.async group; rows past seqlen_q read as 0 (their P is masked).
// Asynchronous, so the loads do not hold up the thread as register loads followed by stores did
// (2-4% of the dK/dV kernels' stall samples: bench/NOTES.md backward v7).
template <int BLOCK_M, int NTHREADS>
__device__ __forceinline__ void load_row_stats_async(float* lse_s, float* delta_s, const float* lse,
                                                     const float* delta, long long row_base, int m0, int seqlen_q,
                                                     int tid) {
    for (int r = tid; r < BLOCK_M; r += NTHREADS) {
        const bool ok = m0 + r < seqlen_q;
        const long long at = ok ? row_base + m0 + r : 0;
        cp_async_4(lse_s + r, lse + at, ok ? 4 : 0);
        cp_async_4(delta_s + r, delta + at, ok ? 4 : 0);
    }
}

// Add a warp's (MA * 16) x (NB * 8) float32 accumulator tile, whose first element is (row0, col0) of
// its head, into dq_accum (DqAccum layout; head points at the head's first tile). Each 16 x 8 tile is
// one vector reduction per lane into 512 contiguous bytes, at an offset from one address that is a
// compile-time constant, so no address register is rewritten while earlier reductions still read it.
template <int HEAD_DIM, int MA, int NB>
__device__ __forceinline__ void dq_accum_add(float* head, int row0, int col0, const float (&acc)[MA][NB][4],
                                             int lane) {
    float* at = head + DqAccum::tile(row0, col0, HEAD_DIM) + lane * 4;
#pragma unroll
    for (int ma = 0; ma < MA; ++ma)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) atomic_add4(at + (ma * (HEAD_DIM / 8) + nb) * 128, acc[ma][nb]);
}

// The most columns of a slice of a warp's dQ tile of `cols` columns: a multiple of 16 that divides it, at most
// `wide`.
__host__ __device__ constexpr int dq_slice_cols(int cols, int wide) {
    for (int c = wide - wide % 16; c > 16; c -= 16)
        if (cols % c == 0) return c;
    return 16;
}

// Store a warp's (MA * 16) x (NB * 8) accumulator tile times `factor`: rows row0.. (first valid ones
// below rows_valid), columns col0.. (below head_dim).
template <typename T, int MA, int NB>
__device__ __forceinline__ void store_tile(T* base, long long row_stride, int row0, int rows_valid, int col0,
                                           int head_dim, const float (&acc)[MA][NB][4], float factor, int lane) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int ma = 0; ma < MA; ++ma) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = row0 + ma * 16 + g + 8 * r;
            if (row >= rows_valid) continue;
            T* out_row = base + row * row_stride;
#pragma unroll
            for (int nb = 0; nb < NB; ++nb) {
                const int col = col0 + nb * 8 + 2 * t;
                if (col < head_dim) out_row[col] = from_float<T>(acc[ma][nb][2 * r] * factor);
                if (col + 1 < head_dim) out_row[col + 1] = from_float<T>(acc[ma][nb][2 * r + 1] * factor);
            }
        }
    }
}

// Store a warp's (MA * 16) x (NB * 8) accumulator tile, converted to T, into a row-major shared tile
// (rows of row_elems elements, tile at the warp tile's first element): element (ma, nb, e) is
// value(ma, nb, e, acc[ma][nb][e]).
template <typename T, int MA, int NB, typename Value>
__device__ __forceinline__ void store_tile_smem_as(T* tile, int row_elems, const float (&acc)[MA][NB][4], int lane,
                                                   Value value) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int ma = 0; ma < MA; ++ma) {
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
            T* at = tile + (ma * 16 + g) * row_elems + nb * 8 + 2 * t;
            *reinterpret_cast<unsigned*>(at) =
                pack2<T>(value(ma, nb, 0, acc[ma][nb][0]), value(ma, nb, 1, acc[ma][nb][1]));
            *reinterpret_cast<unsigned*>(at + 8 * row_elems) =
                pack2<T>(value(ma, nb, 2, acc[ma][nb][2]), value(ma, nb, 3, acc[ma][nb][3]));
        }
    }
}

// The same, each element times `factor`.
template <typename T, int MA, int NB>
__device__ __forceinline__ void store_tile_smem(T* tile, int row_elems, const float (&acc)[MA][NB][4], int lane,
                                                float factor = 1.f) {
    store_tile_smem_as<T>(tile, row_elems, acc, lane, [factor](int, int, int, float x) { return x * factor; });
}

// dK, dV (and, with ATOMIC_DQ, dQ through float32 atomics), FlashAttention-2's layout. Block: BLOCK_N
// keys of one (batch, kv head), 8 warps; K and V stay in shared memory while the query tiles of every
// head of the kv group (Q, dO, lse, delta; BLOCK_M rows) stream through STAGES cp.async stages (two; one
// where two do not fit in shared memory, as FlashAttention-2 runs head_dim 256 on an A100). Each of
// the five products of a step spreads over all 8 warps as a 2-D grid of warp tiles, so every fragment
// read from shared memory feeds several mma instructions:
//   S = Q K^T, dP = dO V^T : warps 2 (queries) x 4 (keys), tiles (BLOCK_M / 2) x (BLOCK_N / 4)
//   dV += P^T dO, dK += dS^T Q : warps 4 (keys) x 2 (head dim), tiles (BLOCK_N / 4) x (HEAD_DIM / 2), or
//                            2 x 4 at 192 and 256 (kRowWarps); the accumulators live in registers for the
//                            whole block
//   dQ += dS K             : warps 4 (queries) x 2 (head dim), tiles (BLOCK_M / 4) x (HEAD_DIM / 2), or 2 x 4
//                            as dK and dV
// P and dS cross between the layouts through shared memory ([BLOCK_M][BLOCK_N], padded rows).
//
// Its shared memory, offsets in elements of T: K, V [BLOCK_N][kRow]; Q, dO [STAGES][BLOCK_M][kRow]; P, dS
// [BLOCK_M][kPRow]; then lse, delta [STAGES][BLOCK_M] float32. kBytes is what the launch gives it
// (_config.mma_smem_bytes; tests/test_compile.py checks the two agree for every spec).
constexpr int kDkdvTiledThreads = 256;   // 8 warps; _config.DKDV_TILED_THREADS
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int STAGES> struct DkdvTiledSmem {
    static constexpr int kRow = PaddedRow<HEAD_DIM>::kElems, kPRow = PaddedRow<BLOCK_N>::kElems;
    static constexpr int kV = BLOCK_N * kRow, kQ = kV + BLOCK_N * kRow, kDo = kQ + STAGES * BLOCK_M * kRow;
    static constexpr int kP = kDo + STAGES * BLOCK_M * kRow, kDs = kP + BLOCK_M * kPRow, kStats = kDs + BLOCK_M * kPRow;
    static constexpr int kBytes = kStats * static_cast<int>(sizeof(T)) +
                                  2 * STAGES * BLOCK_M * static_cast<int>(sizeof(float));
};

template <typename T, int HEAD_DIM, int MASK, int MODS, int BLOCK_M, int BLOCK_N, int STAGES, bool ATOMIC_DQ,
          bool VARLEN>
__global__ void __launch_bounds__(kDkdvTiledThreads, 1) bwd_dkdv_mma(CUFLASH_PARAMS(CUFLASH_BWD_FIELDS)) {
    constexpr int kThreads = kDkdvTiledThreads;
    constexpr int kRow = PaddedRow<HEAD_DIM>::kElems;
    constexpr int kPRow = PaddedRow<BLOCK_N>::kElems;
    // warp tiles of the three layouts (rows x columns)
    constexpr int kSM = BLOCK_M / 2, kSN = BLOCK_N / 4;         // S, dP
    // dK/dV and dQ on a grid of kRowWarps x (8 / kRowWarps) warps: 4 x 2, or past head_dim 128 where a
    // quarter of the head dim is whole 16-column blocks (192, 256) FlashAttention-2's 2 x 4, whose 32 x 64
    // warp tiles read 10 fragments per 16 mma instructions where 16 x 128 read 17
    constexpr int kRowWarps = HEAD_DIM > 128 && HEAD_DIM % 64 == 0 ? 2 : 4, kColWarps = 8 / kRowWarps;
    constexpr int kKvN = BLOCK_N / kRowWarps, kKvD = HEAD_DIM / kColWarps;   // dK, dV
    constexpr int kQM = BLOCK_M / kRowWarps, kQD = HEAD_DIM / kColWarps;     // dQ
    static_assert(kSM % 16 == 0 && kSN % 16 == 0 && kKvN % 16 == 0 && kKvD % 16 == 0 && kQM % 16 == 0,
                  "every warp tile is made of 16 x 16 mma blocks");
    constexpr bool kDropout = (MODS & kModDropout) != 0;

    static_assert(STAGES == 1 || STAGES == 2, "one or two Q/dO stages");
    using Smem = DkdvTiledSmem<T, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* k_s = reinterpret_cast<T*>(smem_raw);
    T* v_s = k_s + Smem::kV;
    T* q_s = k_s + Smem::kQ;
    T* do_s = k_s + Smem::kDo;
    T* p_s = k_s + Smem::kP;
    T* ds_s = k_s + Smem::kDs;
    float* lse_s = reinterpret_cast<float*>(k_s + Smem::kStats);
    float* delta_s = lse_s + STAGES * BLOCK_M;

    const KeyBlock blk(BLOCK_N, heads / group, seqlen_k, dq_splits, dq_pass);
    if (blk.n0 >= seqlen_k) return;   // the split grid's last pass: this split has no key block left
    const int b = blk.b, h_kv = blk.h_kv, n0 = blk.n0;
    const Sequence<VARLEN> seq(cu_seqlens_q, cu_seqlens_k, b, batch, seqlen_q, seqlen_k, diagonal);
    if (VARLEN && n0 >= seq.seqlen_k) return;
    const Window<MASK> window{seq.diagonal, window_left, window_right};
    const QueryTiles<BLOCK_M> query_tiles(window, n0, BLOCK_N, seq.seqlen_q, group);
    const int steps = query_tiles.steps;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    const int s_row0 = (warp / 4) * kSM, s_col0 = (warp % 4) * kSN;     // S / dP tile
    const int kv_row0 = (warp / kColWarps) * kKvN, kv_col0 = (warp % kColWarps) * kKvD;  // dK / dV tile
    const int q_row0 = (warp / kColWarps) * kQM, q_col0 = (warp % kColWarps) * kQD;      // dQ tile

    // Issue the copies of the step (head h_step of the group, query tile m_step) into `stage`.
    auto load_step = [&](int h_step, int m_step, int stage) {
        const int h = h_kv * group + h_step;
        const int m0 = query_tiles.begin + m_step * BLOCK_M;
        load_tile_async<T, BLOCK_M, HEAD_DIM, kThreads>(q_s + stage * BLOCK_M * kRow,
                                                         q + b * q_sb + seq.q_start * q_ss + h * q_sh, q_ss, m0,
                                                         seq.seqlen_q, head_dim, vec_ok, tid);
        load_tile_async<T, BLOCK_M, HEAD_DIM, kThreads>(do_s + stage * BLOCK_M * kRow,
                                                         dout + b * do_sb + seq.q_start * do_ss + h * do_sh, do_ss,
                                                         m0, seq.seqlen_q, head_dim, vec_ok, tid);
        load_row_stats_async<BLOCK_M, kThreads>(lse_s + stage * BLOCK_M, delta_s + stage * BLOCK_M, lse, delta,
                                                seq.stats(b, heads, h), m0,
                                                seq.seqlen_q, tid);
    };

    load_tile_async<T, BLOCK_N, HEAD_DIM, kThreads>(k_s, k + b * k_sb + seq.k_start * k_ss + h_kv * k_sh, k_ss, n0,
                                                     seq.seqlen_k, head_dim, vec_ok, tid);
    load_tile_async<T, BLOCK_N, HEAD_DIM, kThreads>(v_s, v + b * v_sb + seq.k_start * v_ss + h_kv * v_sh, v_ss, n0,
                                                     seq.seqlen_k, head_dim, vec_ok, tid);
    if (steps > 0) load_step(0, 0, 0);
    cp_async_commit();

    float dk_acc[kKvN / 16][kKvD / 8][4], dv_acc[kKvN / 16][kKvD / 8][4];
    zero(dk_acc);
    zero(dv_acc);

    int h_step = 0, m_step = 0;   // step s's head in the group and query tile (no division per step)
    // step s + 1's copies into its stage: with two stages at the start of step s, with one at its end (under
    // its dQ product they made ptxas spill 16-60 bytes at 224 and 256 on sm_80, NVRTC 13.0)
    auto load_next = [&](int s) {
        if (s + 1 < steps) {
            const bool last_tile = m_step + 1 == query_tiles.count;
            load_step(h_step + last_tile, last_tile ? 0 : m_step + 1, (s + 1) & (STAGES - 1));
        }
        cp_async_commit();
    };
    for (int s = 0; s < steps; ++s) {
        cp_async_wait<0>();
        __syncthreads();   // stage s has landed; every warp is done with step s - 1's P, dS and stage
        if constexpr (STAGES == 2) load_next(s);
        const int stage = s & (STAGES - 1);   // STAGES is 1 or 2
        const int m0 = query_tiles.begin + m_step * BLOCK_M;
        const ScoreMod<MODS> mod(scale_log2, softcap_in, softcap_out, alibi_slopes, alibi_batch_stride, b,
                                 h_kv * group + h_step);
        const Dropout<kDropout> dropout(dropout_seed, dropout_offset, dropout_threshold,
                                        b * heads + h_kv * group + h_step);
        const T* q_tile = q_s + stage * BLOCK_M * kRow;
        const T* do_tile = do_s + stage * BLOCK_M * kRow;
        const float* lse_tile = lse_s + stage * BLOCK_M;
        const float* delta_tile = delta_s + stage * BLOCK_M;

        // S = Q K^T, then P into shared memory; dP = dO V^T, then dS into shared memory: this warp's
        // (queries x keys) tile of each. Under dropout, shared memory gets the kept P (for dV), and dP
        // reaches a kept P scaled by dropout_scale and a dropped one not at all: the registers keep a
        // dropped P negated (P >= 0, so its sign bit holds the keep bit, and a P of 0 gives dS = 0 either
        // way), since holding the keep bits or drawing them again for dS made ptxas spill.
        {
            const bool need_mask = m0 + BLOCK_M > seq.seqlen_q || n0 + BLOCK_N > seq.seqlen_k ||
                                   !window.covers(m0, m0 + BLOCK_M, n0, n0 + BLOCK_N);
            using Drop = Dropout<kDropout>;
            unsigned keep[kDropout ? Drop::template kTileWords<kSM / 16, kSN / 16> : 1];   // this warp's tile
            auto kept = [&](int ma, int nb, int e) {
                return Drop::template tile_keeps<kSM / 16, kSN / 16>(keep, ma, nb, e);
            };
            // P, or -P where dropout drops it
            auto signed_p = [&](int ma, int nb, int e, float x) { return kDropout && !kept(ma, nb, e) ? -x : x; };
            float p[kSM / 16][kSN / 8][4];
            zero(p);
            warp_mma<T, kSM / 16, kSN / 8, HEAD_DIM / 16>(
                p,
                [&](unsigned (&a)[4], int ma, int ks) {
                    load_a(a, q_tile + (s_row0 + ma * 16) * kRow + ks * 16, kRow, lane);
                },
                [&](unsigned (&bf)[4], int nb, int ks) {
                    load_b(bf, k_s + (s_col0 + nb * 8) * kRow + ks * 16, kRow, lane);
                });
            if constexpr (kDropout)
                dropout.template tile_bits<kSM / 16, kSN / 16, 4>(keep, m0 + s_row0 + g, n0 + s_col0 + 2 * t);
            if constexpr (!ScoreMod<MODS>::kSoftcap) {
#pragma unroll
                for (int ma = 0; ma < kSM / 16; ++ma) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int row = s_row0 + ma * 16 + g + 8 * (e / 2);   // in the query tile
                        const float row_lse2 = lse_tile[row] * kLog2e;
#pragma unroll
                        for (int nb = 0; nb < kSN / 8; ++nb) {
                            const int col = s_col0 + nb * 8 + 2 * t + (e % 2);   // in the key block
                            float x = exp2f(mod.score(p[ma][nb][e], m0 + row, n0 + col, seq.diagonal) - row_lse2);
                            if (need_mask && (m0 + row >= seq.seqlen_q ||
                                              !window.sees(m0 + row, n0 + col, seq.seqlen_k)))
                                x = 0.f;
                            p[ma][nb][e] = signed_p(ma, nb, e, x);
                        }
                    }
                }
                store_tile_smem_as<T>(p_s + s_row0 * kPRow + s_col0, kPRow, p, lane,
                                      [](int, int, int, float x) { return kDropout ? fmaxf(x, 0.f) : x; });
            } else {
                // Under a softcap dS needs P * (1 - tanh^2) and dV needs P: each pair of P goes to shared
                // memory as soon as it is made, and the registers keep P * (1 - tanh^2) (two arrays of the
                // tile in registers spilled).
#pragma unroll
                for (int ma = 0; ma < kSM / 16; ++ma) {
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const int row = s_row0 + ma * 16 + g + 8 * half;   // in the query tile
                        const float row_lse2 = lse_tile[row] * kLog2e;
#pragma unroll
                        for (int nb = 0; nb < kSN / 8; ++nb) {
                            float pair[2];
#pragma unroll
                            for (int c = 0; c < 2; ++c) {
                                const int col = s_col0 + nb * 8 + 2 * t + c;   // in the key block
                                float grad;
                                float x = exp2f(mod.score(p[ma][nb][2 * half + c], m0 + row, n0 + col, seq.diagonal,
                                                          grad) - row_lse2);
                                if (need_mask && (m0 + row >= seq.seqlen_q ||
                                                  !window.sees(m0 + row, n0 + col, seq.seqlen_k)))
                                    x = 0.f;
                                pair[c] = kept(ma, nb, 2 * half + c) ? x : 0.f;
                                p[ma][nb][2 * half + c] = signed_p(ma, nb, 2 * half + c, x * grad);
                            }
                            *reinterpret_cast<unsigned*>(p_s + row * kPRow + s_col0 + nb * 8 + 2 * t) =
                                pack2<T>(pair[0], pair[1]);
                        }
                    }
                }
            }
            float dp[kSM / 16][kSN / 8][4];
            zero(dp);
            warp_mma<T, kSM / 16, kSN / 8, HEAD_DIM / 16>(
                dp,
                [&](unsigned (&a)[4], int ma, int ks) {
                    load_a(a, do_tile + (s_row0 + ma * 16) * kRow + ks * 16, kRow, lane);
                },
                [&](unsigned (&bf)[4], int nb, int ks) {
                    load_b(bf, v_s + (s_col0 + nb * 8) * kRow + ks * 16, kRow, lane);
                });
#pragma unroll
            for (int ma = 0; ma < kSM / 16; ++ma) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float row_delta = delta_tile[s_row0 + ma * 16 + g + 8 * (e / 2)];
#pragma unroll
                    for (int nb = 0; nb < kSN / 8; ++nb) {
                        if constexpr (kDropout) {
                            const float x = p[ma][nb][e];
                            dp[ma][nb][e] = fabsf(x) * ((x > 0.f ? dp[ma][nb][e] * dropout_scale : 0.f) - row_delta);
                        } else {
                            dp[ma][nb][e] = p[ma][nb][e] * (dp[ma][nb][e] - row_delta);
                        }
                    }
                }
            }
            store_tile_smem<T>(ds_s + s_row0 * kPRow + s_col0, kPRow, dp, lane);
        }
        __syncthreads();   // P and dS complete

        // dV += P^T dO and dK += dS^T Q on this warp's (keys x head dim) tile; A is P^T (dS^T), read
        // transposed out of P (dS): the query rows are the k of the products.
        warp_mma<T, kKvN / 16, kKvD / 8, BLOCK_M / 16>(
            dv_acc,
            [&](unsigned (&a)[4], int ma, int ks) {
                load_a_transposed(a, p_s + ks * 16 * kPRow + kv_row0 + ma * 16, kPRow, lane);
            },
            [&](unsigned (&bf)[4], int nb, int ks) {
                load_b_trans(bf, do_tile + ks * 16 * kRow + kv_col0 + nb * 8, kRow, lane);
            });
        warp_mma<T, kKvN / 16, kKvD / 8, BLOCK_M / 16>(
            dk_acc,
            [&](unsigned (&a)[4], int ma, int ks) {
                load_a_transposed(a, ds_s + ks * 16 * kPRow + kv_row0 + ma * 16, kPRow, lane);
            },
            [&](unsigned (&bf)[4], int nb, int ks) {
                load_b_trans(bf, q_tile + ks * 16 * kRow + kv_col0 + nb * 8, kRow, lane);
            });

        if constexpr (ATOMIC_DQ) {
            // dQ[query tile] += dS K over this block's keys, added into dq_accum (float32); past head_dim 128
            // kDqCols columns of the warp's tile at a time (dq_slice_cols: at most 32 floats a thread, 16 at 256
            // with one stage, which an A100 runs: 32 spilled 16-48 bytes there on sm_80), in a loop ptxas keeps
            // rolled: the whole tile beside dK and dV, or its slices unrolled, spilled 16-64 bytes at 256 (sm_80
            // and sm_90, NVRTC 13.0)
            constexpr int kDqWide = (HEAD_DIM <= 128 ? 64 : 64 * 16 / kQM) / (STAGES == 1 && HEAD_DIM == 256 ? 2 : 1);
            constexpr int kDqCols = kQD <= kDqWide ? kQD : dq_slice_cols(kQD, kDqWide);
            float* const dq_head = dq_accum + DqAccum::head(blk.split, batch, b, heads, h_kv * group + h_step, seq,
                                                            seqlen_q, HEAD_DIM);
#pragma unroll 1
            for (int c0 = 0; c0 < kQD; c0 += kDqCols) {
                float dq_part[kQM / 16][kDqCols / 8][4];
                zero(dq_part);
                warp_mma<T, kQM / 16, kDqCols / 8, BLOCK_N / 16>(
                    dq_part,
                    [&](unsigned (&a)[4], int ma, int ks) {
                        load_a(a, ds_s + (q_row0 + ma * 16) * kPRow + ks * 16, kPRow, lane);
                    },
                    [&](unsigned (&bf)[4], int nb, int ks) {
                        load_b_trans(bf, k_s + ks * 16 * kRow + q_col0 + c0 + nb * 8, kRow, lane);
                    });
                dq_accum_add<HEAD_DIM>(dq_head, m0 + q_row0, q_col0 + c0, dq_part, lane);
            }
        }
        if constexpr (STAGES == 1) {
            __syncthreads();   // every warp is done with the stage (Q, dO, lse, delta)
            load_next(s);
        }
        if (++m_step == query_tiles.count) {
            m_step = 0;
            ++h_step;
        }
    }
    // Epilogue: dK (scaled) and dV staged as T in the Q/dO stages, then stored as 16-byte chunks.
    static_assert(2 * BLOCK_N <= 2 * STAGES * BLOCK_M, "dK and dV are staged where the Q and dO stages were");
    cp_async_wait<0>();
    __syncthreads();   // every warp is done with the stages
    T* dk_stage = q_s;
    T* dv_stage = q_s + BLOCK_N * kRow;
    // This warp's tile at (kv_row0, kv_col0), recomputed from threadIdx.x: keeping kv_row0 and
    // kv_col0 live across the loop for the epilogue made ptxas spill at head_dim 128.
    const int stage_at = (threadIdx.x / (32 * kColWarps)) * kKvN * kRow + (threadIdx.x / 32 % kColWarps) * kKvD;
    store_tile_smem<T>(dk_stage + stage_at, kRow, dk_acc, threadIdx.x % 32, scale);
    store_tile_smem<T>(dv_stage + stage_at, kRow, dv_acc, threadIdx.x % 32, kDropout ? dropout_scale : 1.f);
    __syncthreads();
    const long long kv_head = b * dk_sb + seq.k_start * dk_ss + h_kv * dk_sh;
    store_rows<T, BLOCK_N, HEAD_DIM, kThreads>(dk + kv_head, dk_ss, n0, seq.seqlen_k, head_dim, dk_stage, threadIdx.x);
    store_rows<T, BLOCK_N, HEAD_DIM, kThreads>(dv + kv_head, dk_ss, n0, seq.seqlen_k, head_dim, dv_stage, threadIdx.x);
}

// Which gradients one launch of bwd_dkdv_rows_mma accumulates. Each warp holds 16 x HEAD_DIM of every
// gradient it accumulates; past HEAD_DIM 128 both would not fit in registers, so the host launches the
// kernel twice, once per gradient (P is recomputed; dP^T is needed for dK only).
enum DkdvPart { kDkAndDv = 0, kDvOnly = 1, kDkOnly = 2 };

// dK, dV. Block: BLOCK_N keys of one (batch, kv head), 16 keys per warp; K and V stay in shared memory.
// Query tiles (Q, dO, lse, delta) of BLOCK_M rows stream through two cp.async stages. The warp computes
// the transposed tiles S^T = K Q^T and dP^T = V dO^T (16 keys x BLOCK_M queries), so P^T and dS^T sit
// in accumulator layout and feed dV and dK as A fragments without a trip through shared memory.
// With ATOMIC_DQ (a launch that computes dK), each warp also stores its dS^T rows to shared memory;
// the block then computes dQ[query tile] += dS K over its BLOCK_N keys as items of (16 query rows,
// kDqCols columns) spread over the warps, and adds them into dq_accum.
//
// Its shared memory, offsets in elements of T: K, V [BLOCK_N][kRow]; Q, dO [2][BLOCK_M][kRow]; then lse2,
// delta [2][BLOCK_M] float32; with ATOMIC_DQ, dS^T [BLOCK_N][kDsRow] of T. kBytes is what the launch gives
// it (_config.mma_smem_bytes, checked by tests/test_compile.py).
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, bool ATOMIC_DQ> struct DkdvRowsSmem {
    static constexpr int kRow = PaddedRow<HEAD_DIM>::kElems, kDsRow = PaddedRow<BLOCK_M>::kElems;
    static constexpr int kV = BLOCK_N * kRow, kQ = kV + BLOCK_N * kRow, kDo = kQ + 2 * BLOCK_M * kRow;
    static constexpr int kStats = kDo + 2 * BLOCK_M * kRow;
    static constexpr int kDsBytes = kStats * static_cast<int>(sizeof(T)) + 4 * BLOCK_M * static_cast<int>(sizeof(float));
    static constexpr int kBytes = kDsBytes + (ATOMIC_DQ ? BLOCK_N * kDsRow * static_cast<int>(sizeof(T)) : 0);
};

template <typename T, int HEAD_DIM, int MASK, int MODS, int BLOCK_M, int BLOCK_N, int PART, bool ATOMIC_DQ, bool VARLEN>
__global__ void __launch_bounds__(BLOCK_N / 16 * 32, 1) bwd_dkdv_rows_mma(CUFLASH_PARAMS(CUFLASH_BWD_FIELDS)) {
    constexpr bool kDk = PART != kDvOnly, kDv = PART != kDkOnly;
    static_assert(!ATOMIC_DQ || kDk, "dQ needs dS, which only a launch computing dK has");
    constexpr int kWarps = BLOCK_N / 16;
    constexpr int kThreads = kWarps * 32;
    constexpr int kDsRow = PaddedRow<BLOCK_M>::kElems;                 // dS^T rows: BLOCK_M queries
    // dQ columns of one work item; 32 past head_dim 128, where the dK accumulator leaves no room for 64
    constexpr int kDqCols = HEAD_DIM % 64 == 0 && HEAD_DIM <= 128 ? 64 : 32;
    constexpr int kDqItems = BLOCK_M / 16 * (HEAD_DIM / kDqCols);
    constexpr int kRow = PaddedRow<HEAD_DIM>::kElems;
    constexpr int kMTiles = BLOCK_M / 8;     // n8 tiles of S^T per warp
    constexpr int kDTiles = HEAD_DIM / 8;
    static_assert(BLOCK_M % 16 == 0 && BLOCK_N % 16 == 0, "tiles are made of 16 x 16 mma blocks");
    constexpr bool kDropout = (MODS & kModDropout) != 0;

    using Smem = DkdvRowsSmem<T, HEAD_DIM, BLOCK_M, BLOCK_N, ATOMIC_DQ>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* k_s = reinterpret_cast<T*>(smem_raw);
    T* v_s = k_s + Smem::kV;
    T* q_s = k_s + Smem::kQ;
    T* do_s = k_s + Smem::kDo;
    float* lse2_s = reinterpret_cast<float*>(k_s + Smem::kStats);
    float* delta_s = lse2_s + 2 * BLOCK_M;
    T* ds_s = reinterpret_cast<T*>(smem_raw + Smem::kDsBytes);

    const KeyBlock blk(BLOCK_N, heads / group, seqlen_k, 0, 0);   // the banded grid
    const int b = blk.b, h_kv = blk.h_kv, n0 = blk.n0;
    const Sequence<VARLEN> seq(cu_seqlens_q, cu_seqlens_k, b, batch, seqlen_q, seqlen_k, diagonal);
    if (VARLEN && n0 >= seq.seqlen_k) return;
    // The sequence's offsets where they are used, in a packed batch read again there (Sequence::reread) rather
    // than held in registers across the steps (held, they spilled 4-8 bytes at head_dim 128, sm_80).
    auto offsets = [&] {
        return VARLEN ? Sequence<VARLEN>::reread(cu_seqlens_q, cu_seqlens_k, b, batch, seqlen_q, seqlen_k, diagonal)
                      : seq;
    };
    const Window<MASK> window{seq.diagonal, window_left, window_right};
    const QueryTiles<BLOCK_M> query_tiles(window, n0, BLOCK_N, seq.seqlen_q, group);
    const int m_begin = query_tiles.begin, m_tiles = query_tiles.count, steps = query_tiles.steps;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    const int key_a = n0 + warp * 16 + g, key_b = key_a + 8;

    // Issue the copies of step `s` into stage `s & 1`.
    auto load_step = [&](int s) {
        const int h = h_kv * group + s / m_tiles;
        const int m0 = m_begin + (s % m_tiles) * BLOCK_M;
        const int stage = s & 1;
        const Sequence<VARLEN> at = offsets();
        load_tile_async<T, BLOCK_M, HEAD_DIM, kThreads>(q_s + stage * BLOCK_M * kRow,
                                                         q + b * q_sb + at.q_start * q_ss + h * q_sh, q_ss, m0,
                                                         at.seqlen_q, head_dim, vec_ok, tid);
        load_tile_async<T, BLOCK_M, HEAD_DIM, kThreads>(do_s + stage * BLOCK_M * kRow,
                                                         dout + b * do_sb + at.q_start * do_ss + h * do_sh, do_ss,
                                                         m0, at.seqlen_q, head_dim, vec_ok, tid);
        // lse and delta through registers: load_row_stats_async (bwd_dkdv_mma's) made ptxas spill 8 bytes
        // here on sm_80 at head_dim 128
        const long long row_base = at.stats(b, heads, h);
        for (int r = tid; r < BLOCK_M; r += kThreads) {
            const bool ok = m0 + r < at.seqlen_q;
            lse2_s[stage * BLOCK_M + r] = ok ? lse[row_base + m0 + r] * kLog2e : 0.f;
            delta_s[stage * BLOCK_M + r] = ok ? delta[row_base + m0 + r] : 0.f;
        }
    };

    load_tile_async<T, BLOCK_N, HEAD_DIM, kThreads>(k_s, k + b * k_sb + seq.k_start * k_ss + h_kv * k_sh, k_ss, n0,
                                                     seq.seqlen_k, head_dim, vec_ok, tid);
    load_tile_async<T, BLOCK_N, HEAD_DIM, kThreads>(v_s, v + b * v_sb + seq.k_start * v_ss + h_kv * v_sh, v_ss, n0,
                                                     seq.seqlen_k, head_dim, vec_ok, tid);
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
        const ScoreMod<MODS> mod(scale_log2, softcap_in, softcap_out, alibi_slopes, alibi_batch_stride, b,
                                 h_kv * group + s / m_tiles);
        const Dropout<kDropout> dropout(dropout_seed, dropout_offset, dropout_threshold,
                                        b * heads + h_kv * group + s / m_tiles);
        const T* q_tile = q_s + stage * BLOCK_M * kRow;
        const T* do_tile = do_s + stage * BLOCK_M * kRow;
        const float* lse2_tile = lse2_s + stage * BLOCK_M;
        const float* delta_tile = delta_s + stage * BLOCK_M;

        // S^T = K Q^T -> P^T (16 keys x BLOCK_M queries per warp)
        float p[kMTiles][4];
        zero(p);
        warp_gemm_rows_rows<T, HEAD_DIM, kMTiles>(p, k_s + warp * 16 * kRow, q_tile, lane);
        const Sequence<VARLEN> now = offsets();
        const bool need_mask = m0 + BLOCK_M > now.seqlen_q || n0 + BLOCK_N > now.seqlen_k ||
                               !window.covers(m0, m0 + BLOCK_M, n0, n0 + BLOCK_N);
#pragma unroll
        for (int mb = 0; mb < kMTiles; ++mb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = mb * 8 + 2 * t + (e & 1);
                const int key = e < 2 ? key_a : key_b;
                float x = exp2f(mod.score(p[mb][e], m0 + col, key, seq.diagonal) - lse2_tile[col]);
                if (need_mask) {
                    if (m0 + col >= now.seqlen_q || !window.sees(m0 + col, key, now.seqlen_k)) x = 0.f;
                }
                p[mb][e] = x;
            }
        }
        // Dropout in the transposed tile (Dropout::transposed_bits): keep[mb / 2] holds the two calls of
        // 16-query block mb / 2. dV takes the kept P, dS reaches a kept P through dropout_scale * dP.
        unsigned keep[kDropout ? BLOCK_M / 16 : 1][2];
        if constexpr (kDropout) {
#pragma unroll
            for (int mb2 = 0; mb2 < BLOCK_M / 16; ++mb2)
                dropout.transposed_bits(keep[mb2], m0 + mb2 * 16 + 2 * t, key_a);
        }
        auto kept = [&](int mb, int e) {
            return Dropout<kDropout>::transposed_keeps(keep[kDropout ? mb / 2 : 0], mb, e, g);
        };
        unsigned a[BLOCK_M / 16][4];
        if constexpr (kDv) {
            if constexpr (kDropout) {
                float p_kept[kMTiles][4];
#pragma unroll
                for (int mb = 0; mb < kMTiles; ++mb)
#pragma unroll
                    for (int e = 0; e < 4; ++e) p_kept[mb][e] = kept(mb, e) ? p[mb][e] : 0.f;
                pack_a_fragments<T, kMTiles>(a, p_kept);
            } else {
                pack_a_fragments<T, kMTiles>(a, p);
            }
            warp_gemm_frag_rows<T, HEAD_DIM, BLOCK_M / 16>(dv_acc, a, do_tile, lane);   // dV += P^T dO
        }
        if constexpr (kDk && ScoreMod<MODS>::kSoftcap) {   // dV is done with P: from here p holds P * (1 - tanh^2)
#pragma unroll
            for (int mb = 0; mb < kMTiles; ++mb) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int col = mb * 8 + 2 * t + (e & 1);
                    p[mb][e] *= mod.softcap_grad(p[mb][e], lse2_tile[col], m0 + col, e < 2 ? key_a : key_b,
                                                 seq.diagonal);
                }
            }
        }
        if constexpr (kDk) {
            // dP^T = V dO^T -> dS^T = P^T * (dP^T - delta)
            float ds[kMTiles][4];
            zero(ds);
            warp_gemm_rows_rows<T, HEAD_DIM, kMTiles>(ds, v_s + warp * 16 * kRow, do_tile, lane);
#pragma unroll
            for (int mb = 0; mb < kMTiles; ++mb) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float d = ds[mb][e];
                    if constexpr (kDropout) d = kept(mb, e) ? d * dropout_scale : 0.f;
                    ds[mb][e] = p[mb][e] * (d - delta_tile[mb * 8 + 2 * t + (e & 1)]);
                }
            }
            pack_a_fragments<T, kMTiles>(a, ds);
            warp_gemm_frag_rows<T, HEAD_DIM, BLOCK_M / 16>(dk_acc, a, q_tile, lane);    // dK += dS^T Q
            if constexpr (ATOMIC_DQ) {
                // This warp's 16 rows of dS^T, as the packed words of `a` (accumulator layout).
                T* ds_rows = ds_s + warp * 16 * kDsRow;
#pragma unroll
                for (int mb = 0; mb < kMTiles; ++mb) {
                    *reinterpret_cast<unsigned*>(ds_rows + g * kDsRow + mb * 8 + 2 * t) = a[mb / 2][(mb % 2) * 2];
                    *reinterpret_cast<unsigned*>(ds_rows + (g + 8) * kDsRow + mb * 8 + 2 * t) = a[mb / 2][(mb % 2) * 2 + 1];
                }
                __syncthreads();
                const int h = h_kv * group + s / m_tiles;
                // rows m0.. of this head (the banded grid: one copy)
                float* dq_query_tile = dq_accum + DqAccum::head(0, batch, b, heads, h, offsets(), seqlen_q, HEAD_DIM) +
                                       DqAccum::tile(m0, 0, HEAD_DIM);
#pragma unroll
                for (int it = 0; it < (kDqItems + kWarps - 1) / kWarps; ++it) {
                    const int item = warp + it * kWarps;
                    if (kDqItems % kWarps != 0 && item >= kDqItems) break;
                    const int row0 = (item % (BLOCK_M / 16)) * 16, col0 = (item / (BLOCK_M / 16)) * kDqCols;
                    unsigned ds_frag[BLOCK_N / 16][4];   // dS rows row0.., k = the block's keys
#pragma unroll
                    for (int kk = 0; kk < BLOCK_N / 16; ++kk)
                        load_a_transposed<T>(ds_frag[kk], ds_s + kk * 16 * kDsRow + row0, kDsRow, lane);
                    float dq_part[1][kDqCols / 8][4];   // one 16-row atom
                    zero(dq_part);
                    warp_gemm_frag_rows<T, HEAD_DIM, BLOCK_N / 16, kDqCols>(dq_part[0], ds_frag, k_s + col0, lane);
                    if (m0 + row0 < seq.seqlen_q)   // an atom past the end adds zeros (its P and dS are)
                        dq_accum_add<HEAD_DIM>(dq_query_tile, row0, col0, dq_part, lane);
                }
            }
        }
        __syncthreads();   // this stage (and dS^T) is refilled by step s + 1
    }
    cp_async_wait<0>();

    const long long kv_head = b * dk_sb + offsets().k_start * dk_ss + h_kv * dk_sh;
    using WarpRows = const float(&)[1][kDTiles][4];   // the store_tile view of a 16-row accumulator
    const int key0 = n0 + warp * 16;
    if constexpr (kDk)
        store_tile<T>(dk + kv_head, dk_ss, key0, seq.seqlen_k, 0, head_dim, reinterpret_cast<WarpRows>(dk_acc), scale,
                      lane);
    if constexpr (kDv)
        store_tile<T>(dv + kv_head, dk_ss, key0, seq.seqlen_k, 0, head_dim, reinterpret_cast<WarpRows>(dv_acc),
                      kDropout ? dropout_scale : 1.f, lane);
}

// dQ. Block: BLOCK_M queries of one (batch, head) over WARPS warps, BLOCK_M / WARPS rows (kMAtoms
// stacked 16-row atoms) per warp, so every K and V fragment read from shared memory feeds kMAtoms mma
// instructions. Q and dO stay in shared memory while K and V tiles of BLOCK_N keys stream through two
// cp.async stages (the forward's structure). dS stays in registers as the A operand of dS K.
//
// Its shared memory, offsets in elements of T: Q, dO [BLOCK_M][kRow]; K, V [2][BLOCK_N][kRow]. kBytes is what
// the launch gives it (_config.mma_smem_bytes, checked by tests/test_compile.py).
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N> struct DqSmem {
    static constexpr int kRow = PaddedRow<HEAD_DIM>::kElems;
    static constexpr int kDo = BLOCK_M * kRow, kK = kDo + BLOCK_M * kRow, kV = kK + 2 * BLOCK_N * kRow;
    static constexpr int kBytes = (kV + 2 * BLOCK_N * kRow) * static_cast<int>(sizeof(T));
};

template <typename T, int HEAD_DIM, int MASK, int MODS, int BLOCK_M, int BLOCK_N, int WARPS, bool VARLEN>
__global__ void __launch_bounds__(WARPS * 32, 1) bwd_dq_mma(CUFLASH_PARAMS(CUFLASH_BWD_FIELDS)) {
    constexpr int kThreads = WARPS * 32;
    constexpr int kRowsPerWarp = BLOCK_M / WARPS;
    constexpr int kMAtoms = kRowsPerWarp / 16;
    constexpr int kRow = PaddedRow<HEAD_DIM>::kElems;
    constexpr int kNTiles = BLOCK_N / 8;
    constexpr int kDTiles = HEAD_DIM / 8;
    static_assert(BLOCK_M % (16 * WARPS) == 0 && BLOCK_N % 16 == 0, "tiles are made of 16 x 16 mma blocks");

    using Smem = DqSmem<T, HEAD_DIM, BLOCK_M, BLOCK_N>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* q_s = reinterpret_cast<T*>(smem_raw);
    T* do_s = q_s + Smem::kDo;
    T* k_s = q_s + Smem::kK;
    T* v_s = q_s + Smem::kV;

    const QueryBlock blk(BLOCK_M, batch, heads, group, seqlen_q, batch * heads);   // one section
    const int bh = blk.bh, b = blk.b, h = blk.h, h_kv = blk.h_kv, m0 = blk.m0;
    const Sequence<VARLEN> seq(cu_seqlens_q, cu_seqlens_k, b, batch, seqlen_q, seqlen_k, diagonal);
    if (VARLEN && m0 >= seq.seqlen_q) return;
    const Window<MASK> window{seq.diagonal, window_left, window_right};
    const ScoreMod<MODS> mod(scale_log2, softcap_in, softcap_out, alibi_slopes, alibi_batch_stride, b, h);
    constexpr bool kDropout = (MODS & kModDropout) != 0;
    const Dropout<kDropout> dropout(dropout_seed, dropout_offset, dropout_threshold, bh);
    // the key tiles this block's rows see: key_first, then n_tiles tiles
    const int key_first = window.key_begin(m0) / BLOCK_N * BLOCK_N;
    const int n_end = window.key_end(m0 + BLOCK_M, seq.seqlen_k);
    const int n_tiles = (n_end - key_first + BLOCK_N - 1) / BLOCK_N;   // <= 0 where no row sees a key
    const T* k_head = k + b * k_sb + seq.k_start * k_ss + h_kv * k_sh;
    const T* v_head = v + b * v_sb + seq.k_start * v_ss + h_kv * v_sh;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    const int warp_row0 = warp * kRowsPerWarp;
    const long long row_base = VARLEN ? seq.stats(b, heads, h) : static_cast<long long>(bh) * seqlen_q;
    // lse (base 2) and delta of this thread's rows (g and g + 8 of each atom); rows past the end see nothing
    float lse2[kMAtoms][2], dlt[kMAtoms][2];
#pragma unroll
    for (int ma = 0; ma < kMAtoms; ++ma) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = m0 + warp_row0 + ma * 16 + g + 8 * r;
            lse2[ma][r] = row < seq.seqlen_q ? lse[row_base + row] * kLog2e : 0.f;
            dlt[ma][r] = row < seq.seqlen_q ? delta[row_base + row] : 0.f;
        }
    }

    load_tile_async<T, BLOCK_M, HEAD_DIM, kThreads>(q_s, q + b * q_sb + seq.q_start * q_ss + h * q_sh, q_ss, m0,
                                                     seq.seqlen_q, head_dim, vec_ok, tid);
    load_tile_async<T, BLOCK_M, HEAD_DIM, kThreads>(do_s, dout + b * do_sb + seq.q_start * do_ss + h * do_sh, do_ss, m0,
                                                     seq.seqlen_q, head_dim, vec_ok, tid);
    if (n_tiles > 0) {
        load_tile_async<T, BLOCK_N, HEAD_DIM, kThreads>(k_s, k_head, k_ss, key_first, seq.seqlen_k, head_dim, vec_ok,
                                                         tid);
        load_tile_async<T, BLOCK_N, HEAD_DIM, kThreads>(v_s, v_head, v_ss, key_first, seq.seqlen_k, head_dim, vec_ok,
                                                         tid);
    }
    cp_async_commit();

    float dq_acc[kMAtoms][kDTiles][4];
    zero(dq_acc);
    for (int j = 0; j < n_tiles; ++j) {
        const int stage = j & 1;
        if (j + 1 < n_tiles) {
            const int nxt = key_first + (j + 1) * BLOCK_N;
            load_tile_async<T, BLOCK_N, HEAD_DIM, kThreads>(k_s + (stage ^ 1) * BLOCK_N * kRow, k_head, k_ss, nxt,
                                                             seq.seqlen_k, head_dim, vec_ok, tid);
            load_tile_async<T, BLOCK_N, HEAD_DIM, kThreads>(v_s + (stage ^ 1) * BLOCK_N * kRow, v_head, v_ss, nxt,
                                                             seq.seqlen_k, head_dim, vec_ok, tid);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const T* k_tile = k_s + stage * BLOCK_N * kRow;
        const T* v_tile = v_s + stage * BLOCK_N * kRow;
        const int n0 = key_first + j * BLOCK_N;
        const bool need_mask = m0 + BLOCK_M > seq.seqlen_q || n0 + BLOCK_N > seq.seqlen_k ||
                               !window.covers(m0, m0 + BLOCK_M, n0, n0 + BLOCK_N);

        // P = exp2(S * scale_log2 - lse2), S = Q K^T
        float p[kMAtoms][kNTiles][4];
        zero(p);
        warp_mma<T, kMAtoms, kNTiles, HEAD_DIM / 16>(
            p,
            [&](unsigned (&a)[4], int ma, int ks) {
                load_a(a, q_s + (warp_row0 + ma * 16) * kRow + ks * 16, kRow, lane);
            },
            [&](unsigned (&bf)[4], int nb, int ks) { load_b(bf, k_tile + nb * 8 * kRow + ks * 16, kRow, lane); });
#pragma unroll
        for (int ma = 0; ma < kMAtoms; ++ma) {
#pragma unroll
            for (int nb = 0; nb < kNTiles; ++nb) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = m0 + warp_row0 + ma * 16 + g + 8 * (e / 2);
                    const int key = n0 + nb * 8 + 2 * t + (e & 1);
                    float grad;   // P only feeds dS here: p holds P * (1 - tanh^2) under a softcap
                    float x = exp2f(mod.score(p[ma][nb][e], row, key, seq.diagonal, grad) - lse2[ma][e / 2]);
                    if (need_mask) {
                        if (row >= seq.seqlen_q || !window.sees(row, key, seq.seqlen_k)) x = 0.f;
                    }
                    p[ma][nb][e] = x * grad;
                }
            }
        }
        // dS = P * (dP - delta), dP = dO V^T; packed into A fragments of dS K. Under dropout dP reaches a
        // kept P scaled by dropout_scale and a dropped one not at all (one Philox call per 32 keys of a row,
        // per 16 past head_dim 128).
        unsigned ds_frag[kMAtoms][BLOCK_N / 16][4];
        {
            float dp[kMAtoms][kNTiles][4];
            zero(dp);
            warp_mma<T, kMAtoms, kNTiles, HEAD_DIM / 16>(
                dp,
                [&](unsigned (&a)[4], int ma, int ks) {
                    load_a(a, do_s + (warp_row0 + ma * 16) * kRow + ks * 16, kRow, lane);
                },
                [&](unsigned (&bf)[4], int nb, int ks) { load_b(bf, v_tile + nb * 8 * kRow + ks * 16, kRow, lane); });
#pragma unroll
            for (int ma = 0; ma < kMAtoms; ++ma) {
                unsigned keep = ~0u;
#pragma unroll
                for (int nb = 0; nb < kNTiles; ++nb) {
                    if constexpr (kDropout) {
                        // a call's two 16 x 16 blocks where the tile holds both (n0 a multiple of BLOCK_N), but
                        // past head_dim 128, where holding both blocks' bits made ptxas spill 12-136 bytes; one
                        // compare per draw (SERIAL), where the four-at-once one spilled
                        constexpr int kCallTiles = BLOCK_N % 32 == 0 && HEAD_DIM <= 128 ? 4 : 2;
                        if (nb % kCallTiles == 0) {
                            const int row = m0 + warp_row0 + ma * 16 + g, key = n0 + nb * 8 + 2 * t;
                            keep = kCallTiles == 4 ? dropout.template bits2<true>(row, key)
                                                   : dropout.template bits<true>(row, key);
                        }
                        const int block_bit = kCallTiles == 4 ? 8 * ((nb >> 1) & 1) : 0;
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int bit = block_bit + Dropout<kDropout>::keep_bit(e >> 1, nb & 1, e & 1);
                            dp[ma][nb][e] = (keep >> bit) & 1u ? dp[ma][nb][e] * dropout_scale : 0.f;
                        }
                    }
#pragma unroll
                    for (int e = 0; e < 4; ++e) dp[ma][nb][e] = p[ma][nb][e] * (dp[ma][nb][e] - dlt[ma][e / 2]);
                }
                pack_a_fragments<T, kNTiles>(ds_frag[ma], dp[ma]);
            }
        }
        // dQ += dS K
        warp_mma<T, kMAtoms, kDTiles, BLOCK_N / 16>(
            dq_acc,
            [&](unsigned (&a)[4], int ma, int ks) {
#pragma unroll
                for (int i = 0; i < 4; ++i) a[i] = ds_frag[ma][ks][i];
            },
            [&](unsigned (&bf)[4], int nb, int ks) { load_b_trans(bf, k_tile + ks * 16 * kRow + nb * 8, kRow, lane); });
        __syncthreads();
    }
    cp_async_wait<0>();
    store_tile<T>(dq + b * dq_sb + seq.q_start * dq_ss + h * dq_sh, dq_ss, m0 + warp_row0, seq.seqlen_q, 0, head_dim,
                  dq_acc, scale, lane);
}

// dq = dq_accum * scale, cast to T: the last step of the backwards that add dQ into dq_accum. blockIdx.y walks
// the (batch, head) pairs of a copy (in a packed batch its heads), blockIdx.x and the thread one pair's rows:
// one thread per row of a 16 x 8 tile of dq_accum (DqAccum layout), the 16 rows of a tile on consecutive
// threads: a warp reads two whole tiles (the four lanes of a tile row gave two floats each), and writes its
// row's 8 columns as one 16-byte store, the two tiles' stores of a row side by side. (One thread per tile lane
// wrote 4-byte pieces: 1.5x FlashAttention-2's time, bench/NOTES.md backward v7.) Within a pair the index
// math is 32-bit by constants: a 64-bit division by the pair's rows took more time than the bytes (bench/NOTES.md
// "The dQ conversion"). With several copies (the deterministic split grid, KeyBlock), each thread sums its
// values over the copies in copy order, so the sum is the same on every run. In a packed batch a thread finds
// the sequence of its row by a binary search of the prefix sums; there the launch bounds ask for 2 blocks per
// SM (up to 128 registers): without a minimum ptxas aimed at 40 and spilled 8 bytes (sm_80), with 4 (64) it
// spilled 4 (sm_90).
template <typename T, int HEAD_DIM, bool VARLEN>
__global__ void __launch_bounds__(256, VARLEN ? 2 : 0)
bwd_dq_convert(const float* __restrict__ dq_accum, T* __restrict__ dq, const int* __restrict__ cu_seqlens_q,
               long long dq_sb, long long dq_ss, long long dq_sh, int batch, int heads, int seqlen_q, int head_dim,
               float scale, int copies) {
    constexpr int kColTiles = HEAD_DIM / 8;
    // a pair's rows: DqAccum::rows(seqlen_q), or in a packed batch a head's DqAccum::packed_rows
    const long long pair_rows = VARLEN ? DqAccum::packed_rows(batch, cu_seqlens_q[batch]) : DqAccum::rows(seqlen_q);
    const int pair_threads = static_cast<int>(pair_rows / 16) * kColTiles * 16;   // a thread per tile row
    const int pairs = VARLEN ? heads : batch * heads;
    const long long copy_floats = static_cast<long long>(pairs) * pair_rows * HEAD_DIM;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= pair_threads) return;
    const int r = i % 16, tile = i / 16;   // the thread's row in its tile; the tile in the pair, DqAccum's order
    const int col0 = tile % kColTiles * 8;
    const int pair_row = tile / kColTiles * 16 + r;
    for (int bh = blockIdx.y; bh < pairs; bh += gridDim.y) {   // in a packed batch, bh is the head
        int row = pair_row;
        T* dst;
        if constexpr (VARLEN) {   // the sequence whose rows hold packed row `row`: the last starting at or before it
            int lo = 0, hi = batch - 1;
            while (lo < hi) {
                const int mid = (lo + hi + 1) / 2;
                if (DqAccum::packed_row(mid, cu_seqlens_q[mid]) <= row) lo = mid; else hi = mid - 1;
            }
            const int q_start = cu_seqlens_q[lo];
            row -= static_cast<int>(DqAccum::packed_row(lo, q_start));
            if (row >= cu_seqlens_q[lo + 1] - q_start) continue;
            dst = dq + (static_cast<long long>(q_start) + row) * dq_ss + bh * dq_sh + col0;
        } else {
            if (row >= seqlen_q) continue;
            dst = dq + (bh / heads) * dq_sb + row * dq_ss + (bh % heads) * dq_sh + col0;
        }
        // lane g * 4 + t of the tile holds (row g, columns 2t, 2t + 1) at floats 0, 1 and (row g + 8, the
        // same columns) at floats 2, 3
        const float* src =
            dq_accum + (static_cast<long long>(bh) * pair_rows * HEAD_DIM + static_cast<long long>(tile) * 128) +
            (r % 8) * 16 + (r / 8) * 2;
        float vals[8];
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const float2 x = *reinterpret_cast<const float2*>(src + t * 4);
            vals[2 * t] = x.x;
            vals[2 * t + 1] = x.y;
        }
        for (int c = 1; c < copies; ++c) {
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                const float2 x = *reinterpret_cast<const float2*>(src + c * copy_floats + t * 4);
                vals[2 * t] += x.x;
                vals[2 * t + 1] += x.y;
            }
        }
        if (col0 + 8 <= head_dim && reinterpret_cast<unsigned long long>(dst) % 16 == 0) {
            uint4 packed;
            unsigned* words = reinterpret_cast<unsigned*>(&packed);
#pragma unroll
            for (int t = 0; t < 4; ++t) words[t] = pack2<T>(vals[2 * t] * scale, vals[2 * t + 1] * scale);
            *reinterpret_cast<uint4*>(dst) = packed;
        } else {
            for (int e = 0; e < 8 && col0 + e < head_dim; ++e) dst[e] = from_float<T>(vals[e] * scale);
        }
    }
}

}  // namespace cuflash
