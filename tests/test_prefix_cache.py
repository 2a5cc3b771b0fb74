"""The prefix cache and chunked prefill: prompts that share a prefix reuse its keys and values, bit for bit the
same answers as without the cache, and a long prompt's prefill lets the requests already running go on."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import safetensors.torch
import torch
from conftest import TINY, tiny_model
from fastapi.testclient import TestClient
from safetensors import safe_open

from smollm2 import Tokenizer, load
from smollm2.errors import SmolError
from smollm2.generation import Request, steps
from smollm2.generation.prefix_cache import PrefixCache, checksum, model_identity
from smollm2.kernels.held import HeldWeight
from smollm2.server import create_app
from smollm2.server.scheduler import EngineThread
from test_server import running

NAME = "tiny"
TOPICS = ["the sea", "a cat", "mountains", "bread", "the moon", "rain", "a train", "music", "chess", "apples",
          "winter", "a library", "bees", "a bridge", "coffee", "the desert"]


@pytest.fixture
def small_chunks(monkeypatch):
    """16-token prefill chunks: the tiny model's 512-token window then holds many, and many steps a prompt."""
    monkeypatch.setattr(steps, "PREFILL_CHUNK", 16)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load(tiny_dir), Tokenizer.from_pretrained(tiny_dir)


def block(value: float) -> list[torch.Tensor]:
    """A chunk's keys and values, as KVCache.parts holds them."""
    k = torch.full((2, 1, steps.PREFILL_CHUNK, 4), float(value))
    return [k, -k]


def test_lookup_store_and_least_recently_used_eviction(small_chunks):
    size = 2 * block(0)[0].numel() * 4  # one block's keys and values, float32
    cache = PrefixCache(max_bytes=3 * size)
    a, b, c, d = (list(range(i * 16, i * 16 + 16)) for i in range(4))
    first = cache.store([], a, block(1))
    second = cache.store([first], b, block(2))
    assert cache.lookup(a + b + [7]) == [first, second]
    assert cache.lookup(a + b) == [first]  # the last token is never taken from the cache: its logits are needed
    assert cache.lookup(b + a + [7]) == []  # a block is its prefix, not its tokens alone
    assert torch.equal(second.parts[0], block(2)[0]) and cache.looked_up == 33 + 32 + 33 and cache.found == 32 + 16
    # Full: the least recently used block goes, and blocks others extend are used after them.
    other = cache.store([], c, block(3))
    cache.lookup(a + b + [7])
    cache.store([], d, block(4))
    assert cache.lookup(c + [7]) == [] and cache.lookup(a + b + [7]) == [first, second]
    assert cache.bytes == 3 * size and other not in cache.blocks.values()
    # A block is evicted before the block it extends; a block after an evicted one is not kept.
    more = [list(range(i, i + 16)) for i in range(100, 500, 100)]
    cache.store([], c, block(3))  # evicts d
    cache.store([], more[0], block(5))  # evicts second, which extends first
    assert cache.lookup(a + b + [7]) == [first]
    for tokens in more[1:]:  # evict c, more[0], then first
        cache.store([], tokens, block(6))
    assert cache.lookup(a + b + [7]) == [] and cache.store([first], b, block(2)) is None
    assert PrefixCache(max_bytes=size - 1).store([], a, block(1)) is None  # one block over the budget


def test_a_prompt_seen_whole_before_needs_no_prefill(small_chunks):
    cache = PrefixCache(max_bytes=1 << 20)
    a, tail = list(range(16)), [1, 2, 3]
    first = cache.store([], a, block(1))
    assert cache.lookup(a + tail) == [first]
    h = torch.ones(1, 1, 8)
    last = cache.store([first], tail, [t[..., :3, :] for t in block(2)], h)
    assert cache.lookup(a + tail) == [first, last] and torch.equal(last.h, h)  # the whole prompt: 19 tokens
    assert cache.lookup(a + tail[:2]) == [first] and cache.lookup(a) == []  # a is a block, not a prompt's end
    assert cache.found == 16 + 19 + 16
    cache.store([], a, block(1), h)  # now a prompt ended with a too
    assert cache.lookup(a) == [first] and cache.bytes == sum(b.bytes for b in cache.blocks.values())


def chat_turns(url: str, chat: int, turns: int = 5) -> list[tuple[str, list]]:
    """One chat of `turns` turns, its whole history sent each turn; each answer and its log-probabilities."""
    messages = [{"role": "system", "content": f"You are a poet who only writes about {TOPICS[chat]}."}]
    sampling = dict(temperature=0) if chat % 2 == 0 else dict(temperature=0.9, seed=chat)
    answers = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Turn {turn}: tell me one more thing about {TOPICS[chat]}."})
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json=dict(
            model=NAME, messages=messages, max_tokens=12, logprobs=True, top_logprobs=2, **sampling))
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        answers.append((choice["message"]["content"], choice["logprobs"]["content"]))
        messages.append({"role": "assistant", "content": choice["message"]["content"]})
    return answers


