"""Where ptxas put a Hopper kernel's wgmma waits beside its exponentials and products. No GPU needed.

``python tools/sass_order.py 'cuflash::bwd_dkdv_wgmma<__nv_bfloat16, 128, 0, 0, 64, 128, false, false>' [--nvdisasm
PATH] [--sass OUT.sass]`` compiles the spec of that name (``_config.all_specs`` of the H100 table) with NVRTC and the
GPU path's options for sm_90a, disassembles the cubin with ``nvdisasm`` (the CUDA toolkit's, or the
``nvidia-cuda-nvdisasm`` wheel's: ``pip install --target DIR nvidia-cuda-nvdisasm``) and prints the kernel's
sequence of waits and issues in program order: ``W1`` / ``W0`` a wgmma wait (``WARPGROUP.DEPBAR.LE gsb0, N``),
``G`` the last wgmma of a committed group, ``N`` a NANOSLEEP (``computed_before_wait``), ``[k e]`` a run of k
MUFU.EX2. ptxas moves a wait above the independent arithmetic before it in its basic block (bench/NOTES.md,
session 34): an exponential meant to run beside a product in flight shows up after the wait that ends it.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

from cuda.bindings import nvrtc

from cuflash import _compile, _config


def cubin(spec: _config.KernelSpec) -> bytes:
    """The sm_90a cubin of ``spec``'s source with only ``spec`` instantiated."""
    source = _compile.kernel_source(spec.source_file)
    with _compile.nvrtc_program(source, "sm_90a", [spec.name]) as (program, _):
        return _compile.nvrtc_output(program, nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN)


def order(sass: str) -> str:
    """The waits, group ends, nanosleeps and runs of exponentials of ``sass``, in program order."""
    marks = []
    for line in sass.splitlines():
        wait = re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x(\d)", line)
        if wait:
            marks.append(f"W{wait.group(1)}")
        elif "HGMMA" in line and "gsb0" in line:
            marks.append("G")
        elif "NANOSLEEP" in line:
            marks.append("N")
        elif "MUFU.EX2" in line:
            marks.append("e")
    return re.sub(r"(?:e )+", lambda m: f"[{len(m.group(0)) // 2} e] ", " ".join(marks) + " ").strip()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("name", help="a spec's name, as _config.all_specs(_config.H100) names it")
    parser.add_argument("--nvdisasm", default=shutil.which("nvdisasm"), help="nvdisasm's path (default: on PATH)")
    parser.add_argument("--sass", help="also write the disassembly here")
    args = parser.parse_args()
    if args.nvdisasm is None:
        sys.exit("no nvdisasm on PATH: pass --nvdisasm")
    spec = next((s for s in _config.all_specs(_config.H100) if s.name == args.name), None)
    if spec is None:
        sys.exit(f"no spec named {args.name!r} in the H100 table")
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "kernel.cubin"
        path.write_bytes(cubin(spec))
        sass = subprocess.run([args.nvdisasm, "-c", str(path)], capture_output=True, text=True, check=True).stdout
    if args.sass:
        pathlib.Path(args.sass).write_text(sass)
    print(order(sass))


if __name__ == "__main__":
    main()
