// Forward pass on Hopper (sm_90a): wgmma from shared memory, TMA loads, warp specialization.
//
// One thread block owns BLOCK_M query rows of one (batch, head) (QueryBlock, as fwd_mma) and 1 + BLOCK_M / 64
// warpgroups:
// - warpgroup 0, the producer, gives most of its registers away (setmaxnreg) and one of its threads issues
//   TMA loads: the Q tile once, then the K and V tiles of the keys the rows see, the highest first (as
//   fwd_mma: the diagonal's masked tiles first), into kWgmmaStages stages; each load completes on the stage's
//   "full" mbarrier, and a stage is refilled once every consumer has arrived on its "empty" one.
// - warpgroups 1.., the consumers, take the registers and 64 rows each: S = Q K^T by wgmma with both
//   operands in shared memory, the mask and score modifiers and the online softmax on S's accumulators
//   (mma.sync's layout: ScoreMod, Window as fwd_mma), P packed into A fragments in registers, O += P V by
//   wgmma with V read MN-major. The product of tile j + 1's S is issued before tile j's P V, and tile
//   j + 1's softmax runs while P V is in flight (FlashAttention-3's intra-warpgroup overlap), so S, P and O
//   are held at once: 64 x (BLOCK_N + BLOCK_N / 2 + HEAD_DIM) / 128 registers per thread. Where kPingPong, the
//   consumers take turns to issue their products (named barriers, round robin), so that one's softmax runs
//   under the others' products (FlashAttention-3's ping-pong).
// Scores in base 2 as fwd_mma, its rescale slack included; the epilogue normalizes (with the sinks) and
// stores O from registers, and the lse. Where kMergeItems, an item's last P V is issued with the next item's
// first S, in one turn, and its epilogue runs beside that item's first softmax.
//
// Q, K and V are read through tensor maps (_tma.py): 4-D (column, head, row, batch) over the arrays as they
// are, boxes of [rows][64 columns]; columns past head_dim and rows past the end read as zeros. In a packed
// batch (VARLEN) the maps span the packed rows (batch extent 1) and a block reads from its sequence's first
// row: rows of the next sequence that a tile overruns are masked (keys) or never stored (queries).
// Dropout (kModDropout) zeroes the dropped probabilities in P's A fragments after the row sums took them, one
// Philox call per two 16 x 16 blocks as fwd_mma (Dropout::drop_pairs: the fragments' layouts are the same).
// No KV cache (the plan runs fwd_mma for it).
#include "hopper.cuh"

namespace cuflash {

constexpr int kWgmmaStages = 2;     // K and V stages each
// The persistent grid's work counter, int32 (_config.WGMMA_WORK_COUNTER_INTS): the items taken, and the blocks
// done taking them
constexpr int kItemsTaken = 0, kBlocksDone = 1, kWorkCounterInts = 2;
// Ping-pong up to head_dim 128: there it gained up to 8% at seqlen 1k and 1-13% at head_dim 64 (three
// consumers); at 192 and 256, where P V is long beside the softmax, it cost 4-11% from 4k (bench/NOTES.md, h2).
template <int HEAD_DIM> constexpr bool kPingPong = HEAD_DIM <= 128;
// An item's last P V issued with the next item's first S (below) where the consumers ping-pong: its epilogue then
// runs off the other consumers' turns. It gained 3% under a 1024-key window at head_dim 128; without ping-pong
// it cost 4% at 256 and 1% at 192 (bench/NOTES.md, session 16).
template <int HEAD_DIM> constexpr bool kMergeItems = kPingPong<HEAD_DIM>;
// Where the consumers take turns, each walks only the key tiles that its own 64 rows see (below), except three
// consumers (192-row blocks) beside the softcap: there the walk's own bounds spilled 8-460 bytes at their 160
// registers (NVRTC 13.0, sm_90a: causal, and windows with the sinks)
template <int HEAD_DIM, int CONSUMERS, int MODS> constexpr bool kSkipTiles =
    kPingPong<HEAD_DIM> && !(CONSUMERS == 3 && (MODS & kModSoftcap) != 0);

// The warpgroups of a block of BLOCK_M rows: a producer and BLOCK_M / 64 consumers, and their setmaxnreg budgets.
// setmaxnreg moves registers within what the block was given at launch: one block per SM of kThreads threads gets
// kLaunchRegisters each (65536 / kThreads in multiples of 8: 168 for 384 threads, 128 for 512), and the budgets
// (multiples of 8) must not exceed that pool, or setmaxnreg.inc waits for ever. The producer's thread decodes work
// items and picks the next, which spilled at 24 registers: 40 beside two consumers of 232 (at 32 it spills 4 bytes
// under some masks, and the consumers would still get 232), 32 beside three of 160.
template <int BLOCK_M> struct WgmmaRoles {
    static constexpr int kConsumers = BLOCK_M / 64, kThreads = 128 * (1 + kConsumers);
    static constexpr int kLaunchRegisters = 65536 / kThreads / 8 * 8;
    static constexpr int kProducerRegisters = kConsumers == 2 ? 40 : 32;
    static constexpr int kConsumerRegisters =
        (kLaunchRegisters * kThreads - 128 * kProducerRegisters) / (128 * kConsumers) / 8 * 8;
    static_assert(128 * (kProducerRegisters + kConsumers * kConsumerRegisters) <= kLaunchRegisters * kThreads,
                  "the setmaxnreg budgets fit in the block's registers");
};

// fwd_wgmma's shared memory, bytes: Q [HEAD_DIM / E][BLOCK_M rows][E], then K stages and V stages, each
// [HEAD_DIM / E][BLOCK_N rows][E] (E = kRowElems, a row of kRowBytes: 128, or the 64 of float8 at head_dim 64;
// swizzled blocks as TMA writes them: hopper.cuh), a float8 V stage V^T [BLOCK_N / R][HEAD_DIM rows][R keys] (the
// same bytes; R = kVRowBytes, 128 where it divides BLOCK_N, else 64: a swizzled box row holds at most 128 bytes;
// rows of R bytes with that swizzle), then the mbarriers: q_full, q_empty,
// k_full[stages], v_full[stages], k_empty[stages], v_empty[stages], item_full[2], item_empty[2]; then the two
// work-item slots (unsigned) the producer hands the consumers. kBytes is what the launch gives it
// (_config.wgmma_smem_bytes), kRowBytes and kVRowBytes the widths of the boxes of the maps of q and k, and of v
// (_config.wgmma_row_bytes), all checked by tests/test_compile.py.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N> struct WgmmaFwdSmem {
    static constexpr int kRowBytes = HEAD_DIM * static_cast<int>(sizeof(T)) < kSwizzleRowBytes
                                         ? HEAD_DIM * static_cast<int>(sizeof(T)) : kSwizzleRowBytes;
    static constexpr int kRowElems = kRowBytes / static_cast<int>(sizeof(T));
    static constexpr int kColBlocks = HEAD_DIM / kRowElems;
    // a V box row: 16-bit V's 128 bytes; float8's V^T, kVRowBytes keys of a head_dim row (the widest swizzle that
    // divides the key tile), a box of every head_dim row taking kVChunk bytes
    static constexpr int kVRowBytes = !kFloat8<T> || BLOCK_N % kSwizzleRowBytes == 0 ? kSwizzleRowBytes
                                                                                     : kSwizzleRowBytes / 2;
    static constexpr int kVChunk = HEAD_DIM * kVRowBytes;
    static constexpr int kQBlock = BLOCK_M * kRowBytes;        // one [BLOCK_M][E] column block of Q
    static constexpr int kKVBlock = BLOCK_N * kRowBytes;       // one [BLOCK_N][E] block of K or V
    static constexpr int kKVStage = kColBlocks * kKVBlock;
    static constexpr int kK = kColBlocks * kQBlock, kV = kK + kWgmmaStages * kKVStage;
    static constexpr int kBarriers = kV + kWgmmaStages * kKVStage, kBarrierCount = 2 + 4 * kWgmmaStages + 4;
    static constexpr int kItemSlots = kBarriers + 8 * kBarrierCount;
    static constexpr int kBytes = kItemSlots + 2 * 4;
    static_assert(!kFloat8<T> || BLOCK_N / kVRowBytes * kVChunk == kKVStage, "a V^T stage holds the key tile");
};

