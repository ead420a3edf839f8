"""The checked record that ``flax.serialization`` stores for a static or dynamic scaler
(``LSR1``): its kinds, its bytes, and reading them back (``flax_record.py`` registers it
with flax; ``upgrade.py`` reads which leaves a saved record holds).

The layout::

    magic b"LSR1" | kind u8 | ndim u8 | dims u32[ndim] | (headroom kinds: window u32) |
    each leaf (in flattening order), little-endian float32 / int32, C order |
    crc32 u32 of everything before it

The dims are the scalar leaves' shape (replica axes, or none); ``grad_max_history`` has
the dims and then the window. One msgpack ``bin``: msgpack never decodes inside it, so a
corrupted byte reaches :func:`decode` (a ValueError naming the field), and the CRC-32
refuses every 1- to 32-bit burst and all but 2**-32 of the rest: a flipped bit of the
scale's float32 can give another in-range scale, which no range check can see.

A kind says which leaves follow (:data:`KINDS`, from :mod:`loss_scaling.core.fields`):
kinds 2 and 3 are a ``DynamicLossScale`` with its ``failure`` leaf (on its own, and every
one written before issue 41), kinds 4 and 5 one that a ``with_loss_scaling`` state holds,
without it (the wrapper's register is the one).
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, NamedTuple

import numpy as np

from loss_scaling.checkpoint.state_dict import host_array, is_concrete
from loss_scaling.core import fields, headroom
from loss_scaling.core.scalers import (
    DynamicLossScale,
    LossScale,
    StaticLossScale,
    holds_failure,
    leaf_names,
)

MAGIC = b"LSR1"
_F32_DTYPE = np.dtype("<f4")
_INT_DTYPE = np.dtype("<i4")


class Kind(NamedTuple):
    """One kind of record: which scaler, which leaves."""

    name: str
    growth: str | None  # None: a StaticLossScale
    alone: bool  # a DynamicLossScale with its failure leaf

    @property
    def leaf_names(self) -> tuple[str, ...]:
        if self.growth is None:
            return (fields.LOSS_SCALE,)
        return fields.dynamic_leaf_names(self.growth, self.alone)


KINDS = {
    1: Kind("StaticLossScale", None, True),
    2: Kind("DynamicLossScale", fields.INTERVAL, True),
    3: Kind("DynamicLossScale with growth='headroom'", headroom.RULE, True),
    4: Kind("DynamicLossScale held by a with_loss_scaling state", fields.INTERVAL, False),
    5: Kind("DynamicLossScale with growth='headroom' held by a with_loss_scaling state",
            headroom.RULE, False),
}
"""Every kind a version wrote (2 and 3 by every version; 4 and 5 since issue 41)."""


class RecordError(ValueError):
    """A record that does not decode into its target (the caller names the path)."""


def _dtype(name: str) -> np.dtype:
    return _F32_DTYPE if fields.is_float(name) else _INT_DTYPE


def _window(scaler: LossScale) -> int | None:
    """The length of a headroom scaler's window leaf (None for every other: none has one)."""
    return getattr(getattr(scaler, "config", None), "headroom_window", None)


def kind_of(scaler: LossScale) -> int:
    """The record kind of a static or dynamic scaler."""
    if isinstance(scaler, StaticLossScale):
        return 1
    assert isinstance(scaler, DynamicLossScale)
    growth, alone = scaler.config.growth, holds_failure(scaler)
    return next(k for k, kind in KINDS.items() if (kind.growth, kind.alone) == (growth, alone))


def saved_leaf_names(data: Any) -> tuple[str, ...] | None:
    """The leaves a saved record holds (read from its kind); None for anything that is not
    an intact record of a known kind (:func:`decode` then says what is wrong)."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) < len(MAGIC) + 6:
        return None
    data = bytes(data)
    if data[:len(MAGIC)] != MAGIC or zlib.crc32(data[:-4]) != struct.unpack(
            "<I", data[-4:])[0]:
        return None
    kind = KINDS.get(data[len(MAGIC)])
    return None if kind is None else kind.leaf_names


def encode(scaler: LossScale) -> bytes | None:
    """The checked record of a concrete scaler; None for placeholders and tracers."""
    names = leaf_names(scaler)
    leaves = [getattr(scaler, name) for name in names]
    if not all(map(is_concrete, leaves)):
        return None
    arrays = [host_array(leaf) for leaf in leaves]
    shape, config = arrays[0].shape, getattr(scaler, "config", None)
    window = _window(scaler)
    if len(shape) > 255 or any(a.shape != (*shape, *fields.shape(n, config))
                               for n, a in zip(names, arrays, strict=True)):
        return None
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        body = b"".join(np.ascontiguousarray(a.astype(_dtype(n))).tobytes()
                        for n, a in zip(names, arrays, strict=True))
    payload = (MAGIC + struct.pack("<BB", kind_of(scaler), len(shape))
               + struct.pack(f"<{len(shape)}I", *shape)
               + (b"" if window is None else struct.pack("<I", window)) + body)
    return payload + struct.pack("<I", zlib.crc32(payload))


def decode(target: LossScale, record: bytes) -> dict[str, np.ndarray]:
    """The named arrays of a checked record of ``target``'s kind; a :class:`RecordError`
    for anything corrupted or of another kind."""
    names = leaf_names(target)
    if len(record) < len(MAGIC) + 6 or zlib.crc32(record[:-4]) != struct.unpack(
            "<I", record[-4:])[0]:
        raise RecordError(
            f"the record of {', '.join(names)} ({len(record)} bytes) fails its CRC-32 check: "
            "the bytes are corrupted or truncated. Restore an intact copy of the checkpoint.")
    if record[:4] != MAGIC:
        raise RecordError(f"the record starts with {record[:4]!r}, not {MAGIC!r}: it "
                          "was written by a newer or another program.")
    kind, ndim = struct.unpack("<BB", record[4:6])
    wanted = kind_of(target)
    if kind != wanted:
        saved = KINDS.get(kind)
        hint = ("build the target with the saved configuration (its growth rule included)."
                if saved is None or saved.growth != KINDS[wanted].growth else
                "a checkpoint of an earlier version: restore it with `loss_scaling.from_bytes`"
                ", or `loss_scaling.target_as_saved` and `loss_scaling.upgrade_restored`.")
        raise RecordError(
            f"the bytes hold a {saved.name if saved else f'record of kind {kind}'}, the "
            f"target is a {KINDS[wanted].name}: {hint}")
    offset = 6 + 4 * ndim
    shape = struct.unpack(f"<{ndim}I", record[6:offset])
    window = _window(target)
    if window is not None:
        saved_window = struct.unpack("<I", record[offset:offset + 4])[0]
        offset += 4
        if saved_window != window:
            raise RecordError(
                f"the bytes hold a headroom_window of {saved_window}, the target's is "
                f"{window}: build the target with the saved configuration.")
    count = int(np.prod(shape, dtype=np.int64))
    config = getattr(target, "config", None)
    sizes = {n: count * int(np.prod(fields.shape(n, config), dtype=np.int64)) for n in names}
    if len(record) != offset + 4 * sum(sizes.values()) + 4:
        raise RecordError(f"the record's length ({len(record)} bytes) does not match its "
                          f"shape {shape}.")
    arrays = {}
    for name in names:
        dtype = _dtype(name)
        arrays[name] = np.frombuffer(record, dtype, sizes[name], offset).reshape(
            (*shape, *fields.shape(name, config))).astype(dtype.newbyteorder("="))
        offset += 4 * sizes[name]
    return arrays
