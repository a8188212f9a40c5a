"""One reader for every JSON card, profile and baseline an artifact folder holds (JSONL data files
have theirs in specee.data): a file that is missing, empty, truncated, not JSON, lacks a key or
holds a value of the wrong shape is one SpeceeError naming the file and the fix, never a
traceback from deep inside a loader."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from specee.errors import SpeceeError
from specee.io import read_json  # noqa: F401  (the one JSON reader; cards are read through it)


def _kind_ok(value, kind) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:  # any finite number
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, kind)


def read_card(path: str | Path, fix: str, keys: dict[str, Any] | None = None, what: str = "card") -> dict:
    """A JSON object holding at least ``keys`` (name -> type, or a tuple of types; a value
    of None skips the type check)."""
    doc = read_json(path, fix)
    if not isinstance(doc, dict):
        raise SpeceeError(f"{path} is not a {what} (a JSON object; it holds a {type(doc).__name__}); {fix}")
    for key, kind in (keys or {}).items():
        if key not in doc:
            raise SpeceeError(f"{path} is not a {what}: it lacks the key {key!r}; {fix}")
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(doc[key], float) and not math.isfinite(doc[key]):
            raise SpeceeError(f"{path} is not a {what}: {key!r} holds {doc[key]}, not a finite number; {fix}")
        if kind is not None and not any(_kind_ok(doc[key], k) for k in kinds):
            raise SpeceeError(f"{path} is not a {what}: {key!r} holds {str(doc[key])[:40]!r}, not a "
                              f"{' or '.join(k.__name__ for k in kinds)}; {fix}")
    return doc


def counts(value, n: int | None = None) -> bool:
    """A list of non-negative integers (of length n when given)."""
    return isinstance(value, list) and (n is None or len(value) == n) and \
        all(_kind_ok(c, int) and c >= 0 for c in value)


def safetensors_shapes(path: str | Path, fix: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors header, checked against the file's size, without
    reading the weights (a missing, empty, truncated or garbage file fails here, cheaply)."""
    import struct
    path = Path(path)
    if not path.is_file():
        raise SpeceeError(f"missing {path}; {fix}")
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 100_000_000):
                raise ValueError("header length beyond the file")
            header = json.loads(f.read(n))
        shapes, end = {}, 0
        for name, info in header.items():
            if name == "__metadata__":
                continue
            shapes[name] = tuple(int(s) for s in info["shape"])
            end = max(end, int(info["data_offsets"][1]))
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError, struct.error) as err:
        raise SpeceeError(f"{path} is corrupt (not a safetensors file: {err}); {fix}") from None
    if 8 + n + end > size:
        raise SpeceeError(f"{path} is corrupt (truncated: {size} of {8 + n + end} bytes); {fix}")
    return shapes
