"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the official anthropic client: the
same text as chat completions for the same messages, whole or streamed; stop reasons; a prefilled answer; and
every error in Anthropic's shape."""

from __future__ import annotations

import json

import httpx
import pytest
from test_server import expected, running

from smollm2 import SmolLM2, Tokenizer
from smollm2.server import create_app

NAME = "SmolLM2-135M-Instruct"
TINY = "tiny"
SYSTEM = "You are a geography teacher. Answer in one sentence."
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}  # in the body: the newest anthropic clients take no sampling arguments


@pytest.fixture(scope="module")
def served(model):
    """The embedded model served by uvicorn on a free port: the anthropic client, and the openai one."""
    from anthropic import Anthropic
    from openai import OpenAI

    with running(create_app(model, Tokenizer.from_pretrained(), model_name=NAME, max_seq_len=1024)) as url:
        yield (Anthropic(base_url=url, api_key="unused", max_retries=0),
               OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0))


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return SmolLM2.from_pretrained(tiny_dir), Tokenizer.from_pretrained(tiny_dir)


def test_messages_whole_and_streamed_equal_chat_completions(served):
    anthropic, openai = served
    chat = openai.chat.completions.create(model=NAME, messages=[{"role": "system", "content": SYSTEM}, *QUESTION],
                                          temperature=0, max_tokens=40)
    want = chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop"

    message = anthropic.messages.create(model=NAME, system=SYSTEM, messages=QUESTION, max_tokens=40,
                                        extra_body=GREEDY)
    assert [block.type for block in message.content] == ["text"] and message.content[0].text == want
    assert message.stop_reason == "end_turn" and message.stop_sequence is None and message.role == "assistant"
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens

    with anthropic.messages.stream(model=NAME, system=[{"type": "text", "text": SYSTEM}], messages=QUESTION,
                                   max_tokens=40, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == want
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == message.usage.output_tokens
    assert final.usage.input_tokens == message.usage.input_tokens

    counted = anthropic.messages.count_tokens(model=NAME, system=SYSTEM, messages=QUESTION)
    prompt = Tokenizer.from_pretrained().apply_chat_template([{"role": "system", "content": SYSTEM}, *QUESTION])
    assert counted.input_tokens == len(prompt) == message.usage.input_tokens


def test_stop_sequences_and_max_tokens_say_why_the_answer_ended(served):
    anthropic, _ = served
    whole = anthropic.messages.create(model=NAME, messages=QUESTION, max_tokens=40, extra_body=GREEDY).content[0].text
    assert "Paris" in whole
    cut = anthropic.messages.create(model=NAME, messages=QUESTION, max_tokens=40, extra_body=GREEDY,
                                    stop_sequences=["Rome", "Paris"])
    assert cut.content[0].text == whole[:whole.index("Paris")]
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == "Paris"
    with anthropic.messages.stream(model=NAME, messages=QUESTION, max_tokens=40, extra_body=GREEDY,
                                   stop_sequences=["Paris"]) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == cut.content[0].text and final.stop_sequence == "Paris"
    short = anthropic.messages.create(model=NAME, messages=QUESTION, max_tokens=3, extra_body=GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    assert whole.startswith(short.content[0].text)


def test_a_last_assistant_message_is_continued(tiny):
    model, tokenizer = tiny
    start = "The answer is"
    question = [{"role": "user", "content": "What is 2 + 2?"}]
    ids = tokenizer.backend.encode(tokenizer.render_chat(question) + start, add_special_tokens=False).ids
    with running(create_app(model, tokenizer, model_name=TINY)) as url:
        r = httpx.post(f"{url}/v1/messages", json=dict(model=TINY, max_tokens=6, temperature=0, messages=[
            *question, {"role": "assistant", "content": [{"type": "text", "text": start}]}]))
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["text"] == expected(model, tokenizer, ids, 6)
    assert r.json()["usage"]["input_tokens"] == len(ids)


def test_top_k_1_or_a_tiny_top_p_samples_the_greedy_answer(tiny):
    model, tokenizer = tiny
    body = dict(model=TINY, max_tokens=8, messages=[{"role": "user", "content": "Hello"}])
    with running(create_app(model, tokenizer, model_name=TINY)) as url, httpx.Client(base_url=url) as client:
        def answer(**sampling):
            return client.post("/v1/messages", json=dict(body, **sampling)).json()["content"][0]["text"]

        greedy = answer(temperature=0)
        assert greedy == expected(model, tokenizer, tokenizer.apply_chat_template(body["messages"]), 8)
        assert answer(temperature=1, top_k=1) == answer(temperature=1, top_p=1e-6) == greedy


def test_errors_are_in_anthropics_shape_and_name_the_field(tiny):
    model, tokenizer = tiny
    user = [{"role": "user", "content": "Hi"}]
    app = create_app(model, tokenizer, model_name=TINY, max_body_bytes=10_000)
    with running(app) as url, httpx.Client(base_url=url) as client:
        for body, status, kind, field in [
            (dict(model=TINY, messages=user), 400, "invalid_request_error", "max_tokens"),
            (dict(model=TINY, messages=user, max_tokens=0), 400, "invalid_request_error", "max_tokens"),
            (dict(model=TINY, messages=[], max_tokens=5), 400, "invalid_request_error", "messages"),
            (dict(model=TINY, messages=[{"role": "system", "content": "x"}], max_tokens=5), 400,
             "invalid_request_error", "messages.0.role"),
            (dict(model=TINY, messages=[{"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "x", "content": "1"}]}], max_tokens=5), 400,
             "invalid_request_error", "messages.0.content.0.type"),
            (dict(model=TINY, messages=user, max_tokens=5, system=[{"type": "image"}]), 400,
             "invalid_request_error", "system.0.type"),
            (dict(model=TINY, messages=user, max_tokens=5, tools=[{"name": "f", "input_schema": {}}]), 400,
             "invalid_request_error", "tools"),
            (dict(model=TINY, messages=user, max_tokens=5, temperature=1.5), 400, "invalid_request_error",
             "temperature"),
            (dict(model=TINY, messages=user, max_tokens=5, stop_sequences=["a"] * 5), 400, "invalid_request_error",
             "stop_sequences"),
            (dict(model=TINY, messages=[{"role": "user", "content": "word " * 600}], max_tokens=5), 400,
             "invalid_request_error", "context window of 512"),
            (dict(model="claude-sonnet-4-5", messages=user, max_tokens=5), 404, "not_found_error", "model"),
        ]:
            r = client.post("/v1/messages", json=body)
            assert r.status_code == status, (body, r.text)
            assert set(r.json()) == {"type", "error"} and r.json()["type"] == "error", r.text
            assert r.json()["error"]["type"] == kind and field in r.json()["error"]["message"], (body, r.text)
        r = client.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = client.post("/v1/messages/count_tokens", json=dict(model=TINY, messages="Hi"))
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages")
        # Too big a body is refused before any route, in OpenAI's shape; other routes keep OpenAI's shape too.
        r = client.post("/v1/messages", json=dict(model=TINY, messages=[{"role": "user", "content": "x" * 20_000}],
                                                  max_tokens=5))
        assert r.status_code == 413 and r.json()["error"]["message"]
        r = client.post("/v1/chat/completions", json=dict(model=TINY, messages=[]))
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert client.get("/health").json()["active"] == 0


def test_the_api_key_as_anthropic_sends_it(tiny):
    from anthropic import Anthropic, AuthenticationError

    model, tokenizer = tiny
    body = dict(model=TINY, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    with running(create_app(model, tokenizer, model_name=TINY, api_key="sesame")) as url, \
            httpx.Client(base_url=url) as client:
        for headers in ({"x-api-key": "sesame"}, {"Authorization": "Bearer sesame"}):
            assert client.post("/v1/messages", json=body, headers=headers).status_code == 200
            assert client.post("/v1/chat/completions", headers=headers, json=dict(
                model=TINY, messages=body["messages"], max_tokens=2)).status_code == 200
        for headers in ({}, {"x-api-key": "nope"}, {"x-api-key": ""}, {"Authorization": "sesame"}):
            r = client.post("/v1/messages", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
        assert Anthropic(base_url=url, api_key="sesame", max_retries=0).messages.create(**body).content
        with pytest.raises(AuthenticationError):
            Anthropic(base_url=url, api_key="nope", max_retries=0).messages.create(**body)


def test_a_failed_stream_ends_with_an_error_event(tiny, monkeypatch):
    model, tokenizer = tiny
    logits = model.logits
    calls = iter(range(10**6))
    # The prompt's logits, then a failing step: the error comes after the stream's first events.
    monkeypatch.setattr(model, "logits", lambda h: logits(h) if next(calls) < 2 else 1 / 0)
    body = dict(model=TINY, messages=[{"role": "user", "content": "Hi"}], max_tokens=20, temperature=0, stream=True)
    with running(create_app(model, tokenizer, model_name=TINY)) as url, httpx.Client(base_url=url) as client:
        with client.stream("POST", "/v1/messages", json=body) as r:
            lines = [line for line in r.iter_lines() if line]
    assert lines[0] == "event: message_start" and lines[-2] == "event: error"
    assert json.loads(lines[-1][6:])["error"]["type"] == "api_error"
