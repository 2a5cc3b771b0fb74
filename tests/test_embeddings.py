"""Embeddings: the mean of the final normed hidden states over a text's tokens, normalized, equal to
transformers' LlamaModel pooled the same way; in Python, on the command line, and served on the scheduler's
thread as OpenAI's /v1/embeddings."""

from __future__ import annotations

import asyncio
import base64
import json
import threading

import numpy as np
import pytest
import torch
from conftest import TINY, as_variant, hf_copy, tiny_model
from fastapi.testclient import TestClient
from test_server import running, while_streaming

from smollm2 import SmolError, Tokenizer, load
from smollm2.cli import main
from smollm2.generation import embed
from smollm2.server import create_app, scheduler
from smollm2.server import embeddings as served_embeddings

NAME = "tiny"
TEXTS = ["Hello", "The capital of France is Paris.", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
         "Why is the sky blue? Light scatters off the air's molecules, blue light the most."]


def reference(llama_model, rows: list[list[int]]) -> torch.Tensor:
    """transformers' LlamaModel (its last_hidden_state is after the final norm), each row alone, mean-pooled over
    its tokens and normalized: llama.cpp's --pooling mean."""
    with torch.inference_mode():
        pooled = [llama_model(torch.tensor([row])).last_hidden_state[0].float().mean(0) for row in rows]
    return torch.nn.functional.normalize(torch.stack(pooled), dim=-1)


def assert_close(ours: torch.Tensor, want: torch.Tensor) -> None:
    assert (ours - want).abs().max() < 1e-4
    assert torch.nn.functional.cosine_similarity(ours, want, dim=-1).min() >= 0.99999


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load(tiny_dir), Tokenizer.from_pretrained(tiny_dir)


@pytest.mark.parametrize("config", ["gqa", "untied", "bias"])
def test_embeddings_equal_transformers_pooled_hidden_states(config, variant):
    model = tiny_model(TINY[config])
    want_model = hf_copy(model).model
    model = as_variant(model, variant)
    torch.manual_seed(1)
    rows = [torch.randint(0, model.config.vocab_size, (n,)).tolist() for n in (1, 7, 30, 64)]
    batch = embed(model, rows)
    assert batch.shape == (4, model.config.hidden_size) and batch.dtype == torch.float32
    assert torch.allclose(batch.norm(dim=-1), torch.ones(4))
    assert_close(batch, reference(want_model, rows))
    # A batch of rows of different lengths: each row's embedding is the one it gets alone.
    alone = torch.cat([embed(model, [row]) for row in rows])
    assert (batch - alone).abs().max() < 1e-5


def test_the_embedded_model_equals_transformers(model, hf_model):
    tokenizer = Tokenizer.from_pretrained()
    rows = [tokenizer.encode(text) for text in TEXTS]
    batch = embed(model, rows)
    assert_close(batch, reference(hf_model.model, rows))
    assert (batch - torch.cat([embed(model, [row]) for row in rows])).abs().max() < 1e-5


def test_bad_rows_are_smol_errors(tiny):
    model, _ = tiny
    for rows, message in (([], "empty"), ([[1, 2], []], "prompt 1 is empty"), ([[10**9]], "not a token id"),
                          ([list(range(513))], "context window of 512")):
        with pytest.raises(SmolError, match=message):
            embed(model, rows)


def test_the_server_embeds_on_the_scheduler_thread_as_python_does(tiny, monkeypatch):
    """Through the official openai client (which asks for base64 unless told) and as floats; token ids too;
    every forward pass on the scheduler's thread."""
    from openai import OpenAI

    model, tokenizer = tiny
    want = embed(model, [tokenizer.encode(text) for text in TEXTS])
    threads, shapes = [], []
    hidden_states = model.hidden_states

    def seen(ids, *args, **kwargs):
        threads.append(threading.current_thread().name)
        shapes.append(ids.shape)
        return hidden_states(ids, *args, **kwargs)

    monkeypatch.setattr(model, "hidden_states", seen)
    assert served_embeddings.BATCH_TOKENS == 512
    monkeypatch.setattr(served_embeddings, "BATCH_TOKENS", 40)  # several calls, one or more rows each
    with running(create_app(model, tokenizer, model_name=NAME)) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        for encoding_format in ({}, {"encoding_format": "float"}):  # the client's default: base64, decoded
            answer = client.embeddings.create(model=NAME, input=TEXTS, **encoding_format)
            assert [d.index for d in answer.data] == [0, 1, 2, 3]
            assert np.allclose([d.embedding for d in answer.data], want.numpy(), atol=1e-5)
            assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(len(tokenizer.encode(t))
                                                                                  for t in TEXTS)
        encoded = client.embeddings.create(model=NAME, input=TEXTS[0], encoding_format="base64").data[0].embedding
        assert np.allclose(np.frombuffer(base64.b64decode(encoded), "<f4"), want[0].numpy(), atol=1e-5)
        one = client.embeddings.create(model=NAME, input=TEXTS[1])
        assert np.allclose(one.data[0].embedding, want[1].numpy(), atol=1e-5)
        ids = [tokenizer.encode(text) for text in TEXTS[:2]]
        assert np.allclose(client.embeddings.create(model=NAME, input=ids[0]).data[0].embedding, want[0], atol=1e-5)
        by_ids = client.embeddings.create(model=NAME, input=ids)
        assert np.allclose([d.embedding for d in by_ids.data], want[:2].numpy(), atol=1e-5)
    assert threads and set(threads) == {"smollm2-scheduler"}
    # Each call within the budget of padded tokens, or a row alone; some of several rows.
    assert all(rows * length <= 40 or rows == 1 for rows, length in shapes) and max(r for r, _ in shapes) > 1


