"""The open issues' speed targets checked against the committed results (pure: no GPU).

``python -m bench.targets [RESULTS_DIR]`` (default ``bench/results/nvidia-h200``) prints a row per target:
its issue, the promise, how many points of the results it covers, the worst of them and where, and whether
every point meets the bar. A target whose results file is missing, or whose points are not in it (a column
not yet measured), says so: it neither passes nor fails. The bars are the issues' own texts; a value is
cuflash's speed over what the promise compares it with, so higher is better everywhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
from collections.abc import Callable, Iterable

from .records import Shape, read_json, record_key
from .report import SUBJECT, cache_read_rate, fmt_count, packing_efficiency
from .timing import disturbed

DEFAULT_RESULTS = "bench/results/nvidia-h200"
#: SDPA's flash and cuDNN backends: the decode suite's peers, and the varlen suite's padded ones
SDPA_PEERS = ("torch-flash", "torch-cudnn")
MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Point:
    """One measured value of a target and the cell it comes from."""

    value: float
    where: str


@dataclasses.dataclass(frozen=True)
class Target:
    """A promise of an issue: ``points`` gives its values from a suite's records; it holds where each is at
    least ``bar``."""

    issue: int
    promise: str
    suite: str
    bar: float
    points: Callable[[list[dict]], list[Point]]


@dataclasses.dataclass(frozen=True)
class Verdict:
    target: Target
    points: list[Point]
    missing: str = ""   # why there is nothing to judge

    @property
    def met(self) -> bool | None:
        """True or False; None where nothing was measured."""
        return None if not self.points else all(p.value >= self.target.bar for p in self.points)

    @property
    def worst(self) -> Point | None:
        return min(self.points, key=lambda p: p.value) if self.points else None


def _cell(record: dict) -> tuple:
    """What a record measured, without the implementation."""
    return record_key(record)[1:]


def _ok(records: Iterable[dict]) -> list[dict]:
    return [r for r in records if r.get("status") == "ok" and r.get("ms_median")]


def _disturbed(record: dict) -> bool:
    """Did the record stay disturbed (``bench.timing.disturbed``) after the re-measures of
    ``bench.timing.least_disturbed``? Then its median says less of the code than of the machine's moment."""
    return bool(record.get("ms_min")) and disturbed(record["ms_median"], record["ms_min"])


def _where(r: dict, *others: dict) -> str:
    """A cell in words: pass, dtype, head dim, mask and feature (a suite's column or panel name), sizes; marked
    "disturbed" where ``r`` or one of the ``others`` its value came from stayed disturbed (``_disturbed``)."""
    mask = " ".join(dict.fromkeys(filter(None, ("causal" if r["causal"] else "full", r.get("feature")))))
    sizes = (f"seqlen {fmt_count(r['seqlen_q'])}" if r["seqlen_q"] == r["seqlen_k"] else
             f"seqlen_q {r['seqlen_q']}, keys {fmt_count(r['seqlen_k'])}")
    mark = " (disturbed)" if any(map(_disturbed, (r, *others))) else ""
    return (f"{r['pass']} {r['dtype']} d{r['head_dim']} {mask}, batch {r['batch']}, {sizes}, "
            f"heads {r['heads']}/{r['heads_kv']}{mark}")


def _speed(record: dict) -> float:
    """TFLOP/s where the suite counts them (so cells of different work compare), else calls per ms."""
    return record["tflops"] if record.get("tflops") else 1.0 / record["ms_median"]


def ratio_points(subject: str, peers: tuple[str, ...], select: Callable[[dict], bool] = lambda r: True,
                 peer_cell: Callable[[dict], tuple] = _cell) -> Callable[[list[dict]], list[Point]]:
    """The subject's speed over the fastest of ``peers`` at each selected cell where both measured;
    ``peer_cell`` maps a subject record to the peers' cell (default: the same cell)."""
    def points(records: list[dict]) -> list[Point]:
        records = _ok(records)
        by_cell = {}
        for r in records:
            if r["impl"] in peers:
                cell = _cell(r)
                if cell not in by_cell or _speed(r) > _speed(by_cell[cell]):
                    by_cell[cell] = r
        found = []
        for r in records:
            if r["impl"] == subject and select(r):
                peer = by_cell.get(peer_cell(r))
                if peer is not None:
                    found.append(Point(_speed(r) / _speed(peer), _where(r, peer)))
        return found
    return points


