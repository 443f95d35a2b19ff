"""``python -m bench``: run benchmark suites and write ``<out>/<gpu>/<suite>.{json,md,png}``."""

from __future__ import annotations

import argparse
import sys

from cuflash._env import gpu_unavailable_reason

from .impls import IMPL_NAMES
from .records import make_header, merge_records, read_json, results_dir, write_json
from .suites import ON_REQUEST, SUITES, suite_cells

DEFAULT_OUT = "bench/results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Benchmark cuflash against naive CuPy attention and PyTorch SDPA (flash, cuDNN, "
                    "efficient). Suites: grid (TFLOP/s on FlashAttention's grid), memory (peak bytes beyond "
                    "inputs and outputs), overhead (host ms per call at tiny shapes), compile (first call "
                    "with a cold and a warm kernel cache), features (masks and score modifiers against "
                    "FlexAttention), decode (one step against a KV cache), varlen (packed batches of mixed "
                    "lengths against padded peers), scaling (ring attention over the host's GPUs, 128k-1M "
                    "tokens; only when named).",
        epilog="Regenerate tables and plots from a results file: python -m bench.report RESULTS.json")
    parser.add_argument("suites", nargs="*", metavar="SUITE", help=f"suites to run, of {', '.join(SUITES)} "
                        f"(default: all but {', '.join(ON_REQUEST)})")
    parser.add_argument("--suite", action="append", default=[], metavar="SUITE", help="a suite to run (repeatable)")
    parser.add_argument("--quick", action="store_true", help="smoke run: few shapes, few repeats (~1 minute)")
    parser.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                        help=f"results folder; files go to DIR/<gpu>/ (default: {DEFAULT_OUT})")
    parser.add_argument("--impl", action="append", default=[], metavar="NAME",
                        help=f"restrict to these implementations (repeatable or comma-separated), of "
                             f"{', '.join(IMPL_NAMES)} (default: every one this machine can run); cuflash "
                             "still runs unrecorded, as the reference the others are checked against")
    parser.add_argument("--repeats", type=int, default=None, metavar="N",
                        help="timed repeats per cell in the grid (default: 10, --quick: 5)")
    parser.add_argument("--head-dim", action="append", type=int, default=[], metavar="D", dest="head_dims",
                        help="run only the cells of this head dim (repeatable)")
    parser.add_argument("--merge", action="store_true",
                        help="add the records to the suite's results file instead of replacing it (a record "
                             "of the same cell and implementation is replaced); with --head-dim, a suite can "
                             "run in parts")
    args = parser.parse_args(argv)
    args.suites = list(dict.fromkeys(args.suites + args.suite)) or [s for s in SUITES if s not in ON_REQUEST]
    unknown = [s for s in args.suites if s not in SUITES]
    if unknown:
        parser.error(f"unknown suite(s) {', '.join(unknown)}; choose from {', '.join(SUITES)}")
    args.impl = [name.strip() for item in args.impl for name in item.split(",") if name.strip()]
    unknown = [name for name in args.impl if name not in IMPL_NAMES]
    if unknown:
        parser.error(f"unknown implementation(s) {', '.join(unknown)}; choose from {', '.join(IMPL_NAMES)}")
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be at least 1")
    for suite in args.suites:
        if args.head_dims and not suite_cells(suite, args.quick, tuple(args.head_dims)):
            dims = sorted({cell.shape.head_dim for cell in suite_cells(suite, args.quick)})
            parser.error(f"--head-dim {', '.join(map(str, args.head_dims))} leaves no cells of the {suite} suite "
                         f"(its head dims: {', '.join(map(str, dims))})")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from . import impls, report, suites

    reason = gpu_unavailable_reason()
    if reason:
        raise SystemExit(f"bench: the {', '.join(args.suites)} suite(s) need a CUDA GPU: {reason}")
    names = args.impl or impls.default_impl_names()
    try:
        impls.make_impls(names)
    except RuntimeError as exc:
        raise SystemExit(f"bench: {exc}") from None
    environment = impls.environment()
    print(f"bench: {environment['gpu']}; implementations: {', '.join(names)}", file=sys.stderr)
    head_dims = tuple(args.head_dims)
    timed_cells = [cell for suite in args.suites if suite not in suites.SELF_CHECKED
                   for cell in suite_cells(suite, args.quick, head_dims)]
    suites.check_reference(timed_cells)
    folder = results_dir(args.out, environment["gpu"])
    for suite in args.suites:
        records = suites.run_suite(suite, names, quick=args.quick, repeats=args.repeats, head_dims=head_dims)
        header = make_header(suite, args.quick, **environment)
        path = folder / f"{suite}.json"
        if args.merge and path.exists():
            earlier, old = read_json(path)
            if earlier.get("quick", False) != args.quick:
                raise SystemExit(f"bench: --merge: {path} is {'a' if earlier.get('quick') else 'not a'} --quick "
                                 "run and this one is not the same: run again without --merge to replace it")
            records = merge_records(old, records)
            header["merged_with"] = earlier.get("date")
        json_path = write_json(path, header, records)
        for path in (json_path, *report.write_reports(json_path)):
            print(path)


if __name__ == "__main__":
    main()
