"""Benchmarks of cuflash against a materialized CuPy baseline and PyTorch's SDPA backends.

Run ``python -m bench --help``. Pure modules (``flops``, ``records``, ``report``, ``accuracy``,
``naive`` and the cell lists of ``suites``) import without CuPy or PyTorch; ``impls``, ``timing``
and the suite runners import them lazily.
"""
