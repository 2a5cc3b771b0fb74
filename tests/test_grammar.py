"""Structured output: every answer the embedded model writes under a grammar parses and fits its schema (checked
by jsonschema), and numbers are bounded, so that no answer runs on inside one."""

from __future__ import annotations

import json

from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
import torch
from fastapi.testclient import TestClient

from smollm2 import Tokenizer, load
from smollm2.errors import SmolError
from smollm2.generation import grammar as grammar_module
from smollm2.generation.grammar import Grammar
from smollm2.generation import generate, stream
from smollm2.server import create_app
from test_server import running

MAX_NEW_TOKENS = 64
LARGEST = 10**16 - 1  # the largest number of 16 digits
SERVED = "smollm2"  # the model name the test servers answer to

# Integers and numbers mostly without a range, or with one end open: the grammar bounds their digits.
NAME = {"type": "string", "maxLength": 24}
PERSON = {"type": "object", "properties": {"name": NAME, "age": {"type": "integer"},
                                           "student": {"type": "boolean"}},
          "required": ["name", "age", "student"]}
AUTHOR = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}  # as a user sent it, and a greedy answer about Hamlet once ran "age": 10000...
CITY = {"type": "object", "properties": {"city": NAME, "country": NAME,
                                         "population": {"type": "integer", "minimum": 0}},
        "required": ["city", "country", "population"]}
TAGS = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                  "minItems": 1, "maxItems": 3}},
        "required": ["tags"]}
ANSWER = {"type": "object", "properties": {"answer": {"type": "integer"}, "sure": {"type": "boolean"}},
          "required": ["answer", "sure"]}
NESTED = {"type": "object", "properties": {
    "book": {"type": "object", "properties": {"title": NAME, "year": {"type": "integer", "maximum": 2100}},
             "required": ["title", "year"]},
    "rating": {"enum": [1, 2, 3, 4, 5]}},
    "required": ["book", "rating"]}
PRICE = {"type": "object", "properties": {"item": NAME, "price": {"type": "number"},
                                          "currency": {"enum": ["USD", "EUR", "GBP"]}},
         "required": ["item", "price", "currency"]}
MOOD = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad", "neutral"]},
                                         "words": {"type": "array", "items": {"enum": ["good", "bad", "fine"]},
                                                   "maxItems": 2}},
        "required": ["mood", "words"]}

SCHEMAS = {"person": PERSON, "author": AUTHOR, "city": CITY, "tags": TAGS, "answer": ANSWER, "nested": NESTED,
           "price": PRICE, "mood": MOOD}
PROMPTS = {
    "person": ["Describe a student named Ana as JSON.", "Give me a fictional person as JSON.",
               "Return JSON about your favourite teacher.", "Invent a character for a story, as JSON.",
               "Who is Tom, 30, not a student? JSON please."],
    "author": ["Who wrote Hamlet?", "Who painted the Mona Lisa?", "Who discovered penicillin? JSON.",
               "Who was the first man on the Moon? Answer in JSON.", "Who composed the Ninth Symphony?"],
    "city": ["Tell me about Paris as JSON.", "Describe Tokyo in JSON.", "A city in Brazil, as JSON.",
             "Where do kangaroos live? Give a city as JSON.", "The capital of Italy, as JSON."],
    "tags": ["Tag this text as JSON: 'The cat sat on the mat.'", "Give tags for a cooking blog, JSON.",
             "Keywords for a football match report, as JSON.", "Tags for a photo of mountains, JSON.",
             "Label this: 'Stocks fell today.' JSON."],
    "answer": ["What is 2 + 3? Answer in JSON.", "How many legs does a spider have? JSON.",
               "What is 10 times 10? JSON.", "How many days are in a week? JSON.", "What is 7 minus 9? JSON."],
    "nested": ["Recommend a book as JSON.", "Review a novel from 1990, as JSON.",
               "Rate the book 'Dune' in JSON.", "Your favourite book and a rating, JSON.",
               "A classic novel and how good it is, as JSON."],
    "price": ["How much is a coffee? JSON.", "Price of a bicycle in euros, as JSON.",
              "What does a book cost in London? JSON.",
              "Price of a sandwich in New York, JSON.", "How much is a train ticket in Germany? JSON."],
    "mood": ["How do you feel today? JSON.", "Describe the mood of 'I lost my keys', as JSON.",
             "Mood of a sunny holiday, in JSON.",
             "The mood of a rainy Monday, JSON.", "How does a winner feel? JSON."],
}
JSON_OBJECT_PROMPTS = [
    'Reply with a JSON object with the key "answer": what is the capital of France?',
    'Give a JSON object {"name": ..., "age": ...} for a person called Bob.',
    'Return a JSON object with one key "ok" set to true.',
    'Output JSON: the key "fruit" with the name of a red fruit.',
    'Reply in JSON with the key "sum": what is 1 + 1?',
    'Return a JSON object with the keys "x" and "y" for the point (1, 2).',
    'Give a JSON object with the key "color" for the colour of snow.',
    'Return a JSON object with the key "animal" naming a pet.',
    'Return a JSON object with the key "day" naming the first day of the week.',
    'Reply in JSON with the key "planet": which planet do we live on?',
]
CASES = ([("json_schema", key, prompt) for key, prompts in PROMPTS.items() for prompt in prompts]
         + [("json_object", None, prompt) for prompt in JSON_OBJECT_PROMPTS])
