"""The HTTP server: OpenAI's API over continuous batching, exact to the engine, and hard to knock over.

Most tests run the tiny random model, in-process (TestClient) or behind a real uvicorn on a free port
(TestClient buffers whole responses, so streams, disconnects and concurrency need a real server).
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
import uvicorn
from fastapi.testclient import TestClient

from smollm2 import Tokenizer, load
from smollm2.generation import generate, stream
from smollm2.server import create_app, load_app, scheduler
from smollm2.server.serving import MAX_STOP_LENGTH

NAME = "tiny"
PROMPTS = ["Hello", "The capital of France is", "Once upon a time, in a land far far away, there lived",
           "1 2 3 4 5 6 7 8", "Write a poem about the sea and the sky and the wind that blows", "Why?"]


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load(tiny_dir), Tokenizer.from_pretrained(tiny_dir)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(app):
    """A real uvicorn serving `app` on 127.0.0.1 in a thread; yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def while_streaming(app, path: str, body: dict) -> httpx.Response:
    """POST body to path while a long completion streams from the same app (real uvicorn); the stream must run
    on to its end. Returns the POST's response."""
    stream = dict(model=NAME, prompt="Hi", max_tokens=400, temperature=0, stream=True)
    with running(app) as url, httpx.Client(base_url=url) as client:
        with client.stream("POST", "/v1/completions", json=stream) as r:
            lines = r.iter_lines()
            next(lines)  # decoding has begun
            answer = client.post(path, json=body)
            assert [line for line in lines if line][-1] == "data: [DONE]"  # the stream ran on, to its end
    return answer


def expected(model, tokenizer, ids: list[int], max_tokens: int, **sampling) -> str:
    """The engine's answer alone, as `smollm2 generate` / `chat -p` print it: up to EOS, no special tokens."""
    new = generate(model, [ids], max_tokens, **sampling)[0, len(ids):].tolist()
    eos = set(model.config.eos_token_ids)
    new = new[:next((i for i, t in enumerate(new) if t in eos), len(new))]
    return tokenizer.decode(new, skip_special_tokens=True)


def events(response) -> list:
    """The JSON payloads of an SSE response, checking it ends with [DONE]."""
    lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def completion(client, prompt: str, max_tokens: int, stream: bool = False, **extra) -> str:
    body = dict(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=stream, **extra)
    if not stream:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        return "".join(c["choices"][0]["text"] for c in events(r))


def test_models_health_and_greedy_answers_equal_the_engine(tiny):
    model, tokenizer = tiny
    with TestClient(create_app(model, tokenizer, model_name=NAME)) as client:
        assert client.get("/health").json()["status"] == "ok"
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [NAME]
        for prompt in PROMPTS[:3]:
            assert completion(client, prompt, 12) == expected(model, tokenizer, tokenizer.encode(prompt), 12)
        # create_app's defaults (the model's cache dtype, prompt lookup): log-probabilities generate()'s, bit for bit
        body = dict(model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0, logprobs=2)
        served = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["token_logprobs"]
        steps = [step for (step,) in stream(model, [tokenizer.encode(PROMPTS[0])], 12, temperature=0, logprobs=2)]
        assert served == [step.logprob.logprob for step in steps][:len(served)] and served

        messages = [{"role": "user", "content": "What is 2 + 2?"}]
        r = client.post("/v1/chat/completions", json=dict(model=NAME, messages=messages, max_tokens=9, temperature=0))
        body = r.json()
        ids = tokenizer.apply_chat_template(messages)
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
        assert body["choices"][0]["message"]["content"] == expected(model, tokenizer, ids, 9)
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
        usage = body["usage"]
        assert usage["prompt_tokens"] == len(ids) and usage["total_tokens"] == len(ids) + usage["completion_tokens"]


def test_seeded_sampling_is_reproducible_and_equals_the_engine(tiny):
    model, tokenizer = tiny
    with TestClient(create_app(model, tokenizer, model_name=NAME)) as client:
        body = dict(model=NAME, prompt="Hello there", max_tokens=10, temperature=0.8, top_p=0.9, seed=1234)
        first, again = (client.post("/v1/completions", json=body).json()["choices"][0]["text"] for _ in range(2))
        assert first == again == expected(model, tokenizer, tokenizer.encode("Hello there"), 10,
                                          temperature=0.8, top_p=0.9, seed=1234)


