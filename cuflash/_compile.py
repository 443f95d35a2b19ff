"""From a KernelSpec to a compiled kernel: on a GPU with CuPy, or offline with NVRTC for the checks.

The kernel sources in ``cuflash/kernels/`` are assembled into one translation unit (local includes
inlined), so the text that CuPy hashes for its disk cache is the whole source: editing a header
invalidates the cache. Compiled kernels are kept per (device, spec) in memory and, by CuPy, on disk
(``CUPY_CACHE_DIR``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import pathlib
import re

from ._config import KernelSpec

KERNEL_DIR = pathlib.Path(__file__).parent / "kernels"
_LOCAL_INCLUDE = re.compile(r'^#include "([^"]+)"\s*$', re.MULTILINE)

#: NVRTC options shared by the GPU path and the offline check; CuPy adds the architecture itself.
#: ``-ftz=true`` flushes float32 subnormals to zero, as FlashAttention's ``--use_fast_math`` builds do: an
#: exponential is then one MUFU instruction, where ``ex2.approx.f32`` without it takes a compare and two
#: rescaling multiplies around it for a subnormal result (exp2 below -126, a probability under 1e-38 that no
#: sum can see). The offline check compiles with exactly these options, so its register and spill report
#: describes the kernels the GPU runs.
COMMON_OPTIONS = ("-std=c++17", "-ftz=true")


@functools.lru_cache(maxsize=None)
def kernel_source(file_name: str) -> str:
    """The source of ``kernels/<file_name>`` with its local includes inlined, each once."""
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        text = (KERNEL_DIR / name).read_text()
        text = text.replace("#pragma once\n", "")
        return _LOCAL_INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return expand(file_name)


_kernels: dict[tuple, object] = {}


def options(spec: KernelSpec) -> tuple[str, ...]:
    """NVRTC options of ``spec`` on the GPU path: COMMON_OPTIONS, and the architecture-specific target for the
    Hopper kernels (CuPy names the plain sm_XX of the device; NVRTC takes the later -arch)."""
    return COMMON_OPTIONS + (("-arch=sm_90a",) if spec.arch_specific else ())


def get_kernel(spec: KernelSpec, device_id: int):
    """The compiled ``cupy.RawKernel`` of ``spec`` on device ``device_id`` (compiled on first use)."""
    key = (device_id, spec.cache_key)
    kernel = _kernels.get(key)
    if kernel is None:
        import cupy

        with cupy.cuda.Device(device_id):
            module = cupy.RawModule(code=kernel_source(spec.source_file), options=options(spec),
                                    name_expressions=[spec.name])
            kernel = module.get_function(spec.name)
            if spec.smem_bytes > 48 * 1024:  # the default dynamic shared-memory limit per block
                kernel.max_dynamic_shared_size_bytes = spec.smem_bytes
        _kernels[key] = kernel
    return kernel


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """What ptxas said about one kernel."""

    spec: KernelSpec
    arch: str
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_frame_bytes: int
    log: str
    #: ptxas serialized the kernel's wgmma (its C7514 "Potential Performance Loss": a non-wgmma instruction may
    #: read an accumulator while a wgmma into it runs), which makes every product synchronous
    serialized_wgmma: bool = False


def _cuda_include_dir() -> str:
    from cuda import pathfinder

    found = pathfinder.find_nvidia_header_directory("cudart")
    if found is None:
        raise RuntimeError("CUDA runtime headers not found: pip install 'nvidia-cuda-runtime'")
    return found


#: NVRTC releases with which every float16/bfloat16 kernel compiles without a register spill for sm_80 and
#: sm_90 (tests/test_compile.py); the package's extras pin them (pyproject.toml). Other releases compile
#: the same kernels, but their ptxas may spill registers, which costs speed (README, "Compiler").
CHECKED_NVRTC = ((12, 6), (12, 8), (12, 9), (13, 0))


def describe_nvrtc(version: tuple[int, int]) -> str:
    """``major.minor``, and whether the kernels were checked spill-free with that release."""
    major, minor = version
    checked = ", ".join(f"{a}.{b}" for a, b in CHECKED_NVRTC)
    verdict = ("its kernels checked spill-free" if tuple(version) in CHECKED_NVRTC else
               f"not a release the kernels were checked with ({checked}): ptxas may spill registers")
    return f"{major}.{minor} ({verdict})"


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC that ``compile_offline`` uses (cuda-bindings'; no GPU needed)."""
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"NVRTC error {err}")
    return major, minor


def _nvrtc_result(result):
    """The value of a cuda-bindings NVRTC call's ``(err, value...)`` tuple; RuntimeError if ``err`` is not success."""
    from cuda.bindings import nvrtc

    err, *rest = result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"NVRTC error {err}")
    return rest[0] if len(rest) == 1 else rest


