"""Pass ``order``: wave order per layer kind (``schedules/<order>.yaml``) -> global task list.

A schedule YAML gives, per layer kind (``dense``, ``moe``,
``sequential_dense``, ``sequential_moe``), the waves of one layer in order,
and the ``final`` waves after the last layer. A wave is a node kind
(``qkv``, ``attn``, ...) or ``{interleave: [a, b]}``: the tasks of a and b
alternate (a0 b0 a1 b1 ...; the longer one's tail follows), or
``{wave: a, sms_of: b}`` / ``{wave: a, sms_of: [b, c]}``: a's tasks take this place
in the list but run on the SMs of the earlier waves b (and c), dealt round
robin over their tasks (a's task j goes where host task j mod #hosts went),
and move no cursor: the waves after are dealt as if a were not there. This
says "the O-projection on the SMs that ran attention", whose SMs are free
when it is ready while the others still stream experts. ``{wave: a, share:
f}`` (0 < f <= 1) deals a's tasks round robin over only ``round(f *
num_sms)`` consecutive SMs from the cursor (task j on cursor + j mod width)
and moves the cursor past them: "attention on half the SMs", so that at
batch 8 the other half reaches its expert claims while the splits run
instead of after two rounds of them (a claimer wave, on every SM by
design, ignores its share; a placed one is an error, but for a full
layer's attention, claimed or static by the schedule (geometry
``full_static``): claimed, it is dealt in place). Each node kind of
a layer appears exactly once; an omitted, repeated or unknown wave, or a
host that is not an earlier dealt wave, is rejected with a one-line error
naming the file and the wave. A claimer host (attention claimed by every
SM in a long full layer) names no SMs; where none of a placed wave's hosts
names SMs in a layer, or none is in the graph (a fused node), the wave is
dealt by the cursor in its place, as a plain wave.

A claimer node's template is emitted ``num_sms`` times (one claimer per SM;
``assign`` gives them distinct SMs).

``{wave: a, share: f, rest_after: b}`` splits a claimer wave (attention
claimed in a long full layer): the claimers of the ``round(f * num_sms)``
SMs from the cursor take this place (and name those SMs, so a later wave
may be placed on them), the other SMs' claimers go right after wave b. At
batch 8 half the SMs then claim the full layer's attention while the other
half go straight to their expert claims, as the share does for the static
splits of a sliding layer. For a wave that is not claimed it is ``share``.

Ensures: the global list is a topological order of the dependencies: every
wait's counter has all its signallers earlier (for a counter signalled by
claimed tasks: the first claimer of that queue, which drains it), every
claimed task's wait counter is complete before the first claimer of its
queue; otherwise a one-line error names the offending pair.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml

from megac import abi
from megac.abi import H
from megac.errors import MegacError
from megac.ir import layer_kind, layer_node_kinds
from megac.passes import Lowering, PassError
from megac.resources import schedules_dir

NAME = "order"

#: schedules/ at the repository top level.
ORDERS = ("tuned", "interleaved", "attention-first")
LAYER_KINDS = ("dense", "moe", "sequential_dense", "sequential_moe")
#: an order file's ``KIND_full`` entry: the waves of that kind's full-attention layers
FULL_SUFFIX = "_full"
#: an order file's ``KIND_split`` (and ``KIND_split_full``) entry: the waves of that kind's
#: layers in schedules that split the expert down projection (geometry ``split_down``)
SPLIT_SUFFIX = "_split"
#: an order file's ``KIND_routed`` (and ``KIND_routed_full``) entry: the waves of that kind's
#: layers in schedules whose up claimers rank the rows themselves (geometry ``routed_claims``:
#: batch 1 of MoE models), where few expert claims leave most claimers drained at once
ROUTED_SUFFIX = "_routed"
#: the schedule modes an entry may name, in the order a layer looks for them
MODE_SUFFIXES = (SPLIT_SUFFIX, ROUTED_SUFFIX)
#: where ``assign``'s SM cursor starts a layer: "layer" (the default)
#: restarts it at SM 0 every layer (and before the final waves), so every
#: layer's task j runs on the same SM: an SM runs the same opcodes layer
#: after layer and finds their code warm in its instruction caches (H200,
#: eleventh session, against "global": NMC 8K bs1 3.371 -> 3.345 ms, bs8
#: 10.45 -> 10.25, SmolLM2 1K bs1 1.182 -> 1.127). "global" carries it on
#: from the layer before, so the small waves spread over the SMs.
SM_CURSORS = ("layer", "global")


class OrderError(MegacError):
    """A schedule YAML is malformed (one line naming the file and the wave)."""


def schedule_path(order: str) -> Path:
    p = Path(order)
    if p.suffix in (".yaml", ".yml"):
        return p
    return schedules_dir() / f"{order}.yaml"


def order_doc(order: str) -> dict | None:
    """The order file's YAML as a mapping (what a profile trace records, so
    the schedule it ran can be rebuilt after the file changes); None where
    there is no such file or it is not a mapping."""
    try:
        doc = yaml.safe_load(schedule_path(str(order)).read_text())
    except (OSError, yaml.YAMLError):
        return None
    return doc if isinstance(doc, dict) else None


class Narrow(tuple):
    """A wave dealt over a share of the SMs: (name, share) or (name, share,
    rest_after): a claimer wave's other claimers go after wave rest_after."""

    @property
    def name(self) -> str:
        return self[0]

    @property
    def share(self) -> float:
        return self[1]

    @property
    def rest_after(self) -> str | None:
        return self[2] if len(self) > 2 else None