def serve_chats(tiny, prefix_cache_bytes: int) -> tuple[list, str]:
    model, tokenizer = tiny
    app = create_app(model, tokenizer, model_name=NAME, max_batch_size=6, prefix_cache_bytes=prefix_cache_bytes)
    with running(app) as url, ThreadPoolExecutor(len(TOPICS)) as pool:
        answers = list(pool.map(lambda chat: chat_turns(url, chat), range(len(TOPICS))))
        metrics = httpx.get(f"{url}/metrics").text
    return answers, metrics


def metric(text: str, name: str) -> float:
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_sixteen_concurrent_chats_are_bit_identical_with_and_without_the_cache(tiny, small_chunks):
    """16 chats of 5 turns at once on 6 rows: requests wait, finish while others prefill, reuse each other's
    prefixes; every answer and every log-probability is the same with the cache as without."""
    without, metrics_without = serve_chats(tiny, 0)
    with_cache, metrics = serve_chats(tiny, 64 << 20)
    assert with_cache == without
    assert metric(metrics_without, "smollm2_prefix_cache_hit_tokens_total") == 0
    hit, queried = (metric(metrics, f"smollm2_prefix_cache_{n}_tokens_total") for n in ("hit", "queried"))
    assert hit > 0.5 * queried, (hit, queried)  # later turns find their history, the chats their system prompt
    assert metric(metrics, "smollm2_prefix_cache_bytes") > 0


@pytest.mark.parametrize("kv_cache_dtype", [None, "int8"])
def test_repeated_prompts_and_choices_reuse_the_whole_prefill(tiny, small_chunks, kv_cache_dtype):
    """The same request twice, and n=3: after the first, each prompt is found whole; answers equal those
    without the cache. An int8 KV cache's blocks keep its values and scales as they are."""
    model, tokenizer = tiny
    body = dict(model=NAME, messages=[{"role": "user", "content": "Write about " + " and ".join(TOPICS)}],
                max_tokens=8, temperature=0.8, seed=5, logprobs=True)
    answers, hits = [], []
    for cache_bytes in (0, 64 << 20):
        app = create_app(model, tokenizer, model_name=NAME, prefix_cache_bytes=cache_bytes,
                         kv_cache_dtype=kv_cache_dtype)
        with running(app) as url:
            answers.append([httpx.post(f"{url}/v1/chat/completions", json=dict(body, n=n)).json()["choices"]
                            for n in (1, 1, 3)])
            metrics = httpx.get(f"{url}/metrics").text
        hits.append((metric(metrics, "smollm2_prefix_cache_hit_tokens_total"),
                     metric(metrics, "smollm2_prefix_cache_queried_tokens_total")))
    assert answers[0] == answers[1]
    (none, _), (hit, queried) = hits
    assert none == 0 and hit == queried * 4 / 5  # 5 prompts of one length, all but the first found whole


def test_a_long_prompt_is_prefilled_between_the_running_requests_steps(tiny, small_chunks):
    """While a 400-token prompt is prefilled, 16 tokens a step, a running request gets a token every step."""
    model, tokenizer = tiny
    scheduler = EngineThread(model, tokenizer, max_batch_size=4)

    async def run():
        scheduler.start()
        try:
            running_request = scheduler.submit(Request([1, 2, 3], 200))
            events = running_request.events()
            await anext(events)  # it is decoding
            long = scheduler.submit(Request(list(range(5, 405)), 2))
            async for _ in long.events():
                pass
            async for _ in events:
                pass
            return running_request, long
        finally:
            scheduler.stop()

    running_request, long = asyncio.run(run())
    first = long.token_times[0]
    during = [t for t in running_request.token_times if long.submitted < t < first]
    assert len(during) >= 400 // 16 - 2, (len(during), len(running_request.token_times))