def test_stop_strings_cut_the_answer_streamed_or_not(tiny):
    model, tokenizer = tiny
    with running(create_app(model, tokenizer, model_name=NAME)) as url, httpx.Client(base_url=url) as client:
        full = completion(client, PROMPTS[2], 20)
        stop = full[len(full) // 2:len(full) // 2 + 3]
        for streamed in (False, True):
            assert completion(client, PROMPTS[2], 20, streamed, stop=[stop, "never appears"]) == full[:full.find(stop)]


def test_concurrent_greedy_requests_equal_the_same_served_alone(tiny, monkeypatch):
    model, tokenizer = tiny
    rows = []  # the batch size of every decoding step
    step = scheduler.decode_step
    monkeypatch.setattr(scheduler, "decode_step", lambda model, ids, *rest: (rows.append(len(ids)),
                                                                           step(model, ids, *rest))[1])
    lengths = [5, 40, 17, 60, 1, 33]  # different lengths: requests join and leave the batch at different steps
    # fewer slots than requests; no speculation, so that every pass is a decoding step, counted
    app = create_app(model, tokenizer, model_name=NAME, max_batch_size=3, speculative=None)
    with running(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        alone = [completion(client, p, n) for p, n in zip(PROMPTS, lengths)]
        assert set(rows) == {1}  # a lone request decodes in a batch of one, not of every slot
        rows.clear()
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(lambda i: completion(client, PROMPTS[i], lengths[i], stream=i % 2 == 0),
                                     range(len(PROMPTS))))
        assert together == alone
        # The batch grew to every slot and shrank as requests left: rows moved to stay 0..n-1 on the way.
        assert max(rows) == 3 and rows[-1] == 1
        assert client.get("/health").json()["active"] == 0
    assert alone[0] == expected(model, tokenizer, tokenizer.encode(PROMPTS[0]), lengths[0])


def test_streamed_chat_chunks_follow_openai_format(tiny):
    model, tokenizer = tiny
    body = dict(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0,
                stream=True, stream_options={"include_usage": True})
    with running(create_app(model, tokenizer, model_name=NAME)) as url, httpx.Client(base_url=url) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            chunks = events(r)
        whole = client.post("/v1/chat/completions", json={**body, "stream": False}).json()
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert text == whole["choices"][0]["message"]["content"]


MALFORMED = [
    ("/v1/completions", b"{not json"),
    ("/v1/completions", b"[1, 2]"),
    ("/v1/completions", json.dumps({"model": NAME})),
    ("/v1/completions", json.dumps({"model": NAME, "prompt": 5})),
    ("/v1/completions", json.dumps({"model": "gpt-4", "prompt": "hi"})),
    ("/v1/completions", json.dumps({"model": NAME, "prompt": "hi", "max_tokens": -3})),
    ("/v1/completions", json.dumps({"model": NAME, "prompt": "hi", "max_tokens": "ten"})),
    ("/v1/completions", json.dumps({"model": NAME, "prompt": "hi", "temperature": 2.5})),
    ("/v1/completions", json.dumps({"model": NAME, "prompt": "hi", "top_p": 0})),
    ("/v1/completions", json.dumps({"model": NAME, "prompt": "hi", "seed": 1.5})),
    ("/v1/completions", json.dumps({"model": NAME, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]})),
    ("/v1/completions", json.dumps({"model": NAME, "prompt": "hi", "n": 9})),
    ("/v1/completions", json.dumps({"model": NAME, "prompt": "hi", "n": 0})),
    ("/v1/chat/completions", json.dumps({"model": NAME, "messages": [{"role": "user", "content": "x"}], "n": 1.5})),
    ("/v1/completions", json.dumps({"model": NAME, "prompt": ""})),
    ("/v1/chat/completions", json.dumps({"model": NAME, "messages": []})),
    ("/v1/chat/completions", json.dumps({"model": NAME, "messages": [{"role": "robot", "content": "x"}]})),
    ("/v1/chat/completions", json.dumps({"model": NAME, "messages": "hello"})),
    ("/v1/completions", json.dumps({"model": NAME, "prompt": "hi", "logprobs": 21})),
    ("/v1/completions", json.dumps({"model": NAME, "prompt": "hi", "logprobs": True})),
    ("/v1/completions", json.dumps({"model": NAME, "prompt": "hi", "echo": "yes"})),
    ("/v1/chat/completions", json.dumps({"model": NAME, "messages": [{"role": "user", "content": "x"}],
                                         "logprobs": True, "top_logprobs": -1})),
    ("/v1/chat/completions", json.dumps({"model": NAME, "messages": [{"role": "user", "content": "x"}],
                                         "top_logprobs": 2})),
    ("/v1/chat/completions", json.dumps({"model": NAME, "messages": [{"role": "user", "content": "x"}],
                                         "logprobs": 1})),
    ("/v1/chat/completions", json.dumps({"model": NAME, "messages": [{"role": "user", "content": 5}]})),
    ("/v1/chat/completions", json.dumps({"model": NAME, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]}]})),
    ("/tokenize", json.dumps({"content": 5})),
    ("/detokenize", json.dumps({"tokens": [1, -2]})),
    ("/detokenize", json.dumps({"tokens": [1, 10**9]})),
    ("/detokenize", json.dumps({"tokens": "12"})),
    ("/v1/nothing", b"{}"),
]


