"""Sparse dictionaries: sparse autoencoders (SAEs), which rewrite the activation at one hook point as a few active
features of a wide dictionary, and transcoders, which predict a later point's activation (an MLP's output) from
an earlier one's the same way, read from SAELens's on-disk format (a directory of cfg.json and
sae_weights.safetensors) or EleutherAI's sparsify's (a directory of cfg.json and sae.safetensors, named by the
module it hooks, as layers.3.mlp), or such a directory in a Hugging Face repository ("org/name/folder", from the
hub's local cache). The activations: ReLU, TopK (the k largest, the rest zero) and JumpReLU (zero below a learned
threshold per feature); a skip transcoder adds a linear map of its input. load_saes reads a set: a directory of
such directories (sparsify's layout for a model's transcoders).

    sae = load_sae("path/to/blocks.3.hook_resid_pre")          # sae.hook_name: "blocks.3.hook_resid_pre"
    _, cache = lens.run_with_cache(model, ids, [sae.hook_name])
    features = sae.encode(cache[sae.hook_name])               # (B, T, d_sae), mostly zeros
    error = sae.error(cache[sae.hook_name])                    # (B, T, d_in): what the features leave out
    smollm2.generate(model, [ids], 20, hooks=replacement(sae))  # the model run on the reconstruction

A file is untrusted input: its settings, then every tensor's name, shape and dtype from the file's header, are
checked before any tensor is read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .checkpoints.checkpoint import all_finite
from .checkpoints.hf import read_json
from .errors import SmolError
from .generation.hooks import BLOCK_POINTS, HookFunction, Hooks, point_names

CFG, WEIGHTS, SPARSIFY_WEIGHTS = "cfg.json", "sae_weights.safetensors", "sae.safetensors"
# SAELens's architectures: (activation, a transcoder, with a skip connection)
ARCHITECTURES = {"standard": ("relu", False, False), "topk": ("topk", False, False),
                 "jumprelu": ("jumprelu", False, False), "transcoder": ("relu", True, False),
                 "skip_transcoder": ("relu", True, True), "jumprelu_transcoder": ("jumprelu", True, False),
                 "jumprelu_skip_transcoder": ("jumprelu", True, True)}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
STORED_FLOATS = ("F32", "F64", "F16", "BF16")
# TransformerLens's names for what one of our points holds: its hook_mlp_in is the stream entering the MLP's norm
ALIASES = {"hook_mlp_in": "hook_resid_mid"}
POINT = re.compile(r"blocks\.(\d+)\.(.+)")
HUB_FOLDER = re.compile(r"([\w.-]+/[\w.-]+)((?:/[\w.-]+)*)")  # org/name, then the folder in the repository
# sparsify names a dictionary by the module of transformers' model it hooks (under the base model, or "model."):
# a block (layers.3), its attention or MLP (layers.3.self_attn, layers.3.mlp), or the embedding
SPARSIFY_MODULE = re.compile(r"(?:model\.)?(?:embed_tokens|layers\.(\d+)(?:\.(mlp|self_attn))?)")
SPARSIFY_OUTPUTS = {None: "hook_resid_post", "mlp": "hook_mlp_out", "self_attn": "hook_attn_out"}  # of a block's


@dataclasses.dataclass(frozen=True)
class SAE:
    """An SAE or a transcoder, as SAELens computes it (encode, decode), at our hook points."""
    hook_name: str  # where it reads, ours (TransformerLens's names)
    hook_name_out: str  # where what it writes belongs: hook_name for an SAE, the point a transcoder predicts
    activation: str  # relu, topk or jumprelu
    transcoder: bool  # it predicts another activation (hook_name_out's) than the one it reads
    W_enc: torch.Tensor  # (d_in, d_sae)
    b_enc: torch.Tensor  # (d_sae,)
    W_dec: torch.Tensor  # (d_sae, d_out): a feature's decoder direction is its row
    b_dec: torch.Tensor  # (d_out,)
    threshold: torch.Tensor | None  # (d_sae,), JumpReLU's
    W_skip: torch.Tensor | None  # (d_out, d_in), a skip transcoder's
    k: int | None  # TopK's
    subtract_b_dec: bool  # SAELens's apply_b_dec_to_input: encode x - b_dec (an SAE's centring)
    rescale_by_decoder_norm: bool  # TopK: rank a feature by its activation times its decoder row's norm

    def encode(self, activations: torch.Tensor) -> torch.Tensor:
        """The features, (..., d_sae), of activations (..., d_in)."""
        x = activations.to(self.W_enc.dtype)
        pre = (x - self.b_dec if self.subtract_b_dec else x) @ self.W_enc + self.b_enc
        if self.activation == "jumprelu":
            return pre.relu() * (pre > self.threshold).to(pre.dtype)
        if self.activation == "relu":
            return pre.relu()
        if self.rescale_by_decoder_norm:
            pre = pre * self.W_dec.norm(dim=-1)
        values, indices = pre.topk(self.k, dim=-1, sorted=False)
        return torch.zeros_like(pre).scatter_(-1, indices, values.relu())

    def decode(self, features: torch.Tensor) -> torch.Tensor:
        """The features' reconstruction, (..., d_out): their decoder directions' sum, and the bias (not a skip
        transcoder's skip term, which needs the input: reconstruct())."""
        if self.rescale_by_decoder_norm:
            features = features * (1 / self.W_dec.norm(dim=-1))
        return features @ self.W_dec + self.b_dec

    def reconstruct(self, activations: torch.Tensor) -> torch.Tensor:
        """What it writes for activations (..., d_in): decode(encode(x)), and a skip transcoder's x @ W_skip.T."""
        x = activations.to(self.W_enc.dtype)
        out = self.decode(self.encode(x))
        return out if self.W_skip is None else out + x @ self.W_skip.T

    def error(self, activations: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        """The reconstruction error per token, (..., d_out): target - reconstruct(activations), where the target
        is the activations themselves for an SAE and, for a transcoder, the activation at hook_name_out. Its
        .norm(dim=-1) is its size per token."""
        if target is None and self.transcoder:
            raise SmolError(f"a transcoder's error needs its target, the activation at {self.hook_name_out}")
        return (activations if target is None else target).to(self.W_enc.dtype) - self.reconstruct(activations)


def replacement(config, sae: SAE, keep_error: bool = False) -> list[tuple[str, HookFunction]]:
    """The hooks that run the model on the dictionary's output where it writes (hook_name_out): an SAE's
    reconstruction of the activation there, a transcoder's prediction from what it reads at hook_name in the same
    pass. keep_error: add back the error (what the dictionary misses) as a constant, as circuit-tracer's
    replacement model does: the activation keeps the model's own value, bit for bit, while a gradient flows
    through the dictionary's features alone."""
    def written(x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        output = output.to(x.dtype)
        return x.detach() + (output - output.detach()) if keep_error else output  # x + 0: x exactly

    if not sae.transcoder:
        hooks = [(sae.hook_name, lambda x, name: written(x, sae.reconstruct(x)))]
    else:
        reads_before_writes(config, sae)
        seen = {}

        def read(x, name):
            seen["output"] = sae.reconstruct(x)

        def write(x, name):  # the pass that read it, at once: each row's hooked pass runs alone
            return written(x, seen.pop("output"))

        hooks = [(sae.hook_name, read), (sae.hook_name_out, write)]
    Hooks(config.num_hidden_layers, hooks)  # the points are the model's
    return hooks


def reads_before_writes(config, sae: SAE) -> None:
    """A transcoder's pass reads before it writes: hook_name comes before hook_name_out in a model's pass."""
    names = point_names(config.num_hidden_layers)
    if sae.hook_name not in names or sae.hook_name_out not in names \
            or names.index(sae.hook_name) >= names.index(sae.hook_name_out):
        raise SmolError(f"a transcoder must read ({sae.hook_name}) before it writes ({sae.hook_name_out}), both "
                        f"points of a model of {config.num_hidden_layers} blocks")


def load_sae(source: str | os.PathLike, model=None) -> SAE:
    """An SAE or transcoder in SAELens's or sparsify's format: a directory, or "org/name/folder" in the Hugging
    Face hub (its local cache where HF_HUB_OFFLINE=1). model: the one it is for, which a sparsify transcoder of an
    MLP or attention needs (it reads the module's input, after the norm's weight: see sparsify_sae)."""
    return read_sae(sae_directory(source), model)


def load_saes(source: str | os.PathLike, model=None) -> dict[str, SAE]:
    """A dictionary, or a set of them: a directory (or hub folder) that is one, as {its name: it}, or that holds
    one per folder, as {folder: it} in the order of their blocks (sparsify's layout: layers.0.mlp, layers.1.mlp,
    ...)."""
    path = sae_directory(source)
    if (path / CFG).is_file():
        return {path.name: read_sae(path, model)}
    folders = sorted((f for f in path.iterdir() if (f / CFG).is_file()),
                     key=lambda f: [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", f.name)])
    if not folders:
        raise SmolError(f"{path}: no {CFG}, nor folders with one (not an SAE, nor a set of them)")
    return {folder.name: read_sae(folder, model) for folder in folders}


def read_sae(path: Path, model) -> SAE:
    if not (path / CFG).is_file():
        raise SmolError(f"{path}: no {CFG} (not an SAE in SAELens's or sparsify's format)")
    if (path / SPARSIFY_WEIGHTS).is_file() and not (path / WEIGHTS).is_file():
        return sparsify_sae(path, model)
    cfg = read_json(path / CFG)
    setting = Settings(cfg, path / CFG)
    # Before SAELens 6, TopK was a standard SAE's activation_fn (activation_fn_str), with its k among its kwargs
    legacy = setting.get("activation_fn", str, "relu", aliases=("activation_fn_str",))
    if legacy not in ("relu", "topk"):
        raise SmolError(f"{path / CFG}: activation_fn {legacy[:100]!r} is not supported (relu, topk)")
    architecture = setting.get("architecture", str, "topk" if legacy == "topk" else "standard")
    if architecture not in ARCHITECTURES:
        raise SmolError(f"{path / CFG}: architecture {architecture[:100]!r} is not one of {', '.join(ARCHITECTURES)}")
    activation, transcoder, skip = ARCHITECTURES[architecture]
    d_in, d_sae = setting.get("d_in", int), setting.get("d_sae", int)
    d_out = setting.get("d_out", int) if transcoder else d_in
    k = None
    if activation == "topk":
        kwargs = cfg.get("activation_fn_kwargs")
        k = setting.get("k", int, kwargs.get("k") if isinstance(kwargs, dict) else None)
        if k > d_sae:
            raise SmolError(f"{path / CFG}: k={k} is more than the {d_sae} features")
    subtract_b_dec = setting.get("apply_b_dec_to_input", bool, not transcoder)
    if transcoder and subtract_b_dec:
        raise SmolError(f"{path / CFG}: a transcoder cannot subtract its output bias from its input "
                        f"(apply_b_dec_to_input)")
    for name, allowed in (("normalize_activations", ("none", False)), ("reshape_activations", ("none",)),
                          ("hook_head_index", (None,))):
        if cfg.get(name, allowed[0]) not in allowed or setting.metadata.get(name, allowed[0]) not in allowed:
            found = cfg[name] if cfg.get(name, allowed[0]) not in allowed else setting.metadata[name]
            raise SmolError(f"{path / CFG}: {name} {repr(found)[:100]} is not supported (only {allowed[0]!r})")
    dtype_name = setting.get("dtype", str, "float32")
    dtype = DTYPES.get(dtype_name.removeprefix("torch."))
    if dtype is None:
        raise SmolError(f"{path / CFG}: dtype {dtype_name[:100]!r} is not one of {', '.join(DTYPES)}")
    hook_name = our_point(setting.get("hook_name", str, aliases=("hook_point",)), path / CFG)
    hook_name_out = our_point(setting.get("hook_name_out", str, hook_name), path / CFG) if transcoder else hook_name

    shapes = {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_out), "b_dec": (d_out,)}
    shapes |= {"threshold": (d_sae,)} if activation == "jumprelu" else {}
    shapes |= {"W_skip": (d_out, d_in)} if skip else {}
    tensors = read_tensors(path / WEIGHTS, shapes, dtype)
    return SAE(hook_name, hook_name_out, activation, transcoder, tensors["W_enc"], tensors["b_enc"], tensors["W_dec"],
               tensors["b_dec"], tensors.get("threshold"), tensors.get("W_skip"), k, subtract_b_dec,
               activation == "topk" and setting.get("rescale_acts_by_decoder_norm", bool, False))


def sparsify_sae(path: Path, model) -> SAE:
    """sparsify's SparseCoder (sparse_coder.py): cfg.json (its SparseCoderConfig, and d_in) and sae.safetensors
    (encoder.weight (d_sae, d_in), encoder.bias, W_dec (d_sae, d_in), b_dec, and W_skip (d_in, d_in) with a skip
    connection), hooked at the module the folder is named for. It encodes TopK of ReLU(encoder(x)) (x - b_dec for
    an SAE), decodes as SAELens, and a transcoder predicts the module's output from its input. That input is the
    stream for a block; for an MLP or attention, its norm's output, weight applied: no point of ours, so the norm's
    weight is folded into the encoder (and the skip) read at its hook_normalized, before the weight."""
    setting = Settings(read_json(path / CFG), path / CFG)
    if setting.get("activation", str, "topk") != "topk":
        raise SmolError(f"{path / CFG}: activation {setting.cfg['activation']!r} is not supported (topk)"[:300])
    d_in, k = setting.get("d_in", int), setting.get("k", int)
    d_sae = setting.cfg.get("num_latents") or d_in * setting.get("expansion_factor", int)
    transcoder, skip = setting.get("transcode", bool, False), setting.get("skip_connection", bool, False)
    if isinstance(d_sae, bool) or not isinstance(d_sae, int) or d_sae < 1:
        raise SmolError(f"{path / CFG}: num_latents must be a whole number, got {d_sae!r}"[:300])
    if k > d_sae:
        raise SmolError(f"{path / CFG}: k={k} is more than the {d_sae} features")
    module = SPARSIFY_MODULE.fullmatch(path.name)
    if not module:
        raise SmolError(f"{path}: a sparsify folder is named for the module it hooks (embed_tokens, layers.{{l}}, "
                        f"layers.{{l}}.mlp, layers.{{l}}.self_attn), not {path.name[:200]!r}")
    layer, part = module[1], module[2]
    out = "hook_embed" if layer is None else f"blocks.{layer}.{SPARSIFY_OUTPUTS[part]}"
    norm = None
    if transcoder and layer is None:
        raise SmolError(f"{path}: a transcoder of embed_tokens would read token ids")
    if transcoder and part is not None:
        if model is None:
            raise SmolError(f"{path}: a transcoder of {part} reads its norm's output, weight applied: load it with "
                            f"the model (load_sae(source, model)), whose norm weight is folded into its encoder")
        if int(layer) >= len(model.model.layers):
            raise SmolError(f"{path}: the model has no block {layer}")
        block = model.model.layers[int(layer)]
        norm = (block.post_attention_layernorm if part == "mlp" else block.input_layernorm).weight.detach().float()
        reads = f"blocks.{layer}.{'ln2' if part == 'mlp' else 'ln1'}.hook_normalized"
    else:
        reads = f"blocks.{layer}.hook_resid_pre" if transcoder else out
    shapes = {"encoder.weight": (d_sae, d_in), "encoder.bias": (d_sae,), "W_dec": (d_sae, d_in), "b_dec": (d_in,)}
    shapes |= {"W_skip": (d_in, d_in)} if skip else {}
    t = read_tensors(path / SPARSIFY_WEIGHTS, shapes, torch.float32)
    W_enc, W_skip = t["encoder.weight"].T.contiguous(), t.get("W_skip")
    if norm is not None:
        if len(norm) != d_in:
            raise SmolError(f"{path}: d_in={d_in}, but the model's stream has {len(norm)} numbers")
        W_enc = W_enc * norm[:, None]
        W_skip = None if W_skip is None else W_skip * norm
    return SAE(reads, out, "topk", transcoder, W_enc, t["encoder.bias"], t["W_dec"], t["b_dec"], None, W_skip, k,
               not transcoder, False)


def save_sae(sae: SAE, path: str | os.PathLike) -> Path:
    """Write the dictionary in SAELens's format (cfg.json and sae_weights.safetensors, float32) into directory
    `path`, which SAELens and load_sae read: an SAE of any of its activations, a ReLU or JumpReLU transcoder."""
    architecture = next((name for name, kind in ARCHITECTURES.items()
                         if kind == (sae.activation, sae.transcoder, sae.W_skip is not None)), None)
    if architecture is None:
        raise SmolError(f"SAELens has no {sae.activation} transcoder{' with a skip' if sae.W_skip is not None else ''}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = dict(W_enc=sae.W_enc, b_enc=sae.b_enc, W_dec=sae.W_dec, b_dec=sae.b_dec, threshold=sae.threshold,
                   W_skip=sae.W_skip)
    save_file({name: t.detach().float().contiguous() for name, t in tensors.items() if t is not None},
              str(path / WEIGHTS))
    # the format's version: SAELens reads a config without one as written before SAELens 6, in other names
    metadata = dict(sae_lens_version="6.0.0", hook_name=sae.hook_name)
    cfg = dict(architecture=architecture, d_in=sae.W_enc.shape[0], d_sae=sae.W_enc.shape[1], dtype="float32",
               apply_b_dec_to_input=sae.subtract_b_dec, metadata=metadata)
    if sae.transcoder:
        cfg |= dict(d_out=sae.W_dec.shape[1], metadata=metadata | dict(hook_name_out=sae.hook_name_out))
    if sae.activation == "topk":
        cfg |= dict(k=sae.k, rescale_acts_by_decoder_norm=sae.rescale_by_decoder_norm)
    (path / CFG).write_text(json.dumps(cfg, indent=2))
    return path


class Settings:
    """cfg.json's settings, each in its place or, as SAELens 6 writes the model's, in its metadata."""

    def __init__(self, cfg: dict, where: Path):
        self.cfg, self.where = cfg, where
        self.metadata = cfg.get("metadata", {})
        if not isinstance(self.metadata, dict):
            raise SmolError(f"{where}: metadata must be an object, got {self.metadata!r}"[:300])

    def get(self, name: str, kind: type, default=None, aliases: tuple[str, ...] = ()):
        """The setting `name` (or, from older SAELens, an alias), which must be of `kind` (a whole number >= 1
        where int); `default` where it is absent, which must then be given."""
        for key in (name, *aliases):
            for place in (self.metadata, self.cfg):
                if key in place and place[key] is not None:
                    value = place[key]
                    whole = kind is int and isinstance(value, int) and not isinstance(value, bool) and value >= 1
                    if not (whole or kind is not int and isinstance(value, kind)):
                        raise SmolError(f"{self.where}: {key} must be "
                                        f"{'a whole number, 1 or more' if kind is int else f'a {kind.__name__}'}, "
                                        f"got {value!r}"[:300])
                    return value
        if default is None:
            raise SmolError(f"{self.where}: no {name}")
        return default


def our_point(name: str, where: Path) -> str:
    """SAELens's hook name (TransformerLens's) as ours: the same name, or ours for what one of its aliases holds."""
    block = POINT.fullmatch(name)
    if block and block[2] in ALIASES:
        return f"blocks.{block[1]}.{ALIASES[block[2]]}"
    if name in ("hook_embed", "ln_final.hook_scale", "ln_final.hook_normalized") or block and block[2] in BLOCK_POINTS:
        return name
    raise SmolError(f"{where}: hook point {name[:200]!r} is not one of ours (TransformerLens's names: "
                    f"hook_embed, blocks.{{l}}.{{{', '.join(BLOCK_POINTS)}}}, ln_final.hook_normalized)")


def read_tensors(weights: Path, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors `shapes` names, read from `weights` as `dtype` once the file's header shows each there with
    its shape and a float dtype, and no other."""
    if not weights.is_file():
        raise SmolError(f"{weights.parent}: no {weights.name}")
    try:
        with safe_open(str(weights), framework="pt") as f:
            for name in sorted(shapes.keys() - set(f.keys())):
                raise SmolError(f"{weights}: missing tensor {name}")
            for name in sorted(set(f.keys()) - shapes.keys()):
                raise SmolError(f"{weights}: unexpected tensor {name[:200]}")
            for name, shape in shapes.items():
                piece = f.get_slice(name)
                if tuple(piece.get_shape()) != shape:
                    raise SmolError(f"{weights}: tensor {name} has shape {tuple(piece.get_shape())}, but {CFG} "
                                    f"says {shape}")
                if piece.get_dtype() not in STORED_FLOATS:
                    raise SmolError(f"{weights}: tensor {name} has dtype {piece.get_dtype()}, not a float")
            tensors = {name: f.get_tensor(name).to(dtype) for name in shapes}
    except (SafetensorError, OSError) as e:
        raise SmolError(f"{weights}: truncated or corrupt safetensors file ({e})") from None
    for name, tensor in tensors.items():
        if not all_finite(tensor):
            raise SmolError(f"{weights}: tensor {name} holds NaN or infinite values")
    return tensors


def sae_directory(source: str | os.PathLike) -> Path:
    """An existing directory as it is; "org/name/folder" (the folder may be empty) as its files' place in the Hugging
    Face hub's cache, fetched unless HF_HUB_OFFLINE=1 (only a dictionary's files: its own, or its folders')."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    match = HUB_FOLDER.fullmatch(str(source))
    if path.exists() or not match or any(part in (".", "..") for part in str(source).split("/")):
        raise SmolError(f"{source}: not a directory, nor org/name/folder of a Hugging Face repository")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    repo, folder = match[1], match[2].strip("/")
    try:
        root = snapshot_download(repo, allow_patterns=[f"{folder}/{where}{name}".lstrip("/") for where in ("", "*/")
                                                       for name in (CFG, WEIGHTS, SPARSIFY_WEIGHTS)])
    except (LocalEntryNotFoundError, HfHubHTTPError, HFValidationError, OSError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SmolError(f"{source}: not a local directory, and the Hugging Face hub has no usable copy "
                        f"({reason})") from None
    return Path(root) / folder
