"""Sampling controls: OpenAI's logit_bias and presence and frequency penalties, stop token ids and min_tokens,
and guided choice and regex, the same in Python, the server and the command line."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from conftest import TINY, hf_copy, tiny_model
from fastapi.testclient import TestClient
from test_server import expected, running

from smollm2 import SmolError, Tokenizer, load
from smollm2.cli import main
from smollm2.generation import generate, stream
from smollm2.server import create_app

NAME = "tiny"


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(TINY["gqa"])


@pytest.fixture(scope="module")
def served(tiny_dir):
    """A tiny random model with the real tokenizer."""
    return load(tiny_dir), Tokenizer.from_pretrained(tiny_dir)


def openai_reference(hf, prompt: list[int], n: int, presence: float = 0.0, frequency: float = 0.0,
                     bias: dict[int, float] | None = None, repetition: float = 1.0) -> list[int]:
    """Greedy tokens from transformers' logits as OpenAI defines the penalties: logit[j] - count[j] * frequency -
    (count[j] > 0) * presence + bias[j], counts over the tokens generated so far; then transformers' repetition
    penalty over the prompt and those tokens."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
            generated = ids[len(prompt):]
            for j in set(generated):
                logits[j] -= generated.count(j) * frequency + presence
            for j, b in (bias or {}).items():
                logits[j] += b
            logits = RepetitionPenaltyLogitsProcessor(repetition)(torch.tensor([ids]), logits[None])[0]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("params", [
    dict(presence_penalty=1.5), dict(frequency_penalty=0.7), dict(frequency_penalty=-0.5, presence_penalty=2.0),
    dict(presence_penalty=0.5, frequency_penalty=1.0, logit_bias={5: 3.0, 17: -100, 300: 2.5}),
    dict(frequency_penalty=0.5, repetition_penalty=1.3),  # the order: OpenAI's additions, then repetition
])
def test_penalties_give_the_tokens_of_openai_s_formula_on_transformers_logits(tiny, params):
    prompt = [3, 141, 59, 26, 535]
    ours = generate(tiny, [prompt], 20, eos_token_id=None, **params)[0, len(prompt):].tolist()
    theirs = openai_reference(hf_copy(tiny), prompt, 20, params.get("presence_penalty", 0.0),
                              params.get("frequency_penalty", 0.0), params.get("logit_bias"),
                              params.get("repetition_penalty", 1.0))
    assert ours == theirs
    assert ours != generate(tiny, [prompt], 20, eos_token_id=None)[0, len(prompt):].tolist()  # they change it


def test_logit_bias_bans_and_forces_tokens_greedy_or_sampled(tiny):
    prompt = [7, 99, 1024]
    first = generate(tiny, [prompt], 1, eos_token_id=None)[0, -1].item()
    for sampling in ({}, dict(temperature=1.0, seed=3)):
        banned = generate(tiny, [prompt], 12, eos_token_id=None, logit_bias={first: -100}, **sampling)[0, 3:]
        assert first not in banned.tolist()
        forced = generate(tiny, [prompt], 12, eos_token_id=None, logit_bias={first: -100, 321: 100}, **sampling)
        assert forced[0, 3:].tolist() == [321] * 12


def test_log_probabilities_stay_those_of_the_raw_logits(tiny):
    prompt = [7, 99, 1024]
    (step,), = stream(tiny, [prompt], 1, eos_token_id=None, logprobs=2, logit_bias={321: 100}, presence_penalty=1)
    with torch.inference_mode():
        raw = torch.log_softmax(tiny.logits(tiny.hidden_states(torch.tensor([prompt])))[0, -1].float(), -1)
    assert step.token == 321 and raw[321] < -1  # forced, though unlikely
    assert step.logprob.logprob == pytest.approx(raw[321].item(), abs=1e-4)
    assert [t for t, _ in step.logprob.top] == raw.topk(2).indices.tolist()


def test_batch_rows_with_penalties_equal_rows_alone(tiny):
    prompts = [[5, 6, 7, 8, 9, 10], [11], [400, 30, 2]]
    params = dict(presence_penalty=0.8, frequency_penalty=0.4, logit_bias={12: 1.0}, temperature=0.9, seed=5)
    batch = generate(tiny, prompts, 15, eos_token_id=None, **params)
    for b, prompt in enumerate(prompts):
        assert batch[b, -15:].tolist() == generate(tiny, [prompt], 15, eos_token_id=None, **params)[0, -15:].tolist()


