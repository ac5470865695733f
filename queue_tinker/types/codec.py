"""Compact binary payloads: msgpack, with numpy arrays carried as raw bytes.

The one wire encoding of op bodies and results: the client and the gateway encode, the queue
carries the bytes, the worker decodes. It lives with the types because every layer speaks it
and it needs nothing of ours (the engines decode bodies without knowing Redis)."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

_NDARRAY = 1  # msgpack extension type code


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        header = msgpack.packb([obj.dtype.str, list(obj.shape)])
        return msgpack.ExtType(_NDARRAY, header + np.ascontiguousarray(obj).tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__}")


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _NDARRAY:
        return msgpack.ExtType(code, data)
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(data)
    dtype, shape = unpacker.unpack()
    offset = unpacker.tell()
    return np.frombuffer(data, dtype=np.dtype(dtype), offset=offset).reshape(shape)


def encode(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def decode(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
