// Forward pass on the tensor cores (float16 / bfloat16 inputs, float32 accumulation).
//
// One thread block owns BLOCK_M query rows of one (batch, head), split over WARPS warps; a warp owns
// BLOCK_M / WARPS rows as kMAtoms stacked 16-row mma atoms, so every K and V fragment it reads from
// shared memory feeds kMAtoms mma instructions (shared-memory bandwidth, not the tensor cores, bounds
// a one-atom warp: bench/NOTES.md). Where registers cannot hold two atoms' output (head_dim 256), a
// pair of warps shares 32 rows instead (KEY_SPLIT, below). The Q tile stays on chip throughout (in
// registers when they suffice, else in shared memory) while the block walks the key/value tiles,
// BLOCK_N keys at a time from the highest down, double-buffered with cp.async: the next tile is in
// flight while one is used.
// The tiles' rows are XOR-swizzled where the head dim allows (ForwardRow in mma.cuh: 16-byte copies
// land 32-byte aligned). Per row the online-softmax state is m_i (running max of the base-2 scores),
// l_i (running sum of exp2(score - m_i), per-thread partial until the epilogue) and acc (the
// unnormalized output, in mma accumulator layout).
//
// KVCACHE: the decoding forward of attention_with_kvcache. The block's 16 rows are query heads packed with
// their positions (CacheBlock), its keys one split of a cache of per-sequence length, contiguous or paged,
// its 4 warps each scoring a quarter of every key tile (kKeyWarps), their states merged at the end; with
// key splits it writes float32 partials, and the last block of each row group to finish merges them
// (merge_row, merge.cuh): one launch per call. A float8 e4m3 cache (T = __nv_fp8_e4m3, q and the new keys
// too) arrives as bytes in staging tiles and is converted to float16 tiles (Compute<T>: exact) before the
// tensor cores read them; the scores take q_descale * k_descale of the block's kv head, the output v_descale,
// and it is stored as bfloat16 (Output<T>).
//
// Scores are kept in base 2: x = (q . k) * scale * log2(e), so p = exp2(x - m_i). The stored lse is
// converted back to natural log: lse = (m_i + log2(l_i)) * ln(2); a null lse stores none (a caller that
// does not return it allocates none). Under dropout (kModDropout) l_i sums every P, P.V takes the kept
// ones (Dropout::drop_pairs on the packed P), and the epilogue scales by 1 / (1 - p).
#include "merge.cuh"
#include "mma.cuh"