def _as_feature(feature: str) -> Callable[[dict], tuple]:
    """The cell of the same shape and pass under another feature of the features suite."""
    def cell(r: dict) -> tuple:
        return _cell({**r, "feature": feature})
    return cell


def _feature_ratio(feature: str, min_seqlen: int = 0) -> Callable[[list[dict]], list[Point]]:
    """cuflash under ``feature`` over its own plain causal speed (TFLOP/s on the visible entries)."""
    return ratio_points(SUBJECT, (SUBJECT,), lambda r: r["feature"] == feature and r["seqlen_q"] >= min_seqlen,
                        _as_feature("causal"))


def value_points(subject: str, select: Callable[[dict], bool]) -> Callable[[list[dict]], list[Point]]:
    """The subject's TFLOP/s at each selected cell."""
    def points(records: list[dict]) -> list[Point]:
        return [Point(r["tflops"], _where(r)) for r in _ok(records) if r["impl"] == subject and select(r)]
    return points


def _read_rate_share(records: list[dict]) -> list[Point]:
    """cuflash's cache read rate over the copy's, at caches of 256 MiB and more."""
    from .decode import cache_bytes

    records = [r for r in _ok(records) if not r.get("feature")]
    copies = {_cell(r): r for r in records if r["impl"] == "copy"}
    large = [r for r in records if r["impl"] == SUBJECT and cache_bytes(Shape.of(r)) >= 256 * MIB]
    return [Point(cache_read_rate(r) / cache_read_rate(copies[_cell(r)]), _where(r, copies[_cell(r)]))
            for r in large if _cell(r) in copies]


def _packing(records: list[dict]) -> list[Point]:
    """The varlen suite's packing efficiency at each batch, pass, head dim and mask."""
    panels = {}
    for r in records:
        panels.setdefault((r["pass"], r["head_dim"], r["causal"]), []).append(r)
    return [Point(r["efficiency"], _where(r)) for panel in panels.values() for r in packing_efficiency(panel)]


def _grid_cudnn(select: Callable[[dict], bool]) -> Callable[[list[dict]], list[Point]]:
    return ratio_points(SUBJECT, ("torch-cudnn",), lambda r: r["pass"] in ("fwd", "fwd+bwd") and select(r))


#: The open issues' targets, in their order (texts: ``issues show N``)
TARGETS = (
    Target(15, "softcap's speed within 20% of plain causal (fwd, fwd+bwd)", "features", 0.8,
           _feature_ratio("softcap30")),
    Target(15, "ALiBi's within 10% of plain causal", "features", 0.9, _feature_ratio("alibi")),
    Target(15, "sinks' within 10% of plain causal", "features", 0.9, _feature_ratio("sinks")),
    Target(15, "window 1024 >= 0.85x plain causal on visible entries, seqlen 8k and up", "features", 0.85,
           _feature_ratio("window1024", 8192)),
    Target(15, "dropout within 15% of plain causal", "features", 0.85, _feature_ratio("dropout0.1")),
    Target(15, "every feature's forward >= 1.0x FlexAttention", "features", 1.0,
           ratio_points(SUBJECT, ("torch-flex",), lambda r: r["pass"] == "fwd")),
    Target(16, "decode: time <= the best peer's (SDPA flash, cuDNN) at every point", "decode", 1.0,
           ratio_points(SUBJECT, SDPA_PEERS, lambda r: not r.get("feature"))),
    Target(16, "decode: cache read >= 80% of the copy's rate at caches of 256 MiB and more", "decode", 0.8,
           _read_rate_share),
    Target(16, "decode: paged within 5% of contiguous", "decode", 1 / 1.05,
           ratio_points("cuflash-paged", (SUBJECT,), lambda r: not r.get("feature"))),
    Target(16, "decode: host time per call at batch 1 <= SDPA's", "decode", 1.0,
           ratio_points(SUBJECT, SDPA_PEERS, lambda r: r.get("feature") == "host")),
    Target(16, "varlen: packed >= 0.95x its own dense rate (padded work)", "varlen", 0.95, _packing),
    Target(16, "varlen: faster than any padded peer", "varlen", 1.0, ratio_points(SUBJECT, SDPA_PEERS)),
    Target(17, "fwd and fwd+bwd >= 1.0x cuDNN, seqlen 1k-16k", "grid", 1.0,
           _grid_cudnn(lambda r: r["seqlen_q"] >= 1024)),
    Target(17, "fwd and fwd+bwd >= 0.9x cuDNN at seqlen 512", "grid", 0.9,
           _grid_cudnn(lambda r: r["seqlen_q"] < 1024)),
    Target(17, "deterministic >= 0.85x the default's fwd+bwd", "grid", 0.85,
           ratio_points("cuflash-deterministic", (SUBJECT,), lambda r: r["pass"] == "fwd+bwd")),
    Target(17, "the features suite >= 1.0x FlexAttention (fwd and fwd+bwd)", "features", 1.0,
           ratio_points(SUBJECT, ("torch-flex",))),
    Target(18, "float8 forward >= 1000 TFLOP/s at head_dim 128 from seqlen 4k, no mask", "grid", 1000.0,
           value_points("cuflash-fp8", lambda r: r["head_dim"] == 128 and r["seqlen_q"] >= 4096 and not r["causal"])),
    Target(18, "float8 forward >= 1.6x cuflash's bfloat16 forward at every point", "grid", 1.6,
           ratio_points("cuflash-fp8", (SUBJECT,), lambda r: r["dtype"] == "bfloat16")),
)
#: Targets the suites do not measure, and where their measurements are
ELSEWHERE = (
    (17, "the portable head_dim 256 backward >= 1.0x FlashAttention-2",
     "tools/backward_ab.py --portable (bench/NOTES.md)"),
    (18, "the float8 forward's error against bfloat16 (reported, no bar)", "python -m bench.fp8_error"),
)


