"""Attribution graphs (Ameisen et al., "Circuit Tracing", 2025; circuit-tracer): which earlier computations a
prediction depends on, as a graph of direct, linear effects.

A set of transcoders, one per block, each reading the stream before that block's MLP (hook_resid_mid, or
ln2.hook_normalized) and predicting its output (hook_mlp_out), replaces the MLPs: each MLP's output becomes its
transcoder's active features' decoder directions, times their activations, plus an error node (what the
transcoder misses there: the MLP's true output less the transcoder's, kept as a constant). With the attention
patterns and every norm's scale frozen at the prompt's values, the residual stream is then a linear function of
the token embeddings, the features' activations and the error nodes, and the effect of one node on another is
exact: a source's activation times its decoder direction carried along those linear paths, read by the target:
a feature's encoder direction (its pre-activation), or a logit's unembedding row less the mean row (the logit less
the mean logit). Nodes: active features, errors (block, position), token embeddings (position) and the target
logits at the last position. The backward passes that find them run on model.py's hook points.

    graph = attribute(model, transcoders, ids)              # the likeliest next tokens (95% of the probability)
    page = graph_json(graph, lambda ids: tok.decode(ids))   # circuit-tracer's JSON, pruned: Neuronpedia reads it
"""

from __future__ import annotations

import dataclasses
from collections import abc

import torch

from .errors import SmolError
from .generation.hooks import Hooks
from .lens import reference_math, token_rows
from .sae import SAE

READS = ("hook_resid_mid", "ln2.hook_normalized")  # where a transcoder may read: the MLP's input, before its norm
LOGIT_PROBABILITY, MAX_LOGITS = 0.95, 10  # default targets: the likeliest tokens until they hold 95%, 10 at most
MAX_FEATURES = 1024  # feature nodes whose own inputs are computed: the most influential, found as they come
BATCH = 128  # targets whose inputs one batched backward pass finds


@dataclasses.dataclass(frozen=True)
class Graph:
    """A prompt's attribution graph, unpruned. Its nodes, in the adjacency matrix's order: the features (those
    whose inputs were computed), the error nodes (block by block, position by position), the prompt's tokens, the
    target logits. adjacency[target, source]: the source's direct effect on the target (zero into errors and
    tokens, and out of logits)."""
    tokens: list[int]  # the prompt
    features: torch.Tensor  # (F, 3): each feature node's block, position and index in its transcoder
    activations: torch.Tensor  # (F,)
    logits: list[int]  # the target tokens, at the last position
    probabilities: torch.Tensor  # (n,): theirs; a target logit's weight in a node's influence
    adjacency: torch.Tensor  # (N, N), N = F + layers * T + T + n
    active_features: int  # how many features were active in all (F of them are nodes)
    layers: int