def test_create_app_serves_as_smollm2_serve_does_by_default():
    """One server, whichever way it is started: create_app's defaults are the serve command's, but for the KV
    cache, which keeps the model's dtype in Python (answers bit for bit generate()'s) and bf16 in `serve`. Stated
    once, in server/defaults.py: no flag of serve's that becomes a create_app (or load_app) option has a default
    written in cli.py."""
    import ast
    import inspect

    from smollm2 import cli
    from smollm2.cli import parser

    serve = parser().parse_args(["serve"])
    defaults = {name: p.default for name, p in inspect.signature(create_app).parameters.items()}
    assert defaults["kv_cache_dtype"] is None and serve.kv_cache_dtype == "bf16"  # generate()'s bits; half the memory
    assert defaults["prefix_cache_bytes"] == serve.prefix_cache * 2**20
    assert defaults["speculative"] == serve.speculative == "ngram"
    assert (defaults["max_batch_size"], defaults["max_waiting"]) == (serve.max_batch_size, serve.max_waiting)
    assert inspect.signature(load_app).parameters["speculative"].default == serve.speculative
    options = {"--max-batch-size", "--max-waiting", "--prefix-cache", "--speculative", "--kv-cache-dtype"}
    flags = [call for call in ast.walk(ast.parse(open(cli.__file__).read())) if isinstance(call, ast.Call)
             and getattr(call.func, "attr", None) == "add_argument" and call.args
             and getattr(call.args[0], "value", None) in options]
    assert {flag.args[0].value for flag in flags} == options
    written = [ast.unparse(flag) for flag in flags for keyword in flag.keywords
               if keyword.arg == "default" and isinstance(keyword.value, ast.Constant)]
    assert not written, written


def test_load_app_serves_what_sources_name_loaded_on_one_thread(tiny, tiny_dir):
    """server.load_app, which `smollm2 serve` calls: the model and tokenizer at a source, served by its name,
    loaded on one torch thread, which this thread keeps (see EngineThread), the engine threads running on `threads`."""
    model, tokenizer = tiny
    threads = torch.get_num_threads()
    try:
        app = load_app(str(tiny_dir), speculative="off", threads=2)
        assert torch.get_num_threads() == 1
        assert [s.threads for s in app.state.served.engines.values()] == [2]
        with TestClient(app) as client:
            assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [str(tiny_dir)]
            body = dict(model=str(tiny_dir), prompt=PROMPTS[1], max_tokens=12, temperature=0)
            r = client.post("/v1/completions", json=body)
            assert r.json()["choices"][0]["text"] == expected(model, tokenizer, tokenizer.encode(PROMPTS[1]), 12)
    finally:
        torch.set_num_threads(threads)


def test_malformed_requests_get_openai_errors_and_leave_the_server_healthy(tiny):
    model, tokenizer = tiny
    with TestClient(create_app(model, tokenizer, model_name=NAME)) as client:
        before = completion(client, PROMPTS[1], 10)
        for i in range(100):
            path, body = MALFORMED[i % len(MALFORMED)]
            r = client.post(path, content=body, headers={"content-type": "application/json"})
            assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], error
        assert client.get("/health").json() == {"status": "ok", "active": 0, "waiting": 0, "slots": 8}
        assert completion(client, PROMPTS[1], 10) == before


