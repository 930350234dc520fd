"""Incremental detokenization: text grows by deltas that are always valid UTF-8.

Decoding a token on its own loses context (leading spaces in sentencepiece, bytes of a
multi-byte character split across byte-level tokens), so each step decodes a short
window ending at the new token and emits only what the window adds past the text it
already produced; a delta that ends in U+FFFD (an incomplete character) is held back.
"""

from __future__ import annotations

# Prompt tokens kept as left context so the first output token decodes with its spacing.
_PROMPT_CONTEXT = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.output_text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add_token(self, token_id: int) -> str:
        """Append one generated token; return the new text it completes (maybe '')."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.output_text += delta
        return delta

    def truncate(self, length: int) -> None:
        self.output_text = self.output_text[:length]
