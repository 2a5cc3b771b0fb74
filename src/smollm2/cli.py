"""The `smollm2` command: one function per subcommand, each a thin face over the library.

Bad input ends the command with one readable line on stderr and a non-zero exit status, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch

from .errors import SmolError
from .kv_cache import KV_CACHE_DTYPES
from .server import defaults  # the server's, stated there once; it imports nothing

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
GGUF_TYPES = ("f32", "f16", "q8_0", "q4_1")  # as smollm2.checkpoints.gguf.SAVE_TYPES, without importing gguf here
MAX_THREADS = 4 * (os.cpu_count() or 1)  # more only oversubscribes the cores; far more exhausts OpenMP's memory
MAX_SEED = 2**64 - 1  # as generation.sampling's, without importing the engine before the flags are read
MAX_TOP_LOGPROBS = 20  # as generation.logprobs's
MAX_BATCH_SIZE = 256  # serve's rows: each holds a KV cache of the whole context window


class Parser(argparse.ArgumentParser):
    """argparse, reporting bad usage as one line like every other error (no usage block)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def whole_number(low: int, high: int):
    """An argparse type: an integer from `low` to `high`, so out-of-range values fail before anything runs."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be from {low} to {high}, got {value}")
        return value

    return parse


def logit_bias(text: str) -> tuple[int, float]:
    """An argparse type: ID=BIAS, a token id and the bias added to its logit (its range is Sampling's to check)."""
    token, _, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be ID=BIAS, a token id and a number, got {text!r}") from None


def directory(text: str) -> Path:
    """An argparse type: a directory to create or reuse; an existing file on its way is not one."""
    path = Path(text)
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{existing} exists and is not a directory")
    return path


def utf8(text: str, what: str) -> str:
    """`text` if it can be UTF-8; arguments and input that were not UTF-8 arrive holding lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise SmolError(f"{what} is not valid UTF-8 text (character {e.start + 1})") from None
    return text


def check_address(host: str, port: int) -> None:
    """Fail in one line, before the model loads, where the server could not listen: bind each address the
    host resolves to, as uvicorn will, and let go again."""
    try:
        for family, kind, protocol, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                     flags=socket.AI_PASSIVE):
            with socket.socket(family, kind, protocol) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(address)
    except OSError as e:  # socket.gaierror too: a host name that does not resolve
        raise SmolError(f"--host {host} --port {port}: cannot listen there: {e.strerror}") from None


def load_options(args) -> dict:
    """--dtype, --device, --adapter, --quantize, --kernels and --int8-activations as smollm2.load takes them;
    --device cuda refused where there is none."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SmolError("--device cuda: no CUDA device is available")
    return dict(dtype=DTYPES[args.dtype], device=args.device, adapter=args.adapter, quantize=args.quantize,
                kernels=args.kernels, int8_activations=args.int8_activations)


def named_model(args):
    """The model named by --model (default: the embedded SmolLM2-135M-Instruct) with --adapter merged in, as
    --dtype/--quantize say; on the CPU kernels unless --no-kernels."""
    from . import loading
    from .generation import Sampling

    if hasattr(args, "temperature"):
        Sampling(**sampling(args))  # bad sampling flags fail before the model loads, not after
    options = load_options(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    return loading.load(args.model, **options)


def load(args):
    from .tokenizer import Tokenizer

    return named_model(args), Tokenizer.from_pretrained(args.model)


def speculative_flag(text: str) -> str:
    """An argparse type: --speculative ngram, off, draft (the embedded model drafts) or draft:SRC (any source
    --model takes)."""
    if text in ("ngram", "off", "draft") or (text.startswith("draft:") and text != "draft:"):
        return text
    raise argparse.ArgumentTypeError(f"must be ngram, off, draft or draft:SRC, got {text!r}")


def speculation(args, tokenizer):
    """What --speculative asks generation for (generation.speculative.speculation): a draft is loaded as --model
    is (its --dtype, --device, --quantize, kernels), and its tokenizer must be the model's."""
    from .generation import speculative

    options = {k: v for k, v in load_options(args).items() if k != "adapter"}
    return speculative.speculation(args.speculative, tokenizer, **options)


def sampling(args) -> dict:
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty, logit_bias=dict(args.logit_bias),
                min_new_tokens=args.min_new_tokens, seed=args.seed)


def response_format(args) -> dict | None:
    """--json or --json-schema FILE as OpenAI's response_format."""
    if args.json_schema:
        path = Path(args.json_schema)
        try:
            schema = json.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise SmolError(f"{path}: cannot read the JSON schema: {e.strerror}") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SmolError(f"{path}: the JSON schema is not JSON: {e}") from None
        return {"type": "json_schema", "json_schema": {"name": path.stem, "schema": schema}}
    return {"type": "json_object"} if args.json else None


def print_stream(model, tokenizer, ids: list[int], args, prefix_cache=None) -> str:
    """Generate from one prompt, printing its text as it becomes final; returns the text. With --logprobs N,
    then one line per generated token: its id and text, its log-probability, and the N most likely tokens'.
    prefix_cache: a PrefixCache the prompt's whole prefill chunks are looked up in and kept in."""
    from .generation import stream

    text, logprobs = [], []
    stop = args.stop + args.stop_token_id  # strings and token ids
    for (step,) in stream(model, [ids], args.max_new_tokens, stop=stop, tokenizer=tokenizer, compile=args.compile,
                          prefix_cache=prefix_cache, logprobs=args.logprobs,
                          response_format=args.response_format, speculative=args.speculative,
                          kv_cache_dtype=args.kv_cache_dtype, **sampling(args)):
        print(step.text, end="", flush=True)
        text.append(step.text)
        logprobs.append(step.logprob)
    print(flush=True)
    if args.logprobs is not None:
        token = tokenizer.token_text
        for lp in logprobs:
            top = "  ".join(f"{token(t)!r} {v:.4f}" for t, v in lp.top)
            print(f"{lp.token}\t{token(lp.token)!r}\t{lp.logprob:.4f}" + (f"\ttop: {top}" if top else ""))
    return "".join(text)


def generate(args):
    utf8(args.prompt, "the prompt")
    args.response_format = response_format(args)  # a bad schema file fails before the model loads
    model, tokenizer = load(args)
    args.speculative = speculation(args, tokenizer)
    ids = tokenizer.encode(args.prompt)
    if not ids:
        raise SmolError("the prompt is empty")
    print_stream(model, tokenizer, ids, args)


def chat(args):
    from .generation import PrefixCache

    utf8(args.system or "", "--system")
    utf8(args.prompt or "", "--prompt")
    args.response_format = response_format(args)
    model, tokenizer = load(args)
    args.speculative = speculation(args, tokenizer)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    # Each turn sends the whole history again; the prefix cache keeps its prompts' whole prefill chunks, so a
    # turn prefills only from the first chunk that holds something new (the previous answer, say), and
    # answers as the same prompt sent fresh would.
    prefix_cache = PrefixCache(2**30)  # more than a 135M model's whole window takes in float32
    turns = [args.prompt] if args.prompt is not None else None
    if turns is None:
        print("Chatting with the model: /reset clears the history, /exit or Ctrl-D quits.", file=sys.stderr)
    while True:
        if turns is not None:
            if not turns:
                return
            text = turns.pop()
        else:
            try:
                text = utf8(input("> "), "the message")
            except EOFError:
                print(file=sys.stderr)
                return
            except UnicodeDecodeError:  # a stdin that decodes strictly
                raise SmolError("the message is not valid UTF-8 text") from None
            if text.strip() in ("/exit", "/quit"):
                return
            if text.strip() == "/reset":
                del messages[bool(args.system):]
                continue
        if not text.strip():
            if turns is not None:
                raise SmolError("the message is empty")
            continue
        messages.append({"role": "user", "content": text})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        try:
            answer = print_stream(model, tokenizer, ids, args, prefix_cache)
        except SmolError:
            messages.pop()  # the turn that did not fit is not kept
            raise
        messages.append({"role": "assistant", "content": answer})


def evaluate_tasks(args):
    """lm-evaluation-harness tasks on the model, in this process (smollm2.harness)."""
    try:
        from .harness import run_tasks
        from lm_eval.utils import make_table
    except ImportError:
        raise SmolError("smollm2 eval needs lm-eval: pip install 'smollm2[eval]'") from None
    if args.include_path and not Path(args.include_path).is_dir():
        raise SmolError(f"--include-path {args.include_path}: no such directory")
    tasks = [t for t in args.tasks.split(",") if t]
    if not tasks:
        raise SmolError("--tasks: give at least one task name")
    model, tokenizer = load(args)
    results = run_tasks(model, tokenizer, tasks, include_path=args.include_path, limit=args.limit,
                        num_fewshot=args.num_fewshot, batch_size=args.batch_size)
    if args.json:
        print(json.dumps(results["results"], default=str))
    else:
        print(make_table(results))


@torch.inference_mode()
def embed(args):
    """Each text's embedding (generation.embed): one line of numbers per text, or JSON."""
    from .generation import embed as embed_rows

    for i, text in enumerate(args.texts):
        utf8(text, f"text {i + 1}")
    model, tokenizer = load(args)
    rows = [tokenizer.encode(text) for text in args.texts]
    empty = next((i for i, row in enumerate(rows) if not row), None)
    if empty is not None:
        raise SmolError(f"text {empty + 1} is empty: an embedding needs a token at least")
    vectors = embed_rows(model, rows).tolist()
    if args.json:
        print(json.dumps([dict(text=text, tokens=len(row), embedding=vector)
                          for text, row, vector in zip(args.texts, rows, vectors)]))
    else:
        for vector in vectors:
            print(" ".join(f"{x:.8g}" for x in vector))


def perplexity(args):
    """Sliding-window perplexity (evaluate.windowed_perplexity): each window scores only the tokens the previous
    one did not."""
    from tqdm import tqdm

    from . import evaluate

    path = Path(args.file)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise SmolError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise SmolError(f"{path}: {e.strerror}") from None
    if not text.strip():
        raise SmolError(f"{path}: the file is empty")
    model, tokenizer = load(args)
    ids = tokenizer.encode(text)
    if len(ids) < 2:
        raise SmolError(f"{path}: needs at least 2 tokens to measure perplexity, has {len(ids)}")
    start = time.perf_counter()
    with tqdm(total=len(ids) - 1, unit="tok", desc="perplexity", disable=None, file=sys.stderr) as bar:
        measured = evaluate.windowed_perplexity(model, ids, args.context, args.stride, progress=bar.update,
                                                kv_cache_dtype=args.kv_cache_dtype)
    seconds = time.perf_counter() - start
    result = dict(file=str(path), tokens=len(ids), perplexity=measured.perplexity, nll=measured.nll,
                  window=measured.window, stride=measured.stride, tokens_per_s=len(ids) / seconds)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"perplexity {result['perplexity']:.4f} over {len(ids)} tokens "
              f"(window {measured.window}, stride {measured.stride}), {result['tokens_per_s']:.1f} tokens/s")


