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


def _kv_identity(seq: Sequence, pos: int) -> tuple:
    """What the K/V at `pos` of `seq` depends on: its weights, salt and tokens up to pos."""
    tokens = seq.prompt_token_ids + seq.output_token_ids
    return seq.lora_int_id, seq.cache_salt, hash(tuple(tokens[:pos + 1]))


def test_prefix_caching_fuzz_never_serves_wrong_kv_and_never_leaks():
    """Thousands of random add/abort/finish events over shared prefixes, 3 adapters, salts,
    preemption and resets, against a shadow KV cache: every token a step reads must have
    been written by a sequence with the same adapter, salt and tokens; no step writes a slot
    another sequence reads; at the end every block is free."""
    import random

    rng = random.Random(0)
    bm = BlockManager(16, 4, enable_caching=True)
    sched = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=16, max_loras=2)
    prefixes = [[rng.randrange(1, 50) for _ in range(n)] for n in (5, 8, 14)]
    kv: dict[int, tuple] = {}
    live: list[Sequence] = []
    events = 0
    for step in range(1500):
        for _ in range(rng.choice((0, 0, 1, 2))):
            lora = rng.choice((0, 0, 1, 2, 3))
            seq = Sequence(f"r{events}", 0, rng.choice(prefixes) + [rng.randrange(1, 50) for _ in
                           range(rng.choice((0, 0, 1, 3, 6)))],
                           SamplingParams(max_tokens=rng.randrange(1, 9)), 0,
                           LoRARequest(f"a{lora}", lora, "/x") if lora else None,
                           cache_salt=rng.choice((None, None, "s")))
            sched.add(seq)
            live.append(seq)
            events += 1
        if live and rng.random() < 0.08:
            victim = live.pop(rng.randrange(len(live)))
            sched.finish(victim, SequenceStatus.FINISHED_ABORTED)
            events += 1
        if rng.random() < 0.005:
            bm.reset_prefix_cache()
        out = sched.schedule()
        reads, writes = set(), []
        for s in out.scheduled:
            assert s.num_tokens >= 1  # a full hit still computes the last token, to sample
            for pos in range(s.start):
                slot = bm.slot(s.seq, pos)
                assert kv.get(slot) == _kv_identity(s.seq, pos), f"step {step}: wrong KV"
                reads.add(slot)
            writes += [(bm.slot(s.seq, p), _kv_identity(s.seq, p))
                       for p in range(s.start, s.start + s.num_tokens)]
        assert len({w for w, _ in writes}) == len(writes) and not reads & {w for w, _ in writes}
        kv.update(writes)
        sched.update(out)
        for s in out.scheduled:
            if s.samples:
                s.seq.output_token_ids.append(rng.randrange(1, 50))
                if s.seq.num_output_tokens >= s.seq.params.max_tokens:
                    sched.finish(s.seq, SequenceStatus.FINISHED_LENGTH)
                    live.remove(s.seq)
                    events += 1
        held = [b for seq in sched.running for b in seq.block_ids]
        assert all(bm._refs[b] == held.count(b) for b in set(held))
        assert bm.num_free_blocks + len(set(held)) == bm.num_usable_blocks
    for seq in live:
        sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
    assert events > 2000
    assert bm.num_free_blocks == bm.num_usable_blocks and not any(bm._refs)
    hits = sum(h for _, h in sched.prefix_cache_stats.values())
    assert hits > 1000 and sched.num_preemptions > 10, (hits, sched.num_preemptions)
