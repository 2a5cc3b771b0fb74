"""What load balancers and autoscalers read and do: /ready, the metrics under vLLM's names, and the drain on SIGTERM."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from test_server import free_port, running

from smollm2 import Tokenizer, load
from smollm2.generation.engine import Engine
from smollm2.server import create_app
from smollm2.server.draining import DrainingServer
from smollm2.server.metrics import VLLM_FIRST_TOKEN_BUCKETS, VLLM_INTER_TOKEN_BUCKETS
from smollm2.server.scheduler import EngineThread

NAME = "tiny"


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load(tiny_dir), Tokenizer.from_pretrained(tiny_dir)


def until(condition, what: str, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, what
        time.sleep(0.01)
    return value


@pytest.fixture
def slow_steps(monkeypatch):
    """Each engine step 20 ms longer: the tiny model's answers then last long enough to send a SIGTERM into."""
    step = Engine.step

    def slow(self):
        time.sleep(0.02)
        return step(self)

    monkeypatch.setattr(Engine, "step", slow)


def test_ready_only_once_the_warm_up_step_has_run(tiny, monkeypatch):
    """/health is 200 from the start; /ready 503 until the scheduler's warm-up step has run, then 200. The warm-up
    leaves no trace in what /metrics counts."""
    model, tokenizer = tiny
    release, warmed = threading.Event(), []
    warm_up = EngineThread._warm_up

    def held(self):
        assert release.wait(30)
        warm_up(self)
        warmed.append(self)

    monkeypatch.setattr(EngineThread, "_warm_up", held)
    with TestClient(create_app(model, tokenizer, model_name=NAME)) as client:
        assert client.get("/health").status_code == 200
        r = client.get("/ready")
        assert r.status_code == 503 and r.json() == {"status": "loading"}
        release.set()
        until(lambda: client.get("/ready").status_code == 200, "never ready")
        assert client.get("/ready").json() == {"status": "ready"} and len(warmed) == 1
        got = samples(client.get("/metrics").text)
    for name in ("smollm2_decoding_passes_total", "smollm2_prefix_cache_queried_tokens_total",
                 "smollm2_generated_tokens_total"):
        assert got[(name, ())] == 0, name


def samples(text: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def vllm(got: dict, name: str, **labels) -> float:
    return got[(name, tuple(sorted({"model_name": NAME, "engine": "0", **labels}.items())))]


def test_vllm_named_metrics_exist_and_move_with_load(tiny, slow_steps):
    """vLLM's gauges show 4 streams on 2 rows as 2 running, 2 waiting and the cache in use; once they end, its
    counters and histograms (vLLM's buckets, its labels) hold what their usage said."""
    model, tokenizer = tiny
    app = create_app(model, tokenizer, model_name=NAME, max_batch_size=2)
    with running(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        idle = samples(client.get("/metrics").text)
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                     "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                     "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count"):
            assert vllm(idle, name) == 0, name

        def chat(i: int) -> dict:
            body = dict(model=NAME, messages=[{"role": "user", "content": f"Count to {i}"}], max_tokens=100,
                        temperature=0, stream=True, stream_options={"include_usage": True}, min_tokens=100)
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            return next(chunk["usage"] for chunk in chunks if chunk.get("usage"))

        with ThreadPoolExecutor(4) as pool:
            answers = [pool.submit(chat, i) for i in range(4)]
            busy = until(lambda: (got := samples(client.get("/metrics").text)) and
                         vllm(got, "vllm:num_requests_running") == vllm(got, "vllm:num_requests_waiting") == 2
                         and got, "never 2 running and 2 waiting")
            usages = [answer.result() for answer in answers]
        assert 0 < vllm(busy, "vllm:kv_cache_usage_perc") <= 1
        done = samples(client.get("/metrics").text)
    assert vllm(done, "vllm:num_requests_running") == vllm(done, "vllm:num_requests_waiting") == 0
    assert vllm(done, "vllm:kv_cache_usage_perc") == 0
    assert vllm(done, "vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert vllm(done, "vllm:generation_tokens_total") == sum(u["completion_tokens"] for u in usages) == 400
    assert vllm(done, "vllm:time_to_first_token_seconds_count") == 4
    assert vllm(done, "vllm:inter_token_latency_seconds_count") == 4 * 99
    for name, buckets in (("vllm:time_to_first_token_seconds", VLLM_FIRST_TOKEN_BUCKETS),
                          ("vllm:inter_token_latency_seconds", VLLM_INTER_TOKEN_BUCKETS)):
        bounds = [float(dict(labels)["le"]) for key, labels in done if key == f"{name}_bucket"]
        assert bounds == [*buckets, float("inf")], name
    # ours count the same load
    assert done[("smollm2_generated_tokens_total", ())] == 400


@contextlib.contextmanager
def draining_server(app, drain_timeout: float):
    """A DrainingServer in a thread; yields it and its URL. Its SIGTERM is handle_exit's call (signals reach the
    main thread only)."""
    config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
    server = DrainingServer(config, app.state.served, drain_timeout)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    until(lambda: server.started, "the server did not start")
    try:
        yield server, thread, f"http://127.0.0.1:{config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def stream_lines(client: httpx.Client, body: dict):
    return client.stream("POST", "/v1/completions", json={**dict(model=NAME, temperature=0, stream=True), **body})


def test_past_the_drain_timeout_the_answers_in_flight_end_with_an_error_and_the_server_exits(tiny, slow_steps):
    model, tokenizer = tiny
    with draining_server(create_app(model, tokenizer, model_name=NAME), drain_timeout=0.5) as (server, thread, url), \
            httpx.Client(base_url=url, timeout=60) as client:
        with stream_lines(client, dict(prompt="Hi", max_tokens=450, min_tokens=450)) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            began = time.monotonic()
            server.handle_exit(signal.SIGTERM, None)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and "shutting down" in json.loads(rest[-2][6:])["error"]["message"]
        assert len(rest) < 400  # cut short, not run to its 450 tokens (9 s at 20 ms a step)
        thread.join(timeout=10)
        assert not thread.is_alive() and time.monotonic() - began < 0.5 + 5


@pytest.mark.subprocess
def test_serve_drains_on_sigterm(tiny_dir):
    """`smollm2 serve` given SIGTERM mid-stream: /ready turns 503, a new request gets 503 while /health and /metrics
    answer,
    the streamed answer runs to its end, and the process exits 0 within --drain-timeout."""
    port, bound = free_port(), 60
    server = subprocess.Popen([sys.executable, "-m", "smollm2", "serve", "--port", str(port),
                               "--drain-timeout", str(bound)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            def ready():
                with contextlib.suppress(httpx.TransportError):
                    return client.get("/ready").status_code == 200
                assert server.poll() is None, server.stdout.read()
            until(ready, "never ready", timeout=120)
            # The embedded model (~30 ms a token here) answers for seconds: a window to send the signal into.
            with stream_lines(client, dict(model="SmolLM2-135M-Instruct", prompt="Once upon a time",
                                           max_tokens=150, min_tokens=150)) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
                server.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                until(lambda: client.get("/ready").status_code == 503, "/ready did not turn 503")
                refused = client.post("/v1/completions", json=dict(model="SmolLM2-135M-Instruct", prompt="Hi"))
                assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
                assert client.get("/health").status_code == client.get("/metrics").status_code == 200
                rest = [line for line in lines if line]
            assert rest[-1] == "data: [DONE]"
            chunks = [json.loads(line[6:]) for line in rest[:-1]]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # the whole answer, not an error
        assert server.wait(timeout=bound) == 0 and time.monotonic() - signalled < bound
    finally:
        server.kill()
        server.wait()
