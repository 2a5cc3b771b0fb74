"""LoRA adapters served over one base model (generation/adapters.py, server/adapters.py): rows of 4 adapters and the
base in one pass against each adapter merged into a model of its own (lora.with_adapter), the memory they hold,
and vLLM's routes to load and unload them while serving.

The tolerance: a row's logits within 1e-4 of its merged model's, relative to their largest magnitude (measured on
the 135M model with 4 random rank-8 adapters: 3e-6), and its greedy tokens equal. Rows without an adapter: in a
pass of the base's alone, the base model's own bits (the pass runs on it); in a decoding pass with adapter rows
(the whole-step kernel, which adds each adapter row's update itself), the bits of the base model's own step; in
a prompt's pass with adapter rows, those of the base model's per-layer path over the same rows.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from conftest import TINY, tiny_model
from test_lora import ALL
from test_server import running

from smollm2 import SmolError, Tokenizer, generate, load, save
from smollm2.generation.adapters import Adapters, read_lora
from smollm2.generation.engine import Engine, Row
from smollm2.generation.sampling import Sampling
from smollm2.generation.sequence import Sequence
from smollm2.lora import add_lora, save_adapter, with_adapter
from smollm2.server import create_app

NAMES = ("a", "b", "c", "d")
TOLERANCE = 1e-4
LONG = 300  # new tokens: a stream still going when its adapter is unloaded


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Path:
    """A tiny base (the real tokenizer) and 4 adapters of it: ranks 2, 4, 6, 8; every linear layer or q and v."""
    path = tmp_path_factory.mktemp("adapters")
    save(tiny_model(TINY["gqa"]), path / "base")
    Tokenizer.from_pretrained().save_pretrained(path / "base")
    for i, name in enumerate(NAMES):
        lora = add_lora(tiny_model(TINY["gqa"]), r=2 + 2 * i, alpha=8.0,
                        targets=ALL if i % 2 == 0 else ("q_proj", "v_proj"))
        torch.manual_seed(i)
        with torch.no_grad():  # B large enough that each adapter changes the tiny model's greedy answers
            for key, p in lora.named_parameters():
                if ".lora_B." in key:
                    p.normal_(0, 0.5)
        save_adapter(lora, path / name)
    return path


def decode(model, prompts, names, loras, steps: int) -> list[list[int]]:
    """Greedy tokens of every prompt, all rows in one engine, each row with its adapter (None: the base)."""
    with torch.inference_mode():
        engine = Engine(model, len(prompts), 64, prefill_budget=None, adapters=loras)
        rows = [engine.queue(Row(Sequence(prompt, steps, Sampling(), eos=()), adapter=loras.loaded.get(name)))
                for prompt, name in zip(prompts, names)]
        while not all(row.sequence.finish_reason for row in rows):
            engine.step()
    return [row.sequence.tokens for row in rows]


def loaded(model, path: Path) -> Adapters:
    adapters = Adapters(model)
    for name in NAMES:
        adapters.loaded[name] = read_lora(model, name, path / name)
    return adapters


def test_one_pass_of_four_adapters_and_the_base_against_the_merged_models(served):
    base = load(served / "base")
    adapters = loaded(base, served)
    names = [None, "a", "b", "c", "d", None]
    torch.manual_seed(0)
    ids = torch.randint(0, base.config.vocab_size, (len(names), 8))
    with torch.inference_mode():
        model = adapters.model_for([None if n is None else adapters.loaded[n] for n in names])
        assert model is adapters.adapted
        mixed = model(ids)
        own = base(ids)  # the base's pass over the same rows
        for b, name in enumerate(names):
            alone = base(ids[b:b + 1]) if name is None else with_adapter(base, served / name)(ids[b:b + 1])
            assert (mixed[b] - alone[0]).abs().max() <= TOLERANCE * alone.abs().max()
            assert torch.equal(mixed[b].argmax(-1), alone[0].argmax(-1))
            if name is None:
                assert torch.equal(mixed[b], own[b])  # bit for bit


def test_each_row_of_a_mixed_batch_decodes_its_merged_models_tokens(served):
    base = load(served / "base")
    adapters = loaded(base, served)
    prompts = [[1, 5, 9, 200, 17], [3, 4, 5], [7, 8, 9, 10, 11, 12], [100, 200], [42] * 5, [1, 2, 3], [9, 9, 4]]
    names = [None, "a", "b", "c", "d", None, "a"]
    got = decode(base, prompts, names, adapters, 12)
    merged = {name: with_adapter(base, served / name) for name in NAMES}
    for prompt, name, tokens in zip(prompts, names, got):
        model = base if name is None else merged[name]
        assert tokens == generate(model, [prompt], 12, temperature=0)[0, len(prompt):].tolist()
    same = [10, 11, 12, 13]  # one prompt, five models: five answers
    assert len({tuple(t) for t in decode(base, [same] * 5, [None, *NAMES], adapters, 6)}) == 5


def test_a_decoding_pass_with_adapter_rows_runs_the_whole_step_kernel(served):
    """The accelerator's decoding step adds each adapter row's update itself: its base rows get the bits of the base
    model's own step alone, its adapter rows their merged models' logits within the tolerance."""
    from smollm2.generation.steps import decode_step, prefill_chunk
    from smollm2.kv_cache import KVCache

    base = load(served / "base")
    if "accelerator" not in vars(base):
        pytest.skip("no CPU kernels here")
    adapters = loaded(base, served)
    names = [None, "a", "b", "c", "d", None]
    models = [base if name is None else with_adapter(base, served / name) for name in names]
    torch.manual_seed(0)
    prompts = torch.randint(0, base.config.vocab_size, (len(names), 8))
    nxt = torch.randint(0, base.config.vocab_size, (len(names), 1))

    def prefilled() -> KVCache:  # each row's prompt by its own (merged) model
        cache = KVCache(base.config, len(names), 16)
        for b, model in enumerate(models):
            prefill_chunk(model, prompts[b:b + 1], cache.view(slice(b, b + 1)), 0)
        return cache

    with torch.inference_mode():
        model = adapters.model_for([None if n is None else adapters.loaded[n] for n in names])
        runs = model.accelerator.kernel_runs["blocks"]
        mixed = decode_step(model, nxt, torch.full((len(names), 1), 8), prefilled(), None)
        assert model.accelerator.kernel_runs["blocks"] == runs + 1  # one kernel call for the whole pass
        cache = prefilled()
        for b, (name, own) in enumerate(zip(names, models)):
            alone = decode_step(own, nxt[b:b + 1], torch.full((1, 1), 8), cache.view(slice(b, b + 1)), None)[0]
            if name is None:
                assert torch.equal(mixed[b], alone)  # bit for bit
            else:
                assert (mixed[b] - alone).abs().max() <= TOLERANCE * alone.abs().max()
                assert torch.equal(mixed[b].argmax(), alone.argmax())


def test_a_pass_without_adapter_rows_is_the_base_models_own(served):
    base = load(served / "base")
    adapters = loaded(base, served)
    assert adapters.model_for([None, None]) is base
    prompts = [[1, 5, 9, 200, 17], [3, 4, 5]]
    assert decode(base, prompts, [None, None], adapters, 10) == decode(base, prompts, [None, None], Adapters(base), 10)


def test_adapter_rows_neither_read_nor_fill_the_prefix_cache(served):
    """Their keys and values are not the base's: a base row after an adapter row of the same prompt computes its
    own, and an adapter row after a base row does not take the base's."""
    from smollm2.generation.prefix_cache import PrefixCache

    base = load(served / "base")
    adapters = loaded(base, served)
    prompt = list(range(1, 40))
    cache = PrefixCache(1 << 24)
    with torch.inference_mode():
        engine = Engine(base, 1, 64, prefill_budget=None, adapters=adapters, prefix_cache=cache)
        for name in ("a", None, "a"):
            row = engine.queue(Row(Sequence(prompt, 4, Sampling(), eos=()), adapter=adapters.loaded.get(name)))
            while not row.sequence.finish_reason:
                engine.step()
            assert (cache.bytes > 0) == (engine.prefilled > len(prompt))  # kept by the base row alone
            model = base if name is None else with_adapter(base, served / name)
            assert row.sequence.tokens == generate(model, [prompt], 4, temperature=0)[0, len(prompt):].tolist()
    assert engine.prefilled == 3 * len(prompt)  # every prompt computed: none taken from the cache


