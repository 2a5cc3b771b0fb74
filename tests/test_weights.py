"""A float32 model read from a quantized GGUF file holds each matrix the kernels stream as the file's blocks alone
(kernels/held.py): their values, what torch code computes with them, and the memory a loaded model takes."""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY, tiny_model
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from gguf_files import gguf_metadata, gguf_tensors, write_fields, write_gguf
from test_adapters import decode, loaded, served  # noqa: F401 (served: a fixture)
from test_kernels import WIDE, crafted_blocks, crafted_gguf_model

from smollm2 import SmolError, generate, kernels, load, save
from smollm2.checkpoints.gguf import SCALES, gguf_name, open_gguf, rotary_heads, unpermute
from smollm2.kernels.held import HeldWeight
from smollm2.kernels.packed import packed_layout, unpacked
from smollm2.lora import with_adapter
from smollm2.model import rope_tables
from smollm2.quantize import Int8Linear, quantize_int8

pytestmark = pytest.mark.skipif(kernels.compiled() is None, reason="no C compiler")

IDS = torch.tensor([[1, 7, 3, 30, 2, 11, 5, 19, 4, 8, 13, 21, 6, 9, 12, 17, 22, 25]])


def matrices(model) -> dict[str, torch.Tensor]:
    return {name: p for name, p in model.named_parameters() if p.dim() == 2}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.int32) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t


@pytest.mark.parametrize("qtype", list(SCALES), ids=lambda q: q.name)  # every type the kernels stream
def test_held_blocks_decode_to_ggufs_values(qtype):
    """packed.unpacked and the kernels' dequantize give gguf.quants.dequantize's float32 values bit for bit (-0
    included), all rows or some: every type the kernels stream is held as its blocks alone."""
    N, K = 32, 512
    blocks = crafted_blocks(N, K, qtype, np.random.default_rng(int(qtype)))
    want = torch.from_numpy(dequantize(blocks, qtype).reshape(N, K))
    packed = packed_layout(qtype, torch.from_numpy(blocks))
    assert torch.equal(bits(unpacked(packed)), bits(want))
    assert torch.equal(bits(HeldWeight(packed, (N, K)).decoded()), bits(want))  # kernels.c's dequantize
    rows = torch.tensor([[3, 31], [0, 3]])
    assert torch.equal(bits(unpacked(packed, rows)), bits(want[rows]))


@pytest.mark.parametrize("qtype", list(SCALES), ids=lambda q: q.name)
def test_a_quantized_gguf_model_holds_its_blocks_alone(tmp_path, qtype):
    """Every matrix is its blocks, no float32 copy beside them: only the norms are float32 tensors. What they hold
    is what the float32 model read from the same file has, and its state dict says so."""
    model = crafted_gguf_model(tmp_path / "tiny.gguf", qtype)
    plain = load(tmp_path / "tiny.gguf", kernels=False)
    assert all(isinstance(p, HeldWeight) for p in matrices(model).values())
    assert all(p.dim() == 1 for p in model.parameters() if not isinstance(p, HeldWeight))
    state, want = model.state_dict(), plain.state_dict()
    assert state.keys() == want.keys()
    assert all(torch.equal(bits(w.decoded() if isinstance(w, HeldWeight) else w), bits(want[name]))
               for name, w in state.items())
    with torch.inference_mode():
        embedded = model.model.embed_tokens(IDS % WIDE.vocab_size)
    assert torch.equal(bits(embedded), bits(plain.model.embed_tokens(IDS % WIDE.vocab_size).detach()))


@pytest.fixture(scope="module")
def q4_1(tmp_path_factory):
    path = tmp_path_factory.mktemp("held") / "tiny.gguf"
    source = tiny_model(TINY["gqa"])
    write_gguf(path, source.config, gguf_tensors(source, Q.Q4_1))
    return path


