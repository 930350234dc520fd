"""A step's host arrays in one transfer per kind of value.

Every host -> device transfer costs a fixed latency (on XLA CPU ~11 µs idle, 20-150 µs
between a step's graphs; on a TPU a DMA each), and a step has 13-21 small arrays (token
rows, attention metadata, the LoRA plan, sampling parameters). They are concatenated on
the host into one flat buffer per carrier dtype -- every integer and bool array widened
into one int64 buffer, each float dtype its own -- moved, and cut back into named views
inside the captured graph (narrowed back to their own dtype there), where XLA fuses the
slices and converts into their consumers. So a forward graph takes one transfer (before:
one per dtype, up to three with a LoRA plan's token mask) and a sampler two at most. The
layout (names, shapes, dtypes, offsets) is static per graph key and part of it.
"""

from __future__ import annotations

import numpy as np
import torch


class PackLayout:
    """Where each named array lies in the flat buffers: a graph-key leaf (hashable, and a
    single pytree leaf, so flattening the graph's arguments does not walk it)."""

    __slots__ = ("entries", "dtypes", "_hash")

    def __init__(self, entries: tuple, dtypes: tuple) -> None:
        # (group, name, buffer index, start, stop, shape, dtype) per array; dtype: the
        # array's own numpy dtype name where it differs from its buffer's, else None
        self.entries = entries
        self.dtypes = dtypes  # numpy dtype name of each flat buffer
        self._hash = hash((entries, dtypes))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return (isinstance(other, PackLayout) and other._hash == self._hash
                and other.entries == self.entries and other.dtypes == self.dtypes)

    def __repr__(self) -> str:
        return f"PackLayout({len(self.entries)} arrays in {self.dtypes})"


# (group, name, shape, dtype) of every array -> (layout, array indices per flat buffer):
# as many entries as graph keys, so bounded by the bucket ladders.
_LAYOUTS: dict[tuple, tuple[PackLayout, list[list[int]]]] = {}


def pack_arrays(groups: dict[str, dict[str, np.ndarray]]) -> tuple[list[np.ndarray], PackLayout]:
    """{group: {name: array}} -> (one flat host buffer per carrier dtype, their layout)."""
    arrays = [(g, n, a) for g, named in groups.items() for n, a in named.items()]
    signature = tuple((g, n, a.shape, a.dtype.str) for g, n, a in arrays)
    found = _LAYOUTS.get(signature)
    if found is None:
        found = _LAYOUTS[signature] = _plan_layout(signature)
    layout, order = found
    flats = [np.concatenate([arrays[i][2].ravel() for i in idx], dtype=dtype)
             for idx, dtype in zip(order, layout.dtypes)]
    return flats, layout


def _carrier(dtype: np.dtype) -> np.dtype:
    """The flat buffer's dtype an array travels in: int64 holds every bool and integer
    value exactly (uint64 aside), floats keep their own."""
    if dtype.kind in "bi" or (dtype.kind == "u" and dtype.itemsize <= 4):
        return np.dtype(np.int64)
    return dtype


def _plan_layout(signature: tuple) -> tuple[PackLayout, list[list[int]]]:
    dtypes: list[str] = []
    order: list[list[int]] = []
    sizes: list[int] = []
    entries = []
    for i, (group, name, shape, dtype_str) in enumerate(signature):
        dtype = np.dtype(dtype_str)
        carrier = _carrier(dtype).name
        if carrier not in dtypes:
            dtypes.append(carrier)
            order.append([])
            sizes.append(0)
        buf = dtypes.index(carrier)
        start = sizes[buf]
        sizes[buf] += int(np.prod(shape, dtype=np.int64))
        own = dtype.name if dtype.name != carrier else None
        entries.append((group, name, buf, start, sizes[buf], shape, own))
        order[buf].append(i)
    return PackLayout(tuple(entries), tuple(dtypes)), order


def unpack_arrays(flats: list[torch.Tensor],
                  layout: PackLayout) -> dict[str, dict[str, torch.Tensor]]:
    """The inverse, on device tensors (inside the traced graph): {group: {name: view}}."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for group, name, buf, start, stop, shape, own in layout.entries:
        view = flats[buf][start:stop].reshape(shape)
        if own == "bool":
            view = view != 0
        elif own is not None:
            view = view.to(getattr(torch, own))  # numpy's and torch's int names agree
        out.setdefault(group, {})[name] = view
    return out
