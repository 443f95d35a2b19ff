// The backward's dK/dV (and dQ, added into a float32 buffer) on Hopper (sm_90a): wgmma, TMA, warp
// specialization. The algorithm is bwd_dkdv_mma's (bwd_mma.cu) with dQ added into the float32 buffer (DqAccum)
// and bwd_dq_convert after it;
// head_dim 64, 128 and 256, float16/bfloat16, every mask, score modifier and dropout (the plan runs the
// mma.sync kernels for the rest). deterministic=True runs its ordered form (ORDERED_DQ, below).
//
// One thread block owns BLOCK_N keys of one (batch, kv head) (KeyBlock's banded grid) and walks the query tiles
// of every head of its kv group that see them, BLOCK_M rows at a time (steps: head in group, query tile
// fastest): 128 at head_dim 64 (kTallSteps, below; _config.wgmma_dkdv_block_m), else 64. Warpgroups:
// - 0, the producer: thread 0 loads K and V once, then each step's Q and dO tiles by TMA into two stages;
//   warp 1 copies the step's lse and delta (BLOCK_M floats each) into the stage (and, kRowFromStage, the step's
//   first query row); the stage's "full" mbarrier
//   completes on both, and it is refilled once both consumers (at 256: two lanes of the dQ writer, below) have
//   arrived on its "empty" one.
// - 1 and 2, the consumers, holding dK and dV of 64 keys in registers for the whole block. At head_dim 64 and
//   128, BLOCK_N = 128 and each takes 64 keys (rows 64 cw.. of the block) and every column. At 256 (dK and dV
//   of 64 keys would take 256 registers a thread), BLOCK_N = 64 and each takes every key and 128 columns (128
//   cw..): both compute the block's S^T and dP^T (seven products' work for five), and consumer 0 alone stores
//   dS^T. Per step, with keys as the M dimension of every product:
//     S^T = K Q^T, dP^T = V dO^T          (wgmma ss, both K-major)
//     P^T = exp2(score(S^T) - lse2), dS^T = P^T (dP^T - delta) score'   (per element: lse, delta per query;
//     score and its derivative from ScoreMod: scale, softcap, ALiBi; ALiBi alone starts S^T at its bias, init_st)
//     dV += P^T dO, dK += dS^T Q          (wgmma rs: P^T, dS^T packed into A fragments; dO, Q MN-major)
//     Under dropout (Dropout draws the forward's mask Z again) dV takes the kept P^T (dV is scaled by
//     dropout_scale at the end) and dS^T = P^T (Z dP^T dropout_scale - delta) score': a dropped element's
//     dP does not reach it.
//     dS^T into shared memory, then dQ = dS K (wgmma ss, both MN-major: dS^T's rows are keys, K's are keys),
//     added into dq_accum (DqAccum's 16 x 8 tile order, in which a warp's share of 16 rows by 64 columns is
//     contiguous) by the TMA unit, one bulk reduce-add per share: up to head_dim 128 each warp stores its share
//     into its own shared buffer and one lane adds it; at 256, where those buffers do not fit, each consumer
//     stages its shares in its own column blocks of the step's Q (first pass) and dO (second pass), which its
//     dK and dV products have read by then (the other consumer's read only its own blocks, and both S^T and
//     dP^T are done before the consumers meet for dQ), and warp 2 of the producer warpgroup (the dQ writer)
//     adds them and frees the stage once the adds have read it.
//     The consumers meet (named barrier), and at head_dim 128 each takes 64 of the columns over all 128 keys;
//     at 64 (128-row steps) each takes 64 of the queries over all 128 keys; at 256 each takes its 128 columns
//     over the 64 keys, 64 columns per pass.
//   dS^T is double-buffered: the step s + 1 barrier orders step s's dQ reads before step s + 2's writes.
//   At head_dim 64 and 128 (FlashAttention-3's order within a step): S^T and dP^T are two groups, P^T computed
//   while dP^T runs (not under the softcap, nor at 64 under ALiBi or in the ordered form); dV is issued before
//   the consumers meet, dK after dQ, and dQ is stored and added while dK runs.
// Epilogue: dK times the softmax scale, and dV, staged in shared memory where K and V were and stored in whole
// 16-byte chunks of key rows.
//
// The ordered form (deterministic; after FlashAttention-3's dQ semaphores) keeps the default's banded grid and
// its one dq_accum, and adds each share into it in a fixed order of the key blocks: warp 2 of the producer
// warpgroup (with warp 3 at 256: kWriterWarps), the dQ writer, takes the consumer warps' buffers (named
// barriers), waits until the share's count in dq_order says that the key blocks before this one have added, adds
// by the TMA unit, and counts (at head_dim 256 from the stage, as the default's writer does). The order, and the
// walk of the query tiles that matches it (QueryTiles):
// - where a pair's key blocks run side by side (KeyBlock's dq_pass 1: all resident together), each tile's adds
//   come in the order in which its key blocks reach it, so that a key block never waits for one still steps
//   behind: under a mask, key block j walks its tiles upwards from its first, and a tile's adds come from its
//   highest key block downwards (the higher a key block, the earlier it reaches a tile); without one, key block
//   j starts at tile j * stride (stride = tiles / key blocks, 0 where the key blocks outnumber the tiles) and
//   walks upwards, wrapping from the last tile to the first, so that at each step the key blocks are at
//   different tiles, and a tile's adds come from the highest key block starting at or below it downwards,
//   wrapping from key block 0 to the last. Every wait is on a key block that reached the tile at an earlier
//   step (or the same one), so none waits in a cycle. Measured on an H100 against the key-block order on this
//   grid and on the wave-sized bands: bench/NOTES.md session 38.
// - else (the wave-sized bands, where key block j may start only after key block j - 1 has) in key-block
//   order, so that key blocks wait only on lower blockIdx.x (KeyBlock numbers a head's key blocks upwards),
//   which the GPU starts earlier; under a mask the tiles are walked downwards, so that every key block reaches
//   a tile at about the same step (upwards, key block n would reach it a step before key block n - 1 does).
// The consumers never touch a count: on their path the round trips cost 20% (bench/NOTES.md b7).
// The deterministic split grid (KeyBlock's dq_splits) runs the default's form at every head dim (at 64 the 128-row
// steps split dQ by queries, so one consumer adds each element there too).
#include "hopper.cuh"

