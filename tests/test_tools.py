"""Tool calls: tools checked, shown to the model in SmolLM2's trained format (or by a template that writes them
itself), answers held to calls that fit the tools' schemas, and read back as OpenAI's tool_calls, streamed or
not; the official openai client, and the example agent, against the server and the embedded model."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import jsonschema
import pytest
import torch
from fastapi.testclient import TestClient

from smollm2 import SmolError, Tokenizer, load
from smollm2.errors import FieldError
from smollm2.generation import generate, stream
from smollm2.generation.grammar import Grammar
from smollm2.server import create_app
from smollm2.tools import ToolCallParser, Tools, parse_tool_calls

from test_server import running

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}, "hours24": {"type": "boolean"}},
                   "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load(tiny_dir), Tokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_pretrained()


def valid_calls(calls) -> list[str]:
    """The names of OpenAI tool calls (dicts or the client's objects), each checked against its tool's schema."""
    names = []
    for call in calls:
        call = call if isinstance(call, dict) else call.model_dump()
        assert call["type"] == "function" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
        names.append(call["function"]["name"])
    return names


# An answer that writes text, then calls both tools, as the grammar allows under "auto"
TEXT_THEN_CALLS = ('Let me look. <tool_call>[{"name": "get_weather", "arguments": {"city": "Pa\\"ris }", '
                   '"unit": "celsius"}}, {"name": "get_time", "arguments": {"zone": "UTC"}}]</tool_call>')
CUT = 'Let me look. <tool_call>[{"name": "get_weather", "arguments": {"city'  # where an answer may be cut short


def scripted(monkeypatch, model, tokenizer, answer: str) -> None:
    """Makes the model answer `answer`, then EOS, to each request in turn, served one at a time: each pass's
    logits favour the answer's next token (a short prompt is one pass, as is each step after it; rows do not
    speculate, whatever the server's default, so a pass is one token)."""
    logits, script, passes = model.logits, [*tokenizer.encode(answer), tokenizer.eos_token_id], iter(range(10**6))

    def forced(h):
        out = torch.full_like(logits(h), -1e4)
        out[..., script[next(passes) % len(script)]] = 0
        return out

    monkeypatch.setattr(model, "logits", forced)
    monkeypatch.setattr("smollm2.generation.engine.new_guesser", lambda *args: None)


ANSWERS = [
    "Just text, no call.",
    'Let me look. <tool_call>[{"name": "get_weather", "arguments": {"city": "Pa\\"ris }", "unit": "celsius", '
    '"n": [1, {"a": "]"}]}}, {"name": "get_time", "arguments": {}}]</tool_call>',
    '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call> and after',
    '<tool_call>[{"arguments": {"zone": "UTC"}, "name": "get_time"}]</tool_call>',
    '<tool_call>[{"name": "get_weather", "arguments": {"city": "Par',  # cut short
    "a <tool_c",
    "<tool_call>[]</tool_call>",
    '<tool_call>[{"name": "get_time"}]</tool_call>',
]


def test_an_answer_read_in_any_pieces_gives_what_it_gives_whole():
    assert parse_tool_calls(ANSWERS[0]) == ("Just text, no call.", [])
    content, calls = parse_tool_calls(ANSWERS[1])
    assert content == "Let me look. "
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": 'Pa"ris }', "unit": "celsius", "n": [1, {"a": "]"}]}), ("get_time", {})]
    assert parse_tool_calls(ANSWERS[2])[0] == " and after"
    assert [(c.name, c.arguments) for c in parse_tool_calls(ANSWERS[3])[1]] == [("get_time", '{"zone": "UTC"}')]
    assert [(c.name, c.arguments) for c in parse_tool_calls(ANSWERS[4])[1]] == [("get_weather", '{"city": "Par')]
    assert parse_tool_calls(ANSWERS[5]) == ("a <tool_c", [])
    assert parse_tool_calls(ANSWERS[6]) == (None, [])
    assert [(c.name, c.arguments) for c in parse_tool_calls(ANSWERS[7])[1]] == [("get_time", "{}")]
    rng = random.Random(0)
    for answer in ANSWERS:
        content, calls = parse_tool_calls(answer)
        for _ in range(30):
            cuts = sorted(rng.sample(range(1, len(answer)), min(6, len(answer) - 1)))
            parser, text, names, arguments = ToolCallParser(), "", {}, {}
            for start, end in zip([0, *cuts], [*cuts, len(answer)]):
                piece, pieces = parser.feed(answer[start:end])
                text += piece
                for p in pieces:
                    assert p.first == (p.index not in names)  # a call's id and name come first, once
                    names.setdefault(p.index, p.call.name)
                    arguments[p.index] = arguments.get(p.index, "") + p.arguments
            text += parser.finish()
            assert (text or None, list(names.values()), list(arguments.values())) == \
                (content, [c.name for c in calls], [c.arguments for c in calls])


