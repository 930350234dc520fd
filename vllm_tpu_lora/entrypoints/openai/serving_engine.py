"""What completions and chat share: request checks, prompt-length rules, starting engine
requests, merging their streams, SSE framing and stop-string-safe text deltas.

Prompts are tokenized here, with the server's own tokenizer instance (HF tokenizers are not
safe to share with the engine thread), so the context-length rules can be checked before
anything reaches the engine; the engine still validates everything again on add.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator
from http import HTTPStatus

from vllm_tpu_lora.engine.async_engine import EngineDeadError, RequestStream
from vllm_tpu_lora.entrypoints.openai.metrics import ServerMetrics
from vllm_tpu_lora.entrypoints.openai.protocol import APIError, SamplingFields, UsageInfo
from vllm_tpu_lora.entrypoints.openai.serving_models import OpenAIServingModels, adapter_error
from vllm_tpu_lora.outputs import CompletionOutput, RequestOutput
from vllm_tpu_lora.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"
Prompt = tuple[str | None, list[int]]  # (text if known, token ids)


class OpenAIServing:
    def __init__(self, engine, models: OpenAIServingModels, tokenizer,
                 metrics: ServerMetrics, max_model_len: int) -> None:
        self.engine = engine
        self.models = models
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.max_model_len = max_model_len

    # ---- checks ----

    async def check_request(self, request: SamplingFields):
        """(served model name, adapter) after rejecting what this server cannot honour."""
        if request.model_extra:
            logger.warning("The following fields were present in the request but ignored: %s",
                           sorted(request.model_extra))
        bad = request.unsupported()
        if bad:
            raise APIError(f"'{bad[0]}' is not supported by this server.", param=bad[0])
        if request.cache_salt is not None and not request.cache_salt:
            raise APIError("Parameter 'cache_salt' must be a non-empty string if provided.",
                           param="cache_salt")
        return await self.models.resolve_or_fetch(request.model)

    def sampling_params(self, request: SamplingFields, prompt_len: int, max_tokens: int | None,
                        logprobs: int | None, prompt_param: str) -> SamplingParams:
        """vLLM's rules: the prompt must leave room for one token; max_tokens defaults to the
        rest of the context and may not exceed it."""
        m = self.max_model_len
        if prompt_len > m:
            raise APIError(f"The decoder prompt (length {prompt_len}) is longer than the maximum "
                           f"model length of {m}. Make sure that `max_model_len` is no smaller "
                           "than the number of text tokens.", param=prompt_param)
        if prompt_len == m:
            raise APIError(f"The decoder prompt (length {prompt_len}) plus the number of requested "
                           f"output tokens (at least 1) is longer than the maximum model length "
                           f"of {m}.", param=prompt_param)
        try:
            params = request.sampling_params(
                m - prompt_len if max_tokens is None else max_tokens, logprobs)
        except ValueError as e:
            raise APIError(str(e), param=param_of(str(e), request)) from None
        if params.max_tokens > m - prompt_len:
            raise APIError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {params.max_tokens}. "
                f"This model's maximum context length is {m} tokens and your request has "
                f"{prompt_len} input tokens ({params.max_tokens} > {m} - {prompt_len}).",
                param="max_tokens")
        return params

    # ---- running requests ----

    async def start(self, request_id: str, prompts: list[Prompt],
                    params: list[SamplingParams], lora,
                    cache_salt: str | None = None) -> list[RequestStream]:
        """Add one engine request per prompt, all or nothing."""
        results = await asyncio.gather(
            *(self.engine.add_request(f"{request_id}-{i}",
                                      {"prompt": text, "prompt_token_ids": ids,
                                       "cache_salt": cache_salt}, p, lora)
              for i, ((text, ids), p) in enumerate(zip(prompts, params))),
            return_exceptions=True)
        streams = [r for r in results if isinstance(r, RequestStream)]
        errors = [r for r in results if not isinstance(r, RequestStream)]
        if errors:
            for s in streams:
                s.abort()
            raise as_api_error(errors[0])
        return streams

    async def results(self, streams: list[RequestStream], model_name: str,
                      arrival: float) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, cumulative output) from all of a request's streams as they come.
        However it ends (done, client gone, error), every unfinished stream is aborted."""
        tracked = [self.metrics.track(s, model_name, arrival) for s in streams]
        merged = _merge(tracked)
        try:
            async for item in merged:
                yield item
        finally:
            for s in streams:
                s.abort()
            await merged.aclose()  # stops its pump tasks before their iterators are closed
            for t in tracked:
                await t.aclose()

    async def final_outputs(self, streams, model_name, arrival) -> list[RequestOutput]:
        final: list[RequestOutput | None] = [None] * len(streams)
        async for i, out in self.results(streams, model_name, arrival):
            final[i] = out
        return final

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def usage(outputs: list[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion)


class DeltaTracker:
    """What has been streamed of one choice. Text deltas come from the engine's incremental
    detokenizer (CompletionOutput.text only grows), except that a stop string found later
    truncates the text back to where it began; so while a request with stop strings runs, the
    last len(longest stop) - 1 characters are held back, as vLLM's detokenizer does."""

    def __init__(self, params: SamplingParams) -> None:
        stops = params.stop_strings
        self.holdback = max((len(s) for s in stops), default=1) - 1
        self.text_len = 0
        self.num_tokens = 0
        self.num_chunks = 0  # chunks sent (the caller counts)
        self.done = False

    def advance(self, out: CompletionOutput) -> tuple[str, int, int]:
        """(new text, first new token index, end token index) since the last call."""
        end = len(out.text) if out.finish_reason else max(self.text_len,
                                                           len(out.text) - self.holdback)
        delta = out.text[self.text_len:end]
        self.text_len = end
        first, self.num_tokens = self.num_tokens, len(out.token_ids)
        self.done = out.finish_reason is not None
        return delta, first, self.num_tokens


def sse(chunk) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


def sse_error(exc: BaseException) -> str:
    return f"data: {as_api_error(exc).response().model_dump_json()}\n\n"


def as_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError) and str(exc).startswith("Loading lora "):
        return adapter_error(exc)  # the request's adapter is gone or broken: 404 / 400
    if isinstance(exc, ValueError):
        return APIError(str(exc), param=param_of(str(exc)))
    if isinstance(exc, EngineDeadError):
        return APIError(str(exc), HTTPStatus.SERVICE_UNAVAILABLE, "ServiceUnavailableError")
    logger.error("request failed: %r", exc)
    return APIError(str(exc) or type(exc).__name__, HTTPStatus.INTERNAL_SERVER_ERROR,
                    "InternalServerError")


def param_of(message: str, request=None) -> str | None:
    """The parameter an engine error message is about ("top_p must be in (0, 1] ...")."""
    m = re.match(r"'?([a-z_]+)'?\s", message)
    if m is None:
        return None
    name = m.group(1)
    if request is None or name in type(request).model_fields:
        return name
    return None


def now() -> float:
    return time.monotonic()


async def _merge(iterators: list[AsyncIterator]) -> AsyncIterator[tuple[int, RequestOutput]]:
    if len(iterators) == 1:  # the common case needs no tasks
        async for out in iterators[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncIterator) -> None:
        try:
            async for out in it:
                queue.put_nowait((i, out, None))
            queue.put_nowait((i, done, None))
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer
            queue.put_nowait((i, None, e))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            i, out, error = await queue.get()
            if error is not None:
                raise error
            if out is done:
                remaining -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
