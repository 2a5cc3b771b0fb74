"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the official anthropic client: the
same text as chat completions for the same messages, whole or streamed; stop reasons; a prefilled answer; tools,
tool_use and tool_result as chat completions make and render them; and every error in Anthropic's shape."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from test_server import expected, running
from test_tools import CUT, SCHEMAS, TEXT_THEN_CALLS, TOOLS, scripted

from smollm2 import Tokenizer, load
from smollm2.server import create_app
from smollm2.tools import Tools

NAME = "SmolLM2-135M-Instruct"
TINY = "tiny"
SYSTEM = "You are a geography teacher. Answer in one sentence."
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}  # in the body: the newest anthropic clients take no sampling arguments
# The tools in Anthropic's shape
CUSTOM = [{"name": tool["function"]["name"], "description": tool["function"]["description"],
           "input_schema": tool["function"]["parameters"]} for tool in TOOLS]
WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]
RESULT = '{"sky": "sunny", "celsius": 18}'


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
    return load(tiny_dir), Tokenizer.from_pretrained(tiny_dir)


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


def test_a_tool_use_round_trip(served):
    """tool_choice any with two tools: a tool_use block whose input fits the chosen tool's schema, the call chat
    completions makes; the same from the client's stream helper; the tool_result sent back rendered as the chat
    renders a tool message (counted the same), and answered as chat completions answer it."""
    anthropic, openai = served
    ask = dict(model=NAME, max_tokens=100, tools=CUSTOM, extra_body=GREEDY)
    message = anthropic.messages.create(**ask, messages=WEATHER, tool_choice={"type": "any"})
    assert message.stop_reason == "tool_use" and [block.type for block in message.content] == ["tool_use"]
    use = message.content[0]
    jsonschema.validate(use.input, SCHEMAS[use.name])
    assert use.id.startswith("toolu_")
    chat = openai.chat.completions.create(model=NAME, messages=WEATHER, tools=TOOLS, tool_choice="required",
                                          temperature=0, max_tokens=100).choices[0].message
    assert [(c.function.name, json.loads(c.function.arguments)) for c in chat.tool_calls] == [(use.name, use.input)]
    tools = Tools(TOOLS)
    counted = anthropic.messages.count_tokens(model=NAME, messages=WEATHER, tools=CUSTOM)
    assert counted.input_tokens == message.usage.input_tokens == \
        len(Tokenizer.from_pretrained().apply_chat_template(WEATHER, tools=tools))

    with anthropic.messages.stream(**ask, messages=WEATHER, tool_choice={"type": "any"}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == message.usage.output_tokens
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", use.name, use.input)]

    follow_up = [*WEATHER, {"role": "assistant", "content": [block.model_dump() for block in message.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]}]
    said = [*WEATHER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
            {"role": "tool", "tool_call_id": use.id, "content": RESULT}]
    assert f"<tool_response>\n{RESULT}\n</tool_response>" in Tokenizer.from_pretrained().render_chat(said, tools=tools)
    answer = anthropic.messages.create(**ask, messages=follow_up)
    assert answer.usage.input_tokens == len(Tokenizer.from_pretrained().apply_chat_template(said, tools=tools))
    want = openai.chat.completions.create(model=NAME, messages=said, tools=TOOLS, temperature=0, max_tokens=100)
    assert answer.stop_reason == "end_turn" and [block.type for block in answer.content] == ["text"]
    assert answer.content[0].text == want.choices[0].message.content and answer.content[0].text.strip()


def test_text_then_calls_stream_as_they_come_whole(tiny, monkeypatch):
    """An answer with text before two calls: a text block, then a tool_use block per call, the same from the
    client's stream helper; each block's events close before the next one begins."""
    from anthropic import Anthropic

    model, tokenizer = tiny
    scripted(monkeypatch, model, tokenizer, TEXT_THEN_CALLS)
    with running(create_app(model, tokenizer, model_name=TINY)) as url:
        client = Anthropic(base_url=url, api_key="unused", max_retries=0)
        ask = dict(model=TINY, max_tokens=100, messages=WEATHER, tools=CUSTOM)
        whole = client.messages.create(**ask)
        with client.messages.stream(**ask) as stream:
            final = stream.get_final_message()
        events = list(client.messages.create(**ask, stream=True))
        cut = client.messages.create(**{**ask, "max_tokens": len(tokenizer.encode(CUT))})  # the script's last use
    assert cut.stop_reason == "max_tokens" and [block.type for block in cut.content] == ["text", "tool_use"]
    assert cut.content[1].name == "get_weather" and cut.content[1].input == {}  # its arguments cut short
    for message in (whole, final):
        assert message.stop_reason == "tool_use" and [block.type for block in message.content] == \
            ["text", "tool_use", "tool_use"]
        assert message.content[0].text == "Let me look. "
        assert [(block.name, block.input) for block in message.content[1:]] == [
            ("get_weather", {"city": 'Pa"ris }', "unit": "celsius"}), ("get_time", {"zone": "UTC"})]
    kinds = [(e.type, getattr(e, "index", None)) for e in events if e.type.startswith("content_block_")]
    starts = [i for i, (kind, _) in enumerate(kinds) if kind == "content_block_start"]
    stops = [i for i, (kind, _) in enumerate(kinds) if kind == "content_block_stop"]
    assert [kinds[i][1] for i in starts] == [kinds[i][1] for i in stops] == [0, 1, 2]
    assert all(start < stop < next_start for start, stop, next_start in zip(starts, stops, starts[1:]))
    assert [e.content_block.input for e in events if e.type == "content_block_start"
            and e.content_block.type == "tool_use"] == [{}, {}]


def input_of(arguments: str) -> dict:
    """A chat tool call's arguments as a tool_use block's input: {} for arguments cut short by max_tokens."""
    try:
        return json.loads(arguments)
    except ValueError:
        return {}


def test_tool_blocks_reach_the_model_as_chat_completions_give_them(tiny):
    """The same prompt (counted, also by count_tokens) and answer as chat completions for the same conversation:
    an assistant's text and tool_use blocks as one message, each tool_result a tool message (is_error said),
    ahead of the user's text; tool_choice auto, none, tool and any, and disable_parallel_tool_use."""
    model, tokenizer = tiny
    uses = [{**USE, "id": f"toolu_{i}"} for i in (1, 2)]
    messages = [*WEATHER, {"role": "assistant", "content": [{"type": "text", "text": "Let me see."}, *uses]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "noon"},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "late"}],
                     "is_error": True},
                    {"type": "text", "text": "And now?"}]}]
    calls = [{"id": use["id"], "type": "function", "function": {"name": use["name"],
                                                                "arguments": json.dumps(use["input"])}} for use in uses]
    said = [*WEATHER, {"role": "assistant", "content": "Let me see.", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "noon"},
            {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: late"},
            {"role": "user", "content": "And now?"}]
    named = ({"type": "tool", "name": "get_time"}, {"type": "function", "function": {"name": "get_time"}})
    with running(create_app(model, tokenizer, model_name=TINY)) as url, httpx.Client(base_url=url) as client:
        # (Anthropic's tool_choice, chat completions' tool_choice and parallel_tool_calls)
        for choice, chat_choice, parallel in [(None, "auto", True), ({"type": "none"}, "none", True),
                                              ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
                                              (*named, True)]:
            ask = dict(model=TINY, messages=messages, tools=CUSTOM)
            if choice is not None:
                ask["tool_choice"] = choice
            answer = client.post("/v1/messages", json=dict(**ask, max_tokens=40, temperature=0)).json()
            chat = client.post("/v1/chat/completions", json=dict(
                model=TINY, messages=said, tools=TOOLS, tool_choice=chat_choice, parallel_tool_calls=parallel,
                max_tokens=40, temperature=0)).json()
            assert answer["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"] == \
                client.post("/v1/messages/count_tokens", json=ask).json()["input_tokens"] == \
                len(tokenizer.apply_chat_template(said, tools=Tools(TOOLS, chat_choice)))
            message = chat["choices"][0]["message"]
            calls = [(block["name"], block["input"]) for block in answer["content"] if block["type"] == "tool_use"]
            assert calls == [(c["function"]["name"], input_of(c["function"]["arguments"]))
                             for c in message.get("tool_calls", [])]
            text = [block["text"] for block in answer["content"] if block["type"] == "text"]
            assert text == ([message["content"] or ""] if message["content"] or not calls else [])
            assert answer["stop_reason"] == {"tool_calls": "tool_use", "stop": "end_turn",
                                             "length": "max_tokens"}[chat["choices"][0]["finish_reason"]]
            if not parallel:
                assert len(calls) == 1
            if choice is named[0]:
                assert calls and {name for name, _ in calls} == {"get_time"}


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
             "invalid_request_error", "messages.0.content.0.tool_use_id"),
            (dict(model=TINY, messages=user, max_tokens=5, system=[{"type": "image"}]), 400,
             "invalid_request_error", "system.0.type"),
            (dict(model=TINY, messages=user, max_tokens=5, temperature=1.5), 400, "invalid_request_error",
             "temperature"),
            (dict(model=TINY, messages=user, max_tokens=5, stop_sequences=["a"] * 5), 400, "invalid_request_error",
             "stop_sequences"),
            (dict(model=TINY, messages=[{"role": "user", "content": "word " * 600}], max_tokens=5), 400,
             "invalid_request_error", "messages: the prompt"),
            (dict(model=TINY, messages=user, max_tokens=600), 400, "invalid_request_error",
             "max_tokens (600) exceeds the context window of 512"),
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


