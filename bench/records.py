"""Result records, the header record, JSON files and the results folder (pure, no GPU)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
import re

from .flops import PASSES, attention_flops, tflops

#: Outcomes of one (implementation, cell): timed, declined by the implementation, or out of memory.
STATUSES = ("ok", "refused", "oom", "skipped")
#: Passes of the compile suite, besides the timed PASSES.
COMPILE_PASSES = ("compile-cold", "compile-warm")

#: Every record has exactly these keys (plus the header's own keys for the header).
RECORD_FIELDS = ("impl", "pass", "dtype", "batch", "seqlen_q", "seqlen_k", "heads", "heads_kv", "head_dim",
                 "causal", "feature", "ms_median", "ms_min", "ms_max", "repeats", "tflops", "peak_bytes", "status",
                 "note")


@dataclasses.dataclass(frozen=True)
class Shape:
    """An attention problem's sizes: q is (batch, seqlen_q, heads, head_dim), k and v
    (batch, seqlen_k, heads_kv, head_dim)."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    heads_kv: int
    head_dim: int

    @classmethod
    def of(cls, record: dict) -> "Shape":
        """The sizes a result record measured."""
        return cls(*(record[field] for field in ("batch", "seqlen_q", "seqlen_k", "heads", "heads_kv", "head_dim")))

    @classmethod
    def square(cls, batch: int, seqlen: int, heads: int, head_dim: int) -> "Shape":
        """Self-attention sizes: seqlen_q == seqlen_k, one kv head per query head."""
        return cls(batch, seqlen, seqlen, heads, heads, head_dim)


def make_record(impl: str, pass_: str, dtype: str, shape: Shape, causal: bool, status: str = "ok",
                times_ms: list[float] | None = None, peak_bytes: int | None = None, with_tflops: bool = True,
                note: str | None = None, feature: str = "", visible: float | None = None) -> dict:
    """One result row.

    Parameters
    ----------
    impl : str
    pass_ : str
        One of PASSES or COMPILE_PASSES.
    dtype : str
        numpy dtype name, e.g. ``"bfloat16"``.
    shape : Shape
    causal : bool
    status : {"ok", "refused", "oom", "skipped"}
        "skipped": the bench chose not to run the cell (the note says why).
    times_ms : list of float, optional
        Every timed repeat; gives ms_median/min/max and the repeat count.
    peak_bytes : int, optional
        Device memory beyond inputs and outputs (memory suite).
    with_tflops : bool
        Derive TFLOP/s from the median time (only for event-timed fwd/bwd/fwd+bwd records).
    note : str, optional
        Why a cell was refused or skipped, or how it was measured.
    feature : str
        The features suite's mask or score modifier (``bench.features``); empty elsewhere.
    visible : float, optional
        Visible score entries per (batch, head), for TFLOP/s counted on those only (features suite).

    Returns
    -------
    dict
        Keys RECORD_FIELDS; timings and tflops are None unless timed.
    """
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
    if pass_ not in PASSES + COMPILE_PASSES:
        raise ValueError(f"pass must be one of {PASSES + COMPILE_PASSES}, got {pass_!r}")
    median = low = high = rate = None
    if times_ms:
        ordered = sorted(times_ms)
        mid = len(ordered) // 2
        median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
        low, high = ordered[0], ordered[-1]
        if with_tflops and pass_ in PASSES:
            flops = attention_flops(shape.batch, shape.heads, shape.seqlen_q, shape.seqlen_k, shape.head_dim,
                                    causal, pass_, visible)
            rate = tflops(flops, median)
    return {"impl": impl, "pass": pass_, "dtype": dtype, **dataclasses.asdict(shape), "causal": bool(causal),
            "feature": feature, "ms_median": median, "ms_min": low, "ms_max": high, "repeats": len(times_ms or ()),
            "tflops": rate, "peak_bytes": peak_bytes, "status": status, "note": note}


def make_header(suite: str, quick: bool, **environment) -> dict:
    """The first record of a results file: what ran where.

    ``environment`` holds at least gpu, driver, cuda, cupy, torch (None without PyTorch) and cuflash.
    """
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"header": True, "suite": suite, "quick": bool(quick), **environment, "date": now}


def slug(name: str) -> str:
    """A folder name for a device name: ``'NVIDIA H200'`` -> ``'nvidia-h200'``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown-gpu"


def results_dir(out: str | pathlib.Path, gpu_name: str) -> pathlib.Path:
    """``<out>/<slug of the gpu name>``."""
    return pathlib.Path(out) / slug(gpu_name)


def write_json(path: str | pathlib.Path, header: dict, records: list[dict]) -> pathlib.Path:
    """Write ``[header, *records]``; returns the path."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([header, *records], indent=1) + "\n")
    return path


def record_key(record: dict) -> tuple:
    """What a record measured, without the outcome: two records of one key are the same cell and
    implementation. Results written before records had a feature lack the field: no feature, as ''."""
    return tuple(record[field] for field in ("impl", "pass", "dtype", "batch", "seqlen_q", "seqlen_k", "heads",
                                             "heads_kv", "head_dim", "causal")) + (record.get("feature") or "",)


def merge_records(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` with ``new`` added: a new record replaces the old one of its key, in the old one's place."""
    fresh = {record_key(record): record for record in new}
    merged = [fresh.pop(record_key(record), record) for record in old]
    return merged + [record for record in new if record_key(record) in fresh]


def read_json(path: str | pathlib.Path) -> tuple[dict, list[dict]]:
    """``(header, records)`` of a results file (an empty header when it has none)."""
    rows = json.loads(pathlib.Path(path).read_text())
    header = next((row for row in rows if row.get("header")), {})
    return header, [row for row in rows if not row.get("header")]
