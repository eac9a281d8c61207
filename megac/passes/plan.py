"""Pass ``plan``: the buffer plan and the weight layouts.

Every launch-descriptor field (``abi.LAUNCH_DESC``) gets a
:class:`~megac.schedule.BufferSpec`: dtype, physical shape, size in bytes,
kind (schedule / control / weight / kv / activation / scratch / scalar),
lifetime (first writer wave, last reader wave, from the access model over the
global list), guarding counters (the counter families its writers signal,
e.g. ``combine[*][*][*]``) and ``reset_per_step``. Only ``counters`` and
``queue_heads`` are reset before each step; every other buffer is written
before it is read within the step (per-layer scratch is never reused) or is
an input the host writes.

Weight layouts (:class:`~megac.schedule.WeightLayout`), so loaders never
hard-code them:

* ``w_qkv [L, qkv_width, hidden]``: rows Q (q_width) | K (kv_width) | V (kv_width);
* ``w_upgate [dense_layers, 2*dense_width, hidden]`` and ``w_moe_upgate
  [moe_layers, experts, 2*expert_width, hidden]``: gate and up rows
  interleaved in chunks of ``bn/2`` (``upgate_bn`` / ``moe_up_bn``): chunk c
  holds gate rows [c*h, c*h+len) then up rows [c*h, c*h+len).
  :func:`gate_up_rows` gives the permutation (``interleaved =
  concat(gate, up)[perm]``);
* experts stacked per MoE layer (``layer_slot`` indexes the dense / MoE stacks).

Ensures: every descriptor field has a spec with a size; buffers written in
the step have a lifetime and guards; the reset list is exactly the buffers
marked ``reset_per_step``.
"""

from __future__ import annotations

import math
import re

import numpy as np

from megac import abi
from megac.abi import H, Queue
from megac.access import access_boxes, group_access
from megac.buffers import step_buffers
from megac.passes import Lowering, PassError
from megac.schedule import BufferPlan, BufferSpec, WeightLayout

NAME = "plan"

DTYPE_BYTES = {"bf16": 2, "fp32": 4, "int32": 4, "uint32": 4, "u64": 8, "argmax": abi.ARGMAX_RECORD_BYTES, "f32": 4,
               "i32": 4}

#: descriptor buffers whose physical name differs from the access model's
_ACCESS_NAME = {"targets": "target_word", "k_pool": "kv_new", "v_pool": "kv_new"}

RESET_PER_STEP = ("counters", "queue_heads")