def test_an_adapter_holds_its_matrices_alone(served):
    from safetensors.torch import load_file

    base = load(served / "base")
    adapters = loaded(base, served)
    for name in NAMES:
        tensors = load_file(served / name / "adapter_model.safetensors")
        assert adapters.loaded[name].nbytes == sum(t.numel() * 4 for t in tensors.values())  # fp32, as the model
    # the adapted copy shares every tensor: it adds its wrappers alone
    assert {id(t) for t in (*adapters.adapted.parameters(), *adapters.adapted.buffers())} <= \
        {id(t) for t in (*base.parameters(), *base.buffers())}


def test_a_bad_adapter_is_one_line(served, tmp_path):
    with pytest.raises(SmolError) as e:
        read_lora(load(served / "base"), "x", tmp_path)
    assert "\n" not in str(e.value)


# Over HTTP: vLLM's routes.

def chat(url: str, model: str, headers: dict, **fields) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers=headers, timeout=60, json={
        "model": model, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, **fields})


def alone(path: Path, name: str | None) -> str:
    tokenizer = Tokenizer.from_pretrained(path / "base")
    ids = tokenizer.encode("Once upon a time")
    model = load(path / "base", adapter=None if name is None else path / name)
    return tokenizer.decode(generate(model, [ids], 12, temperature=0)[0, len(ids):].tolist())


