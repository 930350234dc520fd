"""LLMEngine: add requests, step() until done. The whole loop is schedule -> run -> update.

With async scheduling (on a TPU by default, off with enforce_eager) a step() schedules and
launches step N+1 before it collects step N: the host's scheduling, input preparation,
LoRA slot planning and transfers for N+1 run while the device computes N, and N's output
processing (detokenizing, stop checks) while it computes N+1. Tokens N samples reach N+1
on the device (runner/model_runner.py); sequences N stops have their N+1 rows dropped.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
from transformers import AutoTokenizer

from vllm_tpu_lora import platform
from vllm_tpu_lora.config import EngineArgs, EngineConfig, xla_cache_dir
from vllm_tpu_lora.engine.block_manager import BlockManager, blocks_needed
from vllm_tpu_lora.engine.detokenizer import IncrementalDetokenizer
from vllm_tpu_lora.engine.output_processor import (
    RequestState,
    append_token,
    check_stop,
    make_request_output,
)
from vllm_tpu_lora.engine.scheduler import Scheduler, SchedulerOutput
from vllm_tpu_lora.engine.sequence import Sequence, SequenceStatus
from vllm_tpu_lora.lora.request import LoRARequest
from vllm_tpu_lora.models.loader import load_model, resolve_dtype
from vllm_tpu_lora.outputs import RequestOutput
from vllm_tpu_lora.parallel import TensorParallel
from vllm_tpu_lora.runner.model_runner import LaunchedStep, ModelRunner
from vllm_tpu_lora.runner.runtime import make_runtime, resolve_runtime
from vllm_tpu_lora.sampling_params import SamplingParams, wrap_int64

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict
# How long an idle step waits for a background adapter read before returning.
_LOAD_WAIT_S = 0.005
# How long an idle engine waits for the adapter reads in flight before admitting a burst.
_BURST_WAIT_S = 0.1


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
        runtime = resolve_runtime(mc.runtime)
        tp_size = config.parallel_config.tensor_parallel_size
        # Before anything else: tensor parallelism must switch XLA to SPMD before any XLA
        # tensor (torch_xla), or give JAX its virtual CPU devices before it starts (jax).
        self.tp = TensorParallel.create(tp_size, mc.hf_config, config.lora_config, runtime)
        if runtime == "torch_xla":
            platform.enable_persistent_cache(xla_cache_dir())
        # Also before the model is built: the jax runtime says which device JAX found.
        self.runtime = make_runtime(runtime)
        if self.tp is not None and runtime == "jax":
            self.runtime.use_mesh(self.tp.tpm.mesh)  # step inputs replicated over it
        self.max_model_len = mc.max_model_len
        self.tokenizer = AutoTokenizer.from_pretrained(mc.tokenizer_path)
        self.eos_token_id = self.tokenizer.eos_token_id
        dtype = resolve_dtype(mc.dtype)
        model = load_model(mc.model, mc.hf_config, cc.block_size, dtype)
        self.vocab_size = mc.hf_config["vocab_size"]
        num_layers = mc.hf_config["num_hidden_layers"]
        slot_elems = sum(int(np.prod(shape)) for shape in model.kv_cache_shapes(1))
        num_blocks = self._num_kv_blocks(num_layers, slot_elems, dtype.itemsize)
        self.block_manager = BlockManager(num_blocks, cc.block_size,
                                          enable_caching=cc.enable_prefix_caching)
        lc = config.lora_config
        self.lora_manager, punica = self._setup_lora(model, dtype) if lc else (None, None)
        self.scheduler = Scheduler(self.block_manager, sc.max_num_seqs, sc.max_num_batched_tokens,
                                   loras=self.lora_manager, max_model_len=self.max_model_len)
        wanted = sc.async_scheduling
        self.async_scheduling = ((platform.is_tpu() if wanted is None else wanted)
                                 and not mc.enforce_eager)
        self.runner = ModelRunner(
            model, num_layers=num_layers, kv_cache_shapes=model.kv_cache_shapes(num_blocks * cc.block_size),
            kv_dtype=dtype, block_size=cc.block_size, max_model_len=self.max_model_len,
            max_num_seqs=sc.max_num_seqs, max_num_batched_tokens=sc.max_num_batched_tokens,
            eos_token_id=self.eos_token_id, lora_manager=self.lora_manager, punica=punica,
            tp=self.tp, enforce_eager=mc.enforce_eager, runtime=self.runtime)
        if punica is not None and punica.backend == "pallas":
            self._check_kernel_budget(dtype)
        self._rng = np.random.default_rng(mc.seed)
        self._requests: dict[str, RequestState] = {}
        self._counter = itertools.count()
        self.num_steps = 0
        # The launched step whose results are not collected yet (async scheduling).
        self._in_flight: _InFlight | None = None

    def _setup_lora(self, model, dtype):
        """Wrap the model's linears with LoRA layers (from outside: the model stays plain)."""
        from vllm_tpu_lora.lora import step_layout
        from vllm_tpu_lora.lora.layers import wrap_lora_layers
        from vllm_tpu_lora.lora.manager import LoRAManager
        from vllm_tpu_lora.lora.punica import PunicaWrapper, resolve_lora_backend

        lc = self.config.lora_config
        lora_dtype = dtype if lc.lora_dtype == "auto" else resolve_dtype(lc.lora_dtype)
        backend = (self.tp.lora_backend(lc.lora_backend) if self.tp else
                   resolve_lora_backend(lc.lora_backend))
        punica = PunicaWrapper(backend, fuse_slices=self.tp is None)
        self._log_lora_backend(backend, lc)
        punica.slot_vectors = lc.enable_lora_bias or lc.enable_dora
        punica.max_loras, punica.max_rank = lc.max_loras, lc.max_lora_rank
        # The TPU table's largest graphs run the grouped kernel, on the jax runtime only:
        # torch_xla reaches Pallas through a JAX bridge never verified on a TPU.
        if lc.lora_backend == "auto" and self.runtime.name == "jax":
            punica.grouped_kernel_from = step_layout.GROUPED_KERNEL_FROM
        layers = wrap_lora_layers(model, punica, lc.max_loras, lc.max_lora_rank, lora_dtype,
                                  lc.target_modules, bias=lc.enable_lora_bias,
                                  dora=lc.enable_dora)
        manager = LoRAManager(model, layers, max_loras=lc.max_loras,
                              max_lora_rank=lc.max_lora_rank, max_cpu_loras=lc.max_cpu_loras,
                              dtype=lora_dtype, target_modules=lc.target_modules,
                              # torch_xla's SPMD steps are traced lazily: one eager
                              # write per buffer there; jax captures the write like a step.
                              one_transfer=self.tp is None or self.runtime.name == "jax",
                              allow_bias=lc.enable_lora_bias,
                              allow_dora=lc.enable_dora)
        return manager, punica

    def _log_lora_backend(self, backend: str, lc) -> None:
        """Say which LoRA backend (and, on a TPU's xla backend, which strategy) runs."""
        what = backend
        if backend == "xla" and self.tp is None and platform.is_tpu():
            what = "xla (per graph; the table is logged at precompile)"
        logger.info("LoRA backend: %s (lora_backend=%r, max_loras=%d, max_lora_rank=%d)",
                    what, lc.lora_backend, lc.max_loras, lc.max_lora_rank)

    def _check_kernel_budget(self, dtype) -> None:
        """Refuse, before compiling anything, a configuration whose Pallas LoRA kernels
        cannot fit in TPU VMEM (ValueError naming the shape). Pure arithmetic: no jax."""
        from vllm_tpu_lora.ops import vmem
        from vllm_tpu_lora.ops.kernel_shapes import check_kernel_budget, lora_layer_kernel_shapes

        shapes = lora_layer_kernel_shapes(self.lora_manager.kernel_layers(), self.runner.token_ladder,
                                          self.runner.slot_ladder, self.lora_manager.max_rank,
                                          vmem.dtype_name(dtype))
        check_kernel_budget(shapes, vmem.VMEM_LIMIT_CEILING_BYTES)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        engine = cls(args.create_engine_config())
        if args.precompile:
            engine.runner.precompile()
            logger.info("precompiled %d graphs in %.1fs", engine.runner.num_graphs,
                        engine.runner.warmup_seconds)
        return engine

    def _num_kv_blocks(self, num_layers: int, slot_elems: int, itemsize: int) -> int:
        cc, sc = self.config.cache_config, self.config.scheduler_config
        per_seq = blocks_needed(self.max_model_len, cc.block_size)
        if cc.num_kv_blocks is not None:
            num = cc.num_kv_blocks
        else:
            bytes_per_block = num_layers * cc.block_size * slot_elems * itemsize
            # No point holding more than every sequence at full length (+ the null block).
            num = min(cc.kv_cache_memory_bytes // bytes_per_block, sc.max_num_seqs * per_seq + 1)
        if num - 1 < per_seq:
            raise ValueError(
                f"The model's max seq len ({self.max_model_len}) is larger than the maximum "
                f"number of tokens that can be stored in KV cache ({(num - 1) * cc.block_size}). "
                "Try increasing `num_kv_blocks` or `kv_cache_memory_bytes`, or decreasing "
                "`max_model_len`.")
        return num

    # ---- requests ----

    @staticmethod
    def _cache_salt(prompt: PromptType) -> str | None:
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
        return salt

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            raise ValueError(f"prompt dict needs 'prompt' or 'prompt_token_ids', got {sorted(prompt)}")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"Unsupported prompt type {type(prompt).__name__}")

    def _validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("The decoder prompt cannot be empty")
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"The decoder prompt (length {len(ids)}) is longer than the maximum model "
                f"length of {self.max_model_len}. Make sure that `max_model_len` is no smaller "
                "than the number of text tokens.")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"Token id {bad[0]} is out of vocabulary (vocab size {self.vocab_size})")

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    lora_request: Any = None) -> None:
        """Validate everything before touching any state, so a bad request changes nothing."""
        params = params or SamplingParams()
        if request_id in self._requests:
            raise ValueError(f"Request id {request_id} already running.")
        text, ids = self._tokenize(prompt)
        salt = self._cache_salt(prompt)
        self._validate_prompt(ids)
        self._check_lora_request(lora_request)
        seqs = []
        for i in range(params.n):
            # Any Python int seeds (offline); the step's seed rows are int64, so it is kept
            # modulo 2**64 (as SamplingTensors keeps seeds), and seed + i may wrap too.
            seed = (wrap_int64(params.seed + i) if params.seed is not None
                    else int(self._rng.integers(2**62)))
            seq = Sequence(request_id, i, ids, params, seed, lora_request, cache_salt=salt)
            seq.detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
            seqs.append(seq)
        self._requests[request_id] = RequestState(request_id, text, ids, seqs, lora_request)
        for seq in seqs:
            self.scheduler.add(seq)

    def _check_lora_request(self, lora_request: Any) -> None:
        if lora_request is None:
            return
        if self.lora_manager is None:
            raise ValueError("LoRA is not enabled. Use --enable-lora to enable LoRA.")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        # Validates the files (not the tensor data); the host copy is read in the background.
        # Requests between two steps share one check of a cached adapter's files, and an
        # idle engine checks again: files replaced on disk are seen by the next request
        # once a step has run or the engine was idle.
        if not self._requests:
            self.lora_manager.registry.new_round()
        self.lora_manager.register(lora_request)

    # ---- adapters (vLLM's LLMEngine names) ----

    def _require_lora(self):
        if self.lora_manager is None:
            raise ValueError("LoRA is not enabled. Use --enable-lora to enable LoRA.")
        return self.lora_manager

    def add_lora(self, lora_request: LoRARequest, *, load_inplace: bool = False) -> bool:
        """Read and validate an adapter into the host cache now (False: it already was).
        load_inplace: replace the weights of the adapter with this id; sequences admitted
        from now on use the new ones, running ones finish on the old ones (no step mixes
        them)."""
        manager = self._require_lora()
        if load_inplace:
            manager.load_inplace(lora_request)
            return True
        return manager.add_lora(lora_request)

    def lora_users(self, lora_id: int) -> int:
        """Unfinished sequences that use adapter `lora_id`."""
        return sum(s.lora_int_id == lora_id
                   for s in self.scheduler.running + list(self.scheduler.waiting))

    def remove_lora(self, lora_id: int) -> bool:
        users = self.lora_users(lora_id)
        if users:
            raise ValueError(f"LoRA {lora_id} is in use by {users} unfinished sequence(s); "
                             "abort them or wait for them to finish before removing it")
        return self._require_lora().remove_lora(lora_id)

    def running_request_ids(self) -> set[str]:
        return {seq.request_id for seq in self.scheduler.running}

    def list_loras(self) -> set[int]:
        return self._require_lora().list_loras()

    def pin_lora(self, lora_id: int) -> bool:
        return self._require_lora().pin_lora(lora_id)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached KV blocks (vLLM's name). Sequences keep the blocks they hold;
        nothing computed so far is matched again."""
        dropped = self.block_manager.reset_prefix_cache()
        logger.info("prefix cache reset (%d cached blocks dropped)", dropped)
        return True

    def abort_request(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            state = self._requests.pop(rid, None)
            if state is None:
                continue
            for seq in state.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        # A step still in flight once every request has finished holds only rows to drop:
        # the next step() collects it.
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def new_request_id(self) -> str:
        return str(next(self._counter))

    # ---- the loop ----

    def step(self) -> list[RequestOutput]:
        if self.lora_manager is not None:
            self.lora_manager.registry.new_round()
        failed = self._advance_lora_loads() if self.lora_manager is not None else []
        if (self.lora_manager is not None and self.scheduler.waiting and not self.scheduler.running
                and self._in_flight is None):
            # An idle engine facing a burst of requests for adapters on disk: admitting each
            # as its read lands starts the burst as a trickle of small prefill steps, and the
            # staggered finishes keep every later step small too. Let the reads in flight
            # (at most max_loras, a few ms each) land first, so the burst starts as one batch.
            self.lora_manager.registry.wait_for_loads(_BURST_WAIT_S, every=True)
            failed += self._advance_lora_loads()
        out = self.scheduler.schedule()
        previous, launched = self._in_flight, None
        if out.scheduled:
            launched = self._launch(out, previous)
        self._in_flight = launched if self.async_scheduling else None
        outputs = self._collect(previous) if previous is not None else []
        if launched is not None and not self.async_scheduling:
            outputs += self._collect(launched)
        if not out.scheduled and previous is None:
            if self.lora_manager is not None and self.scheduler.waiting:
                self.lora_manager.registry.wait_for_loads(_LOAD_WAIT_S)  # don't spin on the GIL
        return failed + outputs

    def _launch(self, out: SchedulerOutput, previous: _InFlight | None) -> _InFlight:
        """Launch a scheduled step; its sequences' sampled tokens become pending."""
        for s in out.scheduled:
            if s.seq.num_pending_tokens:  # its last input is sampled by `previous`
                s.prev_row = previous.rows[s.seq.seq_id]
        # Top logprobs cost the sampler a topk (and keep the step off the greedy graph);
        # logprobs=0 needs only the sampled token's logprob and rank, which every step has.
        want_top = any((s.seq.params.logprobs or 0) > 0 for s in out.scheduled)
        launched = self.runner.launch(out.scheduled, want_top)
        self.scheduler.update(out)
        for s in out.scheduled:
            s.seq.num_pending_tokens += s.samples
        self.num_steps += 1
        return _InFlight(out, launched, {s.seq.seq_id: i for i, s in enumerate(out.scheduled)})

    def _collect(self, step: _InFlight) -> list[RequestOutput]:
        """Wait for a launched step; append its tokens, apply stop conditions, build the
        outputs. Rows of sequences that stopped (or were aborted) since it was scheduled
        are dropped: nothing is emitted past a stop."""
        try:
            result = self.runner.collect(step.launched)
        except Exception:
            # Its tokens never arrive: nothing may wait for them (the caller aborts the
            # requests that were running).
            for s in step.out.scheduled:
                s.seq.num_pending_tokens -= s.samples
            raise
        touched: dict[str, RequestState] = {}
        for i, s in enumerate(step.out.scheduled):
            if not s.samples:
                continue
            seq = s.seq
            seq.num_pending_tokens -= 1
            if seq.is_finished:
                continue
            topk = None if result.topk_ids is None else (result.topk_ids[i].tolist(),
                                                         result.topk_logprobs[i].tolist())
            append_token(seq, int(result.token_ids[i]), float(result.logprobs[i]),
                         int(result.ranks[i]), topk, self.tokenizer)
            status = check_stop(seq, self.eos_token_id, self.max_model_len)
            if status is not None:
                self.scheduler.finish(seq, status)
            else:  # blocks that waited for this token to be known
                self.scheduler.register_computed(seq)
            touched[seq.request_id] = self._requests[seq.request_id]
        outputs = [make_request_output(st) for st in touched.values()]
        for o in outputs:
            if o.finished:
                del self._requests[o.request_id]
        return outputs

    def _advance_lora_loads(self) -> list[RequestOutput]:
        """Harvest background adapter reads; fail the requests of adapters that could not be
        read (finished outputs carrying the error); start reads for the waiting queue."""
        failures = self.lora_manager.registry.poll()
        outputs = []
        if failures:
            for state in list(self._requests.values()):
                error = failures.get(state.lora_request.lora_int_id if state.lora_request else 0)
                if error is None or any(s.status is SequenceStatus.RUNNING for s in state.seqs):
                    continue
                logger.warning("request %s failed: %s", state.request_id, error)
                for seq in state.seqs:
                    if not seq.is_finished:
                        self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
                out = make_request_output(state)
                out.error = error
                outputs.append(out)
                del self._requests[state.request_id]
        self.lora_manager.registry.prefetch(self.scheduler.waiting_lora_order())
        return outputs

    def stats(self, per_adapter: bool = True) -> dict[str, Any]:
        """Engine counters; per_adapter adds "loras": {name: loads, evictions, residency,
        running/waiting sequences} (cost grows with the number of known adapters)."""
        lm = self.lora_manager
        extra: dict[str, Any] = {}
        if lm is not None:
            extra = {"max_loras": lm.max_loras, "lora_host_loads": lm.num_host_loads,
                     "lora_host_cache_size": len(lm.list_loras()),
                     "lora_requests_waiting_for_adapter": sum(
                         1 for s in self.scheduler.waiting if s.lora_int_id)}
            if per_adapter:
                extra["loras"] = lm.adapter_stats(self.scheduler.waiting_per_lora())
                for a in extra["loras"].values():
                    queries, hits = self.scheduler.prefix_cache_stats.get(a["lora_int_id"], (0, 0))
                    a["prefix_cache_queries"], a["prefix_cache_hits"] = queries, hits
        bm, by_lora = self.block_manager, self.scheduler.prefix_cache_stats.values()
        return {**extra,
            "enable_prefix_caching": bm.enable_caching,
            "prefix_cache_queries": sum(q for q, _ in by_lora),
            "prefix_cache_hits": sum(h for _, h in by_lora),
            "num_cached_kv_blocks": bm.num_cached_blocks,
            "prefix_cache_evictions": bm.num_cache_evictions,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_free_kv_blocks": self.block_manager.num_free_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "num_graphs": self.runner.num_graphs,
            "forward_graph_steps": dict(self.runner.forward_graph_steps),
            "warmup_seconds": self.runner.warmup_seconds,
            "compilations_after_warmup": self.runner.guard.compilations_after_warmup,
            "captures_after_warmup": self.runner.guard.captures_after_warmup,
            "graph_replay": self.runner.capture is not None,
            "device": platform.device_type(),
            "runtime": self.runtime.name,
            "tensor_parallel_size": self.tp.size if self.tp else 1,
            "lora_slots_in_use": self.lora_manager.num_slots_in_use if self.lora_manager else 0,
            "lora_slot_loads": self.lora_manager.num_slot_loads if self.lora_manager else 0,
        }


@dataclass
class _InFlight:
    """A launched step: what was scheduled, its device results, each sequence's row."""
    out: SchedulerOutput
    launched: LaunchedStep
    rows: dict[int, int]