def test_speculation_keeps_the_tokens_of_each_control(tiny):
    """A speculating row takes its guessed positions one sampling call each, with its counts, bans and bias as
    they stand there: the tokens of decoding without it."""
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 9, 10, 9]]
    for params in (dict(presence_penalty=0.5, frequency_penalty=0.3, logit_bias={7: 2.0}),
                   dict(frequency_penalty=-1.0, temperature=0.9, seed=1),
                   dict(logit_bias={8: 5.0}, stop=[8], min_new_tokens=6)):
        plain = generate(tiny, prompts, 24, eos_token_id=None, **params)
        assert generate(tiny, prompts, 24, eos_token_id=None, speculative="ngram", **params).tolist() == plain.tolist()


def test_stop_token_ids_end_a_row_as_eos_does(served):
    model, tokenizer = served
    ids = tokenizer.encode("Once upon a time")
    sampling = dict(eos_token_id=None, tokenizer=tokenizer, temperature=1.0, seed=0)  # greedy, it repeats itself
    free = [step for (step,) in stream(model, [ids], 12, **sampling)]
    k = next(i for i in range(1, 12) if free[i].token not in [s.token for s in free[:i]])
    steps = [step for (step,) in stream(model, [ids], 12, stop=[free[k].token], **sampling)]
    assert [s.token for s in steps] == [s.token for s in free[:k + 1]] and steps[-1].finish_reason == "stop"
    assert "".join(s.text for s in steps) == tokenizer.decode([s.token for s in free[:k]])  # not its text
    for bad in ([-1], [model.config.vocab_size], [1.5], [True]):
        with pytest.raises(SmolError, match="token ids in"):
            generate(model, [ids], 3, stop=bad)


def test_min_new_tokens_bans_eos_and_stop_tokens_and_lets_stop_strings_pass(served):
    model, tokenizer = served
    a = tokenizer.encode("a")[0]
    ids = tokenizer.encode("Say a")
    # +100 makes "a" the only choice where it is allowed: without min_new_tokens it ends the answer at once.
    forced = dict(eos_token_id=None, tokenizer=tokenizer, logit_bias={a: 100})
    assert [s.token for (s,) in stream(model, [ids], 10, stop=[a], **forced)] == [a]
    steps = [s for (s,) in stream(model, [ids], 10, stop=[a], min_new_tokens=4, **forced)]
    assert len(steps) == 5 and a not in [s.token for s in steps[:4]] and steps[-1].token == a
    assert steps[-1].finish_reason == "stop"
    eos = model.config.eos_token_ids[0]
    steps = [s for (s,) in stream(model, [ids], 10, tokenizer=tokenizer, logit_bias={eos: 100}, min_new_tokens=3)]
    assert len(steps) == 4 and steps[-1].token == eos and eos not in [s.token for s in steps[:3]]
    # The stop string "a" completes at every token; it counts from the third on, and the text ends before it.
    steps = [s for (s,) in stream(model, [ids], 10, stop=["a"], min_new_tokens=3, **forced)]
    assert len(steps) == 3 and "".join(s.text for s in steps) == "aa" and steps[-1].finish_reason == "stop"
    with pytest.raises(SmolError, match="exceeds max_new_tokens"):
        generate(model, [ids], 3, min_new_tokens=4)
    with pytest.raises(SmolError, match="min_new_tokens cannot be combined with response_format"):
        generate(model, [ids], 3, min_new_tokens=2, tokenizer=tokenizer, response_format={"type": "json_object"})


@pytest.mark.parametrize("kwargs, message", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"), ({"logit_bias": {5: 101}}, "logit_bias"),
    ({"logit_bias": {-1: 1}}, "logit_bias"), ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"logit_bias": [(5, 1)]}, "logit_bias"), ({"logit_bias": {999_999: 1}}, "logit_bias: 999999 is not a token id"),
    ({"min_new_tokens": -1}, "min_new_tokens"), ({"min_new_tokens": 1.5}, "min_new_tokens"),
])
def test_bad_sampling_controls(tiny, kwargs, message):
    with pytest.raises(SmolError, match=message):
        generate(tiny, [1, 2], 3, **kwargs)


