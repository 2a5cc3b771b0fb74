"""Speed, measured the way llama-bench does (pp: prompt tokens/s, tg: generated tokens/s), side by side.

Both systems are timed by one protocol on the same weights and the same random prompt: t1, the time to
generate 1 token (the prefill), and tN, the time to generate N; prefill tok/s = B*T / t1 and decode tok/s =
B*(N-1) / (tN - t1). Each figure is the best of a few runs after a warm-up: these machines are noisy, so
compare ratios from one run, not figures across runs.
"""

from __future__ import annotations

import re
import resource
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .generation import generate


@dataclass
class Speed:
    system: str
    prefill_tok_s: float
    decode_tok_s: float
    peak_memory_mb: float  # the process's peak while generating (RSS on the CPU), the model included


def _best_time(run, repeats: int) -> float:
    run()  # warm-up: allocations, kernel choice, compilation
    best = float("inf")
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


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
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux, bytes on macOS


def _speed(system, generate_n, prompt: torch.Tensor, new_tokens: int, repeats: int, device) -> Speed:
    """Peak memory counts from here: generation's own, not loading's."""
    B, T = prompt.shape
    reset_peak_memory(device)
    t1 = _best_time(lambda: generate_n(1), repeats)
    tn = _best_time(lambda: generate_n(new_tokens), repeats)
    return Speed(system, B * T / t1, B * (new_tokens - 1) / max(tn - t1, 1e-9), peak_memory_mb(device))


def random_prompt(vocab_size: int, batch_size: int, tokens: int, device) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch_size, tokens), generator=torch.Generator().manual_seed(0)).to(device)


def bench_ours(model, prompt: torch.Tensor, new_tokens: int, repeats: int = 2, compile: bool = False) -> Speed:
    device = prompt.device.type

    def generate_n(n):
        generate(model, prompt, n, eos_token_id=None, compile=compile)

    return _speed("smollm2", generate_n, prompt, new_tokens, repeats, device)


def bench_transformers(model, prompt: torch.Tensor, new_tokens: int, repeats: int = 2) -> Speed:
    """transformers' LlamaForCausalLM (eager attention, as in its default CPU setup) on our model's weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dtype = model.model.embed_tokens.weight.dtype
    hf = LlamaForCausalLM(LlamaConfig(**model.config.to_hf())).to(prompt.device, dtype).eval()
    hf.load_state_dict(model.state_dict(), strict=False)  # a tied lm_head follows the embedding
    mask = torch.ones_like(prompt)

    @torch.inference_mode()
    def generate_n(n):
        hf.generate(prompt, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                    pad_token_id=0)

    return _speed("transformers", generate_n, prompt, new_tokens, repeats, prompt.device.type)


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
