"""VMEM arithmetic of the LoRA Pallas kernels: pure Python, no jax import, so the
engine can check its kernel shapes at start-up on any backend.

The numbers are estimates from Mosaic's layout rules; `kernel_vmem_bytes` is meant
to err on the high side. On a TPU v5e (benchmarks/tpu_kernels.py) it did: blocks
estimated at up to 22.1 MiB compiled under Mosaic's default limit, and the first to
fail (CompileTimeScopedVmemOom) were estimated at 24.3 MiB.

Formula (bytes; B token block, F feature tile, R rank, s = dtype itemsize):

    pad(r, c, s) = roundup(r, 8 * 4 / s) * roundup(c, 128) * s
        Mosaic stores a 2-D block as (sublane, lane) tiles: (8, 128) for 32-bit,
        (16, 128) for 16-bit dtypes, so a rank-8 block occupies 128 lanes.
    shrink: 2 * [pad(B, F) + pad(R, F) + pad(B, R)]            x, A, ys blocks
            + pad(B, R, 4)                                      f32 accumulator scratch
            + pad(B, R, 4) + pad(B, R) + pad(F, R)              temporaries (below)
    expand: 2 * [pad(B, R) + pad(F, R) + pad(B, F)]            ys, B, zs blocks
            + pad(B, F, 4) + pad(B, F) + pad(R, F)              temporaries (below)

Every BlockSpec'd operand is double-buffered by the Pallas pipeline (block i+1 is
fetched while block i computes; the output block i-1 is written back while block i
is computed), hence the factor 2. Temporaries: the float32 matmul result and its
cast, and one copy of the weight block in the other orientation, an allowance for
Mosaic relaying out the NT matmul's operand (both kernels contract the weight's lane
dim). The scalar-prefetched block -> slot map lives in SMEM, not VMEM.

A shape "fits" a limit when estimate + VMEM_HEADROOM_BYTES <= limit: the headroom
covers what the estimate does not see (Mosaic's internal scratch, register spills).
"""

from __future__ import annotations

MiB = 1 << 20

# Mosaic's default scoped VMEM limit per kernel, 16 MiB on v5e/v6e; every generation
# is budgeted against it (on v5e every shape budgeted to fit it compiled). A kernel
# that fits it needs no compiler parameter at all.
DEFAULT_SCOPED_VMEM_BYTES = 16 * MiB
# Physical VMEM per TensorCore: 128 MiB on v5e/v6e, 64 MiB on v7x.
# Largest explicit vmem_limit_bytes we ever pass: 3/4 of the smallest physical VMEM
# (v7x's 64 MiB), so the same limit is valid on every generation and leaves 16 MiB
# for what XLA keeps resident in VMEM around the custom call. A shape needing more
# is refused at start-up (check_kernel_budget) instead of failing to compile.
VMEM_LIMIT_CEILING_BYTES = 48 * MiB
# Slack on top of every estimate (see the module docstring).
VMEM_HEADROOM_BYTES = 2 * MiB

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
KERNEL_OPS = ("shrink", "expand")


def dtype_name(dtype) -> str:
    """'bfloat16' for torch.bfloat16, jnp.dtype('bfloat16') or the string itself."""
    return str(dtype).rsplit(".", 1)[-1]


def itemsize(dtype) -> int:
    name = dtype_name(dtype)
    if name not in ITEMSIZE:
        raise ValueError(f"no VMEM itemsize for dtype {name!r}; known: {sorted(ITEMSIZE)}")
    return ITEMSIZE[name]


def _roundup(n: int, m: int) -> int:
    return -(-n // m) * m


def padded_block_bytes(rows: int, cols: int, size: int) -> int:
    """VMEM bytes of a [rows, cols] block of `size`-byte elements in Mosaic's tiling."""
    sublanes = 8 * 4 // size  # 8 rows of 32-bit, 16 of 16-bit: one (sublane, lane) tile
    return _roundup(rows, sublanes) * _roundup(cols, 128) * size


def kernel_vmem_bytes(op: str, token_block: int, feature_tile: int, rank: int, dtype) -> int:
    """Estimated VMEM of one kernel instance (formula in the module docstring).
    feature_tile is the D tile for shrink and the O tile for expand; activations and
    adapter weights share `dtype` (the torch wrappers cast the weights to it)."""
    s, b, f, r = itemsize(dtype), token_block, feature_tile, rank
    weight = padded_block_bytes(r, f, s) if op == "shrink" else padded_block_bytes(f, r, s)
    relayout = padded_block_bytes(f, r, s) if op == "shrink" else padded_block_bytes(r, f, s)
    if op == "shrink":
        blocks = padded_block_bytes(b, f, s) + weight + padded_block_bytes(b, r, s)
        acc = padded_block_bytes(b, r, 4)
        temps = padded_block_bytes(b, r, 4) + padded_block_bytes(b, r, s) + relayout
        return 2 * blocks + acc + temps
    if op == "expand":
        blocks = padded_block_bytes(b, r, s) + weight + padded_block_bytes(b, f, s)
        temps = padded_block_bytes(b, f, 4) + padded_block_bytes(b, f, s) + relayout
        return 2 * blocks + temps
    raise ValueError(f"unknown kernel op {op!r}; expected one of {KERNEL_OPS}")


def required_limit_bytes(estimate: int) -> int:
    """The scoped VMEM limit a kernel with this estimate needs: estimate plus headroom,
    rounded up to whole MiB."""
    return _roundup(estimate + VMEM_HEADROOM_BYTES, MiB)


def explicit_vmem_limit(estimate: int) -> int | None:
    """vmem_limit_bytes to pass to pallas_call: None while the default scoped limit
    suffices (the compiler parameters stay as they were), else the required limit.
    May exceed VMEM_LIMIT_CEILING_BYTES; callers refuse such shapes."""
    needed = required_limit_bytes(estimate)
    return None if needed <= DEFAULT_SCOPED_VMEM_BYTES else needed