def test_text_that_is_not_unicode_gets_400_naming_the_field(tiny):
    model, tokenizer = tiny
    with TestClient(create_app(model, tokenizer, model_name=NAME)) as client:
        for path, body, field in [
            ("/v1/completions", dict(model=NAME, prompt="caf\ud800"), "prompt"),
            ("/v1/chat/completions", dict(model=NAME, messages=[{"role": "user", "content": "\ud800"}]),
             "messages.0.content"),
            ("/v1/completions", dict(model="\udcff", prompt="Hi"), "model"),
            ("/v1/completions", dict(model=NAME, prompt="Hi", stop="\ud800"), "stop.0"),
            ("/v1/chat/completions", dict(model=NAME, messages=[{"role": "user", "content": [
                {"type": "text", "text": "\ud800"}]}]), "messages.0.content.0.text"),
            ("/tokenize", dict(content="\ud800"), "content"),
        ]:  # valid JSON: a lone surrogate escaped as \ud800
            r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == field and r.json()["error"]["message"].startswith(field)


def test_seeds_beyond_64_bits_get_400(tiny):
    model, tokenizer = tiny
    with TestClient(create_app(model, tokenizer, model_name=NAME)) as client:
        for seed in (10**30, 2**64, -1):
            r = client.post("/v1/completions", json=dict(model=NAME, prompt="Hi", max_tokens=2, seed=seed))
            assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
        r = client.post("/v1/completions", json=dict(model=NAME, prompt="Hi", max_tokens=2, seed=2**64 - 1))
        assert r.status_code == 200, r.text


def test_stop_strings_are_bounded(tiny):
    model, tokenizer = tiny
    with TestClient(create_app(model, tokenizer, model_name=NAME)) as client:
        start = time.perf_counter()
        r = client.post("/v1/completions", json=dict(model=NAME, prompt="Hi", stop=["x" * 200_000] * 4))
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop.0"
        assert f"at most {MAX_STOP_LENGTH} characters" in r.json()["error"]["message"]
        assert time.perf_counter() - start < 5
        stop = ["x" * MAX_STOP_LENGTH] * 4
        assert completion(client, PROMPTS[0], 5, stop=stop) == completion(client, PROMPTS[0], 5)



def test_limits_context_body_size_and_api_key(tiny):
    model, tokenizer = tiny
    app = create_app(model, tokenizer, model_name=NAME, api_key="sesame", max_body_bytes=10_000)
    auth = {"Authorization": "Bearer sesame"}
    with TestClient(app) as client:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "sesame"}):
            r = client.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert client.get("/v1/models", headers=auth).status_code == 200

        r = client.post("/v1/completions", headers=auth, json=dict(model=NAME, prompt="word " * 400, max_tokens=200))
        assert r.status_code == 400 and "context window of 512" in r.json()["error"]["message"]
        r = client.post("/v1/chat/completions", headers=auth,
                        json=dict(model=NAME, messages=[{"role": "user", "content": "word " * 600}]))
        assert r.status_code == 400 and "context window of 512" in r.json()["error"]["message"]

        r = client.post("/v1/completions", headers=auth, json=dict(model=NAME, prompt="x" * 20_000))
        assert r.status_code == 413 and r.json()["error"]["message"]
        r = client.post("/v1/completions", headers=auth, json=dict(model=NAME, prompt="Hi", max_tokens=3))
        assert r.status_code == 200


def test_full_queue_gets_429(tiny, monkeypatch):
    model, tokenizer = tiny
    gate = threading.Event()  # holds the scheduler thread inside the first request's prefill
    logits = model.logits
    monkeypatch.setattr(model, "logits", lambda h: (gate.wait(30), logits(h))[1])
    app = create_app(model, tokenizer, model_name=NAME, max_batch_size=1, max_waiting=1)
    body = dict(model=NAME, prompt="Hi", max_tokens=2)
    with running(app) as url, httpx.Client(base_url=url, timeout=60) as client, ThreadPoolExecutor(2) as pool:
        def wait_for(**load):
            deadline = time.time() + 10
            while {k: client.get("/health").json()[k] for k in load} != load:
                assert time.time() < deadline, client.get("/health").json()
                time.sleep(0.02)

        first = pool.submit(client.post, "/v1/completions", json=body)
        wait_for(active=1)
        second = pool.submit(client.post, "/v1/completions", json=body)
        wait_for(waiting=1)
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        gate.set()
        assert first.result().status_code == second.result().status_code == 200


