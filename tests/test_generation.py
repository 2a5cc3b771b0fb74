"""Generation: greedy equals transformers' generate; batches, streams, stops and sampling behave."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from conftest import TINY, hf_copy, tiny_model, torch_row_variance

import smollm2.generation.steps as steps
from smollm2 import SmolError, Tokenizer
from smollm2.generation import PrefixCache, Sampling, generate, stream
from smollm2.generation.engine import Engine, prompt_logprobs
from smollm2.generation.logprobs import log_probs
from smollm2.generation.sampling import penalized, sample, warped
from smollm2.generation.sequence import Sequence, StopStrings
from smollm2.generation.steps import attended_together, prefill_rows
from smollm2.kernels import accelerate
from smollm2.kernels.choosing import Choices

CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "What is 12 times 7?",
         "Name three primary colors."]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_pretrained()


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(TINY["gqa"])


def test_greedy_chat_answers_equal_transformers(model, hf_model, tokenizer):
    for question in CHATS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}])
        ours = generate(model, [ids], 40)
        theirs = hf_model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)
        assert ours.tolist() == theirs.tolist(), question
    assert "Paris" in tokenizer.decode(generate(model, [tokenizer.apply_chat_template(
        [{"role": "user", "content": CHATS[0]}])], 20)[0])


def test_tiny_greedy_equals_transformers_without_eos(tiny):
    prompt = torch.randint(0, tiny.config.vocab_size, (2, 7))
    ours = generate(tiny, prompt, 30, eos_token_id=None)
    theirs = hf_copy(tiny).generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=30,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(ours, theirs)


def test_batch_rows_equal_rows_alone(model, tokenizer):
    prompts = [tokenizer.encode(t) for t in ("The capital of Italy is", "1, 2, 3,",
                                             "Once upon a time, in a land far away, there lived a")]
    for sampling in ({}, {"temperature": 0.8, "top_p": 0.9, "seed": 7}):
        batch = generate(model, prompts, 12, eos_token_id=None, **sampling)
        for b, row in enumerate(prompts):
            alone = generate(model, [row], 12, eos_token_id=None, **sampling)
            assert batch[b, -12:].tolist() == alone[0, -12:].tolist()
            assert batch[b, batch.shape[1] - 12 - len(row):-12].tolist() == row  # left-padded prompt


# Prompts of several lengths, with 64-token chunks: several waves, rows of two kinds (rows_bucket) packed in a pass
# each, chunks of at most 16 tokens (a decoding step's rows, run alone), a long prompt's later chunk beside
# another's.
PACKED_PROMPTS = [list(range(3, 23)), list(range(40, 70)), list(range(5, 50)), list(range(90, 190)),
                  list(range(7, 16)), list(range(200, 270)), list(range(30, 61)), list(range(300, 450))]
SEEDED = Sampling(temperature=0.8, top_p=0.9, seed=7)


def engine_steps(model, prompts, budget=None, prefix_cache=None) -> list[list]:
    """Every row's Steps (tokens and log-probabilities), its prompts admitted to one engine at once; a prompt of
    odd length samples, seeded."""
    engine = Engine(model, len(prompts), max(map(len, prompts)) + 6, prefill_budget=budget, prefix_cache=prefix_cache)
    rows = [engine.admit(Sequence(prompt, 6, SEEDED if len(prompt) % 2 else Sampling(), eos=(), logprobs=2))
            for prompt in prompts]
    taken = {row: [] for row in rows}
    while not all(row.ended for row in rows):
        for row, step in engine.step():
            taken[row].append(step)
    return list(taken.values())


def test_the_heap_is_trimmed_once_the_last_queued_prompt_is_in(tiny, monkeypatch):
    """The engine hands the prompts' freed activations back to the OS (release_freed_memory) at the step whose
    prefill takes in the last queued prompt, and not while prompts are left, nor at decoding steps."""
    import smollm2.generation.engine as engine_module

    trims = []
    monkeypatch.setattr(engine_module, "release_freed_memory", lambda: trims.append(len(trims)))
    engine = Engine(tiny, 2, 40, prefill_budget=20)  # a step prefills one of these prompts
    rows = [engine.admit(Sequence(list(range(3, 3 + n)), 4, Sampling(), eos=())) for n in (20, 15)]
    counts = []
    while not all(row.ended for row in rows):
        engine.step()
        counts.append(len(trims))
    assert counts[:2] == [0, 1] and counts[-1] == 1  # the first prompt's step, then the last's; decoding none


@pytest.mark.parametrize("mode", ["on", "auto", "off"])
def test_a_batched_prefill_gives_each_row_the_bits_it_gets_alone(mode, tmp_path, monkeypatch):
    """Rows' chunks prefilled in one pass (steps.prefill_rows) give each row the first token and log-probabilities
    it gets prefilled alone, in every kernels mode: measured choices, then mixes of kernel and torch (torch runs
    each prompt's rows alone, the kernel all of them); and with a budget and a prefix cache. Off, rows prefill
    alone (torch's products may give a row other bits among others). Its later tokens, decoded beside the other
    rows, are its own where the decoding step's products keep a row's bits: on the kernels, always."""
    monkeypatch.setattr(steps, "PREFILL_CHUNK", 64)
    model = accelerate(tiny_model(dataclasses.replace(TINY["gqa"], head_dim=64)), mode=mode)
    if mode == "auto":  # measured into the test's own file
        model.accelerator.choices = Choices("auto", lambda: tmp_path / "choices.json")
    alone = [engine_steps(model, [prompt])[0] for prompt in PACKED_PROMPTS]
    passes = []
    monkeypatch.setattr(steps, "prefill_rows", lambda model, chunks, cache: passes.append(len(chunks)) or
                        prefill_rows(model, chunks, cache))
    decoded_alone = mode != "off" or torch_row_variance(model) is None

    def check(together, want):
        assert [row[0] for row in together] == [row[0] for row in want]  # the prefill's
        assert together == want or not decoded_alone

    check(engine_steps(model, PACKED_PROMPTS), alone)
    assert max(passes, default=0) == (4 if mode != "off" else 0)  # the first chunks of 45-150 tokens
    check(engine_steps(model, PACKED_PROMPTS, budget=100, prefix_cache=PrefixCache(1 << 22)), alone)
    if mode == "auto":
        made = model.accelerator.choices.made
        assert made  # the prompts' kinds, measured
        for parity in (0, 1):  # each kind the other side's than its neighbour's
            model.accelerator.choices.made = {key: choice._replace(winner=("kernel", "torch")[(i + parity) % 2])
                                              for i, (key, choice) in enumerate(made.items())}
            check(engine_steps(model, PACKED_PROMPTS), [engine_steps(model, [p])[0] for p in PACKED_PROMPTS])


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_rows_of_one_length_attended_in_one_call_keep_the_bits_each_gets_alone(mode, tmp_path, monkeypatch):
    """First chunks of one length in consecutive rows share their attention and cache writes (one call,
    steps.attended_together), beside a row of another length: each row's tokens and log-probabilities are those it
    gets alone; in auto mode also with attention's kind on torch's side (then run row by row) and the kernel's."""
    monkeypatch.setattr(steps, "PREFILL_CHUNK", 64)
    model = accelerate(tiny_model(dataclasses.replace(TINY["gqa"], head_dim=64)), mode=mode)
    if mode == "auto":
        model.accelerator.choices = Choices("auto", lambda: tmp_path / "choices.json")
    prompts = [list(range(3 + 50 * b, 43 + 50 * b)) for b in range(4)] + [list(range(250, 283))]
    groups = []
    monkeypatch.setattr(steps, "attended_together", lambda chunks, last: groups.append(together := attended_together(
        chunks, last)) or together)
    alone = [engine_steps(model, [prompt])[0] for prompt in prompts]
    assert engine_steps(model, prompts) == alone
    assert [[0, 1, 2, 3], [4]] in groups  # the last block's row by row
    if mode == "auto":
        made = model.accelerator.choices.made
        for winner in ("torch", "kernel"):
            model.accelerator.choices.made = {key: choice._replace(winner=winner) if key.op == "prompt_attention"
                                              else choice for key, choice in made.items()}
            assert engine_steps(model, prompts) == [engine_steps(model, [p])[0] for p in prompts]


def test_the_embedded_model_prefills_rows_together_with_the_bits_of_each_alone(model, tokenizer):
    """Real weights (the file's Q4_1 blocks streamed), prompts of 20-60 tokens in one pass: each row's tokens and
    log-probabilities are those it gets alone."""
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": question * (1 + b)}])
               for b, question in enumerate(CHATS)]
    assert engine_steps(model, prompts) == [engine_steps(model, [prompt])[0] for prompt in prompts]


def test_chunked_prefill_gives_the_same_tokens(tiny, monkeypatch):
    prompt = torch.randint(0, tiny.config.vocab_size, (1, 50))
    whole = generate(tiny, prompt, 10, eos_token_id=None)
    monkeypatch.setattr(steps, "PREFILL_CHUNK", 7)
    assert torch.equal(generate(tiny, prompt, 10, eos_token_id=None), whole)


# Each prompt token's log-probability from a prefill in chunks against one forward over the whole prompt: the same
# float32 math in other summation orders (a later chunk's attention reads the keys an earlier one cached).
CHUNKED_TOLERANCE = 1e-4


@torch.inference_mode()
def test_chunked_prefill_equals_a_whole_prompt_forward(either_model, tokenizer, english, monkeypatch):
    """The embedded model, the test text (615 tokens) in three chunks of 256, as the engine prefills a prompt
    (and scores an echoed one), against model(ids) over all of it at once."""
    ids = tokenizer.encode(english)
    monkeypatch.setattr(steps, "PREFILL_CHUNK", 256)
    chunked = torch.tensor([scored.logprob for scored in prompt_logprobs(either_model, ids)[1:]])
    whole = log_probs(either_model(torch.tensor([ids]))[0, :-1]).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert len(ids) > 512
    diff = (chunked - whole).abs().max().item()
    print(f"chunked prefill vs one forward, {len(ids)} tokens: max |logprob diff| {diff:.1e}")
    assert diff <= CHUNKED_TOLERANCE


def test_each_row_stops_at_its_own_eos(tiny):
    prompts = [[5, 6, 7], [9, 10]]
    sampling = dict(temperature=1.0, seed=0)  # a random tiny model repeats itself when greedy
    free = generate(tiny, prompts, 8, eos_token_id=None, **sampling)
    new0 = free[0, 3:].tolist()  # prompts are padded to 3
    k = next(i for i in range(1, 8) if new0[i] not in new0[:i])  # a token row 0 first makes at step k
    eos = new0[k]
    out = generate(tiny, prompts, 8, eos_token_id=eos, **sampling)
    rows = list(stream(tiny, prompts, 8, eos_token_id=eos, **sampling))
    assert [row[0].token for row in rows[:k + 1]] == new0[:k + 1]
    assert rows[k][0].finish_reason == "stop" and all(row[0] is None for row in rows[k + 1:])
    pad = tiny.config.pad_token_id if tiny.config.pad_token_id is not None else tiny.config.eos_token_ids[0]
    assert out[0, 4 + k:].tolist() == [pad] * (out.shape[1] - 4 - k)
    new1 = free[1, 3:].tolist()
    stopped = new1.index(eos) + 1 if eos in new1 else 8
    assert out[1, 3:3 + stopped].tolist() == new1[:stopped]


def test_default_eos_is_the_checkpoints_and_none_disables_it(model, tokenizer):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": CHATS[0]}])
    out = generate(model, [ids], 30)[0, len(ids):].tolist()
    assert out[-1] == tokenizer.eos_token_id == model.config.eos_token_ids[0] and len(out) < 30
    assert len(generate(model, [ids], len(out) + 3, eos_token_id=None)[0]) == len(ids) + len(out) + 3


def test_stop_strings_end_the_text_before_them(model, tokenizer):
    ids = tokenizer.encode("Count with me: 1, 2, 3, 4,")
    out = generate(model, [ids], 30, eos_token_id=None, stop=[" 7"], tokenizer=tokenizer)[0, len(ids):].tolist()
    whole = tokenizer.decode(out)  # the tokens run up to the one that completes the stop string
    assert " 7" in whole and " 7" not in tokenizer.decode(out[:-1])
    rows = list(stream(model, [ids], 30, eos_token_id=None, stop=[" 7"], tokenizer=tokenizer))
    assert [step.token for (step,) in rows] == out and rows[-1][0].finish_reason == "stop"
    assert "".join(step.text for (step,) in rows) == whole[:whole.index(" 7")]
    with pytest.raises(SmolError, match="tokenizer"):
        generate(model, [ids], 3, stop=["x"])
    with pytest.raises(SmolError, match="non-empty strings"):
        generate(model, [ids], 3, stop=[""], tokenizer=tokenizer)


def test_text_that_may_begin_a_stop_string_is_held_back(tokenizer):
    ids = tokenizer.encode("one two three four")
    sequence = Sequence([1], 10, Sampling(), eos=[], stop=["two thr", "our!"], tokenizer=tokenizer)
    texts = [sequence.accept(t).text for t in ids[:3]]
    assert texts[:2] == ["one", " "]  # "two" may begin "two thr": held back
    assert sequence.finish_reason == "stop" and "".join(texts) == sequence.text == "one "
    sequence = Sequence([1], len(ids), Sampling(), eos=[], stop=["our!"], tokenizer=tokenizer)
    steps = [sequence.accept(t) for t in ids]
    assert steps[-1].text == " four" and steps[-1].finish_reason == "length"  # "our" is released at the end


def test_stop_strings_are_matched_in_linear_time():
    # Each character is looked at once per string: no rescanning of the text or of the strings' prefixes.
    matcher, start = StopStrings(["a" * 999 + "b"] * 4), time.perf_counter()
    for _ in range(10_000):
        assert matcher.feed("aaa") == -1
    assert matcher.held == 999 and time.perf_counter() - start < 5
    assert matcher.feed("aab") == 30_003 - 1000  # where the first string completed starts
    matcher = StopStrings(["bc", "abcd", "ce"])
    assert matcher.feed("xab") == -1 and matcher.held == 2  # "ab" may yet begin "abcd"
    assert matcher.feed("cd") == 1  # "bc" ends first, but "abcd", complete too, starts first


def test_stream_yields_the_tokens_generate_returns(tiny):
    prompt = [3, 1, 4, 1, 5]
    tokens = [step.token for (step,) in stream(tiny, prompt, 9, eos_token_id=None, temperature=1.0, seed=3)]
    assert tokens == generate(tiny, prompt, 9, eos_token_id=None, temperature=1.0, seed=3)[0, 5:].tolist()


def prefilled_chunks(model, monkeypatch) -> list[int]:
    """Where each prefill chunk the model computes from now on starts (a decoding step's slots are per row)."""
    starts, hidden_states = [], model.hidden_states

    def recording(ids, input_pos=None, *args, **kwargs):
        if input_pos is not None and input_pos.dim() == 1:
            starts.append(int(input_pos[0]))
        return hidden_states(ids, input_pos, *args, **kwargs)

    monkeypatch.setattr(model, "hidden_states", recording)
    return starts


def test_a_prefix_cache_kept_across_calls_prefills_only_the_chunks_it_lacks(tiny, monkeypatch):
    """A chat's turns through one PrefixCache: each turn computes only the chunks after those an earlier prompt
    prefilled whole, and its steps (tokens, log-probabilities) are those of a call without it, bit for bit."""
    monkeypatch.setattr(steps, "PREFILL_CHUNK", 8)
    starts = prefilled_chunks(tiny, monkeypatch)

    def turn(prompt, prefix_cache):
        starts.clear()
        answer = [step for (step,) in stream(tiny, [prompt], 6, eos_token_id=None, temperature=0.8, seed=1,
                                             logprobs=2, prefix_cache=prefix_cache)]
        return answer, list(starts)

    cache, first = PrefixCache(1 << 20), list(range(1, 21))  # chunks 0-7, 8-15, 16-19
    answer, computed = turn(first, cache)
    assert computed == [0, 8, 16] and answer == turn(first, None)[0]
    assert turn(first, cache) == (answer, [])  # the same prompt again: found whole, its last state too
    follow_up = first + [step.token for step in answer] + [30, 31, 32]  # 29 tokens
    assert turn(follow_up, cache) == (turn(follow_up, None)[0], [16, 24])  # its first two chunks copied
    edited = first[:10] + [99, 100]
    assert turn(edited, cache) == (turn(edited, None)[0], [8])


def test_rows_of_one_batch_share_their_prefix_through_the_cache(tiny, monkeypatch):
    """Prompts are prefilled one after another: a later row copies the chunks an earlier one has just kept."""
    monkeypatch.setattr(steps, "PREFILL_CHUNK", 8)
    starts = prefilled_chunks(tiny, monkeypatch)
    system = list(range(100, 116))  # two whole chunks
    prompts = [system + [1, 2, 3], system + [4, 5]]
    with_cache = list(stream(tiny, prompts, 5, eos_token_id=None, prefix_cache=PrefixCache(1 << 20)))
    assert starts[:4] == [0, 8, 16, 16]
    assert with_cache == list(stream(tiny, prompts, 5, eos_token_id=None))


def test_seeded_sampling_is_reproducible_and_varies_with_the_seed(tiny):
    prompt = [1, 2, 3]
    a = generate(tiny, prompt, 20, eos_token_id=None, temperature=1.0, seed=1)
    assert torch.equal(a, generate(tiny, prompt, 20, eos_token_id=None, temperature=1.0, seed=1))
    assert not torch.equal(a, generate(tiny, prompt, 20, eos_token_id=None, temperature=1.0, seed=2))
    greedy = generate(tiny, prompt, 20, eos_token_id=None)
    assert torch.equal(greedy, generate(tiny, prompt, 20, eos_token_id=None, temperature=1.0, top_k=1, seed=5))


def test_warpers_equal_transformers():
    from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    torch.manual_seed(0)
    logits = torch.randn(3, 100) * 3
    history = torch.randint(0, 100, (3, 12))
    rows = [Sampling(temperature=0.7, top_k=40, top_p=0.8, min_p=0.05, repetition_penalty=1.3, seed=0)] * 3
    ours = warped(penalized(logits, rows, history), rows)
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(history, logits.clone())
    for warp in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(40), TopPLogitsWarper(0.8), MinPLogitsWarper(0.05)):
        theirs = warp(history, theirs)
    assert torch.equal(ours.isinf(), theirs.isinf())
    torch.testing.assert_close(ours[~ours.isinf()], theirs[~theirs.isinf()])


