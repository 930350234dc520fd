"""POST /v1/chat/completions: messages through the tokenizer's chat template (as LLM.chat
does, so the server and the offline API see the same token ids), SSE streaming deltas."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from vllm_tpu_lora.entrypoints.openai.protocol import (
    APIError,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProb,
    ChatLogProbs,
    ChatLogProbsContent,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    random_id,
)
from vllm_tpu_lora.entrypoints.openai.serving_engine import (
    SSE_DONE,
    DeltaTracker,
    OpenAIServing,
    now,
    sse,
    sse_error,
    usage,
)
from vllm_tpu_lora.outputs import CompletionOutput

_NO_TEMPLATE = ("As of transformers v4.44, default chat template is no longer allowed, so you "
                "must provide a chat template if the tokenizer does not define one.")
ROLE = "assistant"


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args, chat_template: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.chat_template = chat_template

    async def create_chat_completion(self, request: ChatCompletionRequest
                                     ) -> ChatCompletionResponse | AsyncIterator[str]:
        arrival = now()
        model_name, lora = await self.check_request(request)
        if request.top_logprobs and not request.logprobs:
            raise APIError("when using `top_logprobs`, `logprobs` must be set to true.",
                           param="top_logprobs")
        ids = self._render(request)
        max_tokens = request.max_completion_tokens
        if max_tokens is None:
            max_tokens = request.max_tokens
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(request, len(ids), max_tokens, logprobs, "messages")
        request_id = random_id("chatcmpl")
        streams = await self.start(request_id, [(None, ids)], [params], lora, request.cache_salt)
        created = int(time.time())
        if request.stream:
            return self._stream(request, request_id, created, model_name, streams, params,
                                arrival)
        [final] = await self.final_outputs(streams, model_name, arrival)
        top = request.top_logprobs or 0
        choices = [ChatChoice(index=o.index, message=ChatResponseMessage(role=ROLE, content=o.text),
                              logprobs=_logprobs(o, 0, len(o.token_ids), top)
                              if request.logprobs else None,
                              finish_reason=o.finish_reason, stop_reason=o.stop_reason)
                   for o in final.outputs]
        return ChatCompletionResponse(id=request_id, created=created, model=model_name,
                                      choices=choices, usage=usage([final]))

    def _render(self, request: ChatCompletionRequest) -> list[int]:
        if not (self.chat_template or getattr(self.tokenizer, "chat_template", None)):
            raise APIError(_NO_TEMPLATE, param="messages")
        conversation = [{"role": m.role, "content": _text_of(m.content)}
                        for m in request.messages]
        kwargs = dict(request.chat_template_kwargs or {})
        if request.continue_final_message:
            kwargs["continue_final_message"] = True
        try:
            encoded = self.tokenizer.apply_chat_template(
                conversation, chat_template=self.chat_template, tokenize=True,
                add_generation_prompt=request.add_generation_prompt, **kwargs)
        except Exception as e:  # noqa: BLE001 - a template error is the request's fault
            raise APIError(f"Failed to apply the chat template: {e}", param="messages") from None
        # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True)
        if hasattr(encoded, "keys") and "input_ids" in encoded:
            encoded = encoded["input_ids"]
        return list(encoded)

    async def _stream(self, request, request_id, created, model_name, streams, params,
                      arrival) -> AsyncIterator[str]:
        def chunk(choices, usage_info=None) -> str:
            return sse(ChatCompletionChunk(id=request_id, created=created, model=model_name,
                                           choices=choices, usage=usage_info))

        trackers = [DeltaTracker(params) for _ in range(request.n)]
        top = request.top_logprobs or 0
        last = None
        try:
            # OpenAI's first chunk of each choice carries the role and no content.
            for j in range(request.n):
                yield chunk([ChatStreamChoice(index=j, delta=DeltaMessage(role=ROLE, content=""))])
            async for _, out in self.results(streams, model_name, arrival):
                last = out
                for o in out.outputs:
                    tracker = trackers[o.index]
                    if tracker.done:
                        continue
                    text, first, end = tracker.advance(o)
                    if not text and not tracker.done and (first == end or not request.logprobs):
                        continue
                    choice = ChatStreamChoice(
                        index=o.index, delta=DeltaMessage(content=text),
                        logprobs=_logprobs(o, first, end, top) if request.logprobs else None,
                        finish_reason=o.finish_reason, stop_reason=o.stop_reason)
                    yield chunk([choice], usage([out]) if request.continuous_usage else None)
            if request.include_usage and last is not None:
                yield chunk([], usage([last]))
        except Exception as e:  # noqa: BLE001 - reported in-band: the 200 is already sent
            yield sse_error(e)
        finally:
            for s in streams:  # however the response ends, nothing keeps running
                s.abort()
        yield SSE_DONE


def _text_of(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise APIError(f"Only text content parts are supported, got {part.get('type')!r}.",
                           param="messages")
        parts.append(part.get("text", ""))
    return "\n".join(parts)


def _logprobs(o: CompletionOutput, first: int, end: int, top: int) -> ChatLogProbs:
    content = []
    for tid, entry in zip(o.token_ids[first:end], (o.logprobs or [])[first:end]):
        sampled = entry.get(tid)
        token = sampled.decoded_token if sampled else ""
        ranked = sorted((e for e in entry.values() if e.rank is not None and e.rank <= top),
                        key=lambda e: e.rank)
        content.append(ChatLogProbsContent(
            token=token, logprob=sampled.logprob if sampled else float("-inf"),
            bytes=list(token.encode("utf-8")),
            top_logprobs=[ChatLogProb(token=e.decoded_token or "", logprob=e.logprob,
                                      bytes=list((e.decoded_token or "").encode("utf-8")))
                          for e in ranked]))
    return ChatLogProbs(content=content)
