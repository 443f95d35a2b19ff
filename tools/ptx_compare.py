"""Do two cuflash trees compile a kernel to the same code? No GPU needed.

``python tools/ptx_compare.py OLD_TREE NEW_TREE [--kernel fwd_mma] [--jobs N] [--mods BITS]`` compiles to PTX
(compute_90, or compute_90a for the Hopper kernels) every spec of ``kernel`` (with one of the ``--mods`` bits,
where given) in the compile check (``_config.all_specs`` of the A100 and H100 tables) in both
trees, each tree a folder holding a ``cuflash`` package, and compares each spec's kernel body with
parameter declarations and names, register numbers and labels normalized: a kernel whose parameter list
grew but whose code did not compares equal. Specs are matched by the fields set away from their defaults
(so a field the other tree's KernelSpec lacks counts only where it is set). Prints each spec whose body
differs and the counts; exits 1 when one does. Use it to show that a change left a kernel family's code
alone (bench/NOTES.md, decoding).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
import subprocess
import sys

#: run inside a tree: its specs of one kernel as (key, name, source file), key the spec's set fields
_LIST_SPECS = """
import dataclasses, json, sys
sys.path.insert(0, sys.argv[1])
from cuflash import _config
found = {}
for device in (_config.A100, _config.H100):
    for spec in _config.all_specs(device):
        if spec.kernel == sys.argv[2]:
            values = dataclasses.asdict(spec)
            fields = {f.name: (values[f.name].name if f.name == "dtype" else values[f.name])
                      for f in dataclasses.fields(spec)
                      if values[f.name] != f.default or f.name in ("mask", "mods")}
            arch = "compute_90a" if getattr(spec, "arch_specific", False) else "compute_90"
            found[json.dumps(fields, sort_keys=True, default=str)] = (spec.name, spec.source_file, arch)
print(json.dumps(found))
"""

#: run inside a tree: the PTX of one kernel
_PTX = """
import sys
sys.path.insert(0, sys.argv[1])
from cuda.bindings import nvrtc
from cuflash import _compile
err, prog = nvrtc.nvrtcCreateProgram(_compile.kernel_source(sys.argv[3]).encode(), b"x.cu", 0, [], [])
nvrtc.nvrtcAddNameExpression(prog, sys.argv[2].encode())
opts = [o.encode() for o in _compile.COMMON_OPTIONS] + [f"--gpu-architecture={sys.argv[4]}".encode(),
        f"-I{_compile._cuda_include_dir()}".encode()]
err, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
    raise SystemExit(f"NVRTC failed for {sys.argv[2]}")
err, size = nvrtc.nvrtcGetPTXSize(prog)
buffer = b" " * size
nvrtc.nvrtcGetPTX(prog, buffer)
sys.stdout.write(buffer.decode(errors="replace"))
"""


def specs(tree: str, kernel: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _LIST_SPECS, tree, kernel], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def body(tree: str, name: str, source: str, arch: str) -> list[str]:
    """The kernel's PTX for ``arch`` from its entry on, normalized."""
    ptx = subprocess.run([sys.executable, "-c", _PTX, tree, name, source, arch], capture_output=True, text=True,
                         check=True).stdout
    text = ptx[ptx.index(".entry"):]
    text = re.sub(r"_Z\w+?_param_\d+", "PARAM", text)
    text = re.sub(r"_Z\w+", "KERNEL", text)
    text = re.sub(r"%(r|rd|f|fd|p|rs|h|hh)\d+", r"%\1", text)
    text = re.sub(r"\$L__\w+", "LABEL", text)
    return [line for line in text.splitlines() if not line.strip().startswith((".param", ".reg"))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/ptx_compare.py", description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--kernel", default="fwd_mma")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--mods", type=int, default=0,
                        help="compare only the specs with one of these score-modifier bits (_config.MOD_*)")
    args = parser.parse_args(argv)
    old, new = specs(args.old, args.kernel), specs(args.new, args.kernel)
    both = set(old) & set(new)
    common = sorted(key for key in both if not args.mods or json.loads(key)["mods"] & args.mods)

    def same(key):
        return body(args.old, *old[key]) == body(args.new, *new[key])

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(same, common))
    differ = [new[key][0] for key, equal in zip(common, results) if not equal]
    for name in differ:
        print("differs:", name)
    print(f"{args.kernel}: {len(both)} specs in both trees ({len(old) - len(both)} only in the old, "
          f"{len(new) - len(both)} only in the new), {len(common)} compared, {len(differ)} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
