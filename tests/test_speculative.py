"""Speculative decoding (prompt lookup): the tokens are those of decoding without it, greedy or seeded, alone
or batched, with stop strings and grammars, through Python, the CLI and the server; and it does guess."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from conftest import TINY, tiny_model
from fastapi.testclient import TestClient

from smollm2 import SmolError, SmolLM2, Tokenizer, load
from smollm2.cli import main
from smollm2.generation import generate, stream
from smollm2.generation.engine import Engine
from smollm2.generation.sampling import Sampling
from smollm2.generation.sequence import Sequence
from smollm2.generation.speculative import MAX_GUESS, MIN_GUESS, Draft, PromptLookup, lookup, speculation
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
    # model.py's modules, no kernel running: batched alone (torch's steps are ~10x the kernels' here)
    "greedy_on_the_reference_model": ([[COPY, OPEN]], dict()),
    "seeded": ([[COPY, OPEN]], dict(temperature=0.8, top_p=0.9, seed=7)),  # a draw per position it keeps
    "stop": ([[COPY, OPEN]], dict(stop=["library"])),
    "json": ([[COPY]], dict(response_format={"type": "json_object"}, max_new_tokens=32)),
}


@pytest.mark.parametrize("case", CASES)
def test_tokens_equal_decoding_without_speculation_alone_and_batched(model, reference_model, tok, case):
    batches, kwargs = CASES[case]
    m = reference_model if case.endswith("reference_model") else model
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
        if case.startswith("greedy") or case == "seeded":
            passes, decoded, kept = counts[-1]
            assert kept > 0 and decoded > passes  # it did guess, and some guesses stood


def test_a_tiny_model_speculates_to_the_last_token_and_bad_settings_are_errors():
    model = tiny_model(TINY["gqa"])
    prompt = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7]]
    assert generate(model, prompt, 30, eos_token_id=None, speculative="ngram").tolist() == \
        generate(model, prompt, 30, eos_token_id=None).tolist()
    with pytest.raises(SmolError, match="speculative"):
        generate(model, prompt, 3, speculative="draft")
    engine = Engine(model, 1, 64, prefill_budget=None, whole_cache=True)
    with pytest.raises(SmolError, match="compiled"):
        engine.admit(Sequence([1, 2], 3, Sampling(), ()), speculative="ngram")


def test_the_cli_and_server_answer_alike_with_and_without(model, tok, capsys):
    main(["chat", "-p", COPY, "--temperature", "0", "--max-new-tokens", "48", "--speculative", "ngram"])
    with_cli = capsys.readouterr().out.strip()
    main(["chat", "-p", COPY, "--temperature", "0", "--max-new-tokens", "48"])
    assert capsys.readouterr().out.strip() == with_cli
    name = "SmolLM2-135M-Instruct"
    with TestClient(create_app(model, tok, model_name=name, speculative="ngram")) as client:
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
                                                          speculative="draft"))  # this server has no draft
        assert r.status_code == 400 and r.json()["error"]["param"] == "speculative"


def test_the_cli_and_server_answer_alike_with_a_draft_and_without(model, tok, capsys):
    """The embedded model drafting for itself (the only real weights here): the CLI's `draft` loads a copy."""
    printed = []
    for speculative in ("draft", "off"):
        main(["chat", "-p", OPEN, "--temperature", "0", "--max-new-tokens", "24", "--speculative", speculative])
        printed.append(capsys.readouterr().out)
    assert printed[0] == printed[1] and printed[0].strip()
    name = "SmolLM2-135M-Instruct"
    with TestClient(create_app(model, tok, model_name=name, speculative=model)) as client:
        answers = {}
        for speculative in ("draft", "off"):  # alone, under a grammar; then two prompts batched, a stop string
            r = client.post("/v1/chat/completions", json=dict(
                model=name, messages=[{"role": "user", "content": OPEN}], max_tokens=24, temperature=0,
                response_format={"type": "json_object"}, speculative=speculative, logprobs=True))
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            r = client.post("/v1/completions", json=dict(model=name, prompt=[COPY, OPEN], max_tokens=24,
                                                         temperature=0, stop=["budget for"], logprobs=1,
                                                         speculative=speculative))
            assert r.status_code == 200, r.text
            answers[speculative] = (choice["message"]["content"], choice["logprobs"]["content"],
                                    [(c["text"], c["logprobs"]) for c in r.json()["choices"]])
        assert answers["draft"] == answers["off"]
        assert answers["draft"][0].startswith("{") and "budget for" not in answers["draft"][2][0][0]
        metrics = {line.split()[0]: float(line.split()[1]) for line in client.get("/metrics").text.splitlines()
                   if line.startswith("smollm2_") and not line.startswith("#")}
        assert 0 < metrics["smollm2_speculation_kept_tokens_total"] <= metrics[
            "smollm2_speculation_guessed_tokens_total"]