def test_repetition_penalty_ignores_padding_slots():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    history = torch.tensor([[-1, -1, 1, 2]])  # -1: no token there; token 0 was never seen
    out = penalized(logits, [Sampling(repetition_penalty=2.0)], history)
    assert out.tolist() == [[2.0, -4.0, 0.5, 0.5]]


def test_a_row_draws_the_same_tokens_in_a_mixed_batch_as_alone():
    rows = [Sampling(), Sampling(temperature=0.8, top_p=0.9, seed=1), Sampling(temperature=1.2, top_k=5, seed=2),
            Sampling(temperature=0.7, min_p=0.1, seed=3), Sampling(temperature=1.0, repetition_penalty=1.3, seed=4),
            Sampling(repetition_penalty=1.5), Sampling(temperature=0.9, top_k=50, top_p=0.8, min_p=0.02, seed=1),
            Sampling(presence_penalty=1.2), Sampling(temperature=0.8, frequency_penalty=0.9, seed=1),
            Sampling(logit_bias={3: 5.0, 10: -100}), Sampling(temperature=1.1, logit_bias={7: 2.0}, seed=2),
            Sampling(temperature=0.7, top_p=0.9, presence_penalty=-1, frequency_penalty=2, repetition_penalty=1.2,
                     logit_bias={1: 1.5}, seed=3)]
    torch.manual_seed(0)
    together = [s.generator("cpu") for s in rows]
    alone = [s.generator("cpu") for s in rows]
    for _ in range(20):
        logits = torch.randn(len(rows), 1000) * 4
        history = torch.randint(-1, 1000, (len(rows), 30))
        generated = torch.randint(-1, 1000, (len(rows), 12))
        batch = sample(logits, rows, together, history, generated).tolist()
        assert batch == [sample(logits[b:b + 1], [s], [g], history[b:b + 1], generated[b:b + 1]).item()
                         for b, (s, g) in enumerate(zip(rows, alone))]


