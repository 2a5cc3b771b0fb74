"""Speed, measured the way llama-bench does (pp: prompt tokens/s, tg: generated tokens/s), side by side.

Every system is timed by one protocol on the same weights and the same random prompt: one generation of
N tokens that marks the moment each step's tokens arrive. Prefill is the time to the first token (B*T
tokens), decode the time from the first token to the last (B*(N-1) tokens). Each figure is the best of a
few runs after a warm-up, the systems taking turns: these machines are noisy, so compare ratios from one run,
not figures across runs. `smollm2 bench` keeps each system in a process of its own (timed_apart), as their
users run them: compare() is that command, a Setup what it times.

    found = compare(Setup(model="model.gguf", prompt_tokens=128), others=("transformers",))
    print(found.table())                       # each system's speeds, then our ratio to each other one
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import multiprocessing
import re
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from . import loading
from .errors import SmolError
from .generation import stream
from .generation.speculative import speculation
from .kernels import weight_format


@dataclass
class Speed:
    system: str
    prefill_tok_s: float
    decode_tok_s: float
    peak_memory_mb: float  # the process's peak while generating (RSS on the CPU), the model included


def reset_peak_memory(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    elif Path("/proc/self/clear_refs").exists():
        Path("/proc/self/clear_refs").write_text("5")  # Linux: restart the peak resident set from now


def peak_memory_mb(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    status = Path("/proc/self/status")
    if status.exists():
        return int(re.search(r"VmHWM:\s+(\d+)", status.read_text()).group(1)) / 2**10
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # elsewhere: the whole run's peak, KiB


def one_run(run: Callable, device: str) -> tuple[float, float]:
    """run(mark) once: the seconds to its first mark (prefill) and from its first mark to its last (decode)."""
    marks = []

    def mark():
        if device == "cuda":
            torch.cuda.synchronize()
        marks.append(time.perf_counter())

    start = time.perf_counter()
    run(mark)
    return marks[0] - start, marks[-1] - marks[0]


def warm_up(run: Callable, device: str) -> float:
    """A first, untimed run (allocations, kernel choice, compilation); its peak memory: what the system holds,
    from the moment it starts, beside what was there before."""
    reset_peak_memory(device)
    one_run(run, device)
    return peak_memory_mb(device)


def take_turns(runs: dict[str, Callable[[], tuple[float, float]]], repeats: int) -> dict[str, tuple[float, float]]:
    """Each system's best prefill and decode seconds over `repeats` runs of runs[name](); the systems take turns,
    a run each, so that a noisy stretch of the machine falls on all of them alike."""
    best = dict.fromkeys(runs, (math.inf, math.inf))
    for _ in range(repeats):
        for name, run in runs.items():
            prefill, decode = run()
            best[name] = (min(best[name][0], prefill), min(best[name][1], decode))
    return best


def speeds(shape: tuple[int, int], new_tokens: int, best: dict, peaks: dict) -> list[Speed]:
    (B, T), n = shape, new_tokens - 1
    return [Speed(name, B * T / prefill, B * n / decode, peaks[name]) for name, (prefill, decode) in best.items()]


def timed(systems: list[tuple[str, Callable]], prompt: torch.Tensor, new_tokens: int, repeats: int) -> list[Speed]:
    """systems: (name, make) pairs, make() returning run(mark), which generates new_tokens tokens per row and
    calls mark() as each step's tokens arrive; all in this process, taking turns (see take_turns). Each is
    warmed up by one run, whose peak memory is reported."""
    device, runs, peaks = prompt.device.type, {}, {}
    for name, make in systems:
        run = make()
        peaks[name] = warm_up(run, device)
        runs[name] = functools.partial(one_run, run, device)
    return speeds(prompt.shape, new_tokens, take_turns(runs, repeats), peaks)


def serve_runs(make: Callable, device: str, conn) -> None:
    """A system's own process (see timed_apart): make() gives (run, facts); it is warmed up, its facts and peak
    memory sent, then it runs once, timed, each time it is asked to."""
    try:
        run, facts = make()
    except SmolError as e:  # bad input: the parent says it in one line
        conn.send(e)
        return
    peak = warm_up(run, device)
    conn.send((facts(), peak))
    while conn.recv():
        conn.send(one_run(run, device))


def timed_apart(systems: list[tuple[str, Callable]], shape: tuple[int, int], new_tokens: int, repeats: int,
                device: str) -> tuple[list[Speed], dict]:
    """As timed(), but each system in a process of its own, as its users run it: one system's memory churn
    (pages it freed, which the next must fault in again: ~10% of a prefill) and peak do not fall on another.
    Here make() returns (run, facts), facts() a dict of what the system reports about itself after its warm-up
    run (the choices it made in it, say); make runs in the system's process, so it must be a module-level
    function or a functools.partial of one. Returns the speeds and every system's facts, merged."""
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked OpenMP or CUDA state
    processes, runs, peaks, facts = [], {}, {}, {}

    def answer(conn, name: str):
        try:
            got = conn.recv()
        except EOFError:
            raise SmolError(f"bench: {name}'s process ended without an answer (its error is above)") from None
        if isinstance(got, Exception):
            raise got
        return got

    def turn(conn, name: str) -> tuple[float, float]:
        conn.send(True)
        return answer(conn, name)

    try:
        for name, make in systems:  # one after another: each warm-up's peak is its own
            conn, child = context.Pipe()
            process = context.Process(target=serve_runs, args=(make, device, child), daemon=True)
            process.start()
            processes.append((process, conn))
            more, peaks[name] = answer(conn, name)
            facts.update(more)
            runs[name] = functools.partial(turn, conn, name)
        return speeds(shape, new_tokens, take_turns(runs, repeats), peaks), facts
    finally:
        for process, conn in processes:
            with contextlib.suppress(OSError):
                conn.send(False)
            process.join(timeout=30)
            if process.is_alive():
                process.kill()