def test_a_failing_step_fails_its_requests_and_the_server_keeps_serving(tiny, monkeypatch):
    model, tokenizer = tiny
    logits = model.logits
    failures = iter([RuntimeError("boom")])

    def flaky(h):
        error = next(failures, None)
        if error:
            raise error
        return logits(h)

    monkeypatch.setattr(model, "logits", flaky)
    with TestClient(create_app(model, tokenizer, model_name=NAME)) as client:
        r = client.post("/v1/completions", json=dict(model=NAME, prompt="Hi", max_tokens=3))
        assert r.status_code == 503 and "boom" in r.json()["error"]["message"]
        assert completion(client, "Hi", 3) == expected(model, tokenizer, tokenizer.encode("Hi"), 3)


def test_the_scheduler_thread_runs_the_model_with_the_threads_it_was_given(tiny, monkeypatch):
    """OpenMP's thread count is each thread's own: the scheduler sets it in its thread (see EngineThread)."""
    import threading

    import torch

    model, tokenizer = tiny
    answer = expected(model, tokenizer, tokenizer.encode("Hi"), 2)
    logits, seen = model.logits, []

    def counted(h):
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return logits(h)

    monkeypatch.setattr(model, "logits", counted)
    with TestClient(create_app(model, tokenizer, model_name=NAME, threads=1)) as client:
        assert completion(client, "Hi", 2) == answer
    assert seen and set(seen) == {("smollm2-scheduler", 1)}


