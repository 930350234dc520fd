"""VMEM budget of the Pallas kernels (ops/vmem.py, block_sizes.kernel_blocks) and the
start-up check (ops/kernel_shapes.check_kernel_budget). Pure arithmetic, no jax:
the lowering of the same shapes for TPU is in test_ops_export.py.

Realistic configurations: Llama-3-8B, Qwen2.5-7B and Gemma-2-9B with LoRA on all
seven linears, ranks 8-256, bf16. Their LoRA widths come from the real LoRA layers
(lora/layers.py wrapping packed qkv / gate_up, built on the meta device) and their
kernel shapes from the same listing the runner uses (ModelRunner.lora_kernel_shapes).
"""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from vllm_tpu_lora.layers.linear import MergedLinear
from vllm_tpu_lora.lora.layers import wrap_lora_layers
from vllm_tpu_lora.lora.punica import PunicaWrapper
from vllm_tpu_lora.ops import vmem
from vllm_tpu_lora.ops.block_sizes import MAX_FEATURE_TILE, kernel_blocks, pallas_token_blocks
from vllm_tpu_lora.ops.kernel_shapes import (
    KernelShape,
    check_kernel_budget,
    lora_layer_kernel_shapes,
    shape_blocks,
)

MiB = vmem.MiB
# name: (hidden, intermediate, attention heads, kv heads, head_dim)
CONFIGS = {
    "Llama-3-8B": (4096, 14336, 32, 8, 128),
    "Qwen2.5-7B": (3584, 18944, 28, 4, 128),
    "Gemma-2-9B": (3584, 14336, 16, 8, 256),
}
RANKS = [8, 16, 32, 64, 128, 256]
ALLOWED_RANKS = [1, 8, 16, 32, 64, 128, 256, 320, 512]  # config.LoRAConfig.max_lora_rank
TOKEN_BUCKETS = [16, 32, 64, 128, 256, 512]
SLOT_BUCKETS = [0, 1, 2, 4, 8]  # 0: the base-only graph, no kernel


def _decoder_layer(hidden, inter, heads, kv_heads, head_dim) -> nn.Module:
    """The linears of one decoder layer as models/llama.py packs them."""
    q, kv = heads * head_dim, kv_heads * head_dim
    attn, mlp = nn.Module(), nn.Module()
    attn.qkv_proj = MergedLinear(hidden, [q, kv, kv], bias=False)
    attn.o_proj = nn.Linear(q, hidden, bias=False)
    mlp.gate_up_proj = MergedLinear(hidden, [inter, inter], bias=False)
    mlp.down_proj = nn.Linear(inter, hidden, bias=False)
    layer = nn.Module()
    layer.self_attn, layer.mlp = attn, mlp
    return nn.ModuleDict({"layer": layer})


def lora_layers(name: str, rank: int = 8) -> dict:
    """The real LoRA wrappers of one decoder layer of config `name` (meta device: no
    memory), as the engine builds them with all seven linears targeted."""
    with torch.device("meta"):
        model = _decoder_layer(*CONFIGS[name])
        return wrap_lora_layers(model, PunicaWrapper("pallas"), 1, rank, torch.bfloat16)


def lora_widths(name: str) -> list[tuple[int, list[int]]]:
    """(in_features, output_slices) of each LoRA layer: what the kernels are called on."""
    return [(lay.in_features, lay.output_slices) for lay in lora_layers(name).values()]


def realistic_shapes(name: str, ranks=RANKS, tokens=TOKEN_BUCKETS, slots=SLOT_BUCKETS):
    """Every kernel shape a runner would precompile for config `name` in bf16."""
    widths = lora_widths(name)
    return [
        shape
        for rank in ranks
        for shape in lora_layer_kernel_shapes(widths, tokens, slots, rank, "bfloat16")
    ]


def test_lora_widths_are_the_packed_slices():
    widths = {
        k.rsplit(".", 1)[-1]: (v.in_features, v.output_slices)
        for k, v in lora_layers("Gemma-2-9B").items()
    }
    assert widths == {
        "qkv_proj": (3584, [4096, 2048, 2048]),
        "o_proj": (4096, [3584]),
        "gate_up_proj": (3584, [14336, 14336]),
        "down_proj": (14336, [3584]),
    }


def test_shape_listing_matches_the_runner():
    from vllm_tpu_lora.lora.manager import LoRAManager
    from vllm_tpu_lora.runner.model_runner import ModelRunner

    layers = lora_layers("Qwen2.5-7B", rank=64)
    manager = SimpleNamespace(layers=layers, max_rank=64)
    manager.kernel_layers = lambda: LoRAManager.kernel_layers(manager)
    fake_runner = SimpleNamespace(
        lora_manager=manager,
        token_ladder=TOKEN_BUCKETS,
        slot_ladder=SLOT_BUCKETS,
    )
    assert ModelRunner.lora_kernel_shapes(fake_runner, "bfloat16") == realistic_shapes(
        "Qwen2.5-7B", ranks=[64]
    )


def test_padded_block_bytes_follow_mosaic_tiling():
    assert vmem.padded_block_bytes(8, 8, 4) == 8 * 128 * 4  # rank 8 fills 128 lanes
    assert vmem.padded_block_bytes(8, 256, 2) == 16 * 256 * 2  # bf16: 16-row tiles
    assert vmem.padded_block_bytes(16, 4096, 2) == 16 * 4096 * 2
    # shrink, bf16, B=16, D tile 4096, R=64, by hand from the formula in ops/vmem.py:
    x, a, ys = 16 * 4096 * 2, 64 * 4096 * 2, 16 * 128 * 2
    acc, product, cast, relayout = 16 * 128 * 4, 16 * 128 * 4, 16 * 128 * 2, 4096 * 128 * 2
    expected = 2 * (x + a + ys) + acc + product + cast + relayout
    assert vmem.kernel_vmem_bytes("shrink", 16, 4096, 64, "bfloat16") == expected


