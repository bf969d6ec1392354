"""`TextStream.advance`: the one place a stop string ends a request, for the HTTP edge (both
answer shapes) and the batch runners. The builtin tiny tokenizer maps byte b to id 3 + b."""

from __future__ import annotations

import pytest

from cluster.frontend import TextStream, openai_finish_reason
from controller.messages import FinishReason
from workers.presets import resolve_model
from workers.tokenizer import Tokenizer


def ids(text: str) -> list[int]:
    return [3 + b for b in text.encode()]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(resolve_model("builtin:tiny"))


def feed(stream: TextStream, deltas: list[tuple[str, FinishReason | None]]
         ) -> tuple[list[str], FinishReason | None, int]:
    """Feed deltas until one finishes: (text pieces, finish reason, abort calls)."""
    aborts: list[None] = []
    pieces: list[str] = []
    reason = None
    for text, finish_reason in deltas:
        piece, reason = stream.advance(ids(text), finish_reason, lambda: aborts.append(None))
        pieces.append(piece)
        if reason is not None:
            break
    return pieces, reason, len(aborts)


def test_stop_string_spanning_two_deltas_aborts_once(tokenizer: Tokenizer) -> None:
    stream = TextStream(tokenizer, ("lo w",))
    pieces, reason, num_aborts = feed(stream, [("hel", None), ("lo wor", None),
                                               ("ld", None), ("!", FinishReason.LENGTH)])
    assert reason == FinishReason.STOP and num_aborts == 1
    assert len(pieces) == 2  # the second delta ended it: later ones are never read
    assert "".join(pieces) == stream.text == "hel"
    assert stream.token_ids == ids("hello wor")


def test_stop_string_at_the_very_first_token(tokenizer: Tokenizer) -> None:
    stream = TextStream(tokenizer, ("h",))
    pieces, reason, num_aborts = feed(stream, [("hi", None), ("there", None)])
    assert (pieces, reason, num_aborts) == ([""], FinishReason.STOP, 1)
    assert stream.text == ""


def test_no_stop_string_passes_the_controllers_reason_and_flushes(tokenizer: Tokenizer
                                                                 ) -> None:
    stream = TextStream(tokenizer, ("xyz",))
    # "xy" could start the stop string: held back until the request ends, then flushed.
    pieces, reason, num_aborts = feed(stream, [("abc x", None), ("y", FinishReason.LENGTH)])
    assert reason == FinishReason.LENGTH and num_aborts == 0
    assert pieces[0] == "abc " and "".join(pieces) == stream.text == "abc xy"


def test_finished_in_the_same_delta_as_the_stop_string_is_not_aborted(tokenizer: Tokenizer
                                                                     ) -> None:
    stream = TextStream(tokenizer, ("end",))
    pieces, reason, num_aborts = feed(stream, [("the end", FinishReason.LENGTH)])
    assert (pieces, reason, num_aborts) == (["the "], FinishReason.LENGTH, 0)
    assert openai_finish_reason(stream, reason) == FinishReason.STOP


@pytest.mark.parametrize("stop", [(), ("zz",)])
def test_a_lazy_stream_gives_the_eager_text_and_decodes_only_at_the_end(tokenizer, stop):
    """Non-streaming answers gather ids and decode once; with a stop string to watch for,
    the stream stays incremental. Split UTF-8 characters and a trailing half character
    come out as the eager stream gives them."""
    chunks = ["hé", "\u00e9"[:1], "llo ", "wörld"]
    raw = [ids(c) for c in chunks] + [[0xE2 + 3, 0x82 + 3]]  # half of a 3-byte character
    eager, lazy = TextStream(tokenizer, stop), TextStream(tokenizer, stop, is_lazy=True)
    assert lazy.is_lazy == (not stop)
    pieces = []
    for i, chunk in enumerate(raw):
        reason = FinishReason.LENGTH if i == len(raw) - 1 else None
        eager.advance(chunk, reason, lambda: None)
        piece, _ = lazy.advance(chunk, reason, lambda: None)
        pieces.append(piece)
    assert lazy.text == eager.text and lazy.text.endswith("\ufffd") and "wörld" in lazy.text
    if not stop:
        assert pieces[:-1] == ["", "", "", ""] and pieces[-1] == lazy.text
    assert lazy.finish() == "" and lazy.text == eager.text  # a second finish adds nothing


def test_a_lazy_stream_decodes_its_whole_answer_off_the_event_loop(tokenizer):
    """A non-streamed answer is decoded at its end, all at once: the edge sends that
    decode to its text pool by the answer's length, not by the last delta's."""
    import asyncio
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from cluster.chunks import advance
    from cluster.config import TokenflowConfig
    from cluster.frontend import Frontend
    from controller.messages import Delta

    config = TokenflowConfig()
    threshold = config.edge.detokenize_in_thread_tokens
    stream = TextStream(tokenizer, (), is_lazy=True)
    assert stream.num_to_decode(ids("a"), None) == 0
    threads: list[str] = []
    original = stream.advance

    def spy(*args):
        threads.append(threading.current_thread().name)
        return original(*args)

    stream.advance = spy  # type: ignore[method-assign]
    text = "x" * (threshold + 5)

    async def main() -> str:
        with ThreadPoolExecutor(1, thread_name_prefix="tokenflow-text") as pool:
            frontend = Frontend(tokenizer, config, 512, pool)
            for ch in text[:-1]:  # one token per delta, none decoded yet
                await advance(frontend, stream, Delta("r", 0, ids(ch)), lambda: None)
            piece, reason = await advance(frontend, stream, Delta(
                "r", 0, ids(text[-1]), finish_reason=FinishReason.LENGTH), lambda: None)
            assert reason == FinishReason.LENGTH
            return piece

    assert asyncio.run(main()) == text == stream.text
    assert stream.num_to_decode([], FinishReason.LENGTH) == 0  # decoded: nothing left
    assert threads[-1].startswith("tokenflow-text")
    assert all(name == threading.main_thread().name for name in threads[:-1])
