"""Request models for /v1/completions and /v1/chat/completions (stage 1: model-free checks).

Shape, types and ranges of every field are checked here; limits that need the model (prompt
length, vocabulary) are checked after tokenization by `cluster.protocol.validation`.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from cluster.protocol.errors import ProtocolError, _invalid
from cluster.protocol.fields import (
    NoToolChoice,
    NullAsZero,
    OutputTokenLimit,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    TokenIdList,
    Unsupported,
    check_non_negative_ids,
)
from cluster.protocol.logprobs import MAX_COMPLETION_LOGPROBS, MAX_TOP_LOGPROBS
from cluster.protocol.messages import ChatMessage
from cluster.protocol.structured import GrammarRequest, grammar_request
from cluster.protocol.tools import ToolPlan, tool_grammar, tool_plan

# OpenAI caps `stop` at 4 sequences; matching cost grows with their number on every delta.
MAX_STOP_SEQUENCES = 4
TEMPERATURE_MAX = 2.0


def _schema(**keywords: Any) -> Any:
    """JSON Schema keywords for /openapi.json only: the validators above stay the ones that
    check (and word the errors); keywords on a nullable field apply to its non-null form."""
    return Field(json_schema_extra=keywords)


# Seeds travel to torch generators, which take 64-bit values.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool | None = False


class _RequestBase(BaseModel):
    """Fields and checks shared by /v1/completions and /v1/chat/completions.

    Unknown fields are ignored, not errors, so that clients sending newer OpenAI parameters
    (or other servers' extensions) keep working."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    max_tokens: Annotated[OutputTokenLimit, _schema(minimum=1)] = None
    temperature: Annotated[StrictFloat | None, _schema(minimum=0, maximum=TEMPERATURE_MAX)] = None
    top_p: Annotated[StrictFloat | None, _schema(exclusiveMinimum=0, maximum=1)] = None
    top_k: Annotated[StrictInt | None, _schema(minimum=-1)] = None
    seed: Annotated[StrictInt | None, _schema(minimum=_SEED_MIN, maximum=_SEED_MAX)] = None
    stop: Annotated[list[str], _schema(maxItems=MAX_STOP_SEQUENCES,
                                       items={"type": "string", "minLength": 1})] = Field(
        default_factory=list)
    stop_token_ids: TokenIdList = Field(default_factory=list)
    ignore_eos: StrictBool | None = False
    n: Annotated[StrictInt | None, _schema(minimum=1)] = 1
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: StrictBool | None = False
    priority: Annotated[StrictInt, NullAsZero] = 0
    user: StrictStr | None = None
    # Output constraints (cluster/protocol/structured.py): checked by `grammar`.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # OpenAI options whose silent omission would change the answer: 400, naming them.
    logit_bias: Annotated[dict[str, Any] | None, Unsupported] = None
    _grammar: GrammarRequest | None = PrivateAttr(default=None)

    @field_validator("temperature")
    @classmethod
    def _check_temperature(cls, value: float | None) -> float | None:
        if value is not None and not (math.isfinite(value) and 0.0 <= value <= TEMPERATURE_MAX):
            raise _invalid(f"must be a number between 0 and {TEMPERATURE_MAX:g}, got {value}")
        return value

    @field_validator("top_p")
    @classmethod
    def _check_top_p(cls, value: float | None) -> float | None:
        if value is not None and not (math.isfinite(value) and 0.0 < value <= 1.0):
            raise _invalid(f"must be in (0, 1], got {value}")
        return value

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, value: int | None) -> int | None:
        if value is not None and value < -1:
            raise _invalid(f"must be -1 (disabled) or >= 0, got {value}")
        return value

    @field_validator("seed")
    @classmethod
    def _check_seed(cls, value: int | None) -> int | None:
        if value is not None and not _SEED_MIN <= value <= _SEED_MAX:
            raise _invalid("must fit in 64 bits")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _normalize_stop(cls, value: Any) -> list[str]:
        if value is None:
            return []
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise _invalid("must be a string or a list of strings")
        if len(value) > MAX_STOP_SEQUENCES:
            raise _invalid(f"accepts at most {MAX_STOP_SEQUENCES} sequences, got {len(value)}")
        # An empty stop string would match before the first character and end every request.
        if any(s == "" for s in value):
            raise _invalid("must not contain empty strings")
        return value

    @field_validator("n")
    @classmethod
    def _check_n(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise _invalid(f"must be at least 1, got {value}")
        return value  # the configured maximum is checked with the model (Frontend.prepare)

    @model_validator(mode="after")
    def _check_stream_options(self) -> _RequestBase:
        if self.stream_options is not None and not self.stream:
            raise _invalid("is only allowed when 'stream' is true", field="stream_options")
        return self

    @model_validator(mode="after")
    def _check_grammar(self) -> _RequestBase:
        self._grammar = grammar_request(
            self.response_format, self.structured_outputs,
            {"guided_json": self.guided_json, "guided_regex": self.guided_regex,
             "guided_choice": self.guided_choice, "guided_grammar": self.guided_grammar})
        return self

    @property
    def grammar(self) -> GrammarRequest | None:
        """The output constraint asked for (its text not compiled yet), or None."""
        return self._grammar

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def is_prompt_only(self) -> bool:
        return False

    @property
    def num_choices(self) -> int:
        """Sequences generated: `n` (completions: `best_of` when larger)."""
        return self.n or 1

    @property
    def num_logprobs(self) -> int | None:
        return None

    @property
    def num_prompt_logprobs(self) -> int | None:
        return None

    @property
    def max_tokens_param(self) -> str:
        """The field the client used for the output limit, for error messages."""
        return "max_tokens"

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def prompt_param(self) -> str:
        return "prompt"


class CompletionRequest(_RequestBase):
    """/v1/completions. After validation `prompt` is either a non-empty string or a non-empty
    list of token ids: one-element batches (`["text"]`, `[[1, 2]]`) are unwrapped."""

    prompt: Annotated[str | list[StrictInt], _schema(minLength=1, minItems=1)]
    # 0 only with `echo` (score the prompt, generate nothing: log-likelihood evaluation).
    max_tokens: Annotated[StrictInt | None, _schema(minimum=0)] = None
    echo: StrictBool | None = False
    logprobs: Annotated[StrictInt | None, _schema(minimum=0,
                                                  maximum=MAX_COMPLETION_LOGPROBS)] = None
    suffix: Annotated[StrictStr | None, Unsupported] = None
    best_of: Annotated[StrictInt | None, _schema(minimum=1)] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _normalize_prompt(cls, value: Any) -> str | list[int]:
        if isinstance(value, str):
            if not value:
                raise _invalid("must not be empty")
            return value
        if not isinstance(value, list):
            raise _invalid("must be a string or a list of token ids")
        if not value:
            raise _invalid("must not be empty")
        if all(isinstance(v, (str, list)) for v in value):
            # OpenAI's batched form: several prompts in one request. Each would need its own
            # choice index and stream, which this server does not do.
            if len(value) > 1:
                raise _invalid("must be a single prompt: only one prompt per request is supported")
            return cls._normalize_prompt(value[0])
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise _invalid("must be a string or a list of token ids (integers)")
        return check_non_negative_ids(value)

    @field_validator("logprobs")
    @classmethod
    def _check_logprobs(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= MAX_COMPLETION_LOGPROBS:
            raise _invalid(f"must be between 0 and {MAX_COMPLETION_LOGPROBS}, got {value}")
        return value

    @model_validator(mode="after")
    def _check_best_of(self) -> CompletionRequest:
        if self.best_of is None:
            return self
        if self.best_of < (self.n or 1):
            raise _invalid(f"must be at least 'n' ({self.n}), got {self.best_of}",
                           field="best_of")
        if self.stream and self.best_of > 1:
            raise _invalid("cannot be streamed: the best choices are known only at the end",
                           field="best_of")
        return self

    @property
    def num_choices(self) -> int:
        return max(self.best_of or 1, self.n or 1)

    @model_validator(mode="after")
    def _check_max_tokens(self) -> CompletionRequest:
        if self.max_tokens is not None and self.max_tokens < (0 if self.echo else 1):
            raise _invalid(f"must be at least {0 if self.echo else 1} (0 only with 'echo'), "
                           f"got {self.max_tokens}", field="max_tokens")
        return self

    @property
    def is_prompt_only(self) -> bool:
        """`echo` with `max_tokens=0`: the engine runs the prompt and samples one token that
        the edge drops (its prefill is what scores the prompt)."""
        return bool(self.echo) and self.max_tokens == 0

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    @property
    def prompt_token_ids(self) -> list[int] | None:
        """The prompt when the client sent token ids, else None (text needs tokenizing)."""
        return self.prompt if isinstance(self.prompt, list) else None

    @property
    def prompt_text(self) -> str | None:
        return self.prompt if isinstance(self.prompt, str) else None


class ChatCompletionRequest(_RequestBase):
    """/v1/chat/completions. `max_completion_tokens` (OpenAI's newer name) wins over
    `max_tokens` when both are given."""

    messages: Annotated[list[ChatMessage], _schema(minItems=1)]
    max_completion_tokens: Annotated[OutputTokenLimit, _schema(minimum=1)] = None
    logprobs: StrictBool | None = False
    top_logprobs: Annotated[StrictInt | None, _schema(minimum=0, maximum=MAX_TOP_LOGPROBS)] = None
    # Checked by `_check_tools` (cluster/protocol/tools.py).
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Annotated[list[Any] | None, Unsupported] = None
    _tool_plan: ToolPlan | None = PrivateAttr(default=None)
    function_call: Annotated[Any, NoToolChoice] = None

    @field_validator("messages", mode="before")
    @classmethod
    def _check_messages_not_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise _invalid("must contain at least one message")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
            raise _invalid(f"must be between 0 and {MAX_TOP_LOGPROBS}, got {value}")
        return value

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise _invalid("requires 'logprobs' to be true", field="top_logprobs")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        self._tool_plan = tool_plan(self.tools, self.tool_choice, self.parallel_tool_calls)
        grammar = None if self._tool_plan is None else tool_grammar(self._tool_plan)
        if grammar is not None:
            if self._grammar is not None:
                raise ProtocolError(400, f"only one output constraint per request: "
                                    f"'tool_choice' {self._tool_plan.choice!r} constrains "
                                    f"the output, and so does '{self._grammar.param}'",
                                    param="tool_choice")
            self._grammar = grammar
        return self

    @property
    def tool_plan(self) -> ToolPlan | None:
        """The tools and what to do with them; None without tools."""
        return self._tool_plan

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template renders (none with tool_choice 'none')."""
        plan = self._tool_plan
        return None if plan is None or not plan.is_active else list(plan.tools)

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def prompt_param(self) -> str:
        return "messages"

    def conversation(self) -> list[dict[str, Any]]:
        """Messages as `[{"role", "content", ...}]`, the shape chat templates take (tool
        calls and tool results included)."""
        return [m.template_dict() for m in self.messages]