def attribute(model, transcoders: abc.Sequence[SAE], ids, targets: abc.Sequence[int] | None = None,
              max_features: int = MAX_FEATURES, batch: int = BATCH) -> Graph:
    """The attribution graph of one prompt (a list of ids) for its next token: targets (token ids), or the
    likeliest tokens until they hold 95% of the probability (10 at most). Every active feature is a source; the
    max_features most influential on the targets are nodes with their own inputs, chosen as circuit-tracer does
    (the influence through the rows found so far, recomputed after each few batches)."""
    prompt = token_rows(model, ids)
    if prompt.shape[0] != 1:
        raise SmolError(f"an attribution graph is of one prompt, got {prompt.shape[0]}")
    layers, T = model.config.num_hidden_layers, prompt.shape[1]
    check(model.config, transcoders)
    for name, value in (("max_features", max_features), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SmolError(f"{name} must be a whole number, 1 or more, got {value!r}")
    with torch.inference_mode(False), torch.enable_grad():  # backward passes, wherever it is called from
        run = ReplacementRun(model, transcoders, prompt.clone())  # a tensor autograd may keep
        logits = model.logits(run.final).detach()[0, -1].float()
        chosen, probabilities, logit_vectors = target_logits(model, logits, targets)

        # Every node a row may read: the active features, the errors, the tokens (then the logits, read by none).
        found = [run.features[layer].nonzero() for layer in range(layers)]  # (n, 2): position, index
        active = torch.cat([torch.cat([torch.full((len(f), 1), layer, device=f.device), f], 1)
                            for layer, f in enumerate(found)]).cpu()
        A, columns = len(active), len(active) + layers * T + T
        rows = torch.zeros(len(chosen) + min(max_features, A), columns)
        row_nodes = torch.zeros(len(rows), dtype=torch.long)  # each row's node, by its column
        for start in range(0, len(chosen), batch):  # the logits' rows
            part = slice(start, min(start + batch, len(chosen)))
            rows[part] = run.inputs([(layers, T - 1, vector) for vector in logit_vectors[part]])
            row_nodes[part] = torch.arange(part.start, part.stop) + columns
        visited, filled = torch.zeros(A, dtype=torch.bool), len(chosen)
        while filled < len(rows):
            if len(rows) - len(chosen) == A:  # every feature: no ranking needed
                pending = torch.arange(A)
            else:
                weights = torch.zeros(filled)
                weights[:len(chosen)] = probabilities
                ranked = influence(rows[:filled], row_nodes[:filled], weights, layers)[:A].argsort(descending=True)
                pending = ranked[~visited[ranked]][:min(4 * batch, len(rows) - filled)]
            for part in pending.split(batch):
                rows[filled:filled + len(part)] = run.inputs(
                    [(int(layer), int(position), run.encoders[int(layer)][:, int(index)])
                     for layer, position, index in active[part]])
                row_nodes[filled:filled + len(part)] = part
                visited[part] = True
                filled += len(part)

    # The square matrix over the nodes kept: the visited features in order, then errors, tokens and logits.
    selected = visited.nonzero()[:, 0]
    keep = torch.cat([selected, torch.arange(A, columns)])
    F, n = len(selected), len(chosen)
    adjacency = torch.zeros(F + columns - A + n, F + columns - A + n)
    node_of_row = torch.where(row_nodes >= columns, row_nodes - columns + F + columns - A,
                              torch.searchsorted(selected, row_nodes))
    adjacency[node_of_row, :len(keep)] = rows[:, keep]  # nothing reads a logit
    activations = torch.stack([run.features[int(layer)][int(position), int(index)]
                               for layer, position, index in active[selected]]) if F else torch.zeros(0)
    return Graph(prompt[0].tolist(), active[selected], activations.detach().float().cpu(), chosen,
                 probabilities, adjacency, A, layers)


def check(config, transcoders: abc.Sequence[SAE]) -> None:
    """One transcoder per block, each reading block l's MLP input and writing its output, as wide as the stream."""
    if isinstance(transcoders, (str, SAE)) or not isinstance(transcoders, abc.Sequence) \
            or len(transcoders) != config.num_hidden_layers:
        raise SmolError(f"an attribution graph needs a transcoder for each of the {config.num_hidden_layers} blocks, "
                        f"as a list")
    for layer, tc in enumerate(transcoders):
        reads = [f"blocks.{layer}.{point}" for point in READS]
        if not isinstance(tc, SAE) or not tc.transcoder or tc.hook_name not in reads \
                or tc.hook_name_out != f"blocks.{layer}.hook_mlp_out":
            got = f"{tc.hook_name} -> {tc.hook_name_out}" if isinstance(tc, SAE) else type(tc).__name__
            raise SmolError(f"transcoder {layer} must read {' or '.join(reads)} and write blocks.{layer}.hook_mlp_out "
                            f"(a transcoder, load_sae), got {got}")
        if tc.W_enc.shape[0] != config.hidden_size or tc.W_dec.shape[1] != config.hidden_size:
            raise SmolError(f"transcoder {layer} reads {tc.W_enc.shape[0]} and writes {tc.W_dec.shape[1]} numbers, "
                            f"the stream has {config.hidden_size}")


def target_logits(model, logits: torch.Tensor, targets) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """The target tokens, their probabilities, and the directions that read them from the final normed stream:
    each unembedding row less the mean row (the logit less the mean logit, as circuit-tracer)."""
    probs = logits.softmax(-1)
    if targets is None:
        top, ids = probs.topk(MAX_LOGITS)
        ids = ids[:int(torch.searchsorted(top.cumsum(0), LOGIT_PROBABILITY)) + 1]
    else:
        if isinstance(targets, (str, bytes)) or not isinstance(targets, abc.Sequence) or not targets or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < len(probs) for t in targets):
            raise SmolError(f"targets must be a list of token ids in [0, {len(probs)}), got {targets!r}"[:300])
        ids = torch.tensor(list(dict.fromkeys(targets)), device=logits.device)
    unembed = model.output_weight.detach().float()
    return ids.tolist(), probs[ids].cpu(), unembed[ids] - unembed.mean(0)


