"""vLLM-V1 style scheduler: one token budget shared by decodes and (chunked) prefills.

Each step first gives every running sequence its next tokens (1 for a decode, the
next chunk for a partial prefill), preempting the newest sequences by recompute when
KV blocks run out, then admits waiting sequences FCFS while budget, `max_num_seqs`
and blocks allow.

Adapters: at most `max_loras` distinct adapters (pinned ones included) are running at
once; a request for another adapter waits, and cannot starve: once a request has been
passed over for want of a slot `STARVATION_STEPS` steps in a row, nothing else is admitted
before it. With a LoRA manager (`loras`), a sequence is admitted only when its adapter's
host copy is in memory (the manager's loader reads it in the background: a step never
touches the disk); it takes a reference on admission and drops it when it finishes, and
the manager never evicts an adapter a running sequence uses. A request waiting for its
adapter to load does not hold up the queue behind it.

Prefix caching (when the block manager has it on): a sequence admitted from the queue
first takes the longest run of cached blocks its known tokens hash to, under its adapter's
weights and cache_salt, and computes only the rest; the last known token is always
computed, so a token can be sampled. A preempted sequence comes back the same way, often
finding its own blocks still cached. After each step the blocks a sequence completed are
registered for the ones that follow.

Async scheduling (the engine schedules step N+1 while step N runs): a sequence that step
N samples counts that token as pending; N+1 computes it (its id is taken on the device)
and samples the next. A sequence whose pending token ends it by length is not scheduled
again; one that stops otherwise (EOS, stop string, abort) has its N+1 row discarded. A
sequence preempted with a token in flight waits until the token arrives.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from vllm_tpu_lora.engine.block_manager import BlockManager
from vllm_tpu_lora.engine.output_processor import length_reached
from vllm_tpu_lora.engine.prefix_hash import block_hashes, root_hash
from vllm_tpu_lora.engine.sequence import Sequence, SequenceStatus

STARVATION_STEPS = 8
# Waiting sequences passed over per step before admission stops looking further: keeps a
# step's scheduling cost bounded with thousands queued behind adapters still loading.
MAX_SKIPPED_PER_STEP = 512


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # first token position computed this step
    num_tokens: int
    # Whether this chunk reaches the end of the tokens (pending included), so a token is
    # sampled. Fixed at scheduling time: the sequence grows once the step has run.
    samples: bool = field(init=False)
    # Async scheduling: the row of the step in flight whose sampled token is this
    # chunk's last input (-1: every input token is known on the host).
    prev_row: int = -1

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_tokens == self.seq.num_tokens_with_pending


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    def lora_ids(self) -> set[int]:
        return {s.seq.lora_int_id for s in self.scheduled if s.seq.lora_int_id}


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_loras: int | None = None,
                 loras=None, max_model_len: int | None = None) -> None:
        """loras: the LoRAManager (ready/acquire/release/set_running/pinned), or None for
        a plain cap of `max_loras` adapters. max_model_len: where a sequence stops by
        length (needed only with tokens pending)."""
        self.blocks = block_manager
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.loras = loras
        self.max_loras = loras.max_loras if loras is not None else max_loras
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._head_skips = 0
        self.num_preemptions = 0
        self._holds_ref: set[int] = set()  # seq_ids holding an adapter reference
        # lora_int_id (0: base model) -> [prompt tokens looked up, of those found cached]
        self.prefix_cache_stats: dict[int, list[int]] = {}

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def running_lora_ids(self) -> set[int]:
        """Adapters holding device slots: those of running sequences, and pinned ones."""
        pinned = self.loras.pinned if self.loras is not None else set()
        return {s.lora_int_id for s in self.running if s.lora_int_id} | pinned

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self._ends_with_pending(seq):
                i += 1
                continue
            n = min(seq.num_tokens_with_pending - seq.num_computed_tokens, budget)
            while not self.blocks.can_grow(seq, seq.num_computed_tokens + n):
                victim = self.running.pop()  # newest first
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            self.blocks.grow(seq, seq.num_computed_tokens + n)
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
            budget -= n
            i += 1
        return budget

    def _ends_with_pending(self, seq: Sequence) -> bool:
        """The token in flight brings the sequence to max_tokens or max_model_len (the
        length rule of check_stop): nothing more to compute for it."""
        max_model_len = math.inf if self.max_model_len is None else self.max_model_len
        return bool(seq.num_pending_tokens) and length_reached(seq, max_model_len,
                                                                seq.num_pending_tokens)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self._set_running(seq, -1)  # keeps its reference: it resumes on the same weights
        self.blocks.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        self.num_preemptions += 1

    def _lora_ready(self, seq: Sequence) -> bool:
        return (self.loras is None or not seq.lora_int_id or seq.seq_id in self._holds_ref
                or self.loras.ready(seq.lora_int_id))

    def _lora_admissible(self, seq: Sequence, lora_ids: set[int]) -> bool:
        if self.max_loras is None or not seq.lora_int_id or seq.lora_int_id in lora_ids:
            return True
        return len(lora_ids) < self.max_loras

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        lora_ids = self.running_lora_ids()
        skipped: list[Sequence] = []
        starved = False  # a sequence was passed over for want of an adapter slot
        try:
            while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
                   and len(skipped) < MAX_SKIPPED_PER_STEP):
                seq = self.waiting[0]
                # Its adapter still loading, or preempted with a token in flight (the
                # host must know every token to recompute): not its turn yet.
                if seq.num_pending_tokens or not self._lora_ready(seq):
                    skipped.append(self.waiting.popleft())
                    continue
                if not self._lora_admissible(seq, lora_ids):
                    if not starved and self._head_skips >= STARVATION_STEPS:
                        break  # let the running adapters drain so this one gets a slot
                    starved = True
                    skipped.append(self.waiting.popleft())
                    continue
                cached = self._cached_prefix(seq)
                start = len(cached) * self.blocks.block_size
                n = min(seq.num_tokens - start, budget)
                if not self.blocks.can_take(seq, cached, start + n):
                    break
                self.waiting.popleft()
                if self.blocks.enable_caching:
                    self.blocks.take(seq, cached)
                    seq.num_computed_tokens = start
                    self._count_lookup(seq, start)
                self.blocks.grow(seq, start + n)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                if seq.lora_int_id:
                    lora_ids.add(seq.lora_int_id)
                    self._take_ref(seq)
                    self._set_running(seq, +1)
                out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
                budget -= n
        finally:  # whatever happens, no sequence passed over drops out of the queue
            self._head_skips = self._head_skips + 1 if starved else 0
            self.waiting.extendleft(reversed(skipped))

    # ---- prefix caching ----

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        if seq.lora_int_id and self.loras is not None:
            key = self.loras.weights_key(seq.lora_int_id)
        else:
            key = seq.lora_int_id or None
        return block_hashes(seq, root_hash(key, seq.cache_salt), num_blocks,
                            self.blocks.block_size)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks a waiting sequence can start from (never its last known token)."""
        if not self.blocks.enable_caching:
            return []
        return self.blocks.cached_prefix(
            self._hashes(seq, (seq.num_tokens - 1) // self.blocks.block_size))

    def _count_lookup(self, seq: Sequence, hit_tokens: int) -> None:
        counts = self.prefix_cache_stats.setdefault(seq.lora_int_id, [0, 0])
        counts[0] += seq.num_tokens
        counts[1] += hit_tokens

    def register_computed(self, seq: Sequence) -> None:
        """Register the full blocks a running sequence has computed whose tokens the host
        knows (a block holding a pending token waits until the token arrives)."""
        if not self.blocks.enable_caching or seq.status is not SequenceStatus.RUNNING:
            return
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.blocks.block_size
        if full > seq.num_cached_blocks:
            self.blocks.register_full_blocks(seq, self._hashes(seq, full))

    # ---- adapter references ----

    def _take_ref(self, seq: Sequence) -> None:
        if self.loras is not None and seq.seq_id not in self._holds_ref:
            self.loras.acquire(seq.lora_int_id)
            self._holds_ref.add(seq.seq_id)

    def _set_running(self, seq: Sequence, delta: int) -> None:
        if self.loras is not None and seq.lora_int_id:
            self.loras.set_running(seq.lora_int_id, delta)

    def waiting_per_lora(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for seq in self.waiting:
            if seq.lora_int_id:
                counts[seq.lora_int_id] = counts.get(seq.lora_int_id, 0) + 1
        return counts

    def waiting_lora_order(self):
        """Adapter ids of the waiting queue, head first, each once (for prefetching)."""
        seen: set[int] = set()
        for seq in self.waiting:
            lid = seq.lora_int_id
            if lid and lid not in seen and seq.seq_id not in self._holds_ref:
                seen.add(lid)
                yield lid

    def update(self, out: SchedulerOutput) -> None:
        """Account the computed tokens of a step that has run."""
        for s in out.scheduled:
            s.seq.num_computed_tokens = s.start + s.num_tokens
            self.register_computed(s.seq)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Stop `seq` (done or aborted) and release everything it holds."""
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
            self._set_running(seq, -1)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        if seq.seq_id in self._holds_ref:
            self._holds_ref.discard(seq.seq_id)
            self.loras.release(seq.lora_int_id)