namespace cuflash {

// fwd_mma's shared memory, offsets in elements of Compute<T>: Q [BLOCK_M][kRow], then K and V, kStages
// stages each [kStages][BLOCK_N][kRow]; element (row, column) of a tile at Row::offset(row, column / 8) +
// column % 8. Where warps share rows (KEY_SPLIT = 2), then each warp's row maxima [WARPS][kMAtoms][2][32
// lanes] (float; in the epilogue its row sums: kMaxSlots floats per warp) and its P fragments
// [WARPS][kMAtoms][key steps][32 lanes] (uint4: kPSlots per warp), indexed by lane so that the partner reads
// each lane's values (the same rows) back conflict-free. float8 (kStaged): one stage of the tiles, each
// converted from the bytes as loaded, which follow them at byte kStaging: Q [BLOCK_M][HEAD_DIM], then K and V,
// two stages each [2][BLOCK_N][HEAD_DIM]. kBytes is what the launch gives it (_config.mma_smem_bytes,
// checked by tests/test_compile.py).
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, int KEY_SPLIT> struct FwdSmem {
    static constexpr bool kStaged = kFloat8<T>;
    static constexpr int kStages = kStaged ? 1 : 2;
    static constexpr int kRow = ForwardRow<HEAD_DIM>::kElems;
    static constexpr int kK = BLOCK_M * kRow, kV = kK + kStages * BLOCK_N * kRow;
    static constexpr int kTiles = kV + kStages * BLOCK_N * kRow;
    static constexpr int kMAtoms = BLOCK_M / (WARPS / KEY_SPLIT) / 16;   // 16-row atoms of a warp
    // a pair's warp computes S for BLOCK_N / KEY_SPLIT keys of a tile (pairs take whole tiles)
    static constexpr int kMaxSlots = kMAtoms * 2 * 32, kPSlots = kMAtoms * (BLOCK_N / KEY_SPLIT / 16) * 32;
    static constexpr int kStaging = kTiles * static_cast<int>(sizeof(Compute<T>)) +
                                    (KEY_SPLIT > 1 ? WARPS * (kMaxSlots * 4 + kPSlots * 16) : 0);
    static constexpr int kStagedK = BLOCK_M * HEAD_DIM, kStagedV = kStagedK + 2 * BLOCK_N * HEAD_DIM;   // bytes
    static constexpr int kBytes = kStaging + (kStaged ? kStagedV + 2 * BLOCK_N * HEAD_DIM : 0);
};

// Minimum blocks per SM, found by reading ptxas's report: without a minimum of one, ptxas aims
// 256-thread blocks at two per SM (128 registers) and spills at head_dim 160; with it, 128-thread
// blocks of two atoms per warp at head_dim 128 reach 255 registers and spill; with none, one-atom
// 128-thread blocks (sm_8x, head_dim 128) stop at 168 registers and spill 24 bytes, and a minimum of
// two lets them keep everything in registers. The KV-cache blocks (one per SM: their tiles take most of
// its shared memory) spilled 12 bytes at 168 registers without a minimum; with one they fit. The dropout
// kernels take one too: without it, sm_80's head_dim 64 one on 128 x 32 tiles stopped at 168 and spilled 32.
template <typename T, int HEAD_DIM, int MASK, int MODS, int BLOCK_M, int BLOCK_N, int WARPS, int KEY_SPLIT,
          bool KVCACHE, bool VARLEN>
__global__ void __launch_bounds__(WARPS * 32,
                                  WARPS >= 8 || KVCACHE || (MODS & kModDropout) ? 1 : BLOCK_M / WARPS == 16 ? 2 : 0)
fwd_mma(CUFLASH_PARAMS(CUFLASH_FWD_FIELDS)) {
    constexpr int kThreads = WARPS * 32;
    // KEY_SPLIT warps share each group of query rows (a pair where KEY_SPLIT = 2): each computes S for its
    // half of the tile's keys and P.V for its half of the head dim, trading row maxima and P with its
    // partner through shared memory. Each warp holds two atoms' rows at head_dim 256 with one atom's
    // accumulator registers, and reads 52 KB of shared memory per 64-key tile instead of 72 (Q 16, K 16,
    // V 16, P 4 against Q 8, K 32, V 32), for two pair barriers per tile (bench/NOTES.md forward v8).
    // Under KVCACHE the warps share one 16-row atom and split each key tile among them instead (kKeyWarps):
    // warp w scores keys [w * kWarpKeys, (w + 1) * kWarpKeys) of every tile and multiplies them into its own
    // acc over every column, with its own m_i and l_i, and the warps' states are merged at the end. A
    // decoding block's rows are few and its tiles many: one warp walking them all left it waiting on its
    // own latency at every tile (bench/NOTES.md, decode d2).
    constexpr int kKeyWarps = KVCACHE ? WARPS : KEY_SPLIT;
    constexpr int kRowGroups = WARPS / kKeyWarps;
    constexpr int kRowsPerWarp = BLOCK_M / kRowGroups;
    constexpr int kMAtoms = kRowsPerWarp / 16;
    using Row = ForwardRow<HEAD_DIM>;   // swizzled rows where HEAD_DIM allows, else padded (mma.cuh)
    constexpr int kRow = Row::kElems;
    constexpr int kKSteps = HEAD_DIM / 16;   // k16 steps of Q.K^T
    // S is computed, exponentiated and multiplied into acc kSubN keys at a time: where acc takes 128
    // registers per thread, a 64-key S beside it (another 64) left ptxas too few for the swizzled
    // addresses and it spilled (head_dim 128, 128 x 64 tiles); sub-tiles whose S takes 32 registers fit.
    // Warp pairs take whole tiles: their exchange slots are reused only after the barrier ending a tile.
    constexpr int kSubN = !KVCACHE && KEY_SPLIT == 1 && kMAtoms * HEAD_DIM / 2 >= 128 && kMAtoms * BLOCK_N / 2 > 32
                              ? 64 / kMAtoms : BLOCK_N;
    constexpr int kWarpKeys = kSubN / kKeyWarps;      // keys of a sub-tile whose scores this warp computes
    constexpr int kWarpKSteps = kWarpKeys / 16;       // their k16 steps of P.V
    constexpr int kNTiles = kWarpKeys / 8;            // n8 accumulator tiles of S per atom
    constexpr int kDTiles = HEAD_DIM / KEY_SPLIT / 8; // n8 accumulator tiles of acc per atom (this warp's columns)
    // Q fragments take kMAtoms * HEAD_DIM / 4 registers; past 32 they crowd out acc and S.
    constexpr bool kQInRegisters = KEY_SPLIT == 1 && kMAtoms * HEAD_DIM <= 128 && (BLOCK_N <= 64 || KVCACHE);
    static_assert(KEY_SPLIT == 1 || KEY_SPLIT == 2, "rows are shared by one warp or a pair");
    static_assert(BLOCK_M % (16 * kRowGroups) == 0 && kWarpKeys % 16 == 0, "tiles are made of 16 x 16 mma blocks");
    static_assert(BLOCK_N % kSubN == 0, "the key tile is made of whole sub-tiles");
    // A pair's column halves start on a 128-byte boundary of a swizzled row (the XOR pattern restarts).
    static_assert(KEY_SPLIT == 1 || kDTiles % 8 == 0, "column shares are whole 64-column groups");
    static_assert(!KVCACHE || (KEY_SPLIT == 1 && (MODS & kModDropout) == 0 && BLOCK_M == 16 && !VARLEN),
                  "the KV-cache forward: one atom, no pairs, no dropout, no packed batch");
    static_assert(!kFloat8<T> || (KVCACHE && HEAD_DIM % 16 == 0), "float8: the KV-cache forward");
    using C = Compute<T>;   // the tiles' and P's type: the tensor cores'
    using O = Output<T>;    // out's
    static_assert(sizeof(O) == sizeof(C), "the epilogue stages the output in the Q tile's rows");

    using Smem = FwdSmem<T, HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, KEY_SPLIT>;
    static_assert(KEY_SPLIT == 1 || (kSubN == BLOCK_N && Smem::kMAtoms == kMAtoms), "the pair slots' layout");
    extern __shared__ __align__(128) unsigned char smem_raw[];   // swizzled rows need 128-byte alignment
    C* q_s = reinterpret_cast<C*>(smem_raw);
    C* k_s = q_s + Smem::kK;
    C* v_s = q_s + Smem::kV;
    unsigned char* const staged = smem_raw + Smem::kStaging;   // float8: the tiles as loaded
    float* pair_max = reinterpret_cast<float*>(q_s + Smem::kTiles);
    uint4* pair_p = reinterpret_cast<uint4*>(pair_max + WARPS * Smem::kMaxSlots);   // 16-byte aligned

    // The block's rows: query rows m0.. of (batch b, head h) (of sequence b in a packed batch: Sequence), or
    // under KVCACHE rows m0.. of the packed query heads h.. (CacheBlock), of split `split` of the keys. `rows`
    // counts a head's (or head group's) rows and position(row) is a row's query position; `keys` counts
    // batch b's keys, whose diagonal is `diag` (a KV cache's own length, aligned bottom-right).
    int b, h, h_kv, m0, bh, split = 0, row_group = 0;
    if constexpr (KVCACHE) {
        const CacheBlock blk(BLOCK_M, seqlen_q * pack, heads / pack, pack, num_splits);
        b = blk.b, h = blk.h, m0 = blk.m0, split = blk.split, row_group = blk.row_group;
        h_kv = h / group;
        bh = b * heads + h;
    } else {
        const QueryBlock blk(BLOCK_M, batch, heads, group, seqlen_q, section_heads);
        bh = blk.bh, b = blk.b, h = blk.h, h_kv = blk.h_kv, m0 = blk.m0;
    }
    const Sequence<VARLEN> seq(cu_seqlens_q, cu_seqlens_k, b, batch, seqlen_q, seqlen_k, diagonal);
    if (VARLEN && m0 >= seq.seqlen_q) return;
    const int rows = KVCACHE ? seqlen_q * pack : seq.seqlen_q;
    auto position = [&](int row) { return KVCACHE ? row / pack : row; };
    int keys = seq.seqlen_k, diag = seq.diagonal;
    // the key count inside the key loop: in a packed batch read again at each use (Sequence::reread_seqlen_k)
    auto key_count = [&] { return VARLEN ? Sequence<VARLEN>::reread_seqlen_k(cu_seqlens_k, b) : keys; };
    // a KV cache's first key (cache_leftpad, contiguous caches): the key rows before it are not the sequence's
    const int lead = KVCACHE && cache_leftpad != nullptr ? cache_leftpad[b] : 0;
    if constexpr (KVCACHE) {
        if (cache_seqlens != nullptr) keys = cache_seqlens[b] + seqlen_k_new;
        keys -= lead;
        diag = keys - seqlen_q;
    }
    const int pos_begin = position(m0), pos_end = position(m0 + BLOCK_M - 1) + 1;   // the rows' positions
    const Window<MASK> window{diag, window_left, window_right};
    // float8: the scores are q.k times q_descale * k_descale of the block's kv head (O times its v_descale: the
    // epilogue reads it)
    float item_scale = 1.f;
    if constexpr (kFloat8<T>) {
        const int at = b * descale_sb + h_kv * descale_sh;
        if (q_descale != nullptr) item_scale *= q_descale[at];
        if (k_descale != nullptr) item_scale *= k_descale[at];
    }
    const float item_scale_log2 = kFloat8<T> ? scale_log2 * item_scale : scale_log2;
    using Mod = ScoreMod<MODS>;
    const Mod mod(item_scale_log2, kFloat8<T> ? softcap_in * item_scale : softcap_in, softcap_out, alibi_slopes,
                  alibi_batch_stride, b, h);
    // the factor from raw products to base-2 scores inside the exponent: scale_log2, or 1 where the
    // modifiers have already made the scores (ScoreMod)
    const float score_factor = Mod::kAny ? 1.f : item_scale_log2;
    constexpr bool kDropout = (MODS & kModDropout) != 0;
    const Dropout<kDropout> dropout(dropout_seed, dropout_offset, dropout_threshold, bh);

    const T* q_head = q + b * q_sb + seq.q_start * q_ss + h * q_sh;
    const T* k_head = k + b * k_sb + (seq.k_start + lead) * k_ss + h_kv * k_sh;
    const T* v_head = v + b * v_sb + (seq.k_start + lead) * v_ss + h_kv * v_sh;
    // Under a mask the block walks only the key tiles its rows see: n_tiles tiles from key_first, the last
    // one first. Walking down from the highest keys meets the masked tiles of the diagonal first and, under
    // ALiBi, the largest scores of each row (its bias falls with the distance), so the row maxima seldom
    // grow afterwards and the warps seldom rescale (see exponentiate).
    int key_first = window.key_begin(pos_begin) / BLOCK_N * BLOCK_N;
    const int n_end = window.key_end(pos_end, keys);
    int n_tiles = (n_end - key_first + BLOCK_N - 1) / BLOCK_N;   // <= 0 where no row sees a key
    if constexpr (KVCACHE) {   // split `split` walks its share of these tiles, consecutive ones
        const int split_tiles = (n_tiles + num_splits - 1) / num_splits;
        key_first += split * split_tiles * BLOCK_N;
        n_tiles = min(split_tiles, n_tiles - split * split_tiles);
    }
    auto tile_key = [&](int j) { return key_first + (n_tiles - 1 - j) * BLOCK_N; };   // the j-th tile walked

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    const int warp_row0 = warp / kKeyWarps * kRowsPerWarp;
    const int share = warp % KEY_SPLIT;   // this warp's share of the keys (S) and of the columns (P.V)
    const int key_share = KVCACHE ? warp : share;   // the keys of a tile it scores (kKeyWarps)
    // Where warps share rows: this lane's slots in pair_max and pair_p; the partner's (warp ^ 1) are one
    // warp's slots after or before them. (Indexing the partner's slots by its warp index instead made
    // ptxas spill 40 bytes.)
    constexpr int kMaxSlots = Smem::kMaxSlots, kPSlots = Smem::kPSlots;   // per warp
    const int partner_side = share == 0 ? 1 : -1;
    float* const my_max = pair_max + warp * kMaxSlots + lane;
    uint4* const my_p = pair_p + warp * kPSlots + lane;
    auto pair_sync = [&] {
        if constexpr (KEY_SPLIT > 1) named_barrier_sync(1 + warp / KEY_SPLIT, 32 * KEY_SPLIT);
    };
    // A per-row quantity (rows g and g + 8 of each atom) traded with the partner through the row-maxima
    // slots: offer this warp's values and meet the partner, then read the partner's value of (atom, row).
    auto offer_to_partner = [&](const float (&mine)[kMAtoms][2]) {
#pragma unroll
        for (int ma = 0; ma < kMAtoms; ++ma)
#pragma unroll
            for (int r = 0; r < 2; ++r) my_max[(ma * 2 + r) * 32] = mine[ma][r];
        pair_sync();
    };
    auto partner_value = [&](int ma, int r) { return my_max[(ma * 2 + r) * 32 + partner_side * kMaxSlots]; };

    // The K and V tiles of keys n.. into stage `stage`. In a paged cache a tile lies within one page
    // (page_size is a multiple of BLOCK_N): the page's rows from n % page_size.
    auto load_keys = [&](int stage, int n) {
        const T *k_src = k_head, *v_src = v_head;
        int row = n, rows_valid = key_count();
        if constexpr (KVCACHE) {
            if (block_table != nullptr) {
                const long long page = block_table[b * block_table_stride + n / page_size];
                row = n % page_size;
                rows_valid = keys - n + row;
                k_src = k + page * k_sb + h_kv * k_sh;
                v_src = v + page * v_sb + h_kv * v_sh;
            }
        }
        if constexpr (Smem::kStaged) {
            load_byte_tile_async<BLOCK_N, HEAD_DIM, kThreads>(staged + Smem::kStagedK + stage * BLOCK_N * HEAD_DIM,
                                                              reinterpret_cast<const unsigned char*>(k_src), k_ss, row,
                                                              rows_valid, head_dim, tid);
            load_byte_tile_async<BLOCK_N, HEAD_DIM, kThreads>(staged + Smem::kStagedV + stage * BLOCK_N * HEAD_DIM,
                                                              reinterpret_cast<const unsigned char*>(v_src), v_ss, row,
                                                              rows_valid, head_dim, tid);
        } else {
            load_tile_async<T, BLOCK_N, HEAD_DIM, kThreads, Row>(k_s + stage * BLOCK_N * kRow, k_src, k_ss, row,
                                                                  rows_valid, head_dim, vec_ok, tid);
            load_tile_async<T, BLOCK_N, HEAD_DIM, kThreads, Row>(v_s + stage * BLOCK_N * kRow, v_src, v_ss, row,
                                                                  rows_valid, head_dim, vec_ok, tid);
        }
    };
    if constexpr (Smem::kStaged) {
        load_byte_rows_async<BLOCK_M, HEAD_DIM, kThreads>(staged, [&](int r) -> const unsigned char* {
            const int row = m0 + r;
            const T* src = q_head + position(row) * q_ss + row % pack * q_sh;
            return row < rows ? reinterpret_cast<const unsigned char*>(src) : nullptr;
        }, q_head, head_dim, tid);
    } else if constexpr (KVCACHE) {
        load_rows_async<T, BLOCK_M, HEAD_DIM, kThreads, Row>(q_s, [&](int r) -> const T* {
            const int row = m0 + r;
            return row < rows ? q_head + position(row) * q_ss + row % pack * q_sh : nullptr;
        }, q_head, head_dim, vec_ok, tid);
    } else {
        load_tile_async<T, BLOCK_M, HEAD_DIM, kThreads, Row>(q_s, q_head, q_ss, m0, rows, head_dim, vec_ok, tid);
    }
    if constexpr (Smem::kStaged) {   // float8: Q's bytes into its tile, while tile 0 loads
        cp_async_commit();
        if (n_tiles > 0) load_keys(0, tile_key(0));
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        convert_e4m3_tile<BLOCK_M, HEAD_DIM, kThreads, Row>(q_s, staged, tid);   // the loop's barrier follows
    } else {
        if (n_tiles > 0) load_keys(0, tile_key(0));
        cp_async_commit();
    }

    float acc[kMAtoms][kDTiles][4];
    float m_i[kMAtoms][2], l_i[kMAtoms][2];   // rows g and g + 8 of each atom
#pragma unroll
    for (int ma = 0; ma < kMAtoms; ++ma) {
        zero(acc[ma]);
        m_i[ma][0] = m_i[ma][1] = -CUFLASH_INF;
        l_i[ma][0] = l_i[ma][1] = 0.f;
    }
    unsigned q_frag[kQInRegisters ? kMAtoms : 1][kQInRegisters ? kKSteps : 1][4];

    // Each lane's ldmatrix address (see mma.cuh) in chunk 0 or 1 of its row, in the first tile and stage;
    // the fragment of k16 step ks is 2 * ks chunks further (Row::advance), that of a later 16-row block a
    // constant number of rows further.
    constexpr int kRowBytes = kRow * sizeof(C);
    const unsigned q_lane = smem_addr(q_s + Row::offset(warp_row0 + (lane % 8) + 8 * ((lane / 8) % 2), lane / 16));
    const unsigned k_lane = smem_addr(k_s + Row::offset(key_share * kWarpKeys + (lane % 8) + 8 * (lane / 16),
                                                        (lane / 8) % 2));
    const unsigned v_lane = smem_addr(v_s + Row::offset((lane % 8) + 8 * ((lane / 8) % 2),
                                                        share * kDTiles + lane / 16));
    auto load_q = [&](unsigned (&a)[4], int ma, int ks) {
        ldmatrix_x4(a, Row::advance(q_lane, 2 * ks) + ma * 16 * kRowBytes);
    };

    for (int j = 0; j < n_tiles; ++j) {
        const int stage = j & 1;
        if (j + 1 < n_tiles) load_keys(stage ^ 1, tile_key(j + 1));
        cp_async_commit();   // possibly empty, so that "all but the newest group" is always tile j
        cp_async_wait<1>();
        __syncthreads();
        if constexpr (Smem::kStaged) {   // tile j's bytes into the tensor cores' tiles
            const unsigned char* tile_bytes = staged + stage * BLOCK_N * HEAD_DIM;
            convert_e4m3_tile<BLOCK_N, HEAD_DIM, kThreads, Row>(k_s, tile_bytes + Smem::kStagedK, tid);
            convert_e4m3_tile<BLOCK_N, HEAD_DIM, kThreads, Row>(v_s, tile_bytes + Smem::kStagedV, tid);
            __syncthreads();
        }
        if constexpr (kQInRegisters) {
            if (j == 0) {
#pragma unroll
                for (int ma = 0; ma < kMAtoms; ++ma)
#pragma unroll
                    for (int ks = 0; ks < kKSteps; ++ks) load_q(q_frag[ma][ks], ma, ks);
            }
        }

        // The tile's keys kSubN at a time (all at once except at head_dim 128 on 128 x 64 tiles), the highest
        // first as the tiles; the loop is not unrolled: unrolled, ptxas interleaved the sub-tiles and spilled.
#pragma unroll 1
        for (int sub = BLOCK_N / kSubN - 1; sub >= 0; --sub) {
            const int tile_stage = Smem::kStaged ? 0 : stage;   // float8: one converted tile
            const unsigned k_tile = k_lane + (tile_stage * BLOCK_N + sub * kSubN) * kRowBytes;
            const unsigned v_tile = v_lane + (tile_stage * BLOCK_N + sub * kSubN) * kRowBytes;
            const int n0 = tile_key(j) + sub * kSubN;
            // S = Q K^T for this warp's rows and kSubN keys (raw, unscaled).
            float s[kMAtoms][kNTiles][4];
            zero(s);
#pragma unroll
            for (int ks = 0; ks < kKSteps; ++ks) {
                unsigned a[kMAtoms][4];
#pragma unroll
                for (int ma = 0; ma < kMAtoms; ++ma) {
                    if constexpr (kQInRegisters) {
#pragma unroll
                        for (int i = 0; i < 4; ++i) a[ma][i] = q_frag[ma][ks][i];
                    } else {
                        load_q(a[ma], ma, ks);
                    }
                }
#pragma unroll
                for (int nb = 0; nb < kNTiles; nb += 2) {
                    unsigned kf[4];
                    ldmatrix_x4(kf, Row::advance(k_tile, 2 * ks) + nb * 8 * kRowBytes);
#pragma unroll
                    for (int ma = 0; ma < kMAtoms; ++ma) {
                        mma_16816<C>(s[ma][nb], a[ma], kf[0], kf[1]);
                        mma_16816<C>(s[ma][nb + 1], a[ma], kf[2], kf[3]);
                    }
                }
            }

            // Online softmax, base 2. Only the tiles that straddle an edge of the window or the end of the
            // keys are masked. Without modifiers the row max is taken on the raw products (scale_log2 > 0
            // keeps the order) and one FMA then scales and subtracts; with them (a softcap, ALiBi) the
            // scores are made first, and the max taken on them.
            const int tile_keys = key_count();
            const bool need_mask = n0 + kSubN > tile_keys || !window.covers(pos_begin, pos_end, n0, n0 + kSubN);
            float tile_max[kMAtoms][2];   // per row: the max of the scaled scores of the sub-tile's keys
            auto take_row_max = [&](int ma) {
                const int row0 = m0 + warp_row0 + ma * 16 + g;      // the row of elements 0 and 1
                // the query position of element e's row; under KVCACHE the rows' positions, computed once (a
                // two-element array of them instead made ptxas spill in the plain kernels, sm_80)
                const int pos0 = position(row0), pos8 = position(row0 + 8);
                auto row_position = [&](int e) { return KVCACHE ? (e < 2 ? pos0 : pos8) : row0 + 8 * (e / 2); };
                const int key0 = n0 + key_share * kWarpKeys + 2 * t;   // the key of element 0 of n8 tile 0
                if constexpr (Mod::kAny) {
#pragma unroll
                    for (int nb = 0; nb < kNTiles; ++nb)
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            s[ma][nb][e] =
                                mod.score(s[ma][nb][e], row_position(e), key0 + nb * 8 + (e & 1), diag);
                }
                if (need_mask) {
#pragma unroll
                    for (int nb = 0; nb < kNTiles; ++nb)
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            if (!window.sees(row_position(e), key0 + nb * 8 + (e & 1), tile_keys))
                                s[ma][nb][e] = -CUFLASH_INF;
                }
                float row_max[2] = {-CUFLASH_INF, -CUFLASH_INF};
#pragma unroll
                for (int nb = 0; nb < kNTiles; ++nb) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) row_max[e / 2] = fmaxf(row_max[e / 2], s[ma][nb][e]);
                }
#pragma unroll
                for (int r = 0; r < 2; ++r) tile_max[ma][r] = quad_max(row_max[r]) * score_factor;
            };
            unsigned p_frag[kMAtoms][kWarpKSteps][4];   // P of this warp's keys
            auto exponentiate = [&](int ma) {
                // m_i is the reference the exponents are taken against, not necessarily the running max: any
                // reference gives the same normalized output and lse, as long as exp2(x - m_i) stays small
                // enough for P (bf16/fp16) and the float32 sums. The warp moves its references (and rescales
                // acc and l_i) only when some row's max has grown past its reference by kRescaleSlack, which
                // after the first tiles is rare: most tiles skip the kDTiles * 4 multiplies per atom.
                const bool grown = tile_max[ma][0] > m_i[ma][0] + kRescaleSlack ||
                                   tile_max[ma][1] > m_i[ma][1] + kRescaleSlack;
                if (__any_sync(0xffffffffu, grown)) {
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const float m_new = fmaxf(m_i[ma][r], tile_max[ma][r]);
                        const float alpha = exp2f(m_i[ma][r] - safe_max(m_new));
                        m_i[ma][r] = m_new;
                        l_i[ma][r] *= alpha;
#pragma unroll
                        for (int i = 0; i < kDTiles; ++i) {
                            acc[ma][i][2 * r] *= alpha;
                            acc[ma][i][2 * r + 1] *= alpha;
                        }
                    }
                }
                // P = exp2(S * score_factor - m_i), packed straight into A fragments of P.V (no trip through
                // shared memory). The row sums take every P; dropout zeroes the dropped ones in the fragments
                // only, one Philox call per two fragments (Dropout::drop_pairs).
                const float neg_base[2] = {-safe_max(m_i[ma][0]), -safe_max(m_i[ma][1])};
#pragma unroll
                for (int nb = 0; nb < kNTiles; ++nb) {
                    float pv[4];
#pragma unroll
                    for (int e = 0; e < 4; ++e) pv[e] = exp2f(fmaf(s[ma][nb][e], score_factor, neg_base[e / 2]));
                    l_i[ma][0] += pv[0] + pv[1];
                    l_i[ma][1] += pv[2] + pv[3];
                    p_frag[ma][nb / 2][(nb % 2) * 2 + 0] = pack2<C>(pv[0], pv[1]);
                    p_frag[ma][nb / 2][(nb % 2) * 2 + 1] = pack2<C>(pv[2], pv[3]);
                }
                dropout.drop_pairs(p_frag[ma], m0 + warp_row0 + ma * 16 + g, n0 + share * kWarpKeys + 2 * t);
            };
            if constexpr (KEY_SPLIT == 1) {
#pragma unroll
                for (int ma = 0; ma < kMAtoms; ++ma) {
                    take_row_max(ma);
                    exponentiate(ma);
                }
            } else {   // the max over the partner's keys too, so that both keep the same m_i
#pragma unroll
                for (int ma = 0; ma < kMAtoms; ++ma) take_row_max(ma);
                offer_to_partner(tile_max);
#pragma unroll
                for (int ma = 0; ma < kMAtoms; ++ma) {
#pragma unroll
                    for (int r = 0; r < 2; ++r) tile_max[ma][r] = fmaxf(tile_max[ma][r], partner_value(ma, r));
                    exponentiate(ma);
                }
            }

