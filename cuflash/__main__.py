"""``python -m cuflash``: what cuflash runs on (``info``) and ahead-of-time kernel compilation (``warmup``)."""

from __future__ import annotations

import argparse
import sys


def _info(args) -> int:
    from ._env import report

    lines = report()
    width = max(len(what) for what, _ in lines)
    for what, value in lines:
        print(f"{what:<{width}}  {value}")
    return 0


def _warmup(args) -> int:
    from .warmup import run

    return run(args.jobs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cuflash", description="What cuflash runs on (info) and "
                                     "ahead-of-time kernel compilation (warmup).")
    commands = parser.add_subparsers(dest="command", metavar="command")
    info = commands.add_parser("info", help="versions of cuflash, CuPy, NumPy, CUDA and NVRTC; the GPU or why "
                                            "there is none; the kernel cache")
    info.set_defaults(run=_info)
    warmup = commands.add_parser("warmup", help="compile the kernels (every head dim, dtype and mask; the score "
                                                "modifiers all at once) for the current GPU, in parallel, into "
                                                "CuPy's on-disk cache")
    warmup.add_argument("--jobs", type=int, default=None, help="compiler processes (default: CPU count)")
    warmup.set_defaults(run=_warmup)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