def test_sampling_draws_tokens_in_proportion_to_their_probability():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    sampling = Sampling(temperature=1.0, seed=0)
    generator = sampling.generator("cpu")
    draws = torch.tensor([sample(probs.log()[None], [sampling], [generator]).item() for _ in range(4000)])
    freq = torch.bincount(draws, minlength=4) / 4000
    assert (freq - probs).abs().max() < 0.03


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"), ({"min_p": 2}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"temperature": float("nan")}, "temperature"), ({"seed": 1.5}, "seed"),
])
def test_out_of_range_sampling_parameters(tiny, kwargs, message):
    with pytest.raises(SmolError, match=message):
        generate(tiny, [1, 2], 3, **kwargs)


@pytest.mark.parametrize("prompt, message", [
    ([], "empty"), ([[1, 2], []], "prompt 1 is empty"), ([1, 99999], "not a token id"), ([1, -1], "not a token id"),
    ("hello", "not str"), (torch.zeros(2, 2, 2, dtype=torch.long), "shape"), ([1.5], "not a token id"),
])
def test_bad_prompts(tiny, prompt, message):
    with pytest.raises(SmolError, match=message):
        generate(tiny, prompt, 3)


def test_prompt_longer_than_the_context_window(tiny):
    context = tiny.config.max_position_embeddings
    with pytest.raises(SmolError, match="context window"):
        generate(tiny, [1] * (context + 1), 1)
    with pytest.raises(SmolError, match="context window"):
        generate(tiny, [1] * (context - 5), 10)
    with pytest.raises(SmolError, match="max_new_tokens"):
        generate(tiny, [1], -1)
    assert generate(tiny, [1] * (context - 5), 5, eos_token_id=None).shape == (1, context)