def test_streams_running_meanwhile_go_on_between_the_batches(tiny, monkeypatch):
    """Each batch is a call between two of the scheduler's steps: a running stream is not held for the whole
    request."""
    model, tokenizer = tiny
    runs = []  # what the scheduler's thread ran, in order: a decoding step (into a cache) or an embedding batch
    hidden_states = model.hidden_states

    def seen(ids, input_pos=None, cache=None, *args, **kwargs):
        runs.append("step" if cache is not None else "embed")
        return hidden_states(ids, input_pos, cache, *args, **kwargs)

    monkeypatch.setattr(model, "hidden_states", seen)
    monkeypatch.setattr(served_embeddings, "BATCH_TOKENS", 8)
    answer = while_streaming(create_app(model, tokenizer, model_name=NAME), "/v1/embeddings",
                             dict(model=NAME, input=TEXTS))
    assert answer.status_code == 200
    batches = [i for i, run in enumerate(runs) if run == "embed"]
    assert len(batches) >= 3 and all("step" in runs[a:b] for a, b in zip(batches, batches[1:]))


def test_bad_input_gets_400_naming_the_field(tiny, monkeypatch):
    model, tokenizer = tiny
    assert served_embeddings.MAX_TOKENS == 300_000
    monkeypatch.setattr(served_embeddings, "MAX_TOKENS", 1000)
    with TestClient(create_app(model, tokenizer, model_name=NAME)) as client:
        for value, field, message in [
            ("", "input", "is empty"),
            (["Hi", ""], "input.1", "is empty"),
            ([[]], "input", "is empty"),
            (["Hi", "word " * 600], "input.1", "context window of 512"),
            ([[5, 10**9]], "input", "not a token id"),
            ([5, -1], "input", "must be text, token ids"),
            (["Hi"] * 2049, "input", "at most 2048"),
            (["word " * 400] * 3, "input", "at most 1000"),
            ([], "input", "non-empty"),
            (7, "input", "must be text"),
        ]:
            r = client.post("/v1/embeddings", json=dict(model=NAME, input=value))
            assert r.status_code == 400, (value, r.text)
            error = r.json()["error"]
            assert error["param"] == field and message in error["message"], (value, error)
        r = client.post("/v1/embeddings", json=dict(model=NAME, input="Hi", encoding_format="int8"))
        assert r.status_code == 400 and r.json()["error"]["param"] == "encoding_format"
        r = client.post("/v1/embeddings", json=dict(model="other", input="Hi"))
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        assert client.get("/health").json()["waiting"] == 0


def test_scheduler_calls_return_results_and_exceptions_between_steps(tiny):
    model, tokenizer = tiny
    sched = scheduler.EngineThread(model, tokenizer)

    def fails():
        raise SmolError("no")

    async def run():
        assert await sched.call(lambda: threading.current_thread().name) == "smollm2-scheduler"
        with pytest.raises(SmolError, match="no"):
            await sched.call(fails)

    sched.start()
    try:
        asyncio.run(run())
    finally:
        sched.stop()


def test_the_embed_command(tiny_dir, tiny, capsys):
    model, tokenizer = tiny
    want = embed(model, [tokenizer.encode(text) for text in TEXTS[:2]])
    assert main(["embed", "--model", str(tiny_dir), *TEXTS[:2], "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [o["text"] for o in out] == TEXTS[:2] and [o["tokens"] for o in out] == [len(tokenizer.encode(t))
                                                                                   for t in TEXTS[:2]]
    assert np.allclose([o["embedding"] for o in out], want.numpy(), atol=1e-6)
    assert main(["embed", "--model", str(tiny_dir), *TEXTS[:2]]) == 0
    assert np.allclose(np.loadtxt(capsys.readouterr().out.splitlines()), want.numpy(), atol=1e-6)
    assert main(["embed", "--model", str(tiny_dir), "Hi", ""]) == 1
    assert "text 2 is empty" in capsys.readouterr().err
