"""``python -m bench.probe '<json>'``: time the first attention call of a fresh process.

Run by the compile suite in a subprocess whose ``CUPY_CACHE_DIR`` it chooses; prints ``{"ms": ...}``.
The JSON argument holds ``impl`` ("cuflash" or "naive-cupy"), ``shape`` (the fields of
:class:`bench.records.Shape`), ``dtype`` and ``causal``.
"""

from __future__ import annotations

import json
import sys
import time


def main(argv: list[str]) -> None:
    import cupy
    import ml_dtypes  # noqa: F401  (registers the "bfloat16" dtype name with NumPy)
    import numpy as np

    spec = json.loads(argv[0])
    shape, causal = spec["shape"], spec["causal"]
    rng = np.random.default_rng(0)
    # Host-generated inputs: generating them on the device would compile CuPy kernels into the very
    # cache whose cold state is being measured.
    q_shape = (shape["batch"], shape["seqlen_q"], shape["heads"], shape["head_dim"])
    kv_shape = (shape["batch"], shape["seqlen_k"], shape["heads_kv"], shape["head_dim"])
    q, k, v = (cupy.asarray(rng.standard_normal(s, dtype=np.float32).astype(spec["dtype"]))
               for s in (q_shape, kv_shape, kv_shape))
    device = cupy.cuda.Device()
    device.synchronize()
    if spec["impl"] == "cuflash":
        import cuflash

        started = time.perf_counter()
        cuflash.attention(q, k, v, causal=causal)
    else:
        from bench import naive

        started = time.perf_counter()
        naive.forward(q, k, v, causal)
    device.synchronize()
    print(json.dumps({"ms": (time.perf_counter() - started) * 1e3}))


if __name__ == "__main__":
    main(sys.argv[1:])
