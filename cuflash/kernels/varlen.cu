// The order in which the Hopper forward walks a packed batch's work items (fwd_wgmma's item_order;
// _plan.forward): the items with the most key tiles first, so that the walk ends on short items wherever the
// sequences differ in length (the longest-processing-time rule that FlashAttention-3's varlen scheduler follows),
// and only items with rows: QueryBlock's order over the longest sequences' grid has a block for every query
// block of the longest sequence in every sequence, most of them past their own sequence's end.
//
// An entry is (sequence b, query block m_block) of `block_m` rows, its sort key the key tiles of `block_n` keys
// its rows see (KeyTiles, as fwd_wgmma's items; rows that see no key still store their zeros: key 0); the
// entry stands for its `heads` work items, which fwd_wgmma walks consecutively.
#include "common.cuh"

namespace cuflash {

constexpr int kOrderThreads = 1024;
// Sequences the one block orders (_config.VARLEN_ORDER_MAX_BATCH): their entry counts' prefix sums are held in
// shared memory. A larger batch runs in QueryBlock's order.
constexpr int kOrderMaxBatch = 4096;
// Sort keys: an entry's key tiles, those with more than kOrderBins - 1 tiles sorted as equals among themselves
// (past 512k keys at 128-key tiles, where an item's own length outweighs any order of the walk's end)
constexpr int kOrderBins = 4096;
constexpr int kOrderScanElems = 8;   // elements per thread of order_scan: kOrderThreads x 8 >= either array
static_assert(kOrderMaxBatch + 1 <= kOrderThreads * kOrderScanElems && kOrderBins <= kOrderThreads * kOrderScanElems,
              "order_scan covers the counts of either array");

// The exclusive prefix sums of data[0, n) in shared memory, in place, by the whole block; `warp_totals` holds
// kOrderThreads / 32 ints. Thread t sums its kOrderScanElems consecutive elements, the warps scan those sums by
// shuffles, and warp 0 the warps' totals.
__device__ __forceinline__ void order_scan(int* data, int n, int* warp_totals) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, begin = threadIdx.x * kOrderScanElems;
    int own = 0;
#pragma unroll
    for (int i = 0; i < kOrderScanElems; ++i) own += begin + i < n ? data[begin + i] : 0;
    int inclusive = own;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
        const int other = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (lane >= d) inclusive += other;
    }
    if (lane == 31) warp_totals[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
        int total = warp_totals[lane];   // kOrderThreads / 32 == 32 warps
#pragma unroll
        for (int d = 1; d < 32; d *= 2) {
            const int other = __shfl_up_sync(0xffffffffu, total, d);
            if (lane >= d) total += other;
        }
        warp_totals[lane] = total - warp_totals[lane];   // exclusive: the warps before
    }
    __syncthreads();
    int running = warp_totals[warp] + inclusive - own;
#pragma unroll
    for (int i = 0; i < kOrderScanElems; ++i) {
        if (begin + i < n) {
            const int count = data[begin + i];
            data[begin + i] = running;
            running += count;
        }
    }
    __syncthreads();
}

// order: int32 (1 + capacity,): the count of entries, then each entry (sequence b, query block m_block) as
// b * num_m_blocks + m_block (num_m_blocks: the longest sequences' query blocks, of seqlen_q rows), the entries
// with the most key tiles first; fwd_wgmma numbers the items of an entry's heads in its grid order (QueryBlock).
// capacity bounds the entries of valid prefix sums (ceil(total_q / block_m) + batch); with invalid ones no more
// are written. The order within a key's entries is the atomics'.
template <int MASK>
__global__ void __launch_bounds__(kOrderThreads)
varlen_order(int* __restrict__ order, const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k,
             int batch, int seqlen_q, int block_m, int block_n, int window_left, int window_right,
             int capacity) {
    static_assert(kOrderThreads == 32 * 32, "order_scan: one warp scans the warps' totals");
    __shared__ int first[kOrderMaxBatch + 1];   // sequence b's entries: first[b] .. first[b + 1] - 1
    __shared__ int slots[kOrderBins];           // entries per key, then each key's next position in `order`
    __shared__ int warp_totals[kOrderThreads / 32];
    const int num_m_blocks = (seqlen_q + block_m - 1) / block_m;
    for (int b = threadIdx.x; b <= batch; b += kOrderThreads)
        first[b] = b < batch ? min(max((cu_seqlens_q[b + 1] - cu_seqlens_q[b] + block_m - 1) / block_m, 0),
                                   num_m_blocks)
                             : 0;
    for (int key = threadIdx.x; key < kOrderBins; key += kOrderThreads) slots[key] = 0;
    __syncthreads();
    order_scan(first, batch + 1, warp_totals);
    const int entries = min(first[batch], capacity);

    // entry e's sequence (the last b with first[b] <= e) and query block, and its key: bins from the most tiles
    auto locate = [&](int e, int& b, int& m_block) {
        int lo = 0, hi = batch - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (first[mid] <= e) lo = mid; else hi = mid - 1;
        }
        b = lo;
        m_block = e - first[lo];
    };
    auto key_of = [&](int b, int m_block) {
        const Sequence<true> seq(cu_seqlens_q, cu_seqlens_k, b, batch, seqlen_q, 0, 0);
        const Window<MASK> window{seq.diagonal, window_left, window_right};
        const KeyTiles tiles(window, m_block * block_m, block_m, block_n, seq.seqlen_k);
        return kOrderBins - 1 - min(max(tiles.count, 0), kOrderBins - 1);
    };
    for (int e = threadIdx.x; e < entries; e += kOrderThreads) {
        int b, m_block;
        locate(e, b, m_block);
        atomicAdd(&slots[key_of(b, m_block)], 1);
    }
    __syncthreads();
    order_scan(slots, kOrderBins, warp_totals);
    for (int e = threadIdx.x; e < entries; e += kOrderThreads) {
        int b, m_block;
        locate(e, b, m_block);
        const int position = atomicAdd(&slots[key_of(b, m_block)], 1);
        order[1 + position] = b * num_m_blocks + m_block;
    }
    if (threadIdx.x == 0) order[0] = entries;
}

}  // namespace cuflash