assert len(CASES) == 50


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained()


def response_format(i: int) -> dict:
    kind, key, _ = CASES[i]
    if kind == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": key, "schema": SCHEMAS[key]}}


def check_answer(i: int, text: str, finish_reason: str) -> None:
    kind, key, _ = CASES[i]
    assert finish_reason == "stop", f"case {i}: no EOS within {MAX_NEW_TOKENS} tokens: {text!r}"
    value = json.loads(text)
    if kind == "json_object":
        assert isinstance(value, dict), text
    else:
        jsonschema.validate(value, SCHEMAS[key])


def sampling(i: int) -> dict:
    # Even cases greedy, odd ones sampled with a seed: the grammar must hold for any choice it allows.
    return dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.7, seed=i)


@pytest.mark.slow
def test_fifty_answers_through_the_server_parse_and_validate(model, tokenizer):
    """All 50 at once, 8 rows a step: every row masked by its own grammar in one batch."""
    app = create_app(model, tokenizer, model_name=SERVED, max_batch_size=8)

    def ask(url: str, i: int) -> tuple[str, str]:
        body = dict(model=SERVED, messages=[{"role": "user", "content": CASES[i][2]}], max_tokens=MAX_NEW_TOKENS,
                    response_format=response_format(i), **sampling(i))
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]

    with running(app) as url, ThreadPoolExecutor(len(CASES)) as pool:
        answers = list(pool.map(lambda i: ask(url, i), range(len(CASES))))
    for i, (text, finish_reason) in enumerate(answers):
        check_answer(i, text, finish_reason)


