"""The faster of a kernel and torch's code, for each kind of operation, measured on the machine that runs it.

Which one wins depends on the CPU (on an AVX2-only CPU a prompt's products ran 4-6x slower on the kernel than on
MKL's sgemm), its cores and torch's build: rather than guess from the CPU's flags, the first call of each kind
times both and the winner runs from then on. Decisions are kept in a file in the user's cache, one per kernel
build, torch version and torch dispatch, so that a later process measures nothing again.

Only a prompt's kinds are measured. A decoding step's (1-16 rows: batched decoding, a speculative pass, a
steered row beside others) run on the kernel wherever it can run them: the kernel gives a row the same bits
whatever rows share its call, torch's products do not (MKL's sgemm gives a row other bits at 2 rows than at 4,
at every ATen capability of a Zen 4), so a row's tokens would depend on its batch wherever torch won. A prompt's
rows are only ever compared with the same chunk computed again (the prefix cache's chunks end at the same
slots wherever a prefill starts), so whichever side runs a prompt's kind, it runs every chunk of that size.

A measurement is only as good as the machine was quiet: both sides run in turns until each side's best time
repeats and the winner leads clearly, or a bounded number of turns. The margin (the loser's time over the
winner's) is kept with the choice; where it is thin, a later accelerator measures again, a bounded number of
times, each measurement's best times merged with the stored ones, so that a near tie measured on a busy machine
does not stay decided the wrong way for good. So is a choice measured while the machine was busy (more threads
runnable than it has cores, other processes' beside ours), whatever its margin: a thread of a parallel region
that another process's work takes off its core holds up the others for a time slice, which can make the faster
side lose by far (a 1.7B's prompt attention was once decided for torch so, by 10x, where quiet the kernel wins).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from ..errors import SmolError

MIN_TURNS = 3  # timed runs of each side, in turns, after one warm-up run each
MAX_TURNS = 12  # at most, for a side whose best time does not repeat, or a close call
BUDGET_S = 1.0  # no more turns past MIN_TURNS once a measurement has taken this long (a big model's step)
SPREAD = 0.05  # a side's best time counts once its second best is within 5% of it: not one lucky run
THIN = 1.10  # a winner less than 10% faster is a close call: measured longer, and again by later accelerators
MEASUREMENTS = 3  # a thin choice is measured at most this many times in all (each process's first meeting)
BUSY = 1.5  # runnable threads a core (the load average over the cores) over which a measurement counts as busy:
# ours alone keep it near 1 while both sides run on every core


class Key(NamedTuple):
    """A kind of operation: calls of one kind run alike, so one measurement decides them all."""
    op: str  # linear, blocks (a decoding step), prompt_attention, rms_norm, rope or silu_mul
    dtype: str  # the activations' ("float32 as int8": quantized to 8 bits for the products)
    weights: str | None  # the format a product's weights are streamed in (ops.WEIGHT_FORMATS)
    rows: int  # rows (tokens; a prompt's attention: its length), as rows_bucket() groups them
    threads: int  # torch.get_num_threads()
    sizes: tuple[int, ...]  # the rest of the shape, as describe() reads it


class Choice(NamedTuple):
    winner: str  # "kernel" or "torch"
    kernel_s: float  # the best time of its runs, over every measurement of this kind
    torch_s: float
    margin: float  # the loser's time over the winner's, >= 1; files without it read as 1 (to be measured again)
    measurements: int  # how many measurements the times come from
    busy: bool = False  # whether the last of them was taken on a busy machine (BUSY)

    @classmethod
    def timed(cls, kernel_s: float, torch_s: float, measurements: int = 1, busy: bool = False) -> Choice:
        faster, slower = sorted((kernel_s, torch_s))
        return cls("kernel" if kernel_s < torch_s else "torch", kernel_s, torch_s,
                   slower / faster if faster > 0 else float("inf"), measurements, busy)

    def measure_again(self) -> bool:
        return (self.margin < THIN or self.busy) and self.measurements < MEASUREMENTS


def machine_load() -> float:
    """Runnable threads a core over the last minute (the load average over the cores); 0 where the OS has none."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (AttributeError, OSError):
        return 0.0


DECODING_ROWS = 16  # rows of a decoding step the kernel takes in one call (ops.MAX_ROWS)