class ReplacementRun:
    """The prompt's pass with the MLPs replaced and the attention patterns and norm scales frozen, kept for
    backward passes: its stream is linear in the embeddings (a leaf), the features' contributions and the errors
    (at a zero added after each MLP, whose gradient is the stream's there)."""

    def __init__(self, model, transcoders: abc.Sequence[SAE], prompt: torch.Tensor):
        layers = model.config.num_hidden_layers
        self.transcoders = transcoders
        self.reads, self.nudges, self.features, self.errors = {}, {}, {}, {}
        hooks = [("hook_embed", self.embed)]
        for layer, tc in enumerate(transcoders):
            hooks += [(f"blocks.{layer}.ln1.hook_scale", frozen), (f"blocks.{layer}.attn.hook_pattern", frozen),
                      (f"blocks.{layer}.ln2.hook_scale", frozen), (tc.hook_name, self.read),
                      (tc.hook_name_out, self.write)]
        hooks.append(("ln_final.hook_scale", frozen))
        with reference_math(model):
            self.final = Hooks(layers, hooks).hidden_states(model, prompt)
        # a feature's reading direction; its writing direction scaled by its activation (decode's), padded into
        # a matrix per position (T, C, most features at a position), and where each feature lands in their products
        self.encoders = [tc.W_enc * tc.W_dec.norm(dim=-1) if tc.rescale_by_decoder_norm else tc.W_enc
                         for tc in transcoders]
        self.writers = []
        for layer, tc in enumerate(transcoders):
            position, index = self.features[layer].nonzero().unbind(1)  # by position
            decoder = tc.W_dec[index] / tc.W_dec[index].norm(dim=-1, keepdim=True) if tc.rescale_by_decoder_norm \
                else tc.W_dec[index]
            counts = torch.bincount(position, minlength=prompt.shape[1])
            rank = torch.arange(len(position), device=position.device) - (counts.cumsum(0) - counts)[position]
            width = int(counts.max()) if len(position) else 0
            padded = torch.zeros(prompt.shape[1], width, tc.W_dec.shape[1], device=position.device)
            padded[position, rank] = (decoder * self.features[layer][position, index, None]).float()
            self.writers.append((padded.transpose(1, 2), position * width + rank))

    def embed(self, x, name):
        self.leaf = x.detach().requires_grad_()
        return self.leaf

    def read(self, x, name):
        layer = int(name.split(".")[1])
        self.reads[layer] = x
        self.features[layer] = self.transcoders[layer].encode(x.detach())[0]

    def write(self, x, name):
        layer = int(name.split(".")[1])
        tc, x_in = self.transcoders[layer], self.reads[layer]
        self.nudges[layer] = torch.zeros_like(x, requires_grad=True)
        written = tc.decode(self.features[layer][None])  # reconstruct(), its features already found
        if tc.W_skip is None:
            self.errors[layer] = (x.detach() - written)[0].to(x.dtype)
            return x.detach() + self.nudges[layer]
        skip = (x_in.to(tc.W_skip.dtype) @ tc.W_skip.T).to(x.dtype)  # the skip connection: a linear path
        self.errors[layer] = (x.detach() - written - skip.detach())[0].to(x.dtype)
        return (x - skip).detach() + skip + self.nudges[layer]

    def inputs(self, targets: list[tuple[int, int, torch.Tensor]]) -> torch.Tensor:
        """For targets (block, position, reading direction), block = layers for the final normed stream: their
        rows, the direct effect on each of every active feature, error and token, (K, columns)."""
        K, layers, (_, T, C) = len(targets), len(self.transcoders), self.final.shape
        outputs = sorted({layer for layer, _, _ in targets})
        seeds = {layer: torch.zeros(K, 1, T, C, dtype=self.final.dtype, device=self.final.device) for layer in outputs}
        for k, (layer, position, direction) in enumerate(targets):
            seeds[layer][k, 0, position] = direction
        sources = [self.leaf] + [self.nudges[layer] for layer in range(max(outputs))]
        grads = torch.autograd.grad([self.final if layer == layers else self.reads[layer] for layer in outputs],
                                    sources, [seeds[layer] for layer in outputs], retain_graph=True,
                                    is_grads_batched=True, allow_unused=True, materialize_grads=True)
        embed, *through = [g[:, 0].float() for g in grads]  # (K, T, C) each
        features, errors = [], []
        for layer in range(layers):
            padded, where = self.writers[layer]
            if layer >= len(through):  # no path from here to any of these targets
                features.append(torch.zeros(K, len(where), device=where.device))
                errors.append(torch.zeros(K, T, device=where.device))
                continue
            g = through[layer]
            # each feature's writer read where it writes: one product per position, (T, K, width)
            effects = torch.bmm(g.transpose(0, 1), padded).transpose(0, 1).reshape(K, -1)
            features.append(effects[:, where])
            errors.append((g * self.errors[layer].float()).sum(-1))
        tokens = (embed * self.leaf.detach()[0].float()).sum(-1)
        return torch.cat([*features, *errors, tokens], 1).cpu()


