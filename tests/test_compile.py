"""The kernels compile with NVRTC for sm_80 and sm_90, without a GPU: every plain kernel the dispatcher can
choose and a covering set of the score-modifier, KV-cache and packed-batch kernels (``_config.all_specs``).

The float16/bfloat16 (tensor-core) kernels must not spill registers to local memory, except where a spill
was measured to cost less than the tiles that avoid it (``allowed_spill_bytes``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import multiprocessing
import os

import numpy as np
import pytest

from cuflash import _config, _philox
from cuflash._compile import CHECKED_NVRTC, compile_offline, nvrtc_version

TARGETS = {"sm_80": _config.A100, "sm_90": _config.H100}


@pytest.fixture(scope="module", params=sorted(TARGETS))
def reports(request):
    # one NVRTC program per (source file, dtype), compiled in parallel processes
    groups = collections.defaultdict(list)
    for spec in _config.all_specs(TARGETS[request.param]):
        groups[spec.source_file, spec.dtype.name].append(spec)
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(os.cpu_count(), mp_context=context) as pool:
        results = pool.map(compile_offline, groups.values(), [request.param] * len(groups))
        return [r for group in results for r in group]


def test_nvrtc_is_a_checked_release():
    # the no-spill guarantee below is a property of the (kernel, NVRTC) pair: the extras pin these releases
    assert nvrtc_version() in CHECKED_NVRTC, (nvrtc_version(), CHECKED_NVRTC)


def test_every_specialization_compiles(reports):
    device = TARGETS[reports[0].arch]
    assert {r.spec.cache_key for r in reports} == {s.cache_key for s in _config.all_specs(device)}
    kernels = collections.Counter(r.spec.kernel for r in reports)
    # plain: 8 head dims x 3 mask kinds, half-precision forwards for 2 dtypes, the SIMT forward for float32;
    # the covering set of the modifiers: 8 head dims x 2 mask kinds x with and without dropout, bfloat16
    # and float32
    masks, head_dims = len(_config.MASK_KINDS), len(_config.HEAD_DIMS)
    # contiguous and paged (one tile past head_dim 128) x (plain, windowed with every modifier); of float8 caches
    # at head_dim 128 and 256 (three tiles)
    fused = sum(d <= _config.MMA_BACKWARD_FUSED_HEAD_DIM for d in _config.HEAD_DIMS)
    kvcache = sum(r.spec.kvcache for r in reports)
    float8_caches = sum(r.spec.kvcache and np.dtype(r.spec.dtype) == _config.FLOAT8_E4M3 for r in reports)
    assert kvcache == 2 * (fused + head_dims) + float8_caches and float8_caches == 2 * 3
    # packed batches: plain and windowed with every modifier, with and without dropout, bfloat16 at every head dim,
    # float32 at two
    packed = collections.Counter(r.spec.kernel for r in reports if r.spec.varlen)
    assert packed["fwd_mma"] == 3 * head_dims and packed["fwd_simt"] == 3 * 2
    assert packed["bwd_dq_convert"] == head_dims and "bwd_preprocess" not in packed
    assert kernels["fwd_mma"] == 2 * masks * head_dims + 2 * 2 * head_dims + kvcache + packed["fwd_mma"]
    assert kernels["merge_parts"] == kernels["merge_into"] == len(_config.SUPPORTED_DTYPES)
    assert kernels["append_rotary"] == len(_config.KVCACHE_DTYPES)
    # the Hopper forward's item order of packed batches, per mask kind
    assert kernels["varlen_order"] == (masks if device.tensor_maps else 0)
    # the Hopper forward (sm_90a) on sm_90 only: 4 head dims (64-column blocks) per plain (dtype, mask), the
    # modifiers with and without dropout (bfloat16, 2 masks), packed (bfloat16, 3 per head dim), the head_dim
    # 64 three-consumer tile with dropout (3), the head_dim 64 causal tile of short query blocks (2 dtypes, and
    # packed in bfloat16), ALiBi alone (its bias in S: bfloat16, per head dim and mask, dense and packed), and the
    # float8 form per float8 head dim and mask, plain and with every modifier but dropout, with its V^T transpose;
    # its fallback is counted above
    float8, alibi = 2 * masks * len(_config.FLOAT8_HEAD_DIMS), 2 * masks * 4
    assert kernels["fwd_wgmma"] == (2 * masks * 4 + 2 * 2 * 4 + 3 * 4 + 3 + 2 + 1 + alibi + float8
                                    if device.tensor_maps else 0)
    assert kernels["transpose_v_float8"] == (len(_config.FLOAT8_HEAD_DIMS) if device.tensor_maps else 0)
    # the Hopper dK/dV kernel at head dims 64, 128 and 256: each half dtype and mask, the modifiers with and
    # without dropout (bfloat16, 2 masks), every modifier but the softcap with and without dropout (bfloat16, each
    # mask: the path of two groups of products), packed bfloat16 as the forward; each also in the deterministic
    # backward's ordered form
    forms = len(_config.WGMMA_DKDV_HEAD_DIMS) + len(_config.ORDERED_DQ_HEAD_DIMS)
    assert kernels["bwd_dkdv_wgmma"] == (forms * (2 * masks + 2 * 2 + 2 * masks + 3) if device.tensor_maps else 0)
    assert kernels["fwd_simt"] == masks * head_dims + 2 * 2 * head_dims + packed["fwd_simt"]
    no_dropout = _config.ALL_MODS & ~_config.MOD_DROPOUT
    # (the Hopper backward drops the sinks, which only the forward takes)
    no_softcap = _config.ALL_MODS & ~_config.MOD_SOFTCAP
    fitting = {no_softcap, no_softcap & ~_config.MOD_SINKS,
               no_softcap & ~_config.MOD_SINKS & ~_config.MOD_DROPOUT} if device.tensor_maps else set()
    assert {r.spec.mods for r in reports} == {0, _config.ALL_MODS, _config.ALL_MODS & ~_config.MOD_SINKS, no_dropout,
                                              no_dropout & ~_config.MOD_SINKS} | fitting
    assert all(r.registers > 0 for r in reports)


def allowed_spill_bytes(report) -> int:
    """Spill stores and loads a kernel may have: none, except on sm_90 the mma.sync dropout forward at head_dim
    128 on 128 x 64 tiles, which spills up to 92 bytes in its packed-batch form (NVRTC 13.0) and
    measured faster than the narrower tiles that fit (_config._mma_forward_tiles), and the Hopper dropout
    forward at head_dim 256 under a mask, whose consumers spill 8-24 bytes at their 232 registers (O alone
    takes 128; giving them 240 leaves the producer 24, where it spilled 20-32 bytes: WgmmaRoles in
    kernels/fwd_wgmma.cu). And the Hopper backward's 128-row steps at head_dim 64 with dropout: 4-20 bytes
    stored, up to 52 loaded (NVRTC 13.0; found when the covering set took in the backward without the softcap,
    before which 128-136 bytes spilled there unseen: bench/NOTES.md session 41), which measured faster than the
    64-row steps that would not spill (causal and under a window: _config.wgmma_dkdv_block_m). And those steps
    with ALiBi alone (its bias in S^T, P^T computed while dP^T runs) under the causal mask and a window: 44-48
    bytes stored, 76 loaded (84 with NVRTC 12.9), 2-3% faster forward+backward than P^T after dP^T, which spills
    nothing (bench/NOTES.md session 51)."""
    spec = report.spec
    tall_dkdv = (spec.kernel == "bwd_dkdv_wgmma" and spec.head_dim == 64
                 and spec.block_m == _config.WGMMA_DKDV_TALL_BLOCK_M)
    if report.arch == "sm_90" and tall_dkdv and spec.mods == _config.MOD_ALIBI and spec.mask != _config.MASK_NONE:
        return 84
    if report.arch != "sm_90" or not spec.mods & _config.MOD_DROPOUT:
        return 0
    if spec.kernel == "fwd_mma" and spec.head_dim == 128 and (spec.block_m, spec.block_n) == (128, 64):
        return 128
    if spec.kernel == "fwd_wgmma" and spec.head_dim == 256 and spec.mask != _config.MASK_NONE:
        return 24
    if tall_dkdv:
        return 52
    return 0


def test_half_precision_kernels_do_not_spill(reports):
    spilling = [(r.spec.name, r.spill_store_bytes, r.spill_load_bytes) for r in reports
                if np.dtype(r.spec.dtype) != np.float32
                and max(r.spill_store_bytes, r.spill_load_bytes) > allowed_spill_bytes(r)]
    assert not spilling, f"register spills on {reports[0].arch}: {spilling}"
    # the allowance covers the kernels it names and no other
    assert any(allowed_spill_bytes(r) for r in reports) == (reports[0].arch == "sm_90")


def test_hopper_kernels_keep_their_wgmma_asynchronous(reports):
    # ptxas serializes every wgmma of a kernel where it cannot prove that no other instruction reads an
    # accumulator while a product into it runs (C7514): the kernel still computes the right answer, at about
    # half the speed (a fwd_wgmma that left a P V in flight across a branch's join: bench/NOTES.md, session 13)
    assert not [r.spec.name for r in reports if r.serialized_wgmma]


def test_a_serialized_wgmma_is_reported():
    # the check above reads the warning ptxas prints, naming the function, apart from its resource report
    from cuflash._compile import _report

    spec = next(s for s in _config.all_specs(_config.H100) if s.kernel == "fwd_wgmma")
    report = ("ptxas info    : Compiling entry function '_Zk' for 'sm_90a'\n"
              "ptxas info    : Used 168 registers\n"
              "ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
              "to non wgmma instructions reading accumulator registers of  a wgmma between start and end of the "
              "pipeline stage in the function '{}'\n")
    assert _report(spec, "sm_90", "_Zk", report.format("_Zk")).serialized_wgmma
    assert not _report(spec, "sm_90", "_Zk", report.format("_Zother")).serialized_wgmma
    assert _report(spec, "sm_90", "_Zk", report.format("_Zk")).registers == 168


def test_register_budget_allows_the_launch(reports):
    # 64K 32-bit registers per SM on sm_80 and sm_90: a block must fit on one SM.
    for r in reports:
        assert r.registers * r.spec.threads <= 65536, (r.spec.name, r.registers)



#: each tensor-core kernel's shared-memory layout struct, as a template argument list of its spec
SMEM_LAYOUTS = {
    "fwd_mma": lambda s, t: f"FwdSmem<{t}, {s.head_dim}, {s.block_m}, {s.block_n}, {s.threads // 32}, {s.key_split}>",
    "bwd_dkdv_mma": lambda s, t: f"DkdvTiledSmem<{t}, {s.head_dim}, {s.block_m}, {s.block_n}, {s.stages}>",
    "bwd_dkdv_rows_mma": lambda s, t: (f"DkdvRowsSmem<{t}, {s.head_dim}, {s.block_m}, {s.block_n}, "
                                       f"{str(s.atomic_dq).lower()}>"),
    "bwd_dq_mma": lambda s, t: f"DqSmem<{t}, {s.head_dim}, {s.block_m}, {s.block_n}>",
    "fwd_wgmma": lambda s, t: f"WgmmaFwdSmem<{t}, {s.head_dim}, {s.block_m}, {s.block_n}>",
    "bwd_dkdv_wgmma": lambda s, t: f"BwdWgmmaSmem<{s.head_dim}, {s.block_m}, {s.block_n}>",
}


def smem_asserts(source_file: str) -> list[str]:
    """static_asserts that the shared memory _config gives each tensor-core spec of the compile check (both
    targets) is its kernel's own layout's size."""
    asserts = set()
    for device in TARGETS.values():
        for spec in _config.all_specs(device):
            if spec.kernel in SMEM_LAYOUTS and spec.source_file == source_file:
                layout = SMEM_LAYOUTS[spec.kernel](spec, _config.KERNEL_TYPES[np.dtype(spec.dtype)])
                asserts.add(f"static_assert(cuflash::{layout}::kBytes == {spec.smem_bytes}, "
                            f"\"mma_smem_bytes of {spec.name}\");")
    return sorted(asserts)


def wgmma_row_asserts() -> list[str]:
    """static_asserts that the box rows _config.wgmma_row_bytes gives the maps of each fwd_wgmma spec of the compile
    check are its layout's: 128 bytes, 64 for float8's rows of 64 bytes (q and k at head_dim 64, V^T's 64-key
    tiles)."""
    asserts = set()
    for spec in _config.all_specs(TARGETS["sm_90"]):
        if spec.kernel == "fwd_wgmma":
            layout = SMEM_LAYOUTS["fwd_wgmma"](spec, _config.KERNEL_TYPES[np.dtype(spec.dtype)])
            q, k, v = _config.wgmma_row_bytes(spec)
            assert q == k
            asserts.add(f"static_assert(cuflash::{layout}::kRowBytes == {q} && cuflash::{layout}::kVRowBytes == {v}, "
                        f"\"wgmma_row_bytes of {layout}\");")
    return sorted(asserts)


def test_python_mirrors_the_kernels_constants():
    # The constants and layouts _config repeats from the kernels, checked by the compiler against the
    # kernels' own definitions: a translation unit of each source file plus static_asserts.
    from cuflash._compile import _nvrtc_compile, kernel_source

    forward_rows = "\n".join(
        f"static_assert(cuflash::ForwardRow<{d}>::kElems == {_config.forward_row_elems(d)}, \"ForwardRow<{d}>\");"
        for d in _config.HEAD_DIMS)
    dq_rows = (f"static_assert(cuflash::DqAccum::kRowMultiple == {_config.DQ_ACCUM_ROWS}, "
               "\"_config.DQ_ACCUM_ROWS\");\n"
               f"static_assert(cuflash::DqAccum::kShare == {_config.DQ_ACCUM_SHARE}, \"_config.DQ_ACCUM_SHARE\");")
    _nvrtc_compile(kernel_source("fwd_mma.cu") + "\n" + forward_rows + "\n" + dq_rows + "\n"
                   + "\n".join(smem_asserts("fwd_mma.cu")) + "\n", "sm_90", [])
    merge_warps = f"static_assert(cuflash::kMergeWarps == {_config.MERGE_WARPS}, \"_config.MERGE_WARPS\");"
    _nvrtc_compile(kernel_source("merge.cu") + "\n" + merge_warps + "\n", "sm_90", [])
    order = [f"static_assert(cuflash::{name} == {value}, \"_config.{mirror}\");" for name, value, mirror in (
        ("kOrderThreads", _config.VARLEN_ORDER_THREADS, "VARLEN_ORDER_THREADS"),
        ("kOrderMaxBatch", _config.VARLEN_ORDER_MAX_BATCH, "VARLEN_ORDER_MAX_BATCH"))]
    _nvrtc_compile(kernel_source("varlen.cu") + "\n" + "\n".join(order) + "\n", "sm_90", [])
    dkdv_threads = (f"static_assert(cuflash::kDkdvTiledThreads == {_config.DKDV_TILED_THREADS}, "
                    "\"_config.DKDV_TILED_THREADS\");")
    _nvrtc_compile(kernel_source("bwd_mma.cu") + "\n" + dkdv_threads + "\n"
                   + "\n".join(smem_asserts("bwd_mma.cu")) + "\n", "sm_90", [])
    hopper = [f"static_assert(cuflash::{name} == {value}, \"_config.{mirror}\");" for name, value, mirror in (
        ("WgmmaRoles<128>::kThreads", _config.wgmma_threads(128), "wgmma_threads"),
        ("WgmmaRoles<192>::kThreads", _config.wgmma_threads(192), "wgmma_threads"),
        ("kWgmmaStages", _config.WGMMA_STAGES, "WGMMA_STAGES"), ("kSwizzleElems", _config.SWIZZLE_ELEMS, "SWIZZLE_ELEMS"),
        ("kWorkCounterInts", _config.WGMMA_WORK_COUNTER_INTS, "WGMMA_WORK_COUNTER_INTS"),
        ("kTransposeKeys", _config.FLOAT8_TRANSPOSE_KEYS, "FLOAT8_TRANSPOSE_KEYS"))]
    hopper += wgmma_row_asserts()
    assert len(smem_asserts("fwd_wgmma.cu")) > 4
    _nvrtc_compile(kernel_source("fwd_wgmma.cu") + "\n" + "\n".join(hopper + smem_asserts("fwd_wgmma.cu")) + "\n",
                   "sm_90a", [])
    assert smem_asserts("bwd_wgmma.cu")
    _nvrtc_compile(kernel_source("bwd_wgmma.cu") + "\n" + "\n".join(smem_asserts("bwd_wgmma.cu")) + "\n", "sm_90a", [])

    simt = [f"static_assert(cuflash::kSimtThreads == {_config.SIMT_THREADS}, \"_config.SIMT_THREADS\");"]
    simt.append(f"static_assert(cuflash::kPhiloxRounds == {_philox.ROUNDS}, \"_philox.ROUNDS\");")
    for d in _config.HEAD_DIMS:
        for tile in (16, 32):
            tiles = f"cuflash::SimtTiles<{d}, {tile}, {tile}>"
            fwd = _config.simt_smem_bytes("fwd_simt", d, tile, tile)
            bwd = _config.simt_smem_bytes("bwd_dq_simt", d, tile, tile)
            simt.append(f"static_assert({tiles}::kFwdFloats * 4 == {fwd}, \"fwd_simt {d} {tile}\");")
            simt.append(f"static_assert({tiles}::kBwdFloats * 4 == {bwd}, \"bwd simt {d} {tile}\");")
    _nvrtc_compile(kernel_source("simt.cu") + "\n" + "\n".join(simt) + "\n", "sm_90", [])


def test_a_wrong_mirror_fails_to_compile():
    # the check above can fail: a wrong value is a compile error naming the constant
    from cuflash._compile import _nvrtc_compile, kernel_source

    wrong = f"static_assert(cuflash::kSimtThreads == {_config.SIMT_THREADS + 1}, \"_config.SIMT_THREADS\");"
    with pytest.raises(RuntimeError, match="_config.SIMT_THREADS"):
        _nvrtc_compile(kernel_source("simt.cu") + "\n" + wrong + "\n", "sm_90", [])
    # and so is a shared-memory size one row off its kernel's layout
    asserts = smem_asserts("bwd_mma.cu")
    assert len(asserts) > 100 and all(" == " in a for a in asserts)
    layout, size = asserts[0].split(" == ")
    off = f"{layout} == {int(size.split(',')[0]) + 144}, \"mma_smem_bytes off by a row\");"
    with pytest.raises(RuntimeError, match="mma_smem_bytes off by a row"):
        _nvrtc_compile(kernel_source("bwd_mma.cu") + "\n" + off + "\n", "sm_90", [])


@pytest.mark.parametrize("kernel", ["fwd_wgmma", "fwd_mma", "bwd_dkdv_wgmma", "bwd_dkdv_mma"])
def test_the_softmax_exponential_is_one_instruction(kernel):
    # The kernels compile with subnormals flushed (COMMON_OPTIONS, the GPU path's and this check's): each
    # exp2 of the softmax is ex2.approx.ftz, one MUFU instruction, not ex2.approx's four (compare and two
    # multiplies for a subnormal result): three instructions more per score element without the flag.
    from cuflash._compile import _nvrtc_compile, kernel_source

    spec = next(s for s in _config.all_specs(_config.H100)
                if s.kernel == kernel and s.dtype == np.float16 and s.mask == _config.MASK_CAUSAL and not s.mods)
    _, _, ptx = _nvrtc_compile(kernel_source(spec.source_file), "sm_90a" if spec.arch_specific else "sm_90",
                               [spec.name])
    assert "ex2.approx.ftz.f32" in ptx
    assert "ex2.approx.f32" not in ptx


def check_tool(name: str):
    """tools/<name> --check, run with this interpreter: its output where it exits 0 (the assertion shows both
    streams otherwise)."""
    import pathlib
    import subprocess
    import sys

    tool = pathlib.Path(__file__).resolve().parent.parent / "tools" / name
    result = subprocess.run([sys.executable, str(tool), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_the_wgmma_wrappers_are_the_generators_output():
    # kernels/wgmma_ops.cuh is written by tools/gen_wgmma.py: an edit by hand (or a stale header) fails here
    check_tool("gen_wgmma.py")


def test_the_block_timeline_stamps_the_hopper_kernels():
    # tools/block_timeline.py stamps kernels/bwd_wgmma.cu and fwd_wgmma.cu at places it finds by their text and
    # compiles the stamped kernels: an edit that moves one of those places fails here (update the tool's _STAMPS)
    output = check_tool("block_timeline.py")
    assert output.count("stamped, ") == 3, output


def test_the_block_timeline_stamps_only_the_measured_kernel(tmp_path):
    # each pass's stamps go through a pointer that only that pass's measurement fills: the backward's run calls the
    # forward first, and a stamped fwd_wgmma wrote its stamps through the null out_partial (an illegal address)
    import importlib.util
    import pathlib

    repo = pathlib.Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("block_timeline", repo / "tools" / "block_timeline.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    kernels = tool.stamped_package(tmp_path, ("bwd_wgmma.cu",)) / "cuflash" / "kernels"
    for name in ("bwd_wgmma.cu", "fwd_wgmma.cu"):
        stamped = (kernels / name).read_text() != (repo / "cuflash" / "kernels" / name).read_text()
        assert stamped == (name == "bwd_wgmma.cu"), name