namespace cuflash {

constexpr int kBwdWgmmaStages = 2;   // Q/dO stages

// bwd_dkdv_wgmma's shared memory, bytes (128-byte swizzled [rows][64] blocks as TMA writes them):
// K, V [HEAD_DIM / 64][BLOCK_N][64]; Q, dO stages [2][HEAD_DIM / 64][BLOCK_M][64]; dS^T stages
// [2][BLOCK_M / 64][BLOCK_N][64] (a 128-byte row per key and 64 queries); up to head_dim 128 (kBulkDq), each
// consumer warp's dQ share [16][64] float in DqAccum's tile order (at 256 the shares are staged in the Q and dO
// stages: kStagedDq); lse, delta stages [2][BLOCK_M] float; each stage's first query row [2] int
// (kRowFromStage); then the mbarriers: kv_full, q_full[2], q_empty[2].
template <int HEAD_DIM, int BLOCK_M, int BLOCK_N> struct BwdWgmmaSmem {
    // dQ leaves through buffers of its own, added into dq_accum by the TMA unit, where they fit (at 256 two
    // consumers' 32 KB do not fit beside the rest; there the shares are staged in the step's Q and dO)
    static constexpr bool kBulkDq = HEAD_DIM <= 128;
    static constexpr int kColBlocks = HEAD_DIM / kSwizzleElems;
    static constexpr int kKVBlock = BLOCK_N * kSwizzleRowBytes, kKV = kColBlocks * kKVBlock;
    static constexpr int kQBlock = BLOCK_M * kSwizzleRowBytes, kQStage = kColBlocks * kQBlock;
    static constexpr int kDsBlock = BLOCK_N * kSwizzleRowBytes, kDsStage = BLOCK_M / 64 * kDsBlock;
    static constexpr int kDqWarp = 16 * 64 * 4, kDqBytes = kBulkDq ? 8 * kDqWarp : 0;   // 8 consumer warps
    static constexpr int kV = kKV, kQ = kV + kKV, kDo = kQ + kBwdWgmmaStages * kQStage;
    static constexpr int kDs = kDo + kBwdWgmmaStages * kQStage, kDq = kDs + kBwdWgmmaStages * kDsStage;
    static constexpr int kStats = kDq + kDqBytes, kRows = kStats + kBwdWgmmaStages * 2 * BLOCK_M * 4;
    static constexpr int kBarriers = kRows + kBwdWgmmaStages * 4;
    static constexpr int kBytes = kBarriers + 8 * (1 + 2 * kBwdWgmmaStages);
};

// ORDERED_DQ: the ordered form (deterministic, below), its own specialization: the default's code has no
// branch for it (a runtime branch for a deterministic form cost the default 5-15%: bench/NOTES.md b9). The
// deterministic split grid (dq_splits > 0) runs the default's form: one thread adds each dQ element of a launch.
template <typename T, int HEAD_DIM, int MASK, int MODS, int BLOCK_M, int BLOCK_N, bool ORDERED_DQ, bool VARLEN>
__global__ void __launch_bounds__(384, 1)
bwd_dkdv_wgmma(const __grid_constant__ TmaMap q_map, const __grid_constant__ TmaMap k_map,
               const __grid_constant__ TmaMap v_map, const __grid_constant__ TmaMap do_map,
               CUFLASH_PARAMS(CUFLASH_BWD_FIELDS)) {
    // the consumers split the block's keys (BLOCK_N 128) or, at head_dim 256, its columns (BLOCK_N 64)
    constexpr bool kKeySplit = HEAD_DIM <= 128;
    // 128-row steps (head_dim 64): each consumer's S^T and dP^T of 64 keys by 128 queries, and dQ split by queries
    // (consumer cw takes rows 64 cw.. of the step)
    constexpr bool kTallSteps = BLOCK_M == 128;
    static_assert(sizeof(T) == 2 && (HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256) &&
                      BLOCK_M == (HEAD_DIM == 64 ? 128 : 64) && BLOCK_N == (kKeySplit ? 128 : 64),
                  "head_dim 64 or 128 with two consumers of 64 keys, 256 with two of 128 columns; 128-row query tiles "
                  "at head_dim 64, else 64");
    constexpr bool kDropout = (MODS & kModDropout) != 0;
    using Smem = BwdWgmmaSmem<HEAD_DIM, BLOCK_M, BLOCK_N>;
    constexpr int kConsumers = 2;
    constexpr bool kOrdered = ORDERED_DQ;
    // the consumers read each step's first query row from the stage (warp 1 of the producer stores it) in the
    // ordered form at 64-row steps without a mask: there its walk's first tile in their registers spilled 4 bytes
    // (head_dim 128, every modifier), and elsewhere the read did (4 bytes under a mask at 256, and at 64 with the
    // softcap and ALiBi; NVRTC 13.0, sm_90a)
    constexpr bool kRowFromStage = kOrdered && !Window<MASK>::kMasked && !kTallSteps;
    // at head_dim 256 each consumer's dQ shares of a step (two passes of 4 warps' 16 x 64 floats) are staged in
    // its column blocks of the step's Q and dO, one tensor per pass, and the dQ writer adds them
    constexpr bool kStagedDq = !Smem::kBulkDq;
    // the dQ writer's warps (2, and 3 where two): two in the ordered form at 256, one per stage (warp 2 + s % 2
    // takes step s), so that one step's wait for its adds to complete, before it counts them, runs beside the
    // next step's wait and add (bench/NOTES.md session 40)
    constexpr int kWriterWarps = ORDERED_DQ && kStagedDq ? kBwdWgmmaStages : 1;
    constexpr int kConsumerColBlocks = Smem::kColBlocks / kConsumers;
    static_assert(!kStagedDq || (!kKeySplit && 4 * Smem::kDqWarp == kConsumerColBlocks * Smem::kQBlock),
                  "a consumer's 4 warps' shares of one pass fill its column blocks of a Q or dO stage");
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const unsigned k_s = smem_addr(smem_raw), v_s = k_s + Smem::kV, q_s = k_s + Smem::kQ, do_s = k_s + Smem::kDo;
    const unsigned ds_s = k_s + Smem::kDs, bars = k_s + Smem::kBarriers;
    float* const stats_s = reinterpret_cast<float*>(smem_raw + Smem::kStats);   // [stage][lse, delta][BLOCK_M]
    int* const rows_s = reinterpret_cast<int*>(smem_raw + Smem::kRows);          // [stage] (kRowFromStage)
    const unsigned kv_full = bars;
    auto q_full = [&](int stage) { return bars + 8 * (1 + stage); };
    auto q_empty = [&](int stage) { return bars + 8 * (1 + kBwdWgmmaStages + stage); };
    // kStagedDq: where warp `warp` of consumer `consumer` stages its share of dQ pass `pass` of a step in `stage`
    auto staged_dq = [&](int stage, int consumer, int pass, int warp) {
        return (pass == 0 ? q_s : do_s) + stage * Smem::kQStage + consumer * kConsumerColBlocks * Smem::kQBlock +
               warp * Smem::kDqWarp;
    };
    // the first query row of consumer `consumer`'s dQ share of a step: its 64 rows of a 128-row step, else row 0
    auto dq_share_row = [](int consumer) { return kTallSteps ? 64 * consumer : 0; };

    // the banded grid (dq_splits 0), or the deterministic split grid: block `split` adds into its own copy of
    // dq_accum, and one thread adds each element there (head_dim 128 and 256), so the sums are reproducible
    const KeyBlock blk(BLOCK_N, heads / group, seqlen_k, dq_splits, dq_pass);
    const int b = blk.b, h_kv = blk.h_kv, n0 = blk.n0;
    const Sequence<VARLEN> seq(cu_seqlens_q, cu_seqlens_k, b, batch, seqlen_q, seqlen_k, diagonal);
    if (n0 >= seq.seqlen_k) return;   // a packed batch's shorter sequence, the split grid's last pass
    const Window<MASK> window{seq.diagonal, window_left, window_right};
    // the ordered form's walk of the query tiles (above)
    QueryTiles<BLOCK_M, kOrdered> query_tiles(window, n0, BLOCK_N, seq.seqlen_q, group);
    const bool side_by_side = kOrdered && dq_pass != 0;
    const int key_block = n0 / BLOCK_N, key_blocks = (seq.seqlen_k + BLOCK_N - 1) / BLOCK_N;
    const int stride = query_tiles.count / key_blocks;
    if constexpr (kOrdered) {
        if (!side_by_side) query_tiles.downwards = Window<MASK>::kMasked;
        else if (!Window<MASK>::kMasked) query_tiles.first = key_block * stride;
    }
    const int steps = query_tiles.steps;
    // dQ's named barriers in the ordered form: consumer warpgroup i, whose warps' buffers the dQ writer adds,
    // arrives on dq_full(i, s) once its buffers hold step s's shares, the writer on kDqEmptyBarrier + i once it
    // has read them. Staged (256), the stage is the buffer and the writer frees it (q_empty): with nothing to hold
    // a consumer until the writer has taken step s, it may arrive for step s + 1 first, so dq_full alternates
    // between two barriers by step (step s + 2 needs the stage that the writer frees after taking step s).
    constexpr int kDqFullBarrier = 4;
    constexpr int kDqFullPerConsumer = kStagedDq ? kBwdWgmmaStages : 1;
    constexpr int kDqEmptyBarrier = kDqFullBarrier + kConsumers * kDqFullPerConsumer, kDqBarrierThreads = 128 + 32;
    auto dq_full = [&](int consumer, int s) {
        return kDqFullBarrier + consumer * kDqFullPerConsumer + s % kDqFullPerConsumer;
    };

    const int warpgroup = threadIdx.x / 128, tid_wg = threadIdx.x % 128;
    if (threadIdx.x == 0) {
        mbarrier_init(kv_full, 1);
        for (int stage = 0; stage < kBwdWgmmaStages; ++stage) {
            mbarrier_init(q_full(stage), 2);   // the TMA thread's expected bytes and the stats warp's arrival
            mbarrier_init(q_empty(stage), kConsumers);
        }
        mbarrier_init_fence();
    }
    __syncthreads();

    if (warpgroup == 0) {   // the producer
        warpgroup_registers_decrease<24>();
        const int batch_coord = VARLEN ? 0 : b;
        if (tid_wg == 0 && steps > 0) {   // (no loads in flight when the block has no step and ends)
            const int k_row = static_cast<int>(seq.k_start) + n0;
            mbarrier_expect_bytes(kv_full, 2 * Smem::kKV);
            for (int c = 0; c < Smem::kColBlocks; ++c) {
                tma_load_4d(k_s + c * Smem::kKVBlock, k_map, kv_full, c * kSwizzleElems, h_kv, k_row, batch_coord);
                tma_load_4d(v_s + c * Smem::kKVBlock, v_map, kv_full, c * kSwizzleElems, h_kv, k_row, batch_coord);
            }
            for (int s = 0; s < steps; ++s) {
                const int stage = s % kBwdWgmmaStages;
                if (s >= kBwdWgmmaStages) mbarrier_wait(q_empty(stage), (s / kBwdWgmmaStages - 1) & 1);
                const int q_row = static_cast<int>(seq.q_start) + query_tiles.row(s);
                const int h = query_tiles.head(s, h_kv, group);
                mbarrier_expect_bytes(q_full(stage), 2 * Smem::kQStage);
                for (int c = 0; c < Smem::kColBlocks; ++c) {
                    tma_load_4d(q_s + stage * Smem::kQStage + c * Smem::kQBlock, q_map, q_full(stage),
                                c * kSwizzleElems, h, q_row, batch_coord);
                    tma_load_4d(do_s + stage * Smem::kQStage + c * Smem::kQBlock, do_map, q_full(stage),
                                c * kSwizzleElems, h, q_row, batch_coord);
                }
            }
        } else if (tid_wg / 32 == 1) {   // warp 1: lse and delta of each step; rows past seqlen_q read 0
            const int lane = tid_wg % 32;
            for (int s = 0; s < steps; ++s) {
                const int stage = s % kBwdWgmmaStages;
                if (s >= kBwdWgmmaStages) mbarrier_wait(q_empty(stage), (s / kBwdWgmmaStages - 1) & 1);
                const long long base = seq.stats(b, heads, query_tiles.head(s, h_kv, group));
                float* dst = stats_s + stage * 2 * BLOCK_M;
                for (int r = lane; r < BLOCK_M; r += 32) {
                    const int row = query_tiles.row(s) + r;
                    const bool ok = row < seq.seqlen_q;
                    dst[r] = ok ? lse[base + row] : 0.f;
                    dst[BLOCK_M + r] = ok ? delta[base + row] : 0.f;
                }
                if (kRowFromStage && lane == 0) rows_s[stage] = query_tiles.row(s);
                __syncwarp();
                if (lane == 0) mbarrier_arrive(q_full(stage));   // release: the stores above are visible
            }
        } else if ((kOrdered || kStagedDq) && tid_wg / 32 >= 2 && tid_wg / 32 < 2 + kWriterWarps) {   // dQ writer
            // Lane l < 4 kConsumers adds the share of warp l % 4 of consumer l / 4 (16 rows by 64 columns, in
            // that warp's buffer) into dq_accum; in the ordered form once the key blocks before this one that add
            // into the share have (its count in dq_order reaches them: the lowest of them holds the first key that
            // the tile's first row sees), counting this block's add once it is performed. Staged (256), lane
            // l < 16 adds pass l / 8 of warp l % 4 of consumer l / 4 % 2 from the stage.
            const int lane = tid_wg % 32, consumer = kStagedDq ? lane / 4 % kConsumers : lane / 4;
            const int writer_warp = lane % 4, dq_pass = kStagedDq ? lane / 8 : 0;
            const bool adds = lane < 4 * kConsumers * (kStagedDq ? 2 : 1);
            // the lane's buffer: its warp's (stage 0's where staged: the step's stage adds kQStage times it)
            const unsigned buffer = kStagedDq ? staged_dq(0, consumer, dq_pass, writer_warp)
                                              : k_s + Smem::kDq + (4 * consumer + writer_warp) * Smem::kDqWarp;
            const int dq_col = HEAD_DIM == 64 ? 0 : kStagedDq ? 128 * consumer + 64 * dq_pass : 64 * consumer;
            // the lane's share of step s: first_share (the group's first head, row 0) plus s's head and rows
            const int h0 = h_kv * group;
            const int dq_row = dq_share_row(consumer) + 16 * writer_warp;   // the share's first row
            const long long first_share = DqAccum::head(blk.split, batch, b, heads, h0, seq, seqlen_q, HEAD_DIM) +
                                          DqAccum::tile(dq_row, dq_col, HEAD_DIM);
            const long long head_floats = DqAccum::head(blk.split, batch, b, heads, h0 + 1, seq, seqlen_q, HEAD_DIM) -
                                          DqAccum::head(blk.split, batch, b, heads, h0, seq, seqlen_q, HEAD_DIM);
            if constexpr (!kStagedDq)
                for (int i = 0; i < kConsumers && steps > 0; ++i)
                    named_barrier_arrive(kDqEmptyBarrier + i, kDqBarrierThreads);   // the buffers start free
            // (the first step a constant where one warp writes: a runtime one spilled at 64, packed batches)
            for (int s = kWriterWarps > 1 ? tid_wg / 32 - 2 : 0; s < steps; s += kWriterWarps) {
                const int stage = s % kBwdWgmmaStages;
                for (int i = 0; i < kConsumers; ++i) named_barrier_sync(dq_full(i, s), kDqBarrierThreads);
                const int m0 = query_tiles.row(s);
                const long long share =
                    first_share + (s / query_tiles.count) * head_floats + DqAccum::tile(m0, 0, HEAD_DIM);
                int* const count = kOrdered ? dq_order + share / DqAccum::kShare : nullptr;
                if (adds) {
                    if constexpr (kOrdered) {   // the adds before this one (above)
                        int before;
                        if (!side_by_side) {
                            before = key_block - window.key_begin(m0) / BLOCK_N;
                        } else if (Window<MASK>::kMasked) {
                            before = (window.key_end(m0 + BLOCK_M, seq.seqlen_k) - 1) / BLOCK_N - key_block;
                        } else {
                            const int top = stride > 0 ? min(key_blocks - 1, m0 / BLOCK_M / stride) : key_blocks - 1;
                            before = top - key_block + (top < key_block ? key_blocks : 0);
                        }
                        while (load_acquire_gpu(count) < before) {
                        }
                    }
                    bulk_reduce_add(dq_accum + share, buffer + (kStagedDq ? stage * Smem::kQStage : 0), Smem::kDqWarp);
                    bulk_commit();
                    bulk_wait_read<0>();
                }
                __syncwarp();
                if constexpr (kStagedDq) {
                    // the stage is read: Q, dO, lse and delta by the consumers, the staged shares by the adds
                    if (lane < kConsumers) mbarrier_arrive(q_empty(stage));
                } else if (s + 1 < steps) {
                    // the buffers are free for the next step's shares (not after the last: no one waits then)
                    for (int i = 0; i < kConsumers; ++i) named_barrier_arrive(kDqEmptyBarrier + i, kDqBarrierThreads);
                }
                if (kOrdered && adds) {
                    bulk_wait<0>();
                    fence_proxy_async_global();
                    add_release_gpu(count, 1);
                }
            }
            if (adds) bulk_wait<0>();   // the adds done before the block ends (their source is its shared memory)
        }
        return;
    }

    // The consumers: warpgroup 1 + cw owns keys n0 + key_row0.. (64 of them) and dK/dV columns col0.. (kCols);
    // its warp w keys 16 w.. of those. Accumulator element e of n8 tile nb of S^T / dP^T is (key g + 8 (e / 2),
    // query 8 nb + 2 t + e % 2); of dK / dV (key, column col0 + 8 nb + 2 t + e % 2); of dQ (query 16 w + g +
    // 8 (e / 2), column dq_col + 8 nb + 2 t + e % 2).
    warpgroup_registers_increase<240>();
    const int cw = warpgroup - 1, warp = tid_wg / 32, lane = tid_wg % 32, g = lane / 4, t = lane % 4;
    constexpr int kCols = kKeySplit ? HEAD_DIM : HEAD_DIM / 2;
    constexpr int kSq = BLOCK_M / 2, kAcc = kCols / 2, kDq = 64 / 2, kPSteps = BLOCK_M / 16;
    const int key_row0 = kKeySplit ? 64 * cw : 0, col0 = kKeySplit ? 0 : kCols * cw;
    const int key_wg0 = n0 + key_row0, key0 = key_wg0 + 16 * warp + g;   // key0: elements 0, 1's key
    float dk_acc[kAcc], dv_acc[kAcc];
#pragma unroll
    for (int i = 0; i < kAcc; ++i) dk_acc[i] = dv_acc[i] = 0.f;
    const unsigned k_rows = k_s + key_row0 * kSwizzleRowBytes, v_rows = v_s + key_row0 * kSwizzleRowBytes;
    const unsigned col_block0 = col0 / kSwizzleElems * Smem::kQBlock;   // dK/dV's columns in a Q or dO stage
    auto release = [&](unsigned bar) {
        if (tid_wg == 0) mbarrier_arrive(bar);
    };
    // Issues acc = A B^T over the head dim (uncommitted; acc += A B^T where `onto`): A's 64 rows at a_rows (K or
    // V: key rows of the block's tiles), B's BLOCK_M at b_tile (a Q or dO stage), both K-major; k16 step ks reads
    // 64-column block ks / 4, 32 bytes further in per step
    auto issue_rows_by_rows = [&](float (&acc)[kSq], unsigned a_rows, unsigned b_tile, bool onto) {
#pragma unroll
        for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
            const int block = ks / 4;
            const unsigned col = (ks % 4) * 32;
            wgmma_ss<T, BLOCK_M>(acc, smem_descriptor(a_rows + block * Smem::kKVBlock + col, 0),
                                 smem_descriptor(b_tile + block * Smem::kQBlock + col, 0), ks > 0 || onto);
        }
    };
    // dQ's share of this consumer: queries dq_row0.. (64 of them) by all BLOCK_N keys times columns dq_col0.. (64
    // per pass)
    constexpr int kDqPasses = kKeySplit ? 1 : kCols / 64;
    const int dq_row0 = dq_share_row(cw);
    const int dq_col0 = kTallSteps ? 0 : kKeySplit ? 64 * cw : col0;
    // the consumers that store dS^T: both (their own keys), or at head_dim 256 consumer 0 (both hold all of it)
    const bool stores_ds = kKeySplit || cw == 0;
    // this consumer's own named barrier (its 128 threads); the barrier before dQ reads dS^T: both consumers' (id 1)
    const int own_barrier = 2 + cw, ds_barrier = 1;
    constexpr int kDsThreads = 128 * kConsumers;

