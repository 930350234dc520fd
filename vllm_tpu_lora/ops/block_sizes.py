"""Block sizes for the LoRA ops, kept apart from the kernels (as JAX's Pallas ops do).

The entries follow from TPU layout rules and VMEM budgets; `token_block` for the
XLA backend was chosen with benchmarks/benchmark_ops.py on XLA CPU. TPU v5e runs
(benchmarks/tpu_kernels.py, docs/results/tpu_kernels.jsonl, JAX only) checked them:
every block this module picks for 7 widths (128 to 28672) x 5 ranks (8 to 512) x
f32/bf16 compiled, and the Pallas token block was swept per step shape (below,
`PALLAS_STEP_BLOCKS`). Lookups never need to change.

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
    # float16 on XLA CPU runs as bf16 does. The Pallas kernels run float16 in float32
    # (pallas_compute_dtype), so its Pallas block is float32's.
    ("xla", "float16"): 16,
}

# Larger Pallas token blocks for steps with many rows per adapter: (block, least T / S),
# the first entry a step reaches wins, else TOKEN_BLOCK. A larger block means fewer,
# fuller grid steps but up to S * (block - 1) more padding rows, so what decides is the
# rows per slot of the graph (token bucket T over slot bucket S). Measured on a TPU v5e
# (`tpu_kernels.py --parts blocks`, rank 16, D 4096, O 4096 / 14336; ms of one LoRA
# linear's delta, docs/results/tpu_kernels.jsonl runs 3 to 5), e.g. bf16:
#   T/S 16 (T=64 S=4):     B16 0.0272 | B32 0.0280 | B64 0.0349    (O 14336)
#   T/S 32 (T=128 S=4):    B16 0.0353 | B32 0.0319 | B64 0.0379
#   T/S 32 (T=512 S=16):   B16 0.0991 | B32 0.0870 | B64 0.1189
#   T/S 128 (T=128 S=1):   B16 0.0300 | B32 0.0251 | B64 0.0263
#   T/S 512 (T=512 S=1):   B16 0.0754 | B32 0.0526 | B64 0.0523   (1024 S=1: B64 -11%)
# and float32:
#   T/S 4 (T=16 S=4):      B8 0.0254 | B16 0.0265 | B32 0.0339
#   T/S 16 (T=64 S=4):     B8 0.0377 | B16 0.0337 | B32 0.0375
#   T/S 64 (T=256 S=4):    B8 0.0851 | B16 0.0642 | B32 0.0598
#   T/S 128 (T=2048 S=16): B8 0.7308 | B16 0.5578 | B32 0.5221 | B64 0.5990
# (B64 in float32 won only at T/S 512, by <1%: not taken). Decode buckets (T/S under
# 16 in f32, 32 in bf16) keep the base block, which was best there by up to 1.3x.
PALLAS_STEP_BLOCKS: dict[str, tuple[tuple[int, int], ...]] = {
    "float32": ((32, 64), (16, 16)),
    "bfloat16": ((64, 256), (32, 32)),
}

# The dtype the Pallas kernels compute in, per activation dtype. Mosaic on TPU v5e
# cannot load float16 vectors (every float16 kernel failed to compile with "Invalid
# vector type for load", benchmarks/tpu_kernels.py), so float16 runs in float32: the
# upcast is exact, the torch wrappers cast the result back, and the blocks and VMEM
# budget are float32's.
PALLAS_COMPUTE_DTYPE: dict[str, str] = {"float16": "float32"}

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


def padded_num_tokens(num_tokens: int, num_slots: int, block: int) -> int:
    """Static padded length of a segment layout: every non-empty slot wastes at most
    block - 1 rows. Pure Python here, so JAX-only code (benchmarks/tpu_kernels.py) uses
    the same rule as the torch ops."""
    worst = num_tokens + min(num_slots, num_tokens) * (block - 1)
    return max(block, -(-worst // block) * block)


def pallas_compute_dtype(dtype) -> str:
    """The dtype name the Pallas kernels run in for activations of `dtype`."""
    name = vmem.dtype_name(dtype)
    return PALLAS_COMPUTE_DTYPE.get(name, name)


def token_block(dtype, backend: str = "pallas", num_tokens: int = 0,
                num_slots: int = 1) -> int:
    """Token block B for a segment layout built for `backend` and activation `dtype`;
    for the Pallas kernels, of a step of token bucket `num_tokens` over slot bucket
    `num_slots` (0 tokens: the base block, which every step may use)."""
    name = pallas_compute_dtype(dtype) if backend == "pallas" else vmem.dtype_name(dtype)
    key = (backend, name)
    if key not in TOKEN_BLOCK:
        raise ValueError(f"no token block for backend={backend!r} dtype={key[1]!r}")
    if backend == "pallas":
        for block, rows_per_slot in PALLAS_STEP_BLOCKS.get(name, ()):
            if num_tokens >= rows_per_slot * max(1, num_slots):
                return block
    return TOKEN_BLOCK[key]


def pallas_token_blocks(dtype) -> tuple[int, ...]:
    """Every token block the Pallas kernels may run with for activations of `dtype`
    (the base block and the larger step blocks), smallest first."""
    name = pallas_compute_dtype(dtype)
    larger = [block for block, _ in PALLAS_STEP_BLOCKS.get(name, ())]
    return tuple(sorted({token_block(name, "pallas"), *larger}))


def legal_feature_tiles(features: int, dtype) -> list[int]:
    """Legal tiles of a feature dim up to the dtype's lane cap, largest first: the full
    dim if it fits the cap, then every multiple of 128 dividing it (the kernels have no
    ragged last tile). A dim that is not a multiple of 128 has only itself."""
    cap = MAX_FEATURE_TILE.get(vmem.dtype_name(dtype), 4096)
    if features % 128:
        return [features]
    tiles = [t for t in range(min(cap, features) // 128 * 128, 127, -128) if features % t == 0]
    return tiles or [features]


def kernel_blocks(op: str, features: int, rank: int, dtype,
                  block: int | None = None) -> KernelBlocks:
    """The blocks of one kernel shape, used by the torch wrappers and the TPU export
    alike: the largest legal feature tile whose VMEM estimate fits Mosaic's default
    scoped limit; if none does (only a wide dim that is not a multiple of 128 at a
    large rank), the smallest tile with an explicit vmem_limit_bytes (which may exceed
    vmem.VMEM_LIMIT_CEILING_BYTES: check_kernel_budget refuses those shapes).
    `dtype` is the activations'; the blocks are those of the kernels' compute dtype.
    `block`: the step's token block (the segment layout's), default the base one."""
    dtype = pallas_compute_dtype(dtype)
    block = block or token_block(dtype, "pallas")
    tiles = legal_feature_tiles(features, dtype)
    for tile in tiles:
        estimate = vmem.kernel_vmem_bytes(op, block, tile, rank, dtype)
        limit = vmem.explicit_vmem_limit(estimate)
        if limit is None:
            return KernelBlocks(block, tile, None, estimate)
    return KernelBlocks(block, tile, limit, estimate)  # the smallest tile: least VMEM
