"""A step's host arrays in one transfer per dtype.

Every host -> device transfer costs a fixed latency (on XLA CPU ~11 µs; on a TPU a DMA
each), and a step has 13-21 small arrays (token rows, attention metadata, the LoRA plan,
sampling parameters). They are concatenated on the host per dtype, moved as one flat
buffer per dtype, and cut back into named views inside the captured graph, where XLA
fuses the slices into their consumers. The layout (names, shapes, offsets) is static per
graph key and part of it.
"""

from __future__ import annotations

import numpy as np
import torch


class PackLayout:
    """Where each named array lies in the flat buffers: a graph-key leaf (hashable, and a
    single pytree leaf, so flattening the graph's arguments does not walk it)."""

    __slots__ = ("entries", "dtypes", "_hash")

    def __init__(self, entries: tuple, dtypes: tuple) -> None:
        self.entries = entries  # (group, name, buffer index, start, stop, shape) per array
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
    """{group: {name: array}} -> (one flat host buffer per dtype, their layout)."""
    arrays = [(g, n, a) for g, named in groups.items() for n, a in named.items()]
    signature = tuple((g, n, a.shape, a.dtype.str) for g, n, a in arrays)
    found = _LAYOUTS.get(signature)
    if found is None:
        found = _LAYOUTS[signature] = _plan_layout(signature)
    layout, order = found
    flats = [np.concatenate([arrays[i][2].ravel() for i in idx]) for idx in order]
    return flats, layout


def _plan_layout(signature: tuple) -> tuple[PackLayout, list[list[int]]]:
    dtypes: list[str] = []
    order: list[list[int]] = []
    sizes: list[int] = []
    entries = []
    for i, (group, name, shape, dtype) in enumerate(signature):
        if dtype not in dtypes:
            dtypes.append(dtype)
            order.append([])
            sizes.append(0)
        buf = dtypes.index(dtype)
        start = sizes[buf]
        sizes[buf] += int(np.prod(shape, dtype=np.int64))
        entries.append((group, name, buf, start, sizes[buf], shape))
        order[buf].append(i)
    return PackLayout(tuple(entries), tuple(np.dtype(d).name for d in dtypes)), order


def unpack_arrays(flats: list[torch.Tensor],
                  layout: PackLayout) -> dict[str, dict[str, torch.Tensor]]:
    """The inverse, on device tensors (inside the traced graph): {group: {name: view}}."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for group, name, buf, start, stop, shape in layout.entries:
        out.setdefault(group, {})[name] = flats[buf][start:stop].reshape(shape)
    return out