    // S^T = K Q^T and dP^T = V dO^T of step s for this consumer's 64 keys, issued at the start of step s.
    // FlashAttention-3's order where dQ is one pass (head_dim 64 and 128): dK is issued after dQ, and dQ is stored
    // and added while dK runs. There and at head_dim 256, S^T and dP^T are two groups,
    // P^T = exp2(score - lse) computed while dP^T is in flight (not under the softcap, whose d score / d (scale
    // q.k) per element would have to be held from the first pass to the second, nor with 128-row steps in the
    // ordered form, which spills 20-36 bytes with the two groups, or under ALiBi added to finished scores, which
    // spilled 128-136 bytes with them: ptxas of NVRTC 13.0, sm_90a; bench/NOTES.md sessions 41, 49). With ALiBi's
    // bias in S^T (kAlibiInS) they are split: 44-48 bytes spill under a mask, and the step is still 2-3% faster
    // forward+backward at head_dim 64 (causal 2k-8k, H100; session 51).
    constexpr bool kDkAfterDq = kDqPasses == 1;
    // ALiBi without the softcap or dropout, 128-row steps (kAlibiInS): S^T starts at each pair's bias in units of
    // the scale (init_st), the products accumulate onto it, and the rest of the step is plain attention's
    // (StepMod). On 64-row steps (head_dim 128 and 256), whose P^T is computed while dP^T runs, the bias beside
    // it costs less than init_st before the step's first product: there S^T at the bias was 3-4% slower forward
    // and backward (causal 8k, H100; bench/NOTES.md session 49).
    constexpr bool kAlibiInS =
        kTallSteps && (MODS & kModAlibi) != 0 && (MODS & (kModSoftcap | kModDropout)) == 0;
    using StepMod = ScoreMod<kAlibiInS ? (MODS & ~kModAlibi) : MODS>;
    constexpr bool kSplitScores = (kDkAfterDq || HEAD_DIM == 256) && (MODS & kModSoftcap) == 0 &&
                                  !(kTallSteps && (kOrdered || ((MODS & kModAlibi) != 0 && !kAlibiInS)));
    // With the scores split, 64-row steps and no dropout (whose kept P would need its bits in the first pass),
    // dV += P^T dO is issued as soon as P^T is packed, before the wait for dP^T: the wait then follows an issue
    // that needs P^T, so ptxas computes P^T while dP^T is in flight (otherwise it moves the wait above that
    // arithmetic), and the tensor cores take dV while the consumer computes dS^T. With 128-row steps P^T's
    // fragments beside dP^T spill and serialize the wgmma (ptxas of NVRTC 13.0, sm_90a).
    constexpr bool kEarlyDv = kSplitScores && !kDropout && !kTallSteps;
    float st[kSq], dpt[kSq];
    // kAlibiInS: S^T of a step of head h (queries m0..) starts at each pair's bias in units of the scale, slope *
    // log2(e) / scale_log2 (ScoreMod::alibi_unit_of, clamped to float's range: the plan takes ALiBi here only at scales
    // of 2^-60 and more, as fwd_wgmma's S, _config.wgmma_takes_scale), so that P^T = exp2(S^T scale_log2 - lse2) as
    // without ALiBi. Where the warp's 16 keys lie at or below the diagonal for all the step's queries (every tile of a
    // causal walk but the diagonal's), |distance| is a key's count plus a query's, both >= 0 (no cancellation): one FMA
    // an element with the query's count a constant. Elsewhere it is taken per element (an add and a multiply): a third
    // branch, the tiles above the diagonal with the counts mirrored, spilled 4 bytes at head_dim 128 (NVRTC 13.0,
    // sm_90a). No row shift (fwd_wgmma's least_distance): P^T needs no max, and a row before the diagonal's start
    // carries its least bias in its lse as well.
    auto init_st = [&](int h, int m0) {
        if constexpr (kAlibiInS) {
            const int diagonal = seq.diagonal, warp_key0 = key_wg0 + 16 * warp;
            const float unit = ScoreMod<MODS>::alibi_unit_of(
                ScoreMod<MODS>::slope_log2_of(alibi_slopes, alibi_batch_stride, b, h), scale_log2);
            constexpr int kTiles = kSq / 4;   // n8 tiles of queries
            if (m0 + diagonal >= warp_key0 + 15) {   // every distance >= 0: query 8 nb + 2 t + e % 2 less key
                float key_bias[2];
#pragma unroll
                for (int half = 0; half < 2; ++half)
                    key_bias[half] = unit * static_cast<float>(m0 + 2 * t + diagonal - key0 - 8 * half);
#pragma unroll
                for (int nb = 0; nb < kTiles; ++nb)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        st[4 * nb + e] = fmaf(unit, static_cast<float>(8 * nb + (e & 1)), key_bias[e / 2]);
            } else {
                const float distance0 = static_cast<float>(m0 + 2 * t + diagonal - key0);   // element 0's
#pragma unroll
                for (int nb = 0; nb < kTiles; ++nb)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        st[4 * nb + e] =
                            unit * fabsf(distance0 + static_cast<float>(8 * nb + (e & 1) - 8 * (e / 2)));
            }
        }
    };
    auto issue_scores = [&](int s, int h) {
        const int stage = s % kBwdWgmmaStages;
        mbarrier_wait(q_full(stage), (s / kBwdWgmmaStages) & 1);
        init_st(h, kRowFromStage ? *reinterpret_cast<volatile int*>(rows_s + stage) : query_tiles.row(s));
        pin_registers(st);
        pin_registers(dpt);
        wgmma_fence();
        issue_rows_by_rows(st, k_rows, q_s + stage * Smem::kQStage, kAlibiInS);
        if constexpr (kSplitScores) wgmma_commit();
        issue_rows_by_rows(dpt, v_rows, do_s + stage * Smem::kQStage, false);
        wgmma_commit();
    };

