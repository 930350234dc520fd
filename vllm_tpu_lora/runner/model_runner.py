"""Runs one scheduled step on the device with precompiled, fixed-shape graphs, on either
runtime (runner/runtime.py: torch_xla, or jax through torchax).

Two graphs per step: the model forward keyed by (token bucket, LoRA-slot bucket, attention
window bucket), which ends by picking the last hidden row of up to max_num_seqs
sequences, and logits + sampling keyed by the request bucket and whether the step is all
greedy without top logprobs (vLLM's all-greedy fast path: argmax only, no filters, noise
or topk). Graph counts add instead of multiply.
Inputs are prepared on the host in numpy and moved once; the sampler's results come
back in one packed transfer.

A step is launched (`launch`) and its results collected later (`collect`): with async
scheduling the engine launches step N+1 before it collects step N. The sampler writes its
token ids into a device buffer (`last_tokens`) that the next forward reads for the rows
`prev_rows` names, so step N's tokens feed step N+1 without a round trip to the host.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from vllm_tpu_lora import platform
from vllm_tpu_lora.engine.block_manager import blocks_needed
from vllm_tpu_lora.engine.scheduler import ScheduledSeq
from vllm_tpu_lora.layers.attention import AttentionMetadata
from vllm_tpu_lora.layers.linear import pretranspose_linears
from vllm_tpu_lora.layers.sampler import SamplingTensors, sample, sample_greedy
from vllm_tpu_lora.runner import buckets
from vllm_tpu_lora.runner.compile_guard import CompileGuard
from vllm_tpu_lora.runner.input_batch import StepArrays, kv_window_blocks, prepare_step
from vllm_tpu_lora.runner.lazy_capture import FixedTensors
from vllm_tpu_lora.runner.packed_inputs import PackLayout, pack_arrays, unpack_arrays
from vllm_tpu_lora.runner.runtime import TorchXLARuntime

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    token_ids: np.ndarray  # [n] sampled token per scheduled sequence
    logprobs: np.ndarray  # [n] raw logprob of the sampled token
    ranks: np.ndarray  # [n] rank of the sampled token (1 = most likely)
    topk_ids: np.ndarray | None  # [n, K] when any sequence asked for logprobs
    topk_logprobs: np.ndarray | None


@dataclass
class LaunchedStep:
    """A step whose graphs are launched: its packed results, still on the device."""
    packed: torch.Tensor
    num_seqs: int
    want_top_logprobs: bool


class ModelRunner:
    def __init__(self, model: torch.nn.Module, *, num_layers: int, kv_cache_shapes: list[tuple],
                 kv_dtype: torch.dtype, block_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, eos_token_id: int | None,
                 lora_manager=None, punica=None, tp=None, enforce_eager: bool = False,
                 runtime=None) -> None:
        self.rt = runtime if runtime is not None else TorchXLARuntime()
        self.device = self.rt.device
        model.untie_lm_head()
        pretranspose_linears(model)
        if tp is not None:  # tensor parallel: packed columns into per-device blocks (host)
            tp.prepare(model)
        self.model = self.rt.move_module(model)
        self.block_size = block_size
        self.dtype = kv_dtype  # the activations' dtype
        self.max_blocks_per_seq = blocks_needed(max_model_len, block_size)
        self.eos_token_id = eos_token_id
        self.kv_caches = [tuple(self.rt.zeros(shape, kv_dtype) for shape in kv_cache_shapes)
                          for _ in range(num_layers)]
        if tp is not None:  # before the first sync, so each device only gets its shards
            tp.shard(self.model, self.kv_caches, lora_manager.layers if lora_manager else None)
        self.token_ladder = buckets.token_buckets(max_num_batched_tokens)
        self.request_ladder = buckets.request_buckets(max_num_seqs)
        self.max_num_seqs = max_num_seqs
        # Attention windows (KV blocks a query block gathers): a graph per window bucket.
        self.window_ladder = buckets.kv_block_buckets(self.max_blocks_per_seq, block_size,
                                                      ragged_kernel=platform.is_tpu())
        self.lora_manager, self.punica = lora_manager, punica
        self.slot_ladder = buckets.slot_buckets(lora_manager.max_loras if lora_manager else 0)
        # enforce_eager (vLLM's name): re-trace every step lazily instead of replaying.
        # Tensor parallel on torch_xla (SPMD) also re-traces: replaying an SPMD graph by
        # hash hit in-flight scalar placeholders among its by-value inputs (docs/design.md);
        # the jax runtime replays sharded graphs like any other.
        self.capture = (None if enforce_eager or (tp is not None and self.rt.name != "jax")
                        else self.rt.make_capture(self._weights))
        compile_fn = self.capture.compile if self.capture else self.rt.eager
        self._forward_graph = compile_fn(_bind_forward(self.model, punica))
        self._sample_graph = compile_fn(_bind_sample(self.model, punica))
        if lora_manager is not None:
            lora_manager.use_runtime(self.rt, self.capture)
        # Written between steps (slot loads): graph arguments, never baked-in constants.
        self._lora_buffers = FixedTensors(lora_manager.buffers if lora_manager else [],
                                          read_only=True)
        self._kv_args = FixedTensors(self.kv_caches)  # updated in place, never replaced
        # The sampler's token ids of the latest step, [max_num_seqs] (async scheduling).
        self._last_tokens = FixedTensors([self.rt.zeros((max_num_seqs,), torch.int64)])
        self._logits_buffers = lora_manager.logits_buffers if lora_manager else []
        self._neg_token_ids = self.rt.to_device(-np.arange(model.config["vocab_size"],
                                                           dtype=np.float32))
        self.guard = CompileGuard(self.capture, self.rt.compile_count)
        # Benchmarks: wait for each graph before the host goes on, so that XLA's
        # ExecuteTime metric adds up to the device time of a step (no overlap).
        self.serialize_graphs = False
        self.warmup_seconds = 0.0
        self.num_graphs = 0
        # Served steps per forward graph, "T<tokens>/S<slots>/W<window>/<kind>" (window:
        # the attention window bucket in tokens; kind: "base" or the
        # LoRA strategy the step ran): which graphs the traffic lands on, e.g. how often
        # a slots bucket falls back (stats()["forward_graph_steps"]).
        self.forward_graph_steps: collections.Counter[str] = collections.Counter()
        self.rt.launched(captured=False)  # torch_xla: the moves above, run now

    def _weights(self) -> list[torch.Tensor]:
        """What graphs read without being given it: every parameter and buffer of the
        model but the LoRA slot buffers, which are graph arguments (written between steps)."""
        state = {id(b) for b in (self.lora_manager.buffers if self.lora_manager else [])}
        return [t for t in itertools.chain(self.model.parameters(), self.model.buffers())
                if id(t) not in state]

    # ---- graphs ----

    def _to_device(self, x: np.ndarray) -> torch.Tensor:
        return self.rt.to_device(x)

    def _upload(self, groups: dict[str, dict[str, np.ndarray]]) -> tuple[list, PackLayout]:
        """A graph's host arrays in one int64 transfer plus one per float dtype (see
        packed_inputs)."""
        flats, layout = pack_arrays(groups)
        return [self._to_device(f) for f in flats], layout

    def _forward(self, a: StepArrays, num_slots: int, fallback: bool = False) -> torch.Tensor:
        lora = {}
        if self.punica is not None:
            lora = self.punica.plan_step(a.token_lora_idx, a.active_slots, num_slots,
                                         self.dtype, fallback)
        flats, layout = self._upload(forward_host_arrays(a, lora))
        # A base-only graph (S = 0) reads no slot buffer: not passing them keeps them out
        # of its inputs (~56 for 4 layers x 7 linears; the replay costs per input).
        last = self._forward_graph(flats, layout, num_slots, self._kv_args,
                                   self._lora_buffers if num_slots else [], self._last_tokens)
        self._launched(last)
        return last

    def _sample_inputs(self, a: StepArrays, row_slots: np.ndarray | None = None,
                       greedy: bool = False) -> tuple[list, PackLayout, bool]:
        """The logits graph's host arrays, moved (and `greedy`, which picks the graph they
        were built for). row_slots: each sampled row's device slot (-1: none); read only
        when lm_head carries LoRA. greedy: every row is greedy and no top logprobs are
        wanted (the parameters are then not even uploaded)."""
        st = {} if greedy else dict(
            temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
            seeds=a.seeds, step=a.steps)
        rows = {}
        if self._logits_buffers:
            slots = np.full(a.temperature.shape[0], -1, np.int32)
            if row_slots is not None:
                slots[:len(row_slots)] = row_slots
            rows = {"row_slot": slots}
        flats, layout = self._upload({"st": st, "rows": rows,
                                      "mask": {"blocked_ids": a.blocked_ids}})
        return flats, layout, greedy

    def _sample(self, last_hidden: torch.Tensor,
                inputs: tuple[list, PackLayout, bool]) -> torch.Tensor:
        flats, layout, greedy = inputs
        packed = self._sample_graph(last_hidden, flats, layout, self._neg_token_ids,
                                    self._logits_buffers, greedy, self._last_tokens)
        self._launched(packed)
        return packed

    def _launched(self, out: torch.Tensor) -> None:
        self.rt.launched(self.capture is not None)
        if self.serialize_graphs:
            self.rt.wait(out)

    # ---- public ----

    def execute(self, scheduled: list[ScheduledSeq], want_top_logprobs: bool) -> StepResult:
        """Launch a step and wait for its results."""
        return self.collect(self.launch(scheduled, want_top_logprobs))

    @torch.no_grad()
    def launch(self, scheduled: list[ScheduledSeq], want_top_logprobs: bool) -> LaunchedStep:
        """Prepare, move and launch a step's graphs; nothing waits for the device."""
        n_tok = sum(s.num_tokens for s in scheduled)
        t_b = buckets.pick(self.token_ladder, n_tok)
        r_b = buckets.pick(self.request_ladder, len(scheduled))
        with self.guard.watch("model step"):
            position_of, active_slots = self._activate_loras(scheduled)
            w_b = buckets.pick(self.window_ladder, kv_window_blocks(scheduled, self.block_size))
            arrays = prepare_step(scheduled, t_b, r_b, self.max_blocks_per_seq, self.block_size,
                                  position_of, self.eos_token_id, self.max_num_seqs, w_b)
            arrays.active_slots = active_slots
            s_b = (self.punica.graph_slots(arrays.token_lora_idx, len(active_slots),
                                           self.slot_ladder) if self.punica is not None else 0)
            row_slots = None  # the logits graph reads them only when lm_head carries LoRA
            if self._logits_buffers:
                row_slots = np.array([active_slots[position_of[s.seq.lora_int_id]]
                                      if s.seq.lora_int_id else -1 for s in scheduled], np.int32)
            greedy = not want_top_logprobs and all(s.seq.params.is_greedy for s in scheduled)
            # The sampler's arrays move before the forward launches: a transfer issued
            # right after a launch (or a wait for one) took 10-20x an idle one on XLA CPU.
            sample_inputs = self._sample_inputs(arrays, row_slots, greedy)
            last_hidden = self._forward(arrays, s_b)
            kind = self.punica.planned_kind if self.punica is not None else "base"
            self.forward_graph_steps[f"T{t_b}/S{s_b}/W{w_b * self.block_size}/{kind}"] += 1
            packed = self._sample(last_hidden, sample_inputs)
        return LaunchedStep(packed, len(scheduled), want_top_logprobs)

    def collect(self, launched: LaunchedStep) -> StepResult:
        """Wait for a launched step and read its results."""
        packed = self.rt.to_host(launched.packed)
        n, want_top_logprobs = launched.num_seqs, launched.want_top_logprobs
        k = (packed.shape[1] - 3) // 2  # 0 from the greedy graph
        return StepResult(
            token_ids=packed[:n, 0].astype(np.int64), logprobs=packed[:n, 1],
            ranks=packed[:n, 2].astype(np.int64),
            topk_ids=packed[:n, 3:3 + k].astype(np.int64) if want_top_logprobs else None,
            topk_logprobs=packed[:n, 3 + k:] if want_top_logprobs else None)

    def _activate_loras(self, scheduled: list[ScheduledSeq]) -> tuple[dict[int, int], list[int]]:
        """Adapters of this step into device slots: ({lora_int_id: active position},
        [device slot of each active position]). Positions are numbered as the step's
        sequences meet them (its rows follow `scheduled`): a prefill's token tile then
        spans a short run of positions, all the indexed kernel reads for it."""
        requests = {s.seq.lora_int_id: s.seq.lora_request for s in scheduled if s.seq.lora_int_id}
        if not requests:
            return {}, []
        slot_of = self.lora_manager.activate(requests)
        ids = list(requests)  # first appearance: a dict keeps its keys' first insertion
        return {lid: pos for pos, lid in enumerate(ids)}, [slot_of[lid] for lid in ids]

    def lora_kernel_shapes(self, dtype: str) -> list:
        """Every LoRA kernel shape this runner's graphs contain (for the TPU lowering test)."""
        from vllm_tpu_lora.ops.pallas_export import kernel_shapes

        if self.lora_manager is None:
            return []
        layers = self.lora_manager.kernel_layers()
        ins = sorted({d for d, _ in layers if d is not None})
        outs = sorted({size for _, slices in layers for size in slices})
        rank = [self.lora_manager.max_rank]
        t, s = self.token_ladder, self.slot_ladder
        return ([k for k in kernel_shapes(t, s, ins, rank, [dtype]) if k.op == "shrink"]
                + [k for k in kernel_shapes(t, s, outs, rank, [dtype]) if k.op == "expand"])

    @torch.no_grad()
    def precompile(self) -> None:
        start = time.perf_counter()
        before = self.rt.compile_count()
        # A bucket whose LoRA strategy has a fallback graph (steps it does not fit) is
        # traced twice.
        forwards = [(t_b, s_b, w_b, fallback) for t_b in self.token_ladder
                    for s_b in self.slot_ladder
                    if buckets.slots_reachable(t_b, s_b, self.slot_ladder, self.max_num_seqs)
                    for w_b in self.window_ladder for fallback in (False, True)
                    if not fallback or (self.punica is not None
                                        and self.punica.fallback_graph(t_b, s_b))]
        n_fwd = len(forwards)
        if self.punica is not None and self.punica.fuse_slices and self.punica.backend == "xla":
            logger.info("LoRA strategy per graph: %s",
                        self.punica.strategy_table(self.token_ladder, self.slot_ladder,
                                                   self.max_num_seqs))
        bar = tqdm(total=n_fwd + 2 * len(self.request_ladder), desc="Precompiling graphs",
                   unit="graph")
        # The jax runtime traces every graph here and compiles them in background threads
        # (waited for at the end of the block); the calls return zeros instead of running.
        with self.capture.background_compiles() if self.capture else contextlib.nullcontext():
            if self.lora_manager is not None:  # also compiles the slot-write graphs
                warm = self.lora_manager.warmup_adapter()
                for k in self.lora_manager.write_batch_sizes:  # every batch size, once
                    self.lora_manager.write_slots([(slot, warm) for slot in range(k)])
                # Then every slot holds real weights for the forwards run below (torch_xla;
                # inside the jax runtime's background compiles nothing runs).
                self.lora_manager.write_slots([(slot, warm)
                                               for slot in range(self.lora_manager.max_loras)])
            for t_b, s_b, w_b, fallback in forwards:
                last = self._forward(self._dummy(t_b, self.request_ladder[0], s_b, w_b), s_b,
                                     fallback)
                if self.capture is not None:  # which capture a compile's log line names
                    logger.debug("warm-up: forward T%d/S%d/W%s%s is capture %d", t_b, s_b,
                                 w_b, " (fallback)" if fallback else "",
                                 self.capture.captures)
                bar.update(1)
            for r_b in self.request_ladder:
                for greedy in (False, True):
                    inputs = self._sample_inputs(self._dummy(self.token_ladder[0], r_b, 0),
                                                 greedy=greedy)
                    self.rt.to_host(self._sample(last, inputs))
                    bar.update(1)
        bar.close()
        if self.lora_manager is not None:
            self.lora_manager.clear_all_slots()
        self._zero_kv_caches()
        self.num_graphs = self.rt.compile_count() - before
        self.warmup_seconds = time.perf_counter() - start
        self.guard.arm()

    def _dummy(self, t_b: int, r_b: int, s_b: int, w_b: int | None = None) -> StepArrays:
        """An all-padding step (attention window w_b, default the widest); with s_b > 0
        the padding tokens cycle through the slots so the LoRA graph is traced with every
        slot in play."""
        a = prepare_step([], t_b, r_b, self.max_blocks_per_seq, self.block_size, {},
                         self.eos_token_id, self.max_num_seqs, w_b)
        a.active_slots = list(range(s_b))
        if s_b:
            a.token_lora_idx[:] = np.arange(t_b) % s_b
        return a

    def _zero_kv_caches(self) -> None:
        # Warm-up only wrote the null block, but leave the cache as a fresh start would.
        self.rt.zero_([c for layer_cache in self.kv_caches for c in layer_cache])