template <typename T, int HEAD_DIM, int MASK, int MODS, int BLOCK_M, int BLOCK_N, bool VARLEN>
__global__ void __launch_bounds__(WgmmaRoles<BLOCK_M>::kThreads, 1)
fwd_wgmma(const __grid_constant__ TmaMap q_map, const __grid_constant__ TmaMap k_map,
          const __grid_constant__ TmaMap v_map, int* __restrict__ work_counter, const int* __restrict__ item_order,
          CUFLASH_PARAMS(CUFLASH_FWD_FIELDS)) {
    static_assert(sizeof(T) == 2 || kFloat8<T>, "wgmma runs float16, bfloat16 and float8 e4m3");
    // float8: V comes transposed, V^T (batch, heads_kv, head_dim, keys) with the keys of each 32 in the order of
    // P's A fragments (transpose_v_float8, below); a key tile is a swizzled row of it, in boxes of kVRowBytes keys
    static_assert(!kFloat8<T> || (BLOCK_N % 64 == 0 && BLOCK_N <= 256 && !VARLEN && (MODS & kModDropout) == 0),
                  "float8: key tiles of 64-key multiples up to 256, dense batches, no dropout");
    using Roles = WgmmaRoles<BLOCK_M>;
    static_assert(BLOCK_M % 64 == 0 && Roles::kConsumers >= 2 && Roles::kConsumers <= 3,
                  "two or three consumer warpgroups of 64 rows");
    constexpr bool kDropout = (MODS & kModDropout) != 0;
    using Smem = WgmmaFwdSmem<T, HEAD_DIM, BLOCK_M, BLOCK_N>;
    static_assert(HEAD_DIM % Smem::kRowElems == 0 && BLOCK_N % 16 == 0, "whole column blocks, k16 steps");
    extern __shared__ __align__(1024) unsigned char smem_raw[];   // the swizzle's 1024-byte atoms
    const unsigned q_s = smem_addr(smem_raw), k_s = q_s + Smem::kK, v_s = q_s + Smem::kV;
    const unsigned bars = q_s + Smem::kBarriers;
    const unsigned q_full = bars, q_empty = bars + 8;
    auto k_full = [&](int stage) { return bars + 8 * (2 + stage); };
    auto v_full = [&](int stage) { return bars + 8 * (2 + kWgmmaStages + stage); };
    auto k_empty = [&](int stage) { return bars + 8 * (2 + 2 * kWgmmaStages + stage); };
    auto v_empty = [&](int stage) { return bars + 8 * (2 + 3 * kWgmmaStages + stage); };
    auto item_full = [&](int slot) { return bars + 8 * (2 + 4 * kWgmmaStages + slot); };
    auto item_empty = [&](int slot) { return bars + 8 * (4 + 4 * kWgmmaStages + slot); };
    volatile unsigned* const item_slots = reinterpret_cast<volatile unsigned*>(smem_raw + Smem::kItemSlots);

    // The block walks work items by rank: blockIdx.x first, then, where work_counter is given (the persistent grid
    // of a block per SM), the next rank not yet taken (gridDim.x + the count of ranks taken: a section's longest
    // items first, each SM taking one as it frees), else blockIdx.x + gridDim.x, ... work_counter is zero at launch and
    // left zero (the stream's next launch reuses it, with no memset): the last block done taking items zeroes it.
    // The item of a rank is the grid order's (QueryBlock::item_of_rank: pair item / num_m_blocks, query block item %
    // num_m_blocks); in a packed batch with item_order (varlen_order, kernels/varlen.cu: its count of entries, then
    // each entry (sequence b, query block m_block) as b * num_m_blocks + m_block, those with the most key tiles
    // first) the ranks walk the heads in sections of section_heads heads, each section every entry in that order
    // with its heads fastest (QueryBlock::in_sections), and ranks past its entries end the walk. The producer's
    // thread 0 picks each item and hands it to the consumers through two slots (item_full / item_empty); it loads
    // the next item's Q and keys while the consumers finish the last one's epilogue. The mbarriers' phases run on
    // across items (counts of Q and key tiles).
    const int num_m_blocks = QueryBlock::blocks(seqlen_q, BLOCK_M);
    const unsigned items = static_cast<unsigned>(num_m_blocks) * batch * heads;
    struct Item {
        QueryBlock blk;
        Sequence<VARLEN> seq;
        Window<MASK> window;
        int key_first, n_tiles;   // the key tiles the item's rows see: n_tiles from key_first
        __device__ __forceinline__ bool idle() const { return VARLEN && blk.m0 >= seq.seqlen_q; }
        // the j-th key tile walked, the highest first
        __device__ __forceinline__ int tile_key(int j) const { return key_first + (n_tiles - 1 - j) * BLOCK_N; }
    };
    auto item = [&](unsigned index) {
        const QueryBlock blk(index, num_m_blocks, BLOCK_M, heads, group);
        const Sequence<VARLEN> seq(cu_seqlens_q, cu_seqlens_k, blk.b, batch, seqlen_q, seqlen_k, diagonal);
        const Window<MASK> window{seq.diagonal, window_left, window_right};
        const KeyTiles tiles(window, blk.m0, BLOCK_M, BLOCK_N, seq.seqlen_k);
        return Item{blk, seq, window, tiles.first, tiles.count};
    };

    const int warpgroup = threadIdx.x / 128, tid_wg = threadIdx.x % 128;
    if (threadIdx.x == 0) {
        mbarrier_init(q_full, 1);
        mbarrier_init(q_empty, Roles::kConsumers);
        for (int slot = 0; slot < 2; ++slot) {
            mbarrier_init(item_full(slot), 1);
            mbarrier_init(item_empty(slot), 128 * Roles::kConsumers);   // every consumer thread has read it
        }
        for (int stage = 0; stage < kWgmmaStages; ++stage) {
            mbarrier_init(k_full(stage), 1);
            mbarrier_init(v_full(stage), 1);
            mbarrier_init(k_empty(stage), Roles::kConsumers);   // one arrival per consumer warpgroup
            mbarrier_init(v_empty(stage), Roles::kConsumers);
        }
        mbarrier_init_fence();
    }
    __syncthreads();

    if (warpgroup == 0) {   // the producer
        warpgroup_registers_decrease<Roles::kProducerRegisters>();
        if (tid_wg == 0) {
            int q_loads = 0, kv_loads = 0;   // Q tiles and key tiles loaded so far: the barriers' phases
            // (a dense batch has no order, and its kernels no code for one: with it the producer spilled at 32
            // registers, three consumers at head_dim 64 with softcap, ALiBi and sinks under a window)
            const unsigned ranks = item_order != nullptr ? static_cast<unsigned>(item_order[0]) * heads : items;
            const unsigned entries = VARLEN && item_order != nullptr ? static_cast<unsigned>(item_order[0]) : 0;
            auto item_at = [&](unsigned rank) {
                if (rank >= ranks) return items;
                if (!VARLEN || item_order == nullptr)
                    return QueryBlock::item_of_rank(rank, batch * heads, num_m_blocks, section_heads);
                unsigned head, step;
                QueryBlock::in_sections(rank, heads, entries, section_heads, head, step);
                const unsigned entry = static_cast<unsigned>(item_order[1 + step]);
                return (entry / num_m_blocks * heads + head) * num_m_blocks + entry % num_m_blocks;
            };
            unsigned rank = blockIdx.x, index = item_at(rank);
            for (int handed = 0;; ++handed) {
                const int slot = handed % 2;
                if (handed >= 2) mbarrier_wait(item_empty(slot), (handed / 2 - 1) & 1);
                item_slots[slot] = index;
                mbarrier_arrive(item_full(slot));   // (release: the consumers see the slot)
                if (index >= items) break;
                const Item w = item(index);
                rank = work_counter != nullptr ? gridDim.x + atomicAdd(work_counter + kItemsTaken, 1)
                                               : rank + gridDim.x;
                index = item_at(rank);
                if (w.idle() || w.n_tiles <= 0) continue;
                // the maps' coordinates: a packed batch's rows from its sequence's first, batch 0
                const int batch_coord = VARLEN ? 0 : w.blk.b, q_row = static_cast<int>(w.seq.q_start) + w.blk.m0;
                const int k_row = static_cast<int>(w.seq.k_start), h = w.blk.h, h_kv = w.blk.h_kv;
                if (q_loads > 0) mbarrier_wait(q_empty, (q_loads - 1) & 1);   // the consumers are done with Q
                ++q_loads;
                mbarrier_expect_bytes(q_full, Smem::kK);
                for (int c = 0; c < Smem::kColBlocks; ++c)
                    tma_load_4d(q_s + c * Smem::kQBlock, q_map, q_full, c * Smem::kRowElems, h, q_row, batch_coord);
                for (int j = 0; j < w.n_tiles; ++j, ++kv_loads) {
                    const int stage = kv_loads % kWgmmaStages, refill_phase = (kv_loads / kWgmmaStages - 1) & 1;
                    const int row = k_row + w.tile_key(j);
                    if (kv_loads >= kWgmmaStages) mbarrier_wait(k_empty(stage), refill_phase);
                    mbarrier_expect_bytes(k_full(stage), Smem::kKVStage);
                    for (int c = 0; c < Smem::kColBlocks; ++c)
                        tma_load_4d(k_s + stage * Smem::kKVStage + c * Smem::kKVBlock, k_map, k_full(stage),
                                    c * Smem::kRowElems, h_kv, row, batch_coord);
                    if (kv_loads >= kWgmmaStages) mbarrier_wait(v_empty(stage), refill_phase);
                    mbarrier_expect_bytes(v_full(stage), Smem::kKVStage);
                    if constexpr (kFloat8<T>)   // V^T's boxes (its map: keys, kv heads, head_dim rows, batch):
                        // kVRowBytes of the tile's keys of every head_dim row each
                        for (int c = 0; c < BLOCK_N / Smem::kVRowBytes; ++c)
                            tma_load_4d(v_s + stage * Smem::kKVStage + c * Smem::kVChunk, v_map, v_full(stage),
                                        row + c * Smem::kVRowBytes, h_kv, 0, batch_coord);
                    else
                        for (int c = 0; c < Smem::kColBlocks; ++c)
                            tma_load_4d(v_s + stage * Smem::kKVStage + c * Smem::kKVBlock, v_map, v_full(stage),
                                        c * Smem::kRowElems, h_kv, row, batch_coord);
                }
            }
            if (work_counter != nullptr) {
                __threadfence();   // this block's last take of an item comes before its count among the done
                if (atomicAdd(work_counter + kBlocksDone, 1) == static_cast<int>(gridDim.x) - 1) {
                    atomicExch(work_counter + kItemsTaken, 0);
                    atomicExch(work_counter + kBlocksDone, 0);
                }
            }
        }
        return;
    }

    // The consumers: warpgroup 1 + cw owns rows 64 cw.. of each item's block; its warp w rows 16 w.. of those,
    // and accumulator element e of n8 column tile nb (of S or O) is at row g + 8 (e / 2), column 8 nb + 2 t + e % 2.
    warpgroup_registers_increase<Roles::kConsumerRegisters>();
    const int cw = warpgroup - 1, warp = tid_wg / 32, lane = tid_wg % 32, g = lane / 4, t = lane % 4;
    // k steps of 32 bytes: 16 elements of 16-bit types, 32 of float8
    constexpr int kS = BLOCK_N / 2, kO = HEAD_DIM / 2, kKStep = 32 / static_cast<int>(sizeof(T));
    constexpr int kPSteps = BLOCK_N / kKStep;
    // float8 P is exp2(score - max + kPOffset), in [0, 256] (FlashAttention-3's max offset): the probabilities
    // down to 2**-17 of the row's largest keep e4m3's subnormal bits; l and O carry the factor, which the
    // epilogue takes out (kPUnscale)
    constexpr float kPOffset = kFloat8<T> ? 8.f : 0.f, kPUnscale = kFloat8<T> ? 1.f / 256.f : 1.f;
    // The rescale slack (kRescaleSlack: the reference max may lag a row's max by this much). float8: P =
    // exp2(score - reference + kPOffset) must stay within e4m3's 448 (2**8.8), so the reference lags by 0.5 at most
    constexpr float kSlack = kFloat8<T> ? 0.5f : kRescaleSlack;
    // O stored in whole 16-byte chunks (`store`) by two consumers of 232 registers: it gained 4-11% at head_dim 128
    // and 6-19% at 256 at seqlen 512-2k. Three consumers of 160 (head_dim 64's 192-row blocks) spill 8-360 bytes
    // with it under the modifiers and gained nothing measurable (-4..+2%; bench/NOTES.md, session 25): they store
    // each thread's column pairs.
    constexpr bool kChunkedStore = Roles::kConsumers == 2;
    using Mod = ScoreMod<MODS>;
    // ALiBi alone (beside the mask), 16-bit inputs (kAlibiInS): S starts at each pair's bias in S's units
    // (init_s: slope_log2 |distance| / score_factor), the products accumulate onto it, and the softmax is plain
    // attention's: one instruction per element, where adding the bias to the finished scores took two. The softcap
    // applies before ALiBi, to the product alone; float8's unit (its descale factors) is known only per item; beside
    // dropout or the sinks it spilled 4-40 bytes (NVRTC 13.0, sm_90a: head_dim 64, and 256 under a window).
    constexpr bool kAlibiInS = Mod::kAlibi && (MODS & (kModSoftcap | kModSinks | kModDropout)) == 0 && !kFloat8<T>;
    // A row's least |distance| to a key (kAlibiInS): 0 where its diagonal key exists, else (a row before the
    // diagonal's start: seqlen_q > seqlen_k) its distance to key 0
    auto least_distance = [](int row, int diagonal) { return max(0, -(row + diagonal)); };
    // The factor the exponent's FMA applies to a score as softmax leaves it, of an item whose scores are q.k times
    // item_scale (float8: its q_descale * k_descale, below; 1 otherwise): the plain product's scale and the
    // softcap's output factor are positive, so the row max may be taken before them
    auto score_factor_of = [&](float item_scale) {
        return Mod::kAlibi && !kAlibiInS ? 1.f : Mod::kSoftcap ? softcap_out : scale_log2 * item_scale;
    };
    float score_factor = score_factor_of(1.f);

    float o[kO], s[kS];
    unsigned p[kPSteps][4];
    float m_i[2], l_i[2], alpha[2];

    // S = Q K^T of the K tile in `stage` (issued, not waited on)
    const unsigned q_rows = q_s + 64 * cw * Smem::kRowBytes;
    auto issue_s = [&](int stage) {
        pin_registers(s);
        wgmma_fence();
        constexpr int kStepsPerBlock = Smem::kRowBytes / 32;
#pragma unroll
        for (int ks = 0; ks < HEAD_DIM / kKStep; ++ks) {
            const int block = ks / kStepsPerBlock;                // the column block of k step ks
            const unsigned col = (ks % kStepsPerBlock) * 32;      // and its bytes into the block's rows
            wgmma_ss<T, BLOCK_N>(
                s, smem_descriptor<Smem::kRowBytes>(q_rows + block * Smem::kQBlock + col, 0),
                smem_descriptor<Smem::kRowBytes>(k_s + stage * Smem::kKVStage + block * Smem::kKVBlock + col, 0),
                ks > 0 || kAlibiInS);
        }
        wgmma_commit();
        pin_registers(s);
    };
    // O += P V of the V tile in `stage` (issued, not waited on)
    auto issue_pv = [&](int stage) {
        pin_registers(o);
        pin_registers(p);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kPSteps; ++kk) {
            if constexpr (kFloat8<T>)   // V^T K-major: k step kk is keys 32 kk.. of each head_dim row (its chunk's)
                wgmma_rs_k<T, HEAD_DIM>(
                    o, p[kk],
                    smem_descriptor<Smem::kVRowBytes>(v_s + stage * Smem::kKVStage + 32 * kk / Smem::kVRowBytes *
                                                      Smem::kVChunk + 32 * kk % Smem::kVRowBytes, 0), 1);
            else
                wgmma_rs<T, HEAD_DIM>(
                    o, p[kk], smem_descriptor(v_s + stage * Smem::kKVStage + kk * 16 * kSwizzleRowBytes, Smem::kKVBlock),
                    1);
        }
        wgmma_commit();
        pin_registers(o);
        pin_registers(p);
    };
    // P (s, exponentiated) of the keys n0.. into A fragments: k16 step kk holds n8 tiles 2 kk and 2 kk + 1;
    // dropout then zeroes the dropped ones (row: the thread's row g of its warp's 16; the generator's key and
    // threshold read from the parameters here, not held in registers across the loop)
    // float8: k32 step kk holds n8 tiles 4 kk .. 4 kk + 3; register 2 h + r (h: the step's half, r: the row) holds
    // the thread's four values of row g + 8 r in tiles 4 kk + 2 h and + 1 as its four k positions 16 h + 4 t ..,
    // the order V^T's keys are stored in (transpose_v_float8)
    auto pack_p = [&](int bh, int row, int n0) {
        if constexpr (kFloat8<T>) {
#pragma unroll
            for (int kk = 0; kk < kPSteps; ++kk)
#pragma unroll
                for (int half = 0; half < 2; ++half)
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const int nb = 4 * kk + 2 * half;
                        p[kk][2 * half + r] = pack4_e4m3(s[4 * nb + 2 * r], s[4 * nb + 2 * r + 1],
                                                         s[4 * nb + 4 + 2 * r], s[4 * nb + 4 + 2 * r + 1]);
                    }
        } else {
            const Dropout<kDropout> dropout(dropout_seed, dropout_offset, dropout_threshold, bh);
#pragma unroll
            for (int nb = 0; nb < kS / 4; ++nb) {
                p[nb / 2][(nb % 2) * 2 + 0] = pack2<T>(s[4 * nb + 0], s[4 * nb + 1]);
                p[nb / 2][(nb % 2) * 2 + 1] = pack2<T>(s[4 * nb + 2], s[4 * nb + 3]);
            }
            dropout.drop_pairs(p, row, n0 + 2 * t);   // n0 is a multiple of 32: BLOCK_N
        }
    };
    auto rescale_o = [&] {
#pragma unroll
        for (int i = 0; i < kO; ++i) o[i] *= alpha[(i % 4) / 2];
    };
    auto release = [&](unsigned bar) {
        if (tid_wg == 0) mbarrier_arrive(bar);
    };
    // Ping-pong: consumer cw issues its products on its turn, named barrier 1 + cw (barrier 0 is
    // __syncthreads), then passes the turn to the next (arrives on that one's barrier). The last consumer
    // gives consumer 0 its first turn, and consumer 0 takes one turn more at the end, which the last
    // consumer's final pass gives: every wait meets exactly one arrival.
    constexpr int kTurnThreads = 2 * 128;   // the waiting warpgroup and the one that passes it the turn
    auto take_turn = [&] {
        if constexpr (kPingPong<HEAD_DIM>) named_barrier_sync(1 + cw, kTurnThreads);
    };
    auto pass_turn = [&] {
        if constexpr (kPingPong<HEAD_DIM>) named_barrier_arrive(1 + (cw + 1) % Roles::kConsumers, kTurnThreads);
    };
    if (kPingPong<HEAD_DIM> && cw == Roles::kConsumers - 1) named_barrier_arrive(1, kTurnThreads);
    // each consumer's own barrier (its 128 threads), after the turns' (1 .. kConsumers)
    constexpr int kSkipBarrier = 1 + Roles::kConsumers;

    // The epilogue of an item, in two steps. `finish`, once the walk's statistics are final (m_i, l_i: this
    // thread's two rows, row0 and row0 + 8): normalize (the sink joins the denominator, as fwd_mma; kept
    // probabilities scaled by dropout_scale) and store the lse; a row that saw no key has l = 0: lse -inf (with a
    // sink: the sink). `store`, once O is final: O times the rows' 1 / l (0 for a row that saw no key) to the
    // output, each thread's pairs of columns. In between, all that is held is what `finish` returns.
    struct Rows {
        Output<T>* out_row;   // row0's output row (row0: elements 0, 1's row; the thread's other row is 8 below)
        float inv_l[2];
        bool stored[2];     // the row is one of the sequence's
    };
    // float8: out holds Output<T> (bfloat16), which the field list types T; O times v_descale of the item's kv head
    Output<T>* const out_values = reinterpret_cast<Output<T>*>(out);
    auto finish = [&](const Item& w) {
        const int row0 = w.blk.m0 + 64 * cw + 16 * warp + g;
        float* lse_head = lse == nullptr ? nullptr : lse + w.seq.stats(w.blk.b, heads, w.blk.h);
        Rows rows{out_values + w.blk.b * o_sb + (w.seq.q_start + row0) * o_ss + w.blk.h * o_sh, {0.f, 0.f},
                  {false, false}};
        float v_scale = kPUnscale;   // what O carries beyond the probabilities' sum: 2**kPOffset, 1 / v_descale
        if (kFloat8<T> && v_descale != nullptr) v_scale *= v_descale[w.blk.b * descale_sb + w.blk.h_kv * descale_sh];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = row0 + 8 * r;
            float l = quad_sum(l_i[r]) * kPUnscale, m = m_i[r], o_factor = 1.f;
            if constexpr (kAlibiInS)   // the row's least bias, which S left out (init_s); none where it saw no key
                if (m != -CUFLASH_INF)
                    m += Mod::slope_log2_of(alibi_slopes, alibi_batch_stride, w.blk.b, w.blk.h) *
                         static_cast<float>(least_distance(row, w.seq.diagonal));
            if constexpr ((MODS & kModSinks) != 0) {
                const float sink2 = sinks[w.blk.h] * kLog2e;
                const float m_new = safe_max(fmaxf(m, sink2));
                o_factor = exp2f(m - m_new);
                l = l * o_factor + exp2f(sink2 - m_new);
                m = m_new;
            }
            rows.stored[r] = row < w.seq.seqlen_q;
            rows.inv_l[r] = l == 0.f ? 0.f : (kDropout ? o_factor * dropout_scale : o_factor) * v_scale / l;
            if (rows.stored[r] && lse_head != nullptr && t == 0)
                lse_head[row] = l == 0.f ? -CUFLASH_INF : (m + log2f(l)) * kLn2;
        }
        return rows;
    };
    // A quad's four lanes hold the four column pairs of each 8-column chunk of a row (a word each). Where the
    // consumers have the registers (kChunkedStore), each group of four chunks is transposed within the quad, so
    // that lane t holds the group's chunk t and stores it whole (head_dim is a multiple of 8 and out contiguous,
    // from the pool: wgmma_forward_spec), a warp's store writing 64 contiguous bytes in each of 8 rows. Round i
    // (1..3) of the transpose sends the word of chunk t ^ i and receives the partner's word of chunk t, column
    // pair t ^ i; both indices depend on the lane, so the words are put in lane order by two conditional swaps
    // before the rounds and two after (no indexed register array). Every lane takes part in the shuffles.
    auto swap_by_lane = [&](unsigned (&w)[4]) {     // w[i] <- w[i ^ t]
        if (t & 1) {
            const unsigned w0 = w[0], w2 = w[2];
            w[0] = w[1]; w[1] = w0; w[2] = w[3]; w[3] = w2;
        }
        if (t & 2) {
            const unsigned w0 = w[0], w1 = w[1];
            w[0] = w[2]; w[1] = w[3]; w[2] = w0; w[3] = w1;
        }
    };
    auto store = [&](const Rows& rows) {
        if constexpr (kChunkedStore) {
#pragma unroll
            for (int group = 0; group < kO / 16; ++group) {
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    unsigned w[4];  // w[c]: this lane's column pair of chunk 4 * group + c
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        const int nb = 4 * group + c;
                        w[c] = pack2<Output<T>>(o[4 * nb + 2 * r] * rows.inv_l[r],
                                                o[4 * nb + 2 * r + 1] * rows.inv_l[r]);
                    }
                    swap_by_lane(w);    // w[i]: the word of chunk t ^ i
#pragma unroll
                    for (int i = 1; i < 4; ++i) w[i] = __shfl_xor_sync(0xffffffffu, w[i], i);
                    swap_by_lane(w);    // w[j]: column pair j of chunk 4 * group + t
                    const int col = 8 * (4 * group + t);
                    if (rows.stored[r] && col < head_dim)
                        *reinterpret_cast<uint4*>(rows.out_row + 8 * r * o_ss + col) =
                            make_uint4(w[0], w[1], w[2], w[3]);
                }
            }
        } else {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                if (!rows.stored[r]) continue;
                Output<T>* dst = rows.out_row + 8 * r * o_ss;
#pragma unroll
                for (int nb = 0; nb < kO / 4; ++nb) {
                    const int col = 8 * nb + 2 * t;
                    if (col < head_dim)
                        *reinterpret_cast<unsigned*>(dst + col) =
                            pack2<Output<T>>(o[4 * nb + 2 * r] * rows.inv_l[r], o[4 * nb + 2 * r + 1] * rows.inv_l[r]);
                }
            }
        }
    };
    auto clear_o = [&] {
#pragma unroll
        for (int i = 0; i < kO; ++i) o[i] = 0.f;
    };
    auto clear_statistics = [&] {
        m_i[0] = m_i[1] = -CUFLASH_INF;
        l_i[0] = l_i[1] = 0.f;
    };
    // the stage and barrier phase of the key tile consumed count-th in the block (from 0)
    auto kv_stage = [](int count) { return count % kWgmmaStages; };
    auto kv_phase = [](int count) { return (count / kWgmmaStages) & 1; };

    // An item's last P V is left pending (of the last key tile consumed, kv_uses - 1, or where a tile skipped
    // below the walk may follow it, kSkipBelow, of pending_use). Where kMergeItems it is issued with the next
    // item's first S, in one ping-pong turn, and its epilogue runs beside that item's first softmax, off the other
    // consumers' turns; elsewhere, and for the last item, `flush` issues it alone once the next item is known
    // (issuing it at the walk's end made ptxas spill the item loop's counters at head_dim 256 under a window). The
    // merged first turn and the plain one are two whole sequences, each waiting on its own products: O's products
    // in flight across a join of branches make ptxas serialize every wgmma of the kernel (warning C7514, which
    // tests/test_compile.py rejects).
    int q_uses = 0, kv_uses = 0;   // Q tiles and key tiles consumed so far: the barriers' phases
    bool pending = false;
    // (its own count only where needed: elsewhere it cost a register, and the window spec with the softcap and
    // the sinks at 192 rows spilled 8 bytes)
    constexpr bool kSkipBelow = kSkipTiles<HEAD_DIM, Roles::kConsumers, MODS> && Window<MASK>::kLeft;
    int pending_use = 0;
    Rows pending_rows;
    auto pending_stage = [&] { return kv_stage(kSkipBelow ? pending_use : kv_uses - 1); };
    auto pending_phase = [&] { return kv_phase(kSkipBelow ? pending_use : kv_uses - 1); };
    auto flush = [&] {   // the pending item's last P V in a turn of its own, then its epilogue
        mbarrier_wait(v_full(pending_stage()), pending_phase());
        take_turn();
        issue_pv(pending_stage());
        pass_turn();
        wgmma_wait<0>();
        pin_registers(o);
        release(v_empty(pending_stage()));
        store(pending_rows);
        pending = false;
    };
    for (int handed = 0;; ++handed) {
        const int slot = handed % 2;
        mbarrier_wait(item_full(slot), (handed / 2) & 1);
        const unsigned index = item_slots[slot];
        mbarrier_arrive(item_empty(slot));
        if (index >= items) break;
        const Item w = item(index);
        if (w.idle()) continue;
        const int b = w.blk.b, h = w.blk.h;
        const int wg_row0 = w.blk.m0 + 64 * cw, row0 = wg_row0 + 16 * warp + g;   // row0: elements 0, 1's row
        // float8: the item's scores are q.k times q_descale * k_descale of its kv head
        float item_scale = 1.f;
        if constexpr (kFloat8<T>) {
            const int at = b * descale_sb + w.blk.h_kv * descale_sh;
            if (q_descale != nullptr) item_scale *= q_descale[at];
            if (k_descale != nullptr) item_scale *= k_descale[at];
            score_factor = score_factor_of(item_scale);
        }
        const float item_softcap_in = softcap_in * item_scale;
        const Mod mod(scale_log2 * item_scale, item_softcap_in, softcap_out, alibi_slopes, alibi_batch_stride, b, h);
        // kAlibiInS: S of the keys n0.. starts at each pair's bias in units of score_factor (alibi_unit; the plan
        // takes ALiBi here only at scales of 2^-60 and more, where the clamp to float's range leaves every pair 1 or
        // more apart a bias past any score: exactly 0 after the softmax), less its row's least bias (alibi_unit *
        // least_distance(row), where the row's keys all lie past its diagonal; the epilogue adds it back). So each
        // row's nearest key has bias exactly 0 and a row's scores stay as small as plain attention's, whatever the
        // slope: the exponent's FMA subtracts a rounded max from an exact product, which holds its precision only
        // there. Where the warp's 16 rows lie on one side of the diagonal across the whole tile, |distance| less
        // that least distance is a row's count plus a column's, both >= 0 (no cancellation: each bias within 1.5
        // ulp): one FMA an element, the column's count its constant. Across the diagonal it is taken per element.
        // A tile far from a row's nearest key still holds scores of any size (a steep slope's bias), and a row
        // walks such tiles before the max it ends with: there the reference max (tile_max) is rounded up, so that
        // no exponent exceeds the slack (rounded to nearest, the max's own could reach half an ulp of the scaled
        // max, 2^12 at 2^36: an infinite exponential, then inf * 0 in the rescale). Any reference serves: O, l,
        // the rescale and the lse all count from it. (A zero slope gives a zero unit either way; without the test
        // for it ptxas spilled 4 bytes in head_dim 64's dense 192-row kernels: NVRTC 13.0, sm_90a.)
        const float alibi_unit =
            kAlibiInS && mod.slope_log2 != 0.f ? Mod::alibi_unit_of(mod.slope_log2, score_factor) : 0.f;
        auto init_s = [&](int n0) {
            if constexpr (kAlibiInS) {
                const int diagonal = w.seq.diagonal, warp_row0 = wg_row0 + 16 * warp;
                const int rows[2] = {row0, row0 + 8};
                const int last_key = n0 + BLOCK_N - 1;
                if (warp_row0 + diagonal >= last_key) {   // every distance >= 0: counted from the tile's last key
                    float row_bias[2];
#pragma unroll
                    for (int r = 0; r < 2; ++r)
                        row_bias[r] = alibi_unit * static_cast<float>(rows[r] + diagonal - last_key + 6 - 2 * t);
#pragma unroll
                    for (int nb = 0; nb < kS / 4; ++nb)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {   // (BLOCK_N - 7 - 8 nb - e % 2 keys before the last one)
                            const float column = static_cast<float>(8 * (kS / 4 - 1 - nb) + 1 - (e & 1));
                            s[4 * nb + e] = fmaf(alibi_unit, column, row_bias[e / 2]);
                        }
                } else if (warp_row0 + 15 + diagonal <= n0) {   // every distance <= 0: from the row's nearest key
                    float row_bias[2];
#pragma unroll
                    for (int r = 0; r < 2; ++r)
                        row_bias[r] = alibi_unit * static_cast<float>(n0 + 2 * t - (rows[r] + diagonal)
                                                                      - least_distance(rows[r], diagonal));
#pragma unroll
                    for (int nb = 0; nb < kS / 4; ++nb)
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            s[4 * nb + e] = fmaf(alibi_unit, static_cast<float>(8 * nb + (e & 1)), row_bias[e / 2]);
                } else {
                    const float distance0 = static_cast<float>(row0 + diagonal - n0 - 2 * t);   // element 0's
                    const float least[2] = {static_cast<float>(least_distance(rows[0], diagonal)),
                                            static_cast<float>(least_distance(rows[1], diagonal))};
#pragma unroll
                    for (int nb = 0; nb < kS / 4; ++nb)
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            s[4 * nb + e] =
                                alibi_unit * (fabsf(distance0 + static_cast<float>(8 * (e / 2) - 8 * nb - (e & 1)))
                                              - least[e / 2]);
                }
            }
        };
        // The scores of S (the tile of keys n0..) through the modifiers and the mask, their row maxima, and the
        // moved references: returns whether O must be rescaled by `alpha` (only when some row's max grew past
        // its reference by kSlack, as fwd_mma), leaves exp2(score - m_i) in s and adds it to l_i.
        auto softmax = [&](int n0) -> bool {
            const bool need_mask =
                n0 + BLOCK_N > w.seq.seqlen_k || !w.window.covers(wg_row0, wg_row0 + 64, n0, n0 + BLOCK_N);
            const int key0 = n0 + 2 * t;   // the key of element 0 of n8 tile 0
            if constexpr (Mod::kAlibi && !kAlibiInS) {   // (kAlibiInS: the bias is in S already, init_s)
                // At head_dim 64 without the softcap (kFloatDistance) ALiBi's distance of element e of n8 tile nb is
                // a float: row0's to key0 plus a constant, so that the elements of equal row - key share a bias (as
                // ptxas shares the integer form's) and none takes an integer conversion. There this was 3.4% faster
                // in the forward (causal, 8k; 1.298 -> 1.255 ms); at 128 it was 2-3% slower (its integer adds become
                // float adds, presumably on a pipe that head_dim 128's softmax already fills), and 256 gained 1%
                // (bench/NOTES.md session 41). Beside the softcap the shared biases spilled 4-20 bytes (NVRTC 13.0,
                // sm_90a).
                constexpr bool kFloatDistance = !Mod::kSoftcap && HEAD_DIM == 64;
                const float distance0 = kFloatDistance ? static_cast<float>(row0 + w.seq.diagonal - key0) : 0.f;
#pragma unroll
                for (int nb = 0; nb < kS / 4; ++nb)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        s[4 * nb + e] =
                            kFloatDistance
                                ? mod.score_at(s[4 * nb + e], distance0 + (8 * (e / 2) - 8 * nb - (e & 1)))
                                : mod.score(s[4 * nb + e], row0 + 8 * (e / 2), key0 + 8 * nb + (e & 1), w.seq.diagonal);
            } else if constexpr (Mod::kSoftcap) {
#pragma unroll
                for (int i = 0; i < kS; ++i) s[i] = mod.tanh(s[i] * item_softcap_in);   // score_factor: softcap_out
            }
            if (need_mask) {
#pragma unroll
                for (int nb = 0; nb < kS / 4; ++nb)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        if (!w.window.sees(row0 + 8 * (e / 2), key0 + 8 * nb + (e & 1), w.seq.seqlen_k))
                            s[4 * nb + e] = -CUFLASH_INF;
            }
            float tile_max[2] = {-CUFLASH_INF, -CUFLASH_INF};
#pragma unroll
            for (int i = 0; i < kS; ++i) tile_max[(i % 4) / 2] = fmaxf(tile_max[(i % 4) / 2], s[i]);
#pragma unroll
            for (int r = 0; r < 2; ++r)   // (kAlibiInS: rounded up, see alibi_unit above)
                tile_max[r] = kAlibiInS ? __fmul_ru(quad_max(tile_max[r]), score_factor)
                                        : quad_max(tile_max[r]) * score_factor;
            const bool grown = tile_max[0] > m_i[0] + kSlack || tile_max[1] > m_i[1] + kSlack;
            const bool rescale = __any_sync(0xffffffffu, grown);
            if (rescale) {
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const float m_new = fmaxf(m_i[r], tile_max[r]);
                    alpha[r] = exp2f(m_i[r] - safe_max(m_new));
                    m_i[r] = m_new;
                    l_i[r] *= alpha[r];
                }
            }
            float neg_base[2] = {-safe_max(m_i[0]), -safe_max(m_i[1])};
            if constexpr (kFloat8<T>) neg_base[0] += kPOffset, neg_base[1] += kPOffset;
#pragma unroll
            for (int i = 0; i < kS; ++i) {
                s[i] = exp2f(fmaf(s[i], score_factor, neg_base[(i % 4) / 2]));
                l_i[(i % 4) / 2] += s[i];
            }
            return rescale;
        };

        if (w.n_tiles <= 0) {   // rows that see no key
            if (pending) flush();
            clear_o();
            clear_statistics();
            store(finish(w));
            continue;
        }
        // This warpgroup's walk: walk_tiles key tiles from key walk_first, the highest first. With kSkipTiles,
        // the block's tiles that hold a key its rows see (those of KeyTiles for its 64 rows, on the same grid of
        // BLOCK_N keys; rows past the sequence, or that see no key: the block's lowest tile alone, its elements
        // masked). Each consumer still takes one turn per tile of the block: a tile it skips (above its walk: a
        // 192-row block's diagonal, a window's right end, rows past the sequence; below it: a window's left end)
        // takes a turn with no products, and its stages are freed once loaded (waiting for the load keeps the
        // empty barriers' phases: an arrival before it could complete the stage's previous use).
        int walk_first = w.key_first, walk_tiles = w.n_tiles;
        auto walk_key = [&](int j) { return walk_first + (walk_tiles - 1 - j) * BLOCK_N; };
        // The block's next key tile, skipped: its stages freed once loaded and seen loaded by all four warps (a
        // warp that had not yet seen the load when thread 0 freed the stage could miss its phase: the producer may
        // refill the stage twice, and the parity it waits for would be the old one again; in the walk the
        // products between the wait and the release order them)
        auto skip_tile = [&] {
            mbarrier_wait(k_full(kv_stage(kv_uses)), kv_phase(kv_uses));
            mbarrier_wait(v_full(kv_stage(kv_uses)), kv_phase(kv_uses));
            named_barrier_sync(kSkipBarrier + cw, 128);
            release(k_empty(kv_stage(kv_uses)));
            release(v_empty(kv_stage(kv_uses)));
            ++kv_uses;
        };
        auto skip_turns = [&](int tiles) {   // the block's next `tiles` key tiles, skipped in turns of their own
            for (int j = 0; j < tiles; ++j) {
                take_turn();
                pass_turn();
                skip_tile();
            }
        };
        if constexpr (kSkipTiles<HEAD_DIM, Roles::kConsumers, MODS>) {
            // (the rows' first through a shuffle, which ptxas knows is the same in every lane: the walk's bounds
            // then sit in uniform registers, as the block's do; from wg_row0 they spilled 20-630 bytes at head_dim
            // 64, NVRTC 13.0)
            const int rows_begin = w.blk.m0 + 64 * __shfl_sync(0xffffffffu, cw, 0);
            const KeyTiles mine(w.window, rows_begin, 64, BLOCK_N, w.seq.seqlen_k);
            const bool none = rows_begin >= w.seq.seqlen_q || mine.count <= 0;
            walk_first = none ? w.key_first : mine.first;
            walk_tiles = none ? 1 : mine.count;
            const int above = (w.key_first - walk_first) / BLOCK_N + w.n_tiles - walk_tiles;
            if (pending && above > 0) {   // the pending P V in the first of their turns
                flush();
                skip_tile();
                skip_turns(above - 1);
            } else {
                skip_turns(above);
            }
        }
        // key tile j of this item: stage and phase from the count of key tiles consumed before it
        auto stage_of = [&](int j) { return kv_stage(kv_uses + j); };
        auto phase_of = [&](int j) { return kv_phase(kv_uses + j); };
        // S of tile j is done: its K stage is free, and after the item's last S so is Q (the producer loads the
        // next item's while this one's last P V and epilogue run)
        auto s_done = [&](int j) {
            pin_registers(s);
            release(k_empty(stage_of(j)));
            if (j == walk_tiles - 1) release(q_empty);
        };
        if (!kMergeItems<HEAD_DIM> && pending) flush();
        init_s(walk_key(0));
        mbarrier_wait(q_full, q_uses & 1);
        mbarrier_wait(k_full(stage_of(0)), phase_of(0));
        if (kMergeItems<HEAD_DIM> && pending) {   // the merged first turn: this item's first S, the pending last P V
            take_turn();
            issue_s(stage_of(0));
            mbarrier_wait(v_full(pending_stage()), pending_phase());
            issue_pv(pending_stage());
            pass_turn();
            wgmma_wait<1>();   // S done; the pending P V in flight
            s_done(0);
            clear_statistics();
            softmax(walk_key(0));   // O is the pending item's: nothing to rescale
            wgmma_wait<0>();
            pin_registers(o);
            release(v_empty(pending_stage()));
            store(pending_rows);
            clear_o();
        } else {
            clear_o();
            clear_statistics();
            take_turn();
            issue_s(stage_of(0));
            pass_turn();
            wgmma_wait<0>();
            s_done(0);
            softmax(walk_key(0));   // O is zero: nothing to rescale
        }
        pack_p(w.blk.bh, row0, walk_key(0));
