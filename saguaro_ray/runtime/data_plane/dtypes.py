"""The dtype names data-plane descriptors carry.

A :class:`~saguaro_ray.runtime.data_plane.refs.TensorRef` or
:class:`~saguaro_ray.runtime.data_plane.refs.KVDeltaRef` names its dtype as a
string so that it can ride a control frame. The names allowed are the wire
codec's, one list for tensors inline in a frame and tensors sent over the
data plane, so a descriptor can never name a dtype the frames would refuse.
"""

from __future__ import annotations

import torch

from saguaro_ray.runtime.wire import DTYPE_NAMES, DTYPES


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a tensor dtype (what descriptors carry)."""
    name = DTYPE_NAMES.get(dtype)
    if name is None:
        raise ValueError(f"dtype {dtype} cannot travel over the data plane; allowed: {', '.join(DTYPES)}")
    return name


def wire_dtype(name: str) -> torch.dtype:
    """The dtype a descriptor's wire name stands for (a ValueError for any other name)."""
    dt = DTYPES.get(name)
    if dt is None:
        raise ValueError(f"unknown data-plane dtype {name!r}; allowed: {', '.join(DTYPES)}")
    return dt


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A dtype given either way (callers of the plane may pass the wire name)."""
    return wire_dtype(dtype) if isinstance(dtype, str) else dtype
