"""Text in, text out: what both the HTTP ingress and the batch CLI do around the engine.

A request body becomes `Prepared` (prompt ids + sampling params, every check done,
errors as `ProtocolError` with their HTTP status); generated ids become text through an
incremental detokenizer and the stop-string matcher (`TextStream.advance`: the one place a
stop string ends a request); the finished text becomes an OpenAI response body.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from jinja2 import TemplateError

from cluster import protocol as p
from cluster.config import TokenflowConfig
from cluster.protocol.logprobs import LogprobsFormatter
from cluster.protocol.tools import ToolPlan, openai_tool_calls, parse_tool_calls
from controller.logprobs import TokenLogprob
from controller.messages import Delta, FinishReason, SamplingParams
from controller.request import RequestOutput
from workers.structured.spec import GrammarStats
from workers.tokenizer import IncrementalDetokenizer, Tokenizer

if TYPE_CHECKING:
    from workers.structured.compiler import GrammarCache

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass
class Prepared:
    url: str
    request: p.CompletionRequest | p.ChatCompletionRequest
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0

    @property
    def is_chat(self) -> bool:
        return self.url == CHAT

    @property
    def tool_plan(self) -> ToolPlan | None:
        return self.request.tool_plan if isinstance(self.request, p.ChatCompletionRequest) \
            else None


class TextStream:
    """Generated ids -> text deltas, cut before a stop string.

    `is_lazy` (no stop strings, and no one reads the deltas: a non-streaming answer, a
    batch line): ids are only gathered and decoded once at the end, the same text as the
    incremental decode gives, for a fraction of the CPU (two decodes per token saved)."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...], is_lazy: bool = False,
                 is_prompt_only: bool = False):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.matcher = p.StopStringMatcher(list(stop))
        self.is_lazy = is_lazy and not stop
        self.is_prompt_only = is_prompt_only  # echo with max_tokens=0: outputs dropped
        self.text = ""
        self.token_ids: list[int] = []
        self.stopped = False
        self.logprobs: list[TokenLogprob] = []  # one per generated token, when asked
        self.prompt_logprobs: list[TokenLogprob] = []  # prompt positions 1.. (echo)

    def take_scores(self, delta: Delta | RequestOutput) -> list[int]:
        """Keep the delta's log-probabilities; -> the ids to decode (none when only the
        prompt was asked for). The prompt's come whole with the first token; a controller
        resumed after a crash sends them again, and they are taken once."""
        if not self.prompt_logprobs:
            self.prompt_logprobs.extend(delta.prompt_logprobs or ())
        if self.is_prompt_only:
            return []
        self.logprobs.extend(delta.logprobs or ())
        return delta.token_ids if isinstance(delta, Delta) else delta.new_token_ids

    def push(self, new_token_ids: list[int]) -> str:
        if self.stopped:
            return ""
        self.token_ids.extend(new_token_ids)
        if self.is_lazy:
            return ""
        delta, self.stopped = self.matcher.feed(self.detok.push(new_token_ids))
        self.text += delta
        return delta

    def num_to_decode(self, new_token_ids: list[int],
                      finish_reason: FinishReason | None) -> int:
        """Tokens `advance` would detokenize now: a lazy stream decodes everything at its
        end and nothing before (where a caller decides what runs off its event loop)."""
        if not self.is_lazy:
            return len(new_token_ids)
        return len(self.token_ids) + len(new_token_ids) if finish_reason is not None else 0

    def advance(self, new_token_ids: list[int], finish_reason: FinishReason | None,
                abort: Callable[[], object]) -> tuple[str, FinishReason | None]:
        """One delta of the request in: (new text, finish reason). A stop string that
        matches while the request still runs ends it here as STOP and aborts it where it
        runs (`abort`); once finished, the text held back for a stop string is flushed."""
        piece = self.push(new_token_ids)
        if self.stopped and finish_reason is None:
            abort()
            finish_reason = FinishReason.STOP
        if finish_reason is not None:
            piece += self.finish()
        return piece, finish_reason

    def finish(self) -> str:
        """Flush text held back for a possible stop string once generation has ended."""
        if self.stopped:
            return ""
        # A trailing partial UTF-8 character comes out as U+FFFD, as a full decode gives.
        rest = self.detok.push(self.token_ids) if self.is_lazy else ""
        self.is_lazy = False  # every id is in the detokenizer now
        delta, self.stopped = self.matcher.feed(rest + self.detok.flush())
        if not self.stopped:
            delta += self.matcher.flush()
        self.text += delta
        return delta