_INPUT_FIELDS = ("input_ids", "positions", "logits_indices", "prev_rows")
_META_FIELDS = ("slot_mapping", "q_block_token_idx", "q_block_tables", "q_block_kv_lens",
                "token_out_index", "seq_kv_lens", "seq_block_tables", "cu_q_lens", "num_seqs")


def forward_host_arrays(a: StepArrays, lora: dict[str, np.ndarray]) -> dict:
    """The forward graph's host arrays, grouped as it unpacks them: token rows, attention
    metadata and the step's LoRA plan."""
    return {"inputs": {name: getattr(a, name) for name in _INPUT_FIELDS},
            "meta": {name: getattr(a, name) for name in _META_FIELDS}, "lora": lora}


def _bind_forward(model, punica):
    def model_forward(flats: list, layout: PackLayout, num_slots: int, kv: FixedTensors,
                      lora_buffers, last_tokens: FixedTensors) -> torch.Tensor:
        """Graph 1, per (token bucket, LoRA-slot bucket): the forward pass, ending with the
        last hidden row of each sequence [max_num_seqs, hidden]. flats / layout: the step's
        inputs, attention metadata and LoRA plan (packed_inputs). lora_buffers are read
        through the LoRA layers; they are arguments so that slot writes are seen.
        last_tokens: the previous step's sampled ids, input ids of the rows prev_rows names."""
        groups = unpack_arrays(flats, layout)
        inputs, meta, lora = groups["inputs"], groups["meta"], groups.get("lora", {})
        prev = inputs["prev_rows"]
        input_ids = torch.where(prev >= 0, last_tokens.value[0][prev.clamp(min=0)],
                                inputs["input_ids"])
        if punica is not None:
            punica.set_step(num_slots, lora)
        hidden = model(input_ids, inputs["positions"], kv.value,
                       AttentionMetadata(**meta))
        return hidden.index_select(0, inputs["logits_indices"])
    return model_forward


