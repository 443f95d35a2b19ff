"""Markdown tables and plots from a results file (pure: no GPU).

``python -m bench.report RESULTS.json [...]`` rewrites ``RESULTS.md`` and ``RESULTS.png`` next to each
file, so plots can be regenerated without rerunning anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import pathlib

from .records import read_json

#: Table rows and plot lines, in this order; unknown implementations follow, sorted.
IMPL_ORDER = ("cuflash", "cuflash-padded", "cuflash-deterministic", "cuflash-fp8", "naive-cupy", "torch-flash",
              "torch-cudnn", "torch-efficient", "torch-flex")
SUBJECT = "cuflash"
PASS_ORDER = ("fwd", "bwd", "fwd+bwd", "compile-cold", "compile-warm")
#: The plots show one dtype, to stay readable; the tables show all.
PLOT_DTYPE = "bfloat16"
PANEL_SIZE_IN = (4.2, 3.2)  # width, height of one plot panel in inches
PLOT_DPI = 100
KIB = 1024


def fmt_count(n: int) -> str:
    """512 -> '512', 2048 -> '2k'."""
    return f"{n // KIB}k" if n >= KIB and n % KIB == 0 else str(n)


def fmt_bytes(n: float) -> str:
    return f"{n / KIB**3:.2f} GiB" if abs(n) >= KIB**3 else f"{n / KIB**2:.1f} MiB"


def fmt_rate(x: float) -> str:
    return f"{x:.1f}"


def fmt_ms(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.0f}"


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a suite is shown: ``value`` per ``column`` (x axis), one table/panel per ``panel`` fields."""

    value: str
    column: str
    panel: tuple[str, ...]
    label: str  # what the table values are
    axis: str  # the plot's y label
    fmt: object
    ratios: bool
    ratio_meaning: str = ""
    log_y: bool = False


LAYOUTS = {
    "grid": Layout("tflops", "seqlen_q", ("pass", "head_dim", "causal"), "TFLOP/s", "TFLOP/s", fmt_rate, True,
                   "above 1: cuflash is faster"),
    "memory": Layout("peak_bytes", "seqlen_q", ("pass", "head_dim", "causal"),
                     "peak device memory beyond inputs and outputs", "bytes", fmt_bytes, True,
                     "below 1: cuflash needs less", log_y=True),
    "overhead": Layout("ms_median", "seqlen_q", ("pass", "head_dim", "causal"), "median host ms per call",
                       "ms per call", fmt_ms, True, "below 1: cuflash costs less"),
    "compile": Layout("ms_median", "head_dim", ("pass", "seqlen_q", "causal"), "ms of the first call",
                      "ms", fmt_ms, False),
    "features": Layout("tflops", "seqlen_q", ("pass", "head_dim", "feature"), "TFLOP/s on the visible entries",
                       "TFLOP/s", fmt_rate, True, "above 1: cuflash is faster"),
    "decode": Layout("ms_median", "seqlen_k", ("batch", "seqlen_q", "heads", "feature"),
                     "GPU ms per decoding step (feature host: host ms per call)", "ms", fmt_ms, True,
                     "below 1: cuflash is faster", log_y=True),
    "varlen": Layout("tflops", "seqlen_q", ("pass", "head_dim", "causal"), "TFLOP/s on the real tokens",
                     "TFLOP/s", fmt_rate, True, "above 1: cuflash is faster"),
    "scaling": Layout("tflops", "seqlen_q", ("pass", "causal"), "TFLOP/s per GPU", "TFLOP/s per GPU", fmt_rate,
                      False),
}


def impl_order(records: list[dict]) -> list[str]:
    names = {r["impl"] for r in records}
    return [n for n in IMPL_ORDER if n in names] + sorted(names - set(IMPL_ORDER))


