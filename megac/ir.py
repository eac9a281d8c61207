"""Decode graph IR: one networkx node per op of one decode step.

Interface (stable)::

    g = build_graph(spec)            # nx.DiGraph

Nodes, in program order (``g.graph["order"]``, a topological order):

* per layer ``l``: ``L{l}.qkv``, ``L{l}.attn``, ``L{l}.attn_combine``,
  ``L{l}.o_proj``; a dense FFN: ``L{l}.ffn_upgate``, ``L{l}.ffn_down``;
  a MoE FFN: ``L{l}.router``, ``.topk``, ``.route_finalize``, ``.moe_gather``,
  ``.moe_upgate``, ``.moe_down``, ``.moe_combine`` (no ``.topk`` with the
  target's ``fused_topk``, no ``.moe_gather`` with ``fused_gather``: the
  finalize node writes their outputs too; with routed claims
  (``build_graph(spec, routed=True)``) neither, and ``.moe_upgate`` reads the
  router partials and the normed rows itself; no ``.moe_combine`` with
  ``build_graph(spec, fused_combine=True)``: the norm reads the experts'
  outputs; no ``.moe_down`` with ``split_down=True``: the up claims write
  the down projection's split-K partials into ``moe_out``; no
  ``.attn_combine`` with ``merged_attn=True``: the O-projection reads the
  attention partials and merges them itself); sequential blocks
  (Llama) also ``L{l}.norm_attn`` (post-attention residual add + norm);
  every layer ``L{l}.norm`` (residual add + the next norm);
* then ``lm_head``.

Node attributes: ``kind`` (the suffix: ``"qkv"``, ..., ``"lm_head"``),
``layer`` (``num_layers`` for the LM head), ``reads`` / ``writes`` (tensor
names), ``weights`` (weight tensor names read).

Graph attributes: ``tensors`` = ``{name: Tensor}``, ``order`` (node names),
``spec_name``, ``num_layers``, ``block``, ``fused_topk``, ``fused_gather``,
``routed_claims``, ``fused_combine``, ``split_down``, ``o_proj_merge``.

Edges ``producer -> consumer`` carry ``tensor`` (the name that flows). The
residual stream is one tensor per norm, ``x_resid[g]`` next to ``x_norm[g]``
(``x_resid[0]``: the embedding): each norm reads the previous norm's and
writes its own, so no tensor is written twice in a step.

Tensors are typed: ``weight`` (immutable), ``activation`` (normed inputs,
residual), ``kv`` (the KV cache), ``scratch`` (per-layer intermediates).
Shapes may contain the symbol ``"rows"`` (the batch size is a schedule key,
not a property of the model).

Parallel block (Cohere2): attention and FFN both read ``x_norm[l]``; ``norm``
adds both. Sequential block (Llama): attention -> ``norm_attn`` (writes
``x_norm[L+l]``) -> FFN -> ``norm``.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

#: Node kinds of one layer in program order (a valid topological order).
PARALLEL_DENSE = ("qkv", "attn", "attn_combine", "o_proj", "ffn_upgate", "ffn_down", "norm")
PARALLEL_MOE = ("qkv", "attn", "attn_combine", "o_proj", "router", "topk", "route_finalize",
                "moe_gather", "moe_upgate", "moe_down", "moe_combine", "norm")
SEQUENTIAL_DENSE = ("qkv", "attn", "attn_combine", "o_proj", "norm_attn", "ffn_upgate", "ffn_down", "norm")
SEQUENTIAL_MOE = ("qkv", "attn", "attn_combine", "o_proj", "norm_attn", "router", "topk",
                  "route_finalize", "moe_gather", "moe_upgate", "moe_down", "moe_combine", "norm")

#: Every node kind (the wave names a schedule YAML may use).
NODE_KINDS = tuple(dict.fromkeys(PARALLEL_MOE + SEQUENTIAL_DENSE + ("lm_head",)))


@dataclass(frozen=True)
class Tensor:
    name: str
    kind: str  # weight | activation | kv | scratch
    shape: tuple
    dtype: str


def layer_kind(block: str, ffn: str) -> str:
    """Layer kind name used by schedules/*.yaml: dense, moe, sequential_dense, sequential_moe."""
    return ffn if block == "parallel" else f"sequential_{ffn}"


def layer_node_kinds(block: str, ffn: str) -> tuple[str, ...]:
    return {
        ("parallel", "dense"): PARALLEL_DENSE,
        ("parallel", "moe"): PARALLEL_MOE,
        ("sequential", "dense"): SEQUENTIAL_DENSE,
        ("sequential", "moe"): SEQUENTIAL_MOE,
    }[(block, ffn)]


def node_name(layer: int | None, kind: str) -> str:
    return kind if layer is None else f"L{layer}.{kind}"


def fused_routing_of(spec, routed: bool = False) -> tuple[bool, bool]:
    """Whether ROUTE_FINALIZE ranks the rows itself and whether it gathers
    them (the target's ``fused_topk`` / ``fused_gather`` tiles;
    :class:`megac.geometry.Geometry` reads the same). Routed claims rank
    there too (the down claims and the combine read finalize's routing) and
    gather nowhere (the up claims read x_norm)."""
    from megac.geometry import DEFAULT_TILES

    tiles = getattr(spec.target, "tiles", None) or {}
    topk, gather = (bool(spec.moe and tiles.get(k, DEFAULT_TILES[k])) for k in ("fused_topk", "fused_gather"))
    return (topk or (routed and bool(spec.moe)), gather and not routed)


def build_graph(spec, routed: bool = False, fused_combine: bool = False, folded=(),
                split_down: bool = False, merged_attn: bool = False, combined=(),
                unnormalised: bool = False, qkv_combined=(), up_combined=()) -> nx.DiGraph:
    """The decode graph; ``routed``: with routed claims (the up claims read
    the router partials and x_norm; no top-k, no gather); ``fused_combine``:
    the norm does the MoE combine (schedules of one row:
    :func:`megac.geometry.fused_combine_at`); ``folded``: layers whose QKV
    and router nodes fold the norm that writes their x_norm slot (they read
    that norm's inputs instead: :meth:`megac.geometry.Geometry.folded`);
    ``split_down``: the up node also runs the down projection split-K
    (writes ``moe_out``, reads both expert matrices; no ``.moe_down``);
    ``merged_attn``: the O-projection merges the attention splits itself
    (reads the partials; no ``.attn_combine``: schedules of one row,
    :func:`megac.geometry.o_proj_merge_at`); ``combined``: folded layers
    whose router folds the previous layer's MoE combine instead of its norm
    (it reads the combine's inputs, and the finalize the norm's residual:
    :meth:`megac.geometry.Geometry.router_combined`); ``unnormalised``: every
    router of the model multiplies the unnormalised residual (the router_combine
    tile): where it does not fold the combine it reads the residual the norm
    wrote, and the rankers read it for the weights' 1 / rms; ``qkv_combined``:
    folded layers whose QKV node adds the previous layer's expert outputs in
    its fold itself (it reads the combine's inputs instead of its output:
    :meth:`megac.geometry.Geometry.qkv_combined`); ``up_combined``: those
    whose routed up claims do (:meth:`megac.geometry.Geometry.up_combined`)."""
    folded = frozenset(folded)
    combined = frozenset(combined)
    qkv_combined = frozenset(qkv_combined)
    up_combined = frozenset(up_combined)
    L = spec.num_layers
    D = spec.hidden_size
    R = "rows"
    moe = spec.moe
    routed = bool(routed and moe)
    fused_topk, fused_gather = fused_routing_of(spec, routed)
    fused_combine = bool(fused_combine and moe)
    split_down = bool(split_down and moe)
    g = nx.DiGraph(spec_name=spec.name, num_layers=L, block=spec.block, fused_topk=fused_topk,
                   fused_gather=fused_gather, routed_claims=routed, fused_combine=fused_combine,
                   split_down=split_down, o_proj_merge=bool(merged_attn))
    tensors: dict[str, Tensor] = {}
    order: list[str] = []
    last_writer: dict[str, str] = {}
    norm_reads: dict[int, list[str]] = {}  # x_norm slot -> what its norm reads
    comb_reads: dict[int, list[str]] = {}  # x_norm slot -> its norm's residual inputs, the combine's unsummed

    def tensor(name, kind, shape, dtype):
        tensors.setdefault(name, Tensor(name, kind, tuple(shape), dtype))
        return name

    def add(name, kind, layer, reads, writes, weights=()):
        g.add_node(name, kind=kind, layer=layer, reads=list(reads), writes=list(writes), weights=list(weights))
        order.append(name)
        for t in reads:
            src = last_writer.get(t)
            if src is not None:
                if g.has_edge(src, name):
                    g.edges[src, name]["tensors"].append(t)
                else:
                    g.add_edge(src, name, tensor=t, tensors=[t])
        for t in writes:
            last_writer[t] = name

    tensor("x_resid[0]", "activation", (R, D), "fp32")
    tensor("x_norm[0]", "activation", (R, D), "bf16")
    tensor("kv_cache", "kv", ("blocks", "block_size", spec.num_kv_heads, spec.head_dim), "bf16")
    seq = spec.block == "sequential"
    for l, layer in enumerate(spec.layers):
        p = f"L{l}."
        x_in = f"x_norm[{l}]"
        w = lambda n: tensor(f"{n}[{l}]", "weight", _weight_shape(spec, n), "bf16")  # noqa: E731
        q = tensor(f"q[{l}]", "scratch", (R, spec.q_width), "bf16")
        kv = tensor(f"kv_new[{l}]", "kv", (R, 2 * spec.kv_width), "bf16")
        part = tensor(f"attn_part[{l}]", "scratch", (R, spec.num_heads, "splits", spec.head_dim + 1), "fp32")
        aout = tensor(f"attn_out[{l}]", "scratch", (R, spec.q_width), "bf16")
        opart = tensor(f"o_part[{l}]", "scratch", (spec.num_kv_heads, R, D), "fp32")
        # a folded reader reads what the norm writing x_in reads
        x_src = norm_reads[l] if l in folded else [x_in]
        add(p + "qkv", "qkv", l, comb_reads[l] if l in qkv_combined else x_src, [q, kv], [w("w_qkv")])
        add(p + "attn", "attn", l, [q, kv, "kv_cache"], [part])
        if merged_attn:  # the O-projection merges the splits itself
            add(p + "o_proj", "o_proj", l, [part], [opart], [w("w_o")])
        else:
            add(p + "attn_combine", "attn_combine", l, [part], [aout])
            add(p + "o_proj", "o_proj", l, [aout], [opart], [w("w_o")])
        ffn_in = x_in
        if seq:
            ffn_in = tensor(f"x_norm[{L + l}]", "activation", (R, D), "bf16")
            r_in, r_out = f"x_resid[{l}]", tensor(f"x_resid[{L + l}]", "activation", (R, D), "fp32")
            add(p + "norm_attn", "norm_attn", l, [r_in, opart], [r_out, ffn_in], [w("w_norm_attn")])
        if layer.ffn == "dense":
            F = spec.dense_intermediate_size
            act = tensor(f"ffn_act[{l}]", "scratch", (R, F), "bf16")
            fpart = tensor(f"ffn_part[{l}]", "scratch", ("ffn_splits", R, D), "fp32")
            add(p + "ffn_upgate", "ffn_upgate", l, [ffn_in], [act], [w("w_upgate")])
            add(p + "ffn_down", "ffn_down", l, [act], [fpart], [w("w_down")])
        else:
            E, K, F = moe.num_experts, moe.top_k, moe.expert_intermediate_size
            rpart = tensor(f"router_part[{l}]", "scratch", ("router_splits", R, E), "fp32")
            topk = tensor(f"topk[{l}]", "scratch", (R, K), "int32+fp32")
            route = tensor(f"route[{l}]", "scratch", ("route_slot+queues+counts",), "int32")
            mx = tensor(f"moe_x[{l}]", "scratch", (E, R, K, D), "bf16")
            ma = tensor(f"moe_act[{l}]", "scratch", (E, R, K, F), "bf16")
            mo = tensor(f"moe_out[{l}]", "scratch", (E, R, K, D), "fp32")
            fpart = tensor(f"ffn_part[{l}]", "scratch", (1, R, D), "fp32")
            # unnormalised: the residual the norm writing ffn_in wrote (x_resid of the same slot)
            resid_in = ffn_in.replace("x_norm", "x_resid")
            r_src = (comb_reads[l] if l in combined else [resid_in] if unnormalised
                     else x_src if l in folded else [ffn_in])
            add(p + "router", "router", l, r_src, [rpart], [w("w_router")])
            # the finalize task may rank the rows itself and copy them to their
            # slots: a hop less each (the target's fused_topk / fused_gather)
            fin_reads, fin_writes = [rpart] if fused_topk else [topk], [route]
            scale_src = [resid_in] if unnormalised else []  # the weights' 1 / rms
            if fused_topk:
                fin_writes.insert(0, topk)
                fin_reads += scale_src
            else:
                add(p + "topk", "topk", l, [rpart, *scale_src], [topk])
            if fused_gather:
                fin_reads.append(ffn_in)
                fin_writes.append(mx)
            add(p + "route_finalize", "route_finalize", l, fin_reads, fin_writes)
            if not fused_gather and not routed:
                add(p + "moe_gather", "moe_gather", l, [ffn_in, route], [mx])
            # split_down: the up claims write their down partials themselves
            up_out, up_w = ([mo], [w("w_moe_upgate"), w("w_moe_down")]) if split_down else ([ma], [w("w_moe_upgate")])
            if routed:  # each up claimer routes the rows itself (and may fold their norm: up_combined)
                add(p + "moe_upgate", "moe_upgate", l, [rpart, *(comb_reads[l] if l in up_combined else [ffn_in])],
                    up_out, up_w)
            else:
                add(p + "moe_upgate", "moe_upgate", l, [mx, route], up_out, up_w)
            if not split_down:
                add(p + "moe_down", "moe_down", l, [ma, route], [mo], [w("w_moe_down")])
            if fused_combine:  # the norm sums the experts' outputs itself
                fpart = [mo, topk, route]
            else:
                add(p + "moe_combine", "moe_combine", l, [mo, topk, route], [fpart])
        g_next = 2 * L if l == L - 1 else l + 1
        x_next = tensor(f"x_norm[{g_next}]", "activation", (R, D), "bf16")
        r_in = f"x_resid[{L + l if seq else l}]"
        r_out = tensor(f"x_resid[{g_next}]", "activation", (R, D), "fp32")
        fparts = fpart if isinstance(fpart, list) else [fpart]
        reads = [r_in, *fparts] if seq else [r_in, opart, *fparts]
        add(p + "norm", "norm", l, reads, [r_out, x_next], [w("w_norm")])
        norm_reads[g_next] = reads
        if not seq and layer.ffn != "dense" and not split_down:  # (with fused_combine: the norm's reads)
            comb_reads[g_next] = [r_in, opart, mo, topk, route]
    tensor("w_lm_head", "weight", (spec.vocab_size, D), "bf16")
    logits = tensor("logits", "scratch", (R, spec.vocab_size), "fp32")
    add("lm_head", "lm_head", L, [f"x_norm[{2 * L}]"], [logits], ["w_lm_head"])
    g.graph["tensors"] = tensors
    g.graph["order"] = order
    return g


def _weight_shape(spec, name: str) -> tuple:
    D = spec.hidden_size
    if name == "w_qkv":
        return (spec.qkv_width, D)
    if name == "w_o":
        return (D, spec.q_width)
    if name == "w_upgate":
        return (2 * spec.dense_intermediate_size, D)
    if name == "w_down":
        return (D, spec.dense_intermediate_size)
    if name == "w_router":
        return (spec.moe.num_experts, D)
    if name == "w_moe_upgate":
        return (spec.moe.num_experts, 2 * spec.moe.expert_intermediate_size, D)
    if name == "w_moe_down":
        return (spec.moe.num_experts, D, spec.moe.expert_intermediate_size)
    if name in ("w_norm", "w_norm_attn"):
        return (D,)
    raise KeyError(name)


def check_graph(g: nx.DiGraph) -> None:
    """Structural invariants (tests call it; passes rely on it)."""
    assert nx.is_directed_acyclic_graph(g), "decode graph has a cycle"
    order = g.graph["order"]
    pos = {n: i for i, n in enumerate(order)}
    assert set(order) == set(g.nodes), "order does not list every node"
    for u, v in g.edges:
        assert pos[u] < pos[v], f"edge {u} -> {v} goes backwards in program order"
    tensors = g.graph["tensors"]
    for n, d in g.nodes(data=True):
        for t in d["reads"] + d["writes"] + d["weights"]:
            assert t in tensors, f"{n}: unknown tensor {t}"


__all__ = [
    "NODE_KINDS",
    "Tensor",
    "build_graph",
    "check_graph",
    "layer_kind",
    "layer_node_kinds",
    "node_name",
]