@pytest.mark.slow
def test_the_embedded_model_reuses_a_long_history(model):
    """Real weights and the real chunk size: a chat's second turn finds its first turn's prompt."""
    tokenizer = Tokenizer.from_pretrained()
    long = "Here are my notes. " + " ".join(f"Note {i}: the meeting moved to room {i % 7}." for i in range(90))
    answers, hits = [], []
    for cache_bytes in (0, 1 << 30):
        app = create_app(model, tokenizer, model_name=NAME, prefix_cache_bytes=cache_bytes)
        messages = [{"role": "user", "content": long}]
        with running(app) as url:
            for turn in range(2):
                r = httpx.post(f"{url}/v1/chat/completions", timeout=300, json=dict(
                    model=NAME, messages=messages, max_tokens=16, temperature=0, logprobs=True))
                answers.append(r.json()["choices"][0])
                messages += [{"role": "assistant", "content": answers[-1]["message"]["content"]},
                             {"role": "user", "content": "Which room is the meeting in now?"}]
            hits.append(metric(httpx.get(f"{url}/metrics").text, "smollm2_prefix_cache_hit_tokens_total"))
    assert answers[:2] == answers[2:]
    assert hits[0] == 0 and hits[1] >= 1024  # the second turn's first two chunks at least


def test_a_request_cancelled_while_its_prompt_is_prefilled_frees_its_row(tiny, small_chunks):
    model, tokenizer = tiny
    ended = []
    scheduler = EngineThread(model, tokenizer, max_batch_size=2, on_end=ended.append)

    async def run():
        long = scheduler.submit(Request(list(range(5, 405)), 4))
        with torch.inference_mode():
            scheduler._step()  # its first chunk
        (row,) = scheduler.requests
        assert scheduler.requests[row] is long and scheduler.engine.filling is row and 0 < row.filled < 400
        scheduler.cancel(long)
        short = scheduler.submit(Request([1, 2, 3], 3))
        with torch.inference_mode():
            for _ in range(6):
                scheduler._step()
        assert scheduler.engine.filling is None and ended == [long, short] and short.sequence.finish_reason == "length"
        assert scheduler.load()["active"] == 0

    asyncio.run(run())


# The prefix cache on disk (--prefix-cache-dir): blocks that outlive the process.

NOTES = [{"role": "user", "content": "Here are my notes. " + " ".join(
    f"Note {i}: the meeting moved to room {i % 7}." for i in range(20))}]


def ask(served, directory, kv_cache_dtype=None, prefix_cache_bytes=64 << 20) -> tuple[list, str]:
    """A new app (a restarted server: nothing in memory) with its prefix cache kept in `directory`: a long chat's
    answer, sampled, with its log-probabilities; and the app's /metrics after it."""
    model, tokenizer = served
    app = create_app(model, tokenizer, model_name=NAME, prefix_cache_bytes=prefix_cache_bytes,
                     kv_cache_dtype=kv_cache_dtype, prefix_cache_dir=directory)
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json=dict(model=NAME, messages=NOTES, max_tokens=8, temperature=0.8,
                                                          seed=5, logprobs=True, top_logprobs=2))
        assert r.status_code == 200, r.text
        return r.json()["choices"], client.get("/metrics").text


