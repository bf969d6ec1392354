"""`python -m cluster.batch` without `--local`: the same file format through the cluster."""

from __future__ import annotations

import io
import json

from cluster.remote_batch import run_remote
from tests.integration.conftest import Cluster


def batch_line(custom_id: str, body: dict, url: str = "/v1/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_remote_batch_answers_every_line(cluster: Cluster) -> None:
    lines = [
        batch_line("a", {"model": "builtin:tiny", "prompt": "hello", "max_tokens": 5,
                         "ignore_eos": True}),
        batch_line("b", {"model": "builtin:tiny", "max_tokens": 3, "ignore_eos": True,
                         "messages": [{"role": "user", "content": "hi"}]},
                   "/v1/chat/completions"),
        batch_line("c", {"model": "builtin:tiny", "prompt": "x", "max_tokens": -1}),
        "{not json",
        batch_line("done-before", {"model": "builtin:tiny", "prompt": "x"}),
    ]
    out = io.StringIO()
    counts = run_remote(lines, out, cluster.config, {"done-before"}, progress=False)
    assert counts == {"completed": 2, "failed": 2, "skipped": 1}
    records = {r["custom_id"]: r for r in map(json.loads, out.getvalue().splitlines())}
    assert records["a"]["response"]["body"]["usage"]["completion_tokens"] == 5
    assert records["b"]["response"]["body"]["object"] == "chat.completion"
    assert records["c"]["response"]["status_code"] == 400
    assert None in records  # the unparseable line is answered without a custom_id
