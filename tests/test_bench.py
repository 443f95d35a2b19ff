"""CPU tests of the benchmark package: FLOP counts, records, tables, plots, the CLI, the naive baseline.

The GPU measurements themselves are not run here.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from bench import accuracy, features, fp8_error, impls, naive, report, scaling, targets
from bench.__main__ import parse_args
from bench.flops import attention_flops, tflops
from bench.records import (RECORD_FIELDS, Shape, make_header, make_record, merge_records, read_json, record_key,
                           results_dir, slug, write_json)
from bench.suites import MODEL_DIM, SUITES, TOKENS, suite_cells
import cuflash
from cuflash import reference

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
SHAPE = Shape.square(batch=2, seqlen=1024, heads=16, head_dim=128)


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})}, timeout=120)


# FLOPs


def test_forward_flops_follow_the_papers():
    assert attention_flops(2, 16, 1024, 1024, 128, False, "fwd") == 4 * 2 * 16 * 1024 * 1024 * 128


def test_causal_halves_and_passes_scale():
    fwd = attention_flops(2, 16, 1024, 1024, 128, False, "fwd")
    assert attention_flops(2, 16, 1024, 1024, 128, True, "fwd") == fwd / 2
    assert attention_flops(2, 16, 1024, 1024, 128, False, "bwd") == 2.5 * fwd
    assert attention_flops(2, 16, 1024, 1024, 128, False, "fwd+bwd") == 3.5 * fwd
    assert attention_flops(2, 16, 1024, 1024, 128, True, "fwd+bwd") == 3.5 * fwd / 2


def test_unknown_pass_is_rejected():
    with pytest.raises(ValueError, match="pass"):
        attention_flops(1, 1, 1, 1, 1, False, "backward")


def test_tflops():
    assert tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert tflops(1e12, 0.5) == pytest.approx(2000.0)


# records


def test_record_has_the_fields_and_derives_timings():
    rec = make_record("cuflash", "fwd", "bfloat16", SHAPE, True, times_ms=[3.0, 1.0, 2.0, 10.0])
    assert tuple(rec) == RECORD_FIELDS
    assert (rec["ms_median"], rec["ms_min"], rec["ms_max"], rec["repeats"]) == (2.5, 1.0, 10.0, 4)
    flops = 4 * 2 * 16 * 1024 * 1024 * 128 / 2
    assert rec["tflops"] == pytest.approx(flops / 2.5e-3 / 1e12)
    assert (rec["batch"], rec["seqlen_q"], rec["seqlen_k"], rec["heads"], rec["heads_kv"], rec["head_dim"]) == (
        2, 1024, 1024, 16, 16, 128)
    assert rec["causal"] is True and rec["status"] == "ok" and rec["peak_bytes"] is None


def test_record_without_timing_has_nulls():
    rec = make_record("naive-cupy", "bwd", "float16", SHAPE, False, status="oom", note="needs 80 GiB")
    assert rec["ms_median"] is None and rec["tflops"] is None and rec["repeats"] == 0
    assert rec["status"] == "oom" and rec["note"] == "needs 80 GiB"


def test_record_rejects_unknown_status_and_pass():
    with pytest.raises(ValueError, match="status"):
        make_record("cuflash", "fwd", "bfloat16", SHAPE, False, status="error")
    with pytest.raises(ValueError, match="pass"):
        make_record("cuflash", "forward", "bfloat16", SHAPE, False)


def test_untimed_tflops_and_memory_records():
    overhead = make_record("cuflash", "fwd", "bfloat16", SHAPE, False, times_ms=[0.02], with_tflops=False)
    assert overhead["ms_median"] == 0.02 and overhead["tflops"] is None
    compile_cold = make_record("cuflash", "compile-cold", "bfloat16", SHAPE, False, times_ms=[900.0])
    assert compile_cold["tflops"] is None
    memory = make_record("cuflash", "fwd", "bfloat16", SHAPE, False, peak_bytes=4096)
    assert memory["peak_bytes"] == 4096 and memory["ms_median"] is None


def _scripted_timer(*runs):
    """A stand-in for EventTimer that returns the given runs' times in turn, and counts its calls."""
    def timer(fn):
        timer.calls += 1
        return list(runs[timer.calls - 1])
    timer.calls = 0
    return timer