def random_prompt(vocab_size: int, batch_size: int, tokens: int, device) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch_size, tokens), generator=torch.Generator().manual_seed(0)).to(device)


def ours(model, prompt: torch.Tensor, new_tokens: int, compile: bool | None = None, speculative=None,
         kv_cache_dtype: str | None = None):
    """smollm2's run(mark): greedy, no EOS stop; speculative as stream takes it; its KV cache storing
    kv_cache_dtype (None: the model's). run returns what its decoding passes did (PassCounts)."""
    def run(mark):
        steps = stream(model, prompt, new_tokens, eos_token_id=None, compile=compile, speculative=speculative,
                       kv_cache_dtype=kv_cache_dtype)
        while True:
            try:
                next(steps)
            except StopIteration as end:
                return end.value
            mark()

    return run


def bench_ours(model, prompt: torch.Tensor, new_tokens: int, repeats: int = 2,
               compile: bool | None = None) -> Speed:
    return timed([("smollm2", lambda: ours(model, prompt, new_tokens, compile))], prompt, new_tokens, repeats)[0]


def transformers(model, prompt: torch.Tensor, new_tokens: int):
    """transformers' run(mark): its LlamaForCausalLM (default attention) on our model's weights, greedy generate."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.generation.streamers import BaseStreamer

    dtype = model.model.embed_tokens.weight.dtype
    hf = LlamaForCausalLM(LlamaConfig(**model.config.to_hf())).to(prompt.device, dtype).eval()
    hf.load_state_dict(model.state_dict(), strict=False)  # a tied lm_head follows the embedding
    mask = torch.ones_like(prompt)

    class Marks(BaseStreamer):  # generate hands a streamer the prompt, then each step's tokens
        def __init__(self, mark):
            self.mark, self.prompt_seen = mark, False

        def put(self, value):
            if self.prompt_seen:
                self.mark()
            self.prompt_seen = True

        def end(self):
            pass

    @torch.inference_mode()
    def run(mark):
        hf.generate(prompt, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                    do_sample=False, pad_token_id=0, streamer=Marks(mark))

    return run


# What `smollm2 bench` times, each system in a process of its own.

@dataclass(frozen=True)
class Setup:
    """A model as smollm2.load takes it (source, dtype, device, adapter, quantize, kernels, int8_activations), how
    it generates (compile, the KV cache's dtype, speculative in the command line's words:
    generation.speculative.speculation), the torch threads (None: torch's choice) and the run's shape: batch_size
    prompts of prompt_tokens random tokens, new_tokens generated each, greedy."""
    model: str | None = None
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    adapter: str | None = None
    quantize: str | None = None
    kernels: bool = True
    int8_activations: bool = False
    compile: bool | None = None
    kv_cache_dtype: str | None = None
    speculative: str | None = None
    threads: int | None = None
    batch_size: int = 1
    prompt_tokens: int = 512
    new_tokens: int = 128  # a decode time needs two steps: the first token is the prefill's

    def __post_init__(self):
        for flag, least in (("batch_size", 1), ("prompt_tokens", 1), ("new_tokens", 2)):
            if getattr(self, flag) < least:
                raise SmolError(f"--{flag.replace('_', '-')} must be at least {least}")

    def load(self):
        """The model, in the process that times it, on setup.threads torch threads."""
        if self.device == "cuda" and not torch.cuda.is_available():
            raise SmolError("--device cuda: no CUDA device is available")
        if self.threads:
            torch.set_num_threads(self.threads)
        return loading.load(self.model, dtype=self.dtype, device=self.device, adapter=self.adapter,
                            quantize=self.quantize, kernels=self.kernels, int8_activations=self.int8_activations)

    def prompt(self, vocab_size: int) -> torch.Tensor:
        return random_prompt(vocab_size, self.batch_size, self.prompt_tokens, self.device)


def smollm2_run(setup: Setup):
    """smollm2's run and facts, in the process that times it: after the warm-up run, which chose between the
    kernels and torch, what the model read and chose, and what its decoding passes did (speculating, a pass
    decodes more than a token a row)."""
    model = setup.load()
    # The model's tokenizer only where a draft's is checked against it: ~10 MB resident that the run never reads,
    # and its module's imports (jinja2, tokenizers) ~5 MB more.
    tokenizer = None
    if (setup.speculative or "").startswith("draft"):
        from .tokenizer import Tokenizer

        tokenizer = Tokenizer.from_pretrained(setup.model)
    guesser = speculation(setup.speculative, tokenizer, dtype=setup.dtype, device=setup.device,
                          quantize=setup.quantize, kernels=setup.kernels)
    run = ours(model, setup.prompt(model.config.vocab_size), setup.new_tokens, setup.compile, guesser,
               setup.kv_cache_dtype)
    counts = []

    def counted(mark):
        counts.append(run(mark))

    def facts():
        accelerator = getattr(model, "accelerator", None)  # none: kernels off, another device, no C compiler
        c = counts[-1]
        return dict(weights_read=weight_format(model),  # what our decoding steps read
                    kernels=accelerator.mode if accelerator else "off",
                    activations="int8" if accelerator and accelerator.int8_activations else "exact",
                    kernel_choices=accelerator.report() if accelerator else [],
                    tokens_per_pass=round(c.decoded / max(c.passes, 1), 2),
                    acceptance=round(c.kept / c.guessed, 3) if c.guessed else None)

    return counted, facts


def torch_run(setup: Setup):
    """smollm2's reference model, model.py on torch alone (kernels off): what the kernels must beat. Its facts
    are smollm2's to report."""
    run, _ = smollm2_run(dataclasses.replace(setup, kernels=False, int8_activations=False))
    return run, lambda: {}


def transformers_run(setup: Setup):
    """transformers' run on the same checkpoint (unquantized) and prompt, in the process that times it."""
    model = dataclasses.replace(setup, quantize=None).load()
    return transformers(model, setup.prompt(model.config.vocab_size), setup.new_tokens), lambda: {}


OTHERS = {"torch": ("smollm2 (torch)", torch_run), "transformers": ("transformers", transformers_run)}


@dataclass
class Comparison:
    """compare()'s answer: each system's speeds (smollm2's first), and what smollm2 reported of its runs."""
    speeds: list[Speed]
    weights_read: str  # what its decoding steps read: the dtype's weights, int8 ones, or a GGUF file's blocks
    kernels: str  # the accelerator's mode, or "off"
    activations: str  # what its decoding products multiply GGUF blocks by: "exact" float32, or "int8" quantized
    kernel_choices: list[dict]  # each operation on the kernel or torch, whichever was faster here
    tokens_per_pass: float  # tokens a decoding pass gave a row: above 1 where guesses stood
    acceptance: float | None  # guesses kept over guesses made (None: none made)

    def table(self) -> str:
        """The systems' speeds, then the first one's ratio to each other."""
        lines = [f"{'system':<18}{'prefill tok/s':>15}{'decode tok/s':>15}{'peak MiB':>11}"]
        lines += [f"{r.system:<18}{r.prefill_tok_s:>15.1f}{r.decode_tok_s:>15.1f}{r.peak_memory_mb:>11.0f}"
                  for r in self.speeds]
        ours = self.speeds[0]
        lines += [f"{'ratio to ' + ref.system:<18}{ours.prefill_tok_s / ref.prefill_tok_s:>14.2f}x"
                  f"{ours.decode_tok_s / ref.decode_tok_s:>14.2f}x" for ref in self.speeds[1:]]
        return "\n".join(lines)


def compare(setup: Setup, others: tuple[str, ...] = (), repeats: int = 2) -> Comparison:
    """smollm2 on `setup`, and beside it each of `others` ("torch": model.py alone, the kernels off;
    "transformers": its LlamaForCausalLM on the same weights, unquantized), each in a process of its own
    (timed_apart), the best of `repeats` runs after a warm-up. This process takes setup.threads torch threads."""
    if repeats < 1:
        raise SmolError("--repeats must be at least 1")
    unknown = set(others) - OTHERS.keys()
    if unknown:
        raise SmolError(f"others must be among {', '.join(OTHERS)}, got {', '.join(sorted(unknown))}")
    if setup.threads:
        torch.set_num_threads(setup.threads)
    systems = [("smollm2", functools.partial(smollm2_run, setup))]
    systems += [(OTHERS[name][0], functools.partial(OTHERS[name][1], setup)) for name in dict.fromkeys(others)]
    speeds, facts = timed_apart(systems, (setup.batch_size, setup.prompt_tokens), setup.new_tokens, repeats,
                                setup.device)
    return Comparison(speeds, **facts)