def judge(results: str | pathlib.Path, targets: tuple[Target, ...] = TARGETS) -> list[Verdict]:
    """Each target against the suites' files in ``results`` (``<suite>.json``)."""
    results = pathlib.Path(results)
    loaded = {}
    verdicts = []
    for target in targets:
        path = results / f"{target.suite}.json"
        if target.suite not in loaded:
            loaded[target.suite] = read_json(path)[1] if path.exists() else None
        records = loaded[target.suite]
        if records is None:
            verdicts.append(Verdict(target, [], f"no {path.name}"))
            continue
        points = target.points(records)
        verdicts.append(Verdict(target, points, "" if points else f"none of its points in {path.name}"))
    return verdicts


def _fmt(value: float, digits: int = 2) -> str:
    """A value (2 decimals) or a bar (3 significant digits, so that 1 / 1.05 shows as 0.952)."""
    if value >= 100:
        return f"{value:.0f}"
    return f"{value:.{digits}f}" if digits else f"{value:.3g}"


def markdown(verdicts: list[Verdict], results: str | pathlib.Path) -> str:
    lines = [f"# Targets against {results}", "",
             "Value: cuflash's over what the promise compares it with (TFLOP/s for an absolute bar); the worst "
             "point of each target, and how many points it covers.", "",
             "| issue | target | bar | points | worst | where | met |", "|---|---|---|---|---|---|---|"]
    for v in verdicts:
        t = v.target
        if v.met is None:
            lines.append(f"| {t.issue} | {t.promise} | {_fmt(t.bar, 0)} | 0 | | {v.missing} | not measured |")
            continue
        below = sum(p.value < t.bar for p in v.points)
        met = "yes" if v.met else f"no ({below} below)"
        lines.append(f"| {t.issue} | {t.promise} | {_fmt(t.bar, 0)} | {len(v.points)} | {_fmt(v.worst.value)} | "
                     f"{v.worst.where} | {met} |")
    lines += ["", "Measured outside the suites:", ""]
    lines += [f"- issue {issue}: {promise}: {where}" for issue, promise, where in ELSEWHERE]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.targets", description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="?", default=DEFAULT_RESULTS,
                        help=f"a folder of suites' results files (default: {DEFAULT_RESULTS})")
    args = parser.parse_args(argv)
    if not pathlib.Path(args.results).is_dir():
        parser.error(f"{args.results} is not a folder")
    print(markdown(judge(args.results), args.results), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
