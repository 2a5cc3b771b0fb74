"""OpenAI's Responses API (/v1/responses) through the official openai client: the same text as chat completions
for the same conversation, whole or streamed (the client's own stream helpers), across turns with
previous_response_id; function tools, their calls and results as chat completions make and render them;
bounded storage, and errors naming the field."""

from __future__ import annotations

import json

import jsonschema
import pytest
from fastapi.testclient import TestClient
from test_server import running
from test_tools import CUT, SCHEMAS, TEXT_THEN_CALLS, TOOLS, scripted

from smollm2 import Tokenizer, load
from smollm2.server import create_app
from smollm2.server import responses as served_responses
from smollm2.tools import Tools

NAME = "SmolLM2-135M-Instruct"
TINY = "tiny"
QUESTION = "What is the capital of France?"
FUNCTIONS = [{"type": "function", **tool["function"]} for tool in TOOLS]  # the Responses API's shape of the tools
WEATHER = "What is the weather like in Paris today?"
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": '{"zone": "UTC"}'}
RESULT = '{"sky": "sunny", "celsius": 18}'


@pytest.fixture(scope="module")
def client(model):
    """The official client against the embedded model, served by uvicorn on a free port."""
    from openai import OpenAI

    with running(create_app(model, Tokenizer.from_pretrained(), model_name=NAME, max_seq_len=1024)) as url:
        yield OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load(tiny_dir), Tokenizer.from_pretrained(tiny_dir)


def chat(client, messages, **extra) -> str:
    answer = client.chat.completions.create(model=NAME, messages=messages, temperature=0, max_tokens=40, **extra)
    assert answer.choices[0].finish_reason == "stop"  # an answer that ended: the same, whole, from each route
    return answer.choices[0].message.content