def gate_up_rows(width: int, bn: int) -> np.ndarray:
    """Row permutation of an interleaved gate/up matrix: row i of the
    interleaved layout is row ``perm[i]`` of ``concat(gate, up)`` (gate rows
    0..width-1, up rows width..2*width-1), chunks of ``bn // 2`` rows."""
    half = bn // 2
    out = []
    for c0 in range(0, width, half):
        c1 = min(width, c0 + half)
        out.append(np.arange(c0, c1))
        out.append(width + np.arange(c0, c1))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def _shapes(lw: Lowering) -> dict[str, tuple[str, tuple, str, str]]:
    """name -> (dtype, shape, kind, doc) for every descriptor field."""
    geo = lw.geo
    L, R, D = geo.num_layers, geo.rows, geo.hidden
    tw = geo.target_words
    n_dense = len(geo.dense_layers)
    n_moe = len(geo.moe_layers)
    bs = lw.spec.target.kv_block_size
    max_blocks = math.ceil(geo.context / bs)
    # worst case: every layer of every row holds its whole span (sliding layers
    # hold the window plus one partially filled block)
    blocks = sum(min(max_blocks, math.ceil(geo.window[l] / bs) + 1) if geo.sliding[l] else max_blocks
                 for l in range(L)) * R
    max_tasks = int(lw.task_counts.max()) if lw.task_counts is not None else int(np.bincount(lw.sm).max())
    out = {
        "tasks": ("int32", (geo.num_sms, max_tasks, abi.TASK_WORDS), "schedule", ""),
        "task_counts": ("int32", (geo.num_sms,), "schedule", ""),
        "counters": ("uint32", (len(lw.counters),), "schedule", ""),
        "targets": ("int32", (tw.total,), "schedule", f"host words 0..{tw.host_words - 1}, device words after"),
        "queue_heads": ("uint32", (len(Queue), L), "schedule", ""),
        "attn_queue": ("int32", (geo.attn_queue_cap, abi.QUEUE_RECORD_WORDS), "schedule", "host-written"),
        "moe_up_queue": ("int32", (L, geo.moe_queue_cap, abi.QUEUE_RECORD_WORDS), "schedule", "ROUTE_FINALIZE"),
        "moe_down_queue": ("int32", (L, geo.moe_queue_cap, abi.QUEUE_RECORD_WORDS), "schedule", "ROUTE_FINALIZE"),
        "status": ("int32", (getattr(abi, "STATUS_WORDS", 16),), "control",
                   "watchdog status (abort word + error record), zeroed by the host per launch"),
        "progress": ("int32", (geo.num_sms,), "control", "each CTA's current task index (watchdog report)"),
        "w_embed": ("bf16", (geo.vocab, D), "weight", ""),
        "w_lm_head": ("bf16", (geo.vocab, D), "weight", "= w_embed when tied" if lw.spec.tie_embeddings else ""),
        "w_norm": ("bf16", (geo.norm_slots, D), "weight", "GAMMA index"),
        "w_qkv": ("bf16", (L, geo.qkv_width, D), "weight", ""),
        "w_o": ("bf16", (L, D, geo.q_width), "weight", ""),
        "w_upgate": ("bf16", (n_dense, 2 * geo.dense_width, D), "weight", ""),
        "w_down": ("bf16", (n_dense, D, geo.dense_width), "weight", ""),
        "w_router": ("bf16", (n_moe, geo.num_experts, D), "weight", ""),
        "w_moe_upgate": ("bf16", (n_moe, geo.num_experts, 2 * geo.expert_width, D), "weight", ""),
        "w_moe_down": ("bf16", (n_moe, geo.num_experts, D, geo.expert_width), "weight", ""),
        "layer_slot": ("int32", (L,), "weight", "index in the dense / MoE weight stack"),
        "rope_inv_freq": ("fp32", (geo.head_dim // 2,), "weight", ""),
        "k_pool": ("bf16", (blocks, bs, geo.kv_heads, geo.head_dim), "kv", "worst case for this key"),
        "v_pool": ("bf16", (blocks, bs, geo.kv_heads, geo.head_dim), "kv", "worst case for this key"),
        "page_table": ("int32", (L, R, max_blocks), "kv", ""),
        "seq_pos": ("int32", (R,), "kv", ""),
        "row_active": ("int32", (R,), "kv", ""),
        "kv_tmaps": ("int32", (2, 32), "kv", "filled by the GPU backend from the pools; unused by the VM"),
    }
    out.update(step_buffers(geo))
    for f in abi.LAUNCH_DESC:
        if f.name not in out:
            if f.ctype == "ptr":
                raise PassError(NAME, f"descriptor pointer {f.name} has no buffer plan")
            out[f.name] = (f.ctype, (), "scalar", f.doc)
    return out


def _family(name: str) -> str:
    return re.sub(r"\[\d+\]", "[*]", name)


def _lifetimes(lw: Lowering) -> dict[str, dict]:
    """Per access-model buffer: first write / last read positions and the
    counters its writers signal."""
    geo = lw.geo
    words = lw.global_words()
    info: dict[str, dict] = {}

    def note(buf, pos, write, sig):
        d = info.setdefault(buf, {"first_w": None, "last_r": None, "sigs": set()})
        if write:
            d["first_w"] = pos if d["first_w"] is None else min(d["first_w"], pos)
            d["sigs"].update(sig)
        else:
            d["last_r"] = pos if d["last_r"] is None else max(d["last_r"], pos)

    sig = words[:, H.SIGNAL]
    for b in access_boxes(words, geo):
        if b.write:
            note(b.buffer, int(b.task.min()), True, set(np.unique(sig[b.task]).tolist()) - {-1})
        else:
            note(b.buffer, int(b.task.max()), False, ())
    for nt in lw.nodes:
        if not nt.claimer:
            continue
        pos = np.flatnonzero(lw.g_node == nt.index)
        ga = group_access(Queue(nt.queue), nt.layer, geo, nt.words[0])
        sigs = {c for c, _ in ga.signals}
        for r in ga.writes:
            note(r.buffer, int(pos.min()), True, sigs)
        for r in ga.reads:
            note(r.buffer, int(pos.max()), False, ())
    return info


def requires(lw: Lowering) -> None:
    if lw.sm is None:
        raise PassError(NAME, "needs SM assignment (run assign first)")


def run(lw: Lowering) -> str:
    geo = lw.geo
    shapes = _shapes(lw)
    life = _lifetimes(lw)

    def wave(pos):
        return lw.nodes[int(lw.g_node[pos])].name

    buffers: dict[str, BufferSpec] = {}
    for f in abi.LAUNCH_DESC:
        dtype, shape, kind, doc = shapes[f.name]
        nbytes = DTYPE_BYTES[dtype] * int(np.prod(shape)) if shape else DTYPE_BYTES[dtype]
        spec = BufferSpec(f.name, dtype, tuple(int(x) for x in shape), int(nbytes), kind,
                          reset_per_step=f.name in RESET_PER_STEP, doc=doc or f.doc)
        li = life.get(_ACCESS_NAME.get(f.name, f.name))
        if li is not None and li["first_w"] is not None:
            last = li["last_r"] if li["last_r"] is not None else li["first_w"]
            spec.lifetime = (wave(li["first_w"]), wave(last))
            spec.guards = sorted({_family(lw.counters[c].name) for c in li["sigs"]})
        if nbytes == 0:
            spec.doc = (spec.doc + "; " if spec.doc else "") + "unused by this model"
        buffers[f.name] = spec
    weights = _weight_layouts(geo)
    lw.plan = BufferPlan(buffers=buffers, weights=weights, reset=list(RESET_PER_STEP))
    scratch = sum(b.nbytes for b in buffers.values() if b.kind in ("activation", "scratch"))
    w = sum(b.nbytes for b in buffers.values() if b.kind == "weight" and b.name != "w_lm_head")
    return f"{len(buffers)} descriptor fields, scratch {scratch / 2**20:.1f} MiB, weights {w / 2**30:.2f} GiB, " \
           f"reset {'+'.join(RESET_PER_STEP)}"


def _weight_layouts(geo) -> dict[str, WeightLayout]:
    L, D = geo.num_layers, geo.hidden
    out = {
        "w_qkv": WeightLayout("w_qkv", (L, geo.qkv_width, D), "bf16", "fused rows Q | K | V", [
            {"part": "q", "rows": [0, geo.q_width]},
            {"part": "k", "rows": [geo.q_width, geo.q_width + geo.kv_width]},
            {"part": "v", "rows": [geo.q_width + geo.kv_width, geo.qkv_width]},
        ]),
        "w_o": WeightLayout("w_o", (L, D, geo.q_width), "bf16", "[out, in] as in the checkpoint"),
        "w_norm": WeightLayout("w_norm", (geo.norm_slots, D), "bf16",
                               "slot l: input norm of layer l; L+l: post-attention norm of a sequential "
                               "layer l; 2L: final norm"),
    }
    if geo.dense_width:
        n = len(geo.dense_layers)
        out["w_upgate"] = WeightLayout(
            "w_upgate", (n, 2 * geo.dense_width, D), "bf16",
            f"gate/up interleaved in chunks of {geo.upgate_bn // 2} rows (gate chunk, then up chunk)",
            [{"chunk_rows": geo.upgate_bn // 2, "order": ["gate", "up"], "stack": "dense layers (layer_slot)"}])
        out["w_down"] = WeightLayout("w_down", (n, D, geo.dense_width), "bf16", "[out, in], stacked by layer_slot")
    if geo.num_experts:
        n = len(geo.moe_layers)
        out["w_router"] = WeightLayout("w_router", (n, geo.num_experts, D), "bf16", "stacked by layer_slot")
        out["w_moe_upgate"] = WeightLayout(
            "w_moe_upgate", (n, geo.num_experts, 2 * geo.expert_width, D), "bf16",
            f"experts stacked; gate/up interleaved in chunks of {geo.moe_chunk} rows",
            [{"chunk_rows": geo.moe_chunk, "order": ["gate", "up"], "stack": "moe layers (layer_slot), experts"}])
        out["w_moe_down"] = WeightLayout("w_moe_down", (n, geo.num_experts, D, geo.expert_width), "bf16",
                                         "experts stacked, [out, in]")
    return out


def ensures(lw: Lowering) -> None:
    plan = lw.plan
    for f in abi.LAUNCH_DESC:
        b = plan.buffers.get(f.name)
        if b is None:
            raise PassError(NAME, f"descriptor field {f.name} has no plan")
        if b.nbytes < 0:
            raise PassError(NAME, f"{f.name}: negative size")
    # attn_out: not with o_proj_merge (the O-projection merges the partials itself)
    written = ("x_norm", "q", "attn_o_part", "o_part", "logits") + (() if lw.geo.o_proj_merge else ("attn_out",))
    for name in written:
        b = plan.buffers[name]
        # logits are read by the host after the kernel: nothing inside waits on them
        if b.lifetime is None or (not b.guards and name != "logits"):
            raise PassError(NAME, f"{name}: written in the step but has no lifetime / guards")
    if sorted(plan.reset) != sorted(n for n, b in plan.buffers.items() if b.reset_per_step):
        raise PassError(NAME, "reset list disagrees with reset_per_step")


__all__ = ["NAME", "RESET_PER_STEP", "ensures", "gate_up_rows", "requires", "run"]
