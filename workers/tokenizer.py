"""Tokenizer wrapper around the `tokenizers` library (no `transformers` at runtime).

Reads `tokenizer.json` and, when present, `tokenizer_config.json` for the chat template and the
bos/eos token strings. Chat templates are rendered with a sandboxed jinja2 environment using the
same whitespace options Hugging Face uses (`trim_blocks`, `lstrip_blocks`).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

# Used when the model ships no template: one `<|role|>` header line per message.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
REPLACEMENT_CHAR = "\ufffd"


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


def _token_str(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found (only fast tokenizer.json is supported)")
        self._tok = HFTokenizer.from_file(str(path))
        config: dict[str, Any] = {}
        config_path = folder / "tokenizer_config.json"
        if config_path.is_file():
            config = json.loads(config_path.read_text(encoding="utf-8"))
        self.bos_token = _token_str(config.get("bos_token"))
        self.eos_token = _token_str(config.get("eos_token"))
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        self.chat_template: str = template or DEFAULT_CHAT_TEMPLATE
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        self._template = env.from_string(self.chat_template)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """An upper bound on the characters of text one token stands for, so that
        `len(text) // max_chars_per_token` is a lower bound on its token count (a prompt can
        be refused as too long without tokenizing it). +1: a SentencePiece token decodes
        alone without the leading space it has in context; x4 with a normalizer, which may
        compose several characters into one (NFC, NFKC)."""
        ids = self._tok.get_vocab(with_added_tokens=True).values()
        longest = max((len(self._tok.decode([i], skip_special_tokens=False)) for i in ids),
                      default=1)
        return (longest + 1) * (1 if self._tok.normalizer is None else 4)

    def backend_json(self) -> str:
        """The `tokenizers` definition (tokenizer.json's text), for grammar engines."""
        return self._tok.to_str()

    def vocab(self) -> dict[str, int]:
        """Token string -> id, added tokens included."""
        return self._tok.get_vocab(with_added_tokens=True)

    def special_token_ids(self) -> set[int]:
        """Ids of added tokens marked special (left out of decoded text)."""
        return {i for i, tok in self._tok.get_added_tokens_decoder().items() if tok.special}

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token) if self.bos_token else None

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token) if self.eos_token else None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Chat-templated text already carries its specials, hence the default False."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """`tools` (OpenAI tool objects) go to the template's own `tools` argument."""
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas whose concatenation equals `decode(all)`.

    Invariant: text is emitted only when it does not end in U+FFFD, i.e. never half a UTF-8
    character. Only a short window (`_prefix_offset:`) is re-decoded per push, and the window
    starts one emission back so tokenizers that render a token differently at the start of a
    string (SentencePiece's leading space) still produce the right delta.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = 0  # tokens before this are already emitted

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def push(self, new_ids: list[int]) -> str:
        self._ids.extend(new_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = full_text[len(prefix_text) :]
        # The next window starts at the tokens just emitted: enough context for decoders that
        # render a token differently at the start of a string.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta

    def flush(self) -> str:
        """End of stream: emit whatever is held back (even a trailing U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]