@pytest.mark.parametrize("runs, calls, kept", [
    ([[1.00, 1.01, 1.02, 1.03]], 1, 0),                                     # undisturbed: one run
    ([[1.0, 1.6, 1.7, 2.5], [1.0, 1.01, 1.02, 1.02]], 2, 1),                # disturbed, then clean
    ([[1.0, 1.5, 1.6, 2.0], [1.0, 1.3, 1.4, 1.5], [1.0, 1.4, 1.5, 3.0]], 3, 1),   # never clean: the lowest median
])
def test_a_disturbed_cell_is_measured_again_and_keeps_its_lowest_median(runs, calls, kept):
    from bench.suites import _measure_timed
    from bench.timing import DISTURBED_RETRIES

    assert len(runs) <= 1 + DISTURBED_RETRIES
    timer = _scripted_timer(*runs)
    record = functools.partial(make_record, "cuflash", "fwd", "bfloat16", SHAPE, False)
    rec = _measure_timed(None, lambda: None, record, None, timer)
    assert timer.calls == calls
    assert rec["ms_median"] == pytest.approx(float(np.median(runs[kept])))
    assert rec["ms_max"] == max(runs[kept])
    assert (rec["note"] is None) == (calls == 1)
    if calls > 1:
        assert f"measured {calls} times" in rec["note"]


def test_a_disturbed_varlen_cell_keeps_both_notes():
    # the varlen suite measures as the grid does (bench.timing.least_disturbed) and adds its note to the cell's own
    from bench.timing import least_disturbed
    from bench.varlen import joined

    times, note = least_disturbed(_scripted_timer([1.0, 1.6, 1.7, 2.5], [1.0, 1.01, 1.02, 1.02]), lambda: None)
    assert times == [1.0, 1.01, 1.02, 1.02]
    assert joined("packed: attention_varlen", note) == f"packed: attention_varlen; {note}"
    assert note.startswith("measured 2 times")
    assert joined("packed: attention_varlen", None) == "packed: attention_varlen"


@pytest.mark.parametrize("name, expected", [
    ("NVIDIA H200", "nvidia-h200"),
    ("NVIDIA GeForce RTX 4090", "nvidia-geforce-rtx-4090"),
    ("NVIDIA H100 80GB HBM3", "nvidia-h100-80gb-hbm3"),
    ("  NVIDIA A100-SXM4-40GB ", "nvidia-a100-sxm4-40gb"),
])
def test_slug(name, expected):
    assert slug(name) == expected


def test_results_dir_and_json_round_trip(tmp_path):
    header = make_header("grid", False, gpu="NVIDIA H200", driver="570.86", cuda="13.0", cupy="14.2.0", torch=None,
                         cuflash="0.1.0")
    assert header["header"] is True and header["suite"] == "grid" and header["date"]
    for key in ("gpu", "driver", "cuda", "cupy", "torch", "cuflash"):
        assert key in header
    assert results_dir(tmp_path, "NVIDIA H200") == tmp_path / "nvidia-h200"
    rec = make_record("cuflash", "fwd", "bfloat16", SHAPE, False, times_ms=[1.0])
    path = write_json(results_dir(tmp_path, "NVIDIA H200") / "grid.json", header, [rec])
    rows = json.loads(path.read_text())
    assert rows[0]["header"] is True and rows[1] == rec
    assert read_json(path) == (header, [rec])


def test_merge_replaces_a_cells_record_in_place_and_appends_new_cells():
    old = [make_record("cuflash", "fwd", "bfloat16", SHAPE, True, times_ms=[2.0], feature=f) for f in ("a", "b")]
    redo = make_record("cuflash", "fwd", "bfloat16", SHAPE, True, times_ms=[1.0], feature="b")
    other = make_record("torch-flex", "fwd", "bfloat16", SHAPE, True, times_ms=[3.0], feature="b")
    merged = merge_records(old, [other, redo])
    assert merged == [old[0], redo, other]
    assert len({record_key(r) for r in merged}) == 3 and record_key(redo) == record_key(old[1])
    assert merge_records(old, []) == old and merge_records([], old) == old
    # a record written before records had a feature (no such field) is the same cell as a new featureless one
    plain = make_record("cuflash", "fwd", "bfloat16", SHAPE, True, times_ms=[2.0], feature="")
    legacy = {key: value for key, value in plain.items() if key != "feature"}
    assert merge_records([legacy], [plain]) == [plain]


# suites


def test_grid_keeps_tokens_and_model_width():
    cells = suite_cells("grid")
    assert len(cells) == 6 * 3 * 2 * 2 * 3
    for cell in cells:
        assert cell.shape.batch * cell.shape.seqlen_q == TOKENS
        assert cell.shape.heads * cell.shape.head_dim == MODEL_DIM
        assert cell.shape.seqlen_q == cell.shape.seqlen_k
    assert {c.shape.seqlen_q for c in cells} == {512, 1024, 2048, 4096, 8192, 16384}
    assert {c.dtype for c in cells} == {"bfloat16", "float16"}