    // step s
    auto step = [&](int s) {
        const int stage = s % kBwdWgmmaStages, h = query_tiles.head(s, h_kv, group);
        const unsigned q_tile = q_s + stage * Smem::kQStage, do_tile = do_s + stage * Smem::kQStage;
        const float* lse_tile = stats_s + stage * 2 * BLOCK_M;
        const float* delta_tile = lse_tile + BLOCK_M;
        const StepMod mod(scale_log2, softcap_in, softcap_out, alibi_slopes, alibi_batch_stride, b, h);
        const Dropout<kDropout> dropout(dropout_seed, dropout_offset, dropout_threshold, b * heads + h);
        // P^T of st into A fragments (k16 step kk: n8 tiles 2 kk, 2 kk + 1, as the forward packs P)
        auto pack_p = [&](unsigned (&frag)[kPSteps][4]) {
#pragma unroll
            for (int nb = 0; nb < kSq / 4; ++nb) {
                frag[nb / 2][(nb % 2) * 2 + 0] = pack2<T>(st[4 * nb], st[4 * nb + 1]);
                frag[nb / 2][(nb % 2) * 2 + 1] = pack2<T>(st[4 * nb + 2], st[4 * nb + 3]);
            }
        };
        // dV += P^T dO from frag (dO MN-major: the query rows are the k dimension), uncommitted
        auto issue_dv = [&](unsigned (&frag)[kPSteps][4]) {
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < kPSteps; ++kk)
                wgmma_rs<T, kCols>(dv_acc, frag[kk],
                                   smem_descriptor(do_tile + col_block0 + kk * 16 * kSwizzleRowBytes, Smem::kQBlock), 1);
        };
        issue_scores(s, h);
        // the step's first query row (kRowFromStage: from the stage, filled once issue_scores(s) has waited for it)
        const int m0 = kRowFromStage ? *reinterpret_cast<volatile int*>(rows_s + stage) : query_tiles.row(s);
        if constexpr (kSplitScores) {
            const bool need_mask = m0 + BLOCK_M > seq.seqlen_q || key_wg0 + 64 > seq.seqlen_k ||
                                   !window.covers(m0, m0 + BLOCK_M, key_wg0, key_wg0 + 64);
            wgmma_wait<1>();   // S^T done, dP^T in flight
            pin_registers(st);
            // P^T of element e of n8 tile nb (key key0 + 8 (e / 2), query 8 nb + 2 t + e % 2), not dropped; then,
            // on a tile the mask cuts, its masked elements zeroed in a block of their own that whole tiles skip
            // (the element loop below computes the same where the scores are one group: one lambda for both, defined
            // outside this block, changed the PTX of the other head dims)
#pragma unroll
            for (int i = 0; i < kSq; ++i) {
                const int query = 8 * (i / 4) + 2 * t + (i & 1), key = key0 + 8 * ((i % 4) / 2);
                float grad;
                st[i] = exp2f(mod.score(st[i], m0 + query, key, seq.diagonal, grad) - lse_tile[query] * kLog2e);
            }
            if (need_mask) {
#pragma unroll
                for (int i = 0; i < kSq; ++i) {
                    const int query = 8 * (i / 4) + 2 * t + (i & 1), key = key0 + 8 * ((i % 4) / 2);
                    if (!window.sees(m0 + query, key, seq.seqlen_k) || m0 + query >= seq.seqlen_q) st[i] = 0.f;
                }
            }   // st holds P^T from here
        }
        unsigned p_frag[kPSteps][4], ds_frag[kPSteps][4];
        if constexpr (kEarlyDv) {
            pack_p(p_frag);
            pin_registers(dv_acc);
            pin_registers(p_frag);
            issue_dv(p_frag);
            wgmma_commit();
            wgmma_wait<1>();   // step s's dP^T; dV in flight
        } else {
            wgmma_wait<0>();   // step s's S^T and dP^T, the only group in flight
        }
        pin_registers(st);
        pin_registers(dpt);

