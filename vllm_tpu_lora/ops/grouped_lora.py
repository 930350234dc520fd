"""The LoRA delta as one fused Pallas kernel over adapter groups: cost that follows the
work at any number of adapters in a step. JAX only (no torch import), like
pallas_kernels.py.

Why (issue 42, measured on a v5e): XLA's one-hot product multiplies every token by all
S active adapters' A (an S*R-wide matmul that fills the MXU) and masks, so its FLOPs grow
as T*S*R*(D+O); the segment kernels (pallas_kernels.py) pad each adapter's tokens to a
token block and run a rank-R-wide matmul per block, which leaves the 128-lane MXU 1/8
used at rank 16 and pads 8 tokens of an adapter to a whole block.

Formulation. Tokens are sorted by slot (one argsort per step; not when the step fits
one tile) and cut into tiles of TM rows. Slots are grouped G at a time so that a
group's ranks fill 128 lanes (G = 128 / R at rank 16: 8 slots): a group's A is [G*R, D] and its B [G*R, O], free reshapes of the
stacked slot buffers A [S, R, D] and B [S, R, O] (rank-first). Sorted tokens of one tile
touch a contiguous run of groups; the kernel visits the (tile, group) work items whose
group holds a slot of the tile's tokens, in order, each:

    y   = x_tile [TM, D] @ A_g.T           one MXU-wide shrink, [TM, G*R]
    y  *= (slot of row == slot of lane)     keep each token's own adapter's ranks
    acc += y @ B_g                          the expand, accumulated in VMEM

and writes acc once per tile: shrink and expand fused, the [T, R] intermediate never
goes to HBM, each active group's weights read once per tile that uses it. The work
list has at most tiles + groups - 1 items (a tile's run of groups overlaps the next
tile's in at most one group); the grid is that static bound and the items past the
real count re-point their index maps at the last item's blocks (no DMA) and skip the
math. FLOPs: 2 * items * TM * G*R * (D + O), against one-hot's 2 * T * S*R * (D + O).

A tile reads only the groups its tokens use, but a group can hold a slot no token of the
tile uses. Its A lanes are dropped by a select (NaN there cannot leak); its B rows meet
exact zeros in y, so they must be finite: the engine's slot buffers are (every image is
checked finite before it is written, free slots are zero).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from vllm_tpu_lora.ops import vmem
from vllm_tpu_lora.ops.pallas_kernels import _check_precision, _nt_dot, dot_precision

LANES = 128  # MXU width on every TPU generation: a group's ranks fill it
MAX_TILE = 128  # token rows per tile (more only re-reads fewer weights; VMEM grows)
# Budget for one kernel instance's blocks: the D, then the O tile shrink until it fits.
VMEM_BUDGET_BYTES = 32 * vmem.MiB


def slots_per_group(num_slots: int, rank: int) -> int:
    """G: the most slots (a power of two dividing num_slots) whose ranks fit 128 lanes."""
    g = 1
    while num_slots % (2 * g) == 0 and 2 * g * rank <= LANES:
        g *= 2
    return g


def token_tile(num_tokens: int) -> int:
    """TM: the whole step up to 128 tokens (rounded up to 16 rows, bfloat16's sublane
    tile), else 128."""
    return min(MAX_TILE, -(-num_tokens // 16) * 16)


class GroupPlan(NamedTuple):
    """One step's sorted order and work list, shared by every linear of the step."""
    order: jax.Array  # int32 [T_pad]: sorted row -> token (rows >= T: padding)
    inverse: jax.Array  # int32 [T]: token -> sorted row
    sorted_slot: jax.Array  # int32 [T_pad, 1]: slot of each sorted row, -1 for none
    work_tile: jax.Array  # int32 [W]
    work_group: jax.Array  # int32 [W]
    work_live: jax.Array  # int32 [W]: 1 for an item to compute, 0 to skip


def _i32(value) -> jax.Array:
    # Typed constants, never bare Python ints: this code may be traced inside a graph
    # lowered under x64 (the jax runtime), where a Python int that reaches one of jnp's
    # jitted helpers becomes int64 and fails verification beside int32 operands.
    return jnp.asarray(value, jnp.int32)