def another_tokenizer(tiny_dir, tmp_path):
    """A copy of the tiny model whose tokenizer has two tokens' ids swapped: the same size, another vocabulary."""
    other = tmp_path / "other"
    shutil.copytree(tiny_dir, other)
    data = json.loads((other / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = (next(token for token, i in vocab.items() if i == j) for j in (300, 301))
    vocab[a], vocab[b] = 301, 300  # two tokens' ids swapped
    (other / "tokenizer.json").write_text(json.dumps(data))
    return other


def test_a_draft_with_another_tokenizer_is_refused_in_one_line(tiny_dir, tmp_path, capsys):
    other = another_tokenizer(tiny_dir, tmp_path)
    assert main(["generate", "--model", str(tiny_dir), "--speculative", f"draft:{other}", "Hi"]) == 1
    assert capsys.readouterr().err.strip() == (f"smollm2 generate: error: --speculative draft:{other}: the draft's "
                                               f"tokenizer is not the model's; a draft must share its vocabulary")
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(tiny_dir), "--speculative", "draft:", "Hi"])
    assert "must be ngram, off, draft or draft:SRC, got 'draft:'" in capsys.readouterr().err


def test_speculation_from_the_command_lines_words(tiny_dir, tmp_path):
    """generation.speculative.speculation, which --speculative is: the value generate() takes, a draft loaded as
    smollm2.load loads it, and a draft whose tokenizer is not the model's refused."""
    tokenizer = Tokenizer.from_pretrained(tiny_dir)
    assert speculation(None, tokenizer) is None and speculation("off", tokenizer) is None
    assert speculation("ngram", tokenizer) == "ngram"
    draft = speculation(f"draft:{tiny_dir}", tokenizer, kernels=False)
    reference = load(tiny_dir, kernels=False)
    assert type(draft) is SmolLM2 and all(torch.equal(a, b) for a, b in zip(draft.state_dict().values(),
                                                                            reference.state_dict().values()))
    with pytest.raises(SmolError, match="the draft's tokenizer is not the model's"):
        speculation(f"draft:{another_tokenizer(tiny_dir, tmp_path)}", tokenizer)
    with pytest.raises(SmolError, match="must be ngram, off, draft or draft:SRC, got 'lookup'"):
        speculation("lookup", tokenizer)


# Draft-model speculation.

def draft_pair(vocab_size: int = TINY["untied"].vocab_size) -> tuple[SmolLM2, SmolLM2]:
    """A tiny random target of 2 blocks whose second block adds little, and a draft of 1 block: the target
    without it. The two agree on some tokens and not on others, as a small model and a larger one of one family."""
    config = dataclasses.replace(TINY["untied"], vocab_size=vocab_size)  # tied embeddings would make a random
    target = tiny_model(config)  # model repeat its last token, whatever drafts it
    with torch.no_grad():
        for weight in (target.model.layers[1].self_attn.o_proj.weight, target.model.layers[1].mlp.down_proj.weight):
            weight.mul_(0.3)
    draft = SmolLM2(dataclasses.replace(config, num_hidden_layers=1)).eval()
    draft.load_state_dict({k: v for k, v in target.state_dict().items() if not k.startswith("model.layers.1.")})
    return target, draft


