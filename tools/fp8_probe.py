"""The float8 forward kernel (fwd_wgmma of __nv_fp8_e4m3, head_dim 128) called directly on the GPU, before the API
routes float8 to it: its V^T transpose checked byte for byte, its output against the float64 reference of the
quantized inputs and against the same math with P rounded to e4m3 (cuflash.reference.attention_float8_in_dtype:
FlashAttention's rule between the two), and its speed beside cuflash's bfloat16 forward at FlashAttention's grid
shapes, with and without the V^T transpose.

    python tools/fp8_probe.py [--seqlens 512 1024 4096 16384]

Needs a GPU of compute capability 9.0. The e4m3 tensors travel as uint8 bit patterns (CuPy has no float8 dtype).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import ml_dtypes
import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

HEAD_DIM, BLOCK_M, BLOCK_N = 128, 128, 128
TOKENS, WIDTH = 16384, 2048


def key_at(column: int) -> int:
    """The key that V^T's column holds within its 128-key tile (transpose_v_float8)."""
    group, half, t, i = column & ~31, (column >> 4) & 1, (column >> 2) & 3, column & 3
    return group + 16 * half + (2 * t + i if i < 2 else 8 + 2 * t + i - 2)


class Float8Forward:
    """The float8 forward of one shape: V^T's transpose and fwd_wgmma, launched as a plan would."""

    def __init__(self, batch, seqlen_q, seqlen_k, heads, heads_kv, causal, defines=()):
        import cupy as cp

        from cuflash import _compile, _config, _cupy_path, _params
        from cuflash._validate import Problem

        self.cp = cp
        self.shape = (batch, seqlen_q, seqlen_k, heads, heads_kv)
        self.keys_padded = -(-seqlen_k // BLOCK_N) * BLOCK_N
        mask = _config.MASK_CAUSAL if causal else _config.MASK_NONE
        self.fwd_name = f"cuflash::fwd_wgmma<__nv_fp8_e4m3, {HEAD_DIM}, {mask}, 0, {BLOCK_M}, {BLOCK_N}, false>"
        self.transpose_name = f"cuflash::transpose_v_float8<{HEAD_DIM}>"
        module = cp.RawModule(code=_compile.kernel_source("fwd_wgmma.cu"),
                              options=_compile.COMMON_OPTIONS + ("-arch=sm_90a",) + tuple(f"-D{d}" for d in defines),
                              name_expressions=[self.fwd_name, self.transpose_name])
        self.forward_kernel = module.get_function(self.fwd_name)
        self.transpose_kernel = module.get_function(self.transpose_name)
        self.smem = _config.wgmma_smem_bytes(HEAD_DIM, BLOCK_M, BLOCK_N, itemsize=1)
        self.forward_kernel.max_dynamic_shared_size_bytes = self.smem
        self.threads = _config.wgmma_threads(BLOCK_M)
        self.items = -(-seqlen_q // BLOCK_M) * batch * heads
        scale = HEAD_DIM ** -0.5
        p = Problem(batch, seqlen_q, seqlen_k, heads, heads_kv, HEAD_DIM, _config.BFLOAT16, causal, scale,
                    -1, 0 if causal else -1, seqlen_k - seqlen_q)
        fields = _params.forward_fields()
        q_strides = (seqlen_q * heads * HEAD_DIM, heads * HEAD_DIM, HEAD_DIM)
        kv_strides = (seqlen_k * heads_kv * HEAD_DIM, heads_kv * HEAD_DIM, HEAD_DIM)
        self.v_strides = kv_strides
        fixed = {**_cupy_path._stride_fields(q=q_strides, k=kv_strides, v=kv_strides, o=q_strides),
                 **_cupy_path._problem_fields(p), **_cupy_path.NO_CACHE_FIELDS, **_cupy_path.DENSE_FIELDS,
                 "alibi_slopes": _cupy_path._NULL, "sinks": _cupy_path._NULL, "dropout_seed": 0, "dropout_offset": 0,
                 "descale_sb": heads_kv, "descale_sh": 1, "vec_ok": 1, "query_blocks_fastest": 1}
        self.arguments = _params.Arguments(fields, fixed, ("q", "k", "v", "out", "lse", "q_descale", "k_descale",
                                                           "v_descale"), _cupy_path._by_value)
        self.null = _cupy_path._NULL

    def transpose(self, v):
        cp = self.cp
        batch, _, seqlen_k, _, heads_kv = self.shape
        vt = cp.empty((batch, heads_kv, HEAD_DIM, self.keys_padded), cp.uint8)
        self.transpose_kernel((self.keys_padded // BLOCK_N, heads_kv, batch), (256,),
                              (v, vt, *(np.int64(s) for s in self.v_strides), np.int32(seqlen_k),
                               np.int32(self.keys_padded), np.int32(heads_kv)))
        return vt

    def __call__(self, q, k, v, q_descale, k_descale, v_descale, vt=None):
        from cuflash import _tma

        cp = self.cp
        batch, seqlen_q, seqlen_k, heads, heads_kv = self.shape
        vt = self.transpose(v) if vt is None else vt
        u8 = np.dtype(np.uint8)
        maps = (_tma._encode(q.data.ptr, u8, q.shape, tuple(s for s in np.array(q.strides)[:3]), BLOCK_M),
                _tma._encode(k.data.ptr, u8, k.shape, tuple(s for s in np.array(k.strides)[:3]), BLOCK_N),
                # V^T as (batch, rows = head_dim, heads = kv heads, columns = keys): boxes of every head_dim row
                _tma._encode(vt.data.ptr, u8, (batch, HEAD_DIM, heads_kv, self.keys_padded),
                             (heads_kv * HEAD_DIM * self.keys_padded, self.keys_padded, HEAD_DIM * self.keys_padded),
                             HEAD_DIM))
        out = cp.empty((batch, seqlen_q, heads, HEAD_DIM), cp.dtype(ml_dtypes.bfloat16))
        lse = cp.empty((batch, heads, seqlen_q), cp.float32)
        self.forward_kernel((self.items,), (self.threads,),
                            maps + (self.null, self.null) + self.arguments((q, k, vt, out, lse, q_descale, k_descale,
                                                                            v_descale)),
                            shared_mem=self.smem)
        return out, lse


def check(rng, batch, seqlen_q, seqlen_k, heads, heads_kv, causal, defines=()):
    import cupy as cp

    import cuflash
    from cuflash import reference

    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in
               ((batch, seqlen_q, heads, HEAD_DIM), (batch, seqlen_k, heads_kv, HEAD_DIM),
                (batch, seqlen_k, heads_kv, HEAD_DIM)))
    q8, k8, v8, q_descale, k_descale, v_descale = cuflash.quantize_qkv(q, k, v, "head")
    forward = Float8Forward(batch, seqlen_q, seqlen_k, heads, heads_kv, causal, defines)
    device = [cp.asarray(x.view(np.uint8)) for x in (q8, k8, v8)] + [cp.asarray(d) for d in (q_descale, k_descale,
                                                                                             v_descale)]
    vt = forward.transpose(device[2]).get()
    order = np.array([key_at(c % BLOCK_N) + c // BLOCK_N * BLOCK_N for c in range(forward.keys_padded)])
    padded = np.zeros((batch, forward.keys_padded, heads_kv, HEAD_DIM), np.uint8)
    padded[:, :seqlen_k] = v8.view(np.uint8)
    expected = padded[:, order].transpose(0, 2, 3, 1)
    transpose_ok = np.array_equal(vt, expected)
    out, lse = forward(*device)
    out = out.get().astype(np.float64)
    ref, ref_lse = reference.attention(q8, k8, v8, causal, q_descale=q_descale, k_descale=k_descale,
                                       v_descale=v_descale)
    lowp, lowp_lse = reference.attention_float8_in_dtype(q8, k8, v8, causal, None, q_descale, k_descale, v_descale)
    lowp = lowp.astype(np.float64)
    err, lowp_err = np.abs(out - ref).max(), np.abs(lowp - ref).max()
    bound = 2 * lowp_err + reference.rounding(ref, ml_dtypes.bfloat16)
    seen = np.isfinite(ref_lse)   # rows that see no key: -inf on both sides
    lse = lse.get()
    lse_err, lowp_lse_err = np.abs(lse - ref_lse)[seen].max(), np.abs(lowp_lse - ref_lse)[seen].max()
    lse_same_unseen = np.array_equal(lse[~seen], ref_lse[~seen])
    print(f"  ({batch}, {seqlen_q}, {seqlen_k}, {heads}, {heads_kv}) causal={causal}: "
          f"V^T {'ok' if transpose_ok else 'WRONG'};"
          f" out err {err:.4f} (e4m3 math {lowp_err:.4f}, bound {bound:.4f}: {'ok' if err <= bound else 'FAIL'});"
          f" lse err {lse_err:.2e} (e4m3 math {lowp_lse_err:.2e}){'' if lse_same_unseen else '; unseen rows WRONG'}")
    return transpose_ok and err <= bound and lse_same_unseen


def speed(seqlens, defines=()):
    import cupy as cp

    import cuflash
    from bench.timing import EventTimer

    timer = EventTimer(5, 20)
    rng = np.random.default_rng(0)
    for causal in (False, True):
        for seqlen in seqlens:
            batch, heads = TOKENS // seqlen, WIDTH // HEAD_DIM
            shape = (batch, seqlen, heads, HEAD_DIM)
            bf16 = [cp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(cp.dtype(ml_dtypes.bfloat16))
                    for _ in range(3)]
            u8 = [cp.asarray(rng.integers(0x20, 0x40, shape, dtype=np.uint8)) for _ in range(3)]   # |x| in 2**-3..2
            descales = [cp.full((batch, heads), 0.5, cp.float32) for _ in range(3)]
            forward = Float8Forward(batch, seqlen, seqlen, heads, heads, causal, defines)
            vt = forward.transpose(u8[2])
            flops = 4 * batch * heads * HEAD_DIM * seqlen * seqlen / (2 if causal else 1)
            ms_bf16 = np.median(timer(lambda: cuflash.attention(*bf16, causal=causal)))
            ms_fp8 = np.median(timer(lambda: forward(*u8[:2], vt, *descales, vt=vt)))
            ms_total = np.median(timer(lambda: forward(*u8, *descales)))
            print(f"  seqlen {seqlen:6d} {'causal' if causal else 'full  '}: bf16 {flops / ms_bf16 / 1e9:6.0f}, "
                  f"float8 {flops / ms_fp8 / 1e9:6.0f} (with V^T {flops / ms_total / 1e9:6.0f}) TFLOP/s, "
                  f"{ms_bf16 / ms_fp8:.2f}x")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--define", nargs="*", default=[], metavar="NAME=VALUE",
                        help="macros for the float8 kernel's compilation (a variant to measure)")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    print(f"correctness (head_dim 128, per-(batch, kv head) descales; defines {args.define}):")
    ok = all([check(rng, *shape, args.define) for shape in ((2, 256, 256, 4, 2, False), (2, 256, 256, 4, 2, True),
              (1, 300, 1000, 2, 1, True), (1, 1000, 300, 2, 2, True), (1, 1, 77, 2, 1, False))])
    print("speed (FlashAttention's grid, 16 heads):")
    speed(args.seqlens, args.define)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