@pytest.mark.parametrize("name", list(CONFIGS))
def test_realistic_shapes_fit_the_default_scoped_vmem(name):
    """Every shape (op x token bucket x slot bucket x width x rank 8-256, bf16) has
    legal blocks whose estimate + headroom fits Mosaic's default 16 MiB: no explicit
    limit needed, and the start-up check accepts the configuration."""
    shapes, widths = realistic_shapes(name), lora_widths(name)
    num_widths = len({d for d, _ in widths}) + len({o for _, slices in widths for o in slices})
    assert len(shapes) == len(RANKS) * len(TOKEN_BUCKETS) * 4 * num_widths
    for shape in shapes:
        blocks = shape_blocks(shape)
        tile = blocks.feature_block
        assert shape.features % tile == 0 and (tile % 128 == 0 or tile == shape.features)
        assert blocks.vmem_bytes == vmem.kernel_vmem_bytes(
            shape.op, blocks.token_block, tile, shape.rank, shape.dtype
        )
        assert blocks.vmem_limit_bytes is None, shape
        assert vmem.required_limit_bytes(blocks.vmem_bytes) <= vmem.DEFAULT_SCOPED_VMEM_BYTES
    check_kernel_budget(shapes)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_every_allowed_rank_and_width_up_to_16k_fits(dtype):
    """The block table's domain: every allowed max_lora_rank (1-512) x every width that
    is a multiple of 128 up to 16,384, both ops, at every token block a step may use:
    blocks fit the default scoped limit."""
    for op in ("shrink", "expand"):
        for rank in ALLOWED_RANKS:
            for features in range(128, 16384 + 1, 128):
                for token_block in pallas_token_blocks(dtype):
                    blocks = kernel_blocks(op, features, rank, dtype, token_block)
                    assert blocks.token_block == token_block
                    assert blocks.vmem_limit_bytes is None, (op, features, rank, dtype, token_block)
                    assert blocks.feature_block <= MAX_FEATURE_TILE[dtype]


def test_the_old_overflowing_shapes_now_fit():
    """Rank 512 at width 4,096 (f32) / 8,192 (bf16): the old rank-blind full-width tile
    overflowed the default limit; the budgeted tile fits it."""
    for op in ("shrink", "expand"):
        for features, dtype, block in ((4096, "float32", 8), (8192, "bfloat16", 16)):
            old = vmem.kernel_vmem_bytes(op, block, features, 512, dtype)
            assert vmem.required_limit_bytes(old) > vmem.DEFAULT_SCOPED_VMEM_BYTES
            new = kernel_blocks(op, features, 512, dtype)
            assert new.feature_block < features and new.vmem_limit_bytes is None
            assert vmem.required_limit_bytes(new.vmem_bytes) <= vmem.DEFAULT_SCOPED_VMEM_BYTES


def test_untileable_width_gets_an_explicit_limit_within_the_ceiling():
    """A width that is not a multiple of 128 cannot be tiled: at rank 512 f32 its one
    block needs more than the default, so it gets an explicit vmem_limit_bytes."""
    blocks = kernel_blocks("shrink", 4100, 512, "float32")
    assert blocks.feature_block == 4100
    assert vmem.DEFAULT_SCOPED_VMEM_BYTES < blocks.vmem_limit_bytes
    assert blocks.vmem_limit_bytes <= vmem.VMEM_LIMIT_CEILING_BYTES
    assert blocks.vmem_limit_bytes == vmem.required_limit_bytes(blocks.vmem_bytes)
    check_kernel_budget([KernelShape("shrink", 16, 1, 4100, 512, "float32")])


def test_startup_check_refuses_a_shape_over_the_ceiling_and_names_it():
    huge = KernelShape("expand", 64, 4, 16388, 512, "float32")  # untileable, ~100 MiB
    ok = KernelShape("shrink", 16, 1, 4096, 16, "bfloat16")
    with pytest.raises(ValueError) as err:
        check_kernel_budget([ok, huge])
    msg = str(err.value)
    for part in (
        "expand kernel",
        "token bucket 64",
        "slot bucket 4",
        "O=16388",
        "rank 512",
        "float32",
        "48.0 MiB",
        str(vmem.VMEM_LIMIT_CEILING_BYTES),
    ):
        assert part in msg, (part, msg)


def test_startup_check_with_a_tiny_budget_names_the_first_realistic_shape():
    shapes = realistic_shapes("Llama-3-8B", ranks=[64])
    with pytest.raises(
        ValueError,
        match=r"shrink kernel \(token bucket 16, slot bucket 1, "
        r"D=4096, rank 64, bfloat16\).*1.0 MiB",
    ):
        check_kernel_budget(shapes, ceiling_bytes=1 * MiB)


def test_engine_start_up_refuses_kernels_that_cannot_fit(llama_dir, monkeypatch):
    """The engine runs the check before compiling anything (pallas backend), with the
    ceiling read at start-up: shrunk here to 1 MiB, the tiny model's kernels cannot fit."""
    from vllm_tpu_lora import LLM

    monkeypatch.setattr(vmem, "VMEM_LIMIT_CEILING_BYTES", 1 * MiB)
    with pytest.raises(ValueError, match=r"LoRA (shrink|expand) kernel \(token bucket \d+, "
                                         r"slot bucket \d+, [DO]=\d+, rank 8, float32\) "
                                         r"cannot fit in TPU VMEM"):
        LLM(llama_dir, enable_lora=True, lora_backend="pallas", max_lora_rank=8,
            max_num_seqs=8, max_num_batched_tokens=16, max_model_len=64)