def test_quick_runs_are_small():
    for suite in SUITES:
        assert 0 < len(suite_cells(suite, quick=True)) < len(suite_cells(suite))
    assert len(suite_cells("grid", quick=True)) == 12
    assert max(c.shape.seqlen_q for c in suite_cells("memory")) == 32768


def test_head_dims_select_a_suites_cells():
    cells = suite_cells("features", head_dims=(64,))
    assert cells and {c.shape.head_dim for c in cells} == {64}
    assert len(cells) + len(suite_cells("features", head_dims=(128,))) == len(suite_cells("features"))
    assert suite_cells("features", head_dims=(96,)) == []


def test_unknown_suite():
    with pytest.raises(ValueError, match="unknown suite"):
        suite_cells("latency")


def test_features_suite_cells():
    cells = suite_cells("features")
    assert len(cells) == 2 * 4 * len(features.FEATURES) * 2  # head dims x seqlens x features x passes
    assert {c.feature for c in cells} == set(features.BY_NAME)
    for cell in cells:
        assert cell.causal and cell.dtype == "bfloat16" and cell.pass_ in ("fwd", "fwd+bwd")
        assert cell.shape.batch * cell.shape.seqlen_q == TOKENS and cell.shape.heads * cell.shape.head_dim == MODEL_DIM
        assert cell.feature in cell.describe()
    # the comparison point: (2, 8192, 16, 128)
    assert any(c.shape == Shape.square(2, 8192, 16, 128) for c in suite_cells("features", quick=True))


@pytest.mark.parametrize("seqlen", [1, 5, 1024, 1025, 1030, 8192])
@pytest.mark.parametrize("name", list(features.BY_NAME))
def test_visible_entries_count_the_mask(name, seqlen):
    feature = features.BY_NAME[name]
    window = (feature.window_left, -1) if feature.window_left >= 0 else (-1, -1)
    want = reference.mask(seqlen, seqlen, causal=True, window_size=window).sum()
    assert feature.visible_entries(seqlen) == want


def test_flops_on_visible_entries():
    visible = features.BY_NAME["window1024"].visible_entries(8192)
    assert attention_flops(2, 16, 8192, 8192, 128, True, "fwd+bwd", visible) == 4 * 2 * 16 * visible * 128 * 3.5
    record = make_record("cuflash", "fwd", "bfloat16", Shape.square(2, 8192, 16, 128), True, times_ms=[1.0],
                         feature="window1024", visible=visible)
    assert record["feature"] == "window1024" and record["tflops"] == pytest.approx(4 * 2 * 16 * visible * 128 / 1e9)


def test_features_table_has_a_panel_per_feature():
    records = [make_record(impl, "fwd", "bfloat16", Shape.square(2, 8192, 16, 128), True, times_ms=[ms],
                           feature=name, visible=features.BY_NAME[name].visible_entries(8192))
               for name in ("causal", "softcap30") for impl, ms in (("cuflash", 1.0), ("torch-flex", 2.0))]
    text = report.markdown({"gpu": "test"}, records, "features")
    assert "## fwd, head_dim 128, causal, dtype bfloat16" in text and "## fwd, head_dim 128, softcap30" in text
    assert "cuflash / torch-flex | 2.00x" in text


# tables and plots


def grid_records():
    """cuflash and torch-flash at two seqlens; naive runs out of memory at the second."""
    shapes = {512: Shape.square(32, 512, 16, 128), 1024: Shape.square(16, 1024, 16, 128)}
    flops = {s: attention_flops(sh.batch, sh.heads, s, s, 128, False, "fwd") for s, sh in shapes.items()}

    def timed(impl, seqlen, rate):  # a time that gives exactly ``rate`` TFLOP/s
        return make_record(impl, "fwd", "bfloat16", shapes[seqlen], False, times_ms=[flops[seqlen] / rate / 1e9])

    return [timed("cuflash", 512, 100.0), timed("cuflash", 1024, 200.0),
            timed("torch-flash", 512, 50.0), timed("torch-flash", 1024, 400.0),
            timed("naive-cupy", 512, 25.0),
            make_record("naive-cupy", "fwd", "bfloat16", shapes[1024], False, status="oom")]


def test_markdown_table_rows_and_ratios():
    table = report.markdown_table(grid_records(), report.LAYOUTS["grid"])
    lines = table.splitlines()
    assert lines[0] == "| impl | 512 | 1k |"
    assert "| cuflash | 100.0 | 200.0 |" in lines
    assert "| naive-cupy | 25.0 | oom |" in lines
    assert "| torch-flash | 50.0 | 400.0 |" in lines
    assert "| cuflash / naive-cupy | 4.00x |  |" in lines
    assert "| cuflash / torch-flash | 2.00x | 0.50x |" in lines
    # implementations in the fixed order, ratios after them
    assert [line.split(" | ")[0] for line in lines[2:]] == [
        "| cuflash", "| naive-cupy", "| torch-flash", "| cuflash / naive-cupy", "| cuflash / torch-flash"]