            // acc += P V: this warp's keys, then (KEY_SPLIT = 2) its partner's, whose P it reads back.
            auto multiply_pv = [&](const unsigned (&p)[kMAtoms][kWarpKSteps][4], int key_share) {
#pragma unroll
                for (int kk = 0; kk < kWarpKSteps; ++kk) {
#pragma unroll
                    for (int db = 0; db < kDTiles; db += 2) {
                        unsigned vf[4];
                        const int key_row = key_share * kWarpKeys + kk * 16;
                        ldmatrix_x4_trans(vf, Row::advance(v_tile, db) + key_row * kRowBytes);
#pragma unroll
                        for (int ma = 0; ma < kMAtoms; ++ma) {
                            mma_16816<C>(acc[ma][db], p[ma][kk], vf[0], vf[1]);
                            mma_16816<C>(acc[ma][db + 1], p[ma][kk], vf[2], vf[3]);
                        }
                    }
                }
            };
            if constexpr (KEY_SPLIT > 1) {
#pragma unroll
                for (int ma = 0; ma < kMAtoms; ++ma)
#pragma unroll
                    for (int kk = 0; kk < kWarpKSteps; ++kk)
                        my_p[(ma * kWarpKSteps + kk) * 32] =
                            make_uint4(p_frag[ma][kk][0], p_frag[ma][kk][1], p_frag[ma][kk][2], p_frag[ma][kk][3]);
            }
            multiply_pv(p_frag, key_share);
            if constexpr (KEY_SPLIT > 1) {
                pair_sync();
                unsigned p_partner[kMAtoms][kWarpKSteps][4];
#pragma unroll
                for (int ma = 0; ma < kMAtoms; ++ma)
#pragma unroll
                    for (int kk = 0; kk < kWarpKSteps; ++kk) {
                        const uint4 x = my_p[(ma * kWarpKSteps + kk) * 32 + partner_side * kPSlots];
                        p_partner[ma][kk][0] = x.x;
                        p_partner[ma][kk][1] = x.y;
                        p_partner[ma][kk][2] = x.z;
                        p_partner[ma][kk][3] = x.w;
                    }
                multiply_pv(p_partner, share ^ 1);
            }
        }
        __syncthreads();   // this stage is refilled by the loads issued at the top of iteration j + 1
    }
    // Epilogue: normalize, stage each warp's rows in its own rows of the Q tile (no longer read: the
    // barrier also lands Q's copies where no key tile was walked), and store them as 16-byte chunks,
    // consecutive lanes on consecutive chunks of a row. A row that saw no key has l = 0: output 0,
    // lse = -inf (with a sink: output 0, lse = the sink).
    cp_async_wait<0>();
    __syncthreads();
    // With key splits (KVCACHE) every thread of the block comes here once warp 0 has stored the block's
    // partials. The blocks of a row group count themselves in split_counters[row_group]; the last to count
    // resets it for the next call and merges the group's num_splits parts, a warp per row (merge_row reads
    // them through L2). The fences order each thread's partial stores before the count and the merge's
    // loads after it. A named barrier: the warps arrive from two places (warp 0 after the epilogue).
    const bool partial = KVCACHE && num_splits > 1;
    O* const out_values = reinterpret_cast<O*>(out);   // float8: out holds Output<T>, which the field list types T
    auto merge_splits_if_last = [&] {
        constexpr int kSplitsBarrier = 1;   // 0 is __syncthreads'; KVCACHE has no warp pairs (KEY_SPLIT 1)
        int* const last_flag = reinterpret_cast<int*>(q_s);   // the Q tile's memory, read no more
        __threadfence();
        named_barrier_sync(kSplitsBarrier, kThreads);
        if (tid == 0) {
            const bool last = atomicAdd(split_counters + row_group, 1) == num_splits - 1;
            if (last) atomicExch(split_counters + row_group, 0);
            *last_flag = last;
        }
        named_barrier_sync(kSplitsBarrier, kThreads);
        if (*last_flag == 0) return;
        __threadfence();
        const long long part_rows = static_cast<long long>(batch) * heads * seqlen_q;   // rows per part
        for (int r = warp; r < BLOCK_M && m0 + r < rows; r += WARPS) {
            const int row = m0 + r, head = h + row % pack, at = position(row);
            const long long slot = (static_cast<long long>(b) * heads + head) * seqlen_q + at;   // lse's layout
            const float sink = (MODS & kModSinks) != 0 ? sinks[head] : -CUFLASH_INF;
            merge_row(out_partial + ((static_cast<long long>(b) * seqlen_q + at) * heads + head) * head_dim,
                      part_rows * head_dim, lse_partial + slot, part_rows, num_splits, sink,
                      out_values + b * o_sb + at * o_ss + head * o_sh, lse == nullptr ? nullptr : lse + slot,
                      head_dim, lane);
        }
    };
    if constexpr (kKeyWarps > KEY_SPLIT) {
        // The KV-cache warps' states over their keys merged into warp 0's, through the key tiles' memory and
        // what follows them (no longer read): each warp's m_i per row, then its l_i and acc rescaled to the
        // largest m_i, summed by warp 0, which alone runs the epilogue. A warp that saw no key has m_i = -inf and
        // counts for nothing.
        static_assert(kMAtoms == 1 && (2 + kDTiles * 4) * 32 * WARPS * 4 <= Smem::kBytes - Smem::kK * sizeof(C),
                      "the merge's slots fit in the key tiles (and float8's staged bytes)");
        float* row_slots = reinterpret_cast<float*>(k_s);          // [WARPS][2 rows][32 lanes]
        float* acc_slots = row_slots + WARPS * 2 * 32;              // [WARPS][kDTiles][4][32 lanes]
        float m_all[2], factor[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) row_slots[(warp * 2 + r) * 32 + lane] = m_i[0][r];
        __syncthreads();
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            m_all[r] = -CUFLASH_INF;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) m_all[r] = fmaxf(m_all[r], row_slots[(w * 2 + r) * 32 + lane]);
            factor[r] = exp2f(m_i[0][r] - safe_max(m_all[r]));
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < 2; ++r) row_slots[(warp * 2 + r) * 32 + lane] = quad_sum(l_i[0][r]) * factor[r];
#pragma unroll
        for (int db = 0; db < kDTiles; ++db)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_slots[((warp * kDTiles + db) * 4 + e) * 32 + lane] = acc[0][db][e] * factor[e / 2];
        __syncthreads();
        if (warp != 0) {   // warp 0 alone runs the epilogue
            if (partial) merge_splits_if_last();
            return;
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float l = 0.f;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) l += row_slots[(w * 2 + r) * 32 + lane];
            m_i[0][r] = m_all[r];
            l_i[0][r] = t == 0 ? l : 0.f;   // the epilogue sums l_i over the quad
        }