def test_a_client_that_leaves_mid_stream_frees_its_slot(tiny):
    model, tokenizer = tiny
    app = create_app(model, tokenizer, model_name=NAME, max_batch_size=1)
    body = dict(model=NAME, prompt="Hello", max_tokens=500, temperature=0, stream=True)
    with running(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
        deadline = time.time() + 10
        while client.get("/health").json()["active"]:
            assert time.time() < deadline, "the slot was not freed"
            time.sleep(0.02)
        assert completion(client, PROMPTS[0], 5) == expected(model, tokenizer, tokenizer.encode(PROMPTS[0]), 5)


def test_a_client_that_leaves_before_a_whole_answer_cancels_it(tiny, monkeypatch):
    model, tokenizer = tiny
    steps = []
    logits = model.logits
    monkeypatch.setattr(model, "logits", lambda h: (steps.append(1), time.sleep(0.01), logits(h))[2])
    app = create_app(model, tokenizer, model_name=NAME, max_batch_size=1)
    body = dict(model=NAME, prompt="Hello", max_tokens=500, temperature=0)  # not streamed
    with running(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/completions", json=body, timeout=0.5)
        deadline = time.time() + 30
        while client.get("/health").json()["active"]:
            assert time.time() < deadline, "the slot was not freed"
            time.sleep(0.02)
        assert len(steps) < 500  # it stopped early, not at max_tokens
        assert completion(client, PROMPTS[0], 5) == expected(model, tokenizer, tokenizer.encode(PROMPTS[0]), 5)


@pytest.mark.subprocess
def test_serve_command_exits_cleanly_on_sigterm(tiny_dir):
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "smollm2", "serve", "--model", str(tiny_dir), "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            deadline = time.time() + 60
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if client.get("/health").status_code == 200:
                        break
                assert server.poll() is None and time.time() < deadline, server.stdout.read()
                time.sleep(0.2)
            body = dict(model=str(tiny_dir), prompt="Hello", max_tokens=300, temperature=0, stream=True)
            with client.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
                server.send_signal(signal.SIGTERM)
                assert [line for line in lines if line][-1] == "data: [DONE]"  # the answer in flight finishes
        assert server.wait(timeout=30) == 0
    finally:
        server.kill()
        server.wait()


def test_openai_client_against_the_embedded_model(model):
    """The official client, a real server, the real model: the answer `smollm2 chat -p` gives, streamed or not."""
    from openai import OpenAI

    tokenizer = Tokenizer.from_pretrained()
    question = [{"role": "user", "content": "What is the capital of France?"}]
    want = expected(model, tokenizer, tokenizer.apply_chat_template(question), 20, temperature=0)
    assert "Paris" in want
    app = create_app(model, tokenizer, model_name="SmolLM2-135M-Instruct", max_batch_size=2, max_seq_len=1024)
    with running(app) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == ["SmolLM2-135M-Instruct"]
        answer = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=question, temperature=0,
                                                max_tokens=20)
        assert answer.choices[0].message.content == want
        chunks = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=question, temperature=0,
                                                max_tokens=20, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == want


def test_new_fields_bad_values_name_the_field(tiny):
    model, tokenizer = tiny
    user = [{"role": "user", "content": "x"}]
    with TestClient(create_app(model, tokenizer, model_name=NAME)) as client:
        for path, body, field in [
            ("/v1/completions", dict(model=NAME, prompt="hi", logprobs=21), "logprobs"),
            ("/v1/completions", dict(model=NAME, prompt="hi", echo=1), "echo"),
            ("/v1/chat/completions", dict(model=NAME, messages=user, logprobs=True, top_logprobs=21), "top_logprobs"),
            ("/v1/chat/completions", dict(model=NAME, messages=user, top_logprobs=1), "top_logprobs"),
            ("/v1/chat/completions", dict(model=NAME, messages=[{"role": "user", "content": [
                {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]}]),
             "messages.0.content.1.type"),
            ("/v1/chat/completions", dict(model=NAME, messages=[{"role": "user", "content": None}]),
             "messages.0.content"),
            ("/v1/chat/completions", dict(model=NAME, messages=[{"role": "user", "content": ["a"]}]),
             "messages.0.content.0"),
            ("/detokenize", dict(tokens=[3, 49152]), "tokens.1"),
            ("/detokenize", dict(tokens=[3, "4"]), "tokens.1"),
        ]:
            r = client.post(path, json=body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == field, (body, r.text)
            assert r.json()["error"]["message"].startswith(field)
        assert client.get("/health").json()["active"] == 0


def test_text_content_parts_are_joined(tiny):
    model, tokenizer = tiny
    with TestClient(create_app(model, tokenizer, model_name=NAME)) as client:
        def answer(content):
            body = dict(model=NAME, messages=[{"role": "user", "content": content}], max_tokens=6, temperature=0)
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]

        assert answer([{"type": "text", "text": "What is "}, {"type": "text", "text": "2 + 2?"}]) == \
            answer("What is 2 + 2?")


def test_tokenize_and_detokenize(tiny):
    model, tokenizer = tiny
    with TestClient(create_app(model, tokenizer, model_name=NAME)) as client:
        r = client.post("/tokenize", json={"content": "Hello wörld 😀"})
        assert r.json() == {"tokens": tokenizer.encode("Hello wörld 😀")}
        assert client.post("/tokenize", json={"content": "Hi", "add_special": True}).status_code == 200
        r = client.post("/detokenize", json={"tokens": r.json()["tokens"]})
        assert r.json() == {"content": "Hello wörld 😀"}
        assert client.post("/detokenize", json={"tokens": []}).json() == {"content": ""}


def test_echo_scores_the_prompt_as_loglikelihood(tiny, monkeypatch):
    """echo + logprobs with max_tokens 0 (lm-eval's local-completions): the prompt's tokens, the first
    unscored, the rest as smollm2.evaluate scores them."""
    from smollm2 import evaluate
    from smollm2.generation import steps
    from smollm2.generation.engine import prompt_logprobs

    monkeypatch.setattr(steps, "PREFILL_CHUNK", 4)  # the prompt in several chunks, each scored as it is prefilled

    model, tokenizer = tiny
    prompt = PROMPTS[2]
    ids = tokenizer.encode(prompt)
    want, _ = evaluate.loglikelihood(model, ids[:1], ids[1:])
    with running(create_app(model, tokenizer, model_name=NAME, kv_cache_dtype="fp32")) as url, \
            httpx.Client(base_url=url) as client:
        body = dict(model=NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
        choice = client.post("/v1/completions", json=body).json()["choices"][0]
        lp = choice["logprobs"]
        assert choice["text"] == prompt and "".join(lp["tokens"]) == prompt
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert sum(lp["token_logprobs"][1:]) == pytest.approx(want, abs=1e-4)
        # The very numbers of prompt_logprobs, which prefills in the same chunks (bits, not a tolerance).
        assert lp["token_logprobs"][1:] == [s.logprob for s in prompt_logprobs(model, ids)[1:]]
        assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(ids))]
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            chunks = events(r)
        assert chunks[0]["choices"][0]["text"] == prompt
        assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"]

        # With new tokens: the prompt, then the answer, each token with its logprob.
        r = client.post("/v1/completions", json={**body, "max_tokens": 5}).json()["choices"][0]
        new = expected(model, tokenizer, ids, 5)
        assert r["text"] == prompt + new
        assert r["logprobs"]["token_logprobs"][0] is None
        assert r["logprobs"]["token_logprobs"][1:len(ids)] == lp["token_logprobs"][1:]
        # The answer's log-probabilities are those of the same request without echo, bit for bit.
        plain = client.post("/v1/completions", json={**body, "max_tokens": 5, "echo": False}).json()["choices"][0]
        assert r["logprobs"]["token_logprobs"][len(ids):] == plain["logprobs"]["token_logprobs"]
        assert len(r["logprobs"]["tokens"]) == len(ids) + 5
        assert "".join(r["logprobs"]["tokens"]) == prompt + new
        # echo without logprobs: the text alone
        r = client.post("/v1/completions", json={**body, "logprobs": None, "max_tokens": 3}).json()["choices"][0]
        assert r["text"] == prompt + expected(model, tokenizer, ids, 3) and r["logprobs"] is None


def test_openai_client_logprobs_equal_transformers(model, hf_model):
    """Greedy on the embedded model: every token's logprob and top logprobs, chat and completions, streamed
    or not, are log-softmax of transformers' logits."""
    import torch
    from openai import OpenAI

    tokenizer = Tokenizer.from_pretrained()
    name = "SmolLM2-135M-Instruct"
    question = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(question)

    def reference(prompt, tokens):
        with torch.inference_mode():
            logits = hf_model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:].float()
        return torch.log_softmax(logits, -1)

    def check(prompt, tokens, logprobs, tops):
        want = reference(prompt, tokens)
        assert logprobs == pytest.approx(want[range(len(tokens)), tokens].tolist(), abs=1e-4)
        for i, top in enumerate(tops):
            values = want[i].topk(len(top)).values.tolist()
            assert [v for _, v in top] == pytest.approx(values, abs=1e-4)

    app = create_app(model, tokenizer, model_name=name, max_batch_size=2, max_seq_len=1024, kv_cache_dtype="fp32")
    with running(app) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        answer = client.chat.completions.create(model=name, messages=question, temperature=0, max_tokens=12,
                                                logprobs=True, top_logprobs=5)
        content = answer.choices[0].logprobs.content
        tokens = generate(model, [prompt], 12, temperature=0)[0, len(prompt):].tolist()[:len(content)]
        assert [bytes(c.bytes) for c in content] == [tokenizer.token_bytes(t) for t in tokens]
        check(prompt, tokens, [c.logprob for c in content],
              [[(t.token, t.logprob) for t in c.top_logprobs] for c in content])
        assert all(len(c.top_logprobs) == 5 and c.top_logprobs[0].logprob == c.logprob for c in content)

        chunks = client.chat.completions.create(model=name, messages=question, temperature=0, max_tokens=12,
                                                logprobs=True, top_logprobs=5, stream=True)
        streamed = [c for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                    for c in chunk.choices[0].logprobs.content]
        assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]

        text = "The capital of France is"
        ids = tokenizer.encode(text)
        done = client.completions.create(model=name, prompt=text, temperature=0, max_tokens=6, logprobs=3)
        lp = done.choices[0].logprobs
        new = generate(model, [ids], 6, temperature=0)[0, len(ids):].tolist()
        assert lp.tokens == [tokenizer.token_text(t) for t in new]
        check(ids, new, lp.token_logprobs, [list(top.items()) for top in lp.top_logprobs])