def test_load_use_and_unload_over_http(served):
    base = load(served / "base")
    app = create_app(base, Tokenizer.from_pretrained(served / "base"), model_name="tiny", api_key="sesame")
    key = {"Authorization": "Bearer sesame"}
    want = {name: alone(served, name) for name in (None, *NAMES)}
    with running(app) as url:
        load_body = {"lora_name": "a", "lora_path": str(served / "a")}
        assert httpx.post(f"{url}/v1/load_lora_adapter", json=load_body).status_code == 401  # the key, as everywhere
        r = httpx.post(f"{url}/v1/load_lora_adapter", json=load_body, headers=key)
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a' added successfully."
        for name in NAMES[1:]:
            r = httpx.post(f"{url}/v1/load_lora_adapter", headers=key,
                           json={"lora_name": name, "lora_path": str(served / name)})
            assert r.status_code == 200, r.text
        listed = httpx.get(f"{url}/v1/models", headers=key).json()["data"]
        assert [m["id"] for m in listed] == ["tiny", *NAMES]
        assert listed[1]["parent"] == "tiny" and listed[1]["root"] == str(served / "a")

        # 4 adapters and the base at once, 10 requests: each its own model's answer
        asks = ["tiny", *NAMES] * 2
        with ThreadPoolExecutor(len(asks)) as pool:
            texts = list(pool.map(lambda name: chat(url, name, key).json()["choices"][0]["text"], asks))
        assert texts == [want[None if name == "tiny" else name] for name in asks]

        # refused, one line each: a name taken, a directory that holds no adapter, an adapter for another model
        for body, status, words in (({"lora_name": "a", "lora_path": str(served / "b")}, 400, "is taken"),
                                    ({"lora_name": "tiny", "lora_path": str(served / "b")}, 400, "is taken"),
                                    ({"lora_name": "x", "lora_path": str(served / "missing")}, 400, "missing"),
                                    ({"lora_name": "x"}, 400, "lora_path")):
            r = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=key)
            message = r.json()["error"]["message"]
            assert r.status_code == status and words in message and "\n" not in message, message
        r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "x"}, headers=key)
        assert r.status_code == 404 and "'a', 'b', 'c', 'd'" in r.json()["error"]["message"]

        # an adapter's embeddings: its merged model's (to the tolerance), not the base's
        from smollm2.generation.embeddings import embed
        ids = Tokenizer.from_pretrained(served / "base").encode("Once upon a time")
        r = httpx.post(f"{url}/v1/embeddings", headers=key, json={"model": "c", "input": "Once upon a time"})
        got = torch.tensor(r.json()["data"][0]["embedding"])
        assert (got - embed(with_adapter(base, served / "c"), [ids])[0]).abs().max() < TOLERANCE
        assert (got - embed(base, [ids])[0]).abs().max() > 100 * TOLERANCE

        r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "b"}, headers=key)
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'b' removed successfully."
        assert [m["id"] for m in httpx.get(f"{url}/v1/models", headers=key).json()["data"]] == ["tiny", "a", "c", "d"]
        r = chat(url, "b", key)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert chat(url, "a", key).json()["choices"][0]["text"] == want["a"]  # the others go on


def test_unloading_an_adapter_in_use_finishes_its_requests_and_refuses_new_ones(served):
    """The stream that was answering with the adapter when it was unloaded ends with that adapter's answer; a request
    naming it after gets 404; loaded again under the name, it answers as before."""
    base = load(served / "base")
    app = create_app(base, Tokenizer.from_pretrained(served / "base"), model_name="tiny", adapters={"a": served / "a"})
    tokenizer = Tokenizer.from_pretrained(served / "base")
    ids = tokenizer.encode("Once upon a time")
    merged = with_adapter(base, served / "a")
    want = tokenizer.decode(generate(merged, [ids], LONG, temperature=0)[0, len(ids):].tolist())
    with running(app) as url:
        first, text = threading.Event(), []

        def stream():
            with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json=dict(
                    model="a", prompt="Once upon a time", max_tokens=LONG, temperature=0, stream=True,
                    speculative="off")) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        text.append(json.loads(line[6:])["choices"][0]["text"])
                        first.set()

        streaming = threading.Thread(target=stream)
        streaming.start()
        assert first.wait(30)
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 200
        pieces = len(text)
        assert chat(url, "a", {}).status_code == 404
        streaming.join(60)
        assert "".join(text) == want and len(text) > pieces  # it went on after the unload
        assert httpx.post(f"{url}/v1/load_lora_adapter",
                          json={"lora_name": "a", "lora_path": str(served / "a")}).status_code == 200
        assert chat(url, "a", {}, max_tokens=LONG).json()["choices"][0]["text"] == want
