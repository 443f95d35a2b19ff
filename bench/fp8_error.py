"""The float8 forward's error against the bfloat16 forward and the exact attention, on ordinary and outlier-heavy
inputs, with and without the Hadamard rotation (FlashAttention-3's incoherent processing).

``python -m bench.fp8_error [--out DIR] [--model]`` writes ``DIR/<source>/fp8_error.{json,md}`` and prints the
table. On a CUDA GPU (compute capability 9.0, where the float8 kernel runs) the float8 rows are the kernel's
outputs and the bfloat16 row is cuflash's bfloat16 forward on the GPU; elsewhere, or with ``--model``, the float8
rows come from ``reference.attention_float8_in_dtype``, the reference's model of the kernel's arithmetic (q.k
summed as the e4m3 tensor cores sum it, P rounded to e4m3), and the bfloat16 row from the NumPy path; the
source folder is then ``model``.

Every case draws q, k and v of shape SHAPE in float64 and rounds them to bfloat16: those are the inputs of the
bfloat16 forward, and what ``cuflash.quantize_qkv`` quantizes (per tensor, or per (batch, kv head) with and
without ``hadamard=True``). The errors are of ``out``, against ``reference.attention`` of the bfloat16 inputs in
float64 ("exact") and against the bfloat16 forward's output: the root mean square of the difference (RMSE, the
measure FlashAttention-3 reports), that over the RMS of the exact output, and the largest difference.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import ml_dtypes
import numpy as np

import cuflash
from cuflash import reference
from cuflash._env import gpu_unavailable_reason

from .records import make_header, results_dir, write_json

DEFAULT_OUT = "bench/results"
#: (batch, seqlen, heads, head_dim): head_dim 128, the float8 kernel's
SHAPE = (2, 1024, 4, 128)
#: FlashAttention-3's outlier entries (its paper, section 4.3): N(0, 1) + N(0, 100) * Bernoulli(0.001)
OUTLIER_PROBABILITY, OUTLIER_STD = 1e-3, 10.0
#: outlier channels, as in the activations of large language models: these many of q's and k's channels are
#: OUTLIER_CHANNEL_GAIN times the rest
OUTLIER_CHANNELS, OUTLIER_CHANNEL_GAIN = 4, 30.0
CASES = ("normal", "outlier entries", "outlier channels")
#: (row name, quantize_qkv's granularity (None: the bfloat16 forward), hadamard)
METHODS = (("bfloat16 forward", None, False),
           ("float8, one factor per tensor", "tensor", False),
           ("float8, per (batch, kv head)", "head", False),
           ("float8, per (batch, kv head), Hadamard", "head", True))


def make_inputs(case: str, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """q, k, v (SHAPE, bfloat16 NumPy arrays) of ``case``: standard normal; plus FlashAttention-3's outlier
    entries in all three; or q's and k's first OUTLIER_CHANNELS channels OUTLIER_CHANNEL_GAIN times the rest,
    both scaled so that q.k / sqrt(head_dim) keeps unit variance."""
    q, k, v = (rng.standard_normal(SHAPE) for _ in range(3))
    if case == "outlier entries":
        for x in (q, k, v):
            x += OUTLIER_STD * rng.standard_normal(SHAPE) * (rng.random(SHAPE) < OUTLIER_PROBABILITY)
    elif case == "outlier channels":
        gain = np.ones(SHAPE[-1])
        gain[:OUTLIER_CHANNELS] = OUTLIER_CHANNEL_GAIN
        gain /= ((gain**4).sum() / SHAPE[-1]) ** 0.25   # the variance of q.k / sqrt(head_dim) is sum(gain^4) / d
        q, k = q * gain, k * gain
    return tuple(x.astype(ml_dtypes.bfloat16) for x in (q, k, v))


def kernel_available() -> bool:
    """Whether this machine runs the float8 kernel at SHAPE's head dim: the plan's test
    (``_config.float8_forward_spec``: compute capability 9.0 with tensor maps) on the current device."""
    if gpu_unavailable_reason() is not None:
        return False
    import cupy

    from cuflash import _config, _cupy_path

    device = _cupy_path.device_props(cupy.cuda.Device().id)
    return _config.float8_forward_spec(SHAPE[-1], _config.MASK_NONE, device) is not None


def forward(method: tuple, q, k, v, on_gpu: bool) -> np.ndarray:
    """out (float64 NumPy) of one METHODS entry on bfloat16 q, k, v: on the GPU, cuflash's kernels; on the host,
    the NumPy path (bfloat16) or the reference's model of the float8 kernel."""
    _, granularity, hadamard = method
    if granularity is None:
        if on_gpu:
            import cupy

            q, k, v = (cupy.asarray(x.astype(np.float32)).astype("bfloat16") for x in (q, k, v))
            return cuflash.attention(q, k, v).astype(cupy.float64).get()
        return cuflash.attention(q, k, v).astype(np.float64)
    q8, k8, v8, *descales = cuflash.quantize_qkv(q, k, v, granularity, hadamard=hadamard)
    if on_gpu:
        import cupy

        q8, k8, v8 = (cupy.asarray(x.view(np.uint8)) for x in (q8, k8, v8))   # quantize_qkv's bits on either
        q_descale, k_descale, v_descale = (cupy.asarray(d) for d in descales)
        out = cuflash.attention(q8, k8, v8, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
        return out.astype(cupy.float64).get()
    out, _ = reference.attention_float8_in_dtype(q8, k8, v8, False, None, *descales)
    return out.astype(np.float64)


def errors(out: np.ndarray, exact: np.ndarray, bfloat16: np.ndarray) -> dict:
    """The RMSE against the exact and the bfloat16 outputs, the first over the exact output's RMS, and the
    largest difference from the exact output."""
    def rms(x):
        return float(np.sqrt(np.mean(x**2)))

    error = out - exact
    return {"rmse_exact": rms(error), "rmse_bfloat16": rms(out - bfloat16),
            "relative_rmse_exact": rms(error) / rms(exact), "max_error_exact": float(abs(error).max())}


def measure(on_gpu: bool, seed: int = 0) -> list[dict]:
    """A record per (case, method)."""
    rng = np.random.default_rng(seed)
    records = []
    for case in CASES:
        q, k, v = make_inputs(case, rng)
        exact, _ = reference.attention(*(x.astype(np.float64) for x in (q, k, v)))
        outs = {method: forward(method, q, k, v, on_gpu) for method in METHODS}
        bfloat16 = outs[METHODS[0]]
        for method, out in outs.items():
            print(f"fp8_error: {case}, {method[0]}", file=sys.stderr)
            records.append({"case": case, "method": method[0], **errors(out, exact, bfloat16)})
    return records


def table(records: list[dict]) -> str:
    """The records as a Markdown table."""
    lines = ["| inputs | forward | RMSE vs exact | RMSE / RMS(exact) | max error vs exact | RMSE vs bfloat16 |",
             "|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['case']} | {r['method']} | {r['rmse_exact']:.2e} | {r['relative_rmse_exact']:.2%} | "
                     f"{r['max_error_exact']:.2e} | {r['rmse_bfloat16']:.2e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fp8_error", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                        help=f"results folder; files go to DIR/<gpu or 'model'>/ (default: {DEFAULT_OUT})")
    parser.add_argument("--model", action="store_true",
                        help="the reference's model of the float8 kernel, even where the kernel runs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    on_gpu = not args.model and kernel_available()
    if on_gpu:   # the GPU and the versions, as the benchmark suites' headers have them
        from .impls import environment

        versions = environment()
        source = versions["gpu"]
    else:
        versions, source = {"cuflash": cuflash.__version__}, "model"
    records = measure(on_gpu, args.seed)
    header = make_header("fp8_error", False, source=source, shape=list(SHAPE), seed=args.seed, **versions)
    folder = results_dir(args.out, source)
    write_json(folder / "fp8_error.json", header, records)
    text = (f"float8 forward error, {source}: q, k, v {SHAPE} (batch, seqlen, heads, head_dim), "
            f"rounded to bfloat16; seed {args.seed}\n\n" + table(records))
    (folder / "fp8_error.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
