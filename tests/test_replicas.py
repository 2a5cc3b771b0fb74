"""Replicas under Ray Serve (smollm2.server.replicas): 2 replicas of the embedded model, 1 thread each, on a local
Ray cluster of 2 CPUs, answer as the single server does, streamed or not; a replica killed is replaced, the request
it was streaming ends with an error event, the other replica's runs on, and new requests are answered meanwhile.
Skipped where Ray Serve is not installed (pip install 'smollm2[ray]'; the test extra has it). ~1-2 min on 2 cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time

import httpx
import pytest
from fastapi.testclient import TestClient

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # as replicas.py: the cluster on 127.0.0.1
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
from smollm2.server.replicas import HEADER, Recipe, Scaling, application  # noqa: E402 (after the skip)

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

NAME = "SmolLM2-135M-Instruct"
# kv_cache_dtype None: the model's own dtype, in which the server's answers are generate()'s, bit for bit
RECIPE = Recipe(app=dict(kv_cache_dtype=None, max_batch_size=8), threads=1)
QUESTIONS = [f"{what} {n}?" for n in range(8) for what in ("What is 2 +", "Name a color, number", "Count to",
                                                               "Say hello to friend number")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def url():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options=dict(host="127.0.0.1", port=port))
        serve.run(application(RECIPE, Scaling(replicas=2)), name="smollm2", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def chat(question: str, max_tokens: int = 12, stream: bool = False) -> dict:
    return dict(model=NAME, messages=[dict(role="user", content=question)], max_tokens=max_tokens, temperature=0,
                stream=stream)


async def ask(client: httpx.AsyncClient, body: dict) -> tuple[str, str]:
    """The answer's text and the replica that gave it, streamed or not."""
    if not body["stream"]:
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"], r.headers[HEADER]
    text = ""
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        return text, r.headers[HEADER]


def replicas_running() -> int:
    status = serve.status().applications["smollm2"].deployments["Replica"]
    return status.replica_states.get("RUNNING", 0)


def test_replicas_answer_as_the_single_server_and_survive_one_killed(url):
    with TestClient(RECIPE.build()) as single:  # the reference: one in-process app of the same recipe
        expected = [single.post("/v1/chat/completions", json=chat(q)).json()["choices"][0]["message"]["content"]
                    for q in QUESTIONS]

    async def concurrently():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(*(ask(client, chat(q, stream=i % 2 == 1)) for i, q in enumerate(QUESTIONS)))

    answers = asyncio.run(concurrently())
    assert [text for text, _ in answers] == expected  # 32 concurrent chats, half of them streamed
    assert len({replica for _, replica in answers}) == 2  # both replicas answered

    # Two long answers streaming, one on each replica; the first one's replica is killed mid-answer.
    long = chat("Write a long story about a dragon.", max_tokens=400, stream=True)
    with httpx.Client(base_url=url, timeout=120) as client:
        with client.stream("POST", "/v1/chat/completions", json=long) as doomed:
            doomed_lines = doomed.iter_lines()
            next(doomed_lines)  # decoding has begun
            with client.stream("POST", "/v1/chat/completions", json=long) as other:
                other_lines = other.iter_lines()
                next(other_lines)
                assert doomed.headers[HEADER] != other.headers[HEADER]
                name = next(actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
                            if "Replica" in actor["name"] and actor["name"].endswith(doomed.headers[HEADER]))
                ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
                killed = time.monotonic()

                # The doomed stream ends with an error event, which says what happened.
                events = [json.loads(line[6:]) for line in doomed_lines if line.startswith("data: {")]
                assert "error" in events[-1] and "replica" in events[-1]["error"]["message"], events[-1]

                # Meanwhile new requests are answered, by the replica left or the new one.
                fresh = client.post("/v1/chat/completions", json=chat(QUESTIONS[0]))
                assert fresh.status_code == 200 and fresh.json()["choices"][0]["message"]["content"] == expected[0]
                assert time.monotonic() - killed < 30

                assert [line for line in other_lines if line][-1] == "data: [DONE]"  # the other ran to its end

    deadline = time.monotonic() + 120  # Ray Serve starts a replica in its place (the model loads again)
    while replicas_running() != 2:
        assert time.monotonic() < deadline, serve.status()
        time.sleep(0.5)