def test_markdown_report_has_a_table_per_group():
    header = make_header("grid", True, gpu="NVIDIA H200", driver="570.86", cuda="13.0", cupy="14.2.0", torch="2.9",
                         cuflash="0.1.0")
    records = grid_records() + [dict(r, dtype="float16") for r in grid_records()]
    text = report.markdown(header, records, "grid")
    assert text.startswith("# grid: NVIDIA H200")
    assert "## fwd, head_dim 128, non-causal, dtype bfloat16" in text
    assert "## fwd, head_dim 128, non-causal, dtype float16" in text
    assert text.count("| cuflash / torch-flash |") == 2


def test_memory_table_formats_bytes():
    shape = Shape.square(1, 1024, 16, 128)
    records = [make_record("cuflash", "fwd", "bfloat16", shape, False, peak_bytes=2 * 2**20),
               make_record("naive-cupy", "fwd", "bfloat16", shape, False, peak_bytes=3 * 2**30)]
    lines = report.markdown_table(records, report.LAYOUTS["memory"]).splitlines()
    assert "| cuflash | 2.0 MiB |" in lines
    assert "| naive-cupy | 3.00 GiB |" in lines
    assert f"| cuflash / naive-cupy | {2 / 3072:.2f}x |" in lines


def test_plot_and_markdown_from_a_results_file(tmp_path):
    header = make_header("grid", False, gpu="NVIDIA H200", driver="570.86", cuda="13.0", cupy="14.2.0", torch=None,
                         cuflash="0.1.0")
    path = write_json(tmp_path / "grid.json", header, grid_records())
    md_path, png_path = report.write_reports(path)
    assert png_path == tmp_path / "grid.png" and png_path.stat().st_size > 1000
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| cuflash / torch-flash | 2.00x | 0.50x |" in md_path.read_text()


def test_report_cli_regenerates(tmp_path):
    header = make_header("memory", False, gpu="NVIDIA H200", driver="", cuda="13.0", cupy="14.2.0", torch=None,
                         cuflash="0.1.0")
    shape = Shape.square(1, 1024, 16, 128)
    path = write_json(tmp_path / "memory.json", header,
                      [make_record("cuflash", "fwd", "bfloat16", shape, False, peak_bytes=2**20)])
    done = run_cli("bench.report", str(path))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "memory.png").stat().st_size > 0 and (tmp_path / "memory.md").exists()


# accuracy rule and the naive baseline


def test_accuracy_rule():
    want = np.array([1.0, -2.0, 0.5], np.float32)
    assert accuracy.relative_error(want + np.float32(0.02), want) == pytest.approx(0.01, rel=1e-4)
    assert accuracy.check_outputs((want + np.float32(0.02),), (want,), ("out",), "bfloat16")["out"] < 0.02
    with pytest.raises(accuracy.Mismatch, match="dq"):
        accuracy.check_outputs((want + np.float32(0.1),), (want,), ("dq",), "bfloat16")
    with pytest.raises(accuracy.Mismatch):
        accuracy.check_outputs((np.full(3, np.nan, np.float32),), (want,), ("out",), "float16")
    # an implementation with a tolerance factor: 0.03 of the largest value passes at 2x, not at 1x
    off = (want + np.float32(0.06),)
    assert accuracy.check_outputs(off, (want,), ("out",), "bfloat16", tolerance_factor=2.0)["out"] == pytest.approx(0.03)
    with pytest.raises(accuracy.Mismatch):
        accuracy.check_outputs(off, (want,), ("out",), "bfloat16")
    with pytest.raises(accuracy.Mismatch):
        accuracy.check_outputs((np.full(3, np.nan, np.float32),), (want,), ("out",), "float16", tolerance_factor=1e9)


def test_the_float8_forward_is_checked_by_e4m3s_rule_in_every_cell():
    # the float8 forward differed from cuflash's float16 one by 0.113 of its largest value in a grid cell of
    # float16 inputs (H200, head_dim 64, seqlen 1k), beyond float16's rule even at ten times; its rule is e4m3's
    fp8 = impls.CuflashFloat8()
    want = np.array([1.0, -2.0, 0.5], np.float32)
    off = (want + np.float32(2 * 0.113),)
    for cell_dtype in ("bfloat16", "float16"):
        rule = fp8.tolerance_dtype or cell_dtype
        assert accuracy.check_outputs(off, (want,), ("out",), rule, fp8.tolerance_factor)["out"] == pytest.approx(0.113)
    with pytest.raises(accuracy.Mismatch):   # a wrong mask or scale moves the output by its own size
        accuracy.check_outputs((want + np.float32(1.0),), (want,), ("out",), fp8.tolerance_dtype, fp8.tolerance_factor)
    assert impls.Cuflash().tolerance_dtype is None   # the others keep the cell's dtype