#pragma unroll 1
        for (int j = 1; j < walk_tiles; ++j) {
            init_s(walk_key(j));
            mbarrier_wait(k_full(stage_of(j)), phase_of(j));
            take_turn();
            issue_s(stage_of(j));
            mbarrier_wait(v_full(stage_of(j - 1)), phase_of(j - 1));
            issue_pv(stage_of(j - 1));
            pass_turn();
            wgmma_wait<1>();   // S done; P V of the previous tile in flight
            s_done(j);
            const bool rescale = softmax(walk_key(j));
            wgmma_wait<0>();
            pin_registers(o);
            release(v_empty(stage_of(j - 1)));
            if (rescale) rescale_o();
            pack_p(w.blk.bh, row0, walk_key(j));
        }
        ++q_uses;
        kv_uses += walk_tiles;
        // The item's last P V pending (every consumer's: `pending` is the same in all). Under a window the block
        // may hold a tile below this warpgroup's walk: one at most (its rows' first key is at most 64 (kConsumers -
        // 1) <= BLOCK_N past the block's first row's), whose stage is not the pending P V's (kWgmmaStages >= 2):
        // the producer can load it while that P V waits for the next turn. That skip advances kv_uses past the
        // P V's tile: pending_use keeps it.
        static_assert(64 * (Roles::kConsumers - 1) <= BLOCK_N && kWgmmaStages >= 2, "one tile below a walk at most");
        pending = true;
        if constexpr (kSkipBelow) pending_use = kv_uses - 1;
        pending_rows = finish(w);
        if constexpr (kSkipBelow)
            skip_turns(walk_first > w.key_first ? 1 : 0);
    }
    if (pending) flush();
    if (kPingPong<HEAD_DIM> && cw == 0) take_turn();   // the last consumer's final pass
}

