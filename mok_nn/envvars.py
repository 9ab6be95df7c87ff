"""Reading the MOK_* switches on the host path of every call.

A forward reads its switches (MOK_GEMM, MOK_ACT, and with expert parallelism MOK_EP_COPY) on every call,
most often unset, and `os.environ.get` of an unset variable costs about 2 us: `_Environ.__getitem__` raises KeyError and
`Mapping.get` catches it. Where the GPU waits for the host (the benchmark times each call from an
idle GPU, and the qwen3 forward's start is host-bound) those microseconds are the layer's time.

`getenv` reads the same mapping without the exception: CPython's `os.environ` keeps the encoded
variables in `os.environ._data`, updated by every assignment to `os.environ` (monkeypatch.setenv
included), so a switch set at run time is seen by the next call, as before. Where that mapping is
not there (another Python, Windows, an `os.environ` replaced by a plain dict) it falls back to
`os.environ.get`.
"""

from __future__ import annotations

import os

_ENCODED: dict = {}  # variable name -> its key in os.environ._data


def getenv(var: str, default: object = "") -> object:
    """os.environ.get(var, default), without raising and catching KeyError for an unset variable: the
    variable's value (a str) where it is set, else default unchanged (whatever its type)."""
    data = getattr(os.environ, "_data", None)
    if os.name != "posix" or not isinstance(data, dict):
        return os.environ.get(var, default)
    key = _ENCODED.get(var)
    if key is None:
        key = _ENCODED[var] = os.fsencode(var)
    value = data.get(key)
    return default if value is None else os.fsdecode(value)
