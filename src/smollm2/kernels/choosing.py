"""The faster of a kernel and torch's code, for each kind of operation, measured on the machine that runs it.

Which one wins depends on the CPU (on an AVX2-only CPU a prompt's products ran 4-6x slower on the kernel than on
MKL's sgemm), its cores and torch's build: rather than guess from the CPU's flags, the first call of each kind
times both and the winner runs from then on. Decisions are kept in a file in the user's cache, one per kernel
build, torch version and torch dispatch, so that a later process measures nothing again. They are only as good
as the machine was quiet while measuring: delete the file to measure again.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

TURNS = 3  # timed runs of each, in turns, after one warm-up run each; the best of each counts


class Key(NamedTuple):
    """A kind of operation: calls of one kind run alike, so one measurement decides them all."""
    op: str  # linear, blocks (a decoding step), prompt_attention, rms_norm, rope or silu_mul
    dtype: str  # the activations'
    weights: str | None  # the format a product's weights are streamed in (kernels.WEIGHT_FORMATS)
    rows: int  # rows (tokens; a prompt's attention: its length), as rows_bucket() groups them
    threads: int  # torch.get_num_threads()
    sizes: tuple[int, ...]  # the rest of the shape, as describe() reads it


class Choice(NamedTuple):
    winner: str  # "kernel" or "torch"
    kernel_s: float  # the best of TURNS runs
    torch_s: float


DECODING_ROWS = 16  # rows of a decoding step the kernel takes in one call (kernels.MAX_ROWS)


def rows_bucket(rows: int) -> int:
    """A decoding step's 1-16 rows are one kind: the kernel gives a row the same bits whatever its batch, which
    holds only if every batch size runs on the same side. A prompt's rows rounded up to a power of two: prompts
    of 300 and 500 tokens are one kind, not two."""
    return DECODING_ROWS if rows <= DECODING_ROWS else 1 << (rows - 1).bit_length()


def describe(key: Key, choice: Choice) -> str:
    """One line: what ran this kind of operation, and the times that decided it."""
    match key.op, key.sizes:
        case "linear", (K, *N):
            what = f"product {K} -> {'+'.join(map(str, N))}"
        case "blocks", (layers, *_):
            what = f"decode step, {layers} blocks"
        case "prompt_attention", (_, H, KVH, D):
            what = f"prompt attention, {H}/{KVH} heads of {D}"
        case "rms_norm", (C,):
            what = f"RMSNorm of {C}"
        case "rope", (heads, D):
            what = f"RoPE, {heads} heads of {D}"
        case "silu_mul", (I,):
            what = f"SiLU*up of {I}"
    rows = f"{1 if key.rows == DECODING_ROWS else key.rows // 2 + 1}-{key.rows} rows"  # the bucket's range
    weights = f" reading {key.weights}" if key.weights else ""
    return (f"{what}, {rows}, {key.dtype}{weights}: {choice.winner} "
            f"(kernel {choice.kernel_s * 1e3:.3g} ms vs torch {choice.torch_s * 1e3:.3g} ms)")


class Choices:
    """For each Key, whether the kernel or torch runs it. mode: "auto" measures (see pick); "on" runs the kernel
    wherever it can (tests compare it with torch); "off" runs torch everywhere."""

    def __init__(self, mode: str, file: Callable[[], Path]):
        self.mode = mode
        self.file = file  # where the decisions are kept; asked once, when first needed
        self.made: dict[Key, Choice] = {}  # this process's: measured here, or read from the file when first met
        self.stored: dict[Key, Choice] | None = None  # the file's, once read

    @functools.cached_property
    def path(self) -> Path:
        return self.file()

    @contextlib.contextmanager
    def forced(self, kernel: bool):
        """Inside: the kernel wherever it can run (True), or torch everywhere (False)."""
        mode, self.mode = self.mode, "on" if kernel else "off"
        try:
            yield
        finally:
            self.mode = mode

    def pick(self, key: Key, kernel: Callable, plain: Callable):
        """kernel()'s result or plain()'s (torch's code for the same values), whichever computes this kind of
        operation faster. kernel() returns None where it cannot run; then plain() does, and nothing is decided."""
        if self.mode == "auto":
            choice = self.made.get(key) or self.recall(key)
            if choice is None:
                return self.measure(key, kernel, plain)
            if choice.winner == "torch":
                return plain()
        elif self.mode == "off":
            return plain()
        y = kernel()
        return plain() if y is None else y

    def measure(self, key: Key, kernel: Callable, plain: Callable):
        """Times both: a warm-up run each, then TURNS runs each in turns, so that a noisy stretch of the machine
        falls on both alike; the best time of each decides. The winner runs last, so that what it writes (a
        KV cache) is what stays, and its result is returned."""
        if kernel() is None:
            return plain()
        plain()
        best = [math.inf, math.inf]  # torch's, the kernel's
        for _ in range(TURNS):
            for i, run in enumerate((plain, kernel)):  # the kernel last: it usually wins
                start = time.perf_counter()
                y = run()
                best[i] = min(best[i], time.perf_counter() - start)
        choice = self.made[key] = Choice("kernel" if best[1] < best[0] else "torch", best[1], best[0])
        self.save()
        return y if choice.winner == "kernel" else plain()

    def recall(self, key: Key) -> Choice | None:
        """The file's choice for key, from now on this process's; None where it holds none."""
        if self.stored is None:
            self.stored = self.read()
        choice = self.stored.get(key)
        if choice is not None:
            self.made[key] = choice
        return choice

    def read(self) -> dict[Key, Choice]:
        """The file's choices; none where it is missing, unreadable or not what save() writes (then they are
        measured again)."""
        def parsed(entry: dict) -> tuple[Key, Choice]:
            choice = Choice(entry["winner"], float(entry["kernel_s"]), float(entry["torch_s"]))
            if choice.winner not in ("kernel", "torch"):
                raise ValueError(choice.winner)
            return Key(*(entry[field] for field in Key._fields[:-1]), tuple(entry["sizes"])), choice

        try:
            return dict(parsed(entry) for entry in json.loads(self.path.read_text()))
        except (OSError, RuntimeError, ValueError, TypeError, KeyError):  # RuntimeError: no home directory
            return {}

    def save(self) -> None:
        """Adds this process's choices to the file, beside those other processes stored meanwhile. Where it
        cannot be written they are measured again next time; inference goes on."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            entries = [{**key._asdict(), **choice._asdict()} for key, choice in {**self.read(), **self.made}.items()]
            with tempfile.TemporaryDirectory(dir=self.path.parent) as tmp:  # then renamed: never a half-written file
                written = Path(tmp) / self.path.name
                written.write_text(json.dumps(entries, indent=1))
                written.replace(self.path)
        except (OSError, RuntimeError):
            pass

    def report(self) -> list[dict]:
        """This process's choices, for people (text) and programs (the rest)."""
        return [{**key._asdict(), **choice._asdict(), "text": describe(key, choice)}
                for key, choice in self.made.items()]
