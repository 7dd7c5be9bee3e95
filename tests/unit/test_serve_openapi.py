"""kvstore.serve.openapi: the description of kvstore serve's routes is a valid OpenAPI
document schemathesis loads, naming every route the server answers."""

from __future__ import annotations

import schemathesis

from kvstore.serve.openapi import document

ROUTES = {("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/messages"),
          ("POST", "/v1/messages/count_tokens"), ("POST", "/v1/responses"), ("GET", "/v1/responses/{id}"),
          ("DELETE", "/v1/responses/{id}"), ("GET", "/v1/cache/stats"), ("GET", "/metrics"), ("GET", "/health"),
          ("HEAD", "/health"), ("GET", "/v1/models"), ("GET", "/v1/models/{model}"), ("GET", "/openapi.json")}


def test_every_route_is_described_and_the_document_loads() -> None:
    doc = document(64 << 10)
    assert doc["x-max-body-bytes"] == 64 << 10
    schema = schemathesis.openapi.from_dict(doc)
    described = {(r.ok().method.upper(), r.ok().path) for r in schema.get_all_operations()}
    assert ROUTES <= described, ROUTES - described
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if method == "post":
                assert {"200", "400", "413"} <= set(op["responses"]), (method, path)
