"""PunicaWrapper: the per-step LoRA metadata every LoRA layer reads, and the shrink/expand
dispatch (vLLM's method names).

Per step the runner asks `plan_step` for the step's host arrays (numpy, built once per
step, see lora/step_layout.py), uploads them, and hands them to `set_step` with the step's
LoRA-slot bucket S. S is the only Python-level value and it is part of the graph key:
S = 0 traces no LoRA op at all, and the cost of the LoRA ops grows with S, not max_loras
(except the "slots" graphs below, used only where S is above half of max_loras).

Single device (`fuse_slices`): every op indexes the full stacked buffers by device slot,
and on the xla backend they are held transposed, `lora_a[max_loras, D, R]` /
`lora_b[max_loras, R, O]` (`weights_transposed`; on a TPU A stays `[max_loras, R, D]`,
`a_by_input`; tensor parallelism keeps PEFT's
`[max_loras, R, D]` / `[max_loras, O, R]`, the pallas backend PEFT's A and B rank-first,
`grouped_kernel`): XLA CPU reduces a per-token
product fastest over a non-minor axis, where the output's minor axis vectorises, and the
batched and one-hot matmuls then read B with the rank axis first, as they contract it.
A packed layer
(qkv, gate_up) shrinks once over its slices' concatenated A (vLLM's fused slices; the
slots strategy and the Pallas path instead run one product per slice, as concatenating
would copy every slot's weights):
  - xla on a TPU, every graph with S >= 2 "onehot" (S = 1: "single"): the S active
    adapters' weights copied out (one DMA kernel per buffer, ops/slot_copy.py, a packed
    layer's A slices side by side), one product over all of them in token order selected
    by a [T, S] one-hot (no gather of rows, no scatter back); "stacked" (the one-hot over
    every slot as the buffers lie) where S is every slot. They measured faster there than
    every Pallas composition up to T*S*R = 2^19. With lora_backend="auto" on the jax
    runtime, graphs whose T*S*R reaches 2^20 over a one-hot of 2,048+ lanes (from 512
    tokens over 128 adapters of rank 16, 256 over 128 of rank 64) run "grouped_kernel",
    the fused grouped Pallas kernel below over the same buffers: 0.62-0.87x onehot's time
    there (step_layout); decode graphs of up to 32 tokens over 32+ of more slots at rank
    16 run "indexed" (ops/indexed_lora.py: the step's adapters fetched in groups by the
    kernel's own DMAs, read once, no copy; a decode step over 32 of 128 slots 0.93x
    onehot's device time on a v5e).
  - xla elsewhere, per graph (T, S) by measurement (lora/step_layout.py): from 64
    tokens, where S is above half of max_loras, "slots": each adapter's tokens in its
    own device slot's rows, one batched matmul per slice over the buffers as they lie
    (every slot's weights read once, none copied), with the bucket's other strategy as a
    second graph for the steps whose adapters do not fit a slot's rows. Otherwise: S = 1
    a plain `x @ A[slot].T`; small buckets with many adapters gather each token's
    weights by slot (bgmv, FLOPs T*R*(D+O) for any S); otherwise one dense product with
    the S active adapters selected by a [T, S] one-hot, from 64 tokens "split": that
    one-hot over the adapters with many tokens plus a gathered bgmv over the rows of the
    rest. (A grouped matmul on the step's segment layout, tokens grouped by adapter and
    runs padded to a token block B, FLOPs T_pad*R*(D+O), is there when forced.)
  - pallas: the linears run the fused grouped kernel (ops/grouped_lora.py: tokens sorted
    by slot, slots grouped so their ranks fill 128 lanes, shrink, mask and expand of a
    tile in one kernel, B held rank-first); the embedding's expand stays on the segment
    kernels (the block -> slot map scalar-prefetched, each block's BlockSpec fetching its
    adapter straight from the buffers). The segment path for the linears, with its
    gather into segment order and scatter back per slice, lost to onehot at every shape
    measured on a v5e (benchmarks/tpu_lora_layer.py).
Tensor parallel: per-slice ops on the active slots' weights, so each slice stays sharded
like its lora_b (see lora/layers.py `forward_slices`); the layout is built on the device.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_tpu_lora import ops, platform
from vllm_tpu_lora.lora import step_layout
from vllm_tpu_lora.ops.block_sizes import token_block
from vllm_tpu_lora.runner import buckets


def resolve_lora_backend(requested: str) -> str:
    """The LoRA backend of a single-device engine: "auto" is the xla backend everywhere,
    whose strategy table on a TPU sends only the largest graphs to the grouped Pallas
    kernel (`grouped_kernel_from`; step_layout's notes). An explicit choice stands:
    "xla" runs XLA ops only. (The op-level ops.resolve_backend maps "auto" to the kernels
    on a TPU; this is the engine's rule.)"""
    if requested != "auto":
        return ops.resolve_backend(requested)
    return "xla"


class PunicaWrapper:
    def __init__(self, backend: str, fuse_slices: bool = False) -> None:
        self.backend = ops.resolve_backend(backend)
        self.fuse_slices = fuse_slices
        # xla backend: None picks per graph (xla_strategy); benchmarks force one.
        self.force_strategy: str | None = None
        self.force_block: int | None = None
        self.max_loras = 0  # device slots: the slots strategy reads all of them
        self.max_rank = 0  # the buffers' rank: the TPU table's T*S*R rule reads it
        # (T*S*R, S*R) from which a TPU graph runs the grouped Pallas kernel (None: XLA ops
        # only, as an explicit lora_backend="xla" asks; "auto" sets step_layout's measured
        # rule).
        self.grouped_kernel_from: tuple[int, int] | None = None
        self.on_tpu = platform.is_tpu()  # the xla strategy table differs there
        # The TPU's strategy table, with its copies of a step's slots by DMA (ops.take_slots:
        # a TPU lowers a gather over the slot axis reading every slot, and dynamic slices
        # as thousands of small ops). Tests set it on CPU, where the buffers keep their CPU
        # layout.
        self.tpu_strategies = self.on_tpu
        # How those graphs copy a step's slots out (ops.take_slots): None is the DMA kernel
        # (interpreted off a TPU); benchmarks may set another to compare.
        self.force_slot_copy: str | None = None
        self.num_active_slots = 0  # the slot bucket S of the graph being traced
        # Some layers hold per-slot vectors (LoRA bias, DoRA): every step then also carries
        # each token's device slot, whatever the strategy (see slot_rows).
        self.slot_vectors = False
        # Set by the logits graph while it computes lm_head: each row's device slot.
        self.logits_rows: torch.Tensor | None = None
        self.step: dict[str, torch.Tensor] = {}
        # What the last planned step runs ("base", an xla strategy, or the backend's name
        # off the fused xla path): the runner counts the steps of each graph by it.
        self.planned_kind = "base"
        self._layout = None
        self._ones = None

    @property
    def grouped_kernel(self) -> bool:
        """The linears run the fused grouped Pallas kernel, which reads B rank-first
        ([N, R, O]) and A as PEFT's ([N, R, D]): the pallas backend's fused path."""
        return self.backend == "pallas" and self.fuse_slices

    @property
    def weights_transposed(self) -> bool:
        """B as [N, R, O] (rank-first) and, off a TPU, A as [N, D, R] (`a_by_input`): the
        xla backend's fused path. The layers allocate, and the LoRA manager writes, their
        buffers this way."""
        return self.backend == "xla" and self.fuse_slices

    @property
    def a_by_input(self) -> bool:
        """A held [N, D, R]: the xla fused path off a TPU. There A stays PEFT's [N, R, D],
        rank-first like B: the layout of the grouped Pallas kernel too, and no minor axis
        of rank width, which a TPU's (8-16, 128) tiles may pad to 128 lanes. Measured on
        a v5e's layer benchmark (32 tokens, 32 slots of rank 16, 8 and 32 in use), onehot
        over rank-first A took 0.97-0.99x the time over [N, D, R]."""
        return self.weights_transposed and not self.on_tpu

    # ---- per step ----

    def plan_step(self, token_pos: np.ndarray, active_slots: list[int], num_slots: int,
                  dtype: torch.dtype, fallback: bool = False) -> dict[str, np.ndarray]:
        """Host arrays for a step of slot bucket `num_slots`: token_pos [T] is each token's
        position in `active_slots` (-1: base model or padding). fallback: plan a slots
        bucket's fallback graph even if the step fits (warm-up traces both)."""
        if num_slots == 0:
            self.planned_kind = "base"
            return {}
        arrays = self.plan_strategy(token_pos, active_slots, num_slots, dtype, fallback)
        if self.slot_vectors:
            arrays.update(step_layout.token_slot_layout(token_pos, active_slots))
        return arrays

    def plan_strategy(self, token_pos: np.ndarray, active_slots: list[int], num_slots: int,
                      dtype: torch.dtype, fallback: bool = False) -> dict[str, np.ndarray]:
        """The arrays the graph's LoRA strategy reads (host side, once per step). A slots
        graph and its fallback differ in these arrays, so each has its own graph key."""
        strategy = self.step_strategy(token_pos, num_slots, fallback)
        self.planned_kind = strategy or (self.backend if self.fuse_slices
                                         else f"{self.backend}_per_slice")
        if strategy == "slots":
            return step_layout.slots_layout(token_pos, active_slots, num_slots, self.max_loras)
        if strategy == "single":  # each strategy uploads only the arrays its graph reads
            return step_layout.single_slot_layout(token_pos, active_slots)
        block = self.token_block(dtype, token_pos.shape[0], num_slots)
        if strategy == "grouped":
            return step_layout.segment_layout(token_pos, active_slots, num_slots, block)
        if strategy in ("gathered", "stacked", "grouped_kernel"):
            return step_layout.token_slot_layout(token_pos, active_slots)
        if strategy == "split":
            return step_layout.split_layout(token_pos, active_slots, num_slots)
        arrays = step_layout.onehot_layout(token_pos, active_slots, num_slots)
        if strategy == "indexed":  # its kernel fetches only the step's adapters
            arrays["active_count"] = np.array([len(active_slots)], np.int32)
        if self.grouped_kernel:  # the linears' token slots; the embedding's segment layout
            arrays.update(step_layout.token_slot_layout(token_pos, active_slots))
            arrays.update(step_layout.segment_layout(token_pos, active_slots, num_slots, block))
        return arrays  # one-hot, Pallas (its SegmentLayout carries idx), tensor parallel

    def strategy_table(self, token_ladder: list[int], slot_ladder: list[int],
                       max_num_seqs: int) -> str:
        """What each LoRA graph (T, S) of the xla backend runs, for the log: "T16: S1
        single, S2-S8 onehot, S16 stacked; ..." (runs of equal strategies merged; only
        the graphs warm-up compiles)."""
        rows = []
        for t in token_ladder:
            runs: list[list] = []  # [first S, last S, strategy]
            for s in (s for s in slot_ladder if s > 0
                      and buckets.slots_reachable(t, s, slot_ladder, max_num_seqs)):
                kind = self.xla_strategy(t, s)
                if runs and runs[-1][2] == kind:
                    runs[-1][1] = s
                else:
                    runs.append([s, s, kind])
            rows.append(f"T{t}: " + ", ".join(
                f"S{a}{'' if a == b else f'-S{b}'} {k}" for a, b, k in runs))
        return "; ".join(rows)

    def graph_slots(self, token_pos: np.ndarray, num_active: int, ladder: list[int]) -> int:
        """The LoRA-slot bucket S of the graph a step runs: the bucket of its active
        adapters, except for a split graph, where S bounds only the heavy ones (at least
        2: S = 1 is the single-adapter graph)."""
        if num_active == 0:
            return 0
        s = buckets.pick(ladder, num_active)
        if self.step_strategy(token_pos, s) != "split":
            return s
        heavy, _ = step_layout.heavy_positions(token_pos, num_active)
        return buckets.pick(ladder, max(2, len(heavy)))

    def xla_strategy(self, num_tokens: int, num_slots: int) -> str | None:
        """xla backend, per graph (T, S): see step_layout.xla_strategy."""
        if self.backend != "xla":
            return None
        if self.force_strategy is not None:
            if not self.a_by_input and self.force_strategy not in (
                    "single", "onehot", "stacked", "grouped_kernel", "indexed"):
                raise ValueError(f"strategy {self.force_strategy!r} reads A as [N, D, R], "
                                 "which a TPU does not hold")
            return self.force_strategy
        return step_layout.xla_strategy(num_tokens, num_slots, self.max_loras,
                                        self.tpu_strategies, self.max_rank,
                                        self.grouped_kernel_from)

    def step_strategy(self, token_pos: np.ndarray, num_slots: int,
                      fallback: bool = False) -> str | None:
        """The strategy a step runs in graph (T, S) (None: not the fused xla path): a slots
        bucket's own graph if the step fits its slots' rows (and `fallback` is not asked
        for), else that bucket's fallback graph."""
        if not self.fuse_slices:
            return None
        strategy = self.xla_strategy(token_pos.shape[0], num_slots)
        if strategy == "slots" and (fallback or not step_layout.slots_fit(token_pos, num_slots)):
            return step_layout.fallback_strategy(token_pos.shape[0], num_slots)
        return strategy

    def graph_strategy(self, num_tokens: int) -> str | None:
        """The strategy of the graph being traced: a slots bucket's step arrays say whether
        it is the slots graph or its fallback."""
        strategy = self.xla_strategy(num_tokens, self.num_active_slots)
        if strategy == "slots" and "slot_perm" not in self.step:
            return step_layout.fallback_strategy(num_tokens, self.num_active_slots)
        return strategy

    def fallback_graph(self, num_tokens: int, num_slots: int) -> bool:
        """Whether bucket (T, S) has a fallback graph besides its own (warm-up traces it)."""
        return self.fuse_slices and self.xla_strategy(num_tokens, num_slots) == "slots"

    def token_block(self, dtype: torch.dtype, num_tokens: int, num_slots: int) -> int:
        """Token block B of the segment layout of graph (T, S): the Pallas kernels' tile for
        that step shape, or the xla grouped matmul's measured block."""
        if self.backend == "pallas":
            return token_block(dtype, "pallas", num_tokens, num_slots)
        if self.force_block is not None:
            return self.force_block
        return step_layout.GROUPED_BLOCK

    def set_step(self, num_active_slots: int, tensors: dict[str, torch.Tensor]) -> None:
        self.num_active_slots = num_active_slots
        self.step = tensors
        self._layout = None  # tensor parallel: built lazily, once per traced forward

    def slot_rows(self, vectors: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """vectors [max_loras, O] -> [T, O]: each token's adapter's row, zero for tokens
        without an adapter (needs slot_vectors: token_slot / token_valid in the step)."""
        rows = vectors.index_select(0, self.step["token_slot"]).to(dtype)
        return rows * self.step["token_valid"].to(dtype)[:, None]

    @property
    def active(self) -> bool:
        return self.num_active_slots > 0

    # ---- single device: fused slices over the full stacked buffers ----

    def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor],
                        lora_b: list[torch.Tensor], output_slices: list[int]) -> torch.Tensor:
        """Semantics: y[t] += concat_i(x[t] @ A_i[s].T @ B_i[s].T), s = slot of token t
        (scales are folded into B at load time); tokens without an adapter unchanged.
        Shapes: y [T, sum(O_i)], x [T, D], lora_a[i] [N, R, D], lora_b[i] [N, O_i, R];
        transposed (`weights_transposed`, the xla strategies below): lora_b[i] [N, R, O_i]
        and, off a TPU (`a_by_input`), lora_a[i] [N, D, R]."""
        with platform.trace_scope("lora", x):
            return self._add_lora_linear(y, x, lora_a, lora_b, output_slices)

    def _add_lora_linear(self, y, x, lora_a, lora_b, output_slices) -> torch.Tensor:
        if not self.fuse_slices:
            offset = 0
            for a, b, size in zip(lora_a, lora_b, output_slices):
                y = self.add_expand(y, self.add_shrink(x, a), b, offset, size)
                offset += size
            return y
        if self.backend == "pallas":
            return self._pallas_linear(y, x, lora_a, lora_b, output_slices)
        strategy = self.graph_strategy(x.shape[0])
        if strategy == "slots":
            return self._slots_linear(y, x, lora_a, lora_b)
        if strategy == "single":
            return self._single_slot_linear(y, x, lora_a, lora_b)
        if strategy == "onehot":
            return self._onehot_linear(y, x, lora_a, lora_b)
        if strategy == "stacked":
            return self._stacked_linear(y, x, lora_a, lora_b)
        if strategy == "grouped_kernel":  # A as the kernel reads it: a copy on CPU only
            return self._pallas_linear(y, x, [la.transpose(1, 2) if self.a_by_input else la
                                              for la in lora_a], lora_b, output_slices)
        if strategy == "indexed":
            return self._indexed_linear(y, x, lora_a, lora_b)
        if strategy == "gathered":
            return self._gathered_linear(y, x, lora_a, lora_b)
        if strategy == "split":
            return self._light_linear(self._onehot_linear(y, x, lora_a, lora_b), x, lora_a,
                                      lora_b)
        return self._grouped_linear(y, x, lora_a, lora_b)

    def _add_masked(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        # where, not a multiply: a token without an adapter gets exactly zero.
        valid = self.step["token_valid"][:, None]
        return y + torch.where(valid, delta, torch.zeros_like(delta)).to(y.dtype)

    # Each strategy is a shrink (x -> rank activations, in the strategy's own arrangement)
    # and an expand shared with the embedding LoRA, whose "shrink" is a row lookup.

    def _slots_linear(self, y, x, lora_a, lora_b) -> torch.Tensor:
        """Each device slot's rows times that slot's weights, as the buffers lie: one
        batched matmul per slice reads every slot's A and B once (the slices are not
        concatenated: that would copy every slot's weights). FLOPs N*C*R*(D+O) with
        N*C <= 4T rows; padding rows are zero (slot buffers hold only finite values)."""
        rows = self._to_slot_rows(x, lora_a[0].shape[0])
        ys = [torch.einsum("ncd,ndr->ncr", rows, la.to(x.dtype)) for la in lora_a]
        return self._slots_expand(y, ys, lora_b)

    def _to_slot_rows(self, t: torch.Tensor, num_slots: int) -> torch.Tensor:
        """Token-order rows [T, W] -> slot rows [N, C, W]; rows without a token are zero
        (slot_perm points them at the zero row appended here)."""
        perm = self.step["slot_perm"]
        rows = torch.cat([t, t.new_zeros(1, t.shape[1])]).index_select(0, perm)
        return rows.view(num_slots, perm.shape[0] // num_slots, t.shape[1])

    def _slots_expand(self, y, ys: list[torch.Tensor], lora_b) -> torch.Tensor:
        """ys[i] [N, C, R] (slot rows) -> y + each token's concatenated deltas."""
        z = torch.cat([torch.einsum("ncr,nro->nco", yi, lb.to(yi.dtype))
                       for yi, lb in zip(ys, lora_b)], dim=2)
        z = z.reshape(-1, z.shape[2])
        z = torch.cat([z, z.new_zeros(1, z.shape[1])])  # the row of tokens without adapter
        return y + z.index_select(0, self.step["slot_dest"]).to(y.dtype)

    def _single_slot_linear(self, y, x, lora_a, lora_b) -> torch.Tensor:
        # One shrink for every slice: A [D, n*R], or [n*R, D] rank-first (a TPU).
        dim = 1 if self.a_by_input else 0
        a = self._take_one(lora_a, dim).to(x.dtype)
        return self._single_expand(y, x @ a if self.a_by_input else x @ a.T, lora_b)

    def _single_expand(self, y, xa, lora_b) -> torch.Tensor:
        """xa [T, n*R] in token order -> y + concat_i(xa_i @ B_i[slot].T), masked."""
        rank = lora_b[0].shape[1]
        deltas = [xa[:, i * rank:(i + 1) * rank] @ self._take_one([lb], 0).to(xa.dtype)
                  for i, lb in enumerate(lora_b)]
        return self._add_masked(y, torch.cat(deltas, dim=1))

    def _onehot(self, dtype: torch.dtype) -> torch.Tensor:
        slots = torch.arange(self.num_active_slots, device=self.step["token_lora_idx"].device,
                             dtype=torch.int32)
        return (self.step["token_lora_idx"][:, None] == slots).to(dtype)  # [T, S]

    def _onehot_linear(self, y, x, lora_a, lora_b) -> torch.Tensor:
        """Every token times the step's S active adapters in one dense matmul, the wanted
        product selected by a [T, S] one-hot: gather-free, FLOPs S*T*R*(D+O). Slot
        buffers hold only finite values (the loader rejects NaN/Inf, free slots are zero),
        so selecting by multiplication is exact."""
        active = self.step["active_slots"]
        if self.a_by_input:
            a = self._take(lora_a, active, dim=2)  # [S, D, n*R]
            xa = torch.einsum("td,sdr->tsr", x, a.to(x.dtype))
        else:  # rank-first (a TPU): [S, n*R, D]
            a = self._take(lora_a, active, dim=1)
            xa = torch.einsum("td,srd->tsr", x, a.to(x.dtype))
        return self._onehot_expand(y, xa * self._onehot(x.dtype)[:, :, None], lora_b)

    def _onehot_expand(self, y, xa, lora_b) -> torch.Tensor:
        """xa [T, S, n*R], zero outside each token's own adapter -> y + its deltas."""
        t, s, rank = xa.shape[0], xa.shape[1], lora_b[0].shape[1]
        deltas = []
        for i, lb in enumerate(lora_b):
            b = self._take(lb, self.step["active_slots"]).to(xa.dtype)  # [S, R, O_i]
            xi = xa[:, :, i * rank:(i + 1) * rank].reshape(t, s * rank)
            deltas.append(xi @ b.reshape(s * rank, b.shape[2]))
        return y + torch.cat(deltas, dim=1).to(y.dtype)

    @property
    def slot_copy(self) -> str:
        """ops.take_slots' copy: the TPU table's graphs copy a step's slots out by DMA
        (its onehot with 32 of 128 slots in use: +2.4 ms of device time per decode step
        on a v5e, against +9.0 ms as dynamic slices; docs/benchmarks.md, eighth
        session), other graphs gather them."""
        if not self.tpu_strategies:
            return "gather"
        return self.force_slot_copy or "dma"

    def _take(self, buffers, slots: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return ops.take_slots(buffers, slots, copy=self.slot_copy, dim=dim)

    def _take_one(self, buffers: list[torch.Tensor], dim: int) -> torch.Tensor:
        """The single strategy's slot of each buffer, concatenated along `dim` of a slot's
        block: one dynamic slice each on the TPU table (XLA can read it in place as the
        matmul's operand; a copy kernel would only add one)."""
        copy = "gather" if self.slot_copy == "gather" else "slices"
        return ops.take_slots(buffers, self.step["slot"], copy=copy, dim=dim + 1)[0]

    def _slot_onehot(self, num_slots: int, dtype: torch.dtype) -> torch.Tensor:
        """[T, N]: each token's device slot among all N (a zero row without adapter)."""
        slots = torch.arange(num_slots, device=self.step["token_slot"].device,
                             dtype=self.step["token_slot"].dtype)
        hit = (self.step["token_slot"][:, None] == slots) & self.step["token_valid"][:, None]
        return hit.to(dtype)

    def _stacked_linear(self, y, x, lora_a, lora_b) -> torch.Tensor:
        """Every token times every device slot's adapter as the buffers lie, the wanted
        product selected by a [T, N] one-hot of its device slot: no gather and no copy of
        any weight (each slice's own shrink: concatenating the slices' A would copy all N
        slots), FLOPs N*T*R*(D+O). The TPU's graphs whose slot bucket is every slot run
        it: a gather there read all N slots anyway, and the copies it feeds cost more
        than the product (docs/benchmarks.md, the decode-step profile)."""
        onehot = self._slot_onehot(lora_a[0].shape[0], x.dtype)
        spec = "td,ndr->tnr" if self.a_by_input else "td,nrd->tnr"
        xa = [torch.einsum(spec, x, la.to(x.dtype)) * onehot[:, :, None] for la in lora_a]
        return self._stacked_expand(y, xa, lora_b)

    def _stacked_expand(self, y, xa: list[torch.Tensor], lora_b) -> torch.Tensor:
        """xa[i] [T, N, R], zero outside each token's own slot -> y + the slices' deltas
        (lora_b[i] [N, R, O_i] as it lies)."""
        deltas = [torch.einsum("tnr,nro->to", xi, lb.to(xi.dtype)) for xi, lb in zip(xa, lora_b)]
        return y + torch.cat(deltas, dim=1).to(y.dtype)

    def _gathered_linear(self, y, x, lora_a, lora_b) -> torch.Tensor:
        """bgmv: each token's own adapter weights gathered by its device slot, then per-token
        matrix-vector products as multiply + sum over a non-minor axis (XLA CPU ran them
        2-8x slower as batched matmuls from 32 rows up). FLOPs T*R*(D+O) whatever S is,
        for a gather of T*R*(D+O) weights: what wins for decode-sized buckets with many
        adapters."""
        slot = self.step["token_slot"]
        return self._gathered_expand(y, _gathered_shrink(x, lora_a, slot), lora_b)

    def _gathered_expand(self, y, xa, lora_b) -> torch.Tensor:
        return self._add_masked(y, _gathered_deltas(xa, lora_b, self.step["token_slot"]))

    def _light_linear(self, y, x, lora_a, lora_b) -> torch.Tensor:
        """The split strategy's light rows: the gathered bgmv over L rows picked from the
        step's tokens, their deltas added back at those tokens."""
        rows, slot = self.step["light_rows"], self.step["light_slot"]
        delta = _gathered_deltas(_gathered_shrink(x.index_select(0, rows), lora_a, slot),
                                 lora_b, slot)
        # where, not a multiply: a padding row adds exactly zero (to token 0).
        delta = torch.where(self.step["light_valid"][:, None], delta, torch.zeros_like(delta))
        return y.index_add(0, rows, delta.to(y.dtype))

    def _block_slots(self) -> torch.Tensor:
        return self.step["block_slot"].clamp(min=0)  # padding blocks compute on slot 0

    def _grouped_linear(self, y, x, lora_a, lora_b) -> torch.Tensor:
        perm, nb = self.step["perm"], self.step["block_slot"].shape[0]
        slot = self._block_slots()
        a = torch.cat([la.index_select(0, slot) for la in lora_a], dim=2).to(x.dtype)
        xs = x.index_select(0, perm).view(nb, perm.shape[0] // nb, x.shape[1])
        return self._grouped_expand(y, torch.bmm(xs, a), lora_b)

    def _grouped_expand(self, y, ys, lora_b) -> torch.Tensor:
        """ys [NB, B, n*R] in segment order -> y + deltas scattered back to token order
        (padding rows are never read back)."""
        slot, rank = self._block_slots(), lora_b[0].shape[1]
        zs = [torch.bmm(ys[:, :, i * rank:(i + 1) * rank], lb.index_select(0, slot).to(ys.dtype))
              for i, lb in enumerate(lora_b)]
        t_pad = ys.shape[0] * ys.shape[1]
        z = torch.cat(zs, dim=2).reshape(t_pad, -1).index_select(0, self.step["dest"])
        return self._add_masked(y, z)

    # ---- embedding LoRA: lookup as the shrink, then the step's expand ----

    def add_lora_embedding(self, y: torch.Tensor, ids: torch.Tensor, lora_a: torch.Tensor,
                           lora_b: torch.Tensor) -> torch.Tensor:
        """Semantics: y[t] += lora_b[s] @ lora_a[s, ids[t]], s = slot of token t (PEFT's
        lora_embedding_B @ lora_embedding_A[:, id], scale folded into B).
        Shapes: y [T, H], ids [T], lora_a [N, V, R] (rows by token id), lora_b [N, H, R]
        ([N, R, H] where `weights_transposed`). Needs slot_vectors (each token's device
        slot in the step)."""
        with platform.trace_scope("lora", y):
            return self._add_lora_embedding(y, ids, lora_a, lora_b)

    def _add_lora_embedding(self, y, ids, lora_a, lora_b) -> torch.Tensor:
        n, vocab, rank = lora_a.shape
        rows = self.step["token_slot"].to(torch.int64) * vocab + ids.to(torch.int64)
        xa = lora_a.reshape(n * vocab, rank).index_select(0, rows).to(y.dtype)
        xa = torch.where(self.step["token_valid"][:, None], xa, torch.zeros_like(xa))
        if not self.fuse_slices:  # tensor parallel: the per-slice ops' segment layout
            layout = self._get_layout(y.dtype)
            ys = _to_segments(xa, layout.perm, layout.row_valid)
            return self.add_expand(y, ys, lora_b, 0, y.shape[1])
        if self.backend == "pallas":
            layout = self._host_layout()
            return ops.segment_expand(_to_segments(xa, layout.perm, layout.row_valid), lora_b,
                                      layout, y, 0, y.shape[1], backend="pallas")
        strategy = self.graph_strategy(y.shape[0])
        if strategy == "slots":
            return self._slots_expand(y, [self._to_slot_rows(xa, n)], [lora_b])
        if strategy == "single":
            return self._single_expand(y, xa, [lora_b])
        if strategy in ("onehot", "indexed"):  # indexed: onehot's arrays, for the linears
            return self._onehot_expand(y, xa[:, None, :] * self._onehot(xa.dtype)[:, :, None],
                                       [lora_b])
        if strategy in ("stacked", "grouped_kernel"):  # the embedding: every slot's B
            return self._stacked_expand(
                y, [xa[:, None, :] * self._slot_onehot(n, xa.dtype)[:, :, None]], [lora_b])
        if strategy in ("gathered", "split"):  # split: token_slot is there (slot_vectors)
            return self._gathered_expand(y, xa, [lora_b])
        ys = _to_segments(xa, self.step["perm"], self.step["row_valid"])
        nb = self.step["block_slot"].shape[0]
        return self._grouped_expand(y, ys.view(nb, ys.shape[0] // nb, rank), [lora_b])

    # ---- lm_head LoRA, in the logits graph ----

    @staticmethod
    def add_lora_logits(logits: torch.Tensor, h: torch.Tensor, lora_a: torch.Tensor,
                        lora_b: torch.Tensor, row_slot: torch.Tensor) -> torch.Tensor:
        """Semantics: logits[n] += lora_b[s] @ lora_a[s] @ h[n], s = row_slot[n] (-1: none).
        Shapes: logits [N, V], h [N, H], lora_a [L, R, H], lora_b [L, V, R], over all L
        slots: the logits graph is keyed by the request bucket alone, and this one-hot
        product costs N*L*R*(H+V), a fraction L*R/H of the lm_head matmul itself."""
        with platform.trace_scope("lora", h):
            return PunicaWrapper._add_lora_logits(logits, h, lora_a, lora_b, row_slot)

    @staticmethod
    def _add_lora_logits(logits, h, lora_a, lora_b, row_slot) -> torch.Tensor:
        num_slots, rank, hidden = lora_a.shape
        slots = torch.arange(num_slots, device=h.device, dtype=row_slot.dtype)
        onehot = (row_slot[:, None] == slots).to(h.dtype)  # [N, L]
        xa = (h @ lora_a.reshape(num_slots * rank, hidden).to(h.dtype).T)
        xa = xa.view(h.shape[0], num_slots, rank) * onehot[:, :, None]
        delta = torch.einsum("nlr,lvr->nv", xa, lora_b.to(h.dtype))
        return logits + delta.to(logits.dtype)

    def _pallas_linear(self, y, x, lora_a, lora_b, output_slices) -> torch.Tensor:
        """The fused grouped kernel (ops/grouped_lora.py) over the buffers as they lie
        (A [N, R, D], B rank-first [N, R, O]: `grouped_kernel`)."""
        from vllm_tpu_lora.ops.bgmv_pallas import grouped_linear

        delta = grouped_linear(x, self.step["token_slot"], self.step["token_valid"], lora_a,
                               lora_b)
        return y + delta.to(y.dtype)

    def _indexed_linear(self, y, x, lora_a, lora_b) -> torch.Tensor:
        """The indexed Pallas kernel (ops/indexed_lora.py) on onehot's arrays and the
        host's count of the step's adapters: each read once at its slot by the kernel's
        own DMAs, in groups that fill 128 lanes, no copy of the weights and no read of
        the slots it does not use. The TPU table's decode graphs over many of more slots
        (step_layout.INDEXED_*). A CPU's [N, D, R] A (tests that run the TPU's table
        there) is transposed first."""
        from vllm_tpu_lora.ops.bgmv_pallas import indexed_linear

        if self.a_by_input:
            lora_a = [la.transpose(1, 2) for la in lora_a]
        delta = indexed_linear(x, self.step["token_lora_idx"], self.step["active_slots"],
                               lora_a, lora_b, self.step["active_count"])
        return y + delta.to(y.dtype)

    def _host_layout(self) -> ops.SegmentLayout:
        st = self.step
        return ops.SegmentLayout(
            perm=st["perm"], row_valid=st["row_valid"], dest=st["dest"],
            token_valid=st["token_valid"], idx=st["token_lora_idx"],
            block_slot=st["block_slot"], block=st["perm"].shape[0] // st["block_slot"].shape[0])

    # ---- tensor parallel: per slice, on the active slots' weights ----

    def _get_layout(self, dtype: torch.dtype):
        if self._layout is None:
            idx = self.step["token_lora_idx"]
            self._layout = ops.make_segment_layout(idx, self.num_active_slots,
                                                   backend=self.backend, dtype=dtype)
            # Adapter scales are folded into lora_b at load time.
            self._ones = torch.ones(self.num_active_slots, dtype=dtype, device=idx.device)
        return self._layout

    def add_shrink(self, x: torch.Tensor, lora_a: torch.Tensor,
                   keep_rank_axis: bool = False) -> torch.Tensor:
        """Semantics: ys = x @ lora_a[slot(t)].T for the active slots, in segment layout.
        Shapes: x [T, D], lora_a [max_loras, R, D] -> [T_pad, R]. keep_rank_axis: for a
        rank-sharded lora_a (see ops.bgmv_xla.onehot_shrink)."""
        layout = self._get_layout(x.dtype)
        a = lora_a.index_select(0, self.step["active_slots"])
        return ops.segment_shrink(x, a, layout, self._ones, backend=self.backend,
                                  keep_rank_axis=keep_rank_axis)

    def add_expand(self, y: torch.Tensor, ys: torch.Tensor, lora_b: torch.Tensor,
                   offset: int, size: int) -> torch.Tensor:
        """Semantics: y[:, offset:offset+size] += ys @ lora_b[slot(t)].T.
        Shapes: y [T, O_total], ys [T_pad, R], lora_b [max_loras, size, R] -> y'."""
        b = lora_b.index_select(0, self.step["active_slots"])
        return ops.segment_expand(ys, b, self._get_layout(y.dtype), y, offset, size,
                                  backend=self.backend)


# Measured with the transposed buffers against PEFT's layout, in a chain of 4 layers' LoRA
# linears (hidden 512, intermediate 1408, rank 16, distinct weights per layer; LoRA ms over
# the base linears): T=16 S=8 1.7 vs 3.5, T=32 S=8 2.2 vs 5.8, T=32 S=16 2.6 vs 5.7, T=64
# S=16 4.3 vs 11.7. Reducing over a non-minor axis vectorises along the output's minor
# one; over the minor axis (PEFT's layout) each output was a scalar loop.


# The gathered shrink sums over D in two stages, SHRINK_CHUNK-wide chunks first, with an
# optimization barrier between them. As one sum over D, XLA CPU's tree-reduction rewrite
# (reduce windows of 32) split the reduction off the product, so every step wrote out and
# read back the [T, D, n*R] product of each token's gathered weights; merged, the two
# stages became that same single reduction. With the barrier the product, the chunk sums
# and the last sum compile into one fusion. Replayed in the engine, LoRA ms over the base
# graph: 16-token decode over 8 adapters (benchmark_lora shape) 2.2-2.3 vs 3.2-3.3; 32-token
# decode over 16 adapters (vs-PEFT shape) 16.3-17.2 vs 22.3-22.4 (chunks of 8, 16 and 32
# within noise of each other; 32 is the widest the rewrite leaves whole).
SHRINK_CHUNK = 32


def _gathered_shrink(x: torch.Tensor, lora_a: list[torch.Tensor],
                     slot: torch.Tensor) -> torch.Tensor:
    """x [N, D], each row's device slot [N], lora_a[i] [L, D, R] -> xa [N, n*R] over the
    concatenated slices."""
    a = torch.cat([la.index_select(0, slot) for la in lora_a], dim=2).to(x.dtype)
    n, d, r = a.shape
    if d % SHRINK_CHUNK:
        return (a * x[:, :, None]).sum(1)
    chunks = d // SHRINK_CHUNK
    partial = (a.view(n, chunks, SHRINK_CHUNK, r)
               * x.view(n, chunks, SHRINK_CHUNK, 1)).sum(2)  # [N, D/chunk, n*R]
    platform.optimization_barrier([partial])
    return partial.sum(1)


def _gathered_deltas(xa: torch.Tensor, lora_b: list[torch.Tensor],
                     slot: torch.Tensor) -> torch.Tensor:
    """xa [N, n*R], lora_b[i] [L, R, O_i] -> the concatenated slices' deltas
    [N, sum(O_i)], unmasked."""
    rank = lora_b[0].shape[1]
    return torch.cat([(lb.index_select(0, slot).to(xa.dtype)
                       * xa[:, i * rank:(i + 1) * rank, None]).sum(1)
                      for i, lb in enumerate(lora_b)], dim=1)


def _to_segments(xa: torch.Tensor, perm: torch.Tensor, row_valid: torch.Tensor) -> torch.Tensor:
    """Token-order rows -> segment order (padding rows zero)."""
    ys = xa.index_select(0, perm)
    return torch.where(row_valid[:, None], ys, torch.zeros_like(ys))