def test_guided_choice_and_regex(served):
    model, tokenizer = served
    ids = tokenizer.encode("Pick one:")
    for params in ({}, dict(temperature=1.0, seed=4)):
        choices = ["red", "green", "blue sky", 'say "hi"']
        new = generate(model, [ids], 12, tokenizer=tokenizer, response_format={"type": "choice", "choices": choices},
                       **params)[0, len(ids):].tolist()
        assert tokenizer.decode(new[:new.index(tokenizer.eos_token_id)]) in choices
        pattern = r"[0-9]{3}-[a-z]{2,4}\.(com|org)"
        steps = [s for (s,) in stream(model, [ids], 20, tokenizer=tokenizer,
                                      response_format={"type": "regex", "pattern": pattern}, **params)]
        assert steps[-1].finish_reason == "stop" and re.fullmatch(pattern, "".join(s.text for s in steps))


@pytest.mark.parametrize("response_format, message", [
    ({"type": "regex", "pattern": "(unclosed"}, 'response_format regex: invalid regex "(unclosed"'),
    ({"type": "regex", "pattern": r"\bword"}, "lookarounds not supported"),
    ({"type": "regex", "pattern": "a" * 257}, "1 to 256 characters"),
    ({"type": "regex", "pattern": 5}, "needs"),
    ({"type": "choice", "choices": []}, "non-empty strings"),
    ({"type": "choice", "choices": ["a", ""]}, "non-empty strings"),
    ({"type": "choice", "choices": "ab"}, "non-empty strings"),
    ({"type": "choice", "choices": ["x"] * 1025}, "more than 1024"),
    ({"type": "choice", "choices": ["x" * 20_000, "y" * 20_000]}, "characters, more than"),
])
def test_bad_choices_and_patterns(served, response_format, message):
    model, tokenizer = served
    with pytest.raises(SmolError, match=re.escape(message)):
        generate(model, [[1, 2]], 3, tokenizer=tokenizer, response_format=response_format)


def test_the_server_applies_the_controls_as_python_does(served):
    """The official client sends logit_bias with string keys; vLLM's stop_token_ids and min_tokens ride along."""
    from openai import OpenAI

    model, tokenizer = served
    ids = tokenizer.encode("Hello there")
    first = generate(model, [ids], 1, eos_token_id=None)[0, -1].item()
    cat = tokenizer.encode(" cat")[0]
    with running(create_app(model, tokenizer, model_name=NAME)) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

        def complete(**extra):
            return client.completions.create(model=NAME, prompt="Hello there", max_tokens=8, temperature=0, **extra)

        plain = complete().choices[0].text
        banned = complete(logit_bias={str(first): -100}).choices[0].text
        assert banned == expected(model, tokenizer, ids, 8, logit_bias={first: -100}) != plain
        assert complete(logit_bias={str(cat): 100}).choices[0].text == " cat" * 8
        penalized = complete(presence_penalty=1.5, frequency_penalty=0.5).choices[0].text
        assert penalized == expected(model, tokenizer, ids, 8, presence_penalty=1.5, frequency_penalty=0.5)
        answer = complete(logit_bias={str(cat): 100}, extra_body=dict(stop_token_ids=[cat], min_tokens=3))
        steps = [s for (s,) in stream(model, [ids], 8, tokenizer=tokenizer, logit_bias={cat: 100}, stop=[cat],
                                      min_new_tokens=3)]
        assert len(steps) == 4 and steps[-1].token == cat and answer.choices[0].finish_reason == "stop"
        assert answer.choices[0].text == "".join(s.text for s in steps)
        assert answer.usage.completion_tokens == 4  # the stop token counts, as EOS does
        chat = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "Colour?"}], temperature=0,
            response_format={"type": "choice", "choices": ["red", "green"]})
        assert chat.choices[0].message.content in ("red", "green") and chat.choices[0].finish_reason == "stop"