#pragma unroll
        for (int db = 0; db < kDTiles; ++db)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float sum = 0.f;
#pragma unroll
                for (int w = 0; w < WARPS; ++w) sum += acc_slots[((w * kDTiles + db) * 4 + e) * 32 + lane];
                acc[0][db][e] = sum;
            }
    }
    // Where warps share rows, each holds the row sums of its own keys: the partners trade them (through
    // the row-maxima slots), and each stages its columns, then stores its share of the rows.
    float partner_l[kMAtoms][2];
    if constexpr (KEY_SPLIT > 1) {
        float own_l[kMAtoms][2];
#pragma unroll
        for (int ma = 0; ma < kMAtoms; ++ma)
#pragma unroll
            for (int r = 0; r < 2; ++r) own_l[ma][r] = quad_sum(l_i[ma][r]);
        offer_to_partner(own_l);
#pragma unroll
        for (int ma = 0; ma < kMAtoms; ++ma)
#pragma unroll
            for (int r = 0; r < 2; ++r) partner_l[ma][r] = partner_value(ma, r);
    }
    // A packed batch's bounds and offsets read again (Sequence::reread), not held across the key loop.
    const Sequence<VARLEN> out_seq =
        VARLEN ? Sequence<VARLEN>::reread(cu_seqlens_q, cu_seqlens_k, b, batch, seqlen_q, seqlen_k, diagonal) : seq;
    const int out_rows = KVCACHE ? rows : out_seq.seqlen_q;
    float* lse_head = lse == nullptr ? nullptr
                                     : lse + (VARLEN ? out_seq.stats(b, heads, h)
                                                     : static_cast<long long>(bh) * seqlen_q);
    const float sink2 = (MODS & kModSinks) != 0 && !KVCACHE ? sinks[h] * kLog2e : 0.f;   // this head's sink, base 2
    O* const o_s = reinterpret_cast<O*>(q_s);   // the output's rows staged where Q was
    const float v_scale = kFloat8<T> && v_descale != nullptr ? v_descale[b * descale_sb + h_kv * descale_sh] : 1.f;
    // With key splits each block writes its split's result as float32 partials, straight from registers,
    // without the sinks (the merge adds them); a KV-cache row's head is h + row % pack.
