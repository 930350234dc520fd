"""Block sizes for the LoRA ops, kept apart from the kernels (as JAX's Pallas ops do).

Nothing here has been measured on a TPU yet (no TPU on the dev machines); the
entries follow from TPU layout rules and VMEM budgets, and `token_block` for the
XLA backend was chosen with benchmarks/benchmark_ops.py on XLA CPU. Replace rows
with measured ones when a TPU run exists; lookups never need to change.

Rules the values respect (Mosaic legality): the last two dims of every block are
divisible by (8, 128) or equal the full array dims. bf16 packs two rows per
sublane, so its natural token tile is 16 rows.
"""

from __future__ import annotations

from typing import NamedTuple

# Token block B of the segment layout, keyed by (backend, dtype name). Larger B
# wastes up to min(N, T) * (B - 1) padded rows per step; smaller B under-fills the
# MXU rows on TPU. On XLA CPU, 16 beat 8 (its batched matmul is slow on 8-row
# blocks) and 32 gained little more while padding more rows; Pallas interpret
# mode costs per grid step, but f32 stays at the TPU-natural 8.
TOKEN_BLOCK: dict[tuple[str, str], int] = {
    ("pallas", "float32"): 8,
    ("pallas", "bfloat16"): 16,
    ("xla", "float32"): 16,
    ("xla", "bfloat16"): 16,
    # float16 packs like bfloat16 (two rows per sublane); on XLA CPU it runs as bf16 does.
    ("pallas", "float16"): 16,
    ("xla", "float16"): 16,
}

# Largest feature tile (lanes) per dtype: a [R_max=64, tile] adapter block plus a
# [B, tile] activation block, double-buffered, stays far below the 16 MiB default
# scoped VMEM of v5e/v6e for every model width the runner uses (<= 8192).
MAX_FEATURE_TILE: dict[str, int] = {"float32": 4096, "bfloat16": 8192, "float16": 8192}


class KernelBlocks(NamedTuple):
    token_block: int  # B: rows per grid step (the segment layout's block)
    feature_block: int  # D tile for shrink, O tile for expand


def _dtype_name(dtype) -> str:
    name = str(dtype)
    return name.rsplit(".", 1)[-1]  # torch.bfloat16 / jnp dtype('bfloat16') -> bfloat16


def token_block(dtype, backend: str = "pallas") -> int:
    """Token block B for a segment layout built for `backend` and activation `dtype`."""
    key = (backend, _dtype_name(dtype))
    if key not in TOKEN_BLOCK:
        raise ValueError(f"no token block for backend={backend!r} dtype={key[1]!r}")
    return TOKEN_BLOCK[key]


def feature_block(features: int, dtype) -> int:
    """Largest legal tile of a feature dim: the full dim if it fits, else the largest
    multiple of 128 dividing it that is <= MAX_FEATURE_TILE (full dims are always legal)."""
    cap = MAX_FEATURE_TILE.get(_dtype_name(dtype), 4096)
    if features <= cap or features % 128:
        return features
    for tile in range(cap - cap % 128, 127, -128):
        if features % tile == 0:
            return tile
    return features


def kernel_blocks(features: int, dtype) -> KernelBlocks:
    """Lookup used by the Pallas wrappers: (token block, feature tile) for one op shape."""
    return KernelBlocks(token_block(dtype, "pallas"), feature_block(features, dtype))
