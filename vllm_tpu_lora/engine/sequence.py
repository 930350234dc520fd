"""A sequence being generated: token ids, progress through the model, KV blocks, status."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from vllm_tpu_lora.sampling_params import SamplingParams

_seq_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


@dataclass
class Sequence:
    request_id: str  # the user's request id
    index: int  # which of the request's n completions this is
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # randomness comes from (seed, output position): batch-independent
    lora_request: Any = None
    arrival_time: float = field(default_factory=time.monotonic)
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    # Async scheduling: tokens a launched step samples that the host has not seen yet
    # (the next step takes them on the device). At scheduling time at most 1.
    num_pending_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    stop_reason: int | str | None = None
    logprobs: list[dict] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    detok: Any = None  # IncrementalDetokenizer, set by the engine
    first_token_time: float | None = None
    num_preemptions: int = 0
    cache_salt: str | None = None  # only requests with the same salt share cached KV
    # Prefix caching: hashes of the full blocks so far, the root they chain from, and how
    # many of the leading blocks are registered in (or were taken from) the cache.
    block_hashes: list[bytes] = field(default_factory=list)
    hash_root: bytes | None = None
    num_cached_blocks: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return self.num_tokens + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def lora_int_id(self) -> int:
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def output_text(self) -> str:
        return self.detok.output_text if self.detok is not None else ""

    def reset_for_recompute(self) -> None:
        """Preempted: its blocks are gone, so prompt and output so far are recomputed."""
        self.num_computed_tokens = 0
        self.block_ids = []
        self.num_cached_blocks = 0
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1