def test_n_choices_each_equal_their_seed_sent_alone(tiny):
    model, tokenizer = tiny
    body = dict(model=NAME, prompt="Hello there", max_tokens=8, temperature=0.9, seed=7, logprobs=1)
    with running(create_app(model, tokenizer, model_name=NAME, max_batch_size=3)) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        whole = client.post("/v1/completions", json={**body, "n": 4}).json()
        alone = [client.post("/v1/completions", json={**body, "seed": 7 + i}).json() for i in range(4)]
        assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
        for choice, one in zip(whole["choices"], alone):
            assert choice["text"] == one["choices"][0]["text"]
            assert choice["logprobs"]["tokens"] == one["choices"][0]["logprobs"]["tokens"]
        assert len({c["text"] for c in whole["choices"]}) > 1
        assert whole["usage"]["prompt_tokens"] == alone[0]["usage"]["prompt_tokens"]
        assert whole["usage"]["completion_tokens"] == sum(one["usage"]["completion_tokens"] for one in alone)

        with client.stream("POST", "/v1/completions", json={**body, "n": 4, "stream": True,
                                                            "stream_options": {"include_usage": True}}) as r:
            chunks = events(r)
        texts = ["".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i)
                 for i in range(4)]
        assert texts == [c["text"] for c in whole["choices"]]
        assert chunks[-1]["usage"] == whole["usage"]

        chat = dict(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0.9, seed=3)
        whole = client.post("/v1/chat/completions", json={**chat, "n": 3}).json()
        alone = [client.post("/v1/chat/completions", json={**chat, "seed": 3 + i}).json() for i in range(3)]
        assert [c["message"]["content"] for c in whole["choices"]] == \
            [one["choices"][0]["message"]["content"] for one in alone]
        assert client.get("/health").json()["active"] == 0