@pytest.mark.parametrize("causal", [False, True])
def test_naive_matches_the_reference(causal):
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((2, 37, 3, 16), dtype=np.float32) for _ in range(4))
    out, probs = naive.forward(q, k, v, causal, keep_probs=True)
    want_out, _ = reference.attention(q, k, v, causal)
    np.testing.assert_allclose(out, want_out, atol=1e-5)
    grads = naive.backward(dout, q, k, v, out, probs)
    for got, want in zip(grads, reference.attention_backward(dout, q, k, v, causal), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_causal_bias_is_bottom_right_aligned():
    bias = naive.causal_bias(np, 2, 4)
    np.testing.assert_array_equal(np.isfinite(bias), reference.causal_mask(2, 4))


# CLI


def test_help_exits_zero():
    done = run_cli("bench", "--help")
    assert done.returncode == 0
    for option in ("--quick", "--out", "--impl", "--suite", "--head-dim", "--merge", "grid", "memory", "overhead",
                   "compile", "features"):
        assert option in done.stdout


def test_unknown_suite_or_impl_is_a_usage_error():
    assert "unknown suite" in run_cli("bench", "latency").stderr
    done = run_cli("bench", "--impl", "cuflash,triton")
    assert done.returncode == 2 and "unknown implementation" in done.stderr


def test_a_head_dim_outside_the_suite_is_a_usage_error():
    done = run_cli("bench", "features", "--head-dim", "96")
    assert done.returncode == 2 and "leaves no cells of the features suite (its head dims: 64, 128)" in done.stderr


def test_gpu_suite_without_a_gpu_fails_cleanly(tmp_path):
    # CUDA_VISIBLE_DEVICES="" hides every GPU, so this holds on GPU machines too.
    done = run_cli("bench", "grid", "--quick", "--out", str(tmp_path), env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 1
    assert "bench: the grid suite(s) need a CUDA GPU" in done.stderr
    assert "Traceback" not in done.stderr
    assert not any(tmp_path.iterdir())


def test_pure_modules_import_without_cupy_or_torch():
    code = ("import sys; sys.modules['cupy'] = None; sys.modules['torch'] = None\n"
            "import bench.__main__, bench.flops, bench.records, bench.report, bench.accuracy, bench.naive, "
            "bench.suites, bench.impls, bench.timing, bench.features, bench.fp8_error\n"
            "from cuflash._env import gpu_unavailable_reason\n"
            "print(gpu_unavailable_reason())")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 0, done.stderr
    assert "CuPy is not installed" in done.stdout


def test_fp8_error_inputs_have_their_outliers():
    rng = np.random.default_rng(0)
    normal = np.stack([x.astype(np.float64) for x in fp8_error.make_inputs("normal", rng)])
    entries = np.stack([x.astype(np.float64) for x in fp8_error.make_inputs("outlier entries", rng)])
    # FlashAttention-3's recipe: 0.1% of the entries carry an N(0, 100) term, so |x| > 5 is ~50x as common
    assert (abs(normal) > 5).mean() < 1e-5 < 2e-4 < (abs(entries) > 5).mean() < 2e-3
    q, k, v = (x.astype(np.float64) for x in fp8_error.make_inputs("outlier channels", rng))
    channel_rms = np.sqrt((q**2).mean(axis=(0, 1, 2)))
    outliers = fp8_error.OUTLIER_CHANNELS
    gain = channel_rms[:outliers] / channel_rms[outliers:].mean()
    assert np.allclose(gain, fp8_error.OUTLIER_CHANNEL_GAIN, rtol=0.05)
    scores = np.einsum("bihd,bjhd->bhij", q, k) / np.sqrt(q.shape[-1])
    assert 0.9 < scores.std() < 1.1   # the channels' gain leaves the scores' spread at 1
    assert np.sqrt((v**2).mean()) == pytest.approx(1, rel=0.05)


def test_fp8_error_on_the_model(tmp_path, monkeypatch):
    # the model (--model, as on a host without the kernel): the bfloat16 forward on NumPy, the float8 rows from the
    # reference's model of the kernel
    monkeypatch.setattr(fp8_error, "SHAPE", (1, 96, 2, 128))
    fp8_error.main(["--out", str(tmp_path), "--seed", "3", "--model"])
    header, records = read_json(tmp_path / "model" / "fp8_error.json")
    assert header["source"] == "model" and header["shape"] == [1, 96, 2, 128]
    assert [(r["case"], r["method"]) for r in records] == [
        (case, method[0]) for case in fp8_error.CASES for method in fp8_error.METHODS]
    by = {(r["case"], r["method"]): r for r in records}
    bfloat16, tensor, head, hadamard = (m[0] for m in fp8_error.METHODS)
    for case in fp8_error.CASES:
        assert by[case, bfloat16]["rmse_bfloat16"] == 0
        assert 0 < 5 * by[case, bfloat16]["rmse_exact"] < by[case, tensor]["rmse_exact"]
    # the rotation spreads the outlier channels before they set the factors (RMSE 2.2x lower in the README's run)
    assert by["outlier channels", hadamard]["rmse_exact"] < 0.75 * by["outlier channels", head]["rmse_exact"]
    table = (tmp_path / "model" / "fp8_error.md").read_text()
    assert table.count("\n| outlier entries |") == len(fp8_error.METHODS)


def test_feature_options_run_on_the_numpy_path():
    # the options each feature hands cuflash (here through its NumPy path) agree with the float64 reference
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 40, 4, 16), dtype=np.float32) for _ in range(3))
    for feature in features.FEATURES:
        out = cuflash.attention(q, k, v, causal=True, **feature.options(4))
        want, _ = reference.attention(q, k, v, True, **feature.reference_options(4, 1, 40))
        assert np.abs(out - want).max() < 1e-5, feature.name