@pytest.mark.parametrize("i", [0, 1, 40, 45])
def test_python_gives_the_server_s_answer(model, tokenizer, i):
    """stream()/generate() and the server run one core: the same constrained answer, token for token."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": CASES[i][2]}])
    new = generate(model, [ids], MAX_NEW_TOKENS, tokenizer=tokenizer, response_format=response_format(i),
                   **sampling(i))[0, len(ids):].tolist()
    eos = new.index(tokenizer.eos_token_id)
    check_answer(i, tokenizer.decode(new[:eos]), "stop")
    app = create_app(model, tokenizer, model_name=SERVED)
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json=dict(
            model=SERVED, messages=[{"role": "user", "content": CASES[i][2]}], max_tokens=MAX_NEW_TOKENS,
            response_format=response_format(i), **sampling(i)))
    assert r.json()["choices"][0]["message"]["content"] == tokenizer.decode(new[:eos])


def test_mask_width_and_accept(tokenizer):
    grammar = Grammar.from_response_format({"type": "json_object"}, tokenizer)
    m = grammar.matcher()
    V = tokenizer.vocab_size
    mask = m.mask()
    assert mask.shape == (V,) and mask.dtype == torch.bool
    assert mask[tokenizer.encode("{")[0]] and not mask[tokenizer.encode("hello")[0]]
    assert not mask[tokenizer.eos_token_id]  # nothing written yet: EOS would leave no JSON
    wide = m.mask(V + 64)  # a model whose embedding is padded past the tokenizer's vocabulary
    assert torch.equal(wide[:V], mask) and not wide[V:].any()
    assert torch.equal(m.mask(V - 10), mask[:V - 10])
    row = m.allowed(torch.zeros(V + 64))
    assert torch.equal(row == 0, wide) and (row[~wide] == float("-inf")).all()
    with pytest.raises(SmolError, match="not allowed"):
        m.accept(tokenizer.encode("hello")[0])
    with pytest.raises(SmolError, match="not allowed"):
        m.accept(V + 5)
    for t in tokenizer.encode('{"a": "'):
        m.accept(t)
    specials = [i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special]
    assert len(specials) > 2 and not m.mask()[specials].any()  # in a string, "<|im_start|>" is no text
    for t in tokenizer.encode('b"}'):
        m.accept(t)
    assert not m.finished
    only = m.mask()
    assert only[tokenizer.eos_token_id] and only.sum() == 1  # the object is complete: EOS alone may follow
    m.accept(tokenizer.eos_token_id)
    assert m.finished
    with pytest.raises(SmolError, match="after the grammar's end"):
        m.accept(tokenizer.eos_token_id)


def test_cache_is_bounded_and_keyed_by_schema(tokenizer, monkeypatch):
    monkeypatch.setattr(grammar_module, "CACHE_SIZE", 3)
    rf = lambda n: {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {
        f"k{n}": {"type": "integer"}}, "required": [f"k{n}"]}}}
    first = Grammar.from_response_format(rf(0), tokenizer)
    assert Grammar.from_response_format(rf(0), tokenizer)._compiled is first._compiled
    for n in range(1, 5):
        Grammar.from_response_format(rf(n), tokenizer)
    assert len(grammar_module._compiled) <= 3
    assert Grammar.from_response_format(rf(0), tokenizer)._compiled is not first._compiled
    assert Grammar.from_response_format({"type": "text"}, tokenizer) is None


@pytest.mark.parametrize("response_format, message", [
    ("json", "must be an object"),
    ({"type": "xml"}, "is not one of"),
    ({"type": "json_schema"}, "needs"),
    ({"type": "json_schema", "json_schema": {"schema": [1, 2]}}, "must be an object, not list"),
    ({"type": "json_schema", "json_schema": {"schema": "{}"}}, "must be an object, not str"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "strnig"}}}, "unknown type 'strnig' at #"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {
        "a": {"type": "lizard"}}}}}, "unknown type 'lizard' at #/properties/a"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {
        f"p{i}": {"type": "string", "description": "x" * 100} for i in range(1000)}}}}, "characters, more than"),
    ({"type": "json_schema", "json_schema": {"schema": {"$ref": "#/definitions/missing"}}}, "missing"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "(unclosed"}}}, "json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": False}}, "Unsatisfiable schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "string", "format": "colour"}}}, "format: colour"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "array", "contains": {}}}}, "contains"),
])
def test_hostile_response_formats(tokenizer, response_format, message):
    with pytest.raises(SmolError, match=message):
        Grammar.from_response_format(response_format, tokenizer)


def test_deeply_nested_schema(tokenizer):
    schema = {"type": "string"}
    for _ in range(100):
        schema = {"type": "array", "items": schema}
    with pytest.raises(SmolError, match="nested deeper than"):
        Grammar.from_response_format({"type": "json_schema", "json_schema": {"schema": schema}}, tokenizer)
    schema = {}
    node = schema
    for _ in range(5000):  # deeper than json.dumps recurses
        node["items"] = node = {}
    with pytest.raises(SmolError):
        Grammar.from_response_format({"type": "json_schema", "json_schema": {"schema": schema}}, tokenizer)


def test_property_named_type(tokenizer):
    schema = {"type": "object", "properties": {"type": {"type": "string"}}, "required": ["type"]}
    m = Grammar.from_response_format({"type": "json_schema", "json_schema": {"schema": schema}}, tokenizer).matcher()
    for t in tokenizer.encode('{"type": "x"}') + [tokenizer.eos_token_id]:
        m.accept(t)
    assert m.finished


@pytest.mark.parametrize("response_format, message", [
    ({"type": "xml"}, "is not one of"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "strnig"}}}, "unknown type 'strnig'"),
    ("json", "response_format"),
])
def test_a_bad_response_format_is_a_400_naming_it_and_the_server_goes_on(tiny_dir, response_format, message):

    model, tokenizer = load(tiny_dir), Tokenizer.from_pretrained(tiny_dir)
    body = dict(model=SERVED, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0)
    with TestClient(create_app(model, tokenizer, model_name=SERVED)) as client:
        before = client.post("/v1/chat/completions", json=body).json()
        r = client.post("/v1/chat/completions", json=dict(body, response_format=response_format))
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "response_format"
        assert client.post("/v1/chat/completions", json=body).json()["choices"] == before["choices"]
        # A constrained answer from a random model: still JSON, cut short only by max_tokens.
        r = client.post("/v1/chat/completions",
                        json=dict(body, max_tokens=200, response_format={"type": "json_object"}))
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_response_format_needs_a_tokenizer(tiny_dir):

    with pytest.raises(SmolError, match="needs a tokenizer"):
        generate(load(tiny_dir), [[1, 2]], 4, response_format={"type": "json_object"})


def accepts(grammar: Grammar, tokenizer: Tokenizer, text: str) -> bool:
    """Whether the grammar allows text as (the start of) an answer."""
    matcher = grammar.matcher()
    try:
        for t in tokenizer.encode(text):
            matcher.accept(t)
    except SmolError:
        return False
    return True


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}


@pytest.mark.parametrize("response_format, prefix", [
    ({"type": "json_object"}, '{"a": '), ({"type": "json_object"}, '{"a": [1, {"b": -'),
    (schema_format({"type": "integer"}), ""), (schema_format({"type": "number"}), "-"),
    (schema_format({"type": ["integer", "null"]}), ""), (schema_format({"type": "integer", "minimum": 5}), ""),
    (schema_format({"type": "number", "exclusiveMaximum": 0}), "-"),
    (schema_format({"type": "object", "additionalProperties": {"type": "number"}}), '{"x": '),
    (schema_format({"type": "array", "items": {}}), "[true, "),
])
def test_numbers_have_at_most_16_digits_before_and_after_the_point_and_in_the_exponent(tokenizer, response_format,
                                                                                     prefix):
    """As llama.cpp's schema converter bounds them: a small model cannot go on writing one digit after another."""
    grammar = Grammar.from_response_format(response_format, tokenizer)
    assert accepts(grammar, tokenizer, prefix + "9" * 16) and not accepts(grammar, tokenizer, prefix + "9" * 17)
    if "integer" not in json.dumps(response_format) and "minimum" not in json.dumps(response_format) \
            and "Maximum" not in json.dumps(response_format):  # a number without a range: fraction and exponent
        assert accepts(grammar, tokenizer, prefix + "1." + "5" * 16)
        assert not accepts(grammar, tokenizer, prefix + "1." + "5" * 17)
        assert accepts(grammar, tokenizer, prefix + "1.5e-" + "5" * 16)
        assert not accepts(grammar, tokenizer, prefix + "1.5e-" + "5" * 17)


