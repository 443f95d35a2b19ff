"""The kernels' parameter lists, read from their one definition: the X-macros ``CUFLASH_FWD_FIELDS`` and
``CUFLASH_BWD_FIELDS`` in kernels/common.cuh, from which the kernels' own parameter lists are generated.

``Arguments`` builds a launch's argument tuple by field name: the values fixed for a plan converted once
to their C types, the per-call ones (pointers, the dropout seed) put in their places at each call. A
field neither fixed nor named per call, or a name the list does not have, is an error when the plan is
made, not a wrong argument in a launch.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import re
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ._compile import KERNEL_DIR

#: C types of value fields -> their NumPy dtypes (a pointer field takes a device array or a null pointer)
C_TYPES = {"unsigned long long": np.uint64, "unsigned": np.uint32, "long long": np.int64, "int": np.int32,
           "float": np.float32}

_FIELD = re.compile(r"\b(PTR|VAL|LAST)\(\s*([^,()]+?)\s*,\s*(\w+)\s*\)")


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    ctype: str  # the pointee's type for a pointer (as written: "const T", "float")
    pointer: bool

    @property
    def dtype(self) -> np.dtype | None:
        """A value field's NumPy dtype; None for a pointer."""
        return None if self.pointer else np.dtype(C_TYPES[self.ctype])


@functools.lru_cache(maxsize=None)
def fields(macro: str) -> tuple[Field, ...]:
    """The fields of the X-macro ``macro`` of kernels/common.cuh, in the kernels' parameter order."""
    text = (KERNEL_DIR / "common.cuh").read_text()
    match = re.search(rf"#define {macro}\(PTR, VAL, LAST\)((?:.*\\\n)*.*\n)", text)
    if match is None:
        raise RuntimeError(f"no field list {macro} in kernels/common.cuh")
    found = tuple(Field(name, ctype, kind == "PTR") for kind, ctype, name in _FIELD.findall(match.group(1)))
    unknown = [f for f in found if not f.pointer and f.ctype not in C_TYPES]
    if unknown or not found or len({f.name for f in found}) != len(found):
        raise RuntimeError(f"{macro}: unreadable field list (unknown types {unknown})")
    return found


def forward_fields() -> tuple[Field, ...]:
    """fwd_mma's and fwd_simt's parameters."""
    return fields("CUFLASH_FWD_FIELDS")


def backward_fields() -> tuple[Field, ...]:
    """The parameters of the backward's attention kernels (dK/dV, dQ; tensor-core and SIMT)."""
    return fields("CUFLASH_BWD_FIELDS")


def _numpy_scalar(value, dtype):
    return np.dtype(dtype).type(value)


class Arguments:
    """A kernel's argument tuple by field name.

    Parameters
    ----------
    field_list : the kernel's fields (``forward_fields()``, ``backward_fields()``).
    fixed : the value of every field that is the same for each call of a plan; value fields are converted
        to their C type by ``convert(value, dtype)`` once, here (pointer fields are taken as they are).
    per_call : the names of the other fields, in the order a call passes their values.
    convert : value -> the object the launch takes for a field of that dtype (default: a NumPy scalar).

    ``arguments(values)`` is the launch's argument tuple, ``values`` a tuple in ``per_call``'s order.
    """

    __slots__ = ("_fixed", "_pick", "per_call")

    def __init__(self, field_list: Sequence[Field], fixed: Mapping[str, object], per_call: Sequence[str],
                 convert: Callable[[object, np.dtype], object] = _numpy_scalar):
        names = [f.name for f in field_list]
        unknown = sorted((set(fixed) | set(per_call)) - set(names))
        both = sorted(set(fixed) & set(per_call))
        missing = [name for name in names if name not in fixed and name not in per_call]
        if unknown or both or missing or len(set(per_call)) != len(per_call):
            raise ValueError(f"kernel arguments: unknown fields {unknown}, given twice {both}, "
                             f"missing {missing}")
        fixed_fields = [f for f in field_list if f.name not in per_call]
        self._fixed = tuple(fixed[f.name] if f.pointer else convert(fixed[f.name], f.dtype) for f in fixed_fields)
        # a call's values followed by the fixed ones, picked into field order (one C-level pass: the call
        # costs a tuple concatenation and an itemgetter, about half a microsecond)
        position = {name: i for i, name in enumerate(per_call)}
        position.update({f.name: len(per_call) + i for i, f in enumerate(fixed_fields)})
        self._pick = operator.itemgetter(*(position[name] for name in names))
        self.per_call = tuple(per_call)

    def __call__(self, values: tuple) -> tuple:
        if len(values) != len(self.per_call):
            raise ValueError(f"kernel arguments: {len(values)} per-call values for {self.per_call}")
        return self._pick(values + self._fixed)