def test_decode_suite_cells_and_bandwidth_report():
    from bench import decode, report

    cells = suite_cells("decode")
    assert all(c.pass_ == "fwd" and not c.causal and c.shape.head_dim == decode.DECODE_HEAD_DIM for c in cells)
    assert {c.shape.seqlen_k for c in cells} == set(decode.DECODE_CACHES)
    assert {(c.shape.heads, c.shape.heads_kv) for c in cells} == set(decode.DECODE_HEADS)
    assert not any(c.shape.batch == 64 and c.shape.seqlen_k > decode.BATCH_64_MAX_CACHE for c in cells)
    assert all(c.shape.batch * c.shape.seqlen_k % decode.PAGE_SIZE == 0 for c in cells)
    # one step reading 256 MiB in 0.1 ms is 2.68 TB/s; a copy of it in 0.2 ms moves twice the bytes, as fast
    shape = Shape(8, 1, 8192, 32, 8, 128)
    assert decode.cache_bytes(shape) == 256 * 2**20
    records = [make_record("cuflash", "fwd", "bfloat16", shape, False, times_ms=[0.1], with_tflops=False),
               make_record("copy", "fwd", "bfloat16", shape, False, times_ms=[0.2], with_tflops=False),
               make_record("torch-cudnn", "fwd", "bfloat16", shape, False, times_ms=[0.125], with_tflops=False),
               make_record("cuflash-fp8", "fwd", "bfloat16", shape, False, times_ms=[0.05], with_tflops=False)]
    text = report.markdown({"gpu": "test"}, records, "decode")
    assert "## batch 8, seqlen 1, heads 32, dtype bfloat16" in text
    assert "| cuflash / torch-cudnn | 0.80x |" in text
    # the float8 cache is half the bytes: read in half the time, the same rate
    assert "| cuflash | 2.68 |" in text and "| copy | 2.68 |" in text and "| cuflash-fp8 | 2.68 |" in text


def test_varlen_suite_cells_and_packing_report():
    from bench import varlen

    assert all(sum(lengths) == varlen.VARLEN_TOKENS and 128 <= min(lengths) and max(lengths) <= 8192
               for lengths in varlen.BATCHES.values())
    cells = suite_cells("varlen")
    # one padded shape per batch: the longest sequences tell the batches apart (the report's columns)
    assert len({max(lengths) for lengths in varlen.BATCHES.values()}) == len(varlen.BATCHES)
    assert {(c.shape.batch, c.shape.seqlen_q) for c in cells} == {(len(n), max(n)) for n in varlen.BATCHES.values()}
    assert all(c.shape.heads * c.shape.head_dim == varlen.VARLEN_MODEL_DIM for c in cells)
    assert {c.pass_ for c in cells} == set(varlen.VARLEN_PASSES)
    narrow = suite_cells("varlen", head_dims=(64,))
    assert narrow and all(c.shape.head_dim == 64 for c in narrow)
    # sequences 3 and 1: 9 + 1 entries, causal 6 + 1, per sequence on average
    assert varlen.visible_entries((3, 1), False) == 5 and varlen.visible_entries((3, 1), True) == 3.5
    # the packed call at 100 real TFLOP/s in 1 ms; the padded dense call does the same real work in 2 ms, and
    # its padded work (here twice the real) at the same 100 TFLOP/s: packing costs nothing
    lengths = (4, 2)
    shape = varlen.padded_shape(lengths, 128)
    real = varlen.visible_entries(lengths, False)
    padded_work = attention_flops(shape.batch, shape.heads, 4, 4, 128, False, "fwd")
    ms_padded = padded_work / 100e12 * 1e3
    ms_packed = attention_flops(shape.batch, shape.heads, 4, 4, 128, False, "fwd", visible=real) / 100e12 * 1e3
    records = [make_record(name, "fwd", "bfloat16", shape, False, times_ms=[ms], feature="test", visible=real)
               for name, ms in (("cuflash", ms_packed), ("cuflash-padded", ms_padded), ("torch-flash", ms_padded))]
    text = report.markdown({"gpu": "test"}, records, "varlen")
    assert "| cuflash | 100.0 |" in text and "| cuflash / torch-flash |" in text
    assert "| cuflash / cuflash-padded (padded work) | 1.00x |" in text


