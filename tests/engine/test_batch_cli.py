"""`python -m cluster.batch --local` end to end on builtin:tiny, in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def write_input(path: Path) -> None:
    lines = [
        {"custom_id": "text", "method": "POST", "url": "/v1/completions",
         "body": {"model": "builtin:tiny", "prompt": "Hello, world", "max_tokens": 8,
                  "temperature": 0, "ignore_eos": True, "return_token_ids": True}},
        {"custom_id": "ids", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": [5, 6, 7, 8, 9], "max_tokens": 6, "temperature": 0.8,
                  "top_p": 0.9, "top_k": 20, "seed": 3, "ignore_eos": True}},
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                  "temperature": 0, "return_token_ids": True, "ignore_eos": True}},
    ]
    text = "\n".join(json.dumps(x) for x in lines)
    text += '\n{"custom_id": "broken", "method": "POST", "url": \n'  # malformed JSON
    text += json.dumps({"custom_id": "bad-temp", "method": "POST", "url": "/v1/completions",
                        "body": {"prompt": "x", "temperature": -1}}) + "\n"
    path.write_text(text)


def run_batch(inp: Path, out: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "cluster.batch", "-i", str(inp), "-o", str(out), "--local",
           "--model", "builtin:tiny", "--num-kv-blocks", "64", "--block-size", "8",
           "--max-num-batched-tokens", "32", "--no-progress"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_batch_local_end_to_end(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(inp)
    proc = run_batch(inp, out)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by_id = {row["custom_id"]: row for row in rows}
    assert set(by_id) == {"text", "ids", "chat", None, "bad-temp"}
    text = by_id["text"]["response"]
    assert text["status_code"] == 200
    choice = text["body"]["choices"][0]
    assert len(choice["token_ids"]) == 8 and choice["finish_reason"] == "length"
    assert text["body"]["usage"]["completion_tokens"] == 8
    assert by_id["ids"]["response"]["body"]["usage"]["prompt_tokens"] == 5
    chat = by_id["chat"]["response"]["body"]
    assert chat["object"] == "chat.completion" and len(chat["choices"][0]["token_ids"]) == 5
    assert by_id[None]["response"]["status_code"] == 400
    bad = by_id["bad-temp"]["response"]
    assert bad["status_code"] == 400 and "temperature" in bad["body"]["error"]["message"]

    # Resumable: a second run over the same output answers nothing twice.
    proc = run_batch(inp, out)
    assert proc.returncode == 0, proc.stderr
    rows_after = out.read_text().splitlines()
    ids_after = [json.loads(r)["custom_id"] for r in rows_after]
    assert ids_after.count("text") == 1 and ids_after.count("chat") == 1
    # The line too broken to name a custom_id is reported once, not again on each resume.
    assert ids_after.count(None) == 1
    summary = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert summary["skipped"] == 5 and summary["failed"] == 0


def test_resume_retries_retryable_failures_and_keeps_the_rest(tmp_path):
    """A 503 line (a worker failed) runs again, a 400 line and a completed line are kept,
    a torn last line runs again; every custom_id ends with exactly one answer."""
    from cluster import protocol as p

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(inp)
    first = run_batch(inp, out)
    assert first.returncode == 0, first.stderr
    rows = {json.loads(line)["custom_id"]: line for line in out.read_text().splitlines()}
    unavailable = p.batch_error_line("ids", p.ProtocolError(503, "worker 0 failed"))
    out.write_text(rows["text"] + "\n" + rows["bad-temp"] + "\n" + json.dumps(unavailable)
                   + "\n" + '{"custom_id": "chat", "resp')  # chat's line was torn
    again = run_batch(inp, out)
    assert again.returncode == 0, again.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    custom_ids = [row["custom_id"] for row in lines]
    assert sorted(c for c in custom_ids if c) == ["bad-temp", "chat", "ids", "text"]
    assert len(custom_ids) == len(set(custom_ids))  # one answer each
    by_id = {row["custom_id"]: row for row in lines}
    assert by_id["ids"]["response"]["status_code"] == 200  # retried, now answered
    assert by_id["bad-temp"]["response"]["status_code"] == 400  # not retryable: kept
    summary = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert summary["retried"] == 1 and summary["skipped"] == 2
    assert summary["completed"] == 2  # ids and chat


def test_batch_lines_take_output_constraints(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}}, "required": ["n"]}
    lines = [
        {"custom_id": "schema", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "n?"}], "max_tokens": 30,
                  "temperature": 0, "response_format": {
                      "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}},
        {"custom_id": "choice", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "ok?", "max_tokens": 8, "guided_choice": ["yes", "no"]}},
        {"custom_id": "bad", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "x", "guided_regex": "[a-"}},
    ]
    inp.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    proc = run_batch(inp, out)
    assert proc.returncode == 0, proc.stderr
    by_id = {row["custom_id"]: row["response"] for row in map(json.loads,
                                                               out.read_text().splitlines())}
    content = by_id["schema"]["body"]["choices"][0]["message"]["content"]
    assert 0 <= json.loads(content)["n"] <= 99
    assert by_id["choice"]["body"]["choices"][0]["text"] in ("yes", "no")
    assert by_id["bad"]["status_code"] == 400
    assert by_id["bad"]["body"]["error"]["param"] == "guided_regex"


# Several choices a line (`n`, `best_of`): shared with tests/integration/test_remote_batch.py.
CHOICE_LINES = [
    {"custom_id": "n3", "method": "POST", "url": "/v1/completions",
     "body": {"model": "builtin:tiny", "prompt": "hello", "max_tokens": 6, "n": 3, "seed": 7,
              "temperature": 1.0, "ignore_eos": True, "logprobs": 1}},
    {"custom_id": "best", "method": "POST", "url": "/v1/completions",
     "body": {"model": "builtin:tiny", "prompt": "hello", "max_tokens": 6, "best_of": 3,
              "seed": 7, "temperature": 1.0, "ignore_eos": True}},
    {"custom_id": "chat2", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "builtin:tiny", "messages": [{"role": "user", "content": "hi"}],
              "max_tokens": 4, "n": 2, "seed": 5, "temperature": 1.0, "ignore_eos": True}},
]


def check_choice_lines(by_id: dict[str, dict]) -> None:
    """Every choice in its line; best_of=3 keeps the most likely of the 3 sequences n=3
    gives with the same seed (choice i's seed derives from the request's)."""
    n3 = by_id["n3"]["response"]
    assert n3["status_code"] == 200, n3
    choices = n3["body"]["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert len({c["text"] for c in choices}) > 1  # each choice samples its own stream
    assert n3["body"]["usage"]["completion_tokens"] == 18  # each choice's tokens once
    likeliest = max(choices, key=lambda c: sum(c["logprobs"]["token_logprobs"]))
    best = by_id["best"]["response"]["body"]
    assert [c["text"] for c in best["choices"]] == [likeliest["text"]]
    assert best["usage"]["completion_tokens"] == 18  # all 3 were generated
    chat = by_id["chat2"]["response"]["body"]
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    assert all(c["message"]["role"] == "assistant" for c in chat["choices"])
    assert chat["usage"]["completion_tokens"] == 8


def test_batch_lines_take_n_and_best_of(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(json.dumps(x) for x in CHOICE_LINES) + "\n")
    proc = run_batch(inp, out)
    assert proc.returncode == 0, proc.stderr
    first = out.read_text()
    check_choice_lines({row["custom_id"]: row for row in map(json.loads, first.splitlines())})
    # Seeded: the same choices in a second run.
    out.unlink()
    assert run_batch(inp, out).returncode == 0
    texts = [[c.get("text") or c["message"]["content"] for c in json.loads(line)["response"]
              ["body"]["choices"]] for line in first.splitlines()]
    assert [[c.get("text") or c["message"]["content"] for c in json.loads(line)["response"]
             ["body"]["choices"]] for line in out.read_text().splitlines()] == texts
