"""OpenAI-compatible wire protocol: request models, validation, response builders, SSE, batch lines.

Pure on purpose (no Ray, torch or FastAPI app): the Serve ingress and the batch CLI both import
it, so a request is validated the same way whether it arrives over HTTP or in a batch file, and
the whole package is unit-testable in milliseconds.

Validation happens in two stages because some limits are only known after tokenization:
1. `parse_request` / `validate_request`: shape, types and ranges of every field (model-free);
2. `check_limits`: prompt length, `max_tokens` against the context window, token ids against
   the vocabulary (needs the tokenized prompt and the model's limits).
Every failure is a `ProtocolError` carrying the HTTP status and OpenAI's error fields, so callers
only need `error_body(err)` and `err.status_code` to answer.

Modules, one concern each (import from this package, not from them):
- `errors`: `ProtocolError`, `error_body`, pydantic errors turned into OpenAI messages;
- `fields`: strict field types and the checks both request models share;
- `messages`, `requests`: the chat turn and the two request models (stage 1);
- `validation`: parsing entry points, model-dependent checks (stage 2), `to_sampling_params`;
- `responses`, `streaming`: response bodies, stream chunks and SSE framing;
- `structured`: which output constraint a request asks for;
- `stop`: stop-string matching; `batch`: the Batch API's line format.
"""

from __future__ import annotations

from cluster.protocol.batch import (
    BATCH_URLS,
    BatchItem,
    BatchLineError,
    batch_error_line,
    batch_output_line,
    parse_batch_line,
)
from cluster.protocol.errors import ProtocolError, error_body
from cluster.protocol.fields import StrictBool as StrictBool
from cluster.protocol.fields import StrictFloat as StrictFloat
from cluster.protocol.fields import StrictInt as StrictInt
from cluster.protocol.fields import StrictStr as StrictStr
from cluster.protocol.messages import ChatMessage
from cluster.protocol.requests import MAX_STOP_SEQUENCES as MAX_STOP_SEQUENCES
from cluster.protocol.requests import TEMPERATURE_MAX as TEMPERATURE_MAX
from cluster.protocol.requests import ChatCompletionRequest, CompletionRequest, StreamOptions
from cluster.protocol.responses import (
    Head,
    chat_completion_response,
    completion_response,
    models_response,
    new_batch_request_id,
    new_chat_completion_id,
    new_completion_id,
)
from cluster.protocol.stop import StopStringMatcher, apply_stop_strings
from cluster.protocol.streaming import (
    SSE_DONE,
    chat_completion_chunk,
    completion_chunk,
    sse,
    usage_chunk,
)
from cluster.protocol.structured import GrammarRequest as GrammarRequest
from cluster.protocol.validation import RequestT as RequestT
from cluster.protocol.validation import (
    check_limits,
    check_max_tokens,
    check_model,
    check_token_ids,
    parse_request,
    request_class_for_url,
    to_sampling_params,
    validate_request,
)

# The same list as when this was one module; the `X as X` imports above keep the other public
# names of that module (constants, strict types, `RequestT`) importable from here as well.
__all__ = [
    "BATCH_URLS",
    "SSE_DONE",
    "BatchItem",
    "BatchLineError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "Head",
    "ProtocolError",
    "StopStringMatcher",
    "StreamOptions",
    "apply_stop_strings",
    "batch_error_line",
    "batch_output_line",
    "chat_completion_chunk",
    "chat_completion_response",
    "check_limits",
    "check_max_tokens",
    "check_model",
    "check_token_ids",
    "completion_chunk",
    "completion_response",
    "error_body",
    "models_response",
    "new_batch_request_id",
    "new_chat_completion_id",
    "new_completion_id",
    "parse_batch_line",
    "parse_request",
    "request_class_for_url",
    "sse",
    "to_sampling_params",
    "usage_chunk",
    "validate_request",
]
