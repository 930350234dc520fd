"""The LoRA delta of a decode-sized step as one Pallas kernel per linear that reads each
adapter the step uses straight from the slot buffers, once. JAX only (no torch import),
like grouped_lora.py.

Why it was tried (issue 42): a decode step is bound by the bytes it reads, and the least
it must read is its adapters' A and B once. XLA's one-hot reads more: "stacked" reads
every device slot, used or not; "onehot" first copies the step's S slots out of the
buffers (ops/slot_copy.py) and then reads the copy.

Measured on a v5e (2026-12-07, benchmarks/tpu_lora_layer.py, a Llama-3-8B layer at
16-64 tokens over 8-64 adapters): correct under Mosaic, and 1.3-1.7x slower than
onehot at every shape where the step uses its whole bucket, as the engine's steps do.
One grid step per adapter at rank-16 width costs more than onehot's copy saves. The
engine's table does not pick it; a benchmark can force it on every graph
(`--force-strategy indexed`; where a step uses few of many slots, onehot's copy was
dynamic slices until the DMA copy replaced them, 2026-12-07). What
it would need: several adapters per grid step (manual DMAs of arbitrary slots into one
128-lane group, as grouped_lora.py's contiguous groups fill it).

Formulation. The step's adapters are given as the onehot strategy's arrays: their
device slots (`active_slots`, padded) and each token's position among them
(`token_lora_idx`, -1: no adapter). The wrapper first moves the positions some token
uses to the front (so a bucket padded past the step's adapters costs nothing) and
counts them. The grid is (token tiles, positions); each step's BlockSpec fetches its
adapter's A [R, D] and B [R, O] of every slice of the linear at the slot the
scalar-prefetched list names (no copy of the weights, no gather), and

    h    = x_tile [TM, D] @ A_s.T         the shrink, [TM, R] per slice
    h   *= (token's position == this one)  keep the tokens on this adapter
    acc += h @ B_s                        the expand, accumulated in VMEM per slice

Positions past the count re-point at the last used one (no DMA) and skip the math.
Every tile reads every used adapter, so FLOPs are 2 * T * P * R * (D + O) for P used
adapters at rank-R MXU width: this is a kernel for steps of up to a tile or two of
tokens (decodes), where bytes dominate; larger steps belong to the grouped kernel or
one-hot. Unused slots are never read, so NaN in them cannot leak.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from vllm_tpu_lora.ops import vmem
from vllm_tpu_lora.ops.grouped_lora import token_tile  # the same tiles: up to 128 rows
from vllm_tpu_lora.ops.pallas_kernels import _check_precision, _nt_dot, dot_precision

VMEM_BUDGET_BYTES = 32 * vmem.MiB


def vmem_bytes(tile: int, d: int, outs: tuple[int, ...], rank: int, dtype) -> int:
    """Estimated VMEM of one instance (ops/vmem.py's rules): double-buffered x, position,
    A, B and output blocks of every slice, the float32 accumulators, and temporaries
    (the shrink's float32 result and its cast, the expand's float32 product, A relaid
    out for the NT shrink)."""
    s, pad = vmem.itemsize(dtype), vmem.padded_block_bytes
    blocks = pad(tile, d, s) + pad(tile, 1, 4) + sum(
        pad(rank, d, s) + pad(rank, o, s) + pad(tile, o, s) for o in outs)
    scratch = sum(pad(tile, o, 4) for o in outs)
    widest = max(outs)
    temps = pad(tile, rank, 4) + pad(tile, rank, s) + pad(tile, widest, 4) + pad(d, rank, s)
    return 2 * blocks + scratch + temps


def fitting_tile(tile: int, d: int, outs: tuple[int, ...], rank: int, dtype) -> int:
    """The token tile halved (down to 16 rows) until the estimate fits the budget; a
    shape that does not fit even then is refused."""
    while vmem_bytes(tile, d, outs, rank, dtype) > VMEM_BUDGET_BYTES and tile > 16:
        tile //= 2
    limit = vmem.required_limit_bytes(vmem_bytes(tile, d, outs, rank, dtype))
    if limit > vmem.VMEM_LIMIT_CEILING_BYTES:
        raise ValueError(f"indexed_lora: D={d}, outputs {outs} at rank {rank}, tile {tile} "
                         f"{vmem.dtype_name(dtype)} need ~{limit // vmem.MiB} MiB of VMEM, "
                         f"more than the {vmem.VMEM_LIMIT_CEILING_BYTES // vmem.MiB} MiB allowed")
    return tile


def used_first(token_lora_idx: jax.Array, active_slots: jax.Array):
    """(slots [P], positions [T], count [1]): the positions some token uses moved to the
    front, in order, their device slots, each token's new position, and how many are
    used. Small integer ops, once per step."""
    p = active_slots.shape[0]
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    pos = token_lora_idx.astype(jnp.int32)
    used = jnp.zeros(p + 1, jnp.int32).at[jnp.where(pos < i32(0), i32(p), pos)].set(i32(1))[:p]
    # Stable: used positions first, in their order (argsort of 0/1 keys).
    order = jnp.argsort(i32(1) - used, stable=True).astype(jnp.int32)
    new_pos = jnp.zeros(p, jnp.int32).at[order].set(jnp.arange(p, dtype=jnp.int32))
    tokens = jnp.where(pos < i32(0), i32(-1), new_pos[jnp.maximum(pos, i32(0))])
    count = jnp.sum(used, dtype=jnp.int32)[None]
    return active_slots.astype(jnp.int32)[order], tokens, count


def _kernel(count_ref, slot_ref, x_ref, pos_ref, *refs, n_slices, precision):
    a_refs, b_refs = refs[:n_slices], refs[n_slices:2 * n_slices]
    o_refs, acc_refs = refs[2 * n_slices:3 * n_slices], refs[3 * n_slices:]
    i, n = pl.program_id(1), pl.num_programs(1)

    @pl.when(i == jnp.int32(0))
    def _init():
        for acc in acc_refs:
            acc[...] = jnp.zeros_like(acc)

    @pl.when(i < count_ref[0])
    def _delta():
        x = x_ref[...]
        own = pos_ref[...] == i
        for a, b, acc in zip(a_refs, b_refs, acc_refs):
            h = _nt_dot(x, a[...], precision)  # [TM, R] float32
            h = jnp.where(own, h, jnp.zeros_like(h)).astype(x.dtype)
            acc[...] += jax.lax.dot_general(
                h, b[...], (((1,), (0,)), ((), ())),
                precision=dot_precision(h.dtype, precision),
                preferred_element_type=jnp.float32)

    @pl.when(i == n - jnp.int32(1))
    def _store():
        for o, acc in zip(o_refs, acc_refs):
            o[...] = acc[...].astype(o.dtype)


def _slot_at(i, count_ref, slot_ref):
    # Positions past the count re-point at the last used one: no new DMA.
    return slot_ref[jnp.maximum(jnp.minimum(i, count_ref[0] - 1), 0)]


@functools.partial(jax.jit, static_argnames=("tile", "interpret", "precision"))
def indexed_kernel(slots, positions, count, x, weights, *, tile, interpret=False,
                   precision="default"):
    """Semantics: out_i[t] = x[t] @ A_i[slots[p]].T @ B_i[slots[p]] for p = positions[t]
    < count[0], 0 where p = -1, per slice i of weights [(A_i [N, R, D], B_i [N, R, O_i])]
    (rank-first, as a TPU's slot buffers hold them). x [T_pad, D] with T_pad % tile == 0;
    positions int32 [T_pad, 1]. Returns [out_i [T_pad, O_i]] (x.dtype), float32
    accumulation."""
    (t_pad, d), p = x.shape, slots.shape[0]
    r = weights[0][0].shape[1]
    outs = tuple(b.shape[2] for _, b in weights)
    for a, b in weights:
        if a.shape[1:] != (r, d) or b.shape[1] != r or a.shape[0] != b.shape[0]:
            raise ValueError(f"indexed_kernel: A {a.shape}, B {b.shape} do not match "
                             f"[N, R, D={d}], [N, R, O] with one rank R")
    if t_pad % tile:
        raise ValueError(f"indexed_kernel: token tile {tile} must divide T_pad={t_pad}")
    _check_precision(precision)
    limit = vmem.explicit_vmem_limit(vmem_bytes(tile, d, outs, r, x.dtype))
    slot_map = lambda t, i, c, s: (_slot_at(i, c, s), 0, 0)  # noqa: E731
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(t_pad // tile, p),
        in_specs=[pl.BlockSpec((tile, d), lambda t, i, c, s: (t, 0)),
                  pl.BlockSpec((tile, 1), lambda t, i, c, s: (t, 0)),
                  *[pl.BlockSpec((None, r, d), slot_map) for _ in weights],
                  *[pl.BlockSpec((None, r, o), slot_map) for o in outs]],
        out_specs=[pl.BlockSpec((tile, o), lambda t, i, c, s: (t, 0)) for o in outs],
        scratch_shapes=[pltpu.VMEM((tile, o), jnp.float32) for o in outs],
    )
    return pl.pallas_call(
        functools.partial(_kernel, n_slices=len(weights), precision=precision),
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((t_pad, o), x.dtype) for o in outs],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=limit),
        interpret=interpret,
        name="lora_indexed",
    )(count, slots, x, positions, *[a.astype(x.dtype) for a, _ in weights],
      *[b.astype(x.dtype) for _, b in weights])


def indexed_lora(x, weights, token_lora_idx, active_slots, count=None, *, interpret=False,
                 precision="default"):
    """The LoRA delta of every slice of a linear: [T, sum of O] (x.dtype), token t's slice
    i = x[t] @ A_i[s].T @ B_i[s] for s = active_slots[token_lora_idx[t]], 0 where
    token_lora_idx[t] = -1.

    x [T, D]; weights [(A [N, R, D], B [N, R, O_i]), ...] (one pair per output slice,
    rank-first); token_lora_idx int32 [T]; active_slots int32 [P] (the onehot
    strategy's arrays, lora/step_layout.onehot_layout). count int32 [1]: how many of
    active_slots some token uses, all of them first (the engine's steps: the host lists
    only the step's adapters); None: found on the device (used_first), a few small ops
    per call."""
    t, d = x.shape
    r = weights[0][0].shape[1]
    tile = fitting_tile(token_tile(t), d, tuple(b.shape[2] for _, b in weights), r, x.dtype)
    t_pad = -(-t // tile) * tile
    if count is None:
        slots, positions, count = used_first(token_lora_idx, active_slots)
    else:
        slots, positions = active_slots.astype(jnp.int32), token_lora_idx.astype(jnp.int32)
        count = count.astype(jnp.int32)
    if t_pad > t:  # concatenation, not jnp.pad (x64, see grouped_lora._i32)
        x = jnp.concatenate([x, jnp.zeros((t_pad - t, d), x.dtype)])
        positions = jnp.concatenate([positions, jnp.full((t_pad - t,), -1, jnp.int32)])
    outs = indexed_kernel(slots, positions[:, None], count, x, weights, tile=tile,
                          interpret=interpret, precision=precision)
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
    return out[:t]
