// Device helpers shared by every cuflash kernel.
//
// Layout conventions (all kernels):
//   q, out, dout, dq : (batch, seqlen_q, heads,    head_dim), last axis contiguous, other strides given
//   k, v, dk, dv     : (batch, seqlen_k, heads_kv, head_dim), same
//   lse, delta       : float32 (batch, heads, seqlen_q), contiguous; lse is the natural-log logsumexp
// Query head h reads kv head h / (heads / heads_kv).
// Masks (causal, sliding windows) follow Window below.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#define CUFLASH_INF __int_as_float(0x7f800000)

namespace cuflash {

constexpr float kLog2e = 1.4426950408889634f;  // log2(e): scores are kept in base 2 inside kernels
constexpr float kLn2 = 0.6931471805599453f;    // ln(2): converts a base-2 logsumexp back to natural log
constexpr float kFloatMax = 3.40282347e38f;   // the largest finite float

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_fp8_e4m3>(__nv_fp8_e4m3 x) { return static_cast<float>(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
    return __bfloat162float(x);
}

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __nv_fp8_e4m3 from_float<__nv_fp8_e4m3>(float x) { return __nv_fp8_e4m3(x); }

// float8 e4m3 inputs (the Hopper forward's float8 form, the KV-cache forward's float8 caches): their output is
// bfloat16, other types' their own; the mma.sync kernels convert them to float16 for the tensor cores (Compute:
// every e4m3 value is exact in it), other types stay as they are.
template <typename T> constexpr bool kFloat8 = false;
template <> constexpr bool kFloat8<__nv_fp8_e4m3> = true;
template <typename T> struct OutputOf { using type = T; };
template <> struct OutputOf<__nv_fp8_e4m3> { using type = __nv_bfloat16; };
template <typename T> using Output = typename OutputOf<T>::type;
template <typename T> struct ComputeOf { using type = T; };
template <> struct ComputeOf<__nv_fp8_e4m3> { using type = __half; };
template <typename T> using Compute = typename ComputeOf<T>::type;

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

// How far (base 2) a row's max may exceed the reference its exponents are taken against before the
// forward's warps rescale: P stays below 2^8, well inside bf16/fp16 and the float32 sums (fwd_mma).
constexpr float kRescaleSlack = 8.f;

// The kinds of mask a kernel is specialized for (its MASK template argument; _config.MASK_*).
enum MaskKind : int {
    kMaskNone = 0,     // every key within the sequences is visible
    kMaskCausal = 1,   // keys up to `right` past the diagonal (causal: right = 0); no left side
    kMaskWindow = 2,   // a sliding window: both sides (a side may still be unbounded)
};

// The window of visible keys, one rule for causal masks and sliding windows (FlashAttention's): query i
// sees key j when -left <= j - (i + diagonal) <= right, with diagonal = seqlen_k - seqlen_q (bottom-right
// alignment) or 0 (top-left). The host encodes an unbounded side as seqlen_q + seqlen_k, which no
// |j - i - diagonal| reaches, so neither side needs a branch. Only kMaskWindow reads `left`: a causal
// kernel's code has no left side at all (as a runtime bound it cost the causal forwards 2-3%,
// bench/NOTES.md), and kMaskNone reads nothing.
template <int MASK> struct Window {
    static_assert(MASK == kMaskNone || MASK == kMaskCausal || MASK == kMaskWindow, "a MaskKind");
    static constexpr bool kMasked = MASK != kMaskNone;
    static constexpr bool kLeft = MASK == kMaskWindow;
    int diagonal, left, right;
    // The keys [key_begin(row_begin), key_end(row_end)) hold every key that a row of [row_begin, row_end) sees.
    __device__ __forceinline__ int key_begin(int row_begin) const {
        return kLeft ? max(0, row_begin + diagonal - left) : 0;
    }
    __device__ __forceinline__ int key_end(int row_end, int seqlen_k) const {
        return kMasked ? max(0, min(seqlen_k, row_end + diagonal + right)) : seqlen_k;
    }
    // The rows [row_begin(key_begin), row_end(key_end)) hold every row that sees a key of [key_begin, key_end).
    __device__ __forceinline__ int row_begin(int key_begin) const {
        return kMasked ? max(0, key_begin - diagonal - right) : 0;
    }
    __device__ __forceinline__ int row_end(int key_end, int seqlen_q) const {
        return kLeft ? max(0, min(seqlen_q, key_end - diagonal + left)) : seqlen_q;
    }
    // Is `key` within the keys and inside row `row`'s window? (diagonal + right and diagonal - left are
    // loop invariants: one add and one compare per side and element.)
    __device__ __forceinline__ bool sees(int row, int key, int seqlen_k) const {
        return key < seqlen_k && (!kMasked || (key <= row + (diagonal + right) &&
                                               (!kLeft || key >= row + (diagonal - left))));
    }
    // Does every row of [row_begin, row_end) see every key of [key_begin, key_end) (those within the keys)?
    // Then a tile needs no element mask for the window.
    __device__ __forceinline__ bool covers(int row_begin, int row_end, int key_begin, int key_end) const {
        return !kMasked || (key_end - 1 <= row_begin + diagonal + right &&
                            (!kLeft || key_begin >= row_end - 1 + diagonal - left));
    }
};

// The tiles of block_n keys that rows [m0, m0 + block_m) see under `window`: `count` of them from key `first`
// (none where count <= 0). fwd_wgmma's work items, and varlen_order's sort keys for them.
struct KeyTiles {
    int first, count;
    template <int MASK>
    __device__ __forceinline__ KeyTiles(const Window<MASK>& window, int m0, int block_m, int block_n, int seqlen_k)
        : first(window.key_begin(m0) / block_n * block_n),
          count((window.key_end(m0 + block_m, seqlen_k) - first + block_n - 1) / block_n) {}
};

// The query tiles a key block's backward walks: the BLOCK_M-row tiles from `begin` (a multiple of BLOCK_M) to
// `end` whose rows see some key of [n0, n0 + block_n) under `window`, `count` of them, taken as `steps` steps
// (head in the kv group, query tile), query tile fastest. ORDERED (bwd_dkdv_wgmma's ordered form, which sets
// `first` or `downwards`): each head's tiles from tile `first` upwards, wrapping from the last to `begin`, or
// `downwards` from the last to `begin`.
template <int BLOCK_M, bool ORDERED = false> struct QueryTiles {
    int begin, end, count, steps, first = 0;
    bool downwards = false;
    template <int MASK>
    __device__ __forceinline__ QueryTiles(const Window<MASK>& window, int n0, int block_n, int seqlen_q, int group)
        : begin(window.row_begin(n0) / BLOCK_M * BLOCK_M), end(window.row_end(n0 + block_n, seqlen_q)) {
        count = begin < end ? (end - begin + BLOCK_M - 1) / BLOCK_M : 0;
        steps = count * group;
    }
    // step s's query head (of kv head h_kv's group) and first row
    __device__ __forceinline__ int head(int s, int h_kv, int group) const { return h_kv * group + s / count; }
    __device__ __forceinline__ int row(int s) const {
        const int u = s % count;
        if constexpr (!ORDERED) return begin + u * BLOCK_M;
        int t = downwards ? count - 1 - u : first + u;
        t -= t >= count ? count : 0;
        return begin + t * BLOCK_M;
    }
};

// Score modifiers a kernel is specialized for: bits of its MODS template argument (_config.MOD_*).
enum ModBits : int {
    kModSoftcap = 1,   // score = softcap * tanh(scale q.k / softcap)
    kModAlibi = 2,     // score -= slope * |i + diagonal - j|
    kModSinks = 4,     // a per-head logit joins each row's denominator (the forward's epilogue only)
    kModDropout = 8,   // P is dropped by Dropout's mask below (not a score: named here for the same template bits)
};

// tanh on the MUFU unit (sm_75 and newer; relative error about 2^-11): one instruction, as the
// exponential it sits beside, where tanhf is a long sequence. FlashAttention's softcap does the same.
__device__ __forceinline__ float tanh_approx(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The score of a (row, key) pair in base 2, from the raw product s = q . k: scale * s through the softcap
// and ALiBi (applied in that order, the reference's), times log2(e). Without modifiers it is the plain
// s * scale_log2 (the forward then never calls it: it folds the scale into its exponent's FMA).
// Built per thread block: slope_log2 is this (batch, head)'s -slope * log2(e). EXACT (the float32
// kernels) takes tanhf instead of the MUFU approximation, whose 2^-11 would show in float32 results.
template <int MODS, bool EXACT = false> struct ScoreMod {
    static constexpr bool kSoftcap = (MODS & kModSoftcap) != 0;
    static constexpr bool kAlibi = (MODS & kModAlibi) != 0;
    static constexpr bool kAny = kSoftcap || kAlibi;
    float scale_log2, softcap_in, softcap_out, slope_log2;   // softcap_in = scale / softcap, out = softcap * log2(e)

    __device__ __forceinline__ ScoreMod(float scale_log2_, float softcap_in_, float softcap_out_,
                                        const float* alibi_slopes, int alibi_batch_stride, int b, int h)
        : scale_log2(scale_log2_), softcap_in(softcap_in_), softcap_out(softcap_out_), slope_log2(0.f) {
        if constexpr (kAlibi) slope_log2 = slope_log2_of(alibi_slopes, alibi_batch_stride, b, h);
    }
    // ALiBi's -slope * log2(e) of (batch b, head h)
    static __device__ __forceinline__ float slope_log2_of(const float* alibi_slopes, int alibi_batch_stride, int b,
                                                          int h) {
        return -alibi_slopes[b * alibi_batch_stride + h] * kLog2e;
    }
    // ALiBi's bias per unit of distance in units of `factor` (the score's base-2 scale): slope_log2 / factor,
    // clamped to float's range. A kernel whose products accumulate onto the bias takes it (kAlibiInS).
    static __device__ __forceinline__ float alibi_unit_of(float slope_log2, float factor) {
        return fminf(fmaxf(slope_log2 / factor, -kFloatMax), kFloatMax);
    }
    __device__ __forceinline__ float alibi(int row, int key, int diagonal) const {
        return alibi_at(static_cast<float>(row + diagonal - key));
    }
    // ALiBi's bias of a pair `distance` = row + diagonal - key apart, as a float (exact below 2^24)
    __device__ __forceinline__ float alibi_at(float distance) const {
        return kAlibi ? slope_log2 * fabsf(distance) : 0.f;
    }
    __device__ __forceinline__ float tanh(float x) const { return EXACT ? tanhf(x) : tanh_approx(x); }
    // the score before ALiBi: scale * s through the softcap, times log2(e)
    __device__ __forceinline__ float capped(float s) const {
        return kSoftcap ? softcap_out * tanh(s * softcap_in) : s * scale_log2;
    }
    __device__ __forceinline__ float score(float s, int row, int key, int diagonal) const {
        return kAlibi ? capped(s) + alibi(row, key, diagonal) : capped(s);
    }
    // score() of a pair `distance` apart (alibi_at): a kernel that takes a row's distance to its first key once
    // per tile and each element's key offset as a constant pays no integer conversion per element (fwd_wgmma)
    __device__ __forceinline__ float score_at(float s, float distance) const {
        return kAlibi ? capped(s) + alibi_at(distance) : capped(s);
    }
    // The score, and in `grad` d score / d (scale q.k): 1 - tanh^2 under the softcap, else 1.
    __device__ __forceinline__ float score(float s, int row, int key, int diagonal, float& grad) const {
        if constexpr (!kSoftcap) {
            grad = 1.f;
            return score(s, row, key, diagonal);
        }
        const float t = tanh(s * softcap_in);
        grad = 1.f - t * t;
        return kAlibi ? softcap_out * t + alibi(row, key, diagonal) : softcap_out * t;
    }
    // d score / d (scale q.k) of a pair whose probability is p = exp2(score - lse2): 1 - tanh^2 for the
    // softcap (1 without it), for kernels that keep P, not the score (no registers for both): tanh comes
    // back from P, score = log2(p) + lse2. A pair with p = 0 has dS = 0 whatever the factor.
    __device__ __forceinline__ float softcap_grad(float p, float lse2, int row, int key, int diagonal) const {
        if constexpr (!kSoftcap) return 1.f;
        const float t = (__log2f(p) + lse2 - alibi(row, key, diagonal)) * __frcp_rn(softcap_out);
        return p > 0.f ? 1.f - t * t : 0.f;
    }
};

// Rounds of the Philox generator (_philox.ROUNDS, checked by tests/test_compile.py): FlashAttention-2's
// seven, which Salmon et al. found to pass BigCrush (ten is their default, with a margin); three rounds
// fewer cut dropout's forward by 5-8% (bench/NOTES.md, dropout d2).
constexpr int kPhiloxRounds = 7;

// Philox4x32 of `c` under the key (k0, k1), kPhiloxRounds rounds: _philox.philox4x32 (Salmon et al.,
// SC'11). Each round is two 32 x 32 -> 64-bit products; the key schedule is recomputed in the loop (ptxas
// keeps it in uniform registers: the key is the same for the whole grid).
__device__ __forceinline__ uint4 philox4x32(uint4 c, unsigned k0, unsigned k1) {
#pragma unroll
    for (int round = 0; round < kPhiloxRounds; ++round) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const unsigned hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        const unsigned hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    }
    return c;
}

// Dropout's keep mask (kModDropout), the function of _philox.keep. One Philox call draws the 16 elements a
// thread holds of a 16 x 32 block of an mma accumulator (rows r, r + 8; keys 2c, 2c + 1, 2c + 8, 2c + 9 and
// each + 16), 8 bits each: word 2 * kh + rh of the call holds those of row half rh (row bit 3) and key half kh
// (key bit 3), in byte 2 * (key bit 4) + (key bit 0). An element is kept where its draw is at least
// `threshold` = _philox.keep_threshold(dropout_p) (dropout_p * 2^8 rounded, at most 255). A call's two
// 16 x 16 blocks go to the same thread in the kernels that hold keys as columns (bits2, drop_pairs), so they
// draw once per 16 elements; a transposed tile's thread uses 4 elements of each of its calls, and two lanes
// share the drawing (transposed_bits). Kept probabilities are scaled by 1 / (1 - dropout_p) where the kernels
// apply their output factors.
template <bool ENABLED> struct Dropout {
    unsigned key0, key1, bh, offset, threshold;
    __device__ __forceinline__ Dropout(unsigned long long seed, unsigned offset_, unsigned threshold_, int bh_)
        : key0(static_cast<unsigned>(seed)), key1(static_cast<unsigned>(seed >> 32)), bh(bh_), offset(offset_),
          threshold(threshold_) {}
    // The call of the 16 x 32 block that holds element (row, key), any one of its sixteen of the thread's.
    __device__ __forceinline__ uint4 call(int row, int key) const {
        return philox4x32(make_uint4(((key >> 5) << 2) | ((key >> 1) & 3), ((row >> 4) << 3) | (row & 7), bh, offset),
                          key0, key1);
    }
    // The keep bits of the 16 x 16 block that holds element (row, key), any one of its eight of the thread's:
    // its element in row half rh, key half kh and key parity odd has bit keep_bit(rh, kh, odd). ~0 (keep all)
    // without dropout. SERIAL: one compare per draw, not four at once (block_bits).
    template <bool SERIAL = false> __device__ __forceinline__ unsigned bits(int row, int key) const {
        if constexpr (!ENABLED) return ~0u;
        return block_bits<SERIAL>(call(row, key), (key >> 4) & 1);
    }
    // The keep bits of both 16 x 16 blocks of the call of (row, key): bits() of its first block (key bit 4
    // clear) in bits 0-7, of its second in bits 8-15. ~0 without dropout.
    template <bool SERIAL = false> __device__ __forceinline__ unsigned bits2(int row, int key) const {
        if constexpr (!ENABLED) return ~0u;
        const uint4 w = call(row, key);
        return block_bits<SERIAL>(w, 0) | block_bits<SERIAL>(w, 1) << 8;
    }
    // Dropout on the A fragments of P of BLOCKS 16 x 16 blocks of keys key, key + 16, ... (key: the first
    // block's first key plus 2 t; where BLOCKS is even the first block starts a call, its key a multiple of
    // 32 plus 2 t), in place: pairs[b][i] holds two packed 16-bit values, the even key's in the low half, of
    // row half i % 2 and key half i / 2 of block b. Word i of a call holds the draws of pairs[b][i] in bytes
    // 2 (b % 2) and 2 (b % 2) + 1: one compare of the word's four draws at once (kept_signs), then a byte
    // permute spreads the two draws' keep bits over the pair's halves, and one AND applies them.
    template <int BLOCKS>
    __device__ __forceinline__ void drop_pairs(unsigned (&pairs)[BLOCKS][4], int row, int key) const {
        if constexpr (!ENABLED) return;
        constexpr int kPerCall = BLOCKS % 2 == 0 ? 2 : 1;   // 16 x 16 blocks per call
#pragma unroll
        for (int first = 0; first < BLOCKS; first += kPerCall) {
            const uint4 w = call(row, key + 16 * first);
            const unsigned words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const unsigned signs = kept_signs(words[i]);
#pragma unroll
                for (int b = first; b < first + kPerCall; ++b) {
                    const int half = kPerCall == 2 ? b % 2 : (key >> 4) & 1;   // the block's byte pair
                    pairs[b][i] &= replicate_signs(signs, half ? kHighPairSigns : kLowPairSigns);
                }
            }
        }
    }
    // The bit of bits() for the element in row half rh (row bit 3), key half kh (key bit 3) and key parity
    // odd (key bit 0). In accumulator layout it is 4 * (n8 tile & 1) + the fragment index e.
    __device__ static constexpr int keep_bit(int rh, int kh, int odd) { return 4 * kh + 2 * rh + odd; }
    // The bits of a warp tile's 16 x 16 blocks, in accumulator layout: ATOMS 16-row atoms from the one of
    // `row` (the thread's row g of the first atom) times CALLS 16-key blocks from `key` (its key 2t of the
    // first, which starts a call where CALLS is even), block b = atom * CALLS + call at bits 8 * (b % 4) of
    // words[b / 4]. UNROLL calls of a word are in flight at once: a call is kPhiloxRounds dependent rounds,
    // so one at a time leaves the warp waiting on its latency, but unrolled beside a kernel's tiles the
    // rounds can make ptxas spill (the kernels choose).
    template <int ATOMS, int CALLS> static constexpr int kTileWords = (ATOMS * CALLS + 3) / 4;
    template <int ATOMS, int CALLS, int UNROLL>
    __device__ __forceinline__ void tile_bits(unsigned (&words)[kTileWords<ATOMS, CALLS>], int row, int key) const {
        constexpr int kPerCall = CALLS % 2 == 0 ? 2 : 1;   // 16 x 16 blocks per call
#pragma unroll
        for (int w = 0; w < kTileWords<ATOMS, CALLS>; ++w) {
            unsigned word = 0;
#pragma unroll UNROLL
            for (int i = 0; i < 4 && 4 * w + i < ATOMS * CALLS; i += kPerCall) {
                const int block = 4 * w + i, block_row = row + 16 * (block / CALLS);
                const int block_key = key + 16 * (block % CALLS);
                word |= (kPerCall == 2 ? bits2(block_row, block_key) : bits(block_row, block_key)) << (8 * i);
            }
            words[w] = word;
        }
    }
    // Is element e of n8 tile nb of atom `atom` kept, by tile_bits' words? (Always without dropout.)
    template <int ATOMS, int CALLS, int WORDS>
    __device__ static __forceinline__ bool tile_keeps(const unsigned (&words)[WORDS], int atom, int nb, int e) {
        if constexpr (!ENABLED) return true;
        const int block = atom * CALLS + nb / 2;
        return (words[block / 4] >> (8 * (block % 4) + keep_bit(e >> 1, nb & 1, e & 1))) & 1u;
    }
    // The keep bits of a transposed tile (keys as rows, queries as columns: S^T in the dK/dV kernels): a
    // thread's elements of a 16-query block lie in two calls, those of its queries `query` (the block's first
    // plus 2 t) and query + 1 (and their + 8); calls[odd] gets bits() of query + odd at the thread's `key`
    // (its key row g of a 16-key block: key parity = g parity). Lanes g and g ^ 1 (lane ^ 4) need the same two
    // calls: each draws the one of its key parity and they swap through a shuffle, so the warp draws each call
    // once. The whole warp must call it.
    __device__ __forceinline__ void transposed_bits(unsigned (&calls)[2], int query, int key) const {
        const bool odd = key & 1;
        const unsigned mine = bits(query + odd, key), theirs = __shfl_xor_sync(0xffffffffu, mine, 4);
        calls[0] = odd ? theirs : mine;
        calls[1] = odd ? mine : theirs;
    }
    // Is element e of n8 tile nb of a transposed tile kept (query 8 nb + 2 t + (e & 1) of the 16-query block,
    // key row g + 8 (e >> 1)), by its block's transposed_bits? (Always without dropout.)
    __device__ static __forceinline__ bool transposed_keeps(const unsigned (&calls)[2], int nb, int e, int g) {
        if constexpr (!ENABLED) return true;
        return (calls[e & 1] >> keep_bit(nb & 1, e >> 1, g & 1)) & 1u;
    }
    // Is element (row, key) kept? One call per element, for the kernels whose threads hold no mma tile.
    __device__ __forceinline__ bool keeps(int row, int key) const {
        if constexpr (!ENABLED) return true;
        return (bits(row, key) >> keep_bit((row >> 3) & 1, (key >> 3) & 1, key & 1)) & 1u;
    }

  private:
    // prmt selectors that fill the low and the high 16 bits of a word with the sign (bit 7) of byte 2 half
    // and of byte 2 half + 1 of the source: nibble 8 + n of a selector replicates byte n's sign.
    static constexpr unsigned kLowPairSigns = 0x9988u, kHighPairSigns = 0xbbaau;
    // prmt.b32 with its sign-replicate bit: __byte_perm masks each selector nibble to 3 bits and drops it.
    __device__ static __forceinline__ unsigned replicate_signs(unsigned x, unsigned selector) {
        unsigned r;
        asm("prmt.b32 %0, %1, 0, %2;" : "=r"(r) : "r"(x), "r"(selector));
        return r;
    }
    // Bit 7 of byte n set where the draw in byte n of `word` is kept (at least `threshold`), all four bytes
    // at once, the other bits arbitrary. Where a draw's top bit differs from the threshold's, the draw's
    // decides; where it is the same, (draw | 0x80) - (threshold & 0x7f) keeps bit 7 exactly when the low
    // seven bits are at least the threshold's, and borrows nothing from the next byte.
    __device__ __forceinline__ unsigned kept_signs(unsigned word) const {
        const unsigned thresholds = threshold * 0x01010101u;
        return (word & ~thresholds) | (~(word ^ thresholds) & ((word | 0x80808080u) - (thresholds & 0x7f7f7f7fu)));
    }
    // The keep bits of the call's 16 x 16 block `half` (key bit 4), as bits() returns them: of word i's byte
    // pair 2 half, 2 half + 1 (the even key, the odd one), bits 2 i and 2 i + 1. The block's byte pairs of
    // words 0, 1 and of words 2, 3 are packed into one word each and compared four draws at once; two
    // shift-ORs gather the eight signs: bytes 1 and 3's bits of `signs` (bits 8 + k, 24 + k, k = 0 or 4) fold
    // onto bits 1 + k and 17 + k, then bits 16-23 onto 2-7. SERIAL compares one draw at a time instead, for
    // bwd_dq_mma: there ptxas schedules the four-at-once form's calls so that it spills (24-96 bytes past
    // head_dim 128 on sm_80 and sm_90, 4 at 128 on sm_80), and the serial form fits.
    template <bool SERIAL> __device__ __forceinline__ unsigned block_bits(uint4 w, int half) const {
        if constexpr (SERIAL) {
            const unsigned words[4] = {w.x, w.y, w.z, w.w};
            unsigned bits = 0;
#pragma unroll
            for (int i = 0; i < 4; ++i) {   // each draw compared in place, in its byte
                const unsigned pair = words[i] >> (16 * half);
                bits |= (static_cast<unsigned>((pair & 0xffu) >= threshold) |
                         static_cast<unsigned>((pair & 0xff00u) >= threshold << 8) << 1)
                        << (2 * i);
            }
            return bits;
        }
        const unsigned pair_bytes = half ? 0x7632u : 0x5410u;   // prmt: bytes 2 half, 2 half + 1 of each word
        const unsigned low = kept_signs(__byte_perm(w.x, w.y, pair_bytes)) & 0x80808080u;
        const unsigned high = kept_signs(__byte_perm(w.z, w.w, pair_bytes)) & 0x80808080u;
        const unsigned signs = low >> 7 | high >> 3;    // words 0, 1's in bits 0, 8, 16, 24; 2, 3's + 4
        const unsigned folded = signs | signs >> 7;
        return (folded | folded >> 14) & 0xffu;
    }
};

// The query block of a thread block in the kernels that walk key tiles per query block (forward, dQ): one
// block (or work item) per (query block, batch, head), numbered in sections of `section_heads` (batch, head)
// pairs (the host picks: _config.forward_section_heads): section after section, and within a section the highest
// query blocks first, its pairs fastest. Under the causal mask the highest query blocks have the most key tiles,
// so each section starts with its longest blocks, which balances the SMs; and the blocks resident at once read
// the K and V of one section's heads, which stay in L2 until its lowest blocks have read them.
// - section_heads = batch * heads (one section): the highest query blocks of every head first, each lower query
//   block reading its head's K and V from DRAM again (the dQ kernels', and the forward's but where below).
// - section_heads = 1: a head's query blocks together (FlashAttention-2's order, the highest first; fwd_mma and
//   fwd_wgmma without a mask at head_dim 128 and 256).
// - between: fwd_wgmma under the causal mask, as many pairs as fit their K and V in a share of the L2 (in a
//   packed batch walked in varlen_order's order, sections of heads: in_sections).
struct QueryBlock {
    int bh, b, h, h_kv, m0;
    // Work item `item` of a grid of num_m_blocks query blocks a pair: pair item / num_m_blocks, query block
    // item % num_m_blocks (fwd_wgmma's items; the grid order maps ranks to them: item_of_rank)
    __device__ __forceinline__ QueryBlock(unsigned item, int num_m_blocks, int block_m, int heads, int group) {
        set(static_cast<int>(item / num_m_blocks), static_cast<int>(item % num_m_blocks), block_m, heads, group);
    }
    // The thread block's, rank blockIdx.x, in the kernels of a block per query block (fwd_mma, fwd_simt, the dQ
    // kernels): the host gives them sections of one pair or one section of all, and any other count walks one
    // section (the general decode, in_sections, made ptxas spill fwd_mma at 255 registers; so did signed divisions)
    __device__ __forceinline__ QueryBlock(int block_m, int batch, int heads, int group, int seqlen_q,
                                          int section_heads) {
        const unsigned num_m_blocks = blocks(seqlen_q, block_m), pairs = batch * heads, rank = blockIdx.x;
        const bool together = section_heads == 1;
        const unsigned below_last = together ? rank % num_m_blocks : rank / pairs;   // query blocks below the last
        set(static_cast<int>(together ? rank / num_m_blocks : rank % pairs),
            static_cast<int>(num_m_blocks - 1 - below_last), block_m, heads, group);
    }
    __device__ __forceinline__ static int blocks(int seqlen_q, int block_m) {
        return (seqlen_q + block_m - 1) / block_m;
    }
    // The work item of rank `rank` (< bh_count * num_m_blocks) of the grid order (fwd_wgmma's producer)
    __device__ __forceinline__ static unsigned item_of_rank(unsigned rank, int bh_count, int num_m_blocks,
                                                            int section_heads) {
        unsigned pair, step;
        in_sections(rank, bh_count, num_m_blocks, section_heads, pair, step);
        return pair * num_m_blocks + (num_m_blocks - 1 - step);
    }
    // The walk in sections of rank `rank` (< pairs * steps): sections of `section_pairs` of the `pairs` pairs
    // (the last has fewer where they do not divide), each walking its pairs' step 0, then their step 1, ...,
    // its pairs fastest. `pair` and `step` (0 first) of that rank: the step is the query block from the highest
    // in the grid order, the entry of varlen_order's order in fwd_wgmma's packed walk (pairs there are heads).
    __device__ __forceinline__ static void in_sections(unsigned rank, unsigned pairs, unsigned steps,
                                                       unsigned section_pairs, unsigned& pair, unsigned& step) {
        const unsigned per_section = section_pairs * steps;
        const unsigned first = rank / per_section * section_pairs;   // the section's first pair
        const unsigned in_section = rank % per_section;
        const unsigned size = min(section_pairs, pairs - first);     // the last: fewer
        pair = first + in_section % size;
        step = in_section / size;
    }

private:
    __device__ __forceinline__ void set(int pair, int m_block, int block_m, int heads, int group) {
        bh = pair;
        b = pair / heads;
        h = pair % heads;
        h_kv = h / group;
        m0 = m_block * block_m;
    }
};

// The sequence of a thread block's batch index b, which bounds its rows and keys. In a dense batch every
// sequence has the kernel's seqlen_q rows and seqlen_k keys, and `diagonal` is the host's. In a packed batch
// (VARLEN; attention_varlen) sequence b is rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q, out, dout
// and dq (whose batch strides are 0) and rows cu_seqlens_k[b] .. of k, v, dk and dv, its diagonal at its own
// bottom-right corner; lse and delta are (heads, total_q); the grid is sized for the longest sequences (the
// kernel's seqlen_q and seqlen_k) and a block past its own sequence's end has no work.
template <bool VARLEN> struct Sequence {
  private:
    template <bool VOLATILE> struct Loads {};   // which loads the constructor reads the prefix sums with

  public:
    int seqlen_q, seqlen_k, diagonal;
    long long q_start, k_start;   // the sequence's first row of q and of k (0 in a dense batch)
    long long total_q;            // rows of the packed q (VARLEN only)
    __device__ __forceinline__ Sequence(const int* cu_seqlens_q, const int* cu_seqlens_k, int b, int batch,
                                        int seqlen_q_, int seqlen_k_, int diagonal_)
        : Sequence(cu_seqlens_q, cu_seqlens_k, b, batch, seqlen_q_, seqlen_k_, diagonal_, Loads<false>{}) {}
    // The same with volatile loads, which the compiler cannot merge with earlier ones: a kernel short of
    // registers builds a second Sequence for its epilogue rather than hold one across its main loop
    // (fwd_mma: holding it spilled 28-56 bytes at 255 registers, sm_90).
    __device__ static __forceinline__ Sequence reread(const int* cu_seqlens_q, const int* cu_seqlens_k, int b,
                                                      int batch, int seqlen_q_, int seqlen_k_, int diagonal_) {
        return Sequence(cu_seqlens_q, cu_seqlens_k, b, batch, seqlen_q_, seqlen_k_, diagonal_, Loads<true>{});
    }
    // Sequence b's keys, with volatile loads: for a kernel that reads the count at each use in its main loop
    // rather than hold it in a register (fwd_mma: held, ptxas spilled 24-48 bytes at 255 registers, sm_90).
    __device__ static __forceinline__ int reread_seqlen_k(const int* cu_seqlens_k, int b) {
        const int begin = load<true>(cu_seqlens_k + b);
        return load<true>(cu_seqlens_k + b + 1) - begin;
    }
    // The offset of (batch b, head h)'s row 0 in lse and delta.
    __device__ __forceinline__ long long stats(int b, int heads, int h) const {
        return VARLEN ? h * total_q + q_start : (static_cast<long long>(b) * heads + h) * seqlen_q;
    }

  private:
    template <bool VOLATILE>
    __device__ __forceinline__ Sequence(const int* cu_seqlens_q, const int* cu_seqlens_k, int b, int batch,
                                        int seqlen_q_, int seqlen_k_, int diagonal_, Loads<VOLATILE>)
        : seqlen_q(seqlen_q_), seqlen_k(seqlen_k_), diagonal(diagonal_), q_start(0), k_start(0), total_q(0) {
        if constexpr (VARLEN) {
            q_start = load<VOLATILE>(cu_seqlens_q + b);
            k_start = load<VOLATILE>(cu_seqlens_k + b);
            seqlen_q = load<VOLATILE>(cu_seqlens_q + b + 1) - static_cast<int>(q_start);
            seqlen_k = load<VOLATILE>(cu_seqlens_k + b + 1) - static_cast<int>(k_start);
            diagonal = seqlen_k - seqlen_q;
            total_q = load<VOLATILE>(cu_seqlens_q + batch);
        }
    }
    template <bool VOLATILE> __device__ static __forceinline__ int load(const int* p) {
        if constexpr (!VOLATILE) {
            return *p;
        } else {
            int x;
            asm volatile("ld.global.nc.s32 %0, [%1];" : "=r"(x) : "l"(p));
            return x;
        }
    }
};

// The work of a thread block of the KV-cache forward (fwd_mma with KVCACHE; _plan.kvcache). Query heads are
// packed `pack` to a group of rows: row r of head group hg is query position r / pack of query head
// hg * pack + r % pack, so where pack is the GQA group the query heads that share a kv head read its cache
// once (ALiBi, whose slope is per block, runs with pack = 1). One block per (query block of these rows,
// key split, head group, batch), query blocks fastest: the blocks that read one cache run side by side.
struct CacheBlock {
    int b, h, m0, split;   // h: the group's first query head; m0: the block's first row
    int row_group;         // the block's rows, counted over (batch, head group, row block): its splits share it
    __device__ __forceinline__ CacheBlock(int block_m, int rows, int head_groups, int pack, int num_splits) {
        const int num_m_blocks = (rows + block_m - 1) / block_m;
        int rest = static_cast<int>(blockIdx.x);
        const int m_block = rest % num_m_blocks;
        m0 = m_block * block_m;
        rest /= num_m_blocks;
        split = rest % num_splits;
        rest /= num_splits;
        row_group = rest * num_m_blocks + m_block;
        h = rest % head_groups * pack;
        b = rest / head_groups;
    }
};

// The key block of a thread block in the dK/dV kernels, one per (key block, batch, kv head). Two grids:
// - banded (dq_splits = 0; every backward but the deterministic one's split form): blockIdx.y picks a
//   band of `band` (batch, kv head) pairs, band = gridDim.x / (key blocks per head), and blockIdx.x walks
//   the band's key blocks, pairs fastest, the lowest key blocks (which the most query rows see under the
//   causal mask) first. The host sizes a band to about one wave of resident blocks (_config.block_band),
//   so the blocks resident at once stream the Q and dO of a few heads, which stay in L2, instead of
//   every head's from DRAM (5-24% faster at seqlen 1k-4k than pairs fastest, the same at 16k:
//   bench/NOTES.md); bwd_dkdv_wgmma takes one pair per band where a pair has few key blocks
//   (_config.pair_major_tiles), so that a wave holds whole pairs. dq_pass is 0, but in bwd_dkdv_wgmma's
//   ordered form, where 1 says that a pair's key blocks run side by side: one pair per band, and no more key
//   blocks than SMs, so that a pair's key blocks, started in order, are all resident together once the pairs
//   before theirs have ended (bwd_wgmma.cu).
// - split (dq_splits > 0; the deterministic backward, bwd_dkdv_mma and bwd_dkdv_wgmma): the
//   host launches the kernel once per pass, each launch one block per ((batch, kv head) pair, split), splits
//   fastest; in pass
//   dq_pass, block `split` takes key block split + dq_pass * dq_splits (none past the last) and adds dQ
//   into copy `split` of dq_accum (DqAccum::head). Launches on one stream run in order and within a launch
//   one thread adds each element of a copy (at head_dim 64 bwd_dkdv_wgmma's consumer 1, with consumer 0's
//   part added to its own), so every element's sum has a fixed order (_config.deterministic_dq_splits).
//   Walking the passes inside the kernel instead made ptxas spill.
struct KeyBlock {
    int b, h_kv, n0, split;
    __device__ __forceinline__ KeyBlock(int block_n, int heads_kv, int seqlen_k, int dq_splits, int dq_pass) {
        int bhk;
        if (dq_splits > 0) {
            split = static_cast<int>(blockIdx.x % dq_splits);
            bhk = static_cast<int>(blockIdx.x / dq_splits);
            n0 = (split + dq_pass * dq_splits) * block_n;
        } else {
            const int num_n_blocks = (seqlen_k + block_n - 1) / block_n;
            const int band = gridDim.x / num_n_blocks;
            bhk = blockIdx.y * band + blockIdx.x % band;
            split = 0;
            n0 = static_cast<int>(blockIdx.x / band) * block_n;
        }
        b = bhk / heads_kv;
        h_kv = bhk % heads_kv;
    }
};

// The float32 dQ accumulator of the atomic-dQ backward (dq_accum) holds each (batch, head)'s dQ in
// mma-fragment order, so that a warp adds one 16 x 8 accumulator tile with one 512-byte run of vector
// reductions (four whole cache lines) rather than eight rows of 32 bytes (FlashAttention-2's dQaccum is
// in the same spirit; the row layout throttled the load/store unit: bench/NOTES.md backward v6).
// Per (batch, head): DqAccum::rows(seqlen_q) rows (padded, so that the query tiles that overrun
// seqlen_q add their zeros in bounds) x HEAD_DIM columns, as 16 x 8 tiles, row tiles outer; a tile is
// 32 lanes x 4 floats, lane g * 4 + t holding (row g, columns 2t, 2t + 1) and (row g + 8, the same).
struct DqAccum {
    static constexpr int kRowMultiple = 128;   // >= BLOCK_M of every kernel adding into it; _config.DQ_ACCUM_ROWS
    __host__ __device__ static constexpr long long rows(int seqlen_q) {
        return (seqlen_q + kRowMultiple - 1) / kRowMultiple * static_cast<long long>(kRowMultiple);
    }
    // Offset of (batch b, head h)'s first tile in copy `split` of the buffer (the deterministic
    // backward's split grid keeps one copy per split: KeyBlock; the default has one).
    __device__ static __forceinline__ long long head(int split, int batch, int b, int heads, int h, int seqlen_q,
                                                     int head_dim_spec) {
        return ((static_cast<long long>(split) * batch + b) * heads + h) * rows(seqlen_q) * head_dim_spec;
    }
    // The same in a packed batch (VARLEN, Sequence): a copy holds per head packed_rows(batch, total_q) rows,
    // sequence b's from packed_row(b) = 128 * (cu_seqlens_q[b] / 128 + b), at least rows(its length) before
    // the next one's: O(total_q + 128 * batch) per head, not O(batch * the longest).
    __host__ __device__ static constexpr long long packed_rows(int batch, long long total_q) {
        return (total_q / kRowMultiple + batch) * static_cast<long long>(kRowMultiple);
    }
    __host__ __device__ static constexpr long long packed_row(int b, long long q_start) {
        return (q_start / kRowMultiple + b) * static_cast<long long>(kRowMultiple);
    }
    template <bool VARLEN>
    __device__ static __forceinline__ long long head(int split, int batch, int b, int heads, int h,
                                                     const Sequence<VARLEN>& seq, int seqlen_q, int head_dim_spec) {
        if constexpr (!VARLEN) return head(split, batch, b, heads, h, seqlen_q, head_dim_spec);
        return ((static_cast<long long>(split) * heads + h) * packed_rows(batch, seq.total_q) +
                packed_row(b, seq.q_start)) * head_dim_spec;
    }
    // A share: 16 rows by 64 columns (8 tiles), contiguous, and at a multiple of kShare floats (a head's rows
    // are a multiple of 16); the Hopper backward adds a warp's dQ one share at a time.
    static constexpr int kShare = 16 * 64;
    // Offset of the 16 x 8 tile whose first element is (row, col) in a head of `head_dim_spec` columns;
    // row a multiple of 16 and col of 8.
    __device__ static __forceinline__ long long tile(int row, int col, int head_dim_spec) {
        return (static_cast<long long>(row / 16) * (head_dim_spec / 8) + col / 8) * 128;
    }
};

// Kernel parameters: one field list per pass, an X-macro from which the kernels' parameter lists
// (CUFLASH_PARAMS) are generated and which Python reads from this file to fill the arguments by name
// (_params; tests/test_params.py). PTR(type, name) is a device pointer to `type`, declared __restrict__:
// each array is reached through its own name only; VAL(type, name) a value; LAST(type, name) the list's
// last value (the parameter list's end, where no comma follows).
//
// The forward's (fwd_mma, fwd_simt; _cupy_path.ForwardPlan): lse is null where the caller returns none;
// alibi_slopes and sinks are float32, null without them; diagonal, window_left and window_right are
// Window's fields (read by the masked specializations); alibi_batch_stride (0 for slopes of shape
// (heads,)), softcap_in and softcap_out ScoreMod's; dropout_seed, dropout_offset and dropout_threshold
// Dropout's, dropout_scale = 1 / (1 - dropout_p) (all read where MODS asks for them); *_sb, *_ss, *_sh
// the element strides of batch, sequence and head; vec_ok says whether rows may be read as 16-byte
// chunks; section_heads picks QueryBlock's grid order. The KV-cache forward's (fwd_mma with KVCACHE;
// the others get nulls and zeros, and pack = num_splits = 1): k and v are the cache, batch b's keys number
// cache_seqlens[b] + seqlen_k_new (int32; null: seqlen_k for every batch) and sit at the bottom-right
// corner (diagonal = keys - seqlen_q); block_table (int32, block_table_stride per batch; null: contiguous)
// maps key n of batch b to row n % page_size of page block_table[b][n / page_size], k_sb and v_sb then
// the page strides; cache_leftpad (int32, null: 0; contiguous caches only) is the cache row of batch b's
// first key: its keys are rows cache_leftpad[b] .. cache_seqlens[b] + seqlen_k_new - 1, counted (for the
// diagonal, windows and ALiBi) from the first; pack query heads share each group of rows (CacheBlock); where num_splits > 1 the
// blocks write float32 partials: out_partial (num_splits, batch, seqlen_q, heads, head_dim) normalized
// over a split's keys, lse_partial (num_splits, batch, heads, seqlen_q), without the sinks, and count
// themselves in split_counters[row_group] (int32, one per CacheBlock row group, zero before the launch and
// left zero after it): the row group's last block to count merges its parts (merge_row, merge.cuh). cu_seqlens_q and cu_seqlens_k (int32 (batch + 1,)) are
// a packed batch's prefix sums (Sequence; null in a dense batch). The float8 forward's (fwd_wgmma of
// __nv_fp8_e4m3; null and 0 elsewhere): q_descale, k_descale and v_descale (float32, null: 1), the factor of
// batch b, kv head h at [b * descale_sb + h * descale_sh] (both 0: one per tensor); its out holds Output<T>.
#define CUFLASH_FWD_FIELDS(PTR, VAL, LAST)                                                            \
    PTR(const T, q) PTR(const T, k) PTR(const T, v) PTR(T, out) PTR(float, lse)                       \
    PTR(const float, alibi_slopes) PTR(const float, sinks) VAL(unsigned long long, dropout_seed)      \
    VAL(unsigned, dropout_offset) VAL(long long, q_sb) VAL(long long, q_ss) VAL(long long, q_sh)      \
    VAL(long long, k_sb) VAL(long long, k_ss) VAL(long long, k_sh) VAL(long long, v_sb)               \
    VAL(long long, v_ss) VAL(long long, v_sh) VAL(long long, o_sb) VAL(long long, o_ss)               \
    VAL(long long, o_sh) VAL(int, batch) VAL(int, heads) VAL(int, group) VAL(int, seqlen_q)           \
    VAL(int, seqlen_k) VAL(int, head_dim) VAL(int, diagonal) VAL(int, window_left)                    \
    VAL(int, window_right) VAL(int, alibi_batch_stride) VAL(float, softcap_in) VAL(float, softcap_out) \
    VAL(unsigned, dropout_threshold) VAL(float, dropout_scale) VAL(float, scale_log2)                  \
    PTR(const int, cache_seqlens) PTR(const int, block_table) PTR(const int, cache_leftpad)           \
    PTR(float, out_partial)                                                                           \
    PTR(float, lse_partial) PTR(int, split_counters) PTR(const int, cu_seqlens_q)                   \
    PTR(const int, cu_seqlens_k) VAL(long long, block_table_stride) VAL(int, seqlen_k_new) VAL(int, pack)  \
    VAL(int, num_splits) VAL(int, page_size) PTR(const float, q_descale) PTR(const float, k_descale)          \
    PTR(const float, v_descale) VAL(int, descale_sb) VAL(int, descale_sh) VAL(int, vec_ok)                   \
    LAST(int, section_heads)

// The backward's (bwd_dkdv_mma, bwd_dkdv_rows_mma, bwd_dq_mma, bwd_dkdv_simt, bwd_dq_simt;
// _cupy_path.BackwardPlan), the forward's fields as there, plus: delta = rowsum(dout * out) (float32,
// (batch, heads, seqlen_q)); dq_accum is float32 in the DqAccum layout above, zeroed, for the kernels that
// add dQ with atomics, null for the others; dq_order (int32, one per DqAccum::kShare floats of dq_accum,
// zeroed) counts the key blocks that have added into each share, for bwd_dkdv_wgmma's ordered form
// (ORDERED_DQ in bwd_wgmma.cu), null for the others; scale is the softmax scale; dq_splits and dq_pass select
// KeyBlock's grid (dq_splits 0: banded; else the split grid's pass dq_pass, one copy of dq_accum per split);
// in a packed batch dq_accum is DqAccum's packed layout.
#define CUFLASH_BWD_FIELDS(PTR, VAL, LAST)                                                            \
    PTR(const T, q) PTR(const T, k) PTR(const T, v) PTR(const T, dout) PTR(const float, lse)          \
    PTR(const float, delta) PTR(T, dq) PTR(T, dk) PTR(T, dv) PTR(float, dq_accum) PTR(int, dq_order)  \
    PTR(const float, alibi_slopes) PTR(const int, cu_seqlens_q) PTR(const int, cu_seqlens_k)           \
    VAL(unsigned long long, dropout_seed) VAL(unsigned, dropout_offset) VAL(long long, q_sb)          \
    VAL(long long, q_ss) VAL(long long, q_sh) VAL(long long, k_sb) VAL(long long, k_ss)               \
    VAL(long long, k_sh) VAL(long long, v_sb) VAL(long long, v_ss)                                    \
    VAL(long long, v_sh) VAL(long long, do_sb) VAL(long long, do_ss) VAL(long long, do_sh)            \
    VAL(long long, dq_sb) VAL(long long, dq_ss) VAL(long long, dq_sh) VAL(long long, dk_sb)           \
    VAL(long long, dk_ss) VAL(long long, dk_sh) VAL(int, batch) VAL(int, heads) VAL(int, group)        \
    VAL(int, seqlen_q) VAL(int, seqlen_k) VAL(int, head_dim) VAL(int, diagonal) VAL(int, window_left)  \
    VAL(int, window_right) VAL(int, alibi_batch_stride) VAL(float, softcap_in) VAL(float, softcap_out) \
    VAL(unsigned, dropout_threshold) VAL(float, dropout_scale) VAL(float, scale) VAL(float, scale_log2) \
    VAL(int, vec_ok) VAL(int, dq_splits) LAST(int, dq_pass)

// A kernel's parameter list from a field list: fwd_mma(CUFLASH_PARAMS(CUFLASH_FWD_FIELDS)). Kernel
// parameters, not a struct passed by value: a struct of the same fields made ptxas spill up to 112 bytes
// (the head_dim 128 dK/dV kernel; it loaded fields in pairs into registers where it reads single
// parameters from the constant bank at their use; NVRTC 13.0, bench/NOTES.md, the house).
#define CUFLASH_PARAM_PTR(type, name) type *__restrict__ name,
#define CUFLASH_PARAM_VAL(type, name) type name,
#define CUFLASH_PARAM_LAST(type, name) type name
#define CUFLASH_PARAMS(FIELDS) FIELDS(CUFLASH_PARAM_PTR, CUFLASH_PARAM_VAL, CUFLASH_PARAM_LAST)

}  // namespace cuflash
