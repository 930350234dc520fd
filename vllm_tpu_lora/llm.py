"""The offline entry point: LLM(model=...).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from vllm_tpu_lora.config import EngineArgs
from vllm_tpu_lora.engine.llm_engine import LLMEngine, PromptType
from vllm_tpu_lora.outputs import RequestOutput
from vllm_tpu_lora.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, **kwargs: Any) -> None:
        self.engine_args = EngineArgs.from_kwargs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: Any = None) -> list[RequestOutput]:
        prompts = _as_list(prompts)
        params = _broadcast(sampling_params or SamplingParams(), len(prompts), "sampling_params")
        loras = _broadcast(lora_request, len(prompts), "lora_request")
        ids = self._add_all(prompts, params, loras)
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request: Any = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.get_tokenizer()
        prompts = [{"prompt_token_ids": _as_ids(tok.apply_chat_template(
            c, add_generation_prompt=add_generation_prompt, tokenize=True))} for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def _add_all(self, prompts, params, loras) -> list[str]:
        engine, ids = self.llm_engine, []
        try:
            for prompt, p, lora in zip(prompts, params, loras):
                rid = engine.new_request_id()
                engine.add_request(rid, prompt, p, lora_request=lora)
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)  # all or nothing: a bad prompt leaves no half batch
            raise
        return ids

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step until every request finished. A request that failed on its own (its adapter
        could not be read once queued) does not stop the others; the ValueError naming it is
        raised once they are done."""
        engine, done = self.llm_engine, {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while len(done) < len(ids):
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in done])
            raise
        finally:
            bar.close()
        errors = [done[i].error for i in ids if done[i].error is not None]
        if errors:
            raise errors[0]
        return [done[i] for i in ids]


def _as_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        raise ValueError("Pass token ids as {'prompt_token_ids': [...]} items, not a bare list of ints")
    return prompts


def _broadcast(value, n: int, what: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"The lengths of prompts and {what} must be the same, got {n} and {len(value)}")
        return list(value)
    return [value] * n


def _as_ids(encoded) -> list[int]:
    # transformers 5 returns a BatchEncoding-like mapping from apply_chat_template(tokenize=True)
    if hasattr(encoded, "keys") and "input_ids" in encoded:
        encoded = encoded["input_ids"]
    return list(encoded)