def test_torch_code_decodes_held_weights_on_demand(q4_1):
    """The reference path (torch alone, hooks' path), a deep copy, int8 quantizing, saving and converting compute
    with the decoded values: the same bits as the float32 model read from the same file."""
    model, plain = load(q4_1), load(q4_1, kernels=False)
    with torch.inference_mode():
        with model.accelerator.choices.torch_only():
            assert torch.equal(bits(model(IDS)), bits(plain(IDS)))
        copied = copy.deepcopy(model)
        up, copied_up = model.model.layers[0].mlp.up_proj.weight, copied.model.layers[0].mlp.up_proj.weight
        assert copied_up.packed.data is up.packed.data
        with copied.accelerator.choices.torch_only():
            assert torch.equal(bits(copied(IDS)), bits(plain(IDS)))
        int8, plain_int8 = quantize_int8(copy.deepcopy(model)), quantize_int8(copy.deepcopy(plain))
        assert all(torch.equal(a, b) for a, b in zip(int8.state_dict().values(), plain_int8.state_dict().values()))
    save(model, q4_1.parent / "saved")
    saved = load(q4_1.parent / "saved", kernels=False)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(saved.state_dict().values(), plain.state_dict().values()))
    bf16 = model.to(torch.bfloat16)
    assert not any(isinstance(p, HeldWeight) for p in bf16.parameters())
    assert all(torch.equal(a, b) for a, b in zip(bf16.state_dict().values(),
                                                  plain.to(torch.bfloat16).state_dict().values()))


def test_an_int8_weight_model_keeps_its_files_blocks_beside_the_int8_layers(q4_1):
    """--quantize int8 makes the blocks' linear layers int8 from their float32 values; the embeddings and output
    projection stay the file's blocks (no float32 copy: a decoding step reads them, a fifth of the bytes), with the
    values, and so the results, of the int8 model made from the float32 one."""
    model, plain = load(q4_1, quantize="int8"), load(q4_1, quantize="int8", kernels=False)
    assert isinstance(model.model.embed_tokens.weight, HeldWeight)
    assert isinstance(model.model.layers[0].mlp.up_proj, Int8Linear)
    state, want = model.state_dict(), plain.state_dict()
    assert state.keys() == want.keys()
    assert all(torch.equal(bits(w.decoded() if isinstance(w, HeldWeight) else w), bits(want[name]))
               for name, w in state.items())
    with torch.inference_mode(), model.accelerator.choices.torch_only():
        assert torch.equal(bits(model(IDS)), bits(plain(IDS)))