BAD = [  # (request fields, the field the error names)
    (dict(tools={"type": "function"}), "tools"),
    (dict(tools=[{"type": "retrieval"}]), "tools.0.type"),
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools.0.function.name"),
    (dict(tools=[{"type": "function", "function": {"name": "get weather"}}]), "tools.0.function.name"),
    (dict(tools=[WEATHER, TIME, WEATHER]), "tools.2.function.name"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
     "tools.0.function.parameters"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}]), "tools.0.function.parameters"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": json.loads('{"items": ' * 40 + "{}" + "}" * 40)}}}}]),
     "tools.0.function.parameters"),
    (dict(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]), "tools"),
    (dict(tools=TOOLS, tool_choice="nope"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_news"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, parallel_tool_calls="yes"), "parallel_tool_calls"),
    (dict(tools=TOOLS, response_format={"type": "json_object"}), "response_format"),
    (dict(messages=[*QUESTION, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]),
     "messages.1.tool_call_id"),
    (dict(messages=[*QUESTION, {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{city"}}]}]),
     "messages.1.tool_calls.0.function.arguments"),
    (dict(messages=[{"role": "user", "content": "hi", "tool_calls": []}]), "messages.0.tool_calls"),
    (dict(messages=[*QUESTION, {"role": "assistant", "content": None, "tool_calls": []}]), "messages.1.content"),
    (dict(messages=[{"role": "tool", "content": "hi"}]), "messages.0.tool_call_id"),
]


def test_malformed_tools_get_400_naming_the_field_and_a_field_error_in_python(tiny):
    model, tokenizer = tiny
    with TestClient(create_app(model, tokenizer, model_name=MODEL)) as client:
        for fields, field in BAD:
            body = {"model": MODEL, "messages": QUESTION, "max_tokens": 4, **fields}
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, (fields, r.text)
            assert r.json()["error"]["param"] == field, (fields, r.json())
            assert r.json()["error"]["message"].startswith(field), r.json()
        assert client.get("/health").json()["status"] == "ok"
    for fields, field in BAD:
        if not isinstance(fields.get("tools", []), list) or "parallel_tool_calls" in fields or \
                "response_format" in fields:
            continue  # the server's body checks them (types), or they are the server's to combine
        with pytest.raises(FieldError) as e:
            tools = Tools(fields.get("tools", []), fields.get("tool_choice"))
            tokenizer.render_chat(fields.get("messages", QUESTION), tools=tools)
        assert e.value.field == field
    with pytest.raises(FieldError, match="response_format: cannot constrain an answer that may call tools"):
        generate(model, [[1, 2]], 2, tokenizer=tokenizer, tools=Tools(TOOLS), response_format={"type": "json_object"})
    # {"type": "text"} constrains nothing, so it goes with tools
    assert torch.equal(generate(model, [[1, 2]], 2, tokenizer=tokenizer, tools=Tools(TOOLS),
                                response_format={"type": "text"}, temperature=0),
                       generate(model, [[1, 2]], 2, tokenizer=tokenizer, tools=Tools(TOOLS), temperature=0))


def test_tools_calls_and_results_in_smollm2s_trained_format(tokenizer):
    tools = Tools(TOOLS)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                            "arguments": '{"city":"Paris","unit":"celsius"}'}}
    chat = [{"role": "system", "content": "Be brief."}, *QUESTION,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 18"}]
    text = tokenizer.render_chat(chat, tools=tools)
    system = text[:text.index("<|im_end|>")]
    listed = system[system.index("<tools>") + len("<tools>"):system.index("</tools>")]
    assert json.loads(listed) == TOOLS
    assert system.endswith("\n\nBe brief.")  # the caller's system message after the tools
    assert ('<|im_start|>assistant\n<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "celsius"}}]</tool_call><|im_end|>\n') in text
    assert text.endswith("<|im_start|>user\n<tool_response>\nsunny, 18\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")
    # tool_choice "none": the model is not shown the tools; the history still shows the calls it made
    hidden = tokenizer.render_chat(chat, tools=Tools(TOOLS, "none"))
    assert "<tools>" not in hidden and hidden == tokenizer.render_chat(chat)
    assert "<tool_response>" in hidden
    # no tools, no tool parts: the template's own rendering, as before
    assert tokenizer.render_chat(QUESTION, tools=Tools(TOOLS, "none")) == tokenizer.render_chat(QUESTION)


def test_a_template_that_writes_tools_gets_them_as_transformers_gives_them(tokenizer):
    template = ("{% if tools %}{{ 'TOOLS ' + tools | tojson + '\\n' }}{% endif %}{% for m in messages %}"
                "{{ m.role }}: {% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} "
                "{{ c.function.arguments | tojson }}{% endfor %}{% else %}{{ m.content }}{% endif %}{{ '\\n' }}"
                "{% endfor %}")
    own = Tokenizer(tokenizer.backend, "own", eos=tokenizer.eos_token, chat_template=template)
    call = {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    chat = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "content": "noon"}]
    assert own.render_chat(chat, tools=Tools(TOOLS)) == (
        f"TOOLS {json.dumps(TOOLS)}\nuser: {QUESTION[0]['content']}\n"
        'assistant: CALL get_time {"zone": "UTC"}\ntool: noon\n')
    assert own.render_chat(chat, tools=Tools(TOOLS, "none")).startswith("user: ")


def accepts(tools: Tools, tokenizer, answer: str) -> bool:
    """Whether the tools' grammar takes the answer's tokens, then EOS."""
    matcher = Grammar.for_answer(tokenizer, tools=tools).matcher()
    try:
        for token in [*tokenizer.encode(answer), tokenizer.eos_token_id]:
            matcher.accept(token)
    except SmolError:
        return False
    return matcher.finished


def test_the_grammar_holds_each_call_to_a_tool_and_its_schema(tokenizer):
    weather = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    time = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
    auto, required = Tools(TOOLS), Tools(TOOLS, "required")
    for tools in (auto, required):
        assert accepts(tools, tokenizer, f"<tool_call>[{weather}]</tool_call>")
        assert accepts(tools, tokenizer, f"<tool_call>[{weather}, {time}]</tool_call>")
        assert not accepts(tools, tokenizer, '<tool_call>[{"name": "get_news", "arguments": {}}]</tool_call>')
        assert not accepts(tools, tokenizer, '<tool_call>[{"name": "get_weather", "arguments": '
                                             '{"city": "Paris", "unit": "kelvin"}}]</tool_call>')
        assert not accepts(tools, tokenizer, '<tool_call>[{"name": "get_time", "arguments": {}}]</tool_call>')
        assert not accepts(tools, tokenizer, f"<tool_call>[{time}]</tool_call> and more text")
        assert not accepts(tools, tokenizer, f"<tool_call>[ {time}]</tool_call>")  # compact JSON, as response_format's
        assert not accepts(tools, tokenizer, '<tool_call>[{"name": "get_time", "arguments": '
                                             '{"zone": "UTC", "extra": 1}}]</tool_call>')  # no property unasked for
    assert accepts(auto, tokenizer, f"Let me see. <tool_call>[{time}]</tool_call>")
    assert accepts(auto, tokenizer, "No call at all.") and accepts(auto, tokenizer, "<tool_call>[]</tool_call>")
    assert not accepts(required, tokenizer, f"Let me see. <tool_call>[{time}]</tool_call>")
    assert not accepts(required, tokenizer, "<tool_call>[]</tool_call>")
    named = Tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, parallel=False)
    assert accepts(named, tokenizer, f"<tool_call>[{time}]</tool_call>")
    assert not accepts(named, tokenizer, f"<tool_call>[{weather}]</tool_call>")
    assert not accepts(named, tokenizer, f"<tool_call>[{time}, {time}]</tool_call>")  # not parallel
    assert Grammar.for_answer(tokenizer, tools=Tools(TOOLS, "none")) is None


def test_an_answer_cut_short_inside_a_call_ends_with_length_streamed_or_not(tiny):
    model, tokenizer = tiny
    body = dict(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=12, temperature=0)
    with TestClient(create_app(model, tokenizer, model_name=MODEL)) as client:
        whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line and line != "data: [DONE]"]
    assert whole["finish_reason"] == "length" and whole["message"]["content"] is None
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    streamed = {}
    for chunk in chunks:
        for call in chunk["choices"][0]["delta"].get("tool_calls", []):
            if call["index"] not in streamed:  # its first piece: id, type and name; then arguments alone
                assert call["id"].startswith("call_") and call["type"] == "function" and call["function"]["name"]
                streamed[call["index"]] = {"name": call["function"]["name"], "arguments": ""}
            else:
                assert call.keys() == {"index", "function"} and call["function"].keys() == {"arguments"}
            streamed[call["index"]]["arguments"] += call["function"]["arguments"]
    assert list(streamed.values()) == [c["function"] for c in whole["message"].get("tool_calls", [])]


def test_tool_calls_with_the_openai_client_on_the_embedded_model(model, tokenizer):
    """tool_choice "required" with two tools: calls that fit the chosen tool's schema, the same streamed (by the
    client's stream helper) or not; the tool's result sent back as <tool_response> and answered; "none": the
    plain answer; a named function: a call to it."""
    from openai import OpenAI

    app = create_app(model, tokenizer, model_name=MODEL, max_batch_size=2, max_seq_len=2048)
    with running(app) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        ask = dict(model=MODEL, messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=100)
        whole = client.chat.completions.create(**ask, tool_choice="required").choices[0]
        assert whole.finish_reason == "tool_calls" and whole.message.content is None
        names = valid_calls(whole.message.tool_calls)
        assert names
        with client.chat.completions.stream(**ask, tool_choice="required") as events:
            streamed = events.get_final_completion().choices[0]
        assert streamed.finish_reason == "tool_calls"
        assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
            [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]

        call = whole.message.tool_calls[0]
        follow_up = [*QUESTION, whole.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny", "celsius": 18}'}]
        prompt = tokenizer.render_chat(follow_up, tools=Tools(TOOLS))
        assert prompt.endswith('<|im_start|>user\n<tool_response>\n{"sky": "sunny", "celsius": 18}\n'
                               "</tool_response><|im_end|>\n<|im_start|>assistant\n")
        answer = client.chat.completions.create(**{**ask, "messages": follow_up})
        assert answer.usage.prompt_tokens == len(tokenizer.apply_chat_template(follow_up, tools=Tools(TOOLS)))
        assert answer.choices[0].message.content or answer.choices[0].message.tool_calls

        plain = client.chat.completions.create(**ask, tool_choice="none").choices[0]
        without = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=100)
        assert plain.message.tool_calls is None and plain.message.content == without.choices[0].message.content
        other = "get_time" if names[0] == "get_weather" else "get_weather"
        named = client.chat.completions.create(**ask, tool_choice={"type": "function", "function": {"name": other}})
        assert valid_calls(named.choices[0].message.tool_calls) and \
            {c.function.name for c in named.choices[0].message.tool_calls} == {other}


def test_stream_in_python_makes_the_calls_the_server_makes(model, tokenizer):
    tools = Tools(TOOLS, "required")
    ids = tokenizer.apply_chat_template(QUESTION, tools=tools)
    text = "".join(steps[0].text for steps in stream(model, [ids], 100, tokenizer=tokenizer, tools=tools,
                                                     temperature=0))
    content, calls = parse_tool_calls(text)
    assert content is None and valid_calls([call.openai() for call in calls])


def test_the_example_agent_calls_both_tools_then_answers(model, tokenizer):
    path = Path(__file__).parents[1] / "examples" / "agent.py"
    spec = importlib.util.spec_from_file_location("agent", path)
    agent = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent)
    from openai import OpenAI

    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in agent.TOOLS}
    app = create_app(model, tokenizer, model_name=MODEL, max_batch_size=2, max_seq_len=2048)
    with running(app) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        answer, calls = agent.agent(client, MODEL, "What is the weather in Paris, in Fahrenheit?")
    assert {name for name, _ in calls} == {"get_weather", "convert_temperature"}
    for name, arguments in calls:
        jsonschema.validate(arguments, schemas[name])
    assert isinstance(answer, str) and answer.strip()
