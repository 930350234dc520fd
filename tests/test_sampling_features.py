"""Stop conditions, min_tokens, n, logprobs and detokenization through the whole engine."""

import math

from vllm_tpu_lora import SamplingParams
from vllm_tpu_lora.engine.detokenizer import IncrementalDetokenizer

PROMPT = "The cat looks at the lazy fox"


def _greedy(llm, prompt=PROMPT, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=kw.pop("max_tokens", 24), **kw)
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]


def test_stop_string_truncates_text(llama_llm):
    full = _greedy(llama_llm, ignore_eos=True)
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 3]
    assert stop.strip(), f"degenerate text {full.text!r}"
    out = _greedy(llama_llm, ignore_eos=True, stop=[stop])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.find(stop)]
    kept = _greedy(llama_llm, ignore_eos=True, stop=stop, include_stop_str_in_output=True)
    assert kept.text == full.text[: full.text.find(stop) + len(stop)]


def test_stop_token_ids_and_min_tokens(llama_llm):
    full = _greedy(llama_llm, ignore_eos=True)
    stop_id = full.token_ids[2]
    first = full.token_ids.index(stop_id)
    out = _greedy(llama_llm, ignore_eos=True, stop_token_ids=[stop_id])
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # While min_tokens is not reached the stop token is masked out of sampling.
    held = _greedy(llama_llm, ignore_eos=True, stop_token_ids=[stop_id], min_tokens=8)
    assert stop_id not in held.token_ids[:8]
    assert len(held.token_ids) >= 8


def test_max_tokens_is_length(llama_llm):
    out = _greedy(llama_llm, ignore_eos=True, max_tokens=7)
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_logprobs_are_consistent(llama_llm):
    out = _greedy(llama_llm, ignore_eos=True, logprobs=3, max_tokens=8)
    assert len(out.logprobs) == 8
    total = 0.0
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and 1 <= len(entry) <= 4
        assert entry[tok].rank == 1  # greedy picks the most likely token
        assert entry[tok].logprob == max(lp.logprob for lp in entry.values())
        assert sum(math.exp(lp.logprob) for lp in entry.values()) <= 1.0 + 1e-5
        total += entry[tok].logprob
    assert math.isclose(out.cumulative_logprob, total, rel_tol=1e-5)


def test_n_completions_with_seed(llama_llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    outs = llama_llm.generate(PROMPT, params, use_tqdm=False)[0].outputs
    assert [c.index for c in outs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in outs}) == 3
    again = llama_llm.generate(PROMPT, params, use_tqdm=False)[0].outputs
    assert [c.token_ids for c in again] == [c.token_ids for c in outs]


def test_seeds_are_kept_modulo_2_to_64(llama_llm):
    """Offline seeds may be any Python int (the step's seed rows are int64; a seed past
    them raised OverflowError inside the step): a seed and that seed + 2**64 draw alike,
    and completion i's seed + i wraps."""
    def draw(seed, n=1):
        params = SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True)
        return [c.token_ids for c in llama_llm.generate(PROMPT, params, use_tqdm=False)[0].outputs]

    assert draw(2**63 - 1, n=2) == draw(2**63 - 1 + 2**64) + draw(-(2**63))
    assert draw(2**64 + 5) == draw(5) != draw(6)


def test_out_of_range_top_k_and_stop_ids_act_as_no_limit(llama_llm):
    """A top_k past the vocabulary keeps every token and a stop id no token can have
    blocks nothing; values past int32 / int64 failed the whole step before."""
    def draw(**kw):
        params = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, **kw)
        return llama_llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids

    assert draw(top_k=2**40) == draw(top_k=0)
    assert draw(stop_token_ids=[2**70, -4], min_tokens=3) == draw(min_tokens=3)


def test_text_equals_full_decode(llama_llm):
    tok = llama_llm.get_tokenizer()
    for seed in range(3):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=30, ignore_eos=True)
        out = llama_llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
        full = tok.decode(out.token_ids, skip_special_tokens=True)
        # An incomplete UTF-8 tail is held back until a character completes.
        assert full == out.text or (full.startswith(out.text) and full.endswith("\ufffd"))


def test_incremental_detokenizer_on_multibyte_text(llama_llm):
    tok = llama_llm.get_tokenizer()
    text = " naïve café 日本 résumé, the cat"
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("Hello")
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
    deltas = [detok.add_token(t) for t in ids]
    assert "".join(deltas) == tok.decode(ids) == detok.output_text
    assert all("\ufffd" not in d for d in deltas)


def test_chat_uses_the_template(llama_llm):
    tok = llama_llm.get_tokenizer()
    msgs = [{"role": "user", "content": "What does the cat do?"}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    chat = llama_llm.chat(msgs, params, use_tqdm=False)[0]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    plain = llama_llm.generate({"prompt_token_ids": list(ids)}, params, use_tqdm=False)[0]
    assert chat.prompt_token_ids == list(ids)
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids


def test_all_greedy_steps_use_the_greedy_graph_and_match_the_full_sampler(llama_llm):
    """A step whose rows are all greedy and want no top logprobs runs the greedy-only sample
    graph; its tokens, sampled logprobs and ranks equal the full sampler's (the same
    requests with top logprobs, which force the full graph), min_tokens masking included."""
    runner = llama_llm.llm_engine.runner
    calls = []
    real = runner._sample_graph

    def spy(*args):
        calls.append(args[-2])  # the graph's `greedy` key (then last_tokens)
        return real(*args)

    prompts = ["The cat looks at the lazy fox", "Once upon a time", "a b c d e f g"]
    kw = dict(temperature=0.0, max_tokens=10, ignore_eos=True, min_tokens=4,
              stop_token_ids=[7])
    runner._sample_graph = spy
    try:
        fast = llama_llm.generate(prompts, SamplingParams(logprobs=0, **kw), use_tqdm=False)
        assert calls and all(calls)
        calls.clear()
        full = llama_llm.generate(prompts, SamplingParams(logprobs=3, **kw), use_tqdm=False)
        assert calls and not any(calls)
    finally:
        runner._sample_graph = real
    for f, g in zip(fast, full):
        f, g = f.outputs[0], g.outputs[0]
        assert f.token_ids == g.token_ids
        for t, fe, ge in zip(f.token_ids, f.logprobs, g.logprobs):
            assert fe[t].rank == ge[t].rank
            assert math.isclose(fe[t].logprob, ge[t].logprob, abs_tol=1e-6)
        assert len(f.logprobs[0]) == 1 and len(g.logprobs[0]) >= 3
    assert llama_llm.llm_engine.stats()["compilations_after_warmup"] == 0