def frozen(x, name):
    return x.detach()


def influence(rows: torch.Tensor, row_nodes: torch.Tensor, weights: torch.Tensor, layers: int) -> torch.Tensor:
    """Each node's influence on the weighted targets along paths through the rows given (rows[i]: the inputs of
    node row_nodes[i], one column per node; weights: each row's node's own), every row's effects first taken as
    shares of their absolute sum: the weights times the sum of every power of that matrix (circuit-tracer's)."""
    shares = rows.abs()
    shares /= shares.sum(1, keepdim=True).clamp(min=1e-10)
    # the paths run between the nodes that have rows: (R, R), then end anywhere
    inside = row_nodes < rows.shape[1]
    between = torch.zeros(len(rows), len(rows))
    between[:, inside] = shares[:, row_nodes[inside]]
    flow, carried = weights, torch.zeros(len(rows))
    for _ in range(layers + 2):  # each step of a path goes down a block (the logits' first, to the last block)
        carried += flow
        flow = flow @ between
        if not bool(flow.any()):
            break
    return carried @ shares


@dataclasses.dataclass(frozen=True)
class Pruned:
    nodes: torch.Tensor  # (N,) bool: kept
    edges: torch.Tensor  # (N, N) bool: kept, as adjacency[target, source]
    influence: torch.Tensor  # (N,): the share of all nodes' influence held by the nodes at least as influential