def group_plan(token_slot: jax.Array, num_slots: int, group: int, tile: int) -> GroupPlan:
    """The plan for tokens on slots token_slot [T] (-1: no adapter) of num_slots slots,
    grouped `group` at a time, in tiles of `tile` sorted rows. Static shapes only.

    One tile (T <= tile, every decode step): rows stay in token order, as a tile's
    rows need no order (each row's lanes are selected by its own slot) and the sort and
    its two gathers would be passes over x and the output for nothing."""
    t = token_slot.shape[0]
    t_pad = -(-t // tile) * tile
    n_tiles, n_groups = t_pad // tile, num_slots // group
    none, g = _i32(num_slots), _i32(group)
    key = jnp.where(token_slot < _i32(0), none, token_slot.astype(jnp.int32))
    key = jnp.concatenate([key, jnp.full((t_pad - t,), num_slots, jnp.int32)])
    if n_tiles == 1:
        order = jnp.arange(t_pad, dtype=jnp.int32)
        sorted_key, inverse = key, order
    else:
        order = jnp.argsort(key, stable=True).astype(jnp.int32)
        sorted_key = key[order]
        inverse = jnp.zeros(t_pad, jnp.int32).at[order].set(jnp.arange(t_pad, dtype=jnp.int32))
    # used[i, j]: a row of tile i is on a slot of group j. Only those pairs are visited:
    # with slots scattered over the buffers (LRU assignment) the groups between a tile's
    # lowest and highest slot may hold no adapter of the step.
    rows = jnp.arange(n_tiles, dtype=jnp.int32)[:, None]
    tile_group = jax.lax.div(sorted_key.reshape(n_tiles, tile), g)  # n_groups: no adapter
    used = jnp.zeros((n_tiles, n_groups + 1), jnp.bool_).at[rows, tile_group].set(True)
    used = used[:, :n_groups]
    # A tile without adapter tokens still gets one (skipped) item: its output block is
    # written, as zeros.
    visit = used.at[:, 0].set(used[:, 0] | ~used.any(axis=1))
    # At most tiles + groups - 1 pairs: sorted, a tile's groups overlap the next tile's
    # in at most one. The grid is that static bound; the items past the real count
    # re-point at the last real item (no DMA) and skip the math.
    n_work = n_tiles + n_groups - 1
    flat = visit.reshape(-1)
    count = jnp.sum(flat, dtype=jnp.int32)
    # Each visited pair's place in the list (jnp.nonzero's Python-int defaults would be
    # int64 under x64, see _i32).
    place = jnp.where(flat, jnp.cumsum(flat, dtype=jnp.int32) - _i32(1), _i32(n_work))
    items = jnp.zeros(n_work, jnp.int32).at[place].set(
        jnp.arange(flat.shape[0], dtype=jnp.int32), mode="drop")
    w = jnp.arange(n_work, dtype=jnp.int32)
    real = w < count
    items = jnp.where(real, items, items[count - _i32(1)])
    w_tile, w_group = jax.lax.div(items, _i32(n_groups)), jax.lax.rem(items, _i32(n_groups))
    live = (real & used.reshape(-1)[items]).astype(jnp.int32)
    sorted_slot = jnp.where(sorted_key < none, sorted_key, _i32(-1))[:, None]
    return GroupPlan(order, inverse[:t], sorted_slot, w_tile, w_group, live)


def _kernel(tile_ref, group_ref, live_ref, x_ref, slot_ref, a_ref, b_ref, o_ref, acc_ref, y_ref,
            *, group, rank, precision):
    # Constants as int32 arrays: the kernel body is traced when the enclosing graph is
    # lowered, maybe under x64 (the jax runtime), where Python ints in jitted helpers
    # such as floor_divide become int64, which Mosaic and the verifier refuse.
    zero, one = jnp.int32(0), jnp.int32(1)
    w, n = pl.program_id(1), pl.num_programs(1)
    k, n_k = pl.program_id(2), pl.num_programs(2)  # D tiles of the shrink
    tile = tile_ref[w]
    live = live_ref[w] != zero
    first = ((w == zero) | (tile_ref[jnp.maximum(w - one, zero)] != tile)) & (k == zero)
    last = (((w == n - one) | (tile_ref[jnp.minimum(w + one, n - one)] != tile))
            & (k == n_k - one))

    @pl.when(first)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(live & (k == zero))
    def _init_shrink():
        y_ref[...] = jnp.zeros_like(y_ref)

    @pl.when(live)
    def _shrink():
        y_ref[...] += _nt_dot(x_ref[...], a_ref[...], precision)  # [TM, G*R] float32

    @pl.when(live & (k == n_k - one))
    def _expand():
        lane = jax.lax.broadcasted_iota(jnp.int32, (1, group * rank), 1)
        own = slot_ref[...] == group_ref[w] * jnp.int32(group) + jax.lax.div(
            lane, jnp.int32(rank))
        y = y_ref[...]
        y = jnp.where(own, y, jnp.zeros_like(y)).astype(x_ref.dtype)
        acc_ref[...] += jax.lax.dot_general(
            y, b_ref[...], (((1,), (0,)), ((), ())),
            precision=dot_precision(y.dtype, precision),
            preferred_element_type=jnp.float32)

    @pl.when(last)
    def _store():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def vmem_bytes(tile: int, d_tile: int, o_tile: int, lanes: int, dtype) -> int:
    """Estimated VMEM of one instance (the rules of ops/vmem.py): double-buffered x, slot,
    A, B and output blocks, the float32 accumulators (output and shrink), and the
    temporaries (y cast, the expand's float32 result, A relaid out for the NT shrink)."""
    s, pad = vmem.itemsize(dtype), vmem.padded_block_bytes
    blocks = (pad(tile, d_tile, s) + pad(tile, 1, 4) + pad(lanes, d_tile, s)
              + pad(lanes, o_tile, s) + pad(tile, o_tile, s))
    scratch = pad(tile, o_tile, 4) + pad(tile, lanes, 4)
    temps = pad(tile, lanes, 4) + pad(tile, lanes, s) + pad(tile, o_tile, 4) + pad(d_tile, lanes, s)
    return 2 * blocks + scratch + temps


def _halves(n: int) -> list[int]:
    """n, n/2, n/4, ... while a multiple of 128 (legal Mosaic block widths)."""
    out = [n]
    while out[-1] % 2 == 0 and (out[-1] // 2) % 128 == 0:
        out.append(out[-1] // 2)
    return out


def tiles(tile: int, d: int, o: int, lanes: int, dtype) -> tuple[int, int]:
    """(D tile, O tile) within the budget: the whole O if any D tile lets it fit (every O
    tile recomputes the shrink), with the widest such D tile; else narrower O tiles."""
    for o_tile in _halves(o):
        for d_tile in _halves(d):
            if vmem_bytes(tile, d_tile, o_tile, lanes, dtype) <= VMEM_BUDGET_BYTES:
                return d_tile, o_tile
    d_tile, o_tile = _halves(d)[-1], _halves(o)[-1]
    limit = vmem.required_limit_bytes(vmem_bytes(tile, d_tile, o_tile, lanes, dtype))
    if limit > vmem.VMEM_LIMIT_CEILING_BYTES:
        raise ValueError(f"grouped_lora: D={d}, O={o} at {lanes} lanes, tile {tile} "
                         f"{vmem.dtype_name(dtype)} need ~{limit // vmem.MiB} MiB of VMEM, "
                         f"more than the {vmem.VMEM_LIMIT_CEILING_BYTES // vmem.MiB} MiB allowed")
    return d_tile, o_tile


@functools.partial(jax.jit, static_argnames=("group", "tile", "blocks", "interpret",
                                             "precision"))
def grouped_kernel(plan: GroupPlan, xs, lora_a, lora_b, *, group, tile, blocks=None,
                   interpret=False, precision="default"):
    """Semantics: out[r] = xs[r] @ A[s].T @ B[s] for sorted row r on slot s =
    plan.sorted_slot[r], 0 where s = -1.

    Shapes: xs [T_pad, D] (sorted rows), lora_a [S, R, D], lora_b [S, R, O] (rank-first)
    -> [T_pad, O] (xs.dtype), float32 accumulation."""
    (t_pad, d), (s, r, o) = xs.shape, lora_b.shape
    if lora_a.shape != (s, r, d) or s % group or t_pad % tile:
        raise ValueError(f"grouped_kernel: xs {xs.shape}, lora_a {lora_a.shape}, lora_b "
                         f"{lora_b.shape}, group {group}, tile {tile} do not match [T_pad, D], "
                         "[S, R, D], [S, R, O] with S % group == 0, T_pad % tile == 0")
    _check_precision(precision)
    lanes = group * r
    d_tile, o_tile = tiles(tile, d, o, lanes, xs.dtype) if blocks is None else blocks
    limit = vmem.explicit_vmem_limit(vmem_bytes(tile, d_tile, o_tile, lanes, xs.dtype))
    a_g = lora_a.astype(xs.dtype).reshape(s // group, lanes, d)  # free: contiguous
    b_g = lora_b.astype(xs.dtype).reshape(s // group, lanes, o)
    n_work = plan.work_tile.shape[0]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(o // o_tile, n_work, d // d_tile),
        in_specs=[
            pl.BlockSpec((tile, d_tile), lambda j, w, k, t, g, v: (t[w], k)),
            pl.BlockSpec((tile, 1), lambda j, w, k, t, g, v: (t[w], 0)),
            pl.BlockSpec((None, lanes, d_tile), lambda j, w, k, t, g, v: (g[w], 0, k)),
            pl.BlockSpec((None, lanes, o_tile), lambda j, w, k, t, g, v: (g[w], 0, j)),
        ],
        out_specs=pl.BlockSpec((tile, o_tile), lambda j, w, k, t, g, v: (t[w], j)),
        scratch_shapes=[pltpu.VMEM((tile, o_tile), jnp.float32),
                        pltpu.VMEM((tile, lanes), jnp.float32)],
    )
    return pl.pallas_call(
        functools.partial(_kernel, group=group, rank=r, precision=precision),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((t_pad, o), xs.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=limit),
        interpret=interpret,
        name="lora_grouped",
    )(plan.work_tile, plan.work_group, plan.work_live, xs, plan.sorted_slot, a_g, b_g)


def grouped_lora(x, weights, token_slot, *, plan=None, interpret=False, precision="default"):
    """The LoRA delta of every slice of a linear: [T, sum of O] (x.dtype), token t's slice
    i = x[t] @ A_i[s].T @ B_i[s] for s = token_slot[t], 0 where s = -1.

    x [T, D]; weights [(A [S, R, D], B [S, R, O_i]), ...] (one pair per output slice);
    token_slot int32 [T]. The plan (group_plan) may be passed in, built once per step."""
    s, r = weights[0][0].shape[:2]
    group, tile = slots_per_group(s, r), token_tile(x.shape[0])
    if plan is None:
        plan = group_plan(token_slot, s, group, tile)
    t = x.shape[0]
    one_tile = t <= tile  # rows in token order (group_plan)
    if one_tile:  # padded by concatenation: jnp.pad's jitted helper would meet x64 (_i32)
        xs = jnp.concatenate([x, jnp.zeros((tile - t, x.shape[1]), x.dtype)]) if tile > t else x
    else:
        xs = x[jnp.minimum(plan.order, _i32(t - 1))]
    outs = [grouped_kernel(plan, xs, a, b, group=group, tile=tile, interpret=interpret,
                           precision=precision) for a, b in weights]
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
    return out[:t] if one_tile else out[plan.inverse]


def grouped_delta(x, token_slot, weights, *, interpret=False, precision="default"):
    """grouped_lora with the arguments in the order the torch bridges pass them (x, each
    token's slot, then the weights pytree), for call_jax."""
    return grouped_lora(x, weights, token_slot, interpret=interpret, precision=precision)


def grouped_delta_one(x, token_slot, lora_a, lora_b, *, interpret=False, precision="default"):
    """One slice's grouped_lora with array arguments only (torch_xla's call_jax)."""
    return grouped_lora(x, [(lora_a, lora_b)], token_slot, interpret=interpret,
                        precision=precision)
