"""One bench cell under Nsight Compute: warm up outside the profiled range, then profile one call.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \\
        python3 tools/ncu_probe.py --impl cuflash --pass fwd --head-dim 128 --seqlen 4096 [--causal]
        [--feature dropout0.1] [--portable]

Shapes follow FlashAttention's grid (batch * seqlen = 16k tokens, heads * head_dim = 2048), as in
``python -m bench``. ``--feature`` takes a column of the features suite (``bench.features.FEATURES``: a
window, softcap, ALiBi, sinks or dropout; every feature is causal). ``--portable`` plans cuflash as on a GPU
without tensor maps (the ``mma.sync`` kernels an A100 runs). The profiled range holds exactly one call of the
implementation, so ncu reports its kernels and nothing of the warm-up or the input generation.
"""

from __future__ import annotations

import argparse

import cupy

from bench.features import BY_NAME
from bench.impls import make_impls, make_inputs
from bench.records import Shape

TOKENS, WIDTH = 16384, 2048


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", default="cuflash")
    parser.add_argument("--pass", dest="pass_", default="fwd", choices=["fwd", "bwd", "fwd+bwd"])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--feature", choices=sorted(BY_NAME), help="a features-suite column (causal)")
    parser.add_argument("--portable", action="store_true", help="cuflash without the Hopper kernels")
    args = parser.parse_args()
    if args.portable:
        from feature_ab import without_hopper_kernels
        without_hopper_kernels("cuflash")
    feature = BY_NAME[args.feature] if args.feature else None

    heads = WIDTH // args.head_dim
    shape = Shape.square(TOKENS // args.seqlen, args.seqlen, heads, args.head_dim)
    impl, = make_impls([args.impl])
    inputs = make_inputs(shape, args.dtype)
    with impl.context():
        call = impl.make_call(args.pass_, inputs, args.causal or feature is not None, feature)
        for _ in range(3):
            call()
        cupy.cuda.runtime.deviceSynchronize()
        cupy.cuda.profiler.start()
        call()
        cupy.cuda.runtime.deviceSynchronize()
        cupy.cuda.profiler.stop()


if __name__ == "__main__":
    main()
