"""Memory per device under tensor parallelism, from the engine's own sizing: the model is
built on the meta device from a config (no weights), the LoRA layers wrapped as the engine
wraps them, the tensor-parallel layout applied by the engine's own code
(`TensorParallel.prepare`, then `shard_model` / `shard_kv_caches` / `shard_lora_buffers`
handed a mesh that records each tensor's per-device bytes instead of placing it).

    python benchmarks/tp_memory.py --out docs/results/tp_memory.jsonl

Default: Llama-3-8B (hidden 4096, 32 layers, 32 / 8 heads, intermediate 14336, vocab
128256) in bf16, 64 adapters of rank 16 on the seven linears, KV for max_model_len 8k,
at TP 1, 4 and 8 (LoRA A replicated as in vLLM, and fully sharded) on a 15.75 GiB v5e
chip. `full_length_seqs_that_fit`: KV for that many max_model_len sequences fits in what
weights and LoRA buffers leave (activations and XLA's workspace not counted).
"""

from __future__ import annotations

import argparse
import json

import torch

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
             "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False}
GIB = 2**30


class SizingMesh:
    """Stands in for a device mesh: `mark` adds up what one device would hold."""

    def __init__(self, tp: int) -> None:
        self.tp, self.bytes = tp, 0

    def mark(self, t, dim: int | None, groups: int | None = None) -> None:
        split = (self.tp if groups is None else groups) if dim is not None else 1
        self.bytes += t.numel() * t.element_size() // split

    def constrain(self, t, dim, groups=None):
        return t


def sizes(tp: int, max_loras: int, rank: int, max_model_len: int, block_size: int,
          fully_sharded: bool = False) -> dict:
    from vllm_tpu_lora.config import LoRAConfig
    from vllm_tpu_lora.lora.layers import wrap_lora_layers
    from vllm_tpu_lora.lora.punica import PunicaWrapper
    from vllm_tpu_lora.models.registry import resolve_model_class
    from vllm_tpu_lora.parallel import TensorParallel, sharding

    lora_config = LoRAConfig(max_loras=max_loras, max_lora_rank=rank,
                             fully_sharded_loras=fully_sharded)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = resolve_model_class(LLAMA3_8B)(LLAMA3_8B, block_size)
            model.untie_lm_head()
            layers = wrap_lora_layers(model, PunicaWrapper("xla", fuse_slices=tp == 1),
                                      max_loras, rank, torch.bfloat16)
    finally:
        torch.set_default_dtype(prev)
    from vllm_tpu_lora.layers.linear import pretranspose_linears

    pretranspose_linears(model)
    kv = [tuple(torch.empty(s, dtype=torch.bfloat16, device="meta")
                for s in model.kv_cache_shapes(max_model_len)) for _ in range(
        LLAMA3_8B["num_hidden_layers"])]
    row = {"tp": tp, "fully_sharded_loras": fully_sharded, "max_loras": max_loras, "rank": rank,
           "max_model_len": max_model_len}
    if tp == 1:
        lora_ids = {id(b) for layer in layers.values() for b in (*layer.lora_a, *layer.lora_b)}
        weights = sum(p.numel() * p.element_size() for p in model.parameters()
                      if id(p) not in lora_ids)
        lora = sum(b.numel() * b.element_size() for layer in layers.values()
                   for b in (*layer.lora_a, *layer.lora_b))
        kv_bytes = sum(c.numel() * c.element_size() for layer in kv for c in layer)
    else:
        tpar = TensorParallel(tp, LLAMA3_8B, lora_config)
        tpar.tpm = SizingMesh(tp)
        tpar.prepare(model)
        sharding.shard_model(model, tpar.tpm)
        weights, tpar.tpm.bytes = tpar.tpm.bytes, 0
        sharding.shard_lora_buffers(layers, tpar.tpm, fully_sharded)
        lora, tpar.tpm.bytes = tpar.tpm.bytes, 0
        sharding.shard_kv_caches(kv, tpar.tpm, tpar.kv_groups)
        kv_bytes = tpar.tpm.bytes
    row.update(weights_gib=weights / GIB, lora_buffers_gib=lora / GIB,
               kv_per_seq_gib=kv_bytes / GIB)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--max-loras", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--chip-gib", type=float, default=15.75)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    configs = [(n, fs) for n in args.tp for fs in ((False, True) if n > 1 else (False,))]
    for tp, fs in configs:
        row = sizes(tp, args.max_loras, args.rank, args.max_model_len, 16, fs)
        free = args.chip_gib - row["weights_gib"] - row["lora_buffers_gib"]
        row["full_length_seqs_that_fit"] = max(0, int(free // row["kv_per_seq_gib"]))
        line = json.dumps(row)
        print(line)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
