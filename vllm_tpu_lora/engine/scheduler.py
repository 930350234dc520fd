"""vLLM-V1 style scheduler: one token budget shared by decodes and (chunked) prefills.

Each step first gives every running sequence its next tokens (1 for a decode, the
next chunk for a partial prefill), preempting the newest sequences by recompute when
KV blocks run out, then admits waiting sequences FCFS while budget, `max_num_seqs`
and blocks allow. At most `max_loras` distinct adapters are running at once; a
request for another adapter waits, and cannot starve: once the oldest waiting request
has been passed over `STARVATION_STEPS` times nothing else is admitted before it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from vllm_tpu_lora.engine.block_manager import BlockManager
from vllm_tpu_lora.engine.sequence import Sequence, SequenceStatus

STARVATION_STEPS = 8


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # first token position computed this step
    num_tokens: int
    # Whether this chunk reaches the end of the known tokens, so a token is sampled.
    # Fixed at scheduling time: the sequence grows once the step has run.
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_tokens == self.seq.num_tokens


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
                 max_num_batched_tokens: int, max_loras: int | None = None) -> None:
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_loras = max_loras
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._head_skips = 0
        self.num_preemptions = 0
        # Pinned adapters hold device slots for good, so they count against max_loras.
        self.pinned_loras: set[int] = set()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def running_lora_ids(self) -> set[int]:
        return {s.lora_int_id for s in self.running if s.lora_int_id} | self.pinned_loras

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
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
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

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.blocks.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        self.num_preemptions += 1

    def _lora_admissible(self, seq: Sequence, lora_ids: set[int]) -> bool:
        if self.max_loras is None or not seq.lora_int_id or seq.lora_int_id in lora_ids:
            return True
        return len(lora_ids) < self.max_loras

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        lora_ids = self.running_lora_ids()
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._lora_admissible(seq, lora_ids):
                if not skipped and self._head_skips >= STARVATION_STEPS:
                    break  # let the running adapters drain so the head gets a slot
                skipped.append(self.waiting.popleft())
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.blocks.can_grow(seq, n):
                break
            self.waiting.popleft()
            self.blocks.grow(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if seq.lora_int_id:
                lora_ids.add(seq.lora_int_id)
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
            budget -= n
        self._head_skips = self._head_skips + 1 if skipped else 0
        self.waiting.extendleft(reversed(skipped))

    def update(self, out: SchedulerOutput) -> None:
        """Account the computed tokens of a step that has run."""
        for s in out.scheduled:
            s.seq.num_computed_tokens = s.start + s.num_tokens

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Stop `seq` (done or aborted) and release everything it holds."""
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
