"""Replicas under Ray Serve (smollm2.server.replicas): 2 replicas of the embedded model, 1 thread each, on a local
Ray cluster of 2 CPUs, answer as the single server does, streamed or not; a replica killed is replaced, the request
it was streaming ends with an error event, the one it had not begun answering is answered by the other replica,
whose own stream runs on, and new requests are answered meanwhile.
Skipped where Ray Serve is not installed (pip install 'smollm2[ray]'; the test extra has it). ~1-2 min on 2 cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="Ray Serve is not installed (pip install 'smollm2[ray]')")
NAME = "SmolLM2-135M-Instruct"
# Each replica's: the model's own dtype in its KV cache, in which the server's answers are generate()'s, bit for bit
RECIPE = dict(options=dict(kv_cache_dtype=None, max_batch_size=8, threads=1))
QUESTIONS = [f"{what} {n}?" for n in range(8) for what in ("What is 2 +", "Name a color, number", "Count to",
                                                               "Say hello to friend number")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ray_is_an_optional_extra_that_only_replicas_imports():
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    dependencies = re.search(r"^dependencies = \[(.*?)^\]", pyproject, re.M | re.S).group(1)
    assert "ray" not in dependencies
    makefile = (Path(__file__).parents[1] / "Makefile").read_text()
    assert re.search(r"^\t\$\(PY\) -m pip install -q -e \.$", makefile, re.M)  # `make run`: the package, no extra
    assert re.search(r'^ray = \["ray\[serve\]>=2.60"\]$', pyproject, re.M)
    assert '"ray[serve]>=2.60"]' in re.search(r"^test = \[.*?\]$", pyproject, re.M | re.S).group(0)
    # The server and the command line run without it; --replicas says what to install, in one line.
    code = ("import sys; sys.modules['ray'] = None; import smollm2.cli, smollm2.server; "
            f"sys.exit(smollm2.cli.main(['serve', '--replicas', '2', '--port', '{free_port()}']))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and run.stderr.strip().splitlines() == [
        "smollm2 serve: error: replicas run under Ray Serve, which is not installed: pip install 'smollm2[ray]'"]


@needs_ray
@pytest.mark.real_model
def test_routing_key_is_the_prompts_first_chunk():
    from smollm2 import Tokenizer
    from smollm2.generation.steps import PREFILL_CHUNK
    from smollm2.server.replicas import routing_key

    tokenizer = Tokenizer.from_pretrained()
    system = "You are a careful assistant. " * PREFILL_CHUNK  # far more than a chunk's tokens

    def body(*messages, model=NAME):
        return json.dumps(dict(model=model, messages=[dict(role="system", content=system), *messages])).encode()

    first = routing_key(body(dict(role="user", content="Hi")), tokenizer)
    later = routing_key(body(dict(role="user", content="Hi"), dict(role="assistant", content="Hello!"),
                             dict(role="user", content=[dict(type="text", text="And now?")])), tokenizer)
    assert first is not None and first == later  # the turns of one conversation go to one replica
    assert routing_key(body(model="adapter"), tokenizer) != first  # each model has a cache of its own
    assert routing_key(json.dumps(dict(model=NAME, prompt=system)).encode(), tokenizer) is not None
    short = dict(model=NAME, messages=[dict(role="user", content="Hi")])
    for unrouted in (json.dumps(short).encode(), b"not json", b"[[[[" * 100_000, b"{}"):
        assert routing_key(unrouted, tokenizer) is None  # no chunk to reuse: the replica with fewest requests


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster of 2 CPUs serving 2 replicas of RECIPE: (its base URL, the replicas module)."""
    from smollm2.server import replicas  # before Ray: it has the cluster listen on 127.0.0.1
    import ray
    from ray import serve

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options=dict(host="127.0.0.1", port=port))
        serve.run(replicas.application(replicas.Recipe(**RECIPE), replicas.Scaling(replicas=2)), name="smollm2",
                  route_prefix="/")
        yield f"http://127.0.0.1:{port}", replicas
    finally:
        serve.shutdown()
        ray.shutdown()


def chat(question: str, max_tokens: int = 12, stream: bool = False) -> dict:
    return dict(model=NAME, messages=[dict(role="user", content=question)], max_tokens=max_tokens, temperature=0,
                stream=stream)


async def ask(client: httpx.AsyncClient, body: dict) -> tuple[str, str]:
    """The answer's text and the replica that gave it (its header), streamed or not."""
    if not body["stream"]:
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"], r.headers["x-smollm2-replica"]
    text = ""
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        return text, r.headers["x-smollm2-replica"]


def replicas_running() -> int:
    from ray import serve

    status = serve.status().applications["smollm2"].deployments["Replica"]
    return status.replica_states.get("RUNNING", 0)


