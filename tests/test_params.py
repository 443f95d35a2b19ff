"""The kernels' parameter lists as Python reads them (cuflash._params) and the arguments the GPU path
builds from them by name, on the CPU: the lists are the compiled kernels' own, and every plan names each
field exactly once."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cuflash import _config, _cupy_path, _params, _plan
from cuflash._config import BFLOAT16
from cuflash._validate import CacheProblem

from .test_plan import problem

#: a type equality NVRTC can check without the standard headers it lacks
SAME = ("template <class A, class B> struct same_type { static constexpr bool value = false; };\n"
        "template <class A> struct same_type<A, A> { static constexpr bool value = true; };\n")


def cpp_parameter_types(field_list, element: str) -> str:
    """The C++ parameter types of ``field_list`` (as the macro writes them), T being ``element``."""
    return ", ".join(f"{f.ctype.replace('T', element)}*" if f.pointer else f.ctype for f in field_list)


def test_the_field_lists_are_the_kernels_parameter_lists():
    # the kernel's function type, spelled from the fields Python read, is the compiled kernel's own: the
    # same parameters, types and order (the names come from the same list)
    from cuflash._compile import _nvrtc_compile, kernel_source

    mma_only = dataclasses.replace(_config.H100, tensor_maps=False)
    forward = _config.choose_config(64, BFLOAT16, _config.MASK_CAUSAL, mma_only).forward
    simt = _config.choose_config(64, np.dtype(np.float32), _config.MASK_CAUSAL, _config.H100).forward
    hopper = _config.choose_config(64, BFLOAT16, _config.MASK_CAUSAL, _config.H100).forward
    # fwd_wgmma: maps of q, k, v, its work counter and item order, then the fields
    maps = "const cuflash::TmaMap, " * 3 + "int *, const int *, "
    checks = [f"static_assert(same_type<decltype(&{spec.name}), void (*)({head}{cpp_parameter_types(fields, t)})>"
              f"::value, \"{spec.kernel}\");" for spec, head, fields, t in
              ((forward, "", _params.forward_fields(), "__nv_bfloat16"), (simt, "", _params.forward_fields(), "float"),
               (hopper, maps, _params.forward_fields(), "__nv_bfloat16"))]
    _nvrtc_compile(SAME + kernel_source("fwd_mma.cu") + "\n" + checks[0] + "\n", "sm_90", [])
    _nvrtc_compile(SAME + kernel_source("simt.cu") + "\n" + checks[1] + "\n", "sm_90", [])
    assert hopper.kernel == "fwd_wgmma"
    _nvrtc_compile(SAME + kernel_source("fwd_wgmma.cu") + "\n" + checks[2] + "\n", "sm_90a", [])
    # the Hopper dK/dV kernel: the tensor maps of q, k, v and dout, then the backward's fields
    hopper_dkdv = _config.choose_config(128, BFLOAT16, _config.MASK_CAUSAL, _config.H100).bwd_dkdv_wgmma
    types = "const cuflash::TmaMap, " * 4 + cpp_parameter_types(_params.backward_fields(), "__nv_bfloat16")
    _nvrtc_compile(SAME + kernel_source("bwd_wgmma.cu") + "\n" + f"static_assert(same_type<decltype(&{hopper_dkdv.name}), "
                   f"void (*)({types})>::value, \"bwd_dkdv_wgmma\");\n", "sm_90a", [])
    cfg = _config.choose_config(128, BFLOAT16, _config.MASK_WINDOW, _config.H100, _config.MOD_DROPOUT)
    backward = [cfg.bwd_dkdv[0], cfg.bwd_dkdv_atomic[0], cfg.bwd_dq]
    checks = [f"static_assert(same_type<decltype(&{spec.name}), "
              f"void (*)({cpp_parameter_types(_params.backward_fields(), '__nv_bfloat16')})>::value, \"{spec.kernel}\");"
              for spec in backward]
    _nvrtc_compile(SAME + kernel_source("bwd_mma.cu") + "\n" + "\n".join(checks) + "\n",
                   "sm_90", [])
    # and the check fails on a list one field off
    wrong = cpp_parameter_types(_params.forward_fields()[:-1], "__nv_bfloat16")
    with pytest.raises(RuntimeError, match="fwd_mma off by one"):
        _nvrtc_compile(SAME + kernel_source("fwd_mma.cu") + "\n"
                       f"static_assert(same_type<decltype(&{forward.name}), void (*)({wrong})>::value, "
                       "\"fwd_mma off by one\");\n", "sm_90", [])


def test_the_lists_read_from_the_source():
    forward, backward = _params.forward_fields(), _params.backward_fields()
    assert [f.name for f in forward[:9]] == ["q", "k", "v", "out", "lse", "alibi_slopes", "sinks", "dropout_seed",
                                            "dropout_offset"]
    assert forward[-1].name == "section_heads" and backward[-2:][0].name == "dq_splits"
    assert {f.name for f in forward if f.pointer} == {"q", "k", "v", "out", "lse", "alibi_slopes", "sinks",
                                                     "cache_seqlens", "block_table", "cache_leftpad", "out_partial",
                                                     "lse_partial", "split_counters", "cu_seqlens_q", "cu_seqlens_k",
                                                     "q_descale", "k_descale", "v_descale"}
    assert _params.fields("CUFLASH_BWD_FIELDS")[9] == _params.Field("dq_accum", "float", True)
    assert dict((f.name, f.dtype) for f in forward)["dropout_threshold"] == np.uint32
    with pytest.raises(RuntimeError, match="no field list"):
        _params.fields("CUFLASH_NO_FIELDS")


@pytest.mark.parametrize("options", [{}, dict(softcap=30.0, alibi_shape=(2, 8), dropout_p=0.25),
                                     dict(window_left=100, causal=False)])
def test_a_plan_names_every_field_once(options):
    # the fixed fields a plan gives (_cupy_path) and the per-call ones cover each kernel's list exactly,
    # each value lands in its field's place and in its field's C type
    p = problem(**options)
    launch = _plan.forward(p, _config.H100)
    fields = _params.forward_fields()
    strides = [(1, 2, 3), (4, 5, 6), (7, 8, 9), (10, 11, 12)]
    fixed = {**_cupy_path._stride_fields(q=strides[0], k=strides[1], v=strides[2], o=strides[3]),
             **_cupy_path._problem_fields(p), **_cupy_path._tail_fields(fields, launch.tail),
             **_cupy_path.NO_CACHE_FIELDS, **_cupy_path.NO_FLOAT8_FIELDS, **_cupy_path.DENSE_FIELDS}
    per_call = [f"<{name}>" for name in _cupy_path.FORWARD_PER_CALL]
    args = dict(zip([f.name for f in fields], _params.Arguments(fields, fixed, _cupy_path.FORWARD_PER_CALL)(tuple(per_call))))
    assert [args[name] for name in _cupy_path.FORWARD_PER_CALL] == per_call
    assert args["k_ss"] == 5 and type(args["k_ss"]) is np.int64 and args["o_sh"] == 12
    assert args["seqlen_q"] == p.seqlen_q and type(args["seqlen_q"]) is np.int32
    assert args["section_heads"] == launch.tail[0]
    assert type(args["dropout_threshold"]) is np.uint32 and type(args["softcap_in"]) is np.float32
    assert args["alibi_batch_stride"] == (8 if options.get("alibi_shape") else 0)
    # a packed batch's forward: the prefix sums per call, after the others
    packed_fixed = {name: value for name, value in fixed.items() if name not in _cupy_path.DENSE_FIELDS}
    per_call = _cupy_path.FORWARD_PER_CALL + _cupy_path.PACKED_PER_CALL
    args = dict(zip([f.name for f in fields], _params.Arguments(fields, packed_fixed, per_call)(per_call)))
    assert all(args[name] == name for name in per_call)

    backward = _params.backward_fields()
    fixed = {**_cupy_path._stride_fields(q=strides[0], k=strides[1], v=strides[2], do=strides[3], dq=(0, 0, 0),
                                         dk=(0, 0, 0)), **_cupy_path._problem_fields(p), "scale": p.softmax_scale}
    packed_fixed = dict(fixed)
    fixed.update(_cupy_path.DENSE_FIELDS)
    for launch in _plan.backward(p, _config.H100, deterministic=True).dkdv:
        arguments = _params.Arguments(backward, {**fixed, **_cupy_path._tail_fields(backward, launch.tail)},
                                      _cupy_path.BACKWARD_PER_CALL)
        args = dict(zip([f.name for f in backward], arguments(_cupy_path.BACKWARD_PER_CALL)))
        assert (args["dq_splits"], args["dq_pass"]) == launch.tail and args["do_ss"] == 11
        assert args["scale"] == np.float32(p.softmax_scale) and args["dq_accum"] == "dq_accum"
        # a packed batch's plan passes the prefix sums per call, after the others
        per_call = _cupy_path.BACKWARD_PER_CALL + _cupy_path.PACKED_PER_CALL
        arguments = _params.Arguments(backward, {**packed_fixed, **_cupy_path._tail_fields(backward, launch.tail)},
                                      per_call)
        args = dict(zip([f.name for f in backward], arguments(per_call)))
        assert args["cu_seqlens_q"] == "cu_seqlens_q" and args["cu_seqlens_k"] == "cu_seqlens_k"


def test_arguments_refuse_an_incomplete_or_unknown_list():
    fields = (_params.Field("x", "const T", True), _params.Field("n", "int", False),
              _params.Field("s", "float", False))
    assert _params.Arguments(fields, {"n": 3, "s": 0.5}, ("x",))(("ptr",)) == ("ptr", 3, 0.5)
    for fixed, per_call, message in (({"n": 3}, ("x",), r"missing \['s'\]"),
                                     ({"n": 3, "s": 1, "t": 2}, ("x",), r"unknown fields \['t'\]"),
                                     ({"n": 3, "s": 1, "x": 0}, ("x",), r"given twice \['x'\]")):
        with pytest.raises(ValueError, match=message):
            _params.Arguments(fields, fixed, per_call)
    with pytest.raises(ValueError):  # a call gives exactly the per-call values
        _params.Arguments(fields, {"n": 3, "s": 0.5}, ("x",))(("ptr", "extra"))


@pytest.mark.parametrize("lengths", ["array", "int"])
def test_a_kvcache_plan_names_every_field_once(lengths):
    # the KV-cache forward's fixed and per-call fields cover the list exactly; the plan's packing and splits
    # land in their fields
    attn = problem(batch=3, seqlen_q=1, seqlen_k=4096, heads=32, heads_kv=8, head_dim=128)
    p = CacheProblem(attn, page_size=256, num_pages=100, seqlen_new=1, lengths=lengths)
    plan = _plan.kvcache(p, _config.H100)
    fields = _params.forward_fields()
    strides = [(1, 2, 3), (4, 5, 6), (7, 8, 9), (10, 11, 12)]
    fixed = _cupy_path.kvcache_fixed_fields(p, plan, strides, table_stride=16)
    per_call = tuple(f"<{name}>" for name in _cupy_path.KVCACHE_PER_CALL)
    args = dict(zip([f.name for f in fields], _params.Arguments(fields, fixed, _cupy_path.KVCACHE_PER_CALL)(per_call)))
    assert [args[name] for name in _cupy_path.KVCACHE_PER_CALL] == list(per_call)
    assert (args["pack"], args["num_splits"], args["page_size"]) == (4, plan.splits, 256)
    assert args["block_table_stride"] == 16
    assert args["seqlen_k_new"] == 1 and type(args["block_table_stride"]) is np.int64 and args["k_sb"] == 4


def test_merge_arguments_follow_the_kernels_list(monkeypatch):
    # merge_parts(outs, lses, out, lse, sinks, o_sb, o_ss, o_sh, parts, batch, seqlen_q, heads, head_dim): the
    # trailing values after its five pointers, for a contiguous out of (batch, seqlen_q, heads, head_dim). With
    # CuPy the values are its own argument objects, which do not compare as numbers: built here as without it.
    monkeypatch.setattr(_cupy_path, "_CNumpyArray", None)
    args = _cupy_path._merge_args((2, 3, 4, 5), 7)
    assert args == (60, 20, 5, 7, 2, 3, 4, 5)
    assert [np.dtype(type(a)) for a in args] == [np.dtype(np.int64)] * 3 + [np.dtype(np.int32)] * 5