def test_a_range_given_whole_is_the_schema_s_own(tokenizer):
    huge = Grammar.from_response_format(schema_format({"type": "integer", "minimum": 0, "maximum": 10**18}), tokenizer)
    assert accepts(huge, tokenizer, "9" * 18) and not accepts(huge, tokenizer, "9" * 19)
    beyond = Grammar.from_response_format(schema_format({"type": "integer", "minimum": 10**17}), tokenizer)
    assert accepts(beyond, tokenizer, "1" + "0" * 17)  # the schema's own number is longer than the bound
    past = Grammar.from_response_format(schema_format({"type": "integer", "exclusiveMinimum": LARGEST}), tokenizer)
    assert accepts(past, tokenizer, "1" + "0" * 16)  # one digit more than the schema's own


def test_an_answer_pushed_to_write_digits_still_ends_as_valid_json(tiny_dir):
    """A model that would write digits for ever (logit_bias pushes them here) ends its number after 16, then its
    JSON: without the bound it ran to max_tokens inside the number, as the embedded model once did."""

    model, tokenizer = load(tiny_dir), Tokenizer.from_pretrained(tiny_dir)
    digits = {tokenizer.encode(d)[0]: 30.0 for d in "123456789"}  # not "0", after which an integer ends
    age = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
    steps = [s for (s,) in stream(model, [tokenizer.encode("How old?")], 64, tokenizer=tokenizer,
                                  response_format=schema_format(age), logit_bias=digits)]
    text = "".join(s.text for s in steps)
    assert steps[-1].finish_reason == "stop", text
    assert len(str(abs(json.loads(text)["age"]))) == 16


def test_digits_are_bounded_in_numbers_only(tokenizer):
    """The bound is on numbers: a string's digits and the free text before tool calls are the answer's own."""
    text = Grammar.from_response_format(schema_format({"type": "array", "items": {"type": "string"}}), tokenizer)
    assert accepts(text, tokenizer, '["' + "1" * 40 + '", "\\"' + "2" * 40)
    tagged = Grammar.from_tagged_json({"type": "integer"}, tokenizer, "<n>", "</n>", anywhere=True)
    assert accepts(tagged, tokenizer, "1" * 40 + " <n>" + "9" * 16)
    assert not accepts(tagged, tokenizer, "1" * 40 + " <n>" + "9" * 17)


def test_a_schema_s_own_options_cannot_free_the_whitespace(tokenizer):
    loose = {"x-guidance": {"whitespace_flexible": True, "whitespace_pattern": "[ ]+"}, "type": "array",
             "items": {"type": "integer"}}
    grammar = Grammar.from_response_format(schema_format(loose), tokenizer)
    assert accepts(grammar, tokenizer, "[1, 2]") and not accepts(grammar, tokenizer, "[1,  2]")


