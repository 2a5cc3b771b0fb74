"""Model FLOPs utilisation (MFU): the FLOPs of the products a training step computed, over the time it took, over
the fastest dense-matmul rate this machine has been seen to reach.

The peak is measured, not looked up in a table of chip names, and a measurement is only as good as the machine was
quiet: on a busy machine a short one reads low, and every MFU measured against it reads high (past 100%). So the
peak is measured with long products, again and again until the best time repeats, and kept in the user's cache
(per device, dtype, thread count and torch version) as the best rate ever measured: the next runs measure again
(a bounded number of times) and keep the faster, so a peak measured on a busy machine does not stay low for good.
A training step whose products ran faster than the kept peak shows it is still low: that step's rate is the
peak from then on. MFU is then at most 100%, and a busy machine shows as what it is: slow steps, a low MFU.
"""

from __future__ import annotations

import json
import math
import platform
import tempfile
import time
from pathlib import Path

import torch

from ..kernels.build import cache_dir

SIZE = {"cpu": 2048, "cuda": 8192}  # the products' side: long enough that one takes ~0.1 s or more
MIN_RUNS, MAX_RUNS, BUDGET_S = 3, 20, 3.0  # timed products per measurement, after a warm-up one
SPREAD = 0.05  # the best time counts once the second best is within 5% of it: not one lucky run
MEASUREMENTS = 3  # runs that measure the peak again, each keeping the faster


def training_flops(config, tokens: int, length: int, projected: int, frozen: bool) -> float:
    """The FLOPs of one training step's products, PaLM's way (2 per multiply-add; backward twice forward), from
    what the step computed: `tokens` positions through every block, in sequences of `length` (padding
    included), `projected` of them through the output projection. frozen: the blocks' and output's weights get
    no gradients (LoRA: only the activations' are computed; the adapters' own products, r rows each, are left
    out)."""
    c = config
    attn = c.hidden_size * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    block_weights = c.num_hidden_layers * (attn + 3 * c.hidden_size * c.intermediate_size)
    passes = 4 if frozen else 6  # forward, activations' gradients, weights' gradients: 2 each
    attention = 12 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * length  # scores and values
    return tokens * (passes * block_weights + attention) + projected * passes * c.vocab_size * c.hidden_size


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
                platform.processor() or platform.machine())


class PeakFlops:
    """The yardstick of MFU for one device and dtype (see the module's docstring). file: where peaks are kept
    (default: the user's cache)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, file: Path | None = None):
        self.device, self.dtype = device, dtype
        self.file = file or cache_dir() / "peak-flops.json"
        threads = f"{torch.get_num_threads()} threads" if device.type == "cpu" else ""
        self.key = " | ".join([device_name(device), str(dtype).removeprefix("torch."), threads,
                               f"torch {torch.__version__}"])
        kept = self.read().get(self.key, {})
        self.flops, self.measurements = float(kept.get("flops", 0.0)), int(kept.get("measurements", 0))
        if self.measurements < MEASUREMENTS:
            self.flops, self.measurements = max(self.flops, self.measure()), self.measurements + 1
            self.save()

    def product_seconds(self, a: torch.Tensor, b: torch.Tensor) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        a @ b
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def measure(self) -> float:
        """The best rate of square products, timed until the best time repeats (or MAX_RUNS, or BUDGET_S)."""
        n = SIZE.get(self.device.type, SIZE["cpu"])
        numbers = torch.Generator(self.device).manual_seed(0)  # not torch's own: training's draws stay as they were
        a, b = (torch.randn(n, n, device=self.device, generator=numbers).to(self.dtype) for _ in "ab")
        self.product_seconds(a, b)  # warm-up
        times, start = [], time.perf_counter()
        while len(times) < MAX_RUNS:
            times.append(self.product_seconds(a, b))
            best, second = sorted(times)[:2] if len(times) > 1 else (times[0], math.inf)
            if len(times) >= MIN_RUNS and (second <= best * (1 + SPREAD) or time.perf_counter() - start > BUDGET_S):
                break
        return 2 * n**3 / min(times)

    def utilisation(self, flops: float, seconds: float) -> float:
        """MFU of a step that computed `flops` in `seconds`; a step faster than the peak becomes the peak."""
        rate = flops / seconds
        if rate > self.flops:
            self.flops = rate
            self.save()
        return rate / self.flops

    def describe(self) -> str:
        return (f"MFU against a peak of {self.flops / 1e9:.1f} GFLOP/s: {self.key}, the best of {self.measurements} "
                f"measurement{'s' * (self.measurements > 1)} ({self.file})")

    def read(self) -> dict:
        try:
            return json.loads(self.file.read_text())
        except (OSError, RuntimeError, ValueError):  # RuntimeError: no home directory
            return {}

    def save(self) -> None:
        """Adds this peak to the file, beside those of other devices; where it cannot be written, the next run
        measures again."""
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            peaks = {**self.read(), self.key: {"flops": self.flops, "measurements": self.measurements}}
            with tempfile.TemporaryDirectory(dir=self.file.parent) as tmp:  # then renamed: never half a file
                written = Path(tmp) / self.file.name
                written.write_text(json.dumps(peaks, indent=1))
                written.replace(self.file)
        except (OSError, RuntimeError):
            pass
