"""OpenAI-shaped `logprobs` objects from the engine's `TokenLogprob`s.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`; completions:
`{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, where an echoed prompt's
first token has no log-probability (null, as OpenAI and vLLM give). A token's text is its
own decode (a byte-level token that is part of a UTF-8 character shows as U+FFFD); `bytes`
are that text's UTF-8 bytes. One `LogprobsFormatter` per choice: it keeps the running
`text_offset` of a streamed completion.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from controller.logprobs import TokenLogprob

# OpenAI's limits: completions' `logprobs` (top tokens), chat's `top_logprobs`.
MAX_COMPLETION_LOGPROBS = 5
MAX_TOP_LOGPROBS = 20


class LogprobsFormatter:
    def __init__(self, token_text: Callable[[int], str], text_offset: int = 0) -> None:
        self.token_text = token_text
        self.text_offset = text_offset  # completions: where the next token's text starts

    def _candidate(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def chat(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        content = []
        for entry in entries:
            item = self._candidate(entry.token_id, entry.logprob)
            item["top_logprobs"] = [self._candidate(t, lp) for t, lp in
                                    zip(entry.top_ids, entry.top_logprobs, strict=True)]
            content.append(item)
        return {"content": content}

    def completion(self, entries: list[TokenLogprob | None],
                   token_ids: list[int] | None = None) -> dict[str, Any]:
        """`entries[i] is None` (an echoed prompt's first token) needs `token_ids[i]`."""
        body: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        for i, entry in enumerate(entries):
            token_id = entry.token_id if entry is not None else (token_ids or [])[i]
            text = self.token_text(token_id)
            body["tokens"].append(text)
            body["text_offset"].append(self.text_offset)
            self.text_offset += len(text)
            if entry is None:
                body["token_logprobs"].append(None)
                body["top_logprobs"].append(None)
                continue
            body["token_logprobs"].append(entry.logprob)
            body["top_logprobs"].append({self.token_text(t): lp for t, lp in
                                         zip(entry.top_ids, entry.top_logprobs, strict=True)})
        return body
