"""LoRA layers: wrap the model's linears (qkv packed, o, gate_up packed, down) from outside,
and, when lora_target_modules names them, the token embedding and lm_head.

Each wrapped layer owns preallocated stacked buffers, one pair per output slice:
`lora_a[max_loras, max_rank, in]` and `lora_b[max_loras, out_slice, max_rank]`, zero
padded to max_rank (the embedding keeps its A by token: `[max_loras, vocab, max_rank]`).
On the xla backend's fused path B is held rank-first, `[max_loras, max_rank, out_slice]`,
and off a TPU A by input, `[max_loras, in, max_rank]` (layer flags a_by_input /
b_by_rank; see PunicaWrapper.weights_transposed and a_by_input). Loading an adapter only
writes data into a slot of these buffers.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_tpu_lora.lora.punica import PunicaWrapper

# Our module name (last component) -> the checkpoint modules packed into it.
LORA_TARGETS = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "o_proj": ["o_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
    "down_proj": ["down_proj"],
}
# Opt-in targets (lora_target_modules must name them): they change the embedding lookup
# and the logits graph, which engines without such adapters should not pay for.
VOCAB_TARGETS = ("embed_tokens", "lm_head")


def module_allowed(name: str, target_modules) -> bool:
    """Whether LoRA may adapt checkpoint module `name` (a leaf such as "q_proj", or a packed
    one such as Phi-3's "qkv_proj") under lora_target_modules: it is listed; or it is packed
    and all its parts are listed; or it is a part of a listed packed module."""
    if name in target_modules:
        return True
    parts = LORA_TARGETS.get(name, [])
    if len(parts) > 1 and all(p in target_modules for p in parts):
        return True
    return any(name in ps and packed in target_modules
               for packed, ps in LORA_TARGETS.items() if len(ps) > 1)


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, punica: PunicaWrapper, max_loras: int,
                 max_rank: int, dtype: torch.dtype, bias: bool = False,
                 dora: bool = False) -> None:
        """bias / dora: also hold per-slot vectors over the whole output, zero for adapters
        without the feature: lora_bias (lora_B's bias times the scale) and lora_dora
        (DoRA's rescale minus one, m / ||W + s B A|| - 1). Only engines that enable the
        feature have them, so the others' graphs are unchanged."""
        super().__init__()
        self.base_layer = base
        self.punica = punica
        self.output_slices = list(getattr(base, "output_sizes", [base.out_features]))
        self.in_features = base.in_features
        # Slots as PEFT's lora_A [R, in] / lora_B [out, R], or transposed where the punica
        # wrapper's ops read them so: B on the xla fused path (weights_transposed) and for
        # the grouped Pallas kernel (grouped_kernel), A on the xla fused path off a TPU
        # (a_by_input).
        self.a_by_input = punica.a_by_input
        self.b_by_rank = punica.weights_transposed or punica.grouped_kernel
        for i, size in enumerate(self.output_slices):
            a_shape = ((self.in_features, max_rank) if self.a_by_input
                       else (max_rank, self.in_features))
            b_shape = (max_rank, size) if self.b_by_rank else (size, max_rank)
            self.register_buffer(f"lora_a_{i}", torch.zeros(max_loras, *a_shape, dtype=dtype),
                                 persistent=False)
            self.register_buffer(f"lora_b_{i}", torch.zeros(max_loras, *b_shape, dtype=dtype),
                                 persistent=False)
        out = sum(self.output_slices)
        self.vector_kinds = [k for k, on in (("bias", bias), ("dora", dora)) if on]
        for kind in self.vector_kinds:
            self.register_buffer(f"lora_{kind}", torch.zeros(max_loras, out, dtype=dtype),
                                 persistent=False)
        # DoRA rescales all but the base bias, which it needs in output order (under tensor
        # parallelism the base layer's own bias is reordered into per-device blocks).
        bias_t = getattr(base, "bias", None) if dora else None
        self.register_buffer("dora_base_bias", None if bias_t is None else bias_t.detach().clone(),
                             persistent=False)

    @property
    def lora_a(self) -> list[torch.Tensor]:
        return [getattr(self, f"lora_a_{i}") for i in range(len(self.output_slices))]

    @property
    def lora_b(self) -> list[torch.Tensor]:
        return [getattr(self, f"lora_b_{i}") for i in range(len(self.output_slices))]

    @property
    def lora_vectors(self) -> list[torch.Tensor]:
        return [getattr(self, f"lora_{kind}") for kind in self.vector_kinds]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        if not self.punica.active:  # slot bucket 0: the base-only graph
            return y
        out = self.punica.add_lora_linear(y, x, self.lora_a, self.lora_b, self.output_slices)
        return self._add_vectors(out, 0)

    def _add_vectors(self, out: torch.Tensor, offset: int) -> torch.Tensor:
        """LoRA bias and DoRA on output columns [offset, offset + out's width)."""
        if not self.vector_kinds:
            return out
        cols = slice(offset, offset + out.shape[-1])
        if "bias" in self.vector_kinds:
            out = out + self.punica.slot_rows(self.lora_bias, out.dtype)[:, cols]
        if "dora" in self.vector_kinds:
            # PEFT's DoRA: base bias + g * (W x + s (B A x + b)), g per output channel, so
            # add (g - 1) times everything but the base layer's own bias.
            merged = out if self.dora_base_bias is None else out - self.dora_base_bias[cols]
            out = out + self.punica.slot_rows(self.lora_dora, out.dtype)[:, cols] * merged
        return out

    @property
    def slices_natively(self) -> bool:
        """True around a tensor-parallel packed layer (see layers.linear.split_packed)."""
        return getattr(self.base_layer, "slices_natively", False)

    def forward_slices(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The base layer's output slices, each plus its own LoRA delta. Under tensor
        parallelism every slice is sharded like its lora_b, so the expand stays local,
        and lora_a may be rank-sharded (fully_sharded_loras): the shrink keeps that axis."""
        ys = self.base_layer.forward_slices(x)
        if not self.punica.active:
            return ys
        outs, offset = [], 0
        for y, a, b in zip(ys, self.lora_a, self.lora_b):
            y = self.punica.add_expand(y, self.punica.add_shrink(x, a, keep_rank_axis=True), b,
                                       0, y.shape[-1])
            outs.append(self._add_vectors(y, offset))
            offset += y.shape[-1]
        return outs


class _VocabLoRA(nn.Module):
    """One adapted slice over a vocabulary-sized layer (embedding or lm_head): a single
    A/B buffer pair, no per-slot vectors (DoRA / lora_bias are not served there). B is
    [out, R], or [R, out] with `b_by_rank` (the embedding's, on the xla fused path)."""

    vector_kinds: list[str] = []
    lora_vectors: list[torch.Tensor] = []

    def __init__(self, base: nn.Module, punica: PunicaWrapper, in_features: int, out: int,
                 a_shape: tuple[int, int], max_loras: int, dtype: torch.dtype,
                 b_by_rank: bool = False) -> None:
        super().__init__()
        self.base_layer = base
        self.punica = punica
        self.in_features, self.output_slices = in_features, [out]
        self.register_buffer("lora_a_0", torch.zeros(max_loras, *a_shape, dtype=dtype),
                             persistent=False)
        rank = a_shape[1] if self.a_by_input else a_shape[0]
        self.b_by_rank = b_by_rank
        b_shape = (rank, out) if b_by_rank else (out, rank)
        self.register_buffer("lora_b_0", torch.zeros(max_loras, *b_shape, dtype=dtype),
                             persistent=False)

    @property
    def lora_a(self) -> list[torch.Tensor]:
        return [self.lora_a_0]

    @property
    def lora_b(self) -> list[torch.Tensor]:
        return [self.lora_b_0]


class LoRAEmbedding(_VocabLoRA):
    """The token embedding plus PEFT's embedding LoRA: y = E[id] + s * B @ A[:, id]. Its A is
    held by token, `lora_a_0[max_loras, vocab, R]`, so the shrink is one row lookup."""

    a_by_input = True

    def __init__(self, base: nn.Embedding, punica: PunicaWrapper, max_loras: int,
                 max_rank: int, dtype: torch.dtype) -> None:
        vocab, hidden = base.weight.shape
        super().__init__(base, punica, vocab, hidden, (vocab, max_rank), max_loras, dtype,
                         b_by_rank=punica.weights_transposed)

    @property
    def weight(self) -> torch.Tensor:  # tied lm_heads and the loader read it
        return self.base_layer.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(ids)
        if not self.punica.active:
            return y
        return self.punica.add_lora_embedding(y, ids, self.lora_a_0, self.lora_b_0)


class LoRALogits(_VocabLoRA):
    """lm_head plus its LoRA, applied in the logits graph to the rows whose slots the
    sampler set (`punica.logits_rows`); elsewhere (no rows set) the plain lm_head."""

    a_by_input = False

    def __init__(self, base: nn.Module, punica: PunicaWrapper, max_loras: int,
                 max_rank: int, dtype: torch.dtype) -> None:
        hidden = base.in_features
        super().__init__(base, punica, hidden, base.out_features, (max_rank, hidden),
                         max_loras, dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.base_layer(h)
        rows = self.punica.logits_rows
        if rows is None:
            return logits
        return self.punica.add_lora_logits(logits, h, self.lora_a_0, self.lora_b_0, rows)


def wrap_lora_layers(model: nn.Module, punica: PunicaWrapper, max_loras: int, max_rank: int,
                     dtype: torch.dtype, target_modules=None, bias: bool = False,
                     dora: bool = False) -> dict[str, LoRALinear]:
    """Replace the LoRA-capable linears of `model` that hold a targeted checkpoint module
    (all of them by default) in place; return them by module name. A packed layer is
    wrapped whole when any of its slices is targeted (the others stay zero)."""
    wanted = set(target_modules) if target_modules else None
    targets = [name for name, mod in model.named_modules()
               if name.rsplit(".", 1)[-1] in LORA_TARGETS and hasattr(mod, "out_features")
               and (wanted is None or any(module_allowed(m, wanted) for m in
                                          [name.rsplit(".", 1)[-1], *LORA_TARGETS[name.rsplit(".", 1)[-1]]]))]
    wrapped = {}
    for name in targets:
        parent_name, attr = name.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        layer = LoRALinear(getattr(parent, attr), punica, max_loras, max_rank, dtype, bias, dora)
        setattr(parent, attr, layer)
        wrapped[name] = layer
    if wanted and "embed_tokens" in wanted:
        inner = model.model
        inner.embed_tokens = LoRAEmbedding(inner.embed_tokens, punica, max_loras, max_rank, dtype)
        wrapped["model.embed_tokens"] = inner.embed_tokens
        punica.slot_vectors = True  # the lookup needs each token's device slot
    if wanted and "lm_head" in wanted:
        # A tied lm_head gets its own copy first, so its LoRA never touches the embedding
        # (and the embedding's LoRA never reaches the logits), as in PEFT.
        model.untie_lm_head()
        model.lm_head = LoRALogits(model.lm_head, punica, max_loras, max_rank, dtype)
        wrapped["lm_head"] = model.lm_head
    return wrapped
