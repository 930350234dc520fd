"""The DMA slot copy (ops/slot_copy.py) in the Pallas interpreter against numpy's take,
through ops.take_slots on torchax tensors beside its other copies, and lowered for TPU
(Mosaic) at the engine's shapes with jax.export; and ops.put_slots, the slot writes, on
torch_xla against numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.experimental import enable_x64

from vllm_tpu_lora import ops
from vllm_tpu_lora.ops.pallas_export import export_for_tpu, hbm_operands
from vllm_tpu_lora.ops.slot_copy import take_slots_dma


def _buffers(rng, shapes, dtype=np.float32):
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


@pytest.mark.parametrize("axis", [0, 1])
def test_slices_land_side_by_side_in_slot_order(axis):
    """Repeated slots, slot 0, the last slot; three slices of unequal width concatenated
    along either axis of a slot's block: bit-exact to numpy."""
    rng = np.random.default_rng(axis)
    widths = (4, 4, 2)
    shapes = [(6, w, 24) if axis == 0 else (6, 8, w) for w in widths]
    bufs = _buffers(rng, shapes)
    slots = np.array([5, 0, 5, 2], np.int32)
    got = np.asarray(take_slots_dma([jnp.asarray(b) for b in bufs], jnp.asarray(slots),
                                    axis=axis, interpret=True))
    want = np.concatenate([b[slots] for b in bufs], axis=1 + axis)
    assert got.shape == want.shape and np.array_equal(got, want)


def test_copies_past_the_in_flight_window_all_land(monkeypatch):
    """More slots than may be in flight at once: the later starts wait for earlier
    copies, and every slot still lands where it belongs."""
    from vllm_tpu_lora.ops import slot_copy

    monkeypatch.setattr(slot_copy, "IN_FLIGHT", 3)
    rng = np.random.default_rng(3)
    bufs = _buffers(rng, [(9, 2, 8), (9, 4, 8)])
    slots = rng.integers(0, 9, size=7).astype(np.int32)
    got = np.asarray(slot_copy.take_slots_dma.__wrapped__(
        [jnp.asarray(b) for b in bufs], jnp.asarray(slots), interpret=True))
    assert np.array_equal(got, np.concatenate([b[slots] for b in bufs], axis=1))


def test_take_slots_copies_agree_on_torchax_tensors():
    """ops.take_slots inside a jax-runtime graph: the gather, the dynamic slices and the
    DMA copy give one answer (bf16, a packed layer's A concatenated rank-wise)."""
    import torchax

    rng = np.random.default_rng(7)
    bufs = [torch.from_numpy(b).to(torch.bfloat16) for b in _buffers(rng, [(5, 4, 16)] * 3)]
    slots = torch.tensor([4, 1, 1], dtype=torch.int32)
    want = torch.cat([b.index_select(0, slots.long()) for b in bufs], dim=1)
    env = torchax.default_env()
    with env:
        tb, ts = [env.to_xla(b) for b in bufs], env.to_xla(slots)
        for copy in ops.SLOT_COPIES:
            got = ops.take_slots(tb, ts, copy=copy, dim=1)
            assert torch.equal(got.cpu() if hasattr(got, "cpu") else got, want), copy
    with pytest.raises(ValueError, match="unknown slot copy 'scatter'"):
        ops.take_slots(bufs, slots, copy="scatter")


@pytest.mark.parametrize("x64", [False, True])
def test_dma_copy_lowers_for_tpu_at_engine_shapes(x64):
    """Llama-3.2-1B's packed qkv A (three [16, 2048] slices) and its widest B ([16,
    8192]), 32 of 128 slots, and a gate_up A over 64 of 256, bf16: a Mosaic custom call
    each. x64: as the jax runtime traces it (torchax enables x64), where a Python int
    constant in the kernel became int64 and Mosaic refused it (found on the chip)."""
    for n, shapes in ((32, [(128, 16, 2048)] * 3), (32, [(128, 16, 8192)]),
                      (64, [(256, 16, 2048)] * 2)):  # past the in-flight window
        slots, axis = jax.ShapeDtypeStruct((n,), jnp.int32), 0
        bufs = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
        with enable_x64(x64):
            exported = export_for_tpu(
                lambda s, *b, axis=axis: take_slots_dma(list(b), s, axis=axis), (slots, *bufs))
        assert "tpu_custom_call" in exported.mlir_module()
        # Every buffer stays in HBM: XLA may not prefetch all its slots into VMEM.
        assert hbm_operands(exported) == [list(range(1, len(shapes) + 1))]
        out = exported.out_avals[0]
        assert out.shape == (n, 16 * len(shapes), shapes[0][2]) and out.dtype == jnp.bfloat16


@pytest.mark.parametrize("slots", [[2], [3, 0, 1]])
def test_put_slots_on_torch_xla_writes_each_row_to_its_slot_only(slots):
    """A slot write as the LoRA manager's write graph makes it (rows flat, sliced from one
    image), one row (written twice to its slot) or several: those slots hold the rows,
    every other slot is untouched."""
    from vllm_tpu_lora.platform import xla_device

    rng = np.random.default_rng(len(slots))
    buf = rng.standard_normal((4, 3, 5)).astype(np.float32)
    image = rng.standard_normal(len(slots) * 15).astype(np.float32)
    rows = [image[i * 15:(i + 1) * 15] for i in range(len(slots))]
    dev = xla_device()
    got = torch.from_numpy(buf).to(dev)
    ops.put_slots(got, torch.tensor(slots).to(dev),
                  [torch.from_numpy(r).to(dev) for r in rows])
    want = buf.copy()
    for slot, row in zip(slots, rows):
        want[slot] = row.reshape(3, 5)
    assert np.array_equal(got.cpu().numpy(), want)
