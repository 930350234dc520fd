"""Copy a step's adapter slots out of the slot buffers with the TPU's DMA engines: one
Pallas call that starts one HBM -> HBM copy per (slot, buffer) and waits for them all.
JAX only (no torch import), like grouped_lora.py.

Why (issue 42): the onehot strategy first copies the step's S adapters out of the
`max_loras` slots. A TPU lowers a gather over the slot axis as a pass over every slot, so
the copy was S dynamic slices, concatenated; in the engine with 32 of 128 slots in use the
decode step's LoRA cost +7.9 ms of device time against +1.25 ms for the same 32 adapters
held in 32 slots (docs/benchmarks.md, seventh session). A profile of that step in plain
JAX put +9.0 ms on the copies: dynamic-slice, concatenate, dynamic-update-slice and copy
ops, 4,197 of them a step. Here a copy is one kernel whose DMAs all run at once, reading
the S slots alone, and a packed layer's slices land side by side in the one output (the
concatenation done by the copy's destination offsets). Measured on a v5e (eighth
session): the engine's decode step over 32 of 128 slots +2.37 ms (0.91 ms of it the
copies, ~400 GB/s), and 128 adapters at 0.768x base against 0.456x.

    take_slots_dma([buf_0, ..., buf_k], slots, axis)
      buf_j [N, *rest_j]; out [S, *rest] with rest_j concatenated along `axis` (an axis
      of the per-slot block, 0-based: 0 for A [R, D] stacked rank-first).

The slots must be in range: a DMA from outside a buffer faults (the engine's slot lists
are padded with slot 0, never with an index past max_loras).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from vllm_tpu_lora.ops.pallas_kernels import in_hbm

IN_FLIGHT = 32  # slots whose copies may run at once


def _out_shape(buffers, num_slots: int, axis: int):
    rest = list(buffers[0].shape[1:])
    rest[axis] = sum(b.shape[1 + axis] for b in buffers)
    return jax.ShapeDtypeStruct((num_slots, *rest), buffers[0].dtype)


def _kernel(slots_ref, *refs, axis: int, widths: tuple[int, ...]):
    *srcs, out_ref, sem = refs
    num_slots = out_ref.shape[0]

    def dst(i, j):
        start = sum(widths[:j])
        index = [slice(None)] * (out_ref.ndim - 1)
        index[axis] = pl.ds(start, widths[j])
        return out_ref.at[(i, *index)]

    def copies(i):
        return [pltpu.make_async_copy(src.at[slots_ref[i]], dst(i, j), sem)
                for j, src in enumerate(srcs)]

    # Up to IN_FLIGHT slots' copies run at once (the DMA engines overlap them; measured
    # with 32 slots x 3 slices in flight); past that, each start waits for the copies
    # IN_FLIGHT slots back. A wait counts its own copy's bytes on the shared semaphore,
    # so waiting in start order with same-shaped descriptors is exact.
    def wait(i, carry):
        for c in copies(i):
            c.wait()
        return carry

    # int32 bounds and constants: under x64 (the jax runtime's torchax) a Python int
    # traces as int64, and Mosaic refuses to compare it with the int32 loop index.
    window = jnp.int32(IN_FLIGHT)

    def start(i, carry):
        @pl.when(i >= window)
        def _():
            wait(i - window, carry)

        for c in copies(i):
            c.start()
        return carry

    jax.lax.fori_loop(jnp.int32(0), jnp.int32(num_slots), start, jnp.int32(0))
    jax.lax.fori_loop(jnp.int32(max(0, num_slots - IN_FLIGHT)), jnp.int32(num_slots), wait,
                      jnp.int32(0))


@functools.partial(jax.jit, static_argnames=("axis", "interpret"))
def take_slots_dma(buffers, slots, axis: int = 0, interpret: bool = False):
    """list of buf_j [N, *rest_j] (one dtype), slots int32 [S] -> [S, *rest]: row i is
    the buffers' slot slots[i], the buffers' blocks concatenated along `axis`."""
    buffers = list(buffers)
    if len({b.dtype for b in buffers}) != 1:
        raise ValueError("take_slots_dma: the buffers must share one dtype")
    out = _out_shape(buffers, slots.shape[0], axis)
    widths = tuple(b.shape[1 + axis] for b in buffers)
    any_space = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_kernel, axis=axis, widths=widths),
        out_shape=out,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(1,),
            in_specs=[any_space] * len(buffers), out_specs=any_space,
            scratch_shapes=[pltpu.SemaphoreType.DMA(())]),
        interpret=interpret,
    )(slots.astype(jnp.int32), *[in_hbm(b, interpret) for b in buffers])