def rows_bucket(rows: int) -> int:
    """A decoding step's 1-16 rows are one kind: the kernel gives a row the same bits whatever its batch, which
    holds only if every batch size runs on the same side. A prompt's rows rounded up to a power of two: prompts
    of 300 and 500 tokens are one kind, not two."""
    return DECODING_ROWS if rows <= DECODING_ROWS else 1 << (rows - 1).bit_length()


def describe(key: Key, choice: Choice) -> str:
    """One line: what ran this kind of operation, by how much it won, and the times that decided it."""
    match key.op, key.sizes:
        case "linear", (K, *N):
            what = f"product {K} -> {'+'.join(map(str, N))}"
        case "prompt_attention", (_, H, KVH, D):
            what = f"prompt attention, {H}/{KVH} heads of {D}"
        case "rms_norm", (C,):
            what = f"RMSNorm of {C}"
        case "rope", (heads, D):
            what = f"RoPE, {heads} heads of {D}"
        case "silu_mul", (I,):
            what = f"SiLU*up of {I}"
    rows = f"{key.rows // 2 + 1}-{key.rows} rows"  # the bucket's range (a prompt's: a decoding step's is not measured)
    weights = f" reading {key.weights}" if key.weights else ""
    return (f"{what}, {rows}, {key.dtype}{weights}: {choice.winner} by {choice.margin:.2f}x "
            f"(kernel {choice.kernel_s * 1e3:.3g} ms vs torch {choice.torch_s * 1e3:.3g} ms)")


MODES = ("auto", "on", "off")