#pragma unroll
    for (int ma = 0; ma < kMAtoms; ++ma) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float l = quad_sum(l_i[ma][r]);
            if constexpr (KEY_SPLIT > 1) l += partner_l[ma][r];
            float m = m_i[ma][r], acc_factor = 1.f;
            if constexpr ((MODS & kModSinks) != 0) {   // the sink joins the denominator: rescale to max(m, sink)
                const float row_sink2 = !KVCACHE ? sink2 : partial ? -CUFLASH_INF
                                                     : sinks[h + (m0 + warp_row0 + ma * 16 + g + 8 * r) % pack] * kLog2e;
                const float m_new = safe_max(fmaxf(m, row_sink2));
                acc_factor = exp2f(m - m_new);
                l = l * acc_factor + exp2f(row_sink2 - m_new);
                m = m_new;
            }
            const float inv_l =
                l == 0.f ? 0.f : (kDropout ? acc_factor * dropout_scale : kFloat8<T> ? acc_factor * v_scale : acc_factor) / l;
            const int tile_row = warp_row0 + ma * 16 + g + 8 * r;
            if constexpr (KVCACHE) {
                const int row = m0 + tile_row;
                const long long slot = (static_cast<long long>(b) * heads + h + row % pack) * seqlen_q + position(row);
                const float row_lse = l == 0.f ? -CUFLASH_INF : (m + log2f(l)) * kLn2;
                if (partial && row < out_rows) {
                    if (t == 0) lse_partial[static_cast<long long>(split) * batch * heads * seqlen_q + slot] = row_lse;
                    float* dst = out_partial + ((static_cast<long long>(split) * batch + b) * seqlen_q + position(row)) *
                                                   heads * head_dim + (h + row % pack) * head_dim;
#pragma unroll
                    for (int db = 0; db < kDTiles; ++db) {
                        const int col = db * 8 + 2 * t;
                        if (col < head_dim) dst[col] = acc[ma][db][2 * r] * inv_l;
                        if (col + 1 < head_dim) dst[col + 1] = acc[ma][db][2 * r + 1] * inv_l;
                    }
                    continue;
                }
                if (lse != nullptr && t == 0 && row < out_rows) lse[slot] = row_lse;
            } else {
                if (lse_head != nullptr && t == 0 && share == 0 && m0 + tile_row < out_rows)
                    lse_head[m0 + tile_row] = l == 0.f ? -CUFLASH_INF : (m + log2f(l)) * kLn2;
            }