def test_the_readme_table_is_the_committed_grid():
    # the README's performance table is regenerated from the committed results (python -m bench.report --readme),
    # never edited by hand: a table that drifted from grid.json fails here
    _, records = read_json(REPO_ROOT / "bench" / "results" / "nvidia-h200" / "grid.json")
    assert report.readme_table(records) in (REPO_ROOT / "README.md").read_text()


def test_scaling_cells_fit_a_gpu_and_the_host():
    """Every GPU count up to the host's, shards no longer than MAX_TOKENS_PER_GPU; --quick: causal forward."""
    cells = scaling.scaling_cells(False, 8)
    assert {c[0] for c in cells} == {1, 2, 4, 8}
    assert all(tokens // gpus <= scaling.MAX_TOKENS_PER_GPU for gpus, tokens, _, _ in cells)
    assert (1, 1048576, True, "fwd") not in cells and (2, 1048576, True, "fwd") in cells
    assert {c[0] for c in scaling.scaling_cells(False, 3)} == {1, 2}
    assert scaling.scaling_cells(True, 8) == [(g, 524288, True, "fwd") for g in (1, 2, 4, 8)]
    assert "scaling" not in parse_args([]).suites and parse_args(["scaling"]).suites == ["scaling"]


def test_scaling_report_shows_rate_per_gpu_efficiency_and_moves(tmp_path):
    """Rates per GPU from the slowest rank's times; under the table, N GPUs over 1 GPU and the moves' share."""
    tokens = 131072
    assert scaling.slowest([[1.0, 5.0], [2.0, 3.0]]) == [2.0, 5.0]
    records = (scaling.records_of(1, tokens, True, "fwd", [100.0], None)
               + scaling.records_of(4, tokens, True, "fwd", [30.0], [25.0]))
    one, four, still = records
    assert four["impl"] == "4 GPUs" and still["impl"] == "4 GPUs, no moves"
    assert four["tflops"] == pytest.approx(one["tflops"] * 100 / 30 / 4)
    path = write_json(tmp_path / "scaling.json", make_header("scaling", False, gpu="test"), records)
    text = report.markdown(*read_json(path), "scaling")
    assert "| 4 GPUs / 1 GPU | 0.83 |" in text and "| 4 GPUs, moves | 0.17 |" in text
    report.write_reports(path)


def test_the_still_communicator_runs_the_rings_calls_without_moves():
    """The scaling suite's "no moves" runs: a rank of 4 runs every step's calls on its own buffers (their values
    unread by the timing) and returns its shard's shapes, alone, without waiting for other ranks."""
    import warnings

    from cuflash import distributed

    q = np.random.default_rng(0).standard_normal((1, 8, 2, 16)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # the receive buffers hold whatever was in memory
        out, lse = distributed.ring_attention(q, q, q, scaling.StillCommunicator(1, 4), causal=True, return_lse=True)
        grads = distributed.ring_attention_backward(q, q, q, q, out, lse, scaling.StillCommunicator(1, 4), causal=True)
    assert out.shape == q.shape and [g.shape for g in grads] == [q.shape] * 3


# Targets


def _timed(impl, shape, ms, causal=False, pass_="fwd", feature=""):
    return make_record(impl, pass_, "bfloat16", shape, causal, times_ms=[ms], feature=feature)


def test_a_target_is_judged_on_its_worst_point(tmp_path):
    """cuflash over the fastest peer at each cell both measured: met where every ratio reaches the bar, its worst
    point named; a cell only one side measured, or one the selection leaves out, counts for nothing."""
    other = Shape.square(batch=2, seqlen=4096, heads=16, head_dim=128)
    write_json(tmp_path / "grid.json", make_header("grid", False), [
        _timed("cuflash", SHAPE, 1.0), _timed("torch-flash", SHAPE, 2.0), _timed("torch-cudnn", SHAPE, 1.25),
        _timed("cuflash", other, 1.0), _timed("torch-cudnn", other, 0.5),
        _timed("cuflash", SHAPE, 1.0, causal=True),   # no peer there
        _timed("cuflash", SHAPE, 9.0, pass_="bwd"), _timed("torch-cudnn", SHAPE, 1.0, pass_="bwd")])
    fwd_only = targets.ratio_points("cuflash", ("torch-flash", "torch-cudnn"), lambda r: r["pass"] == "fwd")
    judged = targets.judge(tmp_path, (targets.Target(17, "fast", "grid", 0.9, fwd_only),
                                      targets.Target(17, "half as fast", "grid", 0.5, fwd_only),
                                      targets.Target(16, "decoding", "decode", 1.0, fwd_only)))
    fast, half, decoding = judged
    assert sorted(p.value for p in fast.points) == [0.5, 1.25]   # the fastest peer's time, cuDNN's 1.25 ms
    assert fast.met is False and fast.worst.value == 0.5 and "seqlen 4k" in fast.worst.where
    assert half.met is True
    assert decoding.met is None and decoding.missing == "no decode.json"
    table = targets.markdown(judged, tmp_path)
    assert "| 17 | fast | 0.9 | 2 | 0.50 |" in table and "no (1 below) |" in table
    assert "| 16 | decoding | 1 | 0 | | no decode.json | not measured |" in table


def test_a_point_from_a_disturbed_measurement_says_so(tmp_path):
    """A point whose subject or peer kept a median over DISTURBED_RATIO times its fastest repeat is marked in its
    place; steady repeats are not."""
    other = Shape.square(batch=2, seqlen=4096, heads=16, head_dim=128)
    shaky = make_record("cuflash", "fwd", "bfloat16", SHAPE, False, times_ms=[1.0, 1.6, 1.7])
    peer_shaky = make_record("torch-cudnn", "fwd", "bfloat16", other, False, times_ms=[1.0, 1.5, 1.5])
    write_json(tmp_path / "grid.json", make_header("grid", False), [
        shaky, _timed("torch-cudnn", SHAPE, 1.0), _timed("cuflash", other, 1.0), peer_shaky,
        make_record("cuflash", "fwd", "bfloat16", SHAPE, True, times_ms=[1.0, 1.05, 1.08]),
        make_record("torch-cudnn", "fwd", "bfloat16", SHAPE, True, times_ms=[1.0, 1.0, 1.0])])
    (verdict,) = targets.judge(tmp_path, (targets.Target(17, "fast", "grid", 1.0,
                                                         targets.ratio_points("cuflash", ("torch-cudnn",))),))
    marked = {p.where.endswith("(disturbed)") for p in verdict.points if "causal" not in p.where}
    assert marked == {True} and len(verdict.points) == 3
    (steady,) = [p for p in verdict.points if "causal" in p.where]
    assert not steady.where.endswith("(disturbed)")


def test_feature_targets_compare_with_plain_causal_on_visible_entries(tmp_path):
    """A feature's ratio is its TFLOP/s (visible entries) over plain causal's at the same shape and pass."""
    causal = make_record("cuflash", "fwd", "bfloat16", SHAPE, True, times_ms=[1.0], feature="causal")
    window = make_record("cuflash", "fwd", "bfloat16", SHAPE, True, times_ms=[0.5], feature="window1024",
                         visible=SHAPE.seqlen_q * 300)
    write_json(tmp_path / "features.json", make_header("features", False), [causal, window])
    target = targets.Target(15, "window", "features", 0.85, targets._feature_ratio("window1024"))
    (verdict,) = targets.judge(tmp_path, (target,))
    assert verdict.points[0].value == pytest.approx(window["tflops"] / causal["tflops"])
    assert not targets.judge(tmp_path, (targets.Target(15, "long", "features", 0.85,
                                                        targets._feature_ratio("window1024", 8192)),))[0].points


def test_the_committed_results_are_judged_for_every_target():
    verdicts = targets.judge(REPO_ROOT / targets.DEFAULT_RESULTS)
    assert len(verdicts) == len(targets.TARGETS)
    for verdict in verdicts:
        assert verdict.points or verdict.missing, verdict.target.promise
    done = run_cli("bench.targets")
    assert done.returncode == 0, done.stderr
    assert sum(line.startswith("| 1") for line in done.stdout.splitlines()) == len(targets.TARGETS)
    assert run_cli("bench.targets", "no/such/folder").returncode == 2
