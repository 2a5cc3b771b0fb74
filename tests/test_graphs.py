"""Attribution graphs: every edge equals the perturbation definition on a tiny model (scale the source, everything
frozen as in the replacement model, measure the target), the influence-ranked selection keeps those rows, and the
JSON has circuit-tracer's fields; the README's example on the embedded model (benchmarks/graphs.py times a 16-token
graph)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY, tiny_model
from smollm2 import graphs, lens
from smollm2.errors import SmolError
from smollm2.generation.hooks import Hooks
from smollm2.sae import SAE

EPSILON = 0.1  # the replacement model is linear in each node: any scale measures the same effect


def random_transcoder(layer: int, width: int, d_sae: int, seed: int, reads: str = "hook_resid_mid",
                      skip: bool = False, activation: str = "relu", threshold: float = 0.0) -> SAE:
    """A transcoder of block `layer` with random weights: about half its features active on a token (ReLU), or
    fewer (JumpReLU's thresholds: `threshold` and up to about 0.3 more; the pre-activations are about N(0, 1) on a
    normed input)."""
    generator = torch.Generator().manual_seed(seed)

    def random(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=generator)

    return SAE(f"blocks.{layer}.{reads}", f"blocks.{layer}.hook_mlp_out", activation, True,
               random(width, d_sae, scale=width ** -0.5), random(d_sae, scale=0.1), random(d_sae, width, scale=0.1),
               random(width, scale=0.01), threshold + 0.3 * random(d_sae).abs() if activation == "jumprelu" else None,
               random(width, width, scale=0.02) if skip else None, None, False, False)


@pytest.fixture(scope="module")
def tiny():
    config = TINY["gqa"]
    model = tiny_model(config)
    transcoders = [random_transcoder(0, config.hidden_size, 24, 1),
                   random_transcoder(1, config.hidden_size, 24, 2, "ln2.hook_normalized", skip=True,
                                     activation="jumprelu")]
    ids = torch.randint(0, config.vocab_size, (6,), generator=torch.Generator().manual_seed(3)).tolist()
    return model, transcoders, ids


def measured_effects(model, transcoders, ids, graph) -> torch.Tensor:
    """Every node's effect on every feature's pre-activation and target logit (demeaned), measured: one pass per
    source with its activation (error, embedding) scaled by 1 + EPSILON, the other features' activations, every
    attention pattern and norm scale and every error kept at the prompt's values; (target, source) as the
    adjacency, its change over EPSILON."""
    layers, T = model.config.num_hidden_layers, len(ids)
    names = [name for layer, tc in enumerate(transcoders) for name in
             (f"blocks.{layer}.ln1.hook_scale", f"blocks.{layer}.attn.hook_pattern", f"blocks.{layer}.ln2.hook_scale",
              tc.hook_name, tc.hook_name_out)] + ["ln_final.hook_scale"]
    _, clean = lens.run_with_cache(model, [ids], names)
    F = len(graph.features)
    N = len(graph.adjacency)
    scale = torch.ones(N + 1, N)  # row s scales node s; the last row nothing
    scale[torch.arange(N), torch.arange(N)] += EPSILON
    features = {layer: tc.encode(clean[tc.hook_name])[0] for layer, tc in enumerate(transcoders)}
    errors = {layer: clean[tc.hook_name_out][0] - tc.reconstruct(clean[tc.hook_name])[0]
              for layer, tc in enumerate(transcoders)}
    inputs = {}

    def kept(x, name):
        return clean[name].expand_as(x)

    def embed(x, name):
        return x * scale[:, F + layers * T:F + layers * T + T, None]

    def read(x, name):
        inputs[int(name.split(".")[1])] = x

    def write(x, name):
        layer = int(name.split(".")[1])
        tc = transcoders[layer]
        acts = features[layer].expand(N + 1, -1, -1).clone()
        for i, (at, position, index) in enumerate(graph.features.tolist()):
            if at == layer:
                acts[:, position, index] *= scale[:, i]
        out = acts @ tc.W_dec + tc.b_dec + errors[layer] * scale[:, F + layer * T:F + (layer + 1) * T, None]
        return out + (0 if tc.W_skip is None else inputs[layer] @ tc.W_skip.T)

    hooks = [(name, kept) for name in names if "scale" in name or "pattern" in name] + [("hook_embed", embed)]
    hooks += [(tc.hook_name, read) for tc in transcoders] + [(tc.hook_name_out, write) for tc in transcoders]
    with torch.inference_mode():
        logits = model.logits(Hooks(layers, hooks).hidden_states(model, torch.tensor([ids] * (N + 1))))
    values = torch.zeros(N + 1, N)
    for i, (layer, position, index) in enumerate(graph.features.tolist()):
        tc = transcoders[layer]
        values[:, i] = inputs[layer][:, position] @ tc.W_enc[:, index] + tc.b_enc[index]
    last = logits[:, -1]
    values[:, N - len(graph.logits):] = last[:, graph.logits] - last.mean(-1, keepdim=True)
    return ((values[:-1] - values[-1]) / EPSILON).T


def test_every_edge_is_the_effect_of_perturbing_its_source(tiny):
    model, transcoders, ids = tiny
    graph = graphs.attribute(model, transcoders, ids, batch=16)
    F, T, layers = len(graph.features), len(ids), model.config.num_hidden_layers
    assert F == graph.active_features > 50  # every active feature a node here
    assert graph.adjacency.shape == (F + layers * T + T + len(graph.logits),) * 2
    want = measured_effects(model, transcoders, ids, graph)
    largest = graph.adjacency.abs().max()
    assert float((graph.adjacency - want).abs().max()) < 1e-3 * float(largest)
    pruned = graphs.prune(graph)
    kept = graph.adjacency[pruned.edges]
    assert len(kept) > 10 and float((kept - want[pruned.edges]).abs().max()) < 1e-3 * float(largest)
    assert bool((graph.adjacency[:, :F][:F] != 0).any())  # features feed features (block 0 -> 1)
    # fewer feature nodes: the most influential, their rows as before
    few = graphs.attribute(model, transcoders, ids, max_features=20, batch=8)
    assert len(few.features) == 20 and few.active_features == F
    chosen = [graph.features.tolist().index(f) for f in few.features.tolist()]
    rest = list(range(F, len(graph.adjacency)))
    torch.testing.assert_close(few.adjacency, graph.adjacency[chosen + rest][:, chosen + rest], atol=1e-5, rtol=0)


REQUIRED = {  # circuit-tracer's graph JSON: each field its viewer requires, and its type
    "metadata": {"slug": str, "scan": str, "transcoder_list": list, "prompt_tokens": list, "prompt": str},
    "qParams": {"pinnedIds": list, "supernodes": list, "linkType": str, "clickedId": str, "sg_pos": str},
    "node": {"node_id": str, "feature": int, "layer": str, "ctx_idx": int, "feature_type": str, "jsNodeId": str,
             "token_prob": float, "is_target_logit": bool, "run_idx": int, "reverse_ctx_idx": int, "clerp": str},
    "link": {"source": str, "target": str, "weight": float},
}


def test_the_json_has_circuit_tracers_fields(tiny):
    model, transcoders, ids = tiny
    graph = graphs.attribute(model, transcoders, ids)
    page = json.loads(json.dumps(graphs.graph_json(graph, lambda t: f"<{','.join(map(str, t))}>", slug="tiny")))
    for part in ("metadata", "qParams"):
        for field, kind in REQUIRED[part].items():
            assert isinstance(page[part][field], kind), (part, field)
    for node in page["nodes"]:
        for field, kind in REQUIRED["node"].items():
            assert isinstance(node[field], kind), (node, field)
    ids_seen = [node["node_id"] for node in page["nodes"]]
    assert len(set(ids_seen)) == len(ids_seen) and len({n["jsNodeId"] for n in page["nodes"]}) == len(ids_seen)
    for link in page["links"]:
        assert {link["source"], link["target"]} <= set(ids_seen) and isinstance(link["weight"], float)
    kinds = {node["feature_type"] for node in page["nodes"]}
    assert kinds == {"cross layer transcoder", "mlp reconstruction error", "embedding", "logit"}
    assert page["metadata"]["prompt_tokens"] == [f"<{t}>" for t in ids]
    logits = [node for node in page["nodes"] if node["feature_type"] == "logit"]
    assert [node["feature"] for node in logits] == graph.logits and sum(n["is_target_logit"] for n in logits) == 1
    assert len(page["links"]) == int(graphs.prune(graph).edges.sum())


def test_bad_graph_requests_are_smol_errors(tiny):
    model, transcoders, ids = tiny
    with pytest.raises(SmolError, match="a transcoder for each of the 2 blocks"):
        graphs.attribute(model, transcoders[:1], ids)
    swapped = [transcoders[1], transcoders[0]]
    with pytest.raises(SmolError, match="transcoder 0 must read blocks.0.hook_resid_mid or"):
        graphs.attribute(model, swapped, ids)
    with pytest.raises(SmolError, match="targets must be a list of token ids"):
        graphs.attribute(model, transcoders, ids, targets=[-1])
    with pytest.raises(SmolError, match="max_features must be a whole number"):
        graphs.attribute(model, transcoders, ids, max_features=0)
    with pytest.raises(SmolError, match="one prompt"):
        graphs.attribute(model, transcoders, [ids, ids])
    with torch.inference_mode():  # where a server's thread would call it from
        graph = graphs.attribute(model, transcoders, ids, targets=[5, 7])
    assert graph.logits == [5, 7] and bool(graph.adjacency.isfinite().all())
    with pytest.raises(SmolError, match="node_threshold must be a number from 0 to 1"):
        graphs.prune(graph, node_threshold=2)


def test_the_readmes_graph_of_paris(model):
    """The README's worked example: "The capital of France is" with 30 random transcoders."""
    from smollm2 import Tokenizer

    tok = Tokenizer.from_pretrained()
    generator = torch.Generator().manual_seed(0)

    def transcoder(layer, width=576, d_sae=1024):  # as the README builds them
        def random(*shape, scale):
            return scale * torch.randn(*shape, generator=generator)

        return SAE(f"blocks.{layer}.ln2.hook_normalized", f"blocks.{layer}.hook_mlp_out", "jumprelu", True,
                   random(width, d_sae, scale=width ** -0.5), random(d_sae, scale=0.1),
                   random(d_sae, width, scale=0.1), torch.zeros(width), torch.full((d_sae,), 2.3), None, None, False,
                   False)

    ids = tok.encode("The capital of France is")
    graph = graphs.attribute(model, [transcoder(layer) for layer in range(30)], ids, max_features=64)
    F, T, layers = len(graph.features), len(ids), 30
    assert [tok.decode([t]) for t in graph.logits[:3]] == [" Paris", " the", " London"]
    assert len(graph.logits) == 10 and round(float(graph.probabilities[0]), 2) == 0.77
    # A pre-activation at a threshold falls either way with another CPU tier's summation order: about 1,720.
    assert abs(graph.active_features - 1720) <= 17 and F == 64
    paris = graph.adjacency[F + layers * T + T]  # the Paris logit's inputs
    top = paris.topk(2)
    assert [divmod(int(i) - F, T) for i in top.indices] == [(24, 4), (0, 3)]  # error nodes: (block, position)
    assert [round(float(v), 1) for v in top.values] == [3.2, 2.3]
    weights = torch.zeros(len(paris))
    weights[-len(graph.logits):] = graph.probabilities
    influence = graphs.influence(graph.adjacency, torch.arange(len(paris)), weights, layers)
    assert round(float(influence[F:F + layers * T].sum() / influence.sum()), 2) == 0.81  # the errors' share