class Placed(tuple):
    """A wave dealt on other waves' SMs: (name, hosts)."""

    @property
    def name(self) -> str:
        return self[0]

    @property
    def hosts(self) -> tuple[str, ...]:
        return self[1]


def _wave_name(w) -> str:
    if isinstance(w, (Placed, Narrow)):
        return w.name
    return w if isinstance(w, str) else "interleave(" + ",".join(w) + ")"


def parse_waves(raw, where: str, expected: tuple[str, ...]) -> list:
    """Validate one wave list: returns [str | tuple(a, b) | Placed]."""
    if not isinstance(raw, list) or not raw:
        raise OrderError(f"{where}: must be a non-empty list of waves")
    out, seen, dealt = [], [], []
    rest_after: list[tuple[int, str, str]] = []  # (index, wave, the later wave its other claimers follow)
    for i, w in enumerate(raw):
        if isinstance(w, str):
            names = [w]
            out.append(w)
        elif isinstance(w, dict) and set(w) == {"interleave"}:
            pair = w["interleave"]
            if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
                raise OrderError(f"{where}[{i}]: interleave takes a list of two wave names")
            names = list(pair)
            out.append(tuple(pair))
        elif isinstance(w, dict) and set(w) == {"wave", "sms_of"}:
            hosts = [w["sms_of"]] if isinstance(w["sms_of"], str) else w["sms_of"]
            if not isinstance(w["wave"], str) or not (isinstance(hosts, list) and hosts
                                                       and all(isinstance(h, str) for h in hosts)):
                raise OrderError(f"{where}[{i}]: a placed wave is {{wave: a, sms_of: b}} or "
                                 f"{{wave: a, sms_of: [b, c]}}")
            for h in hosts:
                if h not in dealt:
                    raise OrderError(f"{where}[{i}]: wave '{w['wave']}' is placed on '{h}', which is not a "
                                     f"wave dealt earlier in this list")
            names = [w["wave"]]
            out.append(Placed((w["wave"], tuple(hosts))))
        elif isinstance(w, dict) and set(w) in ({"wave", "share"}, {"wave", "share", "rest_after"}):
            f = w["share"]
            if not isinstance(w["wave"], str) or isinstance(f, bool) or not isinstance(f, (int, float)) \
                    or not 0 < f <= 1:
                raise OrderError(f"{where}[{i}]: a wave on a share of the SMs is {{wave: a, share: f}} with "
                                 f"0 < f <= 1 (got {w!r})")
            names = [w["wave"]]
            if "rest_after" in w:
                if not isinstance(w["rest_after"], str):
                    raise OrderError(f"{where}[{i}]: rest_after takes one wave name (got {w['rest_after']!r})")
                rest_after.append((i, w["wave"], w["rest_after"]))
                out.append(Narrow((w["wave"], float(f), w["rest_after"])))
            else:
                out.append(Narrow((w["wave"], float(f))))
        else:
            raise OrderError(f"{where}[{i}]: a wave is a node kind, {{interleave: [a, b]}}, "
                             f"{{wave: a, sms_of: b}}, {{wave: a, share: f}} or "
                             f"{{wave: a, share: f, rest_after: b}} (got {w!r})")
        if not isinstance(out[-1], Placed):
            dealt += names
        for n in names:
            if n not in expected:
                raise OrderError(f"{where}[{i}]: unknown wave '{n}' (this layer kind has: {', '.join(expected)})")
            if n in seen:
                raise OrderError(f"{where}[{i}]: wave '{n}' is repeated")
            seen.append(n)
    missing = [n for n in expected if n not in seen]
    if missing:
        raise OrderError(f"{where}: wave(s) {', '.join(missing)} missing")
    for i, name, after in rest_after:
        if after not in seen or seen.index(after) <= seen.index(name):
            raise OrderError(f"{where}[{i}]: wave '{name}' puts its other claimers after '{after}', which is "
                             f"not a wave later in this list")
    return out


