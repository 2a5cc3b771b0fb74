"""Speculative decoding (prompt lookup): the tokens are those of decoding without it, greedy or seeded, alone
or batched, with stop strings and grammars, through Python, the CLI and the server; and it does guess."""

from __future__ import annotations

import pytest
from conftest import TINY, tiny_model
from fastapi.testclient import TestClient

from smollm2 import SmolError, Tokenizer
from smollm2.cli import main
from smollm2.generation import stream
from smollm2.generation.engine import Engine
from smollm2.generation.sampling import Sampling
from smollm2.generation.sequence import Sequence
from smollm2.generation.speculative import MAX_GUESS, MIN_GUESS, PromptLookup, lookup
from smollm2.server import create_app

TEXT = ("The committee met on Tuesday to review the budget. The budget for the library grew by ten percent, "
        "and the budget for the parks stayed the same. The committee will meet again next month.")
COPY = f"Repeat this text exactly, word for word:\n\n{TEXT}"
OPEN = "Write a short poem about the sea."


def test_lookup_continues_the_longest_ngram_where_the_match_runs_furthest_back():
    assert lookup([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3], 2) == [7, 8]  # "2 3" last seen before 7 8
    assert lookup([5, 1, 2, 3, 4, 6, 2, 3, 8, 1, 2, 3], 3) == [4, 6, 2]  # "1 2 3" beats the later "2 3"
    assert lookup([1, 2, 3, 4, 5, 6, 8, 3, 4, 5, 7, 2, 3, 4, 5], 1) == [6]  # "2 3 4 5" ran before 6, not before 7
    assert lookup([4, 5, 6], 3) == [] and lookup([7], 3) == [] and lookup([1, 2, 1, 2], 5) == [1, 2]
    assert lookup([1, 2, 3, 1], 2) == []  # one token alone is no match (MIN_NGRAM)


def test_the_guess_is_as_long_as_the_match_has_run_and_misses_pause_it():
    text = list(range(100, 160))
    for copied in (2, 5, 12, 30):  # the answer so far repeats text[:copied]
        guess = lookup(text + text[:copied], 60)
        assert guess == text[copied:copied + min(max(copied, MIN_GUESS), MAX_GUESS)]
    assert lookup(text + text[:30], 4) == text[30:34]  # within the room left
    guesser = PromptLookup()
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2]
    assert guesser.guess(tokens, [], 20) == [3, 4, 5]
    guesser.record(3, 0)
    guesser.record(3, 0)  # two first guesses missed running: a pause of 2 steps
    assert [guesser.guess(tokens, [], 20) for _ in range(3)] == [[], [], [3, 4, 5]]
    guesser.record(3, 1)
    assert guesser.misses == 0 and (guesser.guessed, guesser.kept) == (9, 1)


def answers(model, tok, prompts, speculative, **kwargs):
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in prompts]
    tokens, texts = [[] for _ in ids], [""] * len(ids)
    for steps in stream(model, ids, kwargs.pop("max_new_tokens", 48), tokenizer=tok, speculative=speculative,
                        **kwargs):
        for b, step in enumerate(steps):
            if step is not None:
                tokens[b].append(step.token)
                texts[b] += step.text
    return tokens, texts


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_pretrained()


CASES = {
    "greedy": ([[COPY], [COPY, OPEN]], dict()),
    "seeded": ([[COPY, OPEN]], dict(temperature=0.8, top_p=0.9, seed=7)),  # a draw per position it keeps
    "stop": ([[COPY, OPEN]], dict(stop=["library"])),
    "json": ([[COPY]], dict(response_format={"type": "json_object"}, max_new_tokens=32)),
}


@pytest.mark.parametrize("case", CASES)
def test_tokens_equal_decoding_without_speculation_alone_and_batched(model, reference_model, tok, case):
    batches, kwargs = CASES[case]
    for m in (model, reference_model) if case == "greedy" else (model,):
        for prompts in batches:
            plain = answers(m, tok, prompts, None, **dict(kwargs))
            counts = []
            original = Engine._decode

            def counted(self, events):
                original(self, events)
                counts.append((self.passes, self.decoded, self.kept))

            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(Engine, "_decode", counted)
                fast = answers(m, tok, prompts, "ngram", **dict(kwargs))
            assert fast == plain
            if case in ("greedy", "seeded"):
                passes, decoded, kept = counts[-1]
                assert kept > 0 and decoded > passes  # it did guess, and some guesses stood


def test_a_tiny_model_speculates_to_the_last_token_and_bad_settings_are_errors():
    model = tiny_model(TINY["gqa"])
    prompt = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7]]
    assert model.generate(prompt, 30, eos_token_id=None, speculative="ngram").tolist() == \
        model.generate(prompt, 30, eos_token_id=None).tolist()
    with pytest.raises(SmolError, match="speculative"):
        model.generate(prompt, 3, speculative="draft")
    engine = Engine(model, 1, 64, prefill_budget=None, whole_cache=True)
    with pytest.raises(SmolError, match="compiled"):
        engine.admit(Sequence([1, 2], 3, Sampling(), ()), speculative=True)


def test_the_cli_and_server_answer_alike_with_and_without(model, tok, capsys):
    main(["chat", "-p", COPY, "--temperature", "0", "--max-new-tokens", "48", "--speculative", "ngram"])
    with_cli = capsys.readouterr().out.strip()
    main(["chat", "-p", COPY, "--temperature", "0", "--max-new-tokens", "48"])
    assert capsys.readouterr().out.strip() == with_cli
    name = "SmolLM2-135M-Instruct"
    with TestClient(create_app(model, tok, model_name=name, speculative=True)) as client:
        texts = {}
        for speculative in ("ngram", "off"):
            body = dict(model=name, messages=[{"role": "user", "content": COPY}], max_tokens=48, temperature=0,
                        speculative=speculative, logprobs=True)
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            texts[speculative] = (choice["message"]["content"],
                                  [(lp["token"], lp["logprob"]) for lp in choice["logprobs"]["content"]])
        assert texts["ngram"] == texts["off"] and texts["ngram"][0] == with_cli
        metrics = {line.split()[0]: float(line.split()[1]) for line in client.get("/metrics").text.splitlines()
                   if line.startswith("smollm2_") and not line.startswith("#")}
        assert metrics["smollm2_decoded_tokens_total"] > metrics["smollm2_decoding_passes_total"]
        assert 0 < metrics["smollm2_speculation_kept_tokens_total"] <= metrics[
            "smollm2_speculation_guessed_tokens_total"]
        r = client.post("/v1/chat/completions", json=dict(model=name, messages=[{"role": "user", "content": "Hi"}],
                                                          speculative="draft"))
        assert r.status_code == 400 and "speculative" in r.text
