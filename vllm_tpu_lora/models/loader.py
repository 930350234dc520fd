"""Build a model from an HF checkpoint directory (safetensors, single file or sharded)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from torch import nn

from vllm_tpu_lora import platform
from vllm_tpu_lora.models.registry import resolve_model_class

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str) -> torch.dtype:
    """'auto' is bfloat16 on TPU (its native matmul type) and float32 on CPU."""
    if dtype == "auto":
        return torch.bfloat16 if platform.is_tpu() else torch.float32
    return _DTYPES[dtype]


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, s) for s in shards]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    found = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not found:
        raise ValueError(f"No safetensors weights found in {model_dir!r}")
    return [os.path.join(model_dir, f) for f in found]


def iter_checkpoint(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _packed_target(name: str, mapping: dict[str, list[str]]) -> tuple[str, int] | None:
    for packed, parts in mapping.items():
        for shard, part in enumerate(parts):
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{packed}."), shard
    return None


def load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name:
            continue
        if name == "lm_head.weight" and getattr(model, "tie_word_embeddings", False):
            continue
        packed = _packed_target(name, model.packed_modules_mapping)
        target = packed[0] if packed else name
        if target not in params:
            raise ValueError(f"Checkpoint tensor {name!r} has no matching model parameter")
        param = params[target]
        if packed:
            module = model.get_submodule(target.rsplit(".", 1)[0])
            offset, size = module.shard_offset(packed[1])
            dest = param.data.narrow(0, offset, size)
        else:
            dest = param.data
        if dest.shape != tensor.shape:
            raise ValueError(f"Shape mismatch for {name}: checkpoint {tuple(tensor.shape)} vs model {tuple(dest.shape)}")
        dest.copy_(tensor.to(dest.dtype))
        if packed:
            loaded.add(f"{target}#{packed[1]}")
        else:  # a whole tensor, packed already in the checkpoint (Phi-3) or not packed
            module = model.get_submodule(target.rsplit(".", 1)[0])
            loaded.update(f"{target}#{s}" for s in range(len(getattr(module, "output_sizes", [0]))))
    _check_all_loaded(model, params, loaded)


def _check_all_loaded(model: nn.Module, params: dict, loaded: set[str]) -> None:
    missing = []
    for pname in params:
        module = model.get_submodule(pname.rsplit(".", 1)[0])
        shards = len(getattr(module, "output_sizes", [0]))
        missing += [f"{pname}[{s}]" for s in range(shards) if f"{pname}#{s}" not in loaded]
    if missing:
        raise ValueError(f"Checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")


def load_model(model_dir: str, hf_config: dict, block_size: int, dtype: torch.dtype) -> nn.Module:
    """Instantiate on the host in `dtype`, fill from the checkpoint; the caller moves it."""
    cls = resolve_model_class(hf_config)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = cls(hf_config, block_size)
        model = model.to_empty(device="cpu")
    finally:
        torch.set_default_dtype(prev)
    for module in model.modules():  # buffers computed at init (rope) must be rebuilt
        if hasattr(module, "inv_freq"):
            module.inv_freq = _rebuild_inv_freq(module)
    load_weights(model, iter_checkpoint(model_dir))
    return model.eval().requires_grad_(False)


def _rebuild_inv_freq(rotary: nn.Module) -> torch.Tensor:
    # to_empty() left the meta-initialised buffer uninitialised; recompute it.
    from vllm_tpu_lora.layers.rotary import compute_inv_freq

    return compute_inv_freq(rotary.head_dim, rotary.theta, rotary.scaling)
