"""GET /metrics: Prometheus' text format, counting what the server did (requests by route and status, tokens in
and out, queue and rows, token times)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from smollm2 import Tokenizer, load
from smollm2.server import create_app

NAME = "tiny"


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load(tiny_dir), Tokenizer.from_pretrained(tiny_dir)


def samples(text: str) -> dict[tuple, float]:
    """Every sample of the exposition, by (name, sorted labels)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_requests_tokens_and_times(tiny):
    model, tokenizer = tiny
    with TestClient(create_app(model, tokenizer, model_name=NAME)) as client:
        usages = []
        for prompt, max_tokens in (("Hello", 5), ("The capital of France is", 7)):
            r = client.post("/v1/completions", json=dict(model=NAME, prompt=prompt, max_tokens=max_tokens,
                                                         temperature=0))
            assert r.status_code == 200
            usages.append(r.json()["usage"])
        assert client.post("/v1/completions", json=dict(model=NAME, prompt=5)).status_code == 400
        assert client.get("/no/such/route").status_code == 404
        with client.stream("POST", "/v1/chat/completions", json=dict(
                model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True,
                stream_options={"include_usage": True})) as r:
            assert r.status_code == 200
            chunks = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: {")]
            usages.append(next(chunk["usage"] for chunk in chunks if chunk.get("usage")))
        r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    got = samples(r.text)

    def requests(route, status):
        return got.get(("smollm2_requests_total", (("route", route), ("status", status))), 0)

    assert requests("/v1/completions", "200") == 2 and requests("/v1/completions", "400") == 1
    assert requests("unmatched", "404") == 1 and requests("/v1/chat/completions", "200") == 1
    assert got[("smollm2_prompt_tokens_total", ())] == sum(u["prompt_tokens"] for u in usages)
    assert got[("smollm2_generated_tokens_total", ())] == sum(u["completion_tokens"] for u in usages)
    assert got[("smollm2_time_to_first_token_seconds_count", ())] == 3
    assert got[("smollm2_inter_token_seconds_count", ())] == sum(u["completion_tokens"] - 1 for u in usages)
    assert got[("smollm2_requests_waiting", ())] == 0 and got[("smollm2_requests_running", ())] == 0


def test_two_apps_count_apart(tiny):
    model, tokenizer = tiny
    with TestClient(create_app(model, tokenizer, model_name=NAME)) as first, \
            TestClient(create_app(model, tokenizer, model_name=NAME)) as second:
        first.get("/v1/models")
        assert ("smollm2_requests_total", (("route", "/v1/models"), ("status", "200"))) in samples(
            first.get("/metrics").text)
        assert ("smollm2_requests_total", (("route", "/v1/models"), ("status", "200"))) not in samples(
            second.get("/metrics").text)
