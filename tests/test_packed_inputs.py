"""runner/packed_inputs: a step's named host arrays through one flat buffer per carrier
dtype (integers and bools in one int64 buffer, floats their own) and back, each name with
its own values, shape and dtype."""

import numpy as np
import torch

from vllm_tpu_lora.runner.packed_inputs import PackLayout, pack_arrays, unpack_arrays


def _groups(rng, t: int):
    return {
        "inputs": {"input_ids": rng.integers(0, 1000, t).astype(np.int64),
                   "positions": np.arange(t, dtype=np.int64)},
        "meta": {"q_block_tables": rng.integers(0, 50, (t, 3)).astype(np.int64),
                 "seq_kv_lens": rng.integers(0, 9, 4).astype(np.int32),
                 "num_seqs": np.array([4], np.int32)},
        "plan": {"token_valid": rng.random(t) < 0.5,
                 "small": rng.integers(-100, 100, (2, 3)).astype(np.int8)},
        "st": {"temperature": rng.random(4).astype(np.float32),
               "top_k": rng.integers(-1, 9, 4).astype(np.int32)},
        "lora": {},
    }


def test_round_trip_keeps_every_array():
    rng = np.random.default_rng(0)
    groups = _groups(rng, 8)
    flats, layout = pack_arrays(groups)
    assert sorted(f.dtype.name for f in flats) == ["float32", "int64"]  # two transfers
    assert sum(f.size for f in flats) == sum(a.size for g in groups.values() for a in g.values())
    back = unpack_arrays([torch.from_numpy(f) for f in flats], layout)
    assert "lora" not in back  # an empty group has no entries
    for group, arrays in groups.items():
        for name, arr in arrays.items():
            got = back[group][name]
            assert got.dtype == torch.from_numpy(arr).dtype and tuple(got.shape) == arr.shape
            np.testing.assert_array_equal(got.numpy(), arr)


def test_layout_is_a_graph_key():
    """Equal for the same names and shapes (one graph), different when a shape or dtype
    changes (another graph): values never enter it."""
    rng = np.random.default_rng(1)
    _, a = pack_arrays(_groups(rng, 8))
    _, b = pack_arrays(_groups(rng, 8))
    _, c = pack_arrays(_groups(rng, 16))
    g = _groups(rng, 8)
    g["meta"]["num_seqs"] = g["meta"]["num_seqs"].astype(np.int64)
    _, d = pack_arrays(g)
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    assert a != c and a != d
    assert isinstance(a, PackLayout) and not isinstance(a, tuple)  # one pytree leaf


def test_fixed_tensors_are_graph_inputs_keyed_once():
    """State passed as FixedTensors (the KV cache, the LoRA slot buffers) is read and
    updated by the replayed graph like any argument — new contents are seen, in-place
    updates land — without a second capture; it must hold tensors only."""
    import pytest

    from vllm_tpu_lora import platform
    from vllm_tpu_lora.runner.lazy_capture import FixedTensors, LazyGraphCapture

    d = platform.xla_device()
    cap = LazyGraphCapture()

    def fn(x, state: FixedTensors):
        read, acc = state.value["read"], state.value["acc"]
        acc.add_(x)
        return x * read.sum()

    graph = cap.compile(fn)
    read = torch.ones(3, device=d)
    acc = torch.zeros(2, device=d)
    state = FixedTensors({"read": read, "acc": acc})
    x = torch.tensor([1.0, 2.0], device=d)
    platform.sync()  # replayed graphs take materialised buffers, as the engine's are
    assert graph(x, state).cpu().tolist() == [3.0, 6.0]
    read.copy_(torch.tensor([1.0, 2.0, 4.0], device=d))  # contents change between calls
    x2 = x * 2
    platform.sync()
    assert graph(x, state).cpu().tolist() == [7.0, 14.0]
    assert graph(x2, state).cpu().tolist() == [14.0, 28.0]
    assert acc.cpu().tolist() == [4.0, 8.0]  # 1 + 1 + 2, 2 + 2 + 4: every call's update
    assert cap.captures == 1
    with pytest.raises(TypeError, match="tensors only"):
        FixedTensors([acc, 3])
