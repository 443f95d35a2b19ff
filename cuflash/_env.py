"""What this machine offers cuflash: the GPU (or why there is none) and the versions of what it runs on."""

from __future__ import annotations

import os
import pathlib

#: the namespace of every cuflash kernel as it appears, mangled, in a compiled binary
_KERNEL_SYMBOL = b"_ZN7cuflash"


def gpu_unavailable_reason() -> str | None:
    """None when CuPy sees a CUDA device, else why not (no CuPy, no usable driver, no device)."""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install cupy-cuda12x or cupy-cuda13x)"
    runtime = cupy.cuda.runtime
    try:
        count = runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError: no driver, a driver too old for this CuPy, no device node
        if _driver_version(runtime) == 0:
            return "no CUDA driver is installed"
        return f"CUDA is not usable ({exc})"
    return None if count else "no CUDA device is visible"


def _driver_version(runtime) -> int:
    """The CUDA version the installed driver supports (e.g. 13000), 0 where there is no driver."""
    try:
        return runtime.driverGetVersion()
    except Exception:  # a CuPy whose driver query itself fails where no driver is loaded
        return 0


def _version(run) -> str:
    try:
        return run()
    except Exception as exc:  # a library that is missing or fails to load: say which and why
        return f"unavailable ({type(exc).__name__}: {exc})"


def _cuda_version(number: int) -> str:
    return f"{number // 1000}.{number % 1000 // 10}"


def kernel_cache_dir() -> pathlib.Path:
    """Where CuPy keeps compiled kernels (``CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``)."""
    return pathlib.Path(os.environ.get("CUPY_CACHE_DIR", "~/.cupy/kernel_cache")).expanduser()


def cached_kernel_files(cache_dir: pathlib.Path) -> int:
    """Files in CuPy's kernel cache that hold a cuflash kernel (one specialization each, for any GPU and
    any cuflash version)."""
    if not cache_dir.is_dir():
        return 0
    return sum(1 for f in cache_dir.iterdir() if f.is_file() and _KERNEL_SYMBOL in f.read_bytes())


def _nccl_line() -> str:
    """Whether CuPy's NCCL bindings load (ring attention over GPUs, cuflash.distributed, needs them)."""
    try:
        from cupy.cuda import nccl
    except Exception as error:  # a CuPy built without NCCL, or a library that does not load
        return f"not available ({type(error).__name__}): cuflash.distributed runs on local groups only"
    if not nccl.available:
        return ("not available (install NCCL: the nvidia-nccl-cu12 or -cu13 wheel): cuflash.distributed runs on local "
                "groups only")
    return _version(lambda: f"{nccl.get_version()} (cuflash.distributed across GPUs)")


def report() -> list[tuple[str, str]]:
    """(what, value) lines for ``python -m cuflash info``."""
    import ml_dtypes
    import numpy

    import cuflash

    from . import _compile

    lines = [("cuflash", f"{cuflash.__version__} ({pathlib.Path(cuflash.__file__).parent})"),
             ("numpy", numpy.__version__), ("ml_dtypes", ml_dtypes.__version__)]
    try:
        import cupy
    except ImportError:
        cupy = None
    lines.append(("cupy", cupy.__version__ if cupy else "not installed"))
    if cupy is not None:
        runtime = cupy.cuda.runtime
        driver = _driver_version(runtime)
        lines += [("CUDA driver", _cuda_version(driver) if driver else "none installed"),
                  ("CUDA runtime", _version(lambda: _cuda_version(runtime.runtimeGetVersion()))),
                  ("NVRTC", _version(lambda: _compile.describe_nvrtc(cupy.cuda.nvrtc.getVersion()))),
                  ("NCCL", _nccl_line())]
    reason = gpu_unavailable_reason()
    specs = None
    if reason is None:
        from . import _config, _cupy_path

        device = cupy.cuda.Device()
        props = _cupy_path.device_props(device.id)
        name = runtime.getDeviceProperties(device.id)["name"]
        name = name.decode() if isinstance(name, bytes) else name
        lines.append(("GPU", f"{name}, compute capability {props.compute_capability / 10:.1f}, device {device.id} "
                             f"of {runtime.getDeviceCount()}"))
        if props.compute_capability == 90:  # the Hopper forward needs tensor maps, which cuda-bindings encodes
            lines.append(("Hopper kernels", "on (TMA tensor maps through cuda-bindings)" if props.tensor_maps else
                          "off: they need cuda-bindings (pip install cuda-bindings) and NVRTC 12.9 or newer; "
                          "the mma.sync kernels run"))
        specs = len(_config.all_specs(props))
    else:
        lines.append(("GPU", f"no GPU: {reason}"))
    cache = kernel_cache_dir()
    compiled = f"{cached_kernel_files(cache)} files hold cuflash kernels"
    if specs is not None:
        compiled += f"; this GPU uses {specs} specializations (python -m cuflash warmup compiles them all)"
    lines.append(("kernel cache", f"{cache} ({compiled})"))
    return lines