def _bind_sample(model, punica):
    def logits_and_sample(last_hidden, flats: list, layout: PackLayout, neg_token_ids,
                          logits_buffers, greedy: bool, last_tokens: FixedTensors) -> torch.Tensor:
        """Graph 2, per (request bucket R, greedy): logits, sampling and logprobs of the
        first R rows, packed into one float32 [R, 3 + 2K] transfer (token ids < 2**24 are
        exact; K = 0 in the greedy graph, which has no top logprobs).
        flats / layout (packed_inputs): the sampling parameters (none in the greedy
        graph), the blocked ids and, when lm_head carries LoRA, each row's device slot
        (logits_buffers: lm_head's LoRA buffers, arguments so that slot writes are seen)."""
        groups = unpack_arrays(flats, layout)
        st, lora_rows = groups.get("st", {}), groups.get("rows", {})
        blocked_ids = groups["mask"]["blocked_ids"]
        if punica is not None:
            punica.logits_rows = lora_rows.get("row_slot")
        try:
            logits = model.compute_logits(last_hidden[: blocked_ids.shape[0]])
        finally:
            if punica is not None:
                punica.logits_rows = None
        logits = _mask_blocked(logits.float(), blocked_ids)
        if greedy:
            token_ids, logprobs = sample_greedy(logits)
            top = []
        else:
            out = sample(logits, SamplingTensors(**st), neg_token_ids=neg_token_ids)
            token_ids, logprobs = out.sampled_token_ids, out.sampled_logprobs
            top = [out.topk_token_ids.float(), out.topk_logprobs]
        # Kept on the device for the next step's forward (async scheduling).
        last_tokens.value[0].index_copy_(
            0, torch.arange(token_ids.shape[0], device=token_ids.device),
            token_ids.to(torch.int64))
        raw = torch.log_softmax(logits, dim=-1)
        rank = (raw > logprobs[:, None]).sum(-1) + 1
        return torch.cat([token_ids[:, None].float(), logprobs[:, None], rank[:, None].float(),
                          *top], dim=1)
    return logits_and_sample


def _mask_blocked(logits: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    """-inf at blocked[r, j] >= 0 (EOS / stop ids while min_tokens is not reached)."""
    # scatter_add, not scatter: padding entries alias id 0 and must not overwrite a hit.
    valid = (blocked >= 0).to(torch.int32)
    hits = torch.zeros(logits.shape, dtype=torch.int32, device=logits.device)
    hits = hits.scatter_add(1, blocked.clamp(min=0), valid)
    return logits.masked_fill(hits > 0, float("-inf"))
