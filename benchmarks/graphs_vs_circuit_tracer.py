"""Our attribution graph beside circuit-tracer's own, on the embedded model with random transcoders: every edge
both graphs have, and the rest accounted for.

circuit-tracer (pip install circuit-tracer) pins transformers 4.x and TransformerLens 3.2, which the rest of the
test extra does not run with: run this in an environment of its own, e.g. a venv that sees the project's (a .pth
file naming its site-packages) with circuit-tracer installed over it:

    python benchmarks/graphs_vs_circuit_tracer.py [--features 128] [--threads 2]

Both run circuit-tracer's replacement model: each block's MLP replaced by its transcoder (read at hook_resid_mid,
circuit-tracer's nnsight backend on transformers' LlamaForCausalLM of the same weights), attention patterns and
norm scales frozen; every active feature a node (max_feature_nodes=None), the same target logits. circuit-tracer
puts a special token first and leaves that position's features and errors out (zero): the prompt here is its
own, with that token; our features at position 0 are ours alone, and circuit-tracer's edges from its position-0
errors must be zero. Every other edge, into every feature and logit, must agree: exits 1 where a difference is
over 1e-4 of the largest edge compared.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch

from smollm2 import Tokenizer, graphs, lens, load, save
from smollm2.sae import SAE

PROMPT = "The capital of France is"


def transcoder(layer: int, features: int, norm: float) -> SAE:
    """Block `layer`'s random JumpReLU transcoder, reading the stream before the MLP's norm, whose typical norm
    there is `norm`: pre-activations about N(0, 1), thresholds from 1.5 up (a few percent active)."""
    generator = torch.Generator().manual_seed(layer)
    width = 576

    def random(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=generator)

    return SAE(f"blocks.{layer}.hook_resid_mid", f"blocks.{layer}.hook_mlp_out", "jumprelu", True,
               random(width, features, scale=1 / norm), random(features, scale=0.1),
               random(features, width, scale=0.1), random(width, scale=0.01), 1.5 + 0.3 * random(features).abs(),
               None, None, False, False)


def theirs(ours: list[SAE]):
    """The same transcoders as circuit-tracer's TranscoderSet."""
    from circuit_tracer.transcoder.activation_functions import JumpReLU
    from circuit_tracer.transcoder.single_layer_transcoder import SingleLayerTranscoder, TranscoderSet

    found = {}
    for layer, tc in enumerate(ours):
        width, features = tc.W_enc.shape
        one = SingleLayerTranscoder(width, features, JumpReLU(tc.threshold.clone(), 0.1), layer,
                                    device=torch.device("cpu"), dtype=torch.float32)
        with torch.no_grad():
            one.W_enc.copy_(tc.W_enc.T)
            one.b_enc.copy_(tc.b_enc)
            one.W_dec.copy_(tc.W_dec)
            one.b_dec.copy_(tc.b_dec)
        found[layer] = one
    return TranscoderSet(found, feature_input_hook="hook_resid_mid", feature_output_hook="hook_mlp_out")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--features", type=int, default=128, help="each transcoder's")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from circuit_tracer import attribute
    from circuit_tracer.replacement_model import ReplacementModel
    from circuit_tracer.replacement_model.common import ensure_tokenized
    from transformers import AutoTokenizer

    model, tokenizer = load(kernels=False), Tokenizer.from_pretrained()
    layers = model.config.num_hidden_layers
    with tempfile.TemporaryDirectory() as hf_dir:
        save(model, hf_dir)
        tokenizer.save_pretrained(hf_dir)
        # the prompt as circuit-tracer runs it: a special token first, whose features and error it leaves out
        ids = ensure_tokenized(tokenizer.encode(PROMPT), AutoTokenizer.from_pretrained(hf_dir), "cpu", "smollm2")
        ids = ids.tolist()
        names = [f"blocks.{layer}.hook_resid_mid" for layer in range(layers)]
        _, cache = lens.run_with_cache(model, [ids], names)
        norms = [float(cache[name][0, 1:].norm(dim=-1).median()) for name in names]
        transcoders = [transcoder(layer, args.features, norms[layer]) for layer in range(layers)]
        replacement = ReplacementModel.from_pretrained_and_transcoders(hf_dir, theirs(transcoders), backend="nnsight",
                                                                        device=torch.device("cpu"))
        their = attribute(torch.tensor(ids), replacement, max_feature_nodes=None, batch_size=64)
    ours = graphs.attribute(model, transcoders, ids, max_features=layers * len(ids) * args.features)
    T, n = len(ids), len(ours.logits)
    assert [target.vocab_idx for target in their.logit_targets] == ours.logits, "the same target logits"
    # the nodes by key: ("f", block, position, index), ("e", block, position), ("t", position), ("l", k)
    def keys(features, count_logits):
        return [("f", *map(int, f)) for f in features] + [("e", b, p) for b in range(layers) for p in range(T)] \
            + [("t", p) for p in range(T)] + [("l", k) for k in range(count_logits)]

    our_keys = keys(ours.features, n)
    their_keys = keys(their.active_features[their.selected_features], n)
    assert len(their_keys) == len(their.adjacency_matrix)
    our_index = {key: i for i, key in enumerate(our_keys)}
    their_index = {key: i for i, key in enumerate(their_keys)}
    assert all(key in our_index for key in their_keys), "each of circuit-tracer's nodes is one of ours"
    rows = [key for key in their_keys if key[0] in ("f", "l")]
    left_out = [key for key in their_keys if key[0] in ("f", "e") and key[2] == 0]  # by circuit-tracer
    sources = [key for key in their_keys if key not in left_out]

    def part(adjacency, index, columns):
        return adjacency.float()[[index[key] for key in rows]][:, [index[key] for key in columns]]

    assert not part(their.adjacency_matrix, their_index, left_out).any()
    mine, its = part(ours.adjacency, our_index, sources), part(their.adjacency_matrix, their_index, sources)
    worst, largest = float((mine - its).abs().max()), float(its.abs().max())
    print(f"{T} tokens, {len(ours.features)} active features ({len(our_keys) - len(their_keys)} at position 0, ours "
          f"alone); {len(rows)} targets x {len(sources)} sources; largest edge {largest:.4f}, largest difference "
          f"{worst:.2e} ({worst / largest:.1e} of it)")
    return 0 if worst <= 1e-4 * largest else 1


if __name__ == "__main__":
    sys.exit(main())