        // P^T and dS^T, element by element into A fragments (k16 step kk: n8 tiles 2 kk, 2 kk + 1, as the
        // forward packs P), and dS^T into shared memory for dQ. Dropout in the transposed tile
        // (Dropout::transposed_bits): keep holds the two calls of the 16-query block of n8 tiles nb, nb + 1.
        // (the split path's test above, spelled again: as one lambda for both places the PTX of 8 specs changed,
        // and with each element's query and key from lambdas too ptxas spilled 4 bytes at head_dim 128 under a
        // window with the modifiers, ordered; NVRTC 13.0, sm_90a)
        const bool need_mask = m0 + BLOCK_M > seq.seqlen_q || key_wg0 + 64 > seq.seqlen_k ||
                               !window.covers(m0, m0 + BLOCK_M, key_wg0, key_wg0 + 64);
        const unsigned ds_stage = ds_s + (s % 2) * Smem::kDsStage;
        unsigned keep[2];
#pragma unroll
        for (int nb = 0; nb < kSq / 4; ++nb) {
            if (kDropout && nb % 2 == 0) dropout.transposed_bits(keep, m0 + 8 * nb + 2 * t, key0);
            float p[4], ds[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int query = 8 * nb + 2 * t + (e & 1), key = key0 + 8 * (e / 2);
                float grad;   // d score / d (scale q.k)
                if constexpr (kSplitScores) {
                    grad = 1.f;
                    p[e] = st[4 * nb + e];
                } else {
                    p[e] = exp2f(mod.score(st[4 * nb + e], m0 + query, key, seq.diagonal, grad) -
                                 lse_tile[query] * kLog2e);
                    if (need_mask && !window.sees(m0 + query, key, seq.seqlen_k)) p[e] = 0.f;
                    if (need_mask && m0 + query >= seq.seqlen_q) p[e] = 0.f;
                }
                const bool kept = Dropout<kDropout>::transposed_keeps(keep, nb, e, g);
                const float dp = kDropout ? (kept ? dpt[4 * nb + e] * dropout_scale : 0.f) : dpt[4 * nb + e];
                ds[e] = p[e] * (dp - delta_tile[query]) * grad;
                if (!kept) p[e] = 0.f;   // dV takes the kept P
            }
            if constexpr (!kEarlyDv) {
                p_frag[nb / 2][(nb % 2) * 2 + 0] = pack2<T>(p[0], p[1]);
                p_frag[nb / 2][(nb % 2) * 2 + 1] = pack2<T>(p[2], p[3]);
            }
            const unsigned ds_lo = pack2<T>(ds[0], ds[1]), ds_hi = pack2<T>(ds[2], ds[3]);
            ds_frag[nb / 2][(nb % 2) * 2 + 0] = ds_lo;
            ds_frag[nb / 2][(nb % 2) * 2 + 1] = ds_hi;
            // dS^T (key row, query column) in the 128-byte swizzle: key rows key_row0 + 16 w + g (+ 8), the pair
            // of queries 8 nb + 2 t in query block nb / 8, chunk nb % 8 ^ (row % 8)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = key_row0 + 16 * warp + g + 8 * half;
                const unsigned at =
                    ds_stage + nb / 8 * Smem::kDsBlock + row * kSwizzleRowBytes + (((nb % 8) ^ (row % 8)) * 16) + 4 * t;
                if (stores_ds)
                    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at), "r"(half ? ds_hi : ds_lo) : "memory");
            }
        }
        fence_proxy_async_shared();

        // dV += P^T dO (issued already where kEarlyDv), dK += dS^T Q (Q MN-major)
        pin_registers(dv_acc);
        pin_registers(dk_acc);
        pin_registers(p_frag);
        pin_registers(ds_frag);
        if constexpr (!kEarlyDv) issue_dv(p_frag);
        auto issue_dk = [&] {
#pragma unroll
            for (int kk = 0; kk < kPSteps; ++kk)
                wgmma_rs<T, kCols>(dk_acc, ds_frag[kk],
                                   smem_descriptor(q_tile + col_block0 + kk * 16 * kSwizzleRowBytes, Smem::kQBlock), 1);
        };
        if constexpr (!kDkAfterDq) issue_dk();
        if constexpr (!kEarlyDv || !kDkAfterDq) wgmma_commit();

        // dQ = dS K over this consumer's share (dS^T of both consumers at head_dim 128, consumer 0's at 256:
        // they meet first)
        named_barrier_sync(ds_barrier, kDsThreads);