@contextlib.contextmanager
def nvrtc_program(source: str, arch: str, name_expressions: list[str]):
    """``source`` compiled for ``arch`` by NVRTC (no GPU) with the GPU path's options and ptxas's resource report:
    yields (the NVRTC program, its log); the program is destroyed on exit. RuntimeError with the log on failure."""
    from cuda.bindings import nvrtc

    program = _nvrtc_result(nvrtc.nvrtcCreateProgram(source.encode(), b"cuflash.cu", 0, [], []))
    try:
        for name in name_expressions:
            _nvrtc_result(nvrtc.nvrtcAddNameExpression(program, name.encode()))
        options = [o.encode() for o in COMMON_OPTIONS] + [
            f"--gpu-architecture={arch}".encode(), b"--ptxas-options=-v",
            f"-I{_cuda_include_dir()}".encode()]
        err, = nvrtc.nvrtcCompileProgram(program, len(options), options)
        log = nvrtc_output(program, nvrtc.nvrtcGetProgramLogSize, nvrtc.nvrtcGetProgramLog)
        log = log.decode(errors="replace").rstrip("\x00")
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC failed for {arch}:\n{log[:6000]}")
        yield program, log
    finally:
        nvrtc.nvrtcDestroyProgram(program)


def nvrtc_output(program, get_size, get) -> bytes:
    """One output of a compiled NVRTC program, by its pair of calls (``nvrtcGetPTXSize``, ``nvrtcGetPTX``)."""
    data = b" " * _nvrtc_result(get_size(program))
    _nvrtc_result(get(program, data))
    return data


def _nvrtc_compile(source: str, arch: str, name_expressions: list[str]) -> tuple[str, dict[str, str], str]:
    """Compile ``source`` for ``arch`` with NVRTC (no GPU) and the GPU path's options: (the log with ptxas's
    report, the lowered name of each name expression, the PTX). RuntimeError with the log on failure."""
    from cuda.bindings import nvrtc

    with nvrtc_program(source, arch, name_expressions) as (program, log):
        lowered = {name: _nvrtc_result(nvrtc.nvrtcGetLoweredName(program, name.encode())).decode()
                   for name in name_expressions}
        ptx = nvrtc_output(program, nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX)
    return log, lowered, ptx.decode(errors="replace").rstrip("\x00")


def compile_offline(specs: list[KernelSpec], arch: str) -> list[CompileReport]:
    """Compile ``specs`` (all from one source file) for ``arch`` with NVRTC, no GPU needed.

    Returns each kernel's ptxas resource report. Raises RuntimeError with the NVRTC log on failure.
    """
    files = {spec.source_file for spec in specs}
    if len(files) != 1:
        raise ValueError(f"compile_offline takes specs of one source file, got {sorted(files)}")
    # the Hopper kernels' source compiles for the architecture-specific target (sm_90a); reported as `arch`
    target = f"{arch}a" if any(spec.arch_specific for spec in specs) else arch
    log, lowered, _ = _nvrtc_compile(kernel_source(files.pop()), target, [spec.name for spec in specs])
    return [_report(spec, arch, lowered[spec.name], log) for spec in specs]


def _report(spec: KernelSpec, arch: str, mangled: str, log: str) -> CompileReport:
    # ptxas prints, per entry: "Compiling entry function '<mangled>' for 'sm_90'", then
    # "<n> bytes stack frame, <s> bytes spill stores, <l> bytes spill loads" and "Used <r> registers".
    start = log.find(f"entry function '{mangled}'")
    if start < 0:
        raise RuntimeError(f"no ptxas report for {spec.name} in the NVRTC log:\n{log}")
    nxt = log.find("entry function '", start + 1)
    section = log[start: nxt if nxt > 0 else len(log)]

    def number(pattern: str) -> int:
        m = re.search(pattern, section)
        return int(m.group(1)) if m else 0

    return CompileReport(spec, arch, registers=number(r"Used (\d+) registers"),
                         spill_store_bytes=number(r"(\d+) bytes spill stores"),
                         spill_load_bytes=number(r"(\d+) bytes spill loads"),
                         stack_frame_bytes=number(r"(\d+) bytes stack frame"), log=section,
                         serialized_wgmma=_serialized_wgmma(log, mangled))


def _serialized_wgmma(log: str, mangled: str) -> bool:
    """Does ``log`` hold ptxas's warning that it serialized the wgmma of entry ``mangled``? (The warning names the
    function and may come before its resource report.)"""
    return any("wgmma" in line and "serialized" in line and f"'{mangled}'" in line for line in log.splitlines())