def run_engine(model, sequences: list[Sequence], speculative: list) -> Engine:
    """Every sequence to its end in one engine, sequence b speculating with speculative[b]."""
    engine = Engine(model, len(sequences), 128, prefill_budget=None)
    for sequence, how in zip(sequences, speculative):
        engine.admit(sequence, speculative=how)
    while not all(s.finish_reason for s in sequences):
        engine.step()
    return engine


PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [300, 301, 302], [90, 12, 90, 12, 90]]


@pytest.mark.parametrize("params", [dict(), dict(temperature=0.9, top_p=0.9, seed=5),
                                    dict(presence_penalty=0.5, logit_bias={7: 2.0})], ids=["greedy", "seeded",
                                                                                            "penalties"])
def test_a_draft_gives_the_tokens_of_decoding_without_it_alone_and_beside_other_rows(params):
    target, draft = draft_pair(512)
    alone = [generate(target, [p], 24, eos_token_id=None, **params)[0, len(p):].tolist() for p in PROMPTS]
    drafted = generate(target, [PROMPTS[0]], 24, eos_token_id=None, speculative=draft, **params)
    assert drafted[0, 9:].tolist() == alone[0]
    for kinds in ([draft, None, "ngram"], [draft] * 3):
        sequences = [Sequence(p, 24, Sampling(**params), ()) for p in PROMPTS]
        engine = run_engine(target, sequences, kinds)
        assert [s.tokens for s in sequences] == alone
        if not params:  # greedy: many guesses stand, and many fall
            assert 0 < engine.kept < engine.guessed and engine.decoded > engine.passes


def test_a_drafts_guesses_lengthen_by_2_while_all_stand_and_shorten_to_one_past_those_kept():
    _, draft = draft_pair()
    guesser = Draft(draft, 64)
    lengths = [guesser.length]
    for kept_all in (True,) * 7 + (False,):
        guessed = guesser.length
        guesser.record(guessed, guessed if kept_all else 2)
        lengths.append(guesser.length)
    assert lengths == [3, 5, 7, 9, 11, 13, 15, MAX_GUESS, 3]
    guesser.record(3, 0)
    assert guesser.length == 1


@pytest.mark.parametrize("kv_cache_dtype, stored", [("bf16", torch.bfloat16), ("int8", torch.int8)])
def test_a_drafts_cache_stores_what_the_engines_does(kv_cache_dtype, stored):
    target, draft = draft_pair(512)
    engine = Engine(target, 1, 128, prefill_budget=None, kv_cache_dtype=kv_cache_dtype)
    sequence = Sequence(PROMPTS[0], 24, Sampling(), ())
    row = engine.admit(sequence, speculative=draft)
    assert row.guesser.cache.k.dtype == engine.cache.k.dtype == stored
    while not sequence.finish_reason:
        engine.step()
    assert sequence.tokens == generate(target, [PROMPTS[0]], 24, eos_token_id=None,
                                               kv_cache_dtype=kv_cache_dtype)[0, 9:].tolist()
    assert engine.kept > 0


def test_a_draft_of_another_vocabulary_or_kind_is_refused():
    target, _ = draft_pair()
    other = tiny_model(dataclasses.replace(TINY["gqa"], vocab_size=1000))
    for speculative, match in ((other, "vocabulary \\(1000 tokens\\)"), ("draft", "a draft model")):
        with pytest.raises(SmolError, match=match):
            generate(target, [[1, 2, 3]], 4, speculative=speculative)
        with pytest.raises(SmolError, match=match):
            Engine(target, 1, 64, prefill_budget=None).admit(Sequence([1, 2], 3, Sampling(), ()),
                                                             speculative=speculative)


def test_a_draft_keeps_stop_strings_and_grammars_batched(tok):
    target, draft = draft_pair()
    prompts = ["Hello", "Name three colours."]
    plain_tokens, plain_texts = answers(target, tok, prompts, None, max_new_tokens=30)
    stop = plain_texts[1][20:24]  # text the second answer holds, some tokens in
    for kwargs in (dict(stop=[stop]), dict(response_format={"type": "json_object"}), dict(temperature=0.7, seed=3)):
        expected = answers(target, tok, prompts, None, max_new_tokens=30, **kwargs)
        assert answers(target, tok, prompts, draft, max_new_tokens=30, **kwargs) == expected
        if "stop" in kwargs:
            assert expected[1][1] == plain_texts[1][:20] and len(expected[0][1]) < len(plain_tokens[1])


