"""What run-time compilation costs: the kernel specializations per architecture, and NVRTC's time for the
kernels a first call of each feature compiles. No GPU needed.

``python tools/nvrtc_cost.py [--arch sm_80 sm_90] [--head-dim 128] [--seqlen 4096] [--count-only] [--json FILE]``

- **Count.** Every specialization the dispatcher can choose on the architecture's device (the union, over the
  head dims 1-256, float16 / bfloat16 / float32, the three mask kinds, the 16 modifier sets, dense and packed
  batches and arrays with and without tensor maps, of ``_config.choose_config``'s kernels, the deterministic
  backward's forms, the Hopper forward's tile for short query blocks, the KV-cache forward (contiguous and paged,
  few and many row groups), the float8 forward, and the packed batches' order, merge and append kernels),
  beside the compile check's covering set (``_config.all_specs``).
- **Cost.** For each feature the kernels of a first forward and forward+backward call (``_plan``'s launches at
  batch 2, ``--seqlen``, 16 heads, ``--head-dim``, bfloat16, causal; the KV cache: one query against the
  cache; float8: the forward and its V transpose), and of them the ones plain causal attention's call has not
  compiled already. Each is compiled alone, as the GPU path compiles it (one NVRTC program per kernel, to the
  device's code: sm_90a for the Hopper kernels), and timed: seconds of this host's NVRTC, which a GPU's host
  pays the same.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import json
import sys
import time

from cuflash import _compile, _config, _plan
from cuflash._validate import CacheProblem, Problem

DEVICES = {"sm_80": _config.A100, "sm_90": _config.H100}
MOD_SETS = tuple(sum(bits) for n in range(5)
                 for bits in itertools.combinations((_config.MOD_SOFTCAP, _config.MOD_ALIBI, _config.MOD_SINKS,
                                                     _config.MOD_DROPOUT), n))


def every_spec(device: _config.DeviceProps) -> dict[tuple, _config.KernelSpec]:
    """Every kernel specialization the dispatcher can choose on ``device``, by cache key."""
    specs: dict[tuple, _config.KernelSpec] = {}

    def put(*found):
        for spec in found:
            if spec is not None:
                specs[spec.cache_key] = spec

    devices = (device, dataclasses.replace(device, tensor_maps=False)) if device.tensor_maps else (device,)
    for dev, head_dim, dtype, mask, mods, varlen in itertools.product(
            devices, range(1, _config.MAX_HEAD_DIM + 1), _config.SUPPORTED_DTYPES, _config.MASK_KINDS, MOD_SETS,
            (False, True)):
        cfg = _config.choose_config(head_dim, dtype, mask, dev, mods, varlen)
        put(*cfg.specs, _config.ordered_dq_kernel(cfg), _config.split_grid_kernel(cfg),
            _config.wgmma_forward_for_keys(cfg.forward, 1, dev))
    cache_mods = tuple(m for m in MOD_SETS if not m & _config.MOD_DROPOUT)
    for head_dim, dtype, mask, mods in itertools.product(range(1, _config.MAX_HEAD_DIM + 1), _config.KVCACHE_DTYPES,
                                                         _config.MASK_KINDS, cache_mods):
        if dtype == _config.FLOAT8_E4M3 and head_dim not in _config.FLOAT8_HEAD_DIMS:
            continue
        # pages of every multiple of PAGE_SIZE_MULTIPLE divide the tiles these do; few and many row groups
        for page_size, row_groups in itertools.product((0, _config.PAGE_SIZE_MULTIPLE), (0, device.sm_count)):
            put(_config.kvcache_forward_spec(head_dim, dtype, mask, device, mods, page_size, row_groups))
    if device.tensor_maps:
        for head_dim, mask, mods in itertools.product(_config.FLOAT8_HEAD_DIMS, _config.MASK_KINDS, cache_mods):
            put(_config.float8_forward_spec(head_dim, mask, device, mods), _config.float8_transpose_spec(head_dim))
        put(*(_config.varlen_order_spec(mask) for mask in _config.MASK_KINDS))
    for dtype in _config.SUPPORTED_DTYPES:   # the merge kernels as _plan launches them (their spec alone counts)
        put(_plan.merge(1, 1, 1, dtype).spec, _plan.merge_into(1, 1, 1, dtype).spec)
    put(*(_config.KernelSpec("append_rotary", dtype, threads=_config.APPEND_WARPS * 32)
          for dtype in _config.KVCACHE_DTYPES))
    return specs


#: feature: (Problem fields beyond plain causal attention's, deterministic backward, packed batch)
FEATURES = {
    "plain causal": ({}, False, False),
    "window (1024, 0)": ({"window_left": 1024}, False, False),
    "softcap": ({"softcap": 30.0}, False, False),
    "ALiBi": ({"alibi_shape": (16,)}, False, False),
    "sinks": ({"sinks": True}, False, False),
    "dropout": ({"dropout_p": 0.1}, False, False),
    "deterministic": ({}, True, False),
    "packed batch (varlen)": ({}, False, True),
}


def feature_specs(device, head_dim: int, seqlen: int) -> dict[str, tuple[list, list]]:
    """feature: (the forward's kernels, the backward's), as ``_plan`` launches them at that shape."""
    base = Problem(batch=2, seqlen_q=seqlen, seqlen_k=seqlen, heads=16, heads_kv=16, head_dim=head_dim,
                   dtype=_config.BFLOAT16, causal=True, softmax_scale=head_dim ** -0.5, window_right=0)
    found = {}
    for name, (fields, deterministic, packed) in FEATURES.items():
        p = dataclasses.replace(base, **fields)
        total = p.batch * seqlen if packed else None   # a packed batch's rows and keys: every sequence full
        fwd = _plan.forward(p, device, packed=packed, total_q=total, total_k=total)
        bwd = _plan.backward(p, device, deterministic, total_q=total)
        found[name] = ([launch.spec for launch in (fwd.order, fwd) if launch is not None],
                       [launch.spec for launch in (bwd.preprocess, *bwd.dkdv, bwd.dq)])
    cache = CacheProblem(attn=dataclasses.replace(base, batch=8, seqlen_q=1, heads_kv=4), page_size=0, num_pages=0,
                         seqlen_new=1, lengths="array")
    launches = _plan.kvcache(cache, device)
    found["KV cache (append, decode)"] = ([launch.spec for launch in (launches.append, launches.forward)], [])
    if device.tensor_maps and head_dim in _config.FLOAT8_HEAD_DIMS:
        p = dataclasses.replace(base, dtype=_config.FLOAT8_E4M3, out_dtype=_config.BFLOAT16)
        launch = _plan.forward(p, device)
        found["float8"] = ([launch.transpose.spec, launch.spec], [])
    return found


def compile_seconds(spec: _config.KernelSpec, arch: str) -> float:
    """NVRTC's wall time for ``spec`` alone, to the device's code (as the GPU path compiles it)."""
    start = time.perf_counter()
    _compile.compile_offline([spec], arch)
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/nvrtc_cost.py", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", nargs="+", default=list(DEVICES), choices=sorted(DEVICES))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--count-only", action="store_true", help="count the specializations, compile nothing")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    print(f"NVRTC {_compile.describe_nvrtc(_compile.nvrtc_version())}")
    results = {}
    for arch in args.arch:
        device = DEVICES[arch]
        every, covering = every_spec(device), _config.all_specs(device)
        by_kernel = dict(sorted(collections.Counter(spec.kernel for spec in every.values()).items()))
        print(f"\n{arch}: {len(every)} specializations the dispatcher can choose; the compile check compiles "
              f"{len(covering)}")
        print("  " + ", ".join(f"{k} {n}" for k, n in by_kernel.items()))
        result = {"specializations": len(every), "compile_check": len(covering), "by_kernel": by_kernel}
        if not args.count_only:
            seconds: dict[tuple, float] = {}
            features = feature_specs(device, args.head_dim, args.seqlen)
            plain = {spec.cache_key for specs in features["plain causal"] for spec in specs}
            print(f"  first calls at head_dim {args.head_dim}, seqlen {args.seqlen}, bfloat16, causal: seconds of "
                  "NVRTC, forward / backward (kernels not in plain causal attention's call marked *)")
            result["features"] = {}
            for name, (fwd, bwd) in features.items():
                row = {}
                for pass_name, specs in (("forward", fwd), ("backward", bwd)):
                    for spec in specs:
                        if spec.cache_key not in seconds:
                            seconds[spec.cache_key] = compile_seconds(spec, arch)
                    row[pass_name] = [{"kernel": spec.name, "seconds": round(seconds[spec.cache_key], 2),
                                       "new": name != "plain causal" and spec.cache_key not in plain}
                                      for spec in specs]
                total = {k: sum(e["seconds"] for e in v) for k, v in row.items()}
                new = sum(e["seconds"] for v in row.values() for e in v if e["new"])
                print(f"  {name:26s} {total['forward']:6.1f} / {total['backward']:6.1f} s; beyond plain "
                      f"causal's: {new:6.1f} s")
                for pass_name, entries in row.items():
                    for e in entries:
                        print(f"      {pass_name[:3]} {'*' if e['new'] else ' '} {e['seconds']:6.2f}  {e['kernel']}")
                result["features"][name] = row
        results[arch] = result
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"nvrtc": list(_compile.nvrtc_version()), "head_dim": args.head_dim, "seqlen": args.seqlen,
                       "architectures": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