def prune(graph: Graph, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> Pruned:
    """circuit-tracer's pruning: the most influential nodes until they hold node_threshold of all nodes'
    influence on the target logits (tokens and logits always kept), then among their edges the most influential
    (an edge's share of its target's inputs times its target's influence) until edge_threshold; then, until
    nothing changes, features and errors with no kept edge out and features with no kept edge in are dropped."""
    for name, value in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise SmolError(f"{name} must be a number from 0 to 1, got {value!r}")
    A, n, T = graph.adjacency, len(graph.logits), len(graph.tokens)
    N, F = len(A), len(graph.features)
    nodes = torch.arange(N)
    weights = torch.zeros(N)
    weights[N - n:] = graph.probabilities
    node_influence = influence(A, nodes, weights, graph.layers)
    kept = node_influence >= above(node_influence, node_threshold)
    kept[N - n - T:] = True
    pruned = A * kept[:, None] * kept[None, :]
    edge_score = pruned.abs() / pruned.abs().sum(1, keepdim=True).clamp(min=1e-10) \
        * (influence(pruned, nodes, weights, graph.layers) + weights)[:, None]
    edges = edge_score >= above(edge_score.flatten(), edge_threshold)
    edges &= edge_score > 0
    while True:
        before = kept.clone()
        kept[:N - n - T] &= edges[:, :N - n - T].any(0)  # features and errors lead somewhere
        kept[:F] &= edges[:F].any(1)  # features come from somewhere
        edges &= kept[:, None] & kept[None, :]
        if torch.equal(kept, before):
            break
    order = node_influence.argsort(descending=True)
    shares = torch.zeros(N)
    shares[order] = node_influence[order].cumsum(0) / node_influence.sum().clamp(min=1e-10)
    return Pruned(kept, edges, shares)


def above(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """The score of the least of the highest scores that together hold `fraction` of their sum."""
    ranked = scores.sort(descending=True).values
    held = ranked.cumsum(0) / ranked.sum().clamp(min=1e-10)
    return ranked[min(int(torch.searchsorted(held, torch.tensor(fraction))), len(ranked) - 1)]


def graph_json(graph: Graph, decode: abc.Callable[[list[int]], str], slug: str = "graph",
               scan: str = "custom", node_threshold: float = 0.8, edge_threshold: float = 0.98) -> dict:
    """The graph, pruned, in circuit-tracer's graph JSON, which its local server and Neuronpedia's viewer read:
    metadata, qParams, nodes (every kept node with a kept edge, and every token and logit) and links (the kept
    edges). decode: the text of a list of token ids (Tokenizer.decode); scan: the transcoders' name (Neuronpedia
    looks features up by it)."""
    pruned = prune(graph, node_threshold, edge_threshold)
    F, T, layers = len(graph.features), len(graph.tokens), graph.layers
    nodes = {}
    for i in pruned.nodes.nonzero()[:, 0].tolist():
        share = float(pruned.influence[i])
        if i < F:
            layer, position, index = graph.features[i].tolist()
            # feature: Neuronpedia's one number for (block, index), their Cantor pairing, as circuit-tracer writes it
            nodes[i] = dict(node_id=f"{layer}_{index}_{position}", feature=(layer + index) * (layer + index + 1) // 2
                            + index, layer=str(layer), ctx_idx=position, feature_type="cross layer transcoder",
                            jsNodeId=f"{layer}_{index}-0", influence=share, activation=float(graph.activations[i]))
        elif i < F + layers * T:
            layer, position = divmod(i - F, T)
            nodes[i] = dict(node_id=f"{layer}_-1_{position}", feature=-1, layer=str(layer), ctx_idx=position,
                            feature_type="mlp reconstruction error", jsNodeId=f"{layer}_-1-{position}",
                            influence=share)
        elif i < F + layers * T + T:
            position = i - F - layers * T
            token = graph.tokens[position]
            nodes[i] = dict(node_id=f"E_{token}_{position}", feature=position, layer="E", ctx_idx=position,
                            feature_type="embedding", jsNodeId=f"E_{token}-{position}", influence=share)
        else:
            k = i - F - layers * T - T
            token, p = graph.logits[k], float(graph.probabilities[k])
            nodes[i] = dict(node_id=f"{layers + 1}_{token}_{T - 1}", feature=token, layer=str(layers + 1),
                            ctx_idx=T - 1, feature_type="logit", token_prob=p, is_target_logit=k == 0,
                            jsNodeId=f"L_{token}-{T - 1}", clerp=f'Output "{decode([token])}" (p={p:.3f})')
    targets, sources = pruned.edges.nonzero().unbind(1)
    links = [dict(source=nodes[s]["node_id"], target=nodes[t]["node_id"], weight=float(graph.adjacency[t, s]))
             for t, s in zip(targets.tolist(), sources.tolist())]
    linked = {link["source"] for link in links} | {link["target"] for link in links}
    defaults = dict(token_prob=0.0, is_target_logit=False, run_idx=0, reverse_ctx_idx=0, clerp="", influence=None,
                    activation=None)
    return dict(
        metadata=dict(slug=slug, scan=scan, transcoder_list=[], prompt_tokens=[decode([t]) for t in graph.tokens],
                      prompt=decode(graph.tokens), node_threshold=node_threshold, schema_version=1),
        qParams=dict(pinnedIds=[], supernodes=[], linkType="both", clickedId="", sg_pos=""),
        nodes=[defaults | node for node in nodes.values()
               if node["node_id"] in linked or node["feature_type"] in ("embedding", "logit")],
        links=links)