#pragma unroll
        for (int pass = 0; pass < kDqPasses; ++pass) {
            const int dq_col = dq_col0 + 64 * pass;
            float dq[kDq];
            pin_registers(dq);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
                const unsigned key_rows = kk * 16 * kSwizzleRowBytes;
                wgmma_ss_mn<T, 64>(dq, smem_descriptor(ds_stage + dq_row0 / 64 * Smem::kDsBlock + key_rows, 0),
                                   smem_descriptor(k_s + dq_col / kSwizzleElems * Smem::kKVBlock + key_rows, 0),
                                   kk > 0);
            }
            wgmma_commit();
            if constexpr (kDkAfterDq) {   // dK runs while dQ is stored and added
                wgmma_fence();
                issue_dk();
                wgmma_commit();
            }
            const bool last_pass = pass == kDqPasses - 1;
            if constexpr (kDkAfterDq) {
                wgmma_wait<1>();   // all but dK
            } else {
                wgmma_wait<0>();
            }
            pin_registers(dq);
            pin_registers(dv_acc);
            if constexpr (!kDkAfterDq) pin_registers(dk_acc);
            pin_registers(p_frag);    // read by the products until the wait: live until here
            if constexpr (!kDkAfterDq) pin_registers(ds_frag);
            // Q, dO, lse and delta of the stage are read (staged, the dQ writer frees it once it has added;
            // with dK after dQ, once dK is done, below)
            if (!kStagedDq && !kDkAfterDq && pass == 0) release(q_empty(stage));
            if (dq_accum != nullptr) {
                float* head = dq_accum + DqAccum::head(blk.split, batch, b, heads, h, seq, seqlen_q, HEAD_DIM);
                // the warp's share: 16 rows by 64 columns, 8 16 x 8 tiles, contiguous in dq_accum
                float* share = head + DqAccum::tile(m0 + dq_row0 + 16 * warp, dq_col, HEAD_DIM);
                // fragment element 4 nb + i of lane l sits at nb * 128 + 4 l + i of a share (DqAccum's order): the
                // byte offset of this lane's four of n8 tile nb
                auto lane_bytes = [&](int nb) { return (nb * 128 + lane * 4) * 4; };
                // this lane's dq into a share in shared memory
                auto store_dq = [&](unsigned share_s) {
#pragma unroll
                    for (int nb = 0; nb < kDq / 4; ++nb)
                        asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n"
                                     ::"r"(share_s + lane_bytes(nb)),
                                     "f"(dq[4 * nb]), "f"(dq[4 * nb + 1]), "f"(dq[4 * nb + 2]), "f"(dq[4 * nb + 3])
                                     : "memory");
                };
                if constexpr (Smem::kBulkDq) {
                    auto dq_buffer = [&](int warp_buffer) { return k_s + Smem::kDq + warp_buffer * Smem::kDqWarp; };
                    const int own = 4 * cw + warp;
                    if constexpr (kOrdered) {   // into the warp's buffer once free, for the dQ writer
                        named_barrier_sync(kDqEmptyBarrier + cw, kDqBarrierThreads);
                        store_dq(dq_buffer(own));
                        fence_proxy_async_shared();
                        named_barrier_arrive(dq_full(cw, s), kDqBarrierThreads);
                    } else {
                        // into the warp's buffer in the same order, then one bulk add of it by lane 0; the buffer
                        // is free again once the previous step's add has read it
                        if (lane == 0) bulk_wait_read<0>();
                        __syncwarp();
                        store_dq(dq_buffer(own));
                        fence_proxy_async_shared();
                        __syncwarp();
                        if (lane == 0) {
                            bulk_reduce_add(share, dq_buffer(own), Smem::kDqWarp);
                            bulk_commit();
                        }
                        __syncwarp();
                    }
                } else {
                    // staged: into this warp's share of the stage, for the dQ writer (both passes, then one
                    // arrival)
                    store_dq(staged_dq(stage, cw, pass, warp));
                    if (last_pass) {
                        fence_proxy_async_shared();
                        named_barrier_arrive(dq_full(cw, s), kDqBarrierThreads);
                    }
                }
            }
        }
        if constexpr (kDkAfterDq) {
            wgmma_wait<0>();   // dK
            pin_registers(dk_acc);
            pin_registers(ds_frag);
            release(q_empty(stage));
        }
    };

    if (steps > 0) mbarrier_wait(kv_full, 0);