def load_order(order: str) -> dict:
    """Parse and validate schedules/<order>.yaml (or a path to a YAML)."""
    path = schedule_path(order)
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in schedules_dir().glob("*.yaml")))
        raise OrderError(f"unknown wave order '{order}' (known: {known})")
    # a bundled order by its file name, one's own by the path it was given
    where = path.name if path.parent == schedules_dir() else str(order)
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise OrderError(f"{where}: invalid YAML: {err}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("layers"), dict):
        raise OrderError(f"{where}: needs a 'layers' mapping of layer kind -> waves")
    unknown = set(doc) - {"name", "layers", "final", "description", "sm_cursor"}
    if unknown:
        raise OrderError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    cursor = doc.get("sm_cursor", SM_CURSORS[0])
    if cursor not in SM_CURSORS:
        raise OrderError(f"{where}: sm_cursor must be one of {', '.join(SM_CURSORS)} (got {cursor!r})")
    layers = {}
    for kind, raw in doc["layers"].items():
        # KIND_full: that kind's full-attention layers (else they take KIND's waves); KIND_split
        # (_split_full): its layers in split_down schedules, KIND_routed (_routed_full) in routed-claim
        # schedules (else they take KIND's, KIND_full's)
        base = kind[: -len(FULL_SUFFIX)] if kind.endswith(FULL_SUFFIX) else kind
        base = next((base[: -len(m)] for m in MODE_SUFFIXES if base.endswith(m)), base)
        if base not in LAYER_KINDS:
            raise OrderError(f"{where}: layers.{kind}: unknown layer kind (known: {', '.join(LAYER_KINDS)}, "
                             f"each also as KIND{FULL_SUFFIX} for its full-attention layers, KIND{SPLIT_SUFFIX} "
                             f"(KIND{SPLIT_SUFFIX}{FULL_SUFFIX}) in schedules that split the down projection, "
                             f"KIND{ROUTED_SUFFIX} (KIND{ROUTED_SUFFIX}{FULL_SUFFIX}) in routed-claim ones)")
        block, ffn = ("sequential", base.split("_", 1)[1]) if base.startswith("sequential_") else ("parallel", base)
        layers[kind] = parse_waves(raw, f"{where}: layers.{kind}", layer_node_kinds(block, ffn))
    final = parse_waves(doc.get("final", ["lm_head"]), f"{where}: final", ("lm_head",))
    return {"name": doc.get("name", path.stem), "layers": layers, "final": final, "path": str(path),
            "sm_cursor": cursor}


def waves_for(layers: dict, kind: str, full: bool, split: bool, routed: bool = False) -> str:
    """The entry of an order's ``layers`` a layer of ``kind`` takes: in a
    split_down schedule KIND_split_full / KIND_split first, then in a
    routed-claim one KIND_routed_full / KIND_routed, then (full attention)
    KIND_full, then KIND."""
    modes = [m for m, on in zip(MODE_SUFFIXES, (split, routed)) if on] + [""]
    names = [kind + m + f for m in modes for f in ((FULL_SUFFIX, "") if full else ("",))]
    return next(n for n in names if n in layers)


def requires(lw: Lowering) -> None:
    if not lw.counters and any(nt.words is None for nt in lw.nodes):
        raise PassError(NAME, "needs dependencies (run depend first)")


def _node_positions(nt, num_sms: int) -> tuple[np.ndarray, np.ndarray]:
    """(task index, claimer ordinal) of a node's entries in the global list."""
    if nt.claimer:
        return np.zeros(num_sms, dtype=np.int64), np.arange(num_sms, dtype=np.int64)
    return np.arange(nt.n, dtype=np.int64), np.full(nt.n, -1, dtype=np.int64)


def run(lw: Lowering) -> str:
    geo = lw.geo
    spec_order = load_order(lw.order_name)
    num_sms = geo.num_sms
    g_node, g_task, g_cl = [], [], []
    waves: dict[str, list[tuple[str, int]]] = {}
    lw.layer_kinds = []
    # the order files name every node kind; one the graph leaves out (top-k
    # or gather inside ROUTE_FINALIZE: geometry's fused_topk / fused_gather;
    # both with routed claims; the combine inside the norm: fused_combine;
    # the down claims inside the up claims: split_down; the attention
    # combine inside the O-projection: o_proj_merge) has no wave
    absent = ({"topk"} if geo.fused_topk else set()) | (
        {"moe_gather"} if geo.fused_gather or geo.routed_claims else set()) | (
        {"moe_combine"} if geo.fused_combine else set()) | ({"moe_down"} if geo.split_down else set()) | (
        {"attn_combine"} if geo.o_proj_merge else set())

    g_host = []
    # per entry: the cursor's advance and the offset from the advanced
    # cursor (a narrow wave's task j >= width goes back to cursor + j mod width)
    g_adv, g_back = [], []
    placed_waves = 0
    count = 0  # entries emitted so far: the next entry's global position

    def emit(wave_list, prefix, key):
        nonlocal count, placed_waves
        record = key not in waves
        rec = []
        where: dict[str, np.ndarray] = {}  # wave part -> global positions of its entries
        # wave name -> the held-back claimers of a split claimer wave that go after it
        rest: dict[str, list[tuple[str, np.ndarray, np.ndarray, np.ndarray]]] = {}

        def push(name, n_, t_, c_, h_, adv, back):
            nonlocal count
            g_node.append(n_)
            g_task.append(t_)
            g_cl.append(c_)
            g_host.append(h_)
            g_adv.append(adv)
            g_back.append(back)
            count += len(n_)
            rec.append((name, int(len(n_))))

        def flush_rest(names):
            for nm in names:
                for label, n_, t_, c_ in rest.pop(nm, []):
                    # they move no cursor: their SMs follow from their node's
                    # first claimer (assign), which the first part holds
                    z = np.zeros(len(n_), dtype=np.int64)
                    push(label, n_, t_, c_, np.full(len(n_), -1, dtype=np.int64), z, z)

        for w in wave_list:
            hosts, width, after = None, None, None
            if isinstance(w, Placed):
                hosts = [where[h] for h in w.hosts if h in where]
                w = w.name
            elif isinstance(w, Narrow):
                width = max(1, min(num_sms, round(w.share * num_sms)))
                after = w.rest_after
                w = w.name
            wave_names = [w] if isinstance(w, str) else list(w)
            parts = [p for p in wave_names if p not in absent]
            if not parts:
                flush_rest(wave_names)
                continue
            if len(parts) == 1 and not isinstance(w, str):
                w = parts[0]
            ents = []
            for kind in parts:
                nt = lw.by_name[f"{prefix}{kind}" if prefix else kind]
                t, c = _node_positions(nt, num_sms)
                ents.append((np.full(len(t), nt.index, dtype=np.int64), t, c))
            held = None
            if len(ents) == 1:
                n_, t_, c_ = ents[0]
                if (c_ < 0).all():  # a claimer wave runs on every SM: it names no SMs
                    where[parts[0]] = count + np.arange(len(n_), dtype=np.int64)
                elif after is not None and width < len(n_):
                    # a claimer wave split: the claimers of the first `width`
                    # SMs here (they name those SMs: a later wave may be placed
                    # on them), the others after wave `after`
                    held = (f"{_wave_name(w)}(rest)", n_[width:], t_[width:], c_[width:])
                    n_, t_, c_ = n_[:width], t_[:width], c_[:width]
                    where[parts[0]] = count + np.arange(len(n_), dtype=np.int64)
            else:
                (na, ta, ca), (nb, tb, cb) = ents
                m = min(len(ta), len(tb))
                # a0 b0 a1 b1 ... then the longer tail
                n_ = np.concatenate([np.stack([na[:m], nb[:m]], 1).ravel(), na[m:], nb[m:]])
                t_ = np.concatenate([np.stack([ta[:m], tb[:m]], 1).ravel(), ta[m:], tb[m:]])
                c_ = np.concatenate([np.stack([ca[:m], cb[:m]], 1).ravel(), ca[m:], cb[m:]])
                pos = count + np.arange(len(n_), dtype=np.int64)
                for p in parts:
                    nt = lw.by_name[f"{prefix}{p}" if prefix else p]
                    if not nt.claimer:
                        where[p] = pos[n_ == nt.index]
            h_ = np.full(len(n_), -1, dtype=np.int64)
            if hosts and (c_ >= 0).any():
                if parts != ["attn"]:
                    raise PassError(NAME, f"wave '{w}' is a claimer wave (one claimer on every SM): it cannot be "
                                          f"placed on other waves' SMs")
                # a full layer's attention is claimed or static by the schedule (geometry
                # full_static): claimed, it runs on every SM and is dealt in place, as its share is
                hosts = None
            if hosts:
                # task j of the placed wave runs where host entry j mod #hosts ran
                hp = np.concatenate(hosts)
                h_ = hp[np.arange(len(n_)) % len(hp)]
                placed_waves += 1
            adv = np.where(h_ < 0, 1, 0).astype(np.int64)
            back = np.zeros(len(n_), dtype=np.int64)
            # a claimer wave (attention claimed by every SM in a long full
            # layer) runs on every SM: its share is moot, it is dealt in place
            if width is not None and (c_ < 0).all():
                j = np.arange(len(n_), dtype=np.int64)
                adv = (j < width).astype(np.int64)
                back = np.where(j < width, 0, j % width - width)
            push(_wave_name(w), n_, t_, c_, h_, adv, back)
            if held is not None:
                rest.setdefault(after, []).append(held)
            flush_rest(wave_names)
        if record:
            waves[key] = rec

    for l in range(geo.num_layers):
        kind = layer_kind(geo.block, geo.ffn[l])
        if kind not in spec_order["layers"]:
            raise PassError(NAME, f"wave order '{spec_order['name']}' has no waves for layer kind "
                                  f"'{kind}' (layer {l})")
        key = f"{kind}:{'sliding' if geo.sliding[l] else 'full'}"
        lw.layer_kinds.append(key)
        emit(spec_order["layers"][waves_for(spec_order["layers"], kind, not geo.sliding[l], geo.split_down,
                                            geo.routed_claims)],
             f"L{l}.", key)
    emit(spec_order["final"], "", "final")
    lw.g_node = np.concatenate(g_node)
    n = len(lw.g_node)
    lw.g_host = np.concatenate(g_host)
    dealt = lw.g_host < 0
    # the cursor counts dealt entries only (a placed wave moves it not; a
    # narrow wave by its width at most)
    adv = np.concatenate(g_adv)
    cursor = np.cumsum(adv) - adv
    if spec_order["sm_cursor"] == "layer":
        # a layer's tasks (the final waves': layer num_layers) are contiguous in the list
        layer = np.array([nt.layer for nt in lw.nodes], dtype=np.int64)[lw.g_node]
        starts = np.flatnonzero(np.r_[True, layer[1:] != layer[:-1]])
        cursor = cursor - np.repeat(cursor[starts], np.diff(np.r_[starts, n]))
    cursor = cursor + np.concatenate(g_back)
    lw.g_cursor = np.where(dealt, cursor, -1)
    lw.g_task = np.concatenate(g_task)
    lw.g_claimer = np.concatenate(g_cl)
    lw.waves = waves
    placed = f", {placed_waves} placed on other waves' SMs" if placed_waves else ""
    return f"'{spec_order['name']}': {len(lw.g_node)} tasks in {sum(len(v) for v in waves.values())} waves " \
           f"over {len(waves)} layer kinds{placed}"


def ensures(lw: Lowering) -> None:
    n = len(lw.g_node)
    expect = sum(lw.geo.num_sms if nt.claimer else nt.n for nt in lw.nodes)
    if n != expect:
        raise PassError(NAME, f"global list has {n} tasks, nodes have {expect}")
    words = lw.global_words().astype(np.int64)
    C = len(lw.counters)
    pos = np.arange(n, dtype=np.int64)
    # last position at which each counter can be signalled
    last = np.full(C, -1, dtype=np.int64)
    sig = words[:, H.SIGNAL]
    m = sig >= 0
    np.maximum.at(last, sig[m], pos[m])
    node_last = np.full(len(lw.nodes), -1, dtype=np.int64)
    node_first = np.full(len(lw.nodes), n, dtype=np.int64)
    np.maximum.at(node_last, lw.g_node, pos)
    np.minimum.at(node_first, lw.g_node, pos)
    group = np.array([lw.nodes[int(ni)].claimer for ni in lw.counter_node], dtype=bool) if C else np.zeros(0, bool)
    # a counter of claimed tasks completes once the queue's first claimer has
    # run: it claims until the queue is drained, and every claimed record's
    # waits are complete before that claimer (checked below), so whoever holds
    # a record finishes it without waiting; later claimers find the queue
    # drained (a split claimer wave's other claimers may follow the waiters)
    last[group] = node_first[lw.counter_node[group]]

    def name(k):
        nt = lw.nodes[int(lw.g_node[k])]
        return f"{nt.name} (global task {k})"

    def producer(c):
        return lw.nodes[int(lw.counter_node[c])].name

    for wc in (H.WAIT0, H.WAIT1):
        c = words[:, wc]
        has = c >= 0
        bad = np.flatnonzero(has & (last[np.where(has, c, 0)] >= pos))
        if len(bad):
            k = int(bad[0])
            cc = int(c[k])
            raise PassError(NAME, f"not topological: {name(k)} waits {lw.counters[cc].name} signalled by "
                                  f"{producer(cc)} at global task {int(last[cc])}")
    # claimed tasks: their wait counters complete before the queue's first claimer
    from megac.access import queue_subtasks
    from megac.abi import Queue
    for nt in lw.nodes:
        if not nt.claimer:
            continue
        op = nt.op
        base = int(nt.words[0, abi.field_index(op, "TASK_WAIT_BASE")])
        if base < 0:
            continue
        offs = np.unique(queue_subtasks(Queue(nt.queue), nt.layer, lw.geo, merged=True).wait_offset)
        first = node_first[nt.index]
        for o in offs:
            cc = base + int(o)
            if last[cc] >= first:
                raise PassError(NAME, f"not topological: claimed tasks of {nt.name} wait {lw.counters[cc].name} "
                                      f"signalled by {producer(cc)} at global task {int(last[cc])}, after the "
                                      f"first claimer at {int(first)}")


__all__ = ["NAME", "ORDERS", "Narrow", "OrderError", "Placed", "ensures", "load_order", "parse_waves",
           "requires", "run", "schedule_path"]