def test_concurrent_requests_with_different_controls_each_equal_the_request_alone(served):
    model, tokenizer = served
    greedy = dict(temperature=0)
    controls = [greedy, dict(greedy, presence_penalty=1.0), dict(frequency_penalty=1.5, temperature=0.9, seed=2),
                dict(greedy, logit_bias={"300": 4.0, "301": -100}),
                dict(presence_penalty=-0.5, temperature=1.0, seed=9),
                dict(greedy, frequency_penalty=0.8, logit_bias={"42": 2.0})]
    prompts = ["Hello", "The capital of France is", "1 2 3", "Why?", "Once upon a time", "Dear Sir,"]
    with running(create_app(model, tokenizer, model_name=NAME, max_batch_size=4)) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        def ask(i: int) -> str:
            body = dict(model=NAME, prompt=prompts[i], max_tokens=10 + 3 * i, **controls[i])
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(ask, range(len(prompts))))
    for i, (prompt, params) in enumerate(zip(prompts, controls)):
        params = dict(params)
        if "logit_bias" in params:
            params["logit_bias"] = {int(t): b for t, b in params["logit_bias"].items()}
        assert together[i] == expected(model, tokenizer, tokenizer.encode(prompt), 10 + 3 * i, **params)


def test_bad_controls_get_a_400_naming_the_field(served):
    model, tokenizer = served
    base = dict(model=NAME, prompt="hi", max_tokens=4)
    with TestClient(create_app(model, tokenizer, model_name=NAME)) as client:
        for extra, field in [
            (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty="1"), "frequency_penalty"),
            (dict(logit_bias={"abc": 1}), "logit_bias.abc.[key]"), (dict(logit_bias={"5": 101}), "logit_bias.5"),
            (dict(logit_bias={"-3": 1}), "logit_bias.-3.[key]"), (dict(logit_bias={"1.0": 1}), "logit_bias.1.0.[key]"),
            (dict(logit_bias={"49152": 1}), "logit_bias.49152"),
            (dict(logit_bias={str(i): 1 for i in range(1025)}), "logit_bias"),
            (dict(stop_token_ids=[-1]), "stop_token_ids.0"), (dict(stop_token_ids=[2, 49152]), "stop_token_ids.1"),
            (dict(stop_token_ids=list(range(65))), "stop_token_ids"), (dict(min_tokens=-1), "min_tokens"),
            (dict(min_tokens=5), "min_tokens"),
            (dict(min_tokens=2, response_format={"type": "json_object"}), "min_tokens"),
            (dict(response_format={"type": "regex", "pattern": "(a"}), "response_format"),
            (dict(response_format={"type": "choice", "choices": [1]}), "response_format"),
        ]:
            r = client.post("/v1/completions", json={**base, **extra})
            assert r.status_code == 400, (extra, r.text)
            assert r.json()["error"]["param"] == field, (extra, r.text)
        assert client.get("/health").json()["active"] == 0


def test_the_command_line_flags(tiny_dir, capsys):
    model, tokenizer = load(tiny_dir), Tokenizer.from_pretrained(tiny_dir)
    ids, cat = tokenizer.encode("Hello"), tokenizer.encode(" cat")[0]
    args = ["generate", "--model", str(tiny_dir), "--temperature", "0", "--max-new-tokens", "8", "Hello"]
    assert main([*args, "--logit-bias", f"{cat}=100", "--stop-token-id", str(cat), "--min-new-tokens", "2"]) == 0
    steps = [s for (s,) in stream(model, [ids], 8, tokenizer=tokenizer, logit_bias={cat: 100}, stop=[cat],
                                  min_new_tokens=2)]
    assert len(steps) == 3 and steps[-1].token == cat
    assert capsys.readouterr().out == "".join(s.text for s in steps) + "\n"
    assert main([*args, "--presence-penalty", "1.5", "--frequency-penalty", "0.5"]) == 0
    want = expected(model, tokenizer, ids, 8, presence_penalty=1.5, frequency_penalty=0.5)
    assert capsys.readouterr().out == want + "\n"
    with pytest.raises(SystemExit):
        main([*args, "--logit-bias", "5"])
    assert "must be ID=BIAS" in capsys.readouterr().err
    for flags, message in [(["--logit-bias", "5=200"], "logit_bias"), (["--presence-penalty", "3"], "presence_penalty"),
                           (["--min-new-tokens", "9"], "exceeds max_new_tokens"),
                           (["--stop-token-id", "99999"], "token ids in")]:
        assert main([*args, *flags]) == 1
        assert message in capsys.readouterr().err