def test_a_completions_prompt_as_text_token_ids_or_a_list_of_them(tiny):
    """OpenAI's prompt forms; lm-evaluation-harness sends a list of token id lists. A list of prompts is a batch:
    choice p * n + i answers prompt p with seed + i, as that prompt sent alone would."""
    model, tokenizer = tiny
    ids = tokenizer.encode(PROMPTS[1])
    with TestClient(create_app(model, tokenizer, model_name=NAME)) as client:
        want = completion(client, PROMPTS[1], 6)
        for prompt in (ids, [ids], [PROMPTS[1]]):
            assert completion(client, prompt, 6) == want
        body = dict(model=NAME, max_tokens=5, temperature=0.9, seed=11, n=2, echo=True, logprobs=1)
        batch = client.post("/v1/completions", json=dict(body, prompt=[PROMPTS[0], ids, PROMPTS[3]])).json()
        alone = [client.post("/v1/completions", json=dict(body, prompt=p)).json()
                 for p in (PROMPTS[0], ids, PROMPTS[3])]
        assert [c["index"] for c in batch["choices"]] == list(range(6))
        assert batch["choices"] == [dict(c, index=2 * p + i) for p, one in enumerate(alone)
                                    for i, c in enumerate(one["choices"])]
        assert batch["choices"][2]["text"].startswith(PROMPTS[1])  # echo: each choice starts with its own prompt
        assert batch["usage"]["prompt_tokens"] == sum(one["usage"]["prompt_tokens"] for one in alone)
        assert batch["usage"]["completion_tokens"] == sum(one["usage"]["completion_tokens"] for one in alone)
        r = client.post("/v1/completions", json=dict(body, prompt=[PROMPTS[0], ids, PROMPTS[3]], stream=True))
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert ["".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i)
                for i in range(6)] == [c["text"] for c in batch["choices"]]
        r = client.post("/v1/completions", json=dict(model=NAME, prompt=[PROMPTS[0]] * 9, n=8, max_tokens=2))
        assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "72 requests" in r.text, r.text
        for prompt, message in (([PROMPTS[0]] * 17, "at most 16"), ([ids, []], "prompt.1: the prompt is empty"),
                                ([], "non-empty"), ([PROMPTS[0], 5], "must be text"), ([5, 10 ** 9], "not a token id")):
            r = client.post("/v1/completions", json=dict(model=NAME, prompt=prompt, max_tokens=2))
            assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
        assert client.get("/health").json()["status"] == "ok"


def test_requests_cancelled_together_each_end_once(tiny):
    """Rows 0 and 2 of 3 cancelled at one step: each is told its end once, and row 1 moves into row 0."""
    import asyncio

    import torch

    from smollm2.generation import Request

    model, tokenizer = tiny
    ended = []
    sched = scheduler.EngineThread(model, tokenizer, max_batch_size=4, on_end=ended.append)

    async def run():
        requests = [sched.submit(Request([1, 2, 3 + i], 8)) for i in range(3)]
        with torch.inference_mode():
            sched._step()
        assert [sched.requests[row] for row in sched.engine.decoding] == requests
        requests[0].cancelled = requests[2].cancelled = True
        with torch.inference_mode():
            sched._step()
        assert [sched.requests[row] for row in sched.engine.decoding] == [requests[1]]
        assert sorted(map(id, ended)) == sorted(map(id, [requests[0], requests[2]]))

    asyncio.run(run())
