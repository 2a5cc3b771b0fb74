"""POST /inspect and the `steering` request extension: what Python's smollm2.lens computes, over HTTP, on the
scheduler's thread; a steered request changes its own answer alone."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from smollm2 import Tokenizer, graphs, lens, load, roofline
from smollm2.errors import SmolError
from smollm2.features import logit_effect, top_features
from smollm2.generation.hooks import Hooks
from smollm2.generation.engine import prompt_logprobs
from smollm2.server import create_app
from smollm2.sae import SAE, load_saes, save_sae
from smollm2.server import inspect as served_inspect
from test_server import NAME, running, while_streaming

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load(tiny_dir), Tokenizer.from_pretrained(tiny_dir)


@pytest.fixture(autouse=True)
def machine_in_tmp(tmp_path, monkeypatch):
    """Measured once per test at most, kept under tmp_path, never in the user's cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(roofline, "measure", lambda device: roofline.Machine(2e10, 1e11))


def test_inspect_returns_what_python_computes_on_the_scheduler_thread(tiny, monkeypatch):
    model, tokenizer = tiny
    ids = tokenizer.encode(PROMPT)
    threads = []
    hidden_states, logits = Hooks.hidden_states, model.logits

    def seen_pass(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return hidden_states(*args, **kwargs)

    def seen_logits(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return logits(*args, **kwargs)

    monkeypatch.setattr(Hooks, "hidden_states", seen_pass)
    monkeypatch.setattr(model, "logits", seen_logits)
    with TestClient(create_app(model, tokenizer, model_name=NAME)) as client:
        r = client.post("/inspect", json=dict(model=NAME, prompt=PROMPT, top_k=3, attention=[1, 0], profile=True))
        assert r.status_code == 200, r.text
        answer = r.json()
    assert threads and set(threads) == {"smollm2-scheduler"}
    monkeypatch.undo()

    assert answer["object"] == "inspection" and [t["id"] for t in answer["tokens"]] == ids
    assert [t["text"] for t in answer["tokens"]] == [tokenizer.token_text(i) for i in ids]
    assert answer["tokens"][0]["logprob"] is None
    scored = prompt_logprobs(model, ids, 3)
    for token, want in zip(answer["tokens"][1:], scored[1:]):
        assert token["logprob"] == pytest.approx(want.logprob, abs=1e-4)
        assert [t["id"] for t in token["top"]] == [t for t, _ in want.top]

    _, cache = lens.run_with_cache(model, [ids])
    probs, top = lens.logit_lens(model, lens.residual_stream(cache), 3)
    layers = model.config.num_hidden_layers
    assert len(answer["logit_lens"]) == layers + 1
    for layer, positions in enumerate(answer["logit_lens"]):
        assert [[t["id"] for t in position] for position in positions] == top[layer, 0].tolist()
        assert torch.allclose(torch.tensor([[t["prob"] for t in position] for position in positions]),
                              probs[layer, 0], atol=1e-6)
        assert positions[0][0]["text"] == tokenizer.token_text(positions[0][0]["id"])

    assert [a["layer"] for a in answer["attention"]] == [0, 1]  # sorted
    for item in answer["attention"]:
        pattern = cache[f"blocks.{item['layer']}.attn.hook_pattern"][0]
        assert len(item["heads"]) == model.config.num_attention_heads
        for head, rows in zip(pattern, item["heads"]):
            assert [len(row) for row in rows] == list(range(1, len(ids) + 1))  # causal: keys up to the query
            for q, row in enumerate(rows):
                assert row == pytest.approx(head[q, :q + 1].tolist(), abs=1e-6)

    profile = answer["profile"]
    assert profile["machine"] == dict(bandwidth=2e10, flops=1e11) and profile["tokens"] == len(ids)
    for phase in ("prefill", "decode"):
        ops = profile[phase]["ops"]
        assert {op["layer"] for op in ops} == {None, *range(layers)}
        assert {op["kind"] for op in ops} == {"embedding", "residual", "norm", "product", "attention", "activation",
                                              "sampling"}
        assert all(op["seconds"] > 0 and op["bytes"] > 0 for op in ops) and profile[phase]["served_seconds"] > 0


def test_inspect_a_chat_and_parts_on_demand(tiny):
    model, tokenizer = tiny
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    with TestClient(create_app(model, tokenizer, model_name=NAME)) as client:
        answer = client.post("/inspect", json=dict(model=NAME, messages=chat)).json()
        # a last assistant message is a finished turn; a last user message gets the assistant's header after it
        assert [t["id"] for t in answer["tokens"]] == tokenizer.apply_chat_template(chat, add_generation_prompt=False)
        asking = client.post("/inspect", json=dict(model=NAME, messages=chat[:1])).json()
        assert [t["id"] for t in asking["tokens"]] == tokenizer.apply_chat_template(chat[:1])
        assert len(answer["logit_lens"][0][0]) == 5 and answer["attention"] == [] and "profile" not in answer
        lean = client.post("/inspect", json=dict(model=NAME, prompt=PROMPT, logit_lens=False, attention=[1])).json()
        assert lean["logit_lens"] is None and [a["layer"] for a in lean["attention"]] == [1]


def test_bad_inspections_get_400_naming_the_field(tiny, monkeypatch):
    model, tokenizer = tiny
    assert served_inspect.MAX_INSPECT_TOKENS == 256
    monkeypatch.setattr(served_inspect, "MAX_INSPECT_TOKENS", 20)
    layers = model.config.num_hidden_layers
    with TestClient(create_app(model, tokenizer, model_name=NAME)) as client:
        for body, field, message in [
            ({}, "prompt", "either prompt or messages"),
            (dict(prompt="Hi", messages=[{"role": "user", "content": "Hi"}]), "prompt", "either prompt or messages"),
            (dict(prompt=""), "prompt", "1 to 20 tokens"),
            (dict(prompt="word " * 30), "prompt", "1 to 20 tokens"),
            (dict(messages=[{"role": "user", "content": "word " * 30}]), "messages", "1 to 20 tokens"),
            (dict(messages=[]), "messages", "at least 1"),
            (dict(messages=[{"role": "user", "content": 5}]), "messages.0.content", "string"),
            (dict(prompt="Hi", attention=[layers]), "attention.0", "not a block"),
            (dict(prompt="Hi", attention=[0, -1]), "attention.1", "not a block"),
            (dict(prompt="Hi", top_k=0), "top_k", "greater than or equal to 1"),
            (dict(prompt="Hi", top_k=21), "top_k", "less than or equal to 20"),
            (dict(prompt="Hi", profile="yes"), "profile", "boolean"),
        ]:
            r = client.post("/inspect", json=dict(model=NAME, **body))
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert error["param"] == field and message in error["message"], (body, error)
        r = client.post("/inspect", json=dict(model="other", prompt="Hi"))
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        assert client.get("/health").json()["waiting"] == 0


def chat(client, content: str, **extra) -> dict:
    r = client.post("/v1/chat/completions", json=dict(model=NAME, messages=[{"role": "user", "content": content}],
                                                      max_tokens=8, temperature=0, logprobs=True, top_logprobs=2,
                                                      **extra))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_a_steered_request_changes_its_answer_and_no_other(tiny):
    """Concurrent requests on one server, one of them steered toward a token: the others get exactly what they get
    alone, tokens and log-probabilities; the steered one, what it gets steered alone."""
    model, tokenizer = tiny
    steer = dict(steering=dict(layer=1, vector=(1000 * model.output_weight[7]).tolist()))
    questions = ["What is 2 + 2?", "Name a colour.", "Say hi.", "Count to three."]
    with running(create_app(model, tokenizer, model_name=NAME)) as url, \
            httpx.Client(base_url=url, timeout=120) as client:
        alone = [chat(client, q) for q in questions]
        steered_alone = chat(client, questions[1], **steer)
        with ThreadPoolExecutor(len(questions)) as pool:
            together = list(pool.map(lambda i: chat(client, questions[i], **(steer if i == 1 else {})),
                                     range(len(questions))))
        texts = client.post("/v1/chat/completions", json=dict(
            model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
            steering=dict(layer=0, toward="I love", away="I hate", scale=4)))
        assert texts.status_code == 200, texts.text
    assert [together[i] for i in (0, 2, 3)] == [alone[i] for i in (0, 2, 3)]
    assert together[1] == steered_alone
    tokens = [t["token"] for t in steered_alone["logprobs"]["content"]]
    assert tokens == [tokenizer.token_text(7)] * 8 != [t["token"] for t in alone[1]["logprobs"]["content"]]


def test_bad_steering_gets_400_naming_the_field(tiny):
    model, tokenizer = tiny
    C, layers = model.config.hidden_size, model.config.num_hidden_layers
    with TestClient(create_app(model, tokenizer, model_name=NAME)) as client:
        for steering, field, message in [
            (dict(layer=layers, vector=[0.0] * C), "steering.layer", "must be a block"),
            (dict(layer=-1, vector=[0.0] * C), "steering.layer", "must be a block"),
            (dict(layer=0, vector=[0.0] * (C - 1)), "steering.vector", f"must have {C} numbers"),
            (dict(layer=0), "steering", "either vector or both toward and away"),
            (dict(layer=0, toward="a"), "steering", "either vector or both toward and away"),
            (dict(layer=0, vector=[0.0] * C, toward="a", away="b"), "steering", "either vector or both"),
            (dict(layer=0, toward="a", away="b c"), "steering.toward", "2 to 64 tokens"),
            (dict(layer=0, toward="a b", away="word " * 70), "steering.away", "2 to 64 tokens"),
            (dict(layer=0, vector=[0.0] * C, scale=1000), "steering.scale", "less than or equal to 100"),
            (dict(layer=0, vector=["x"] * C), "steering.vector.0", "valid number"),
            (dict(layer="0", vector=[0.0] * C), "steering.layer", "valid integer"),
        ]:
            r = client.post("/v1/chat/completions", json=dict(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                                              steering=steering))
            assert r.status_code == 400, (steering, r.text)
            error = r.json()["error"]
            assert error["param"] == field and message in error["message"], (steering, error)
        # JSON's NaN, which Python's parser reads: no number
        r = client.post("/v1/chat/completions", content=f'{{"model": "{NAME}", "messages": [{{"role": "user", '
                        f'"content": "Hi"}}], "steering": {{"layer": 0, "vector": [NaN{", 0" * (C - 1)}]}}}}',
                        headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "steering.vector.0", r.text


def test_models_tell_the_page_the_models_shape(tiny):
    model, tokenizer = tiny
    with TestClient(create_app(model, tokenizer, model_name=NAME)) as client:
        (entry,) = client.get("/v1/models").json()["data"]
    config = model.config
    assert entry["meta"] == dict(n_vocab=config.vocab_size, n_ctx_train=config.max_position_embeddings,
                                 n_embd=config.hidden_size, n_layer=config.num_hidden_layers,
                                 n_head=config.num_attention_heads, n_head_kv=config.num_key_value_heads)


def test_the_page_and_its_files_are_served_without_the_key(tiny):
    model, tokenizer = tiny
    with TestClient(create_app(model, tokenizer, model_name=NAME, api_key="secret")) as client:
        page = client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "/static/app.js" in page.text and "http" not in page.text  # nothing fetched from elsewhere
        for name, kind in (("app.js", "javascript"), ("style.css", "text/css")):
            r = client.get(f"/static/{name}")
            assert r.status_code == 200 and kind in r.headers["content-type"]
            assert "http://" not in r.text and "https://" not in r.text
        assert client.post("/inspect", json=dict(model=NAME, prompt="Hi")).status_code == 401
        assert client.get("/static/missing.js").status_code == 404


def test_streams_running_meanwhile_go_on_between_the_pieces(tiny, monkeypatch):
    """The inspection is calls between the scheduler's steps: a running stream is not held for all of it."""
    model, tokenizer = tiny
    runs = []  # what the scheduler's thread ran, in order: a step of the engine, or a piece of the logit lens
    hidden_states, logit_lens = model.hidden_states, lens.logit_lens

    def step(*args, **kwargs):
        runs.append("step")
        return hidden_states(*args, **kwargs)

    def piece(*args, **kwargs):
        runs.append("lens")
        return logit_lens(*args, **kwargs)

    monkeypatch.setattr(model, "hidden_states", step)
    monkeypatch.setattr(lens, "logit_lens", piece)
    assert served_inspect.LENS_LAYERS_A_CALL == 4
    monkeypatch.setattr(served_inspect, "LENS_LAYERS_A_CALL", 1)
    answer = while_streaming(create_app(model, tokenizer, model_name=NAME), "/inspect",
                             dict(model=NAME, prompt=PROMPT))
    assert answer.status_code == 200
    pieces = [i for i, run in enumerate(runs) if run == "lens"]
    assert len(pieces) == model.config.num_hidden_layers + 1
    assert all("step" in runs[a:b] for a, b in zip(pieces, pieces[1:]))


# Sparse dictionaries over HTTP: features, a feature, graphs, and steering by a feature.

FEATURE, TOKEN, D_SAE = 5, 7, 32


@pytest.fixture(scope="module")
def dictionaries(tiny, tmp_path_factory) -> list:
    """Written in SAELens's format: an SAE entering block 1 whose feature FEATURE's decoder direction is token
    TOKEN's unembedding, one reading a norm's output (no logit effect), and a transcoder per block (a set: graphs)."""
    model, _ = tiny
    config, root = model.config, tmp_path_factory.mktemp("dictionaries")
    generator = torch.Generator().manual_seed(0)
    C = config.hidden_size

    def random(reads, writes=None, activation="relu", d_out=C):
        W_dec = 0.1 * torch.randn(D_SAE, d_out, generator=generator)
        if d_out == C:
            W_dec[FEATURE] = model.output_weight[TOKEN].detach() / model.output_weight[TOKEN].norm()
        encoder = C ** -0.5 * torch.randn(C, D_SAE, generator=generator)
        return SAE(reads, writes or reads, activation, writes is not None, encoder,
                   0.1 * torch.randn(D_SAE, generator=generator), W_dec, torch.zeros(d_out),
                   torch.full((D_SAE,), 0.05) if activation == "jumprelu" else None, None, None, writes is None, False)

    save_sae(random("blocks.1.hook_resid_pre"), root / "resid")
    save_sae(random("blocks.0.ln2.hook_normalized"), root / "normed")
    for layer in range(config.num_hidden_layers):
        save_sae(random(f"blocks.{layer}.ln2.hook_normalized", f"blocks.{layer}.hook_mlp_out", "jumprelu"),
                 root / "set" / f"mlp{layer}")
    return [str(root / "resid"), str(root / "normed"), str(root / "set")]


def serving(tiny, dictionaries):
    model, tokenizer = tiny
    app = create_app(model, tokenizer, model_name=NAME)
    served_inspect.serve_dictionaries(app, dictionaries)
    return app


def test_features_a_feature_and_a_graph_over_http(tiny, dictionaries):
    model, tokenizer = tiny
    ids = tokenizer.encode(PROMPT)
    saes = {name: sae for source in dictionaries for name, sae in load_saes(source, model).items()}
    with TestClient(serving(tiny, dictionaries)) as client:
        listed = client.get("/inspect/dictionaries").json()
        assert listed["graphs"] and [(d["name"], d["logit_effect"]) for d in listed["data"]] == [
            ("resid", True), ("normed", False), ("mlp0", True), ("mlp1", True)]
        found = client.post("/inspect/features", json=dict(model=NAME, prompt=PROMPT, sae="resid", k=3)).json()
        values, indices = top_features(model, saes["resid"], [ids], k=3)
        assert [t["id"] for t in found["tokens"]] == ids and found["hook_name"] == "blocks.1.hook_resid_pre"
        for position, top in enumerate(found["top"]):  # the active ones among the 3 strongest, strongest first
            active = values[0, position] > 0
            assert [f["index"] for f in top] == indices[0, position][active].tolist()
            assert [f["activation"] for f in top] == pytest.approx(values[0, position][active].tolist(), abs=1e-6)
        one = client.post("/inspect/feature", json=dict(model=NAME, prompt=PROMPT, sae="resid", index=FEATURE)).json()
        _, cache = lens.run_with_cache(model, [ids], ["blocks.1.hook_resid_pre"])
        want = saes["resid"].encode(cache["blocks.1.hook_resid_pre"])[0, :, FEATURE]
        assert one["activations"] == pytest.approx(want.tolist(), abs=1e-6)
        promoted, suppressed = logit_effect(model, saes["resid"], FEATURE)
        assert [t["id"] for t in one["promoted"]] == promoted.indices.tolist() and one["promoted"][0]["id"] == TOKEN
        assert [t["id"] for t in one["suppressed"]] == suppressed.indices.tolist()
        normed = client.post("/inspect/feature", json=dict(model=NAME, prompt=PROMPT, sae="normed", index=0)).json()
        assert normed["promoted"] is None and len(normed["activations"]) == len(ids)

        graph = client.post("/inspect/graph", json=dict(model=NAME, prompt=PROMPT, max_features=32)).json()
        transcoders = [saes["mlp0"], saes["mlp1"]]
        want = graphs.graph_json(graphs.attribute(model, transcoders, ids, max_features=32), tokenizer.decode,
                                 slug="smollm2")
        assert graph["metadata"] == want["metadata"] and graph["metadata"]["prompt"] == PROMPT
        assert [n["node_id"] for n in graph["nodes"]] == [n["node_id"] for n in want["nodes"]]
        assert [(link["source"], link["target"]) for link in graph["links"]] == \
            [(link["source"], link["target"]) for link in want["links"]]
        assert [link["weight"] for link in graph["links"]] == \
            pytest.approx([link["weight"] for link in want["links"]], abs=1e-5)
        aimed = client.post("/inspect/graph", json=dict(model=NAME, prompt=PROMPT, target=TOKEN)).json()
        assert [n["feature"] for n in aimed["nodes"] if n["feature_type"] == "logit"] == [TOKEN]


def test_bad_feature_requests_get_400_naming_the_field(tiny, dictionaries, monkeypatch):
    model, tokenizer = tiny
    with TestClient(serving(tiny, dictionaries)) as client:
        for path, body, status, field, message in [
            ("features", dict(sae="none"), 404, "sae", "no dictionary 'none'; this server has 'resid'"),
            ("features", dict(sae="resid", k=21), 400, "k", "less than or equal to 20"),
            ("feature", dict(sae="resid", index=D_SAE), 400, "index", f"0 to {D_SAE - 1}"),
            ("feature", dict(sae="resid", index=-1), 400, "index", "greater than or equal to 0"),
            ("graph", dict(target=model.config.vocab_size), 400, "target", "not a token id"),
            ("graph", dict(prompt="word " * 70), 400, "prompt", "1 to 64 tokens"),
            ("graph", dict(max_features=0), 400, "max_features", "greater than or equal to 1"),
        ]:
            r = client.post(f"/inspect/{path}", json=dict(model=NAME, prompt=PROMPT) | body)
            assert r.status_code == status, (body, r.text)
            error = r.json()["error"]
            assert error["param"] == field and message in error["message"], (body, error)
    with TestClient(create_app(model, tokenizer, model_name=NAME)) as client:  # no dictionaries served
        assert client.get("/inspect/dictionaries").json() == dict(object="list", graphs=False, data=[])
        r = client.post("/inspect/graph", json=dict(model=NAME, prompt=PROMPT))
        assert r.status_code == 400 and "no transcoder set" in r.json()["error"]["message"]
    with pytest.raises(SmolError, match="a dictionary named 'resid' is already served"):
        served_inspect.serve_dictionaries(create_app(model, tokenizer), dictionaries[:1] * 2)


@pytest.mark.parametrize("mode", ["add", "clamp"])
def test_a_request_steered_by_a_feature_changes_its_answer_and_no_other(tiny, dictionaries, mode):
    """As test_a_steered_request_changes_its_answer_and_no_other, steered by a feature (`steer`): added, or
    clamped, in the SAE entering block 1 whose feature points at token TOKEN."""
    model, tokenizer = tiny
    steer = dict(steer=[dict(feature=dict(sae="resid", index=FEATURE), value=1000.0, mode=mode)])
    questions = ["What is 2 + 2?", "Name a colour.", "Say hi.", "Count to three."]
    with running(serving(tiny, dictionaries)) as url, httpx.Client(base_url=url, timeout=120) as client:
        alone = [chat(client, q) for q in questions]
        steered_alone = chat(client, questions[1], **steer)
        with ThreadPoolExecutor(len(questions)) as pool:
            together = list(pool.map(lambda i: chat(client, questions[i], **(steer if i == 1 else {})),
                                     range(len(questions))))
    assert [together[i] for i in (0, 2, 3)] == [alone[i] for i in (0, 2, 3)]
    assert together[1] == steered_alone
    tokens = [t["token"] for t in steered_alone["logprobs"]["content"]]
    assert tokens == [tokenizer.token_text(TOKEN)] * 8 != [t["token"] for t in alone[1]["logprobs"]["content"]]


def test_bad_feature_steering_gets_400_naming_the_field(tiny, dictionaries):
    with TestClient(serving(tiny, dictionaries)) as client:
        for item, field, message in [
            (dict(feature=dict(sae="none", index=0), value=1.0), "steer.0.feature.sae", "no dictionary 'none'"),
            (dict(feature=dict(sae="resid", index=D_SAE), value=1.0), "steer.0.feature.index",
             f"feature must be a whole number from 0 to {D_SAE - 1}"),
            (dict(feature=dict(sae="normed", index=0), value=1.0), "steer.0.feature.sae", "not in the residual stream"),
            (dict(feature=dict(sae="resid", index=0), value=1.0, mode="multiply"), "steer.0.mode", "'add' or 'clamp'"),
            (dict(feature=dict(sae="resid", index=0), value=1e5), "steer.0.value", "less than or equal to 10000"),
            (dict(feature=dict(sae="resid", index=0)), "steer.0.value", "Field required"),
        ]:
            r = client.post("/v1/chat/completions", json=dict(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                                              max_tokens=2, steer=[item]))
            assert r.status_code == 400, (item, r.text)
            error = r.json()["error"]
            assert error["param"] == field and message in error["message"], (item, error)


# The README's example on the embedded model: a dictionary of countries, steering by one of them.

COUNTRIES = ["France", "Italy", "Germany", "Spain", "Japan", "Russia", "China", "Egypt", "Greece", "England"]
COUNTRIES_LAYER = 27


def countries_dictionary(model, tokenizer) -> SAE:
    """The README's dictionary (not a trained SAE: none ships for SmolLM2-135M): feature k is country k's
    direction in the stream entering block 27 at the last token of "The capital of {country} is", less the
    countries' mean; it encodes the stream's coefficient along it (the mean subtracted, ReLU above 0.2)."""
    point = f"blocks.{COUNTRIES_LAYER}.hook_resid_pre"
    streams = torch.stack([lens.run_with_cache(model, [tokenizer.encode(f"The capital of {country} is")],
                                               [point])[1][point][0, -1] for country in COUNTRIES])
    mean = streams.mean(0)
    directions = streams - mean
    encoder = (directions / directions.pow(2).sum(-1, keepdim=True)).T.contiguous()
    return SAE(point, point, "relu", False, encoder, torch.full((len(COUNTRIES),), -0.2), directions, mean, None,
               None, None, True, False)


def random_transcoder(layer: int, generator: torch.Generator, width: int = 576, d_sae: int = 256) -> SAE:
    """A random JumpReLU transcoder of the embedded model's block `layer` (the README's graph example's kind)."""
    def random(*shape, scale):
        return scale * torch.randn(*shape, generator=generator)
    return SAE(f"blocks.{layer}.ln2.hook_normalized", f"blocks.{layer}.hook_mlp_out", "jumprelu", True,
               random(width, d_sae, scale=width ** -0.5), random(d_sae, scale=0.1), random(d_sae, width, scale=0.1),
               torch.zeros(width), torch.full((d_sae,), 2.3), None, None, False, False)


def test_the_readme_steers_the_capital_of_france_by_a_feature(model, tmp_path):
    """The README's figures: at ` is`, the France feature is the strongest; it promotes ` Paris`; the completion
    ` Paris.` becomes ` Milan.` with the Italy feature added (as `smollm2 serve --sae countries` serves it)."""
    tokenizer = Tokenizer.from_pretrained()
    app = create_app(model, tokenizer, kv_cache_dtype="bf16")  # serve's default
    served_inspect.serve_dictionaries(app, [str(save_sae(countries_dictionary(model, tokenizer),
                                                        tmp_path / "countries"))])
    with TestClient(app) as client:
        body = dict(model="SmolLM2-135M-Instruct", prompt="The capital of France is")
        found = client.post("/inspect/features", json=body | dict(sae="countries", k=3)).json()
        assert COUNTRIES[found["top"][-1][0]["index"]] == "France"
        assert found["top"][-1][0]["activation"] == pytest.approx(0.80, abs=0.005)
        assert len(found["top"][0]) == 3 and found["top"][0][-1]["activation"] > 3  # the sink: several, strongly
        assert found["top"][0][0]["activation"] > 8 * found["top"][-1][0]["activation"]
        france = client.post("/inspect/feature", json=body | dict(sae="countries", index=0, k=5)).json()
        assert [t["text"] for t in france["promoted"]][:4] == [" France", " French", "French", " Paris"]
        answers = {}
        for name, steer in [("plain", []), ("italy", [dict(feature=dict(sae="countries", index=1), value=1.0)])]:
            r = client.post("/v1/completions", json=body | dict(max_tokens=3, temperature=0, steer=steer))
            assert r.status_code == 200, r.text
            answers[name] = r.json()["choices"][0]["text"]
    assert answers == dict(plain=" Paris.\n", italy=" Milan.\n"), (answers, found["top"][-1], france["promoted"])