// The float8 forward's V^T: vt (batch, heads_kv, HEAD_DIM, keys_padded), e4m3 bytes, from v (batch, seqlen_k,
// heads_kv, HEAD_DIM; element strides v_sb, v_ss, v_sh, rows 16-byte aligned). Within each 32 keys, column
// 16 h + 4 t + i holds the key that P's A fragment has there (pack_p): 16 h + 2 t + i for i < 2, 16 h + 8 + 2 t +
// i - 2 for i >= 2. Keys past seqlen_k are zeros (keys_padded, a multiple of kTransposeKeys, is the extent of the
// TMA boxes' map, which reads zeros past it). A block per (kTransposeKeys keys, kv head, batch) turns the tile through
// shared memory: 16-byte reads of key rows, stored as words in rows of HEAD_DIM + 4 bytes (an odd count of words:
// rows 16 apart fall 16 banks apart), the word index XORed with 4 (key / 32 % 4) (so the 8 rows 16 keys apart that
// a warp reads fall in 8 distinct groups of 4 banks); then per unit of 4 head_dim rows by 16 keys, 16 word reads, a
// 4 x 4 byte transpose of each 4 keys in registers (byte_perm) and four 16-byte writes of V^T, one per head_dim
// row: a warp's 8 consecutive units of one head_dim row write 128 contiguous bytes of it. bench/NOTES.md session 40.
constexpr int kTransposeKeys = 128;   // _config.FLOAT8_TRANSPOSE_KEYS
template <int HEAD_DIM>
__global__ void __launch_bounds__(256)
transpose_v_float8(const unsigned char* __restrict__ v, unsigned char* __restrict__ vt, long long v_sb, long long v_ss,
                   long long v_sh, int seqlen_k, int keys_padded, int heads_kv) {
    constexpr int kKeys = kTransposeKeys, kChunks = HEAD_DIM / 16, kRowWords = HEAD_DIM / 4 + 1;
    constexpr int kUnits = HEAD_DIM / 4 * (kKeys / 16);   // (4 head_dim rows, 16 keys), the keys fastest
    static_assert(kRowWords % 2 == 1 && kKeys == 128 && HEAD_DIM >= 64, "odd words a row; 8 units of 16 keys a "
                  "row of V^T; the word index's XOR (up to 12) within a row");
    auto swizzle = [](int key) { return 4 * (key / 32 % 4); };
    __shared__ unsigned tile[kKeys * kRowWords];
    const int key0 = blockIdx.x * kKeys, h = blockIdx.y, b = blockIdx.z;
    for (int i = threadIdx.x; i < kKeys * kChunks; i += blockDim.x) {
        const int key = i / kChunks, chunk = i % kChunks;
        uint4 bytes = make_uint4(0u, 0u, 0u, 0u);
        if (key0 + key < seqlen_k)
            bytes = *reinterpret_cast<const uint4*>(v + b * v_sb + (key0 + key) * v_ss + h * v_sh + 16 * chunk);
        unsigned* const row = tile + key * kRowWords;
        const int word0 = 4 * chunk ^ swizzle(key);
        row[word0] = bytes.x;
        row[word0 + 1] = bytes.y;
        row[word0 + 2] = bytes.z;
        row[word0 + 3] = bytes.w;
    }
    __syncthreads();
    unsigned char* const head = vt + (static_cast<long long>(b) * heads_kv + h) * HEAD_DIM * keys_padded + key0;
    for (int unit = threadIdx.x; unit < kUnits; unit += blockDim.x) {
        const int keys16 = unit % (kKeys / 16), word = unit / (kKeys / 16);
        const int stored = word ^ swizzle(16 * keys16);   // where phase one put the word (16 keys share a swizzle)
        unsigned w[16];   // head_dim bytes 4 word.. of keys 16 keys16 + r
#pragma unroll
        for (int r = 0; r < 16; ++r) w[r] = tile[(16 * keys16 + r) * kRowWords + stored];
        // V^T column 4 t + i of the 16 (t = 0..3) holds key 2 t + i (i < 2), 8 + 2 t + i - 2 (i >= 2): per t the
        // bytes j of keys 2 t, 2 t + 1, 8 + 2 t, 9 + 2 t form row 4 word + j's word t
        unsigned out[4][4];   // [j][t]
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const unsigned lo01 = __byte_perm(w[2 * t], w[2 * t + 1], 0x5140);   // b0 b0' b1 b1'
            const unsigned hi01 = __byte_perm(w[2 * t], w[2 * t + 1], 0x7362);   // b2 b2' b3 b3'
            const unsigned lo89 = __byte_perm(w[8 + 2 * t], w[9 + 2 * t], 0x5140);
            const unsigned hi89 = __byte_perm(w[8 + 2 * t], w[9 + 2 * t], 0x7362);
            out[0][t] = __byte_perm(lo01, lo89, 0x5410);
            out[1][t] = __byte_perm(lo01, lo89, 0x7632);
            out[2][t] = __byte_perm(hi01, hi89, 0x5410);
            out[3][t] = __byte_perm(hi01, hi89, 0x7632);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j)
            *reinterpret_cast<uint4*>(head + static_cast<long long>(4 * word + j) * keys_padded + 16 * keys16) =
                make_uint4(out[j][0], out[j][1], out[j][2], out[j][3]);
    }
}

}  // namespace cuflash
