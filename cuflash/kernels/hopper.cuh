// Hopper (sm_90a) building blocks: tensor maps and TMA loads, mbarriers, shared-memory matrix descriptors,
// and the asynchronous wgmma's fence, commit and wait. Kernels that include this compile for sm_90a only
// (KernelSpec.arch_suffix).
//
// Tiles in shared memory are what a TMA load with the 128-byte swizzle writes: [rows][64] blocks of 16-bit
// elements, 128 bytes per row, 16-byte chunk c of row r at chunk c ^ (r % 8), every block 1024-byte aligned.
// (The float8 forward's tiles of 64-byte rows take the 64-byte swizzle: chunk c of row r at c ^ (r / 2 % 4),
// 8-row groups of 512 bytes.)
// A K-major operand (Q and K of S = Q K^T: rows of the matrix, the reduction along the row) is described by
// its first row's address plus 32 bytes per k16 step inside a block, the stride between 8-row groups 1024
// bytes; an MN-major one (V of P V: keys down, the head dim along the row) by its first key's address plus
// 16 keys (2048 bytes) per k16 step, 1024 bytes between 8-key groups and `lbo` between 64-column blocks.
#pragma once
#include "mma.cuh"
#include "wgmma_ops.cuh"

namespace cuflash {

// A CUtensorMap (cuTensorMapEncodeTiled's 128 opaque bytes, _tma.py), passed by value as a
// `const __grid_constant__` kernel parameter so that TMA reads it from the parameter space.
struct __align__(64) TmaMap {
    unsigned long long words[16];
};

// Elements of a 128-byte swizzled row (the inner extent of every TMA box): 64 of 16-bit types, 128 of float8.
constexpr int kSwizzleElems = 64;
constexpr int kSwizzleRowBytes = 128;
template <typename T> constexpr int kSwizzleElemsOf = kSwizzleRowBytes / static_cast<int>(sizeof(T));

__device__ __forceinline__ void mbarrier_init(unsigned bar, int arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals));
}
// Makes the initialized barriers visible to the async proxy (TMA) and to the other threads (with a barrier).
__device__ __forceinline__ void mbarrier_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival that also expects `bytes` of TMA transactions before the phase completes.
__device__ __forceinline__ void mbarrier_expect_bytes(unsigned bar, int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the barrier's phase of parity `phase` has completed.
__device__ __forceinline__ void mbarrier_wait(unsigned bar, int phase) {
    asm volatile(
        "{\n.reg .pred done;\nwait_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_%=;\n}\n" ::"r"(bar), "r"(phase)
        : "memory");
}

// One box of a 4-D tensor map (column c, head h, row s, batch b) into shared memory at `dst`, completing
// on `bar`. Rows and columns past the tensor's extent land as zeros (and still count their bytes).
__device__ __forceinline__ void tma_load_4d(unsigned dst, const TmaMap& map, unsigned bar, int c, int h, int s, int b) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
        "%5}], [%6];\n" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c), "r"(h), "r"(s), "r"(b), "r"(bar)
        : "memory");
}

// Four floats as e4m3 bytes of one word, a0 in the lowest byte (round to nearest even, saturating to +-448):
// cvt's e4m3x2 puts its first source in the upper byte.
__device__ __forceinline__ unsigned pack4_e4m3(float a0, float a1, float a2, float a3) {
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(a1), "f"(a0));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(a3), "f"(a2));
    return static_cast<unsigned>(lo) | static_cast<unsigned>(hi) << 16;
}

// A wgmma shared-memory matrix descriptor of rows of ROW_BYTES (128, or 64: the swizzle TMA wrote them with):
// start address >> 4 (bits 0-13), leading byte offset >> 4 (bits 16-29), stride byte offset (8 rows) >> 4
// (bits 32-45), layout 1 = 128-byte swizzle, 2 = 64-byte (bits 62-63).
template <int ROW_BYTES = kSwizzleRowBytes>
__device__ __forceinline__ unsigned long long smem_descriptor(unsigned addr, unsigned leading_bytes) {
    static_assert(ROW_BYTES == 128 || ROW_BYTES == 64, "the 128- and 64-byte swizzles");
    constexpr unsigned long long kStride8Rows = 8 * ROW_BYTES, kLayout = ROW_BYTES == 128 ? 1 : 2;
    return static_cast<unsigned long long>((addr & 0x3FFFF) >> 4) |
           static_cast<unsigned long long>((leading_bytes & 0x3FFFF) >> 4) << 16 | (kStride8Rows >> 4) << 32 |
           kLayout << 62;
}

// Adds `bytes` of float32 from shared memory at `src` into global memory at `dst`, element by element, by the TMA
// unit (both 16-byte aligned, bytes a multiple of 16), in the issuing thread's open bulk group.
__device__ __forceinline__ void bulk_reduce_add(float* dst, unsigned src, int bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(
                     static_cast<unsigned long long>(__cvta_generic_to_global(dst))),
                 "r"(src), "r"(bytes)
                 : "memory");
}
// Closes the issuing thread's open bulk group.
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's bulk groups are still reading their shared-memory source.
template <int N> __device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// Waits until at most N of this thread's bulk groups are incomplete (their global writes performed).
template <int N> __device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// Orders this thread's completed bulk operations on global memory (async proxy) before its later ordinary
// accesses there: between bulk_wait and a release that publishes their results.
__device__ __forceinline__ void fence_proxy_async_global() {
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
// An int in global memory read with acquire semantics at GPU scope, and one added to with release semantics:
// a count that one thread block publishes after its writes and another waits on before its own.
__device__ __forceinline__ int load_acquire_gpu(const int* p) {
    int value;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n"
                 : "=r"(value)
                 : "l"(static_cast<unsigned long long>(__cvta_generic_to_global(p)))
                 : "memory");
    return value;
}
__device__ __forceinline__ void add_release_gpu(int* p, int value) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(
                     static_cast<unsigned long long>(__cvta_generic_to_global(p))),
                 "r"(value)
                 : "memory");
}

// Makes this thread's ordinary shared-memory stores visible to the async proxy (wgmma and TMA read through it);
// each writing thread fences before the barrier that precedes the read.
__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Orders this warpgroup's register writes before the wgmma that reads or accumulates into them.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N of this warpgroup's committed groups are pending (groups complete in order).
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving a register array's reads or writes across this point: around a wgmma in
// flight its accumulators (and A fragments) must stay in the registers the instruction named.
template <int N> __device__ __forceinline__ void pin_registers(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N> __device__ __forceinline__ void pin_registers(unsigned (&r)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

// Adds this warpgroup's arrival to named barrier `id` without waiting (the other side of named_barrier_sync).
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Moves this warpgroup's register budget (all its warps execute it, with a compile-time count).
template <int REGISTERS> __device__ __forceinline__ void warpgroup_registers_increase() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGISTERS));
}
template <int REGISTERS> __device__ __forceinline__ void warpgroup_registers_decrease() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGISTERS));
}

}  // namespace cuflash
