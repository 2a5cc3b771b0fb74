"""Speed, measured the way llama-bench does (pp: prompt tokens/s, tg: generated tokens/s), side by side.

Every system is timed by one protocol on the same weights and the same random prompt: one generation of
N tokens that marks the moment each step's tokens arrive. Prefill is the time to the first token (B*T
tokens), decode the time from the first token to the last (B*(N-1) tokens). Each figure is the best of a
few runs after a warm-up, the systems taking turns: these machines are noisy, so compare ratios from one run,
not figures across runs.
"""

from __future__ import annotations

import math
import re
import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .generation import stream


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


def timed(systems: list[tuple[str, Callable]], prompt: torch.Tensor, new_tokens: int, repeats: int) -> list[Speed]:
    """systems: (name, make) pairs, make() returning run(mark), which generates new_tokens tokens per row and
    calls mark() as each step's tokens arrive. The systems take turns, a run each, so that a noisy stretch of
    the machine falls on all of them alike; each figure is its system's best. make() is called at the
    system's first turn, a warm-up (allocations, kernel choice, compilation) whose peak memory is reported:
    what the system holds beside those made before it."""
    (B, T), device = prompt.shape, prompt.device.type
    runs, peaks = {}, {}
    prefill, decode = (dict.fromkeys((name for name, _ in systems), math.inf) for _ in range(2))
    for attempt in range(repeats + 1):
        for name, make in systems:
            if not attempt:
                runs[name] = make()
                reset_peak_memory(device)
            marks = []

            def mark():
                if device == "cuda":
                    torch.cuda.synchronize()
                marks.append(time.perf_counter())

            start = time.perf_counter()
            runs[name](mark)
            if not attempt:
                peaks[name] = peak_memory_mb(device)
            else:
                prefill[name] = min(prefill[name], marks[0] - start)
                decode[name] = min(decode[name], marks[-1] - marks[0])
    return [Speed(name, B * T / prefill[name], B * (new_tokens - 1) / decode[name], peaks[name]) for name, _ in systems]


def random_prompt(vocab_size: int, batch_size: int, tokens: int, device) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch_size, tokens), generator=torch.Generator().manual_seed(0)).to(device)


def ours(model, prompt: torch.Tensor, new_tokens: int, compile: bool | None = None):
    """smollm2's run(mark): greedy, no EOS stop."""
    def run(mark):
        for _ in stream(model, prompt, new_tokens, eos_token_id=None, compile=compile):
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


def table(rows: list[Speed]) -> str:
    lines = [f"{'system':<14}{'prefill tok/s':>15}{'decode tok/s':>15}{'peak MiB':>11}"]
    lines += [f"{r.system:<14}{r.prefill_tok_s:>15.1f}{r.decode_tok_s:>15.1f}{r.peak_memory_mb:>11.0f}" for r in rows]
    if len(rows) == 2:
        ours, ref = rows
        lines.append(f"{'ratio':<14}{ours.prefill_tok_s / ref.prefill_tok_s:>14.2f}x"
                     f"{ours.decode_tok_s / ref.decode_tok_s:>14.2f}x")
    return "\n".join(lines)


def as_dict(rows: list[Speed]) -> list[dict]:
    return [asdict(r) for r in rows]