#pragma unroll 1
    for (int s = 0; s < steps; ++s) step(s);

    // the bulk adds of dQ done before the block ends (their source is this block's shared memory)
    if (Smem::kBulkDq && lane == 0) bulk_wait<0>();

    // Epilogue: dK times the softmax scale, dV (times dropout_scale under dropout); keys past seqlen_k are not
    // stored
    const float dv_scale = kDropout ? dropout_scale : 1.f;
    const Sequence<VARLEN> out_seq =
        VARLEN ? Sequence<VARLEN>::reread(cu_seqlens_q, cu_seqlens_k, b, batch, seqlen_q, seqlen_k, diagonal) : seq;
    auto out_row = [&](T* tensor, int key) {
        return tensor + b * dk_sb + (out_seq.k_start + key) * dk_ss + h_kv * dk_sh;
    };
    // dK and dV leave through shared memory, so that each store to global memory is a whole 16-byte chunk of a key
    // row and a warp's cover 256-512 contiguous bytes (each thread's 4-byte stores of its fragments took 3-8 us of
    // a block's end: bench/NOTES.md, session 24). The staging tiles sit where K and V were, once the products of
    // both consumers, which read this consumer's rows of them, are done (ds_barrier): the tile of K's or V's place
    // is this consumer's 64 keys by kCols columns, as regions of 64 rows of 128 bytes (this consumer's rows of a
    // column block at 64 and 128, its column blocks at 256); its 16-byte chunk c of row r sits in region c / 8 at
    // chunk c % 8 ^ r % 8 (conflict-free both ways).
    constexpr int kChunks = kCols / 8;   // of a tile row: 8 at head_dim 64, 16 at 128 and 256
    constexpr int kOwnThreads = 128;
    auto chunk_at = [&](unsigned place, int r, int c) {
        const int region = c / 8;
        const unsigned at = place + (kKeySplit ? region * Smem::kKVBlock + key_row0 * kSwizzleRowBytes
                                               : (kConsumerColBlocks * cw + region) * Smem::kKVBlock);
        return at + r * kSwizzleRowBytes + ((c % 8) ^ (r % 8)) * 16;
    };
    // this thread's fragments of acc times factor into the tile at place (k_s or v_s)
    auto stage_tile = [&](const float (&acc)[kAcc], float factor, unsigned place) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = 16 * warp + g + 8 * half;