USE = {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"zone": "UTC"}}
CALLED = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [USE]}]
BAD_TOOLS = [  # (request fields, the field the error names first)
    (dict(tools=[CUSTOM[0], {"name": "get weather"}]), "tools.1.name"),
    (dict(tools=[{**CUSTOM[0], "input_schema": {"type": "string"}}]), "tools.0.input_schema"),
    (dict(tools=[{**CUSTOM[0], "input_schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}]),
     "tools.0.input_schema"),
    (dict(tools=[{**CUSTOM[0], "description": 5}]), "tools.0.description"),
    (dict(tools=[*CUSTOM, CUSTOM[1]]), "tools.2.name"),
    (dict(tools=[{"type": "bash_20250124", "name": "bash"}]), "tools.0.type"),
    (dict(tools=CUSTOM, tool_choice={"type": "tool", "name": "get_news"}), "tool_choice"),
    (dict(tools=CUSTOM, tool_choice={"type": "tool"}), "tool_choice.name"),
    (dict(tools=CUSTOM, tool_choice={"type": "sometimes"}), "tool_choice.type"),
    (dict(tools=CUSTOM, tool_choice={"type": ["any"]}), "tool_choice.type"),
    (dict(tools=CUSTOM, tool_choice={"type": "any", "disable_parallel_tool_use": "yes"}),
     "tool_choice.disable_parallel_tool_use"),
    (dict(tool_choice={"type": "any"}), "tool_choice"),
    (dict(messages=[*CALLED, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2"}]}]),
     "messages.2.content.0.tool_use_id"),
    (dict(messages=[*CALLED, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": {}}]}]),
     "messages.2.content.0.tool_use_id"),
    (dict(messages=[*CALLED, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "image"}]}]}]),
     "messages.2.content.0.content.0.type"),
    (dict(messages=[*CALLED, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": "no"}]}]), "messages.2.content.0.is_error"),
    (dict(messages=[{"role": "user", "content": [USE]}]), "messages.0.content.0.type"),
    (dict(messages=[*CALLED[:1], {"role": "assistant", "content": [{**USE, "input": "UTC"}]}]),
     "messages.1.content.0.input"),
    (dict(messages=[*CALLED[:1], {"role": "assistant", "content": [{**USE, "id": 5}]}]), "messages.1.content.0.id"),
    (dict(messages=[*CALLED[:1], {"role": "assistant", "content": [{**USE, "name": None}]}]),
     "messages.1.content.0.name"),
    (dict(messages=CALLED), "messages.1.content"),  # a call left unanswered
]


def test_bad_tools_and_tool_blocks_are_errors_naming_the_field(tiny):
    model, tokenizer = tiny
    with running(create_app(model, tokenizer, model_name=TINY)) as url, httpx.Client(base_url=url) as client:
        for fields, field in BAD_TOOLS:
            for route in ("/v1/messages", "/v1/messages/count_tokens"):
                r = client.post(route, json={"model": TINY, "messages": WEATHER, "max_tokens": 5, **fields})
                assert r.status_code == 400 and r.json()["type"] == "error", (fields, r.text)
                assert r.json()["error"]["message"].startswith(f"{field}: "), (fields, r.text)
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
