"""Turns sampled tokens into text, applies stop conditions, builds RequestOutputs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from vllm_tpu_lora.engine.sequence import Sequence, SequenceStatus
from vllm_tpu_lora.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    lora_request: Any = None
    arrival_time: float = field(default_factory=time.monotonic)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


def append_token(seq: Sequence, token_id: int, logprob: float, rank: int,
                 topk: tuple[list[int], list[float]] | None, tokenizer) -> None:
    seq.output_token_ids.append(token_id)
    if seq.first_token_time is None:
        seq.first_token_time = time.monotonic()
    seq.cumulative_logprob += logprob
    seq.detok.add_token(token_id)
    if seq.params.logprobs is not None:
        entry = {token_id: Logprob(logprob, rank, tokenizer.decode([token_id]))}
        ids, lps = topk or ([], [])  # none: logprobs=0 (only the sampled token's)
        for r, (tid, lp) in enumerate(zip(ids[: seq.params.logprobs], lps), start=1):
            entry.setdefault(tid, Logprob(float(lp), r, tokenizer.decode([tid])))
        seq.logprobs.append(entry)


def check_stop(seq: Sequence, eos_token_id: int | None, max_model_len: int) -> SequenceStatus | None:
    """vLLM's order: EOS, stop token ids, stop strings (all after min_tokens), then length."""
    p, token = seq.params, seq.output_token_ids[-1]
    if seq.num_output_tokens >= p.min_tokens:
        if not p.ignore_eos and token == eos_token_id:
            return SequenceStatus.FINISHED_STOPPED
        if token in p.stop_token_ids:
            seq.stop_reason = token
            return SequenceStatus.FINISHED_STOPPED
        if p.stop_strings and _apply_stop_strings(seq):
            return SequenceStatus.FINISHED_STOPPED
    if length_reached(seq, max_model_len):
        return SequenceStatus.FINISHED_LENGTH
    return None


def length_reached(seq: Sequence, max_model_len: float, pending: int = 0) -> bool:
    """check_stop's length rule, counting `pending` tokens not appended yet (the scheduler
    asks it about a token still in flight)."""
    p = seq.params
    max_tokens = p.max_tokens if p.max_tokens is not None else max_model_len
    return (seq.num_output_tokens + pending >= max_tokens
            or seq.num_tokens + pending >= max_model_len)


def _apply_stop_strings(seq: Sequence) -> bool:
    text = seq.detok.output_text
    longest = max(len(s) for s in seq.params.stop_strings)
    # Only the tail can hold a stop string that the newest token completed.
    window_start = max(0, len(text) - longest - 8)
    for stop in seq.params.stop_strings:
        idx = text.find(stop, window_start)
        if idx >= 0:
            keep = idx + len(stop) if seq.params.include_stop_str_in_output else idx
            seq.detok.truncate(keep)
            seq.stop_reason = stop
            return True
    return False


def make_request_output(state: RequestState) -> RequestOutput:
    outs = []
    for seq in state.seqs:
        want_lp = seq.params.logprobs is not None
        outs.append(CompletionOutput(
            index=seq.index, text=seq.output_text, token_ids=list(seq.output_token_ids),
            cumulative_logprob=seq.cumulative_logprob if want_lp else None,
            logprobs=list(seq.logprobs) if want_lp else None,
            finish_reason=seq.status.value if seq.is_finished else None,
            stop_reason=seq.stop_reason, lora_request=state.lora_request))
    metrics = {"arrival_time": state.arrival_time}
    firsts = [s.first_token_time for s in state.seqs if s.first_token_time is not None]
    if firsts:
        metrics["first_token_time"] = min(firsts)
    return RequestOutput(request_id=state.request_id, prompt=state.prompt,
                         prompt_token_ids=state.prompt_token_ids, outputs=outs,
                         finished=state.finished, lora_request=state.lora_request,
                         metrics=metrics)
