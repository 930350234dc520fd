"""The LoRA Pallas kernels on the segment layout: JAX only, no torch import, so they
run (and are measured) on a TPU host that has JAX but not torch_xla
(benchmarks/tpu_kernels.py); ops/bgmv_pallas.py bridges them into torch_xla graphs.

Pallas TPU kernels for the LoRA ops on the segment layout, bridged into torch_xla.

The runner's segment layout (built once per step on the host, lora/step_layout.py)
sorts tokens by adapter and pads each adapter's run to the token block B, so every
token block belongs to exactly one adapter. The kernels grid over token blocks and
scalar-prefetch `block_slot`, the DEVICE slot of each block: each BlockSpec index_map
fetches that block's adapter straight from the full stacked buffers [max_loras, ...]
(no per-op copy of the active adapters), and FLOPs are T_pad*R*D, not N*T*R*D.
Unreferenced slots are never loaded, so NaN in them cannot leak.

What the grid order really re-fetches (Pallas skips a DMA when a block index repeats
from one grid step to the next):
- shrink, grid (T_pad/B, D/block_d), D innermost: when D fits one tile (block_d = D,
  the case for widths up to MAX_FEATURE_TILE unless the rank is large, see VMEM
  below) the adapter's [R, D] block index repeats across the consecutive token
  blocks of one adapter, so it streams once per adapter; when D is tiled, the index
  changes every step and the adapter's tiles are re-fetched for each of its token
  blocks (R*D per block: small next to the x blocks at ranks <= 64, comparable to
  them or larger at rank 256-512).
- expand, grid (O/block_o, T_pad/B), token blocks innermost: per O tile, each adapter's
  [block_o, R] tile is fetched once per run of its blocks, i.e. once per adapter per tile.
Trailing padding blocks (block_slot = -1) re-point their index maps at the last valid
block (no new DMA) and write zeros under pl.when.

VMEM: the blocks come from block_sizes.kernel_blocks (the largest feature tile whose
estimate fits Mosaic's default scoped limit, ops/vmem.py); a kernel whose blocks need
more passes an explicit vmem_limit_bytes, computed from its actual blocks, and one
needing more than vmem.VMEM_LIMIT_CEILING_BYTES is refused with a ValueError.

`interpret=True` runs the same kernels on any backend (PJRT CPU); Mosaic on TPU.
Only the matmuls are kernels; the permutation gathers and the scatter back stay
torch ops and reuse the XLA backend's code.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from vllm_tpu_lora.ops import vmem
from vllm_tpu_lora.ops.block_sizes import kernel_blocks


def _fetch_block(i, nvalid_ref):
    # Padding blocks come after all valid ones: point them at the last valid block
    # so the pipeline sees an unchanged block index and issues no DMA.
    return jnp.maximum(jnp.minimum(i, nvalid_ref[0] - 1), 0)


def _fetch_slot(i, slot_ref, nvalid_ref):
    return jnp.maximum(slot_ref[_fetch_block(i, nvalid_ref)], 0)  # -1 (no tokens) -> 0


# torch_xla's mat_mul_precision names -> jax's. On a TPU "default" multiplies float32
# in one bfloat16 pass (measured on v5e: ~1% error relative to the output's RMS,
# benchmarks/tpu_kernels.py); the torch wrappers pass the precision the model's own
# matmuls were traced with, so a float32 engine set to "highest" gets float32 LoRA too.
PRECISIONS = {
    "default": jax.lax.Precision.DEFAULT,
    "high": jax.lax.Precision.HIGH,
    "highest": jax.lax.Precision.HIGHEST,
}


def x64(on: bool = True):
    """A context with JAX's 64-bit types on (or off) for what is traced or run inside
    (jax >= 0.8: jax.enable_x64, a config state callable as a context manager)."""
    return (jax.enable_x64 if hasattr(jax, "enable_x64") else jax.experimental.enable_x64)(on)


def traced_without_x64(fn):
    """fn traced with JAX's 32-bit defaults, also inside an x64 trace (the jax runtime's
    graphs, whose int64 step inputs need x64): Mosaic takes no 64-bit scalars, and under
    x64 a Pallas kernel's Python-int constants and grid indices become int64 ("Bad lhs
    type", an index map returning i64, lax.div of int32 by int64). Also at JAX's default
    matmul precision: with "highest" set for the process (float32 parity runs) Mosaic
    refused every bfloat16 dot in a kernel ("Bad lhs type", seen on a v5e); the LoRA
    kernels pass their own precision explicitly."""
    def call(*args, **kwargs):
        with x64(False), jax.default_matmul_precision("default"):
            return fn(*args, **kwargs)
    return call


def jax_matmul_precision() -> str:
    """JAX's default matmul precision (what torchax's matmuls use) in the names the LoRA
    kernels take, so a float32 engine set to "highest" gets float32 LoRA products too."""
    value = str(jax.config.jax_default_matmul_precision or "default").lower()
    if value in ("highest", "float32"):
        return "highest"
    if value in ("high", "bfloat16_3x", "tensorfloat32"):
        return "high"
    return "default"


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(
            f"unknown matmul precision {precision!r}; expected one of {sorted(PRECISIONS)}"
        )


def dot_precision(dtype, precision: str):
    """A kernel dot's precision: as asked for float32 operands; DEFAULT, explicitly, for
    bfloat16 ones, which are one exact MXU pass anyway. Explicitly: with None, a
    process-wide "highest" (jax_default_matmul_precision) reaches the kernel's dot and
    Mosaic refuses a bfloat16 dot at fp32 ("Bad lhs type", seen on a v5e)."""
    return PRECISIONS[precision] if dtype == jnp.float32 else jax.lax.Precision.DEFAULT


def in_hbm(x, interpret: bool):
    """x for a pallas_call that reads it by the kernel's own DMAs (memory space ANY),
    pinned to HBM. Left to XLA, a TPU's memory-space assignment may prefetch the whole
    array into VMEM before the call: in the engine's decode step over 32 of 128 slots it
    copied 34 whole 128-slot LoRA buffers (210 MB a step) into VMEM for DMA copies that
    read 32 slots of each (docs/benchmarks.md, tenth session). The interpreter has no
    memory spaces."""
    if interpret:
        return x
    return pltpu.with_memory_space_constraint(x, pltpu.HBM)


def _nt_dot(a, b, precision):
    """a [M, K] @ b [N, K].T with float32 accumulation (MXU-native NT matmul)."""
    return jax.lax.dot_general(
        a,
        b,
        (((1,), (1,)), ((), ())),
        precision=dot_precision(a.dtype, precision),
        preferred_element_type=jnp.float32,
    )


def _check_tiles(name, rows, block, features, tile, what):
    if block <= 0 or rows % block or (block % 8 and block != rows):
        raise ValueError(
            f"{name}: token block {block} must divide T_pad={rows} and be a multiple of 8"
        )
    if tile <= 0 or features % tile or (tile % 128 and tile != features):
        raise ValueError(
            f"{name}: {what} tile {tile} must divide {what}={features} and be a multiple "
            f"of 128 (or equal {what})"
        )


def _vmem_limit(name, op, block, tile, rank, dtype) -> int | None:
    """The explicit vmem_limit_bytes these blocks need (None: Mosaic's default suffices,
    so the compiler parameters stay as before); refuses blocks that need more than
    the ceiling. Computed from the blocks actually used, so an explicit tile (tests,
    benchmarks) gets the limit it needs too."""
    estimate = vmem.kernel_vmem_bytes(op, block, tile, rank, dtype)
    limit = vmem.explicit_vmem_limit(estimate)
    if limit is not None and limit > vmem.VMEM_LIMIT_CEILING_BYTES:
        raise ValueError(
            f"{name}: blocks (token {block}, feature tile {tile}) at rank {rank} "
            f"{vmem.dtype_name(dtype)} need ~{limit // vmem.MiB} MiB of VMEM, more than "
            f"the {vmem.VMEM_LIMIT_CEILING_BYTES // vmem.MiB} MiB allowed"
        )
    return limit


def _shrink_kernel(slot_ref, nvalid_ref, x_ref, w_ref, o_ref, acc_ref, *, precision):
    i, k = pl.program_id(0), pl.program_id(1)

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(slot_ref[i] >= 0)  # padding blocks skip the matmul and store zeros
    def _accumulate():
        acc_ref[...] += _nt_dot(x_ref[...], w_ref[...].astype(x_ref.dtype), precision)

    @pl.when(k == pl.num_programs(1) - 1)
    def _store():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block", "block_d", "interpret", "precision"))
def shrink_kernel(
    block_slot, xs, lora_a, *, block, block_d=None, interpret=False, precision="default"
):
    """Semantics: ys[r] = xs[r] @ lora_a[block_slot[r // B]].T, 0 in blocks with slot -1.

    Shapes: block_slot int32 [T_pad/B], xs [T_pad, D] (segment layout), lora_a
    [N, R, D] -> ys [T_pad, R] (xs.dtype). Grid (T_pad/B, D/block_d); D is the
    reduction axis, accumulated in a float32 VMEM scratch. block_d defaults to the
    VMEM-budgeted tile of block_sizes.kernel_blocks.
    """
    (t_pad, d), d_w = xs.shape, lora_a.shape[2]
    if block_d is None:
        block_d = kernel_blocks("shrink", d, lora_a.shape[1], xs.dtype, block).feature_block
    if d_w != d or block_slot.shape != (t_pad // max(block, 1),):
        raise ValueError(
            f"shrink_kernel: xs {xs.shape}, lora_a {lora_a.shape}, block_slot "
            f"{block_slot.shape} do not match [T_pad, D], [N, R, D], [T_pad/{block}]"
        )
    _check_tiles("shrink_kernel", t_pad, block, d, block_d, "D")
    _check_precision(precision)
    limit = _vmem_limit("shrink_kernel", "shrink", block, block_d, lora_a.shape[1], xs.dtype)
    return shrink_pallas_call(
        block_slot,
        xs,
        lora_a,
        block=block,
        block_d=block_d,
        interpret=interpret,
        vmem_limit_bytes=limit,
        precision=precision,
    )


def shrink_pallas_call(
    block_slot, xs, lora_a, *, block, block_d, interpret, vmem_limit_bytes=None, precision="default"
):
    """The unvalidated pallas_call behind shrink_kernel (tests feed it illegal tiles
    to show that Mosaic itself rejects them). vmem_limit_bytes None keeps Mosaic's
    default scoped VMEM limit."""
    (t_pad, d), rank = xs.shape, lora_a.shape[1]
    nvalid = jnp.sum(block_slot >= 0, dtype=jnp.int32).reshape(1)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(t_pad // block, d // block_d),
        in_specs=[
            pl.BlockSpec((block, block_d), lambda i, k, s, v: (_fetch_block(i, v), k)),
            pl.BlockSpec((None, rank, block_d), lambda i, k, s, v: (_fetch_slot(i, s, v), 0, k)),
        ],
        out_specs=pl.BlockSpec((block, rank), lambda i, k, s, v: (i, 0)),
        scratch_shapes=[pltpu.VMEM((block, rank), jnp.float32)],
    )
    return pl.pallas_call(
        functools.partial(_shrink_kernel, precision=precision),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((t_pad, rank), xs.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=vmem_limit_bytes
        ),
        interpret=interpret,
        name="lora_segment_shrink",
    )(block_slot.astype(jnp.int32), nvalid, xs, lora_a)


def _expand_kernel(slot_ref, nvalid_ref, y_ref, w_ref, o_ref, *, precision):
    i = pl.program_id(1)

    @pl.when(slot_ref[i] >= 0)
    def _compute():
        o_ref[...] = _nt_dot(y_ref[...], w_ref[...].astype(y_ref.dtype), precision).astype(
            o_ref.dtype
        )

    @pl.when(slot_ref[i] < 0)
    def _zero():
        o_ref[...] = jnp.zeros_like(o_ref)


@functools.partial(jax.jit, static_argnames=("block", "block_o", "interpret", "precision"))
def expand_kernel(
    block_slot, ys, lora_b, *, block, block_o=None, interpret=False, precision="default"
):
    """Semantics: zs[r] = ys[r] @ lora_b[block_slot[r // B]].T, 0 in blocks with slot -1.

    Shapes: block_slot int32 [T_pad/B], ys [T_pad, R] (segment layout), lora_b
    [N, O, R] -> zs [T_pad, O] (ys.dtype). Grid (O/block_o, T_pad/B): token blocks
    innermost, so one adapter's [block_o, R] tile is fetched once per run of blocks.
    block_o defaults to the VMEM-budgeted tile of block_sizes.kernel_blocks.
    """
    (t_pad, rank), (o, rank_w) = ys.shape, lora_b.shape[1:]
    if block_o is None:
        block_o = kernel_blocks("expand", o, rank, ys.dtype, block).feature_block
    if rank_w != rank or block_slot.shape != (t_pad // max(block, 1),):
        raise ValueError(
            f"expand_kernel: ys {ys.shape}, lora_b {lora_b.shape}, block_slot "
            f"{block_slot.shape} do not match [T_pad, R], [N, O, R], [T_pad/{block}]"
        )
    _check_tiles("expand_kernel", t_pad, block, o, block_o, "O")
    _check_precision(precision)
    limit = _vmem_limit("expand_kernel", "expand", block, block_o, rank, ys.dtype)
    return expand_pallas_call(
        block_slot,
        ys,
        lora_b,
        block=block,
        block_o=block_o,
        interpret=interpret,
        vmem_limit_bytes=limit,
        precision=precision,
    )


def expand_pallas_call(
    block_slot, ys, lora_b, *, block, block_o, interpret, vmem_limit_bytes=None, precision="default"
):
    """The unvalidated pallas_call behind expand_kernel."""
    (t_pad, rank), o = ys.shape, lora_b.shape[1]
    nvalid = jnp.sum(block_slot >= 0, dtype=jnp.int32).reshape(1)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(o // block_o, t_pad // block),
        in_specs=[
            pl.BlockSpec((block, rank), lambda j, i, s, v: (_fetch_block(i, v), 0)),
            pl.BlockSpec((None, block_o, rank), lambda j, i, s, v: (_fetch_slot(i, s, v), j, 0)),
        ],
        out_specs=pl.BlockSpec((block, block_o), lambda j, i, s, v: (i, j)),
    )
    return pl.pallas_call(
        functools.partial(_expand_kernel, precision=precision),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((t_pad, o), ys.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel"), vmem_limit_bytes=vmem_limit_bytes
        ),
        interpret=interpret,
        name="lora_segment_expand",
    )(block_slot.astype(jnp.int32), nvalid, ys, lora_b)