#pragma unroll
            for (int db = 0; db < kDTiles; ++db)
                *reinterpret_cast<unsigned*>(o_s + Row::offset(tile_row, share * kDTiles + db) + 2 * t) =
                    pack2<O>(acc[ma][db][2 * r] * inv_l, acc[ma][db][2 * r + 1] * inv_l);
        }
    }
    if (partial) {
        merge_splits_if_last();
        return;
    }
    constexpr int kStoreRows = kRowsPerWarp / KEY_SPLIT;
    static_assert(kStoreRows % 8 == 0, "a warp's first stored row starts the swizzle's 8-row period");
    if constexpr (KEY_SPLIT > 1)
        pair_sync();
    else
        __syncwarp();
    const int store_row0 = warp_row0 + share * kStoreRows;
    if constexpr (KVCACHE) {
        store_rows_to<O, kStoreRows, HEAD_DIM, 32, Row>([&](int r) -> O* {
            const int row = m0 + store_row0 + r;
            return row < out_rows ? out_values + b * o_sb + position(row) * o_ss + (h + row % pack) * o_sh : nullptr;
        }, head_dim, o_s + store_row0 * kRow, lane);
    } else {
        store_rows<O, kStoreRows, HEAD_DIM, 32, Row>(out_values + b * o_sb + out_seq.q_start * o_ss + h * o_sh, o_ss,
                                                     m0 + store_row0, out_rows, head_dim, o_s + store_row0 * kRow,
                                                     lane);
    }
}

}  // namespace cuflash