def test_sampled_with_a_draft_the_tokens_follow_the_models_distribution():
    """A chi-square test of the first 3 tokens' joint distribution, drawn with a draft (8 rows an engine, every
    row its own seed: the draft guesses the second token, and the third is drawn in the same pass where the
    guess stood), against the one the target's logits give (top-2 at temperature 1: 8 outcomes)."""
    target, draft = draft_pair(512)
    prompt, sampling = [5, 6, 7, 8, 9, 10, 5, 6, 7], dict(temperature=1.0, top_k=2)

    def probabilities(tokens: list[int]) -> dict[int, float]:  # the next token's, from one forward pass
        logits = target(torch.tensor([prompt + tokens]))[0, -1]
        top = logits.topk(2)
        return dict(zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist()))

    expected = {}
    for a, pa in probabilities([]).items():
        for b, pb in probabilities([a]).items():
            for c, pc in probabilities([a, b]).items():
                expected[a, b, c] = pa * pb * pc
    draws, counts, guessed, kept = 400, dict.fromkeys(expected, 0), 0, 0
    for first in range(0, draws, 8):
        sequences = [Sequence(prompt, 3, Sampling(**sampling, seed=seed), ()) for seed in range(first, first + 8)]
        engine = run_engine(target, sequences, [draft] * 8)
        guessed, kept = guessed + engine.guessed, kept + engine.kept
        for s in sequences:
            counts[tuple(s.tokens[:3])] += 1
    chi2 = sum((counts[k] - draws * p) ** 2 / (draws * p) for k, p in expected.items())
    p_value = torch.special.gammaincc(torch.tensor((len(expected) - 1) / 2), torch.tensor(chi2 / 2)).item()
    assert sum(counts.values()) == draws and p_value > 1e-3, (chi2, counts)
    assert 0.2 * guessed < kept < 0.8 * guessed  # the draft's guesses both stood and fell, often


def test_bench_reports_tokens_per_pass_and_acceptance(tiny_dir, capsys):
    args = ["bench", "--model", str(tiny_dir), "--prompt-tokens", "8", "--new-tokens", "12", "--repeats", "1", "--json"]
    assert main([*args, "--speculative", f"draft:{tiny_dir}"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["speculative"] == f"draft:{tiny_dir}" and result["tokens_per_pass"] > 1  # a model drafting for
    assert result["acceptance"] == 1.0  # itself: every guess stands
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens_per_pass"] == 1.0 and result["acceptance"] is None


def test_a_requests_speculation_is_checked_once_on_its_way_to_the_engine(tok, monkeypatch):
    """Request.row is the one place a request's speculation is checked: generate() and the server queue the row it
    makes as it is (Engine.queue); the engine checks a bare sequence's (Engine.admit), the server its default once,
    as it starts."""
    from smollm2.generation import engine, request
    from smollm2.generation.speculative import check_speculative
    from smollm2.server import scheduler

    checked = []

    def counted(speculative, vocab_size):
        checked.append(speculative)
        check_speculative(speculative, vocab_size)

    for module in (request, engine, scheduler):
        monkeypatch.setattr(module, "check_speculative", counted)
    model = tiny_model(TINY["gqa"])
    generate(model, [[1, 2, 3], [4, 5]], 2, speculative="ngram")
    assert checked == ["ngram"] * 2  # one per row
    app = create_app(model, tok, model_name="tiny", speculative="ngram")
    with TestClient(app) as client:
        r = client.post("/v1/completions", json=dict(model="tiny", prompt=[1, 2, 3], max_tokens=2, n=2))
        assert r.status_code == 200, r.text
    assert checked == ["ngram"] * 5  # the server's default as it starts, then each of the two requests