#pragma unroll
            for (int nb = 0; nb < kAcc / 4; ++nb) {
                const unsigned word = pack2<T>(acc[4 * nb + 2 * half] * factor, acc[4 * nb + 2 * half + 1] * factor);
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(chunk_at(place, r, nb) + 4 * t), "r"(word) : "memory");
            }
        }
    };
    // the tile at place into `tensor`: thread i takes chunk i % kChunks of rows i / kChunks, + 128 / kChunks, ...
    auto store_tile = [&](T* tensor, unsigned place) {
        const int c = tid_wg % kChunks, col = col0 + 8 * c;
#pragma unroll
        for (int r = tid_wg / kChunks; r < 64; r += kOwnThreads / kChunks) {
            const int key = key_wg0 + r;
            uint4 chunk;
            asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(chunk.x), "=r"(chunk.y), "=r"(chunk.z), "=r"(chunk.w)
                         : "r"(chunk_at(place, r, c)) : "memory");
            if (key < out_seq.seqlen_k && col < head_dim) *reinterpret_cast<uint4*>(out_row(tensor, key) + col) = chunk;
        }
    };
    named_barrier_sync(ds_barrier, kDsThreads);
    stage_tile(dk_acc, scale, k_s);
    stage_tile(dv_acc, dv_scale, v_s);
    named_barrier_sync(own_barrier, kOwnThreads);   // this consumer's warps
    store_tile(dk, k_s);
    store_tile(dv, v_s);
}

}  // namespace cuflash