class Choices:
    """One accelerator's choices: for each Key, whether the kernel or torch runs it. mode: "auto" measures (see
    pick); "on" runs the kernel wherever it can (tests compare it with torch); "off" runs torch everywhere.
    file: where the decisions are kept, asked once, when first needed. clock: seconds, to time runs with; load:
    how busy the machine is (machine_load)."""

    def __init__(self, mode: str, file: Callable[[], Path], clock: Callable[[], float] = time.perf_counter,
                 load: Callable[[], float] = machine_load):
        if mode not in MODES:
            raise SmolError(f"kernels mode {mode!r} is none of {', '.join(MODES)}")
        self.mode, self.file, self.clock, self.load = mode, file, clock, load
        self.made: dict[Key, Choice] = {}  # this accelerator's: measured, or read from the file when first met
        self.stored: dict[Key, Choice] | None = None  # the file's, once read
        self.kernel_runs: Counter[str] = Counter()  # calls whose result a kernel computed, by operation
        # The decoding products' inputs quantized to 8 bits, integer dot products (kernels.c's rows_times): not
        # exact, asked for alone (Accelerator). Never measured: a decoding step's kinds are not (see above).
        self.int8_activations = False
        self.local = threading.local()  # torch_only(), for the thread that is inside it

    @functools.cached_property
    def path(self) -> Path:
        return self.file()

    def __getstate__(self):  # a copy (a model's deepcopy, say): the same choices, outside any torch_only()
        state = self.__dict__.copy()
        del state["local"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state, local=threading.local())

    def allow_kernels(self) -> bool:
        """Whether a kernel may run here at all: not in mode "off", nor inside torch_only() in this thread."""
        return self.mode != "off" and not getattr(self.local, "torch_only", False)

    @contextlib.contextmanager
    def packed(self, lengths: list[int]):
        """Inside, in this thread alone: a prompt's activations, (1, rows, ...), hold several prompts' rows one
        after another, `lengths` each (a batched prefill, every prompt of one rows_bucket), or one row each (their
        last positions). Each kind is then decided as for one of them alone (bucket), and torch's side runs once
        per prompt (split): the kernel gives a row the same bits whatever rows share its call, torch does not."""
        if len({rows_bucket(n) for n in lengths}) > 1:
            raise ValueError(f"packed prompts of several kinds: {lengths}")
        outer = getattr(self.local, "packed", None)
        self.local.packed = lengths
        try:
            yield
        finally:
            self.local.packed = outer

    def split(self, rows: int) -> list[int] | None:
        """Inside packed(): the rows of each prompt among `rows` rows (all of their rows, or their last ones);
        None outside, or for rows that are not those (one prompt's attention)."""
        lengths = getattr(self.local, "packed", None)
        if lengths is None:
            return None
        if rows == sum(lengths):
            return lengths
        return [1] * rows if rows == len(lengths) else None

    def packing(self) -> bool:
        """Whether inside packed(), in this thread."""
        return getattr(self.local, "packed", None) is not None

    def bucket(self, rows: int) -> int:
        """rows_bucket(rows), or inside packed() that of one prompt's rows: the kind it has alone."""
        split = self.split(rows)
        return rows_bucket(rows if split is None else split[0])

    @contextlib.contextmanager
    def torch_only(self):
        """Inside, in this thread alone: torch everywhere, as a decoding step's torch side runs when it is timed
        against the kernel's or has won. Other threads, and other accelerators, go on as they were."""
        outer = getattr(self.local, "torch_only", False)
        self.local.torch_only = True
        try:
            yield
        finally:
            self.local.torch_only = outer

    def pick(self, key: Key, kernel: Callable, plain: Callable, measured: bool = True):
        """kernel()'s result or plain()'s (torch's code for the same values), whichever computes this kind of
        operation faster; a decoding step's kinds, or any with measured=False, kernel()'s (see the module's
        docstring). kernel() returns None where it cannot run; then plain() does, and nothing is decided."""
        if not self.allow_kernels():
            return plain()
        if self.mode == "auto" and measured and key.rows > DECODING_ROWS:
            choice = self.made.get(key)
            if choice is None:
                choice = self.recall(key)
                if choice is None or choice.measure_again():
                    return self.measure(key, kernel, plain, choice)
            if choice.winner == "torch":
                return plain()
        y = kernel()
        if y is None:
            return plain()
        self.kernel_runs[key.op] += 1
        return y

    def measure(self, key: Key, kernel: Callable, plain: Callable, before: Choice | None = None):
        """Times both: a warm-up run each, then runs in turns, so that a noisy stretch of the machine falls on
        both alike, until settled() or MAX_TURNS (BUDGET_S past MIN_TURNS); the best time of each decides,
        merged with `before` (an earlier measurement's). The winner runs last, so that what it writes (a KV
        cache) is what stays, and its result is returned."""
        if kernel() is None:
            return plain()
        plain()
        busy = self.load() > BUSY
        times = ([], [])  # torch's, the kernel's
        start = self.clock()
        for turn in range(1, MAX_TURNS + 1):
            for run, kept in ((plain, times[0]), (kernel, times[1])):  # the kernel last: it usually wins
                begin = self.clock()
                y = run()
                kept.append(self.clock() - begin)
            if turn >= MIN_TURNS and (settled(*times) or self.clock() - start > BUDGET_S):
                break
        kernel_s, torch_s, measurements = min(times[1]), min(times[0]), 1
        if before is not None:
            kernel_s, torch_s = min(kernel_s, before.kernel_s), min(torch_s, before.torch_s)
            measurements += before.measurements
        busy = busy or self.load() > BUSY  # before or after: a minute's average lags
        choice = self.made[key] = Choice.timed(kernel_s, torch_s, measurements, busy)
        self.save()
        if choice.winner == "kernel":
            self.kernel_runs[key.op] += 1
            return y
        return plain()

    def recall(self, key: Key) -> Choice | None:
        """The file's choice for key, from now on this accelerator's; None where it holds none."""
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
            choice = Choice(entry["winner"], float(entry["kernel_s"]), float(entry["torch_s"]),
                            float(entry.get("margin", 1.0)), int(entry.get("measurements", 1)),
                            bool(entry.get("busy", False)))
            if choice.winner not in ("kernel", "torch"):
                raise ValueError(choice.winner)
            return Key(*(entry[field] for field in Key._fields[:-1]), tuple(entry["sizes"])), choice

        try:
            return dict(parsed(entry) for entry in json.loads(self.path.read_text()))
        except (OSError, RuntimeError, ValueError, TypeError, KeyError):  # RuntimeError: no home directory
            return {}

    def save(self) -> None:
        """Adds this accelerator's choices to the file, beside those others stored meanwhile. Where it cannot be
        written they are measured again next time; inference goes on."""
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
        """This accelerator's choices, for people (text) and programs (the rest)."""
        return [{**key._asdict(), **choice._asdict(), "text": describe(key, choice)}
                for key, choice in self.made.items()]


def settled(torch_times: list[float], kernel_times: list[float]) -> bool:
    """Whether both sides' best times repeated (the second best within SPREAD of the best) and the faster leads
    by THIN or more: a close call goes on, where one more quiet turn may still change the winner."""
    bests = [sorted(times)[:2] for times in (torch_times, kernel_times)]
    if not all(second <= best * (1 + SPREAD) for best, second in bests):
        return False
    faster, slower = sorted(best for best, _ in bests)
    return slower >= faster * THIN