def test_plain_and_streamed_answers_equal_chat_completions(client):
    want = chat(client, [{"role": "user", "content": QUESTION}])
    answer = client.responses.create(model=NAME, input=QUESTION, temperature=0, max_output_tokens=40)
    assert answer.output_text == want and answer.status == "completed"
    assert answer.output[0].type == "message" and answer.output[0].role == "assistant"
    prompt = Tokenizer.from_pretrained().apply_chat_template([{"role": "user", "content": QUESTION}])
    assert answer.usage.input_tokens == len(prompt)
    assert answer.usage.total_tokens == answer.usage.input_tokens + answer.usage.output_tokens

    with client.responses.stream(model=NAME, input=QUESTION, temperature=0, max_output_tokens=40) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == want
    assert final.usage.output_tokens == answer.usage.output_tokens

    events = list(client.responses.create(model=NAME, input=QUESTION, temperature=0, max_output_tokens=40,
                                          stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert events[-4].text == want and events[-1].response.output_text == want


def test_instructions_and_message_items_are_the_chat_they_describe(client):
    system = "You are a geography teacher. Answer in one sentence."
    want = chat(client, [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}])
    answer = client.responses.create(model=NAME, instructions=system, input=QUESTION, temperature=0,
                                     max_output_tokens=40)
    assert answer.output_text == want and answer.instructions == system
    items = [{"role": "developer", "content": system},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    assert client.responses.create(model=NAME, input=items, temperature=0, max_output_tokens=40).output_text == want


def test_previous_response_id_continues_the_conversation(client):
    first, second = QUESTION, "And of Italy?"
    one = client.responses.create(model=NAME, input=first, temperature=0, max_output_tokens=40)
    two = client.responses.create(model=NAME, input=second, previous_response_id=one.id, temperature=0,
                                  max_output_tokens=40)
    want = chat(client, [{"role": "user", "content": first}, {"role": "assistant", "content": one.output_text},
                         {"role": "user", "content": second}])
    assert two.output_text == want and two.previous_response_id == one.id
    # The same turn streamed; and the earlier answer sent back as an item, as a client keeping its own history does.
    with client.responses.stream(model=NAME, input=second, previous_response_id=one.id, temperature=0,
                                 max_output_tokens=40) as stream:
        assert stream.get_final_response().output_text == want
    items = [{"role": "user", "content": first}, *[item.model_dump() for item in one.output],
             {"role": "user", "content": second}]
    assert client.responses.create(model=NAME, input=items, temperature=0, max_output_tokens=40).output_text == want


def test_a_json_schema_format_answers_as_chat_completions_does(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    question = [{"role": "user", "content": "Name the capital of France as JSON."}]
    want = chat(client, question, response_format={"type": "json_schema",
                                                   "json_schema": {"name": "place", "schema": schema}})
    answer = client.responses.create(model=NAME, input=question, temperature=0, max_output_tokens=40,
                                     text={"format": {"type": "json_schema", "name": "place", "schema": schema}})
    assert answer.output_text == want and set(json.loads(want)) == {"city", "country"}


def test_function_tools_with_the_openai_client(client):
    """tool_choice "required" with two tools: the call chat completions makes, its arguments valid under the chosen
    tool's schema, the same streamed; its result sent back, in the input or after previous_response_id, rendered
    as the chat renders a tool message and answered with text."""
    ask = dict(model=NAME, tools=FUNCTIONS, temperature=0, max_output_tokens=100)
    answer = client.responses.create(**ask, input=WEATHER, tool_choice="required")
    assert answer.status == "completed" and [item.type for item in answer.output] == ["function_call"]
    call = answer.output[0]
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": WEATHER}], tools=TOOLS,
                                          tool_choice="required", temperature=0, max_tokens=100).choices[0].message
    assert [(c.function.name, c.function.arguments) for c in chat.tool_calls] == [(call.name, call.arguments)]
    assert answer.usage.input_tokens == len(Tokenizer.from_pretrained().apply_chat_template(
        [{"role": "user", "content": WEATHER}], tools=Tools(TOOLS)))

    with client.responses.stream(**ask, input=WEATHER, tool_choice="required") as stream:
        final = stream.get_final_response()
    assert [(item.type, item.name, item.arguments) for item in final.output] == [("function_call", call.name,
                                                                                   call.arguments)]
    events = list(client.responses.create(**ask, input=WEATHER, tool_choice="required", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert events[2].item.type == "function_call" and events[2].item.arguments == ""
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    assert "".join(e.delta for e in events[3:-3]) == events[-3].arguments == call.arguments
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert events[-2].item.arguments == call.arguments
    assert events[-1].response.output[0].call_id == events[2].item.call_id

    # The result: the chat's tool message, rendered as <tool_response> (the prompt counted the same); answered.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}
    follow_up = client.responses.create(**ask, input=[{"role": "user", "content": WEATHER}, call.model_dump(),
                                                      result])
    said = [{"role": "user", "content": WEATHER}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": RESULT}]
    prompt = Tokenizer.from_pretrained().render_chat(said, tools=Tools(TOOLS))
    assert f"<tool_response>\n{RESULT}\n</tool_response>" in prompt
    assert follow_up.usage.input_tokens == len(Tokenizer.from_pretrained().apply_chat_template(said,
                                                                                                tools=Tools(TOOLS)))
    assert follow_up.status == "completed" and [item.type for item in follow_up.output] == ["message"]
    assert follow_up.output_text.strip()
    stored = client.responses.create(**ask, input=[result], previous_response_id=answer.id)
    assert stored.output_text == follow_up.output_text
    assert stored.usage.input_tokens == follow_up.usage.input_tokens


def test_text_then_calls_stream_as_they_come_whole(tiny, monkeypatch):
    """An answer with text before two calls: a message item, then a function_call item per call, the same from the
    client's stream helper; the events close each item before the next one begins."""
    from openai import OpenAI

    model, tokenizer = tiny
    scripted(monkeypatch, model, tokenizer, TEXT_THEN_CALLS)
    with running(create_app(model, tokenizer, model_name=TINY)) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        ask = dict(model=TINY, input=WEATHER, tools=FUNCTIONS, max_output_tokens=100)
        whole = client.responses.create(**ask)
        with client.responses.stream(**ask) as stream:
            streamed = stream.get_final_response()
        events = list(client.responses.create(**ask, stream=True))
        cut = client.responses.create(**{**ask, "max_output_tokens": len(tokenizer.encode(CUT))})  # the script's last
    assert cut.status == "incomplete" and [(item.type, item.status) for item in cut.output] == [
        ("message", "completed"), ("function_call", "incomplete")]
    assert cut.output[1].name == "get_weather" and cut.output[1].arguments == '{"city'
    for answer in (whole, streamed, events[-1].response):
        assert [item.type for item in answer.output] == ["message", "function_call", "function_call"]
        assert answer.output_text == "Let me look. " and answer.status == "completed"
        assert [(item.name, json.loads(item.arguments), item.status) for item in answer.output[1:]] == [
            ("get_weather", {"city": 'Pa"ris }', "unit": "celsius"}, "completed"),
            ("get_time", {"zone": "UTC"}, "completed")]
    opened = [e.output_index for e in events if e.type == "response.output_item.added"]
    closed = [e.output_index for e in events if e.type == "response.output_item.done"]
    assert opened == closed == [0, 1, 2]
    kinds = [e.type for e in events]
    assert kinds.index("response.output_item.done") < kinds.index("response.function_call_arguments.delta")
    assert [e.item for e in events if e.type == "response.output_item.done"] == events[-1].response.output
    assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == \
        [item.arguments for item in events[-1].response.output[1:]]


def test_tool_choice_and_items_reach_the_model_as_chat_completions_give_them(tiny):
    """The same prompt (counted) and the same answer as chat completions for the same conversation: an
    assistant's text and calls as one message, results as tool messages; tool_choice none, named, and
    parallel_tool_calls false; the response repeats what the request asked."""
    model, tokenizer = tiny
    results = [{"type": "function_call_output", "call_id": "call_1", "output": "noon"},
               {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "x"}]}]
    items = [{"role": "user", "content": WEATHER}, {"role": "assistant", "content": "Let me see."},
             {**CALL, "call_id": "call_1"}, {**CALL, "call_id": "call_2"}, *results]
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": CALL["name"],
                                                                  "arguments": CALL["arguments"]}} for i in (1, 2)]
    said = [{"role": "user", "content": WEATHER}, {"role": "assistant", "content": "Let me see.", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
            {"role": "tool", "tool_call_id": "call_2", "content": "x"}]
    named = ({"type": "function", "name": "get_time"}, {"type": "function", "function": {"name": "get_time"}})
    with TestClient(create_app(model, tokenizer, model_name=TINY)) as client:
        # (this API's tool_choice, chat completions', parallel_tool_calls)
        for choice, chat_choice, parallel in [("auto", "auto", True), ("none", "none", True),
                                              ("required", "required", False), (*named, False)]:
            answer = client.post("/v1/responses", json=dict(
                model=TINY, input=items, tools=FUNCTIONS, tool_choice=choice, parallel_tool_calls=parallel,
                max_output_tokens=40, temperature=0)).json()
            chat = client.post("/v1/chat/completions", json=dict(
                model=TINY, messages=said, tools=TOOLS, tool_choice=chat_choice, parallel_tool_calls=parallel,
                max_tokens=40, temperature=0)).json()
            assert answer["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"] == len(
                tokenizer.apply_chat_template(said, tools=Tools(TOOLS, chat_choice)))
            message = chat["choices"][0]["message"]
            calls = [(item["name"], item["arguments"]) for item in answer["output"] if item["type"] == "function_call"]
            assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
            text = [item["content"][0]["text"] for item in answer["output"] if item["type"] == "message"]
            assert text == ([message["content"] or ""] if message["content"] or not calls else [])
            assert (answer["tools"], answer["tool_choice"], answer["parallel_tool_calls"]) == (FUNCTIONS, choice,
                                                                                                parallel)
            if not parallel:  # "required" or the named function: one call
                assert len(calls) == 1
            if choice is named[0]:
                assert {name for name, _ in calls} == {"get_time"}


def test_a_tiny_top_p_samples_the_greedy_answer(tiny):
    model, tokenizer = tiny
    with TestClient(create_app(model, tokenizer, model_name=TINY)) as client:
        def answer(**sampling):
            r = client.post("/v1/responses", json=dict(model=TINY, input="Hello", max_output_tokens=8, **sampling))
            return r.json()["output"][0]["content"][0]["text"]

        assert answer(temperature=1, top_p=1e-6) == answer(temperature=0)


def test_a_cut_answer_is_incomplete_whole_or_streamed(tiny):
    model, tokenizer = tiny
    body = dict(model=TINY, input="Hello", max_output_tokens=3, temperature=0)
    with TestClient(create_app(model, tokenizer, model_name=TINY)) as client:
        answer = client.post("/v1/responses", json=body).json()
        assert answer["status"] == "incomplete" and answer["incomplete_details"] == {"reason": "max_output_tokens"}
        assert answer["output"][0]["status"] == "incomplete" and answer["usage"]["output_tokens"] == 3
        with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        last = json.loads(lines[-1][6:])
        assert last["type"] == "response.incomplete" and last["response"]["status"] == "incomplete"
        assert last["response"]["output"][0]["content"] == answer["output"][0]["content"]


def test_instructions_are_not_carried_to_the_next_turn(tiny):
    """As OpenAI: a stored conversation keeps the input and the answer, not the instructions."""
    model, tokenizer = tiny
    with TestClient(create_app(model, tokenizer, model_name=TINY)) as client:
        def respond(**body):
            return client.post("/v1/responses", json=dict(model=TINY, max_output_tokens=5, temperature=0,
                                                          **body)).json()

        def chat(messages):
            return client.post("/v1/chat/completions", json=dict(model=TINY, messages=messages, max_tokens=5,
                                                                 temperature=0)).json()["choices"][0]["message"]

        one = respond(input="Hello", instructions="Answer in French.")
        assert one["output"][0]["content"][0]["text"] == chat([{"role": "system", "content": "Answer in French."},
                                                              {"role": "user", "content": "Hello"}])["content"]
        two = respond(input="Why?", previous_response_id=one["id"])
        said = one["output"][0]["content"][0]["text"]
        assert two["output"][0]["content"][0]["text"] == chat([{"role": "user", "content": "Hello"},
                                                              {"role": "assistant", "content": said},
                                                              {"role": "user", "content": "Why?"}])["content"]


def test_stored_conversations_are_bounded_least_recently_used_first(tiny, monkeypatch):
    model, tokenizer = tiny
    assert served_responses.MAX_STORED == 256
    monkeypatch.setattr(served_responses, "MAX_STORED", 2)
    with TestClient(create_app(model, tokenizer, model_name=TINY)) as client:
        def ask(**extra):
            r = client.post("/v1/responses", json=dict(model=TINY, input="Hi", max_output_tokens=2, **extra))
            return r.json()["id"] if r.status_code == 200 else r.json()["error"]

        first, second = ask(), ask()
        ask(previous_response_id=first, store=False)  # first used again, this answer not stored: second is now
        # the least recently used
        third = ask()
        for gone in (second, "resp_unknown"):
            error = ask(previous_response_id=gone)
            assert error["param"] == "previous_response_id" and error["code"] == "previous_response_not_found"
        for kept in (first, third):
            assert isinstance(ask(previous_response_id=kept, store=False), str)


def test_bad_requests_get_400_naming_the_field(tiny):
    model, tokenizer = tiny
    with TestClient(create_app(model, tokenizer, model_name=TINY)) as client:
        for extra, field in [
            (dict(input=5), "input"),
            (dict(input=[]), "input"),
            (dict(input=["Hi"]), "input.0"),
            (dict(input=[{"role": "tool", "content": "x"}]), "input.0.role"),
            (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
             "input.0.content.0.type"),
            (dict(input=[{"role": "user", "content": "Hi"}, {"type": "reasoning", "summary": []}]), "input.1.type"),
            (dict(input=[{"role": "user", "content": "Hi"}, {"type": "function_call_output", "output": "1"}]),
             "input.1.call_id"),
            (dict(input=[{"role": "user", "content": "Hi"}, {**CALL, "call_id": "call_1"},
                         {"type": "function_call_output", "call_id": "call_2", "output": "1"}]), "input.2.call_id"),
            (dict(input=[{"role": "user", "content": "Hi"}, {**CALL, "arguments": "{city"}]), "input.1.arguments"),
            (dict(input=[{"role": "user", "content": "Hi"}, {**CALL, "name": 5}]), "input.1.name"),
            (dict(input=[{"role": "user", "content": "Hi"}, {**CALL, "call_id": ""}]), "input.1.call_id"),
            (dict(input=[{"role": "user", "content": "Hi"}, {"type": "function_call_output", "call_id": [1]}]),
             "input.1.call_id"),
            (dict(input=[{"role": ["user"], "content": "Hi"}]), "input.0.role"),
            (dict(input=[{"role": "user", "content": "Hi"}, CALL,
                         {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_image"}]}]),
             "input.2.output.0.type"),
            (dict(input="Hi", tools=[FUNCTIONS[0], {"type": "function", "name": "get weather"}]), "tools.1.name"),
            (dict(input="Hi", tools=[{**FUNCTIONS[0], "parameters": {"type": "string"}}]), "tools.0.parameters"),
            (dict(input="Hi", tools=[{**FUNCTIONS[0], "description": 5}]), "tools.0.description"),
            (dict(input="Hi", tools=[{**FUNCTIONS[0], "strict": "yes"}]), "tools.0.strict"),
            (dict(input="Hi", tools=[*FUNCTIONS, FUNCTIONS[0]]), "tools.2.name"),
            (dict(input="Hi", tools=[{"type": "web_search"}]), "tools.0.type"),
            (dict(input="Hi", tools=FUNCTIONS, tool_choice={"type": "function", "name": "get_news"}), "tool_choice"),
            (dict(input="Hi", tools=FUNCTIONS, tool_choice={"type": "file_search"}), "tool_choice"),
            (dict(input="Hi", tools=FUNCTIONS, tool_choice="sometimes"), "tool_choice"),
            (dict(input="Hi", tool_choice="required"), "tool_choice"),
            (dict(input="Hi", tools=FUNCTIONS, parallel_tool_calls="no"), "parallel_tool_calls"),
            (dict(input="Hi", tools=FUNCTIONS, text={"format": {"type": "json_object"}}), "text.format"),
            (dict(input="Hi", text={"format": {"type": "json_schema"}}), "text.format"),
            (dict(input="Hi", max_output_tokens=0), "max_output_tokens"),
            (dict(input="Hi", temperature="hot"), "temperature"),
            (dict(input="\ud800"), "input"),
            (dict(input="word " * 600), "input"),  # beyond the context window of 512
            (dict(input="Hi", max_output_tokens=600), "max_output_tokens"),
        ]:
            r = client.post("/v1/responses", content=json.dumps(dict(model=TINY, **extra)),
                            headers={"content-type": "application/json"})
            assert r.status_code == 400, (extra, r.text)
            error = r.json()["error"]
            assert error["param"] == field and error["message"], (extra, error)
        r = client.post("/v1/responses", json=dict(model="gpt-5", input="Hi"))
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert client.get("/health").json()["active"] == 0