def _group(records: list[dict], keys: tuple[str, ...]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    return groups


def _sorted_keys(keys: tuple[str, ...], groups: dict) -> list[tuple]:
    """Group keys in reading order: passes as in PASS_ORDER, numbers ascending, non-causal first."""
    def order(values):
        return tuple(PASS_ORDER.index(v) if k == "pass" and v in PASS_ORDER else v for k, v in zip(keys, values))

    return sorted(groups, key=order)


def _panel_title(keys: tuple[str, ...], values: tuple) -> str:
    parts = []
    for key, value in zip(keys, values):
        if key == "causal":
            parts.append("causal" if value else "non-causal")
        elif key == "feature":
            if value:  # none: the plain cells of a suite that also has feature cells
                parts.append(str(value))
        elif key == "pass":
            parts.append(str(value))
        else:
            parts.append(f"seqlen {fmt_count(value)}" if key == "seqlen_q" else f"{key} {value}")
    return ", ".join(parts)


def markdown_table(records: list[dict], layout: Layout) -> str:
    """One table: a row per implementation, a column per ``layout.column`` value, plus ratio rows.

    A cell holds the formatted value, or the status where the implementation did not run ('oom',
    'refused'). Ratio rows ``cuflash / peer`` divide cuflash's value by the peer's, where both ran.
    """
    columns = sorted({r[layout.column] for r in records})
    cells = {(r["impl"], r[layout.column]): r for r in records}

    def value(impl, col):
        r = cells.get((impl, col))
        return r[layout.value] if r and r["status"] == "ok" and r[layout.value] is not None else None

    def shown(impl, col):
        r = cells.get((impl, col))
        if r is None:
            return ""
        return layout.fmt(value(impl, col)) if value(impl, col) is not None else r["status"]

    impls = impl_order(records)
    head = "| impl | " + " | ".join(fmt_count(c) for c in columns) + " |"
    lines = [head, "|" + "---|" * (len(columns) + 1)]
    lines += ["| " + " | ".join([impl] + [shown(impl, c) for c in columns]) + " |" for impl in impls]
    if layout.ratios and SUBJECT in impls:
        for peer in impls:
            if peer == SUBJECT:
                continue
            ratios = []
            for c in columns:
                ours, theirs = value(SUBJECT, c), value(peer, c)
                ratios.append(f"{ours / theirs:.2f}x" if ours is not None and theirs else "")
            lines.append("| " + " | ".join([f"{SUBJECT} / {peer}"] + ratios) + " |")
    return "\n".join(lines)


def markdown(header: dict, records: list[dict], suite: str) -> str:
    """The whole report of one suite: a title, the environment, then a table per panel and dtype."""
    layout = LAYOUTS[suite]
    env = ", ".join(f"{key} {header[key]}" for key in ("driver", "cuda", "cupy", "torch", "cuflash")
                    if header.get(key))
    lines = [f"# {suite}: {header.get('gpu', 'unknown GPU')}", "",
             "; ".join(filter(None, [env, header.get("date")])) + (" (quick run)" if header.get("quick") else ""), "",
             f"Values: {layout.label} per {'seqlen' if layout.column == 'seqlen_q' else layout.column}."]
    if layout.ratios:
        lines[-1] += f" Ratio rows: cuflash's value over the peer's ({layout.ratio_meaning})."
    if suite == "grid":
        lines.append("FLOPs: 4 * batch * heads * seqlen^2 * head_dim for the forward, halved when causal; "
                     "bwd 2.5x, fwd+bwd 3.5x that.")
    if suite == "features":
        lines.append("FLOPs: 4 * batch * heads * head_dim * the score entries the mask leaves visible (causal: "
                     "seqlen (seqlen + 1) / 2; a window of w keys: min(i + 1, w + 1) for row i) for the forward; "
                     "fwd+bwd 3.5x that. Every feature is causal.")
    if suite == "varlen":
        from .varlen import BATCHES

        names = ", ".join(f"{fmt_count(max(lengths))} {name} ({len(lengths)} sequences)"
                          for name, lengths in BATCHES.items())
        lines.append(f"Columns: each batch's longest sequence: {names}; 16384 tokens each, bfloat16, heads x head_dim "
                     "= 2048. cuflash is the packed call; the others run on the batch padded to its longest sequence. "
                     "FLOPs: 4 * heads * head_dim * each sequence's score entries (causal: n (n + 1) / 2), fwd+bwd "
                     "3.5x, for every implementation. Under each table: cuflash's packed rate over its dense "
                     "kernels' rate on the padded batch counted on the padded work (4 * batch * heads * head_dim * "
                     "seqlen^2, halved when causal).")
    if suite == "decode":
        lines.append("Columns: keys per sequence in the cache (every sequence full), bfloat16, head_dim 128, "
                     "non-causal; heads = query heads (kv heads in the file). GPU time, launch hidden, L2 "
                     "flushed (bench/decode.py). Under each table: the cache read rate, TB/s (the copy: bytes "
                     "read and written).")
    if suite == "scaling":
        lines.append("Columns: tokens of the whole sequence, sharded over the GPUs (zigzag), bfloat16, batch 1, 32 "
                     "heads x 128; rows: GPUs, one process each, NCCL. FLOPs: 4 * heads * head_dim * the score "
                     "entries (causal: n (n + 1) / 2), fwd+bwd 3.5x, over the slowest rank's time and the GPU count. "
                     "'no moves': the same calls on a communicator that moves nothing. Under each table: the rate "
                     "per GPU over one GPU's at those tokens, and the share of the time the moves cost "
                     "(1 - no moves / ring).")
    groups = _group(records, layout.panel + ("dtype",))
    for key in _sorted_keys(layout.panel + ("dtype",), groups):
        lines += ["", f"## {_panel_title(layout.panel + ('dtype',), key)}", "",
                  markdown_table(groups[key], layout)]
        if suite == "decode" and key[layout.panel.index("feature")] != "host":
            lines += ["", bandwidth_table(groups[key])]
        if suite == "varlen":
            lines += ["", packing_table(groups[key])]
        if suite == "scaling":
            lines += ["", scaling_table(groups[key])]
    return "\n".join(lines) + "\n"


def cache_read_rate(record: dict) -> float:
    """A decode record's cache read rate, TB/s: the caches' bytes (the float8 caches' half the others') over the
    median time (the copy's: twice that, what it reads and writes)."""
    from .decode import cache_bytes, cache_itemsize
    from .records import Shape

    moved = cache_bytes(Shape.of(record), cache_itemsize(record["impl"])) * (2 if record["impl"] == "copy" else 1)
    return moved / (record["ms_median"] * 1e-3) / 1e12


def bandwidth_table(records: list[dict]) -> str:
    """The decode suite's cache read rate per implementation and cache size, TB/s (cache_read_rate)."""
    layout = Layout("rate", "seqlen_k", (), "TB/s", "TB/s", lambda x: f"{x:.2f}", False)
    rows = [{**r, "rate": cache_read_rate(r) if r["status"] == "ok" and r["ms_median"] else None} for r in records]
    return markdown_table(rows, layout)


def packing_efficiency(records: list[dict]) -> list[dict]:
    """The varlen suite's cuflash records (one panel's: a pass, head dim and mask) with ``efficiency``: the packed
    rate (real tokens) over cuflash's dense rate on the padded batch counted on the padded work, 1 where packing
    costs the kernels nothing."""
    from .flops import attention_flops, tflops

    padded = {}
    for r in records:
        if r["impl"] == "cuflash-padded" and r["status"] == "ok":
            work = attention_flops(r["batch"], r["heads"], r["seqlen_q"], r["seqlen_k"], r["head_dim"], r["causal"],
                                   r["pass"])
            padded[r["seqlen_q"]] = tflops(work, r["ms_median"])
    return [{**r, "efficiency": r["tflops"] / padded[r["seqlen_q"]]}
            for r in records if r["impl"] == SUBJECT and r["status"] == "ok" and r["seqlen_q"] in padded]


def packing_table(records: list[dict]) -> str:
    """The varlen suite's packing efficiency per batch (packing_efficiency)."""
    rows = [{**r, "impl": "cuflash / cuflash-padded (padded work)"} for r in packing_efficiency(records)]
    layout = Layout("efficiency", "seqlen_q", (), "", "", lambda x: f"{x:.2f}x", False)
    return markdown_table(rows, layout)


def scaling_table(records: list[dict]) -> str:
    """The scaling suite's efficiency per GPU count and token count: the rate per GPU over one GPU's rate
    ("N GPUs / 1 GPU") and the share of the ring's time that its moves cost ("N GPUs, moves")."""
    ok = {(r["impl"], r["seqlen_q"]): r for r in records if r["status"] == "ok" and r["ms_median"]}
    rows = []
    for (impl, tokens), r in ok.items():
        if impl.endswith("no moves"):
            continue
        one = ok.get(("1 GPU", tokens))
        if one is not None and impl != "1 GPU":
            rows.append({**r, "impl": f"{impl} / 1 GPU", "ratio": r["tflops"] / one["tflops"]})
        still = ok.get((f"{impl}, no moves", tokens))
        if still is not None:
            rows.append({**r, "impl": f"{impl}, moves", "ratio": 1 - still["ms_median"] / r["ms_median"]})
    layout = Layout("ratio", "seqlen_q", (), "", "", lambda x: f"{x:.2f}", False)
    return markdown_table(rows, layout)


def plot(header: dict, records: list[dict], suite: str, path: str | pathlib.Path) -> pathlib.Path:
    """Lines of ``layout.value`` against ``layout.column``, one panel per ``layout.panel``, one line per impl.

    Only PLOT_DTYPE records are drawn when there are any (else the first dtype present); points whose
    status is not 'ok' are left out.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layout = LAYOUTS[suite]
    dtypes = sorted({r["dtype"] for r in records})
    dtype = PLOT_DTYPE if PLOT_DTYPE in dtypes else (dtypes[0] if dtypes else PLOT_DTYPE)
    shown = [r for r in records if r["dtype"] == dtype]
    groups = _group(shown, layout.panel)
    keys = _sorted_keys(layout.panel, groups)
    # one row per pass (the first panel key), one column per combination of the others
    passes = list(dict.fromkeys(k[0] for k in keys))
    per_row = max((sum(1 for k in keys if k[0] == p) for p in passes), default=1)
    rows = max(len(passes), 1)
    fig, axes = plt.subplots(rows, per_row, squeeze=False, layout="constrained",
                             figsize=(PANEL_SIZE_IN[0] * per_row, PANEL_SIZE_IN[1] * rows))
    impls = impl_order(shown)
    colors = dict(zip(impls, itertools.cycle(plt.rcParams["axes.prop_cycle"].by_key()["color"])))
    for row, pass_ in enumerate(passes):
        for col, key in enumerate(k for k in keys if k[0] == pass_):
            ax = axes[row][col]
            for impl in impls:
                points = sorted((r[layout.column], r[layout.value]) for r in groups[key]
                                if r["impl"] == impl and r["status"] == "ok" and r[layout.value] is not None
                                and (r[layout.value] > 0 or not layout.log_y))
                if points:
                    xs, ys = zip(*points)
                    ax.plot(xs, ys, marker="o", label=impl, color=colors[impl])
            xs = sorted({r[layout.column] for r in groups[key]})
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [fmt_count(x) for x in xs])
            ax.minorticks_off()
            if layout.log_y:
                ax.set_yscale("log")
            else:
                ax.set_ylim(bottom=0)
            ax.set_title(_panel_title(layout.panel, key), fontsize="medium")
            ax.set_xlabel("seqlen" if layout.column == "seqlen_q" else layout.column)
            ax.set_ylabel(layout.axis)
            ax.grid(True, alpha=0.3)
        for col in range(sum(1 for k in keys if k[0] == pass_), per_row):
            axes[row][col].set_visible(False)
    legend = {}  # label -> handle, over every panel: an implementation may be missing from some
    for ax in axes.flat:
        legend.update(zip(*reversed(ax.get_legend_handles_labels())))
    if legend:
        labels = [impl for impl in impls if impl in legend]
        fig.legend([legend[label] for label in labels], labels, loc="outside lower center", ncol=len(labels),
                   frameon=False)
    fig.suptitle(f"{suite}: {header.get('gpu', 'unknown GPU')}, {dtype}")
    path = pathlib.Path(path)
    fig.savefig(path, dpi=PLOT_DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def suite_of(header: dict, json_path: pathlib.Path) -> str:
    """The suite a results file holds: from its header, else from its file name."""
    suite = header.get("suite") or json_path.stem
    if suite not in LAYOUTS:
        raise ValueError(f"{json_path}: unknown suite {suite!r} (expected one of {tuple(LAYOUTS)})")
    return suite


#: the README's performance table: its passes, head dims and implementations (bfloat16, FlashAttention's grid)
README_PASSES, README_HEAD_DIMS = ("fwd", "fwd+bwd"), (64, 128, 256)
README_PEERS = ("torch-flash", "torch-cudnn")
README_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)


def readme_table(records: list[dict]) -> str:
    """The README's performance table from grid records: per pass, head dim and mask, TFLOP/s of cuflash, of
    cuflash-deterministic (forward plus backward) and of the peers, then cuflash's ratio to each peer. Every
    cell must be in ``records``."""
    rates = {(r["pass"], r["head_dim"], r["causal"], r["impl"], r["seqlen_q"]): r["tflops"] for r in records
             if r["dtype"] == "bfloat16" and r["status"] == "ok"}
    lines = ["| pass, head_dim, mask | impl | " + " | ".join(fmt_count(n) for n in README_SEQLENS) + " |",
             "|---|---|" + "---|" * len(README_SEQLENS)]
    for pass_ in README_PASSES:
        for head_dim in README_HEAD_DIMS:
            for causal in (False, True):
                label = f"{pass_} d={head_dim} {'causal' if causal else 'full'}"
                deterministic = ("cuflash-deterministic",) if pass_ != "fwd" else ()
                for i, impl in enumerate((SUBJECT, *deterministic, *README_PEERS)):
                    cells = [f"{rates[pass_, head_dim, causal, impl, n]:.0f}" for n in README_SEQLENS]
                    lines.append(f"| {label if i == 0 else ''} | {impl} | " + " | ".join(cells) + " |")
                for peer in README_PEERS:
                    cells = [f"{rates[pass_, head_dim, causal, SUBJECT, n] / rates[pass_, head_dim, causal, peer, n]:.2f}x"
                             for n in README_SEQLENS]
                    lines.append(f"| | {SUBJECT} / {peer} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_reports(json_path: str | pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """Write ``<stem>.md`` and ``<stem>.png`` next to a results file; returns their paths."""
    json_path = pathlib.Path(json_path)
    header, records = read_json(json_path)
    suite = suite_of(header, json_path)
    md_path = json_path.with_suffix(".md")
    md_path.write_text(markdown(header, records, suite))
    return md_path, plot(header, records, suite, json_path.with_suffix(".png"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.report",
                                     description="Regenerate the markdown tables and plots of results files.")
    parser.add_argument("results", nargs="+", help="results JSON files written by python -m bench")
    parser.add_argument("--readme", action="store_true",
                        help="print the README's performance table from a grid results file instead")
    args = parser.parse_args(argv)
    for path in args.results:
        if args.readme:
            print(readme_table(read_json(path)[1]))
            continue
        for written in write_reports(path):
            print(written)


if __name__ == "__main__":
    main()
