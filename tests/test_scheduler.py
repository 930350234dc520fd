"""Scheduler on its own (pure Python): token budget, chunked prefill, preemption, LoRA limit."""

from vllm_tpu_lora.engine.block_manager import BlockManager
from vllm_tpu_lora.engine.scheduler import STARVATION_STEPS, Scheduler
from vllm_tpu_lora.engine.sequence import Sequence, SequenceStatus
from vllm_tpu_lora.lora.request import LoRARequest
from vllm_tpu_lora.sampling_params import SamplingParams


def _seq(n_prompt: int, lora_id: int = 0, rid: str = "r") -> Sequence:
    lora = LoRARequest(f"a{lora_id}", lora_id, "/x") if lora_id else None
    return Sequence(rid, 0, list(range(1, n_prompt + 1)), SamplingParams(), 0, lora)


def _run_step(sched: Scheduler, token: int = 7):
    """What the engine does after the model ran: account tokens, append samples."""
    out = sched.schedule()
    sched.update(out)
    for s in out.scheduled:
        if s.samples:
            s.seq.output_token_ids.append(token)
    return out


def test_chunked_prefill_and_decode_share_the_budget():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    a, b = _seq(6), _seq(30)
    sched.add(a)
    sched.add(b)
    out = _run_step(sched)
    assert [(s.seq, s.num_tokens) for s in out.scheduled] == [(a, 6), (b, 4)]
    assert out.scheduled[0].samples and not out.scheduled[1].samples
    out = _run_step(sched)  # a decodes 1 token, b's prefill continues with the other 9
    assert [(s.seq, s.start, s.num_tokens) for s in out.scheduled] == [(a, 6, 1), (b, 4, 9)]
    assert out.num_tokens == 10


def test_max_num_seqs_caps_running():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [_seq(3) for _ in range(4)]
    for s in seqs:
        sched.add(s)
    out = _run_step(sched)
    assert [s.seq for s in out.scheduled] == seqs[:2]
    assert len(sched.waiting) == 2


def test_preemption_by_recompute_frees_the_newest():
    bm = BlockManager(num_blocks=5, block_size=2)  # 4 usable blocks = 8 tokens
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=100)
    old, new = _seq(4), _seq(4)
    sched.add(old)
    sched.add(new)
    _run_step(sched)  # both prefilled: 4 blocks used, each has a sampled token
    assert bm.num_free_blocks == 0
    out = _run_step(sched)  # old needs a 3rd block -> new is preempted
    assert out.preempted == [new]
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0
    assert new.output_token_ids == [7]  # kept: recomputed as part of the prefill later
    assert [s.seq for s in out.scheduled] == [old]
    assert sched.waiting[0] is new


def test_waiting_admission_stops_when_blocks_run_out():
    sched = Scheduler(BlockManager(3, 4), max_num_seqs=4, max_num_batched_tokens=100)
    a, b = _seq(8), _seq(2)
    sched.add(a)
    sched.add(b)
    out = _run_step(sched)
    assert [s.seq for s in out.scheduled] == [a]  # FCFS: b does not jump the queue


def test_at_most_max_loras_adapters_run_and_none_starves():
    sched = Scheduler(BlockManager(256, 4), max_num_seqs=8, max_num_batched_tokens=64,
                      max_loras=1)
    first = _seq(2, lora_id=1, rid="first")
    other = _seq(2, lora_id=2, rid="other")
    sched.add(first)
    sched.add(other)
    out = _run_step(sched)
    assert [s.seq for s in out.scheduled] == [first]
    # A stream of adapter-1 requests keeps arriving; adapter 2 must still get in.
    admitted_other = False
    for step in range(STARVATION_STEPS + 20):
        sched.add(_seq(2, lora_id=1, rid=f"more{step}"))
        out = _run_step(sched)
        assert len(out.lora_ids()) <= 1
        for s in list(sched.running):
            if s.num_output_tokens >= 2 and s is not other:
                sched.finish(s, SequenceStatus.FINISHED_LENGTH)
        if other.status is SequenceStatus.RUNNING:
            admitted_other = True
            break
    assert admitted_other


def test_finish_releases_blocks_from_running_and_waiting():
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=100)
    a, b = _seq(5), _seq(5)
    sched.add(a)
    sched.add(b)
    _run_step(sched)
    sched.finish(a, SequenceStatus.FINISHED_ABORTED)
    sched.finish(b, SequenceStatus.FINISHED_ABORTED)
    assert bm.num_free_blocks == 15 and not sched.has_unfinished()