def test_logprobs_are_the_raw_logits_log_softmax_whatever_the_sampling(tiny):
    """Each Step's logprob is log-softmax of the model's logits before penalty, temperature and top-k/p, for
    the rows that ask; a row's tokens are the same with or without them."""
    prompts = [[5, 9, 200, 31], [7, 7]]
    params = dict(temperature=0.9, top_k=20, top_p=0.8, repetition_penalty=1.3, seed=3)
    plain = [[s.token if s else None for s in row]
             for row in stream(tiny, prompts, 6, eos_token_id=None, **params)]
    got = list(stream(tiny, prompts, 6, eos_token_id=None, logprobs=3, **params))
    assert [[s.token if s else None for s in row] for row in got] == plain
    with torch.inference_mode():
        for b, prompt in enumerate(prompts):
            tokens = [row[b].token for row in got]
            logits = tiny.logits(tiny.hidden_states(torch.tensor([prompt + tokens[:-1]])))[0, len(prompt) - 1:]
            want = torch.log_softmax(logits.float(), -1)
            for i, row in enumerate(got):
                lp = row[b].logprob
                assert lp.token == tokens[i] and lp.logprob == pytest.approx(want[i, tokens[i]].item(), abs=1e-4)
                top = want[i].topk(3)
                assert [t for t, _ in lp.top] == top.indices.tolist()
                assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert all(s.logprob is None for row in stream(tiny, prompts, 2) for s in row if s)
    assert next(stream(tiny, prompts, 1, logprobs=0))[0].logprob.top == ()
    for bad in (-1, 21, 2.0, True):
        with pytest.raises(SmolError, match="logprobs"):
            next(stream(tiny, prompts, 1, logprobs=bad))


