"""Sharding annotations for the model, the KV cache and the LoRA buffers (Megatron layout).

Applied from outside, after the runner moved everything to the (SPMD virtual) device:
torch_xla keeps the host data until `mark_sharding`, so each device only ever receives its
own shard. Shapes below are as stored (weights transposed, `weight_t [in, out]`):

- column parallel, packed qkv / gate_up: weight_t dim 1 (already in per-device blocks,
  parallel/packed.py), bias dim 0.
- row parallel, o_proj / down_proj: weight_t dim 0; the bias stays replicated. XLA adds
  the all-reduce of the partial sums after the matmul.
- vocab parallel: embedding weight [V, H] dim 0 (XLA does the masked local lookup plus an
  all-reduce), lm_head weight_t [H, V] dim 1 (the sampler's full-vocab ops gather logits).
- KV cache [slots, kv_heads (x2 interleaved on TPU), head_dim]: dim 1, kv heads replicated
  when fewer than N, matching the k / v slices of qkv_proj.
- LoRA (vLLM's layout): column-parallel layers keep lora_a [L, R, in] replicated and shard
  lora_b [L, out_slice, R] on dim 1 like their output slice; row-parallel layers shard
  lora_a on dim 2 (in) and keep lora_b replicated. fully_sharded_loras also shards
  column-parallel lora_a on the rank (dim 1; XLA gathers the shrink output) and
  row-parallel lora_b on the output (dim 1), as vLLM's fully sharded (S-LoRA) layers do.
  Per-slot vectors (LoRA bias, DoRA) and the embedding's and lm_head's LoRA stay
  replicated: their deltas are added to replicated activations (the embedding's output,
  the gathered logits), and each is at most vocab x rank per slot.

Everything else (norms, rotary tables) is replicated.
"""

from __future__ import annotations

from torch import nn

COLUMN_PACKED = ("qkv_proj", "gate_up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def _owner(name: str) -> str:
    """Module name without a LoRA wrapper's `.base_layer`, last component only."""
    if name.endswith(".base_layer"):
        name = name[: -len(".base_layer")]
    return name.rsplit(".", 1)[-1]


def shard_model(model: nn.Module, tpm) -> dict[str, str]:
    """Annotate every weight; return {parameter name: how it was sharded} for logging/tests."""
    done = {}
    for name, module in model.named_modules():
        owner = _owner(name)
        if getattr(module, "slices_natively", False) and hasattr(module, "weight_t"):
            tpm.mark(module.weight_t, 1)
            if module.bias is not None:
                tpm.mark(module.bias, 0)
            done[name] = "column (packed, per-device blocks)"
        elif owner in ROW_PARALLEL and hasattr(module, "weight_t"):
            tpm.mark(module.weight_t, 0)
            done[name] = "row"
        elif owner == "lm_head" and hasattr(module, "weight_t"):
            tpm.mark(module.weight_t, 1)
            module.register_forward_hook(_replicated_output(tpm, gather_from=1))
            done[name] = "vocab (lm_head)"
        elif isinstance(module, nn.Embedding):
            tpm.mark(module.weight, 0)
            done[name] = "vocab (embedding)"
        if owner in ROW_PARALLEL and not name.endswith(".base_layer"):  # outermost (LoRA) layer
            module.register_forward_hook(_replicated_output(tpm))
    missing = [n for n in (*COLUMN_PACKED, *ROW_PARALLEL, "lm_head", "embed_tokens")
               if not any(_owner(k) == n for k in done)]
    if missing:
        raise ValueError(f"tensor parallelism found no {missing} module in "
                         f"{type(model).__name__}; only Llama-family models are supported")
    return done


def _replicated_output(tpm, gather_from: int | None = None):
    """Forward hook pinning a layer's output to replicated.

    On row-parallel layers it keeps the residual stream replicated, as in Megatron (XLA
    then reduces the partial sums right there, and gathers a fully sharded LoRA's
    output-sharded delta, as vLLM does). On lm_head it is vLLM's logits gather. Without
    these pins XLA's propagation is free to leave activations sharded differently from
    graph to graph: a graph's sharded output then meets a graph compiled for another
    input sharding (a compile after warm-up), or makes XLA gather a weight instead.
    `gather_from`: first pin the output sharded on that dim, where the matmul leaves it;
    with a replicated pin alone XLA gathered lm_head's weight instead of the logits.
    """
    def hook(module, args, out):
        if gather_from is not None:
            out = tpm.constrain(out, gather_from)
        return tpm.constrain(out, None)

    return hook


def shard_kv_caches(kv_caches: list[tuple], tpm, kv_groups: int) -> None:
    for layer_cache in kv_caches:
        for cache in layer_cache:
            tpm.mark(cache, 1, kv_groups)


def shard_lora_buffers(layers: dict, tpm, fully_sharded: bool) -> None:
    """`layers`: {module name: LoRALinear} as the LoRA manager holds them."""
    for name, layer in layers.items():
        owner = _owner(name)
        for vector in layer.lora_vectors:
            tpm.mark(vector, None)
        if owner in ("embed_tokens", "lm_head"):
            for buf in (*layer.lora_a, *layer.lora_b):
                tpm.mark(buf, None)
        elif owner in COLUMN_PACKED:
            slices = layer.base_layer.slices  # the ColumnParallelPackedLinear's layout
            for a, b, s in zip(layer.lora_a, layer.lora_b, slices):
                tpm.mark(a, 1 if fully_sharded else None)
                tpm.mark(b, 1, s.groups)
        elif owner in ROW_PARALLEL:
            for a, b in zip(layer.lora_a, layer.lora_b):
                tpm.mark(a, 2)
                tpm.mark(b, 1 if fully_sharded else None)
        else:
            raise ValueError(f"no tensor-parallel layout for LoRA layer {name!r}")
