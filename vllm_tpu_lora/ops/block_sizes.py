"""Block sizes for the LoRA ops, kept apart from the kernels (as JAX's Pallas ops do).

Nothing here has been measured on a TPU yet (no TPU on the dev machines); the
entries follow from TPU layout rules and VMEM budgets, and `token_block` for the
XLA backend was chosen with benchmarks/benchmark_ops.py on XLA CPU. Replace rows
with measured ones when a TPU run exists; lookups never need to change.

Rules the values respect (Mosaic legality): the last two dims of every block are
divisible by (8, 128) or equal the full array dims. bf16 packs two rows per
sublane, so its natural token tile is 16 rows. VMEM: every kernel shape's blocks
are chosen against the estimate in ops/vmem.py, for every allowed max_lora_rank
(up to 512), feature widths up to 16k and more, in f32, bf16 and f16.
"""

from __future__ import annotations

from typing import NamedTuple

from vllm_tpu_lora.ops import vmem

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

# Largest feature tile (lanes) per dtype, the values budgeted for rank <= 64 (so
# those shapes keep their blocks; fewer, larger tiles mean fewer grid steps and
# longer DMAs). This is only a cap: `kernel_blocks` shrinks the tile until the shape's VMEM
# estimate (ops/vmem.py) fits the default scoped limit, which matters from rank 256
# up (a [512, 8192] bf16 adapter block alone is 8 MiB, 16 MiB double-buffered).
MAX_FEATURE_TILE: dict[str, int] = {"float32": 4096, "bfloat16": 8192, "float16": 8192}


class KernelBlocks(NamedTuple):
    token_block: int  # B: rows per grid step (the segment layout's block)
    feature_block: int  # D tile for shrink, O tile for expand
    vmem_limit_bytes: int | None  # explicit scoped VMEM limit, None = Mosaic's default
    vmem_bytes: int  # the estimate the choice was made on (ops/vmem.py)


def token_block(dtype, backend: str = "pallas") -> int:
    """Token block B for a segment layout built for `backend` and activation `dtype`."""
    key = (backend, vmem.dtype_name(dtype))
    if key not in TOKEN_BLOCK:
        raise ValueError(f"no token block for backend={backend!r} dtype={key[1]!r}")
    return TOKEN_BLOCK[key]


def legal_feature_tiles(features: int, dtype) -> list[int]:
    """Legal tiles of a feature dim up to the dtype's lane cap, largest first: the full
    dim if it fits the cap, then every multiple of 128 dividing it (the kernels have no
    ragged last tile). A dim that is not a multiple of 128 has only itself."""
    cap = MAX_FEATURE_TILE.get(vmem.dtype_name(dtype), 4096)
    if features % 128:
        return [features]
    tiles = [t for t in range(min(cap, features) // 128 * 128, 127, -128) if features % t == 0]
    return tiles or [features]


def kernel_blocks(op: str, features: int, rank: int, dtype) -> KernelBlocks:
    """The blocks of one kernel shape, used by the torch wrappers and the TPU export
    alike: the largest legal feature tile whose VMEM estimate fits Mosaic's default
    scoped limit; if none does (only a wide dim that is not a multiple of 128 at a
    large rank), the smallest tile with an explicit vmem_limit_bytes (which may exceed
    vmem.VMEM_LIMIT_CEILING_BYTES: check_kernel_budget refuses those shapes)."""
    block = token_block(dtype, "pallas")
    tiles = legal_feature_tiles(features, dtype)
    for tile in tiles:
        estimate = vmem.kernel_vmem_bytes(op, block, tile, rank, dtype)
        limit = vmem.explicit_vmem_limit(estimate)
        if limit is None:
            return KernelBlocks(block, tile, None, estimate)
    return KernelBlocks(block, tile, limit, estimate)  # the smallest tile: least VMEM