def test_prompt_logprobs_score_each_token_given_the_ones_before(tiny, monkeypatch):
    from smollm2 import evaluate
    from smollm2.generation import engine, steps

    monkeypatch.setattr(steps, "PREFILL_CHUNK", 7)  # several chunks
    ids = [(i * 37) % 500 + 1 for i in range(30)]
    scored = engine.prompt_logprobs(tiny, ids, 2)
    assert scored[0] is None and [s.token for s in scored[1:]] == ids[1:] and all(len(s.top) == 2 for s in scored[1:])
    want, _ = evaluate.loglikelihood(tiny, ids[:1], ids[1:])
    assert sum(s.logprob for s in scored[1:]) == pytest.approx(want, abs=1e-4)
    assert engine.prompt_logprobs(tiny, ids[:1]) == [None]


@pytest.mark.parametrize("kv_cache_dtype", [None, "bf16", "int8"])
def test_the_slots_rows_no_longer_hold_go_back_to_the_os(kv_cache_dtype):
    """A server's memory follows its load: once a row retires, its cache row's slots are handed back (they read as
    zeros again), and a row that moves into a freed row leaves nothing of the one before past its own slots.
    Whatever the cache stores: an int8 cache's scales go back with its values (whole pages: the tiny model's
    whole window, 512 slots, makes a row's scales of a layer one page)."""
    from smollm2.generation.engine import Engine

    model = tiny_model(TINY["gqa"])
    engine = Engine(model, 2, 512, prefill_budget=None, kv_cache_dtype=kv_cache_dtype)
    long_, short = (Sequence(list(range(3, 3 + n)), new, Sampling(), ()) for n, new in ((20, 12), (5, 3)))
    rows = [engine.admit(long_), engine.admit(short)]
    with torch.inference_mode():
        while not short.finish_reason:
            engine.step()
        held = [t[:, 0, :, :rows[0].filled].clone() for t in engine.cache.parts]
        assert engine.decoding == [rows[0]]
        assert not any(t[:, 1].any() for t in engine.cache.parts)  # the short row's memory is back
        while not long_.finish_reason:
            engine.step()
    assert all(t.any() for t in held) and not any(t.any() for t in engine.cache.parts)


def test_the_cache_a_prefill_pass_writes_counts_as_used(monkeypatch):
    """kv_cache_usage (the server's vllm:kv_cache_usage_perc) while a prefill pass runs counts the slots its rows
    are being given, as vLLM counts a scheduled prompt's blocks: rows out of the queue and not yet decoding hold
    them already. Once every row has ended, nothing."""
    model = tiny_model(TINY["gqa"])
    engine = Engine(model, 2, 64, prefill_budget=None)
    rows = [engine.admit(Sequence(list(range(3, 3 + n)), 2, Sampling(), eos=())) for n in (20, 30)]
    seen = []
    fill = engine._fill
    monkeypatch.setattr(engine, "_fill", lambda plan: seen.append(engine.kv_cache_usage) or fill(plan))
    while not all(row.ended for row in rows):
        engine.step()
    assert seen and seen[0] == (20 + 30) / (2 * engine.cache.max_len)
    assert engine.kv_cache_usage == 0
