"""Contract fuzzing of the HTTP edge with schemathesis, from the app's own /openapi.json.

In-process (ASGI) over the fake controller client of test_ingress, on the builtin tiny
tokenizer: a few hundred generated requests, every answer checked against the document:
no 5xx, every status, content type, header and body as documented.
"""

from __future__ import annotations

import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from cluster.config import TokenflowConfig
from cluster.ingress import OpenAIServer, add_routes
from tests.unit.test_ingress import FakeClient, ids

# Fixed: the examples derandomized, so a failure reproduces; one server for every case.
SERVER = OpenAIServer(TokenflowConfig(protections={"max_prefill_tokens": 64}),
                      FakeClient(ids("hello world")))
schema = schemathesis.openapi.from_asgi("/openapi.json", add_routes(FastAPI(), SERVER))

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


@schema.parametrize()
@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_every_answer_conforms_to_the_spec(case: schemathesis.Case) -> None:
    case.call_and_validate(checks=CHECKS)