@needs_ray
@pytest.mark.slow
@pytest.mark.real_model
def test_replicas_answer_as_the_single_server_and_survive_one_killed(cluster):
    import ray
    from ray import serve

    url, replicas = cluster
    system = dict(role="system", content="You are a storyteller who answers at length. " * 60)  # > 512 tokens
    waiting = dict(chat("Tell me about a castle.", max_tokens=300), messages=[system, dict(
        role="user", content="Tell me about a castle.")])
    with TestClient(replicas.Recipe(**RECIPE).build()) as single:  # the reference: one app in this process
        expected = [single.post("/v1/chat/completions", json=chat(q)).json()["choices"][0]["message"]["content"]
                    for q in QUESTIONS]
        waiting_expected = single.post("/v1/chat/completions", json=waiting).json()["choices"][0]["message"]

    async def concurrently():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(*(ask(client, chat(q, stream=i % 2 == 1)) for i, q in enumerate(QUESTIONS)))

    answers = asyncio.run(concurrently())
    assert [text for text, _ in answers] == expected  # 32 concurrent chats, half of them streamed
    assert len({replica for _, replica in answers}) == 2  # both replicas answered

    # On replica X: a long answer streaming, and one not streamed (nothing of it sent yet), both behind one long
    # system prompt (a routing key: one replica). On the other: a long answer streaming. Then X is killed.
    doomed_body = dict(waiting, stream=True, max_tokens=400)
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=url, timeout=120) as client:
        with client.stream("POST", "/v1/chat/completions", json=doomed_body) as doomed:
            doomed_lines = doomed.iter_lines()
            next(doomed_lines)  # decoding has begun
            victim = doomed.headers["x-smollm2-replica"]
            retried = pool.submit(client.post, "/v1/chat/completions", json=waiting)
            time.sleep(1)  # it is on X now: the same key, and X has room
            with client.stream("POST", "/v1/chat/completions", json=chat("Write a long story.", 400, True)) as other:
                other_lines = other.iter_lines()
                next(other_lines)
                assert other.headers["x-smollm2-replica"] != victim  # the replica with fewer requests
                name = next(actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
                            if "Replica" in actor["name"] and actor["name"].endswith(victim))
                ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
                killed = time.monotonic()

                # The doomed stream ends with an error event, which says what happened.
                events = [json.loads(line[6:]) for line in doomed_lines if line.startswith("data: {")]
                assert "error" in events[-1] and "replica" in events[-1]["error"]["message"], events[-1]

                # The request X had not begun answering is answered by another replica, from the start.
                answer = retried.result()
                assert answer.status_code == 200 and answer.headers["x-smollm2-replica"] != victim
                assert answer.json()["choices"][0]["message"] == waiting_expected

                # Meanwhile new requests are answered, by the replica left or the new one.
                fresh = client.post("/v1/chat/completions", json=chat(QUESTIONS[0]))
                assert fresh.status_code == 200 and fresh.json()["choices"][0]["message"]["content"] == expected[0]
                assert time.monotonic() - killed < 30

                assert [line for line in other_lines if line][-1] == "data: [DONE]"  # the other ran to its end

    deadline = time.monotonic() + 120  # Ray Serve starts a replica in its place (the model loads again)
    while replicas_running() != 2:
        assert time.monotonic() < deadline, serve.status()
        time.sleep(0.5)


@needs_ray
@pytest.mark.slow
@pytest.mark.subprocess
def test_serve_replicas_joins_a_running_cluster(cluster, tiny_dir):
    """`smollm2 serve --replicas 1 --ray-address` on the cluster above (whose Serve keeps its HTTP port): its
    application, the tiny model, replaces the one there; Ctrl-C removes it and leaves the cluster's Serve running."""
    import signal

    import ray
    from ray import serve

    url, _ = cluster
    command = [sys.executable, "-m", "smollm2", "serve", "--replicas", "1", "--model", str(tiny_dir),
               "--ray-address", ray.get_runtime_context().gcs_address, "--port", str(free_port())]
    # Ctrl-C's default action restored in the child: a suite started in the background (`make test &`) runs with
    # SIGINT ignored, which a child inherits, and Python then installs no KeyboardInterrupt for it.
    with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) as process:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None and time.monotonic() < deadline
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"] == str(tiny_dir):
                    break
            time.sleep(1)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=120) == 130  # as the CLI ends on Ctrl-C
    assert "smollm2" not in serve.status().applications
    assert serve.status().proxies  # Serve itself runs on


@needs_ray
def test_scaling_is_a_number_of_replicas_or_autoscaling_on_requests_beyond_a_batch():
    from smollm2 import SmolError
    from smollm2.server.replicas import Scaling

    assert Scaling(3, target=8).options() == dict(num_replicas=3, max_ongoing_requests=16)
    assert Scaling(2, 1, 4, target=8).options() == dict(max_ongoing_requests=16, autoscaling_config=dict(
        min_replicas=1, max_replicas=4, initial_replicas=2, target_ongoing_requests=8))
    assert Scaling(1, max_replicas=3).options()["autoscaling_config"]["min_replicas"] == 1
    with pytest.raises(SmolError, match=r"--min-replicas \(3\) <= --replicas \(2\)"):
        Scaling(2, min_replicas=3).options()


@needs_ray
def test_serve_runs_application_builder_takes_key_value_arguments():
    from ray.serve import Application

    from smollm2 import SmolError
    from smollm2.server.replicas import app

    assert isinstance(app({"replicas": "2", "threads": "1", "routing": "random"}), Application)
    with pytest.raises(SmolError, match="unknown argument"):
        app({"replica": "2"})
    with pytest.raises(SmolError, match="threads must be a whole number"):
        app({"threads": "0"})
    with pytest.raises(SmolError, match="routing must be prefix or random"):
        app({"routing": "hash"})