def bench(args):
    """Prefill and decode speed, beside other systems, each in a process of its own (bench.compare)."""
    from . import bench

    fields = {f.name for f in dataclasses.fields(bench.Setup)}
    setup = bench.Setup(**{**{k: v for k, v in vars(args).items() if k in fields}, "dtype": DTYPES[args.dtype]})
    found = bench.compare(setup, tuple(args.compare), args.repeats)
    header = dict(model=args.model or "embedded SmolLM2-135M-Instruct", dtype=args.dtype, quantize=args.quantize,
                  weights_read=found.weights_read, kv_cache_dtype=args.kv_cache_dtype or args.dtype,
                  compile=args.compile, speculative=args.speculative,
                  tokens_per_pass=found.tokens_per_pass, acceptance=found.acceptance,
                  device=args.device, threads=torch.get_num_threads(), kernels=found.kernels,
                  activations=found.activations,
                  batch_size=args.batch_size, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens)
    if args.json:
        print(json.dumps({**header, "results": [dataclasses.asdict(r) for r in found.speeds],
                          "kernel_choices": found.kernel_choices}))
    else:
        print(", ".join(f"{k}={v}" for k, v in header.items()))
        print(found.table())
        if found.kernel_choices:
            print("smollm2's operations, on the kernel or torch, whichever was faster here:")
            print("\n".join(f"  {choice['text']}" for choice in found.kernel_choices))


