"""The LoRA delta of a step as one Pallas kernel per linear that reads each adapter the
step uses straight from the slot buffers, once, several adapters at a time.
JAX only (no torch import), like grouped_lora.py.

Why (issue 42): a decode step is bound by the bytes it reads, and the least it must read
is its adapters' A and B once. XLA's one-hot reads more: "stacked" reads every device
slot, used or not; "onehot" first copies the step's S slots out of the buffers
(ops/slot_copy.py, HBM -> HBM) and then reads the copy, and slices it again (on a v5e,
32 of 128 slots in the engine's decode step: +2.37 ms, 0.91 ms of it the copies).

History: the first form (2026-12-07) ran one grid step per adapter, its BlockSpec
fetching that adapter's A and B. It was correct under Mosaic and 1.3-1.7x slower than
onehot in the layer benchmark: at rank 16 each grid step did a 16-wide matmul and a
64 KB fetch, and the fixed cost per step dominated. Now a grid step takes a *group* of
G adapters, G*R = 128 lanes (the MXU's width) where the rank allows, fetched by the
kernel's own DMAs from the slots the scalar-prefetched list names, up to DEPTH - 1
groups ahead: their copies run while this group computes.

Formulation. The step's adapters are given as the onehot strategy's arrays: their
device slots (`active_slots`, padded) and each token's position among them
(`token_lora_idx`, -1: no adapter). With the host's count (the engine's steps list their
adapters first) they are used as given; without it the wrapper moves the positions some
token uses to the front on the device. The grid is (token tiles,
groups); group g holds positions g*G .. g*G+G-1, and

    h    = x_tile [TM, D] @ A_g.T              the shrink, [TM, G*R] per slice
    h    = where(token's position == column's, h, 0)
    acc += h @ B_g                             the expand [G*R, O], accumulated in VMEM

Each token tile fetches only the positions from its lowest to its highest (`tile_runs`,
a few small ops per step), and visits only the groups holding them: a step's rows follow
its sequences and the host numbers adapters as the sequences meet them, so a prefill
tile of a few sequences fetches those few adapters, not the step's every one (before,
each tile read them all: 490 ms against onehot's 432 for 20 prefills of 1,024 tokens
over 32 adapters on a v5e). A decode tile spans them all, as before. A group's members
outside the tile's run are not fetched; their B rows are zeroed in VMEM (they meet the
select's zeros in the expand and must be finite), their A lanes are dropped by the
select. FLOPs are 2 * T * P * R * (D + O) for P used adapters at most; bytes each used
adapter's A and B once per tile whose run holds it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from vllm_tpu_lora.ops import vmem
from vllm_tpu_lora.ops.grouped_lora import _i32, token_tile  # its tiles and x64-safe ints
from vllm_tpu_lora.ops.pallas_kernels import _check_precision, _nt_dot, dot_precision, in_hbm

VMEM_BUDGET_BYTES = 32 * vmem.MiB
LANES = 128  # a group's ranks side by side fill the MXU's width
DEPTH = 4  # group buffers: DEPTH - 1 groups' copies in flight ahead of the one computing


def max_group(rank: int, num_positions: int, dtype) -> int:
    """G: adapters per grid step, G*R <= 128. A group is merged into one [G*R, D] matrix
    in VMEM, which Mosaic does without a relayout only when R is whole sublane tiles
    (8 rows of 32-bit, 16 of 16-bit); other ranks run one adapter a step."""
    sublanes = 8 * 4 // vmem.itemsize(dtype)
    if rank % sublanes or rank >= LANES:
        return 1
    return max(1, min(LANES // rank, num_positions))


def vmem_bytes(tile: int, d: int, outs: tuple[int, ...], rank: int, dtype,
               group: int = 1, depth: int = 2, weight_dtype=None) -> int:
    """Estimated VMEM of one instance (ops/vmem.py's rules): double-buffered x, position
    and output blocks (`dtype`), `depth` groups of A and B per slice as the buffers hold
    them (`weight_dtype`, default `dtype`; the one computing, the ones in flight), the
    float32 accumulators, and temporaries: the shrink's float32 result and its cast, the
    expand's float32 product, a group's A and B loaded as [G*R, *] values (and cast to
    `dtype` where the buffers hold another), A relaid out for the NT shrink."""
    s, pad, lanes = vmem.itemsize(dtype), vmem.padded_block_bytes, group * rank
    ws = vmem.itemsize(weight_dtype or dtype)
    blocks = pad(tile, d, s) + pad(tile, 1, 4) + sum(pad(tile, o, s) for o in outs)
    groups = depth * group * sum(pad(rank, d, ws) + pad(rank, o, ws) for o in outs)
    scratch = sum(pad(tile, o, 4) for o in outs)
    widest = max(outs)
    loaded = pad(lanes, d, ws) + pad(lanes, widest, ws)
    casts = 0 if ws == s else pad(lanes, d, s) + pad(lanes, widest, s)
    temps = (pad(tile, lanes, 4) + pad(tile, lanes, s) + pad(tile, widest, 4) + loaded
             + casts + pad(d, lanes, s))
    return 2 * blocks + groups + scratch + temps


def fitting_plan(tile: int, d: int, outs: tuple[int, ...], rank: int, dtype,
                 group: int = 1, depth: int = DEPTH, weight_dtype=None) -> tuple[int, int, int]:
    """(token tile, group, depth) within the budget: the depth lowered first (down to
    double buffering), then the group halved (a step's tokens in one tile read each
    adapter once), then the token tile (down to 16 rows); a shape that does not fit
    even then is refused."""
    def estimate():
        return vmem_bytes(tile, d, outs, rank, dtype, group, depth, weight_dtype)

    while estimate() > VMEM_BUDGET_BYTES:
        if depth > 2:
            depth -= 1
        elif group > 1:
            group //= 2
        elif tile > 16:
            tile //= 2
        else:
            break
    need = vmem.required_limit_bytes(estimate())
    if need > vmem.VMEM_LIMIT_CEILING_BYTES:
        raise ValueError(f"indexed_lora: D={d}, outputs {outs} at rank {rank}, tile {tile} "
                         f"{vmem.dtype_name(dtype)} need ~{need // vmem.MiB} MiB of VMEM, "
                         f"more than the {vmem.VMEM_LIMIT_CEILING_BYTES // vmem.MiB} MiB allowed")
    return tile, group, depth


def used_first(token_lora_idx: jax.Array, active_slots: jax.Array):
    """(slots [P], positions [T], count [1]): the positions some token uses moved to the
    front, in order, their device slots, each token's new position, and how many are
    used. Small integer ops, once per call (the engine passes its host's count)."""
    p = active_slots.shape[0]
    pos = token_lora_idx.astype(jnp.int32)
    used = jnp.zeros(p + 1, jnp.int32).at[jnp.where(pos < _i32(0), _i32(p), pos)].set(_i32(1))[:p]
    # Stable: used positions first, in their order (argsort of 0/1 keys).
    order = jnp.argsort(_i32(1) - used, stable=True).astype(jnp.int32)
    new_pos = jnp.zeros(p, jnp.int32).at[order].set(jnp.arange(p, dtype=jnp.int32))
    tokens = jnp.where(pos < _i32(0), _i32(-1), new_pos[jnp.maximum(pos, _i32(0))])
    count = jnp.sum(used, dtype=jnp.int32)[None]
    return active_slots.astype(jnp.int32)[order], tokens, count


def tile_runs(positions: jax.Array, tile: int, group: int):
    """Each token tile's run of positions and of groups, int32 [tiles] each: (lowest and
    highest position its tokens use, first group, number of groups), -1 / 0 for a tile
    of base tokens only. positions int32 [T_pad], T_pad % tile == 0, -1 for none."""
    pos = positions.reshape(-1, tile)
    used = pos >= _i32(0)
    lo = jnp.min(jnp.where(used, pos, _i32(jnp.iinfo(jnp.int32).max)), axis=1)
    hi = jnp.max(jnp.where(used, pos, _i32(-1)), axis=1)
    any_used = hi >= _i32(0)
    lo = jnp.where(any_used, lo, _i32(-1))
    first = jnp.where(any_used, lo // _i32(group), _i32(0))
    number = jnp.where(any_used, hi // _i32(group) - first + _i32(1), _i32(0))
    return lo, hi, first, number


def _kernel(slot_ref, lo_ref, hi_ref, first_ref, number_ref, x_ref, pos_ref, *refs, n_slices,
            group, depth, precision):
    n = n_slices
    hbm = refs[:2 * n]  # A_0 .. A_n-1, B_0 .. B_n-1: [N, R, *] where the buffers lie
    o_refs = refs[2 * n:3 * n]
    bufs = refs[3 * n:5 * n]  # the same order, [depth, G, R, *] in VMEM
    acc_refs, sem = refs[5 * n:6 * n], refs[6 * n]
    # int32 constants throughout (_i32): under x64 a Python int would trace as int64.
    # g counts this tile's groups; its group in the step is first + g.
    t, g, last = pl.program_id(0), pl.program_id(1), pl.num_programs(1) - _i32(1)
    lo, hi, first_group, used_groups = lo_ref[t], hi_ref[t], first_ref[t], number_ref[t]

    def members(grp):
        """(fetched?, position) of each member of the tile's grp-th group: only positions
        in the tile's run are fetched."""
        out = []
        for j in range(group):
            p = (first_group + _i32(grp)) * _i32(group) + _i32(j)
            out.append(((p >= lo) & (p <= hi), p))
        return out

    def each_copy(grp, buf, action):
        for j, (fetched, p) in enumerate(members(grp)):
            @pl.when(fetched)
            def _copy(j=j, p=p):  # called at once: binds this member
                for src, dst in zip(hbm, bufs):
                    action(pltpu.make_async_copy(src.at[slot_ref[p]], dst.at[buf, _i32(j)],
                                                 sem.at[buf]))

    @pl.when(g == _i32(0))
    def _init():
        for acc in acc_refs:
            acc[...] = jnp.zeros_like(acc)

        for k in range(depth - 1):  # the first groups, ahead
            @pl.when(_i32(k) < used_groups)
            def _first(k=k):  # called at once: binds this k
                each_copy(_i32(k), _i32(k), lambda c: c.start())

    ahead = g + _i32(depth - 1)

    @pl.when(ahead < used_groups)
    def _prefetch():  # into the buffer the previous group has finished with
        each_copy(ahead, ahead % _i32(depth), lambda c: c.start())

    @pl.when(g < used_groups)
    def _delta():
        buf = g % _i32(depth)
        each_copy(g, buf, lambda c: c.wait())
        # A member outside the run was not fetched: its A lanes are dropped by the
        # select below, but its B rows meet those zeros, so they must be finite.
        for j, (fetched, _) in enumerate(members(g)):
            @pl.when(jnp.logical_not(fetched))
            def _zero(j=j):
                for b in bufs[n:]:
                    b[buf, _i32(j)] = jnp.zeros(b.shape[2:], b.dtype)
        x = x_ref[...]
        rank = bufs[0].shape[2]
        lanes = group * rank
        # Column c of the group belongs to its position c // R; a token keeps the
        # columns of its own position (range tests: no vector integer division).
        col0 = (pos_ref[...] - (first_group + g) * _i32(group)) * _i32(rank)  # [TM, 1]
        col = jax.lax.broadcasted_iota(jnp.int32, (x.shape[0], lanes), 1)
        own = (col >= col0) & (col < col0 + _i32(rank))
        for a, b, acc in zip(bufs[:n], bufs[n:], acc_refs):
            # The buffers' dtype is cast here, a group at a time: casting a buffer
            # before the call would read all its slots.
            h = _nt_dot(x, _merged(a, buf, lanes).astype(x.dtype), precision)  # [TM, G*R]
            h = jnp.where(own, h, jnp.zeros_like(h)).astype(x.dtype)
            acc[...] += jax.lax.dot_general(
                h, _merged(b, buf, lanes).astype(x.dtype), (((1,), (0,)), ((), ())),
                precision=dot_precision(h.dtype, precision),
                preferred_element_type=jnp.float32)

    @pl.when(g == last)
    def _store():
        for o, acc in zip(o_refs, acc_refs):
            o[...] = acc[...].astype(o.dtype)


def _merged(ref, buf, lanes):
    """A group's [G, R, F] in buffer `buf` as one [G*R, F] matrix."""
    if ref.shape[1] == 1:
        return ref[buf, jnp.int32(0)]
    return ref[buf].reshape(lanes, ref.shape[3])


@functools.partial(jax.jit, static_argnames=("tile", "group", "depth", "interpret",
                                             "precision"))
def indexed_kernel(slots, positions, x, weights, *, tile, group=1, depth=2,
                   interpret=False, precision="default"):
    """Semantics: out_i[t] = x[t] @ A_i[slots[p]].T @ B_i[slots[p]] for p = positions[t],
    0 where p = -1, per slice i of weights [(A_i [N, R, D], B_i [N, R, O_i])] (rank-first,
    as a TPU's slot buffers hold them). x [T_pad, D] with T_pad % tile == 0; positions
    int32 [T_pad, 1]; `group` adapters per grid step, `depth` groups' buffers (depth - 1
    groups fetched ahead). A token tile fetches the positions from its lowest to its
    highest (tile_runs): each must name a slot of finite weights. The weights keep their
    own dtype (one for all), cast to x's in the kernel. Returns [out_i [T_pad, O_i]]
    (x.dtype), float32 accumulation."""
    (t_pad, d), p = x.shape, slots.shape[0]
    r = weights[0][0].shape[1]
    outs = tuple(b.shape[2] for _, b in weights)
    for a, b in weights:
        if a.shape[1:] != (r, d) or b.shape[1] != r or a.shape[0] != b.shape[0]:
            raise ValueError(f"indexed_kernel: A {a.shape}, B {b.shape} do not match "
                             f"[N, R, D={d}], [N, R, O] with one rank R")
    wdt = weights[0][0].dtype
    if any(w.dtype != wdt for pair in weights for w in pair):
        raise ValueError("indexed_kernel: the weights must share one dtype")
    if t_pad % tile:
        raise ValueError(f"indexed_kernel: token tile {tile} must divide T_pad={t_pad}")
    _check_precision(precision)
    groups = -(-p // group)
    depth = max(1, min(depth, groups))
    runs = tile_runs(positions[:, 0], tile, group)
    limit = vmem.explicit_vmem_limit(vmem_bytes(tile, d, outs, r, x.dtype, group, depth,
                                                wdt))
    any_space = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(t_pad // tile, groups),
        in_specs=[pl.BlockSpec((tile, d), lambda t, g, *_: (t, 0)),
                  pl.BlockSpec((tile, 1), lambda t, g, *_: (t, 0)),
                  *[any_space] * (2 * len(weights))],
        out_specs=[pl.BlockSpec((tile, o), lambda t, g, *_: (t, 0)) for o in outs],
        scratch_shapes=[*[pltpu.VMEM((depth, group, r, d), wdt) for _ in outs],
                        *[pltpu.VMEM((depth, group, r, o), wdt) for o in outs],
                        *[pltpu.VMEM((tile, o), jnp.float32) for o in outs],
                        pltpu.SemaphoreType.DMA((depth,))],
    )
    return pl.pallas_call(
        functools.partial(_kernel, n_slices=len(weights), group=group, depth=depth,
                          precision=precision),
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((t_pad, o), x.dtype) for o in outs],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=limit),
        interpret=interpret,
        name="lora_indexed",
    )(slots, *runs, x, positions, *[in_hbm(a, interpret) for a, _ in weights],
      *[in_hbm(b, interpret) for _, b in weights])


def indexed_lora(x, weights, token_lora_idx, active_slots, count=None, *, group=None,
                 depth=DEPTH, interpret=False, precision="default"):
    """The LoRA delta of every slice of a linear: [T, sum of O] (x.dtype), token t's slice
    i = x[t] @ A_i[s].T @ B_i[s] for s = active_slots[token_lora_idx[t]], 0 where
    token_lora_idx[t] = -1.

    x [T, D]; weights [(A [N, R, D], B [N, R, O_i]), ...] (one pair per output slice,
    rank-first); token_lora_idx int32 [T]; active_slots int32 [P] (the onehot
    strategy's arrays, lora/step_layout.onehot_layout). count int32 [1]: given (the
    engine's host count of the step's adapters, listed first), the positions are used as
    they are: every one below it is some token's; None: the used ones are moved to the
    front on the device (used_first), a few small ops per call. Either way a token tile
    fetches only the positions from its lowest to its highest. group: adapters per grid
    step (None: as many as fill 128 lanes); depth: groups' buffers (both lowered while
    VMEM is short, ``fitting_plan``)."""
    t, d = x.shape
    r, p = weights[0][0].shape[1], active_slots.shape[0]
    outs = tuple(b.shape[2] for _, b in weights)
    wdt = weights[0][0].dtype
    start = max_group(r, p, wdt) if group is None else group
    tile, group, depth = fitting_plan(token_tile(t), d, outs, r, x.dtype, start, depth, wdt)
    t_pad = -(-t // tile) * tile
    if count is None:  # else the host's contract holds: no unused position below the count
        slots, positions, _ = used_first(token_lora_idx, active_slots)
    else:
        slots, positions = active_slots.astype(jnp.int32), token_lora_idx.astype(jnp.int32)
    if t_pad > t:  # concatenation, not jnp.pad (x64, see grouped_lora._i32)
        x = jnp.concatenate([x, jnp.zeros((t_pad - t, d), x.dtype)])
        positions = jnp.concatenate([positions, jnp.full((t_pad - t,), -1, jnp.int32)])
    outs = indexed_kernel(slots, positions[:, None], x, weights, tile=tile,
                          group=group, depth=depth, interpret=interpret, precision=precision)
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
    return out[:t]
