"""POST /v1/completions: prompt(s) as text or token ids, n choices each, SSE streaming."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from vllm_tpu_lora.entrypoints.openai.protocol import (
    APIError,
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    random_id,
)
from vllm_tpu_lora.entrypoints.openai.serving_engine import (
    SSE_DONE,
    DeltaTracker,
    OpenAIServing,
    Prompt,
    now,
    sse,
    sse_error,
    usage,
)
from vllm_tpu_lora.outputs import CompletionOutput, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest
                                ) -> CompletionResponse | AsyncIterator[str]:
        arrival = now()
        model_name, lora = await self.check_request(request)
        prompts = self._prompts(request)
        params = [self.sampling_params(request, len(ids), request.max_tokens, request.logprobs,
                                       "prompt") for _, ids in prompts]
        request_id = random_id("cmpl")
        streams = await self.start(request_id, prompts, params, lora, request.cache_salt)
        ctx = _Ctx(request, request_id, model_name, prompts, self.tokenizer)
        if request.stream:
            return self._stream(ctx, streams, params, arrival)
        finals = await self.final_outputs(streams, model_name, arrival)
        choices = [ctx.choice(i, o, 0, len(o.token_ids), o.text, text_start=0, echo=True)
                   for i, out in enumerate(finals) for o in out.outputs]
        return CompletionResponse(id=request_id, created=ctx.created, model=model_name,
                                  choices=choices, usage=usage(finals))

    def _prompts(self, request: CompletionRequest) -> list[Prompt]:
        p = request.prompt
        items = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not items:
            raise APIError("prompt must not be empty", param="prompt")
        prompts = []
        for item in items:
            if isinstance(item, str):
                prompts.append((item, self.tokenize(item, request.add_special_tokens)))
            else:
                prompts.append((None, list(item)))
            if not prompts[-1][1]:
                raise APIError("The decoder prompt cannot be empty", param="prompt")
        return prompts

    async def _stream(self, ctx: _Ctx, streams, params, arrival) -> AsyncIterator[str]:
        req, n = ctx.request, ctx.request.n
        trackers = [DeltaTracker(params[i // n]) for i in range(len(streams) * n)]
        latest: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for i, out in self.results(streams, ctx.model_name, arrival):
                latest[i] = out
                for o in out.outputs:
                    tracker = trackers[i * n + o.index]
                    if tracker.done:
                        continue
                    text, first, end = tracker.advance(o)
                    if not text and not tracker.done and (first == end or req.logprobs is None):
                        continue  # nothing a client could see yet
                    chunk = CompletionResponse(
                        id=ctx.request_id, created=ctx.created, model=ctx.model_name,
                        choices=[ctx.choice(i, o, first, end, text,
                                            text_start=tracker.text_len - len(text),
                                            echo=not tracker.num_chunks)])
                    tracker.num_chunks += 1
                    if req.continuous_usage:
                        chunk.usage = usage([out])
                    yield sse(chunk)
            if req.include_usage:
                yield sse(CompletionResponse(id=ctx.request_id, created=ctx.created,
                                             model=ctx.model_name, choices=[],
                                             usage=usage(latest)))
        except Exception as e:  # noqa: BLE001 - reported in-band: the 200 is already sent
            yield sse_error(e)
        finally:
            for s in streams:  # however the response ends, nothing keeps running
                s.abort()
        yield SSE_DONE


class _Ctx:
    """One completion request's fixed facts, and how to render a choice from them."""

    def __init__(self, request: CompletionRequest, request_id: str, model_name: str,
                 prompts: list[Prompt], tokenizer) -> None:
        self.request, self.request_id, self.model_name = request, request_id, model_name
        self.prompts, self.tokenizer = prompts, tokenizer
        self.created = int(time.time())

    def prompt_text(self, i: int) -> str:
        text, ids = self.prompts[i]
        return text if text is not None else self.tokenizer.decode(ids)

    def choice(self, i: int, o: CompletionOutput, first: int, end: int, text: str,
               text_start: int, echo: bool) -> CompletionChoice:
        """Choice for tokens [first, end) of output o of prompt i, carrying `text` (which
        starts at character text_start of the output). `echo`: this is the choice's first
        chunk, so the prompt goes before it if the request asked for echo."""
        prefix = self.prompt_text(i) if self.request.echo and echo else ""
        logprobs = None
        if self.request.logprobs is not None:
            logprobs = _logprobs(o, first, end, len(prefix) + text_start)
        return CompletionChoice(index=i * self.request.n + o.index, text=prefix + text,
                                logprobs=logprobs, finish_reason=o.finish_reason,
                                stop_reason=o.stop_reason)


def _logprobs(o: CompletionOutput, first: int, end: int, offset: int) -> CompletionLogProbs:
    lp = CompletionLogProbs()
    for tid, entry in zip(o.token_ids[first:end], (o.logprobs or [])[first:end]):
        sampled = entry.get(tid)
        token = sampled.decoded_token if sampled else ""
        lp.text_offset.append(offset)
        offset += len(token)
        lp.tokens.append(token)
        lp.token_logprobs.append(sampled.logprob if sampled else None)
        lp.top_logprobs.append({e.decoded_token: e.logprob
                                for e in sorted(entry.values(), key=lambda e: e.rank or 0)})
    return lp