def test_held_weights_change_only_once_dequantized(q4_1):
    """An optimizer's step or a state dict loaded into the model would change the blocks in place: it raises,
    naming dequantize(), which gives every matrix its float32 values (the same), and training then runs."""
    model, plain = load(q4_1), load(q4_1, kernels=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(IDS).logsumexp(-1).mean().backward()
    with pytest.raises(SmolError, match=r"dequantize\(model\)"):
        optimizer.step()
    with pytest.raises(RuntimeError, match=r"dequantize\(model\)"):  # load_state_dict's, quoting ours
        model.load_state_dict(plain.state_dict())
    assert kernels.dequantize(model) is model
    assert not any(isinstance(p, HeldWeight) for p in model.parameters())
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(model.state_dict().values(), plain.state_dict().values()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(IDS).logsumexp(-1).mean().backward()
    optimizer.step()
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, plain.model.layers[0].mlp.up_proj.weight)


def test_adapters_serve_over_held_weights(q4_1, served):
    """generation/adapters.py over a held base: the adapted copy shares the held weights, a pass with adapter rows
    (each layer's product, then its rows' updates) and the engine's decoding (the whole-step kernel adding them)
    give the bits of the same runs over the base's float32 values; merging an adapter (lora.with_adapter) decodes
    the blocks and gives the merged float32 model's tokens."""
    held = load(q4_1)
    plain = kernels.dequantize(copy.deepcopy(held))
    adapters = {model: loaded(model, served) for model in (held, plain)}
    names = [None, "a", "b", "c", "d", None]
    ids = IDS[:, :8].repeat(len(names), 1) % held.config.vocab_size
    with torch.inference_mode():
        passes = {model: a.model_for([None if n is None else a.loaded[n] for n in names])(ids)
                  for model, a in adapters.items()}
        copied = adapters[held].adapted.model.layers[0].mlp.up_proj.base.weight
        assert isinstance(copied, HeldWeight) and copied is held.model.layers[0].mlp.up_proj.weight
    assert torch.equal(bits(passes[held]), bits(passes[plain]))
    prompts = [[1, 5, 9, 20, 17], [3, 4, 5], [7, 8, 9, 10, 11, 12], [10, 20], [42] * 5, [1, 2, 3]]
    runs = held.accelerator.kernel_runs["blocks"]
    got = decode(held, prompts, names, adapters[held], 8)
    assert held.accelerator.kernel_runs["blocks"] > runs
    assert got == decode(plain, prompts, names, adapters[plain], 8)
    merged, plain_merged = with_adapter(held, served / "a"), with_adapter(plain, served / "a")
    assert torch.equal(generate(merged, [prompts[0]], 6, temperature=0),
                       generate(plain_merged, [prompts[0]], 6, temperature=0))


PEAK = """
import json, re, sys
from pathlib import Path
from smollm2 import generate, load
model = load(sys.argv[1])
generate(model, [[1]], 1)  # every weight read once: the file's mapped pages resident, as once serving
loaded = Path("/proc/self/status").read_text()
for prompt in json.loads(sys.argv[2]):
    generate(model, [prompt], 32)
status = Path("/proc/self/status").read_text()
print(json.dumps({key: int(re.search(key + r":\\s+(\\d+)", text).group(1)) * 1024
                  for key, text in (("VmRSS", loaded), ("VmHWM", status))}))
"""


def resident(path, prompts: list[list[int]]) -> dict[str, int]:
    """Bytes resident once `path` is loaded and has decoded a token (VmRSS: its mapped weights read once), and at
    the peak of its load and the generation of 32 tokens after each of `prompts` in turn (VmHWM), in a process of
    its own."""
    done = subprocess.run([sys.executable, "-c", PEAK, str(path), json.dumps(prompts)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


KINDS = {bool: "bool", int: "u32", str: "str", list: "arr"}  # write_fields' kind of a metadata value


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_loaded_model_costs_its_file_and_the_runtime(embedded_path, tmp_path):
    """The embedded model (98 MB of Q4_1 and Q8_0 blocks), loaded and generating, holds at most 1.2x its file
    beside the runtime. The runtime is measured, not assumed: the same script in a process of its own (the
    interpreter, torch and what smollm2 imports, the compiled kernels, the tokenizer read from the file's
    metadata, RoPE tables for 1024 positions, a load and a 32-token generation) run on a model of a few hundred KB
    of the same types with the embedded file's tokenizer metadata. Each figure is compared with the runtime's same
    figure: resident once loaded (and a token decoded) with the same, the peak (load and generation) with the
    peak. The blocks are the file's bytes (packed.py); the 1.2 leaves room for what the KV cache and activations
    take (on a 2-core AMD EPYC VM: runtime 251 MiB loaded, 251 at the peak; the model 345 and 347; the file 94
    MiB, so the model costs 1.03x it; 1.16x when the kernels laid Q4_1 out again at 6 bits a weight)."""
    runtime, model = (resident(path, [[1, 504, 3458, 282]]) for path in (runtime_file(embedded_path, tmp_path),
                                                                          embedded_path))
    for figure in ("VmRSS", "VmHWM"):
        assert model[figure] <= runtime[figure] + 1.2 * embedded_path.stat().st_size, (figure, runtime, model)


def runtime_file(embedded_path: Path, tmp_path: Path) -> Path:
    """A model of a few hundred KB of the embedded file's types, with its tokenizer metadata: what loading and
    generating cost beside the weights."""
    tiny = dataclasses.replace(TINY["gqa"], max_position_embeddings=8192)
    source = tiny_model(tiny)
    tensors = gguf_tensors(source, Q.Q4_1)
    tensors["token_embd.weight"] = gguf_tensors(source, Q.Q8_0)["token_embd.weight"]  # as the embedded file
    vocabulary = {key: (KINDS[type(value)], value) for key, value in open_gguf(embedded_path).metadata.items()
                  if key.startswith("tokenizer.")}
    write_fields(tmp_path / "tiny.gguf", {**gguf_metadata(tiny), **vocabulary}, tensors)
    return tmp_path / "tiny.gguf"


@pytest.mark.slow
@pytest.mark.subprocess
def test_serving_prompts_adds_their_cache_not_the_loads_holes(embedded_path, tmp_path, model):
    """Prompts of 128 tokens, one after another, raise the embedded model's peak over what its load left resident
    by no more than they raise the runtime's (the tiny model above, the same prompts: ~8 MB) and twice the KV cache
    they fill (7.4 MB: the cache, and as much again for a prompt's activations). As loading once left its freed
    copies as holes between the held blocks (held.heap_for_loading), a prompt's activations landed in them and the
    holes they touched stayed resident: the peak rose by ~50 MB, more with each prompt; now by ~15 MB."""
    prompts = torch.randint(3, 49152, (3, 128), generator=torch.Generator().manual_seed(0)).tolist()
    runtime, embedded = (resident(path, prompts) for path in (runtime_file(embedded_path, tmp_path), embedded_path))
    config = model.config
    cache = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4 * (128 + 32)
    rise = {name: got["VmHWM"] - got["VmRSS"] for name, got in (("runtime", runtime), ("model", embedded))}
    assert rise["model"] <= rise["runtime"] + 2 * cache, (rise, cache)


def mapping_of(t: torch.Tensor) -> str:
    """What /proc/self/maps says holds t's first byte: a file's path, [heap], or nothing."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split()
        low, high = (int(x, 16) for x in span.split("-"))
        if low <= t.data_ptr() < high:
            return rest[-1] if len(rest) == 5 else ""
    return ""


def test_a_float32_gguf_matrix_is_the_files_own_pages(tmp_path):
    """An F32 file's matrices whose rows the model takes in the file's order are mapped, not copied (q and k,
    whose rows llama.cpp permutes, are copies); a change in place copies its page, never the file."""
    source = tiny_model(TINY["gqa"])
    path = tmp_path / "f32.gguf"
    write_gguf(path, source.config, gguf_tensors(source, Q.F32))
    model = load(path)
    for name, p in model.named_parameters():
        assert (mapping_of(p) == str(path)) == (p.dim() == 2 and not name.endswith(("q_proj.weight", "k_proj.weight")))
        assert torch.equal(p, source.get_parameter(name))
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(2)
    assert torch.equal(load(path).model.layers[0].mlp.up_proj.weight, source.model.layers[0].mlp.up_proj.weight)


@pytest.mark.parametrize("qtype", list(SCALES), ids=lambda q: q.name)  # every type the kernels stream
def test_a_quantized_gguf_matrix_is_the_files_own_bytes(tmp_path, qtype):
    """A held matrix's blocks are the file's bytes, as the file holds them (q and k, whose rows llama.cpp permutes:
    each row the file's row's bytes), copied into the model's own room of huge pages (packed.HugePages), not the
    file's mapped pages: from the 4 KiB pages of a file's mapping the 360M Q8_0 model decoded 0.88x as fast
    (benchmarks/huge_pages.py)."""
    path = tmp_path / "tiny.gguf"
    model = crafted_gguf_model(path, qtype)
    file = {t.name: t for t in open_gguf(path).tensors}
    for name, p in matrices(model).items():
        permuted = name.endswith(("q_proj.weight", "k_proj.weight"))
        assert mapping_of(p.packed.data) != str(path), name
        blocks = torch.from_numpy(np.array(file[gguf_name(name)].data))
        want = unpermute(blocks, rotary_heads(name, model.config)) if permuted else blocks
        assert torch.equal(p.packed.data, want), name


def test_rope_tables_are_built_for_the_caches_made():
    """A model holds RoPE tables for 1024 positions up front (0.5 MiB at head_dim 64), not its context window's
    (8192: 4 MiB), and grows them to each cache's length as it is made: the same values, bit for bit, as tables
    built for the whole window."""
    config = dataclasses.replace(TINY["gqa"], max_position_embeddings=8192, head_dim=64)
    model, (cos, sin) = tiny_model(config), rope_tables(config)
    assert model.rope_cos.shape == (1024, 64)
    model.new_cache(1, 3000)
    n = model.rope_cos.shape[0]
    assert 3000 <= n <= 8192
    assert torch.equal(bits(model.rope_cos), bits(cos[:n])) and torch.equal(bits(model.rope_sin), bits(sin[:n]))


@pytest.mark.subprocess
def test_running_a_model_imports_no_tokenizer_or_grammar_engine():
    """What a process that loads a model and generates from ids (smollm2 bench's) imports: not the tokenizer's
    jinja2 and tokenizers, nor llguidance, which a grammar imports at its first use (~8 MB resident between them),
    nor safetensors, which a GGUF model's run never reads (~0.75 MB)."""
    script = ("import sys, torch, smollm2.bench, smollm2.loading\n"
              "from smollm2.generation import stream\n"
              "from smollm2.generation.speculative import speculation\n"
              "assert speculation(None, None) is None and speculation('ngram', None) == 'ngram'\n"
              "print(sorted({'jinja2', 'tokenizers', 'llguidance', 'smollm2.tokenizer', 'safetensors'}\n"
              "             & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["[]"]


def test_the_heap_keeps_64_mib_free_at_its_top_after_loading(monkeypatch):
    """heap_for_loading: glibc's thresholds at 128 KiB inside, then blocks of their own from 32 MiB and a free top
    kept up to 64 MiB (glibc's own once risen; a batched prefill's activations freed at each layer are not handed
    back and faulted in again), the freed pages handed back as it ends."""
    from smollm2.kernels import held

    calls = []

    class Glibc:
        def mallopt(self, parameter, value):
            calls.append((parameter, value))

        def malloc_trim(self, pad):
            calls.append(("trim", pad))

    monkeypatch.setattr(held.ctypes, "CDLL", lambda name: Glibc())
    with held.heap_for_loading():
        assert calls == [(held.M_MMAP_THRESHOLD, 128 << 10), (held.M_TRIM_THRESHOLD, 128 << 10)]
    assert calls[2:] == [("trim", 0), (held.M_MMAP_THRESHOLD, 32 << 20), (held.M_TRIM_THRESHOLD, 64 << 20)]


def test_held_matrices_share_rooms_of_huge_pages():
    """packed.HugePages: matrices side by side in one room (each 64-byte aligned, the first at a huge page's start),
    one larger than a room in a room of its own, numpy's own arrays from 4 MiB kept as they are; where Linux gives
    transparent huge pages on request, a room's written pages are huge ones. A room is let go with the last matrix
    in it."""
    from smollm2.kernels.packed import HUGE, NUMPYS, HugePages

    pages = HugePages()
    small = [pages.empty((n, 3)) for n in (1000, 7, 333334)]
    at = [t.data_ptr() for t in small]
    assert at[0] % HUGE == 0 and at[1] == at[0] + 3008 and at[2] == at[1] + 64
    assert pages.copy(torch.arange(5, dtype=torch.uint8)).tolist() == [0, 1, 2, 3, 4]
    big = torch.zeros(NUMPYS, dtype=torch.uint8)
    assert pages.copy(big) is big  # numpy's, already
    alone = pages.empty((HugePages.ROOM + 1,))
    assert alone.data_ptr() % HUGE == 0 and pages.empty((1,)).data_ptr() % HUGE == 0  # its room full: a new one
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        return
    small[2].fill_(1)  # 1 MB written: the room's first 2 MiB page
    for line_at, line in enumerate(lines := Path("/proc/self/smaps").read_text().splitlines()):
        span = line.split()[0]
        if "-" in span and int(span.split("-")[0], 16) <= at[0] < int(span.split("-")[1], 16):
            huge = next(x for x in lines[line_at:] if x.startswith("AnonHugePages:"))
            assert int(huge.split()[1]) >= HUGE >> 10, huge
            return
    raise AssertionError("the room is not mapped")