@pytest.mark.parametrize("kv_cache_dtype", [None, "int8"])
def test_a_restarted_server_answers_from_its_disk_cache_bit_for_bit(tiny, small_chunks, tmp_path, kv_cache_dtype):
    """The first app computes the long prompt and writes its chunks; a second, new app with the same folder
    prefills nothing (every chunk and the last hidden state read from disk), and its answer and log-probabilities
    are the first's, and those of an app with no prefix cache at all, bit for bit."""
    prompt = len(tiny[1].apply_chat_template(NOTES))
    cold, first = ask(tiny, tmp_path, kv_cache_dtype)
    assert metric(first, "smollm2_prefilled_tokens_total") == prompt > 16 * 16
    assert len(list(tmp_path.rglob("*.safetensors"))) == -(-prompt // 16)  # a file a chunk
    warm, second = ask(tiny, tmp_path, kv_cache_dtype)
    assert warm == cold
    assert metric(second, "smollm2_prefilled_tokens_total") == 0
    assert metric(second, "smollm2_prefix_cache_disk_hit_tokens_total") == prompt
    assert ask(tiny, None, kv_cache_dtype, prefix_cache_bytes=0)[0] == cold


def first_file(directory) -> Path:
    """The file of a prompt's first chunk: the one that follows no other."""
    return next(path for path in directory.rglob("*.safetensors")
                if safe_open(path, framework="pt").metadata()["parent"] == "")


def contents(path: Path) -> tuple[dict, dict]:
    """A file's metadata and tensors (as lists), to compare: its bytes' order may vary (the metadata's keys)."""
    with safe_open(path, framework="pt") as file:
        return file.metadata(), {key: file.get_tensor(key).float().tolist() for key in file.keys()}


def wrong_dtype(path: Path) -> None:
    """The file with its metadata (this model's identity) and a checksum that holds, but bf16 keys and values."""
    with safe_open(path, framework="pt") as file:
        metadata = file.metadata()
        tensors = {key: file.get_tensor(key) for key in file.keys()}
    tensors = {key: t.bfloat16() if key.startswith("part.") else t for key, t in tensors.items()}
    metadata["sha256"] = checksum(tensors)
    path.write_bytes(safetensors.torch.save(tensors, metadata))


def test_corrupt_and_foreign_files_are_refused_and_computed_again(tiny, small_chunks, tmp_path, caplog):
    """A file spoiled in any way (a flipped bit, cut short, not safetensors, grown, another model's or another
    cache dtype's under this one's name, the right names but other dtypes) is refused, logged, and its chunks
    computed again, with the cold answer; the chunk's file is then written anew. Another model, or cache dtype,
    given the same folder never reads this one's files."""
    model, tokenizer = tiny
    other = (tiny_model(TINY["gqa"], seed=1), tokenizer)
    ours, theirs, bf16 = tmp_path / "ours", tmp_path / "theirs", tmp_path / "bf16"
    cold, _ = ask(tiny, ours)
    assert ask(other, theirs)[0] != cold
    ask(tiny, bf16, "bf16")
    folders = {path.parent.name for folder in (ours, theirs, bf16) for path in folder.rglob("*.safetensors")}
    assert len(folders) == 3  # one identity each
    target = first_file(ours)  # this model's: the others' asks below write folders of their own beside it
    for foreign, kv_cache_dtype in ((other, None), (tiny, "bf16")):
        _, metrics = ask(foreign, ours, kv_cache_dtype)
        assert metric(metrics, "smollm2_prefix_cache_disk_hit_tokens_total") == 0
        assert metric(metrics, "smollm2_prefix_cache_disk_refused_files_total") == 0  # not even looked at

    prompt = len(tokenizer.apply_chat_template(NOTES))
    good, written = target.read_bytes(), contents(target)
    spoils = [  # each spoiling of the file, and the reason it is refused for, where it is ours to give
        (lambda: target.write_bytes(good[:-1] + bytes([good[-1] ^ 1])), "checksum"),  # a flipped bit
        (lambda: target.write_bytes(good[:len(good) // 2]), ""),  # cut short: safetensors' own error
        (lambda: target.write_bytes(b"\x00" * 8 + b"{not json" + b"\xff" * 100), ""),
        (lambda: target.write_bytes(good + b"\x00" * (1 << 17)), "more than a block"),  # checked before opening
        (lambda: target.write_bytes(first_file(theirs).read_bytes()), "identity differs"),  # another model's
        (lambda: target.write_bytes(first_file(bf16).read_bytes()), "identity differs"),  # a bf16 cache's
        (lambda: wrong_dtype(target), "not F32"),  # checked before a tensor is read
    ]
    for spoil, reason in spoils:
        spoil()
        caplog.clear()
        answer, metrics = ask(tiny, ours)
        assert answer == cold
        assert metric(metrics, "smollm2_prefix_cache_disk_refused_files_total") == 1, reason
        assert metric(metrics, "smollm2_prefilled_tokens_total") == prompt  # the chain breaks at its first chunk
        assert any("refusing" in record.message and reason in record.message for record in caplog.records), reason
        assert contents(target) == written  # written anew
    answer, metrics = ask(tiny, ours)
    assert answer == cold and metric(metrics, "smollm2_prefilled_tokens_total") == 0


def test_a_cache_folder_needs_a_prefix_cache_and_a_folder(tiny, tmp_path):
    model, tokenizer = tiny
    with pytest.raises(SmolError, match="needs a prefix cache"):
        create_app(model, tokenizer, prefix_cache_bytes=0, prefix_cache_dir=tmp_path)
    (tmp_path / "file").write_text("")
    with pytest.raises(SmolError, match="cannot create it"):
        create_app(model, tokenizer, prefix_cache_dir=tmp_path / "file" / "cache")


def test_the_identity_hashes_held_blocks_and_the_activations_mode(monkeypatch):
    """A GGUF model's identity hashes its held matrices' blocks (what decides their values), not a float32 copy
    of each (the embedded model's took 0.93 s that way, 0.07 s now); int8 activations, which change the keys and
    values a prefill writes, make another identity, and exact again the first."""
    model = load()
    cache = model.new_cache(1, 16)
    monkeypatch.setattr(HeldWeight, "decoded", lambda self: pytest.fail("a held matrix was decoded"))
    exact = model_identity(model, cache, 2)
    model.accelerator.choices.int8_activations = True
    assert model_identity(model, cache, 2) != exact
    model.accelerator.choices.int8_activations = False
    assert model_identity(model, cache, 2) == exact