class Frontend:
    """`executor`: where the HTTP edge runs `prepare` and long detokenizations, off its
    event loop (None: the caller's thread, as the batch CLI does)."""

    def __init__(self, tokenizer: Tokenizer, config: TokenflowConfig, vocab_size: int,
                 executor: Executor | None = None):
        self.tokenizer = tokenizer
        self.config = config
        self.vocab_size = vocab_size
        self.executor = executor
        # A token's own text, for log-probability objects (the same few ids recur).
        self.token_text = functools.lru_cache(maxsize=65536)(
            lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False))
        self._grammars: GrammarCache | None = None
        self._grammars_lock = threading.Lock()
        self.num_tool_parse_failures = 0  # generated text that looked like calls, unparsed
        self.num_constrained_requests = 0

    def prepare(self, url: str, body: dict | bytes | str) -> Prepared:
        """Validate and tokenize one request; raises ProtocolError (400/404/422). CPU-bound
        (parsing, templating, tokenizing): an event loop calls it on `executor`."""
        if url not in (COMPLETIONS, CHAT):
            raise p.ProtocolError(404, f"unknown endpoint {url}", "NotFoundError")
        cls = p.request_class_for_url(url)
        request = (p.validate_request(body, cls) if isinstance(body, dict)
                   else p.parse_request(body, cls, self.config.edge.max_json_depth))
        p.check_model(request.model, self.served_names)
        if isinstance(request, p.ChatCompletionRequest):
            try:
                text = self.tokenizer.apply_chat_template(request.conversation(),
                                                          add_generation_prompt=True,
                                                          tools=request.template_tools)
            except (TemplateError, ValueError) as err:  # the template refuses these turns
                raise p.ProtocolError(400, f"'messages' cannot be rendered by this model's "
                                      f"chat template: {str(err)[:200]}",
                                      param="messages") from None
            prompt_ids = self._encode(text, request.prompt_param, add_special_tokens=False)
        elif request.prompt_token_ids is not None:
            prompt_ids = list(request.prompt_token_ids)
        else:
            prompt_ids = self._encode(request.prompt_text or "", request.prompt_param,
                                      add_special_tokens=False)
        cap = self.config.protections.prefill_cap_tokens
        if len(prompt_ids) > cap:
            # The budget circuit breaker: refused before any actor call.
            raise p.ProtocolError(422, f"the prompt has {len(prompt_ids)} tokens, over the "
                                  f"prefill cap of {cap} tokens", param=request.prompt_param,
                                  code="prompt_too_long")
        worker = self.config.worker
        room = p.check_limits(request, prompt_ids, worker.max_model_len, self.vocab_size)
        params = p.to_sampling_params(request, min(room, worker.default_max_tokens))
        check_choices(request, self.config.edge.max_choices)
        if request.num_choices > (request.n or 1) and params.logprobs is None:
            # best_of ranks by cumulative log-probability: the chosen tokens' are needed.
            params = dataclasses.replace(params, logprobs=0)
        if request.grammar is not None:
            self.check_grammar(request.grammar)
            with self._grammars_lock:
                self.num_constrained_requests += 1
        return Prepared(url, request, prompt_ids, params, request.priority or 0)

    @property
    def grammars(self) -> GrammarCache:
        """Built on the first constrained request (xgrammar, and torch with it, is imported
        only by servers that get one)."""
        with self._grammars_lock:
            if self._grammars is None:
                from workers.structured.compiler import cache_for

                eos = self.tokenizer.eos_token_id
                self._grammars = cache_for(self.tokenizer, self.vocab_size,
                                           [] if eos is None else [eos])
            return self._grammars

    def grammar_stats(self) -> GrammarStats:
        if self._grammars is None:
            return GrammarStats()
        return self._grammars.stats

    def check_grammar(self, grammar: p.GrammarRequest) -> None:
        """Compile it here, on the caller's thread (the edge's executor, off its event loop
        and off every step loop): a bad schema, regex or grammar is a 400 with the grammar
        engine's reason; a good one is in this process's cache for the next request."""
        from workers.structured.compiler import GrammarError

        try:
            self.grammars.compile(grammar.kind, grammar.text)
        except GrammarError as err:
            raise p.ProtocolError(400, f"'{grammar.param}' cannot be compiled: {err}",
                                  param=grammar.param, code="invalid_grammar") from None

    def _encode(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        # A text whose length alone proves it over the cap is refused untokenized: the
        # tokenizer's time grows with the text, the answer would be the same 422.
        cap = self.config.protections.prefill_cap_tokens
        min_len = len(text) // self.tokenizer.max_chars_per_token
        if min_len > cap:
            raise p.ProtocolError(422, f"the prompt has at least {min_len} tokens, over the "
                                  f"prefill cap of {cap} tokens", param=param,
                                  code="prompt_too_long")
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except (TypeError, ValueError):  # text the tokenizer cannot take (invalid Unicode)
            raise p.ProtocolError(400, f"'{param}' cannot be tokenized: it must be valid "
                                  f"Unicode text", param=param, code="invalid_text") from None

    @property
    def served_names(self) -> list[str]:
        return list(dict.fromkeys([self.config.worker.model_name, self.config.worker.model]))

    def text_stream(self, prepared: Prepared) -> TextStream:
        """Lazy (decoded once at the end) unless deltas are streamed or stop strings are
        watched for."""
        return TextStream(self.tokenizer, prepared.params.stop,
                          is_lazy=not getattr(prepared.request, "stream", False),
                          is_prompt_only=prepared.request.is_prompt_only)

    def echo_text(self, prepared: Prepared) -> str:
        """The prompt as text, for completions' `echo` ("" otherwise)."""
        request = prepared.request
        if prepared.is_chat or not getattr(request, "echo", False):
            return ""
        return request.prompt_text or self.tokenizer.decode(prepared.prompt_token_ids)

    def logprobs_body(self, prepared: Prepared, formatter: LogprobsFormatter,
                      logprobs: list[TokenLogprob], prompt_logprobs: list[TokenLogprob] | None,
                      echo_len: int = 0) -> dict | None:
        """The choice's `logprobs` for these entries (None when not asked); with
        `prompt_logprobs` (a completion's echo, first chunk) the prompt's come first and
        the generated tokens' offsets start after the `echo_len` characters of its text."""
        if prepared.request.num_logprobs is None:
            return None
        if prepared.is_chat:
            return formatter.chat(logprobs)
        if prompt_logprobs is None:
            return formatter.completion(list(logprobs))
        prompt_ids = prepared.prompt_token_ids
        body = formatter.completion([None, *prompt_logprobs], prompt_ids[:1])
        formatter.text_offset = echo_len
        rest = formatter.completion(list(logprobs))
        return {key: body[key] + rest[key] for key in body}

    def response(self, prepared: Prepared, request_id: str, stream: TextStream,
                 finish_reason: FinishReason | None) -> dict:
        """The non-streaming OpenAI body of a finished request."""
        reason = openai_finish_reason(stream, finish_reason)
        return_ids = bool(prepared.request.return_token_ids)
        echo = self.echo_text(prepared)
        args = dict(head=p.Head(request_id, self.config.worker.model_name, int(time.time())),
                    text=echo + stream.text, finish_reason=reason,
                    prompt_len=len(prepared.prompt_token_ids),
                    completion_len=len(stream.token_ids),
                    token_ids=stream.token_ids if return_ids else None,
                    prompt_token_ids=prepared.prompt_token_ids if return_ids else None)
        if prepared.is_chat:
            body = p.chat_completion_response(**args)
            plan = prepared.tool_plan
            if plan is not None and plan.is_active:
                self._put_tool_calls(body, plan, stream.text)
        else:
            body = p.completion_response(**args)
        body["choices"][0]["logprobs"] = self.logprobs_body(
            prepared, LogprobsFormatter(self.token_text), stream.logprobs,
            stream.prompt_logprobs if echo else None, len(echo))
        return body

    def _put_tool_calls(self, body: dict, plan: ToolPlan, text: str) -> None:
        """The message's text as OpenAI tool calls, when it holds some."""
        content, calls, failed = parse_tool_calls(text, plan)
        self.num_tool_parse_failures += failed
        if not calls:
            return
        choice = body["choices"][0]
        choice["message"]["content"] = content
        choice["message"]["tool_calls"] = openai_tool_calls(calls)
        if choice["finish_reason"] == FinishReason.STOP and not plan.is_named:
            choice["finish_reason"] = "tool_calls"


def check_choices(request: p.CompletionRequest | p.ChatCompletionRequest,
                  max_choices: int) -> None:
    if request.num_choices > max_choices:
        param = "best_of" if getattr(request, "best_of", None) == request.num_choices else "n"
        raise p.ProtocolError(400, f"'{param}' is too large: {request.num_choices}, this "
                              f"server generates at most {max_choices} choices per request "
                              f"(edge.max_choices)", param=param)


def openai_finish_reason(stream: TextStream, finish_reason: FinishReason | None
                         ) -> FinishReason | None:
    """OpenAI has no "abort": an aborted request (a stop string, its consumer) says STOP."""
    if stream.stopped or finish_reason == FinishReason.ABORT:
        return FinishReason.STOP
    return finish_reason
