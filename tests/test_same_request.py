"""One request, one answer: the same prompt, sampling, seed, stop string and max tokens give the same token ids and
the same text through generate/stream in Python, the `smollm2 generate` and `smollm2 chat` commands (their
--logprobs lines name each token's id), and the server (its log-probabilities name each token: by its bytes in
a chat, by its text in a completion), streamed or not, alone or among 15 other requests decoded in the same
batch; and the same chat through the Responses and Messages APIs (which name no token: the same text, as many
tokens, the same end), as far as each API's fields reach: greedy, and Messages' stop sequences."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from test_server import events, running

from smollm2 import Tokenizer, cli
from smollm2.generation import generate, stream
from smollm2.server import create_app, scheduler

NAME = "SmolLM2-135M-Instruct"
MAX_TOKENS = 12
SAMPLINGS = {"greedy": dict(temperature=0.0), "seeded": dict(temperature=0.8, top_p=0.9, seed=1234)}
COMPLETION = "Once upon a time, in a land far away,"  # sent raw: `smollm2 generate`, /v1/completions
QUESTION = "Write a short poem about the sea."  # sent as a chat: `smollm2 chat -p`, /v1/chat/completions


@dataclass
class Request:
    chat: bool
    prompt: str  # the raw prompt, or the question of a chat
    sampling: dict
    stop: str = ""

    def ids(self, tokenizer) -> list[int]:
        """The prompt as the model sees it: a chat's is the chat template applied to the question."""
        if self.chat:
            return tokenizer.apply_chat_template([{"role": "user", "content": self.prompt}])
        return tokenizer.encode(self.prompt)

    def body(self, streamed: bool, others: bool = False) -> dict:
        """others: one of the requests beside ours, which need no log-probabilities."""
        if self.chat:
            prompt = dict(messages=[{"role": "user", "content": self.prompt}], logprobs=not others)
        else:
            prompt = dict(prompt=self.prompt, logprobs=None if others else 0)
        return dict(model=NAME, max_tokens=MAX_TOKENS, stop=[self.stop], stream=streamed, **self.sampling, **prompt,
                    stream_options=dict(include_usage=True) if streamed else None)


@dataclass
class Answer:
    text: str
    tokens: list[int]  # the ids of the tokens generated
    finish_reason: str


def in_python(model, tokenizer, request: Request) -> Answer:
    stop = [request.stop] if request.stop else []
    steps = [step for (step,) in stream(model, [request.ids(tokenizer)], MAX_TOKENS, stop=stop, tokenizer=tokenizer,
                                        **request.sampling)]
    return Answer("".join(step.text for step in steps), [step.token for step in steps], steps[-1].finish_reason)


class TokenNames:
    """Token ids back from the names the server's log-probabilities give them: a chat's bytes, a completion's
    text. Only a name one token has counts (a piece of a character, shown as U+FFFD, has none)."""

    def __init__(self, tokenizer):
        by_bytes, by_text = {}, {}
        for i in range(tokenizer.vocab_size):
            by_bytes.setdefault(tokenizer.token_bytes(i), []).append(i)
            by_text.setdefault(tokenizer.token_text(i), []).append(i)
        self.by_bytes, self.by_text = by_bytes, by_text

    def ids(self, names: list, table: dict) -> list[int]:
        found = [table.get(name, []) for name in names]
        assert all(len(ids) == 1 for ids in found), [name for name, ids in zip(names, found) if len(ids) != 1]
        return [ids[0] for ids in found]

    def chat(self, content: list[dict]) -> list[int]:
        return self.ids([bytes(entry["bytes"]) for entry in content], self.by_bytes)

    def completion(self, logprobs: dict) -> list[int]:
        return self.ids(logprobs["tokens"], self.by_text)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_pretrained()