def test_objects_take_no_properties_their_schema_does_not_name_unless_it_says_so(tokenizer):
    named = {"type": "object", "properties": {"a": {"type": "integer"}}}
    closed = Grammar.from_response_format(schema_format(named), tokenizer)
    assert accepts(closed, tokenizer, '{"a": 1}') and not accepts(closed, tokenizer, '{"a": 1, "b"')
    open_ = Grammar.from_response_format(schema_format({**named, "additionalProperties": True}), tokenizer)
    assert accepts(open_, tokenizer, '{"a": 1, "b": [true]}')
    merged = {"allOf": [named, {"properties": {"b": {"type": "string"}}}]}  # each part's properties, together
    assert accepts(Grammar.from_response_format(schema_format(merged), tokenizer), tokenizer, '{"a": 1, "b": "x"}')


# Regexes whose automata grow with each counted repetition: those llguidance's lexer cannot start within its fuel,
# and those it builds as tokens come, each step within that fuel.
REFUSED_PATTERNS = ["[^a]{0,40}[^b]{0,40}[^c]{0,40}[^d]{0,40}[^e]{0,40}[^f]{0,40}", "((.{0,20}){0,20}){0,5}x"]
BOUNDED_PATTERNS = ["[^a]{0,40}" * 6, "([^a]{0,40}){6}b", "(.{0,20}){0,20}x", "(.{1,9}){1,9}(.{1,9}){1,9}(.{1,9}){1,9}"]


@pytest.mark.parametrize("pattern", REFUSED_PATTERNS)
def test_a_pattern_too_costly_to_start_is_refused_at_once(tokenizer, pattern):
    with pytest.raises(SmolError, match="response_format regex: lexer error: too many expressions"):
        Grammar.from_response_format({"type": "regex", "pattern": pattern}, tokenizer)


@pytest.mark.parametrize("response_format", [{"type": "regex", "pattern": p} for p in BOUNDED_PATTERNS] + [
    schema_format({"type": "string", "pattern": p}) for p in BOUNDED_PATTERNS + REFUSED_PATTERNS])
def test_a_costly_pattern_is_bounded_at_each_step(tokenizer, response_format):
    """Inside a JSON string the same patterns start within the fuel: their every step stays within it too (or
    the grammar gives up, and the answer ends cut short). Never a hang."""
    import time

    rng = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    matcher = Grammar.from_response_format(response_format, tokenizer).matcher()
    for _ in range(32):
        allowed = matcher.mask().nonzero()[:, 0]
        token = allowed[torch.randint(len(allowed), (1,), generator=rng)].item()
        if token == tokenizer.eos_token_id:
            break
        matcher.accept(token)
    assert time.perf_counter() - start < 10  # a step's fuel is ~15 ms of one core; 10 s is a hang


def test_a_grammar_that_gives_up_ends_its_answer_with_length(tokenizer):
    """llguidance may run out of fuel at a later step: the answer then ends where it stands, cut short."""
    from smollm2.generation.sampling import Sampling
    from smollm2.generation.sequence import Sequence

    grammar = Grammar.from_response_format({"type": "json_object"}, tokenizer)
    sequence = Sequence([1], 16, Sampling(), [tokenizer.eos_token_id], tokenizer=tokenizer, grammar=grammar)
    sequence.accept(tokenizer.encode("{")[0])
    sequence.matcher._m.consume_token(tokenizer.encode("}}")[0])  # as a lexer out of fuel, llguidance's error state
    allowed = sequence.matcher.mask()
    assert allowed[tokenizer.eos_token_id] and allowed.sum() == 1
    assert sequence.accept(tokenizer.eos_token_id).finish_reason == "length"


def test_structured_output_needs_only_the_package_s_own_dependencies(tokenizer, monkeypatch):
    """`pip install smollm2` alone: llguidance is a base dependency, and a grammar compiles and masks with neither
    transformers nor xgrammar importable."""
    import pathlib
    import re
    import sys

    pyproject = (pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text()
    base = re.search(r"^dependencies = \[(.*?)^\]", pyproject, re.S | re.M).group(1)
    assert '"llguidance' in base and "xgrammar" not in pyproject
    for name in ("transformers", "xgrammar"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails
    grammar = Grammar.from_response_format(schema_format({"type": "object", "properties": {
        "unseen": {"type": "boolean"}}, "required": ["unseen"]}), tokenizer)
    assert accepts(grammar, tokenizer, '{"unseen": true}')