def lora_name(text: str) -> tuple[str, str]:
    """--lora NAME=DIR -> (NAME, DIR)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise SmolError(f"--lora {text}: expected NAME=DIR, the model name requests use and the adapter's directory")
    if not Path(path).is_dir():
        raise SmolError(f"--lora {text}: {path} is not a directory")
    return name, path


def serve(args):
    """The OpenAI-compatible HTTP server, until Ctrl-C, or SIGTERM once drained (server.draining)."""
    from .server import draining, load_app

    if args.compile:
        raise SmolError("--compile is not supported by serve")
    check_address(args.host, args.port)
    served = dict(lora_name(text) for text in args.lora)  # checked before the model loads
    options = dict(load=load_options(args), lora=served, speculative=args.speculative, threads=args.threads,
                   max_batch_size=args.max_batch_size, max_waiting=args.max_waiting, max_seq_len=args.max_seq_len,
                   api_key=args.api_key, prefix_cache_bytes=args.prefix_cache * 2**20,
                   kv_cache_dtype=args.kv_cache_dtype, prefix_cache_dir=args.prefix_cache_dir, saes=args.sae)
    if args.replicas or args.min_replicas or args.max_replicas or args.ray_address:  # each replica loads the model
        from .server import replicas
        scaling = replicas.Scaling(args.replicas or args.min_replicas or 1, args.min_replicas, args.max_replicas,
                                   args.max_batch_size)
        replicas.run(replicas.Recipe(args.model, options), scaling, args.host, args.port, args.ray_address)
    else:
        draining.serve(load_app(args.model, **options), args.host, args.port, args.drain_timeout)


def prepare(args):
    from .tokenizer import Tokenizer
    from .training import data

    data.prepare(args.files, args.out, Tokenizer.from_pretrained(args.tokenizer), val_fraction=args.val_fraction)
    print(f"{args.out}: {data.split_tokens(args.out, 'train')} train and {data.split_tokens(args.out, 'val')} "
          f"validation tokens")


def training_config(args):
    from .training import TrainConfig

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in fields})


def lora_settings(args):
    """--lora-r and the flags beside it as training.LoRASettings; None without --lora-r."""
    from .training import LoRASettings

    if args.lora_r is None:
        if args.quantize:
            raise SmolError("--quantize int8 freezes the weights: it needs --lora-r (QLoRA), which trains an adapter")
        return None
    return LoRASettings(args.lora_r, args.lora_alpha, tuple(args.lora_targets.split(",")), args.lora_dropout,
                        args.quantize)


def train(args):
    """Pretraining from scratch (HF-style init) on token shards made by `prepare` (training.pretrain)."""
    from . import training

    final = training.pretrain(args.config, args.data, args.out, training_config(args), tokenizer=args.tokenizer,
                              device=args.device, resume=args.resume)
    print(f"the trained model is in {final}")


def print_final(args, final: Path, how: str) -> None:
    what = "adapter (PEFT's format; use it with --adapter)" if args.lora_r is not None else "model"
    print(f"the {how} {what} is in {final}")


def finetune(args):
    """Supervised fine-tuning on chats ({"messages": [...]} per line); loss on the assistant's tokens only
    (training.finetune)."""
    from . import training

    final = training.finetune(args.data, args.out, training_config(args), model=args.model, val_data=args.val_data,
                              lora=lora_settings(args), device=args.device, resume=args.resume)
    print_final(args, final, "fine-tuned")


def dpo(args):
    """Direct Preference Optimization on pairs of a chosen and a rejected answer; the starting model is the
    reference, its log-probabilities computed once before training (training.train_dpo)."""
    from . import training

    dpo = training.DPOSettings(args.beta, args.label_smoothing)  # checked before the data and the model load
    final = training.train_dpo(args.data, args.out, training_config(args), model=args.model, val_data=args.val_data,
                               lora=lora_settings(args), dpo=dpo, device=args.device, resume=args.resume)
    print_final(args, final, "DPO-trained")


def export(args):
    """--model, with --adapter merged into its weights, as a HF directory or a GGUF file, tokenizer included
    (loading.export)."""
    from . import loading
    from .tokenizer import Tokenizer

    if args.to == "hf" and args.type:
        raise SmolError(f"--type {args.type} is for --to gguf; a HF directory's weights take --dtype")
    model = loading.load(args.model, dtype=DTYPES[args.dtype], adapter=args.adapter, kernels=False)
    loading.export(model, Tokenizer.from_pretrained(args.model), args.out,
                   (args.type or "f32") if args.to == "gguf" else None)
    print(f"the {'merged ' if args.adapter else ''}model is in {args.out}")


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="smollm2", description="SmolLM2 language models in plain PyTorch.")
    commands = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    model = argparse.ArgumentParser(add_help=False)
    model.add_argument("--model", help="HF directory, .gguf file or hub id (default: the embedded "
                                       "SmolLM2-135M-Instruct)")
    model.add_argument("--adapter", metavar="DIR", help="a LoRA adapter directory in PEFT's format, merged into the "
                                                        "model's weights as they load")
    model.add_argument("--dtype", choices=DTYPES, default="fp32")
    model.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    model.add_argument("--threads", type=whole_number(1, MAX_THREADS),
                       help=f"CPU threads, 1 to {MAX_THREADS} (default: torch's choice)")
    model.add_argument("--quantize", choices=("int8",), help="int8 weight-only linear layers")
    model.add_argument("--kernels", action=argparse.BooleanOptionalAction, default=True,
                       help="run on smollm2's CPU kernels where they are the faster (default); --no-kernels runs "
                            "the reference model.py on torch alone")
    model.add_argument("--int8-activations", action="store_true",
                       help="multiply a GGUF file's blocks by activations quantized to 8 bits, as llama.cpp, when "
                            "decoding (and prompts where that is faster): faster for K-quants, not exact (README: "
                            "int8 activations)")
    model.add_argument("--compile", action=argparse.BooleanOptionalAction,
                       help="torch.compile the decoding step (default: on CUDA yes, on the CPU no)")

    cache = argparse.ArgumentParser(add_help=False)
    cache.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                       help="what the KV cache stores: bf16 half the memory of fp32, int8 a quarter (default: --dtype)")

    speculate = argparse.ArgumentParser(add_help=False)
    speculate.add_argument("--speculative", type=speculative_flag, metavar="ngram|draft[:SRC]",
                           help="guess tokens and check them in one pass (the same answer): ngram by prompt lookup "
                                "(faster where it repeats its input); draft:SRC with a smaller model of the same "
                                "tokenizer, loaded as --model (draft alone: the embedded model). bench reports its "
                                "tokens per decoding pass and acceptance rate (guesses kept)")

    sample = argparse.ArgumentParser(add_help=False)
    sample.add_argument("--max-new-tokens", type=int, default=256)
    sample.add_argument("--min-new-tokens", type=int, default=0,
                        help="no EOS, stop token or stop text before this many tokens (default: 0)")
    sample.add_argument("--temperature", type=float, default=0.2, help="0 is greedy (default: 0.2)")
    sample.add_argument("--top-k", type=int)
    sample.add_argument("--top-p", type=float, default=0.9)
    sample.add_argument("--min-p", type=float)
    sample.add_argument("--repetition-penalty", type=float, default=1.0)
    sample.add_argument("--presence-penalty", type=float, default=0.0,
                        help="OpenAI's, in [-2, 2]: subtracted from the logit of each token already generated")
    sample.add_argument("--frequency-penalty", type=float, default=0.0,
                        help="OpenAI's, in [-2, 2]: subtracted from a token's logit once per time it was generated")
    sample.add_argument("--logit-bias", type=logit_bias, action="append", default=[], metavar="ID=BIAS",
                        help="add BIAS, in [-100, 100], to token ID's logit (repeatable; -100 bans it)")
    sample.add_argument("--seed", type=whole_number(0, MAX_SEED))
    sample.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="end the answer before this text (repeatable); it is never printed")
    sample.add_argument("--stop-token-id", type=int, action="append", default=[], metavar="ID",
                        help="end the answer at this token, as at EOS (repeatable); it is never printed")
    sample.add_argument("--logprobs", type=whole_number(0, MAX_TOP_LOGPROBS), metavar="N",
                        help="after the text, one line per token: its id and text, its log-probability and the N "
                             "most likely tokens'")
    structured = sample.add_mutually_exclusive_group()
    structured.add_argument("--json", action="store_true", help="answer with a JSON object (constrained decoding)")
    structured.add_argument("--json-schema", metavar="FILE", help="answer with JSON valid under this JSON schema")

    generating = [model, cache, speculate, sample]
    c = commands.add_parser("generate", parents=generating, help="complete a raw prompt, streamed")
    c.add_argument("prompt")
    c.set_defaults(run=generate)

    c = commands.add_parser("chat", parents=generating, help="chat with the model (chat template)")
    c.add_argument("-p", "--prompt", help="answer this one message and exit")
    c.add_argument("--system", help="a system message (default: the template's own)")
    c.set_defaults(run=chat)

    c = commands.add_parser("embed", parents=[model], help="embeddings: each text's mean final hidden state, "
                                                           "normalized")
    c.add_argument("texts", nargs="+", metavar="TEXT")
    c.add_argument("--json", action="store_true", help="print a JSON list of {text, tokens, embedding}")
    c.set_defaults(run=embed)

    c = commands.add_parser("perplexity", parents=[model, cache], help="perplexity of a text file")
    c.add_argument("file")
    c.add_argument("--context", type=int, help="window length in tokens (default: 1024, or the model's context "
                                               "window where shorter)")
    c.add_argument("--stride", type=int, help="tokens the window moves by (default: half the window)")
    c.add_argument("--json", action="store_true", help="print the result as one JSON object")
    c.set_defaults(run=perplexity)

    c = commands.add_parser("eval", parents=[model], help="lm-evaluation-harness tasks, in this process")
    c.add_argument("--tasks", required=True, help="task names, comma-separated: lm-eval's, or ones in --include-path")
    c.add_argument("--include-path", metavar="DIR", help="a directory of task YAML files of your own")
    c.add_argument("--limit", type=whole_number(1, 2**31), help="at most this many examples a task")
    c.add_argument("--num-fewshot", type=whole_number(0, 1024), metavar="K", help="examples shown before each")
    c.add_argument("--batch-size", type=whole_number(1, 1024), default=8, help="log-likelihoods scored at once")
    c.add_argument("--json", action="store_true", help="print the results as one JSON object")
    c.set_defaults(run=evaluate_tasks)

    c = commands.add_parser("bench", parents=[model, cache, speculate],
                            help="prefill and decode speed, optionally beside transformers")
    c.add_argument("--prompt-tokens", type=int, default=512)
    c.add_argument("--new-tokens", type=int, default=128)
    c.add_argument("--batch-size", type=int, default=1)
    c.add_argument("--repeats", type=int, default=2, help="timed runs after a warm-up; the best counts")
    c.add_argument("--compare", choices=("torch", "transformers"), action="append", default=[],
                   help="time beside ours: transformers on the same weights, or torch (our model, every kernel off); "
                        "repeatable")
    c.add_argument("--json", action="store_true", help="print the results as one JSON object")
    c.set_defaults(run=bench)

    c = commands.add_parser("serve", parents=[model], help="an OpenAI-compatible HTTP server (continuous batching)")
    c.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    c.add_argument("--port", type=whole_number(1, 65535), default=8000)
    c.add_argument("--max-batch-size", type=whole_number(1, MAX_BATCH_SIZE), default=defaults.MAX_BATCH_SIZE,
                   help=f"requests decoded together (default: {defaults.MAX_BATCH_SIZE})")
    c.add_argument("--max-waiting", type=int, default=defaults.MAX_WAITING,
                   help=f"requests queued beyond those; more get 429 (default: {defaults.MAX_WAITING})")
    c.add_argument("--max-seq-len", type=int, help="prompt + answer tokens per request (default: the context "
                                                    "window); the KV cache holds this many per batch row")
    c.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every request")
    c.add_argument("--speculative", type=speculative_flag, default=defaults.SPECULATIVE,
                   metavar="ngram|off|draft[:SRC]",
                   help="ngram: requests guess tokens by prompt lookup, checked in one pass (the same answers); "
                        "draft:SRC: with a smaller model of the same tokenizer (draft alone: the embedded model); "
                        f"off: not (default: {defaults.SPECULATIVE}). A request's \"speculative\" field overrides it "
                        "(draft: only where the server has one)")
    c.add_argument("--lora", action="append", default=[], metavar="NAME=DIR",
                   help="also serve this LoRA adapter over the model, as model NAME (repeatable): held as its "
                        "low-rank matrices, batched with the base's requests; more load and unload while serving "
                        "(POST /v1/load_lora_adapter, /v1/unload_lora_adapter)")
    c.add_argument("--sae", action="append", default=[], metavar="DIR_OR_HUBID",
                   help="serve an SAE or transcoder (SAELens's or sparsify's format), or a folder of them (a "
                        "transcoder per block: attribution graphs), to the page and the API (repeatable)")
    c.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=defaults.SERVE_KV_CACHE_DTYPE,
                   help=f"what the KV cache stores: bf16 half the memory of fp32, int8 a quarter (default: "
                        f"{defaults.SERVE_KV_CACHE_DTYPE})")
    c.add_argument("--prefix-cache", type=whole_number(0, 2**24), default=defaults.PREFIX_CACHE_BYTES >> 20,
                   metavar="MIB", help="memory for the keys and values of prompt prefixes that later prompts reuse "
                                       f"(default: {defaults.PREFIX_CACHE_BYTES >> 20} MiB; 0: none)")
    c.add_argument("--prefix-cache-dir", type=directory, metavar="DIR",
                   help="also keep the prefix cache's chunks as files here, which a restarted server reads "
                        "instead of prefilling them again")
    # 20 s: within Kubernetes' default grace period (30 s), after which the process is killed
    c.add_argument("--drain-timeout", type=whole_number(0, 3600), default=20, metavar="SECONDS",
                   help="on SIGTERM, wait this long for the requests in flight, refusing new ones with 503, then end "
                        "those left and exit (default: 20)")
    c.add_argument("--replicas", type=whole_number(1, 1024), metavar="N",
                   help="run N replicas under Ray Serve behind the one endpoint, --threads each (default: 1), "
                        "requests of one prompt prefix to one replica (pip install 'smollm2[ray]')")
    c.add_argument("--min-replicas", type=whole_number(1, 1024), metavar="N", help="autoscale from N replicas")
    c.add_argument("--max-replicas", type=whole_number(1, 1024), metavar="N", help="autoscale up to N replicas")
    c.add_argument("--ray-address", metavar="ADDRESS", help="join this Ray cluster (default: start one here)")
    c.set_defaults(run=serve)

    c = commands.add_parser("export", help="write a model, with a LoRA adapter merged in, as a HF directory or a "
                                           "GGUF file (llama.cpp, Ollama)")
    c.add_argument("--model", help="HF directory, .gguf file or hub id (default: the embedded SmolLM2-135M-Instruct)")
    c.add_argument("--adapter", metavar="DIR", help="a LoRA adapter directory in PEFT's format, merged into the "
                                                    "weights")
    c.add_argument("--to", choices=("hf", "gguf"), default="hf", help="the format (default: hf)")
    c.add_argument("--dtype", choices=DTYPES, default="fp32", help="the weights as loaded, and in a HF directory")
    c.add_argument("--type", choices=GGUF_TYPES, help="--to gguf: the weights' type in the file (default: f32)")
    c.add_argument("--out", required=True, help="the HF directory, or with --to gguf the .gguf file, to write")
    c.set_defaults(run=export)

    c = commands.add_parser("prepare", help="tokenize text or JSONL files into token shards for `train`")
    c.add_argument("files", nargs="+", help="text files, or JSONL files of {\"text\": ...} objects")
    c.add_argument("--out", type=directory, required=True, help="directory for the shards and manifest.json")
    c.add_argument("--tokenizer", help="tokenizer source, as --model (default: the embedded model's)")
    c.add_argument("--val-fraction", type=float, default=0.01, help="share of the text held out for validation")
    c.set_defaults(run=prepare)

    fit = argparse.ArgumentParser(add_help=False)
    fit.add_argument("--out", type=directory, required=True,
                     help="run directory: metrics.jsonl, checkpoints/, final/")
    fit.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    fit.add_argument("--batch-size", type=int, default=8, help="examples per micro-batch on each process")
    fit.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    fit.add_argument("--seq-len", type=int, default=512, help="tokens per example")
    fit.add_argument("--lr", type=float, default=3e-4, help="peak learning rate")
    fit.add_argument("--min-lr", type=float, default=3e-5, help="learning rate at the end of the decay")
    fit.add_argument("--warmup", type=int, default=100, help="linear warmup steps")
    fit.add_argument("--schedule", choices=("cosine", "wsd", "constant"), default="cosine",
                     help="after warmup: cosine decay, warmup-stable-decay, or constant")
    fit.add_argument("--cooldown", type=float, default=0.2, help="wsd: fraction of steps decaying at the end")
    fit.add_argument("--weight-decay", type=float, default=0.1)
    fit.add_argument("--decay-embeddings", action="store_true", help="weight decay on the embeddings too")
    fit.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm (0: no clipping)")
    fit.add_argument("--eval-every", type=int, default=100, help="steps between validation losses")
    fit.add_argument("--eval-batches", type=int, default=8, help="validation batches per evaluation")
    fit.add_argument("--save-every", type=int, default=100, help="steps between checkpoints")
    fit.add_argument("--keep", type=int, default=2, help="checkpoints kept on disk")
    fit.add_argument("--log-every", type=int, default=1, help="steps between lines of metrics.jsonl")
    fit.add_argument("--seed", type=whole_number(0, MAX_SEED), default=0)
    fit.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    fit.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    fit.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="bf16: autocast, fp32 weights")
    fit.add_argument("--compile", action="store_true", help="torch.compile the model")
    fit.add_argument("--activation-checkpointing", action="store_true",
                     help="recompute each block in the backward pass: less memory, ~30%% more compute")
    fit.add_argument("--fsdp", action="store_true", help="shard the model (FSDP2) and its checkpoints (DCP)")

    c = commands.add_parser("train", parents=[fit], help="pretrain a model from scratch on prepared shards")
    c.add_argument("--config", required=True, help="135M, 360M, 1.7B, tiny, or a config.json")
    c.add_argument("--data", required=True, help="a directory made by `smollm2 prepare`")
    c.add_argument("--tokenizer", help="saved with the model (default: the embedded model's)")
    c.set_defaults(run=train)

    tune = argparse.ArgumentParser(add_help=False)
    tune.add_argument("--model", help="starting checkpoint, as elsewhere (default: the embedded model)")
    tune.add_argument("--lora-r", type=whole_number(1, 4096), metavar="R",
                      help="train a LoRA adapter of rank R instead of every weight; final/ then holds the adapter "
                           "alone")
    tune.add_argument("--lora-alpha", type=float, metavar="A",
                      help="the adapter's update is scaled by A/R (default: R)")
    tune.add_argument("--lora-targets", default="q_proj,v_proj", metavar="NAMES",
                      help="the linear layers that get an adapter, comma-separated, from q_proj, k_proj, v_proj, "
                           "o_proj, gate_proj, up_proj, down_proj (default: q_proj,v_proj, as PEFT)")
    tune.add_argument("--lora-dropout", type=float, default=0.0, metavar="P", help="dropout on the adapter's input")
    tune.add_argument("--quantize", choices=("int8",), help="with --lora-r: the frozen base as int8 (QLoRA)")

    c = commands.add_parser("finetune", parents=[fit, tune], help="fine-tune on chats (loss on assistant tokens)")
    c.add_argument("--data", required=True, help="JSONL, one {\"messages\": [...]} chat per line")
    c.add_argument("--val-data", help="JSONL chats for the validation loss")
    c.set_defaults(run=finetune, lr=5e-5, min_lr=5e-6, warmup=10, steps=100, batch_size=4)

    c = commands.add_parser("dpo", parents=[fit, tune],
                            help="Direct Preference Optimization on pairs of a chosen and a rejected answer")
    c.add_argument("--data", required=True, help="JSONL, one {\"prompt\", \"chosen\", \"rejected\"} pair per line, "
                                                 "or {\"chosen\": [messages], \"rejected\": [messages]}")
    c.add_argument("--val-data", help="JSONL pairs for the validation loss and reward accuracy")
    c.add_argument("--beta", type=float, default=0.1,
                   help="how far the policy may move from the reference: higher keeps it closer (default: 0.1)")
    c.add_argument("--label-smoothing", type=float, default=0.0, metavar="E",
                   help="the share of pairs assumed mislabelled, in [0, 0.5) (conservative DPO; default: 0)")
    c.set_defaults(run=dpo, lr=1e-6, min_lr=1e-7, warmup=10, steps=100, batch_size=4)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        args.run(args)
    except SmolError as e:
        print(f"smollm2 {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