@pytest.fixture(scope="module")
def requests(model, tokenizer) -> dict[str, tuple[Request, Answer]]:
    """A raw completion and a chat, each greedy and seeded, with a stop string taken from the middle of the
    answer without one, so that it does cut the answer; with that answer."""
    cases = {}
    for chat, prompt in ((False, COMPLETION), (True, QUESTION)):
        for name, sampling in SAMPLINGS.items():
            request = Request(chat, prompt, sampling)
            whole = in_python(model, tokenizer, request)
            request.stop = whole.text[len(whole.text) // 2:len(whole.text) // 2 + 3]
            cases[f"{'chat' if chat else 'completion'}, {name}"] = request, whole
    return cases


@pytest.fixture(scope="module")
def answers(model, tokenizer, requests) -> dict[str, Answer]:
    """Each request's answer from stream(), the one every other way must give."""
    return {name: in_python(model, tokenizer, request) for name, (request, _) in requests.items()}


@pytest.fixture(scope="module")
def names(tokenizer) -> TokenNames:
    return TokenNames(tokenizer)


def test_python_ends_the_answer_before_the_stop_string(model, tokenizer, requests, answers):
    for name, (request, whole) in requests.items():
        cut = answers[name]
        assert request.stop in whole.text and cut.text == whole.text[:whole.text.find(request.stop)], name
        assert cut.finish_reason == "stop", name
        # The same draws as without the stop string, up to the token that completed it; generate() agrees.
        assert cut.tokens == whole.tokens[:len(cut.tokens)], name
        ids = request.ids(tokenizer)
        generated = generate(model, [ids], MAX_TOKENS, stop=[request.stop], tokenizer=tokenizer, **request.sampling)
        assert generated[0, len(ids):].tolist() == cut.tokens, name


def test_the_commands_print_the_same_tokens(model, tokenizer, requests, answers, monkeypatch, capsys):
    monkeypatch.setattr(cli, "load", lambda args: (model, tokenizer))  # the model is loaded once, by the fixture
    for name, (request, _) in requests.items():
        command = ["chat", "-p", request.prompt] if request.chat else ["generate", request.prompt]
        flags = [f"--{key.replace('_', '-')}={value}" for key, value in request.sampling.items()]
        assert cli.main([*command, f"--max-new-tokens={MAX_TOKENS}", f"--stop={request.stop}", "--logprobs=0",
                         *flags]) == 0
        expected = answers[name]
        out = capsys.readouterr().out.splitlines(keepends=True)
        text, lines = "".join(out[:-len(expected.tokens)]), out[-len(expected.tokens):]  # then a line a token
        assert text == expected.text + "\n", name
        assert [int(line.split("\t")[0]) for line in lines] == expected.tokens, name


def ask(client: httpx.Client, request: Request, streamed: bool, names: TokenNames | None) -> Answer:
    """The server's answer; names: None for a request beside ours, whose tokens are not asked for."""
    path = "/v1/chat/completions" if request.chat else "/v1/completions"
    if not streamed:
        r = client.post(path, json=request.body(streamed, others=names is None))
        assert r.status_code == 200, r.text
        choices, usage = r.json()["choices"], r.json()["usage"]
        text = choices[0]["message"]["content"] if request.chat else choices[0]["text"]
    else:
        with client.stream("POST", path, json=request.body(streamed, others=names is None)) as r:
            assert r.status_code == 200
            chunks = events(r)
        choices, usage = [c["choices"][0] for c in chunks[:-1]], chunks[-1]["usage"]
        text = "".join(c["delta"].get("content", "") if request.chat else c["text"] for c in choices)
    tokens = None
    if names is not None:
        pieces = [c["logprobs"] for c in choices if c["logprobs"]]
        tokens = ([i for p in pieces for i in names.chat(p["content"])] if request.chat
                  else [i for p in pieces for i in names.completion(p)])
        assert len(tokens) == usage["completion_tokens"]
    return Answer(text, tokens, choices[-1]["finish_reason"])


def test_the_server_answers_the_same_alone(model, tokenizer, requests, answers, names):
    with running(create_app(model, tokenizer, model_name=NAME, max_seq_len=256)) as url, \
            httpx.Client(base_url=url, timeout=120) as client:
        for name, (request, _) in requests.items():
            for streamed in (False, True):
                assert ask(client, request, streamed, names) == answers[name], (name, streamed)


def test_the_server_answers_the_same_among_15_others(model, tokenizer, requests, answers, names, monkeypatch):
    """The first request to arrive is held in its prefill until the other 15 wait, so that all 16 decode in
    one batch; the 12 besides ours have other prompts, seeds and stop strings."""
    others = [Request(chat=i % 2 == 0,
                      prompt=f"Tell me about the number {i}." if i % 2 == 0 else f"My lucky number is {i}, because",
                      sampling=dict(temperature=0.8, top_p=0.9, seed=i) if i % 3 else dict(temperature=0.0),
                      stop=f"\n{i}.") for i in range(12)]
    gate, rows = threading.Event(), []
    logits, decode_step = model.logits, scheduler.decode_step
    monkeypatch.setattr(model, "logits", lambda h: (gate.wait(60), logits(h))[1])
    monkeypatch.setattr(scheduler, "decode_step", lambda model, ids, *rest: (rows.append(len(ids)),
                                                                           decode_step(model, ids, *rest))[1])
    # no speculation: every pass is a decoding step, counted in rows
    app = create_app(model, tokenizer, model_name=NAME, max_batch_size=16, max_seq_len=256, speculative=None)
    with running(app) as url, httpx.Client(base_url=url, timeout=120) as client, ThreadPoolExecutor(16) as pool:
        for streamed in (False, True):
            gate.clear()
            ours = [request for request, _ in requests.values()]
            futures = [pool.submit(ask, client, request, streamed, names) for request in ours]
            futures += [pool.submit(ask, client, request, streamed, None) for request in others]
            # held in its prefill, the first to arrive (or the first few, arrived before the engine's step: one
            # prefill pass), the rest waiting
            deadline = time.time() + 60
            while (load := client.get("/health").json())["active"] < 1 or load["active"] + load["waiting"] != 16:
                assert time.time() < deadline, load
                time.sleep(0.02)
            gate.set()
            got = [future.result() for future in futures]
            for (name, answer), served in zip(answers.items(), got):
                assert served == answer, (name, streamed)
            assert max(rows) == 16
            rows.clear()


def ask_other(client: httpx.Client, api: str, request: Request, streamed: bool) -> tuple[str, int, str]:
    """A greedy chat's text, its token count and its finish_reason (as chat completions name it) through
    /v1/responses (which takes no stop string) or /v1/messages."""
    message = {"role": "user", "content": request.prompt}
    if api == "responses":
        body = dict(model=NAME, input=[message], max_output_tokens=MAX_TOKENS, temperature=0.0, stream=streamed)
    else:
        body = dict(model=NAME, messages=[message], max_tokens=MAX_TOKENS, stop_sequences=[request.stop],
                    temperature=0.0, stream=streamed)
    if not streamed:
        r = client.post(f"/v1/{api}", json=body)
        assert r.status_code == 200, r.text
        answer = r.json()
    else:
        with client.stream("POST", f"/v1/{api}", json=body) as r:
            assert r.status_code == 200
            sent = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        last = sent[-1]
        if api == "responses":
            answer = last["response"]
            text = "".join(event["delta"] for event in sent if event["type"] == "response.output_text.delta")
            assert text == answer["output"][0]["content"][0]["text"]
        else:
            text = "".join(event["delta"]["text"] for event in sent if event["type"] == "content_block_delta")
            (end,) = [event for event in sent if event["type"] == "message_delta"]
            answer = dict(content=[dict(type="text", text=text)], usage=end["usage"], **end["delta"])
    if api == "responses":
        reason = {"completed": "stop", "incomplete": "length"}[answer["status"]]
        return answer["output"][0]["content"][0]["text"], answer["usage"]["output_tokens"], reason
    reason = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length"}[answer["stop_reason"]]
    return answer["content"][0]["text"], answer["usage"]["output_tokens"], reason


def test_responses_and_messages_answer_a_greedy_chat_as_python_does(model, tokenizer, requests, answers):
    """Responses without a stop string (it has none): the whole answer; Messages with it: the answer cut."""
    request, whole = requests["chat, greedy"]
    cut = answers["chat, greedy"]
    with running(create_app(model, tokenizer, model_name=NAME, max_seq_len=256)) as url, \
            httpx.Client(base_url=url, timeout=120) as client:
        for streamed in (False, True):
            got = ask_other(client, "responses", request, streamed)
            assert got == (whole.text, len(whole.tokens), whole.finish_reason), streamed
            got = ask_other(client, "messages", request, streamed)
            assert got == (cut.text, len(cut.tokens), cut.finish_reason), streamed
