"""The VM's checked mode: SM queues interleaved (round robin and seeded random),
counters simulated, happens-before tracked per buffer element.

Correct schedules agree bit for bit with fast mode in every interleaving;
schedules broken on purpose (task words edited) are caught with the right
exception: a raised target or a consumer moved before its producer deadlocks,
a removed wait reads early, a redirected write races."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from megac import abi
from megac.abi import H, Op
from megac.kv import PagedKVCache
from megac.ops import REGISTRY
from megac.passes.pipeline import compile_one
from megac.prefill import prefill
from megac.spec import load_spec
from megac.vm import (
    BadTaskError,
    DeadlockError,
    DecodeStep,
    DeviceState,
    EarlyReadError,
    HazardError,
    OverwriteError,
    VMWeights,
)
from megac.weights import random_weights
from engines import run

NUM_SMS = 8  # deep SM queues: many tasks per SM, so interleavings differ a lot


def _spec(name: str):
    from models import variant

    base = load_spec(name, target_overrides={"num_sms": NUM_SMS})
    return variant(base, f"{name}-untied", tie_embeddings=False)


_SETUP: dict = {}


def _setup(name: str, order: str, rows: int, lengths):
    key = (name, order, rows, tuple(lengths))
    if key not in _SETUP:
        spec = _spec(name)
        w = random_weights(spec, seed=7)
        sched = compile_one(spec, order, rows=rows, context=128)
        vmw = VMWeights.from_weights(w, spec, sched.geometry)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for n in lengths]
        kv = PagedKVCache(spec, max_rows=len(prompts), num_blocks=300, dtype=torch.float32)
        kv_rows, lg = prefill(w, spec, kv, prompts)
        _SETUP[key] = (spec, sched, vmw, kv, kv_rows, lg.argmax(-1).tolist())
    return _SETUP[key]


def _run(sched, vmw, kv, kv_rows, tokens, steps, **kw):
    """``steps`` decode steps on a copy of ``kv``; logits per step and the cache."""
    kv = copy.deepcopy(kv)
    step = DecodeStep(DeviceState(sched, vmw), **kw)
    out = []
    toks = list(tokens)
    for _ in range(steps):
        lg = step(kv, kv_rows, toks)
        out.append(lg)
        toks = lg.argmax(-1).tolist()
    return out, kv


@pytest.mark.parametrize("name,order", [("tiny-moe", "tuned"), ("tiny-moe", "interleaved"),
                                        ("tiny-moe", "attention-first"), ("tiny-llama", "tuned")])
def test_interleavings_agree_bit_for_bit_with_fast(name, order):
    spec, sched, vmw, kv, rows, toks = _setup(name, order, 4, (3, 37, 12))
    fast, kv_fast = _run(sched, vmw, kv, rows, toks, 3, mode="fast")
    for policy, seed in (("round_robin", 0), ("random", 1), ("random", 2), ("random", 3)):
        got, kv_got = _run(sched, vmw, kv, rows, toks, 3, mode="checked", policy=policy, seed=seed)
        for a, b in zip(fast, got):
            assert torch.equal(a, b), (policy, seed)
        assert torch.equal(kv_fast.k_pool, kv_got.k_pool) and torch.equal(kv_fast.v_pool, kv_got.v_pool)


def test_checked_engine_matches_fast_engine():
    spec = _spec("tiny-moe")
    w = random_weights(spec, seed=3)
    from megac.passes.pipeline import compile_schedules

    comp = compile_schedules(spec, order="tuned", batch_sizes=[1, 2], buckets=[128])
    prompts = [[5, 6, 7, 8], [9] * 20]
    fast = run(spec, w, comp, prompts, max_tokens=4, eos_token_ids=[], return_logits=True)
    chk = run(spec, w, comp, prompts, mode="checked", policy="random", vm_seed=11, max_tokens=4, eos_token_ids=[],
              return_logits=True)
    for a, b in zip(fast, chk):
        assert a.tokens == b.tokens
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


# --------------------------------------------------------------------------- broken schedules
def _broken():
    return _setup("tiny-moe", "tuned", 2, (3, 12))


def _check(sched, policy="round_robin", seed=0):
    _, base, vmw, kv, rows, toks = _broken()
    _run(sched, vmw, kv, rows, toks, 1, mode="checked", policy=policy, seed=seed)


def _edit(sched, tasks):
    return dataclasses.replace(sched, tasks=tasks)


def _first(tasks, counts, cond):
    for s in range(tasks.shape[0]):
        for j in range(int(counts[s])):
            if cond(tasks[s, j]):
                return s, j
    raise AssertionError("no such task")


def test_correct_schedule_passes():
    _, sched, *_ = _broken()
    for policy, seed in (("round_robin", 0), ("random", 5)):
        _check(sched, policy, seed)


def test_raised_target_deadlocks():
    _, sched, *_ = _broken()
    t = sched.tasks.copy()
    s, j = _first(t, sched.task_counts, lambda w: w[H.OPCODE] == Op.O_PROJ and w[H.WAIT0] >= 0)
    c = int(t[s, j, H.WAIT0])
    t[s, j, H.TARGET0] += 1
    with pytest.raises(DeadlockError) as ei:
        _check(_edit(sched, t))
    e = ei.value
    assert (e.sm, e.slot, e.counter) == (s, j, c) and e.opcode == Op.O_PROJ
    assert sched.counters[c].name in str(e) and "every producer has run" in str(e)
    assert any(b["sm"] == s and b["counter"] == c for b in e.blocked)


def test_lowered_target_is_refused():
    """A target one below its counter's signal count would let a consumer run
    before its last producer; happens-before through counters assumes exact
    targets, so checked mode refuses the schedule before running it."""
    _, sched, *_ = _broken()
    t = sched.tasks.copy()
    s, j = _first(t, sched.task_counts,
                  lambda w: w[H.WAIT0] >= 0 and not abi.is_dyn(int(w[H.TARGET0])) and w[H.TARGET0] > 1)
    t[s, j, H.TARGET0] -= 1
    with pytest.raises(HazardError, match=r"needs exact targets: .* fires before all producers"):
        _check(_edit(sched, t))


@pytest.mark.parametrize("policy,seed", [("round_robin", 0), ("random", 1), ("random", 2), ("random", 3)])
def test_removed_wait_reads_early(policy, seed):
    _, sched, *_ = _broken()
    t = sched.tasks.copy()
    s, j = _first(t, sched.task_counts, lambda w: w[H.OPCODE] == Op.O_PROJ and w[H.LAYER] == 1)
    t[s, j, H.WAIT0], t[s, j, H.TARGET0] = -1, 0
    with pytest.raises(EarlyReadError) as ei:
        _check(_edit(sched, t), policy, seed)
    e = ei.value
    assert (e.sm, e.slot, e.buffer, e.layer) == (s, j, "attn_out", 1)


def test_consumer_moved_before_its_producer_deadlocks():
    """A consumer moved ahead of its producer on the same SM: that SM blocks on
    it, and every other SM ends up waiting on work behind it."""
    _, sched, *_ = _broken()
    t = sched.tasks.copy()
    found = None
    for s in range(t.shape[0]):
        for j in range(int(sched.task_counts[s])):
            c = int(t[s, j, H.WAIT0])
            prod = [i for i in range(j) if int(t[s, i, H.SIGNAL]) == c] if c >= 0 else []
            if prod and int(t[s, j, H.OPCODE]) not in abi.CLAIMERS:
                found = (s, prod[-1], j)
                break
        if found:
            break
    s, i, j = found
    row = t[s, j].copy()
    t[s, i + 1: j + 1] = t[s, i:j].copy()
    t[s, i] = row
    with pytest.raises(DeadlockError) as ei:
        _check(_edit(sched, t), "random", 4)
    e = ei.value
    assert len(e.blocked) > 1  # a cross-SM wait cycle, not one stuck task
    stuck = {b["sm"]: b for b in e.blocked}
    assert stuck[s]["slot"] == i and stuck[s]["opcode"] == Op(int(row[H.OPCODE])).name
    assert any(f"SM {s} slot {i + 1}" in m for m in stuck[s]["missing"])


def test_claimed_tasks_without_their_wait_read_early():
    _, sched, *_ = _broken()
    t = sched.tasks.copy()
    col = abi.field_index(Op.ATTN_DRAIN, "TASK_WAIT_BASE")
    m = t[:, :, H.OPCODE] == Op.ATTN_DRAIN
    t[m, col] = -1
    with pytest.raises(EarlyReadError) as ei:
        _check(_edit(sched, t))
    assert ei.value.buffer in ("q", "k_pool", "v_pool") and ei.value.opcode == Op.ATTN_DRAIN


def test_dynamic_target_read_before_any_wait():
    """A device-written target word in TARGET0 is read before the task waits
    on anything: no counter can order its writer (ROUTE_FINALIZE) first."""
    _, sched, *_ = _broken()
    t = sched.tasks.copy()
    s, j = _first(t, sched.task_counts, lambda w: w[H.OPCODE] == Op.MOE_COMBINE)
    w = t[s, j]
    assert abi.is_dyn(int(w[H.TARGET1]))
    w[[H.WAIT0, H.TARGET0, H.WAIT1, H.TARGET1]] = w[[H.WAIT1, H.TARGET1, H.WAIT0, H.TARGET0]].copy()
    with pytest.raises(EarlyReadError) as ei:
        _check(_edit(sched, t))
    assert ei.value.buffer == "targets" and (ei.value.sm, ei.value.slot) == (s, j)


def test_redirected_write_races():
    """An attention split redirected to another row's partial slot: unordered
    with that row's own split writer and its combine (write-after-write /
    write-after-read), whatever the interleaving."""
    _, sched, *_ = _broken()
    t = sched.tasks.copy()
    row_col = abi.field_index(Op.ATTN_DECODE, "ROW")
    s, j = _first(t, sched.task_counts, lambda w: w[H.OPCODE] == Op.ATTN_DECODE and w[row_col] == 1)
    t[s, j, row_col] = 0
    kinds = set()
    for policy, seed in (("round_robin", 0), ("random", 1), ("random", 2), ("random", 3), ("random", 4)):
        with pytest.raises(HazardError) as ei:
            _check(_edit(sched, t), policy, seed)
        kinds.add(type(ei.value))
        assert ei.value.buffer in ("attn_o_part", "attn_lse_part")
    assert OverwriteError in kinds


def test_bad_fields_are_refused():
    _, sched, *_ = _broken()
    t = sched.tasks.copy()
    s, j = _first(t, sched.task_counts, lambda w: w[H.OPCODE] == Op.LM_HEAD)
    t[s, j, abi.field_index(Op.LM_HEAD, "N_LEN")] = sched.geometry.vocab + 1
    with pytest.raises(BadTaskError) as ei:
        _check(_edit(sched, t))
    assert (ei.value.sm, ei.value.slot, ei.value.opcode) == (s, j, Op.LM_HEAD)
    assert str(ei.value).startswith(f"SM {s} slot {j} LM_HEAD")
    t = sched.tasks.copy()
    t[s, j, H.WAIT0] = sched.num_counters + 5
    with pytest.raises(BadTaskError):
        _check(_edit(sched, t))


def test_poison_and_tracking_cover_scratch():
    """After a checked step nothing the LM head read is NaN, and the tracker saw
    every scratch buffer the schedule writes."""
    spec, sched, vmw, kv, rows, toks = _broken()
    step = DecodeStep(DeviceState(sched, vmw), mode="checked")
    lg = step(copy.deepcopy(kv), rows, toks)
    assert not torch.isnan(lg).any()
    run = step.last_run
    written = {n for n, t in run.tracker.bufs.items() if (t.lastw >= 0).any()}
    for name in ("x_resid", "x_norm", "q", "attn_o_part", "attn_lse_part", "attn_out", "o_part", "ffn_act",
                 "ffn_part", "router_part", "topk_ids", "topk_w", "route_slot", "moe_x", "moe_act", "moe_out",
                 "logits", "argmax_part", "k_pool", "v_pool", "moe_up_queue", "moe_down_queue", "targets"):
        assert name in written, name
    # every event's happens-before set came from counters only: the first
    # task of every SM (no waits) knows no other event
    first = [e for e in run.events if e.slot == 0 and e.note == ""]
    assert first and all(e.signal >= -1 for e in first)
    # the final argmax records give the greedy tokens of the logits
    tokens, _ = abi.argmax_reduce(step.st["argmax_part"][: len(rows)])
    assert np.array_equal(tokens, step.st["logits"][: len(rows)].argmax(1).numpy())
    assert np.all(step.st.np["row_active"][: len(rows)] == 1)


# --------------------------------------------------------------------------- the access model
#: reads the VM (and the device's combine_row) makes that megac.access does not
#: declare: MOE_COMBINE needs the row's slots to find its experts' outputs. It
#: is ordered anyway (MOE_COMBINE waits on ROUTE_FINALIZE for its dynamic
#: target), but the access model should list it.

#: buffers whose physical layout is the access model's logical one
_SAME_LAYOUT = ("x_resid", "x_norm", "q", "attn_o_part", "attn_lse_part", "attn_out", "o_part", "ffn_act",
                "ffn_part", "router_part", "topk_ids", "topk_w", "route_slot", "logits", "argmax_part", "targets")


def _box(index, shape):
    index = index if isinstance(index, tuple) else (index,)
    lo, hi = [], []
    for d, n in enumerate(shape):
        x = index[d] if d < len(index) else slice(None)
        if isinstance(x, slice):
            a, b, _ = x.indices(n)
            lo.append(a)
            hi.append(b)
        elif isinstance(x, np.ndarray):
            lo.append(int(x.min()))
            hi.append(int(x.max()) + 1)
        else:
            lo.append(int(x))
            hi.append(int(x) + 1)
    return np.array(lo), np.array(hi)


@pytest.mark.parametrize("name,order", [("tiny-moe", "interleaved"), ("tiny-llama", "tuned")])
def test_accesses_lie_inside_the_access_model(name, order):
    """Every region a task (or a claimed attention split) reads or writes in the
    VM lies inside a region ``megac.access`` declares for it (the model the
    compiler derives counters from)."""
    from megac.access import access_boxes, logical_shapes, queue_subtasks, subtask_boxes
    from megac.vm.interp import CheckedRun

    spec, sched, vmw, kv, rows, toks = _setup(name, order, 4, (3, 37, 12))
    geo = sched.geometry
    step = DecodeStep(DeviceState(sched, vmw), mode="checked")
    kv = copy.deepcopy(kv)
    pos = step.load_rows(kv, rows)
    step.st.poison()
    step.seed_rows(toks)
    step.st.reset()
    step.host_words(pos)
    step.interp.ops.begin_step()
    run = CheckedRun(step.interp, "random", 9)
    log = []
    tr = run.tracker
    r0, w0 = tr.read, tr.write
    tr.read = lambda n, i: (log.append((run.cur_ev, n, i, False)), r0(n, i))[1]
    tr.write = lambda n, i: (log.append((run.cur_ev, n, i, True)), w0(n, i))[1]
    run.run()
    shapes = logical_shapes(geo)
    subs = {}
    checked = {}
    for ev, name_, index, write in log:
        e = run.events[ev]
        w = sched.tasks[e.sm, e.slot]
        op = REGISTRY[Op(int(w[H.OPCODE]))]
        if e.note:  # a claimed record: compare with its queue's subtask
            if name_ == "targets" or name_ == getattr(op, "queue_buffer", None):
                continue  # the claimer's own cursor / record reads: checked with the claimer task
            if (op.queue, e.layer) not in subs:
                subs[op.queue, e.layer] = subtask_boxes(queue_subtasks(op.queue, e.layer, geo), geo)
            boxes = subs[op.queue, e.layer]
        else:
            boxes = access_boxes(w[None, :], geo)
        for lname, lo, hi in _logical(name_, index, shapes, step.st, geo):
            ok = any(b.buffer == lname and b.write == write and
                     ((b.lo <= lo) & (hi <= b.hi)).all(axis=1).any() for b in boxes)
            assert ok, (f"{e.describe(sched)} {'writes' if write else 'reads'} {name_}{index} = "
                        f"{lname}{list(zip(lo, hi))} outside the model")
            checked[lname] = checked.get(lname, 0) + 1
    # every buffer kind is covered: the MoE buffers and queues (tiny-moe), the KV pools
    want = set(_SAME_LAYOUT) - {"targets", "route_slot", "topk_ids", "topk_w", "router_part"} | {"target_word", "kv_new",
                                                                                               "attn_queue"}
    if geo.num_experts:
        want |= {"moe_x", "moe_act", "moe_out", "moe_up_queue", "moe_down_queue", "route_slot", "topk_ids",
                 "topk_w", "router_part"}
    assert want <= set(checked), want - set(checked)
    assert sum(checked.values()) > 200


def _values(x, n) -> np.ndarray:
    if isinstance(x, slice):
        return np.arange(*x.indices(n))
    return np.atleast_1d(np.asarray(x, dtype=np.int64)).ravel()


def _logical(name, index, shapes, st, geo):
    """The logical regions (access-model coordinates) of one VM access:
    identity for same-layout buffers; the KV pools through the page table to
    ``kv_new`` (layer, row, K or V columns of the head: the current token
    written, any token up to it read); the MoE slot buffers through
    ``route_slot`` / ``topk_ids`` to (layer, expert, row, k); a queue to its layer."""
    index = index if isinstance(index, tuple) else (index,)
    if name in _SAME_LAYOUT:
        lname = "target_word" if name == "targets" else name
        return [(lname, *_box(index, shapes[lname]))]
    if name == "attn_queue":  # one logical word: the queue
        return [(name, np.array([0]), np.array([1]))]
    if name in ("moe_up_queue", "moe_down_queue"):
        layer = int(index[0])
        return [(name, np.array([layer]), np.array([layer + 1]))]
    if name in ("k_pool", "v_pool"):
        pt, pos, bs, hd = st.np["page_table"], st.np["seq_pos"], st.block_size, geo.head_dim
        pool = st[name]
        blk, off = np.broadcast_arrays(_values(index[0], pool.shape[0]), _values(index[1], bs))
        heads = _values(index[2] if len(index) > 2 else slice(None), pool.shape[2])
        base = 0 if name == "k_pool" else geo.kv_width
        out = []
        for b, o in zip(blk.tolist(), off.tolist()):
            where = np.argwhere(pt == b)  # (layer, row, block index): the pool block's one owner
            assert len(where) == 1, f"{name} block {b} has {len(where)} owners"
            layer, row, bi = (int(v) for v in where[0])
            p = bi * bs + o
            assert p <= int(pos[row]), f"{name}: row {row} layer {layer} position {p} beyond the current token"
            for h in heads.tolist():
                out.append(("kv_new", np.array([layer, row, base + h * hd]),
                            np.array([layer + 1, row + 1, base + (h + 1) * hd])))
        return out
    if name in ("moe_x", "moe_act", "moe_out"):
        layer = int(index[0])
        slots = _values(index[1], st[name].shape[1])
        rs = st.np["route_slot"][layer]  # [R, K]
        ids = st.np["topk_ids"][layer]
        width = shapes[name][-1]
        cols = _values(index[2] if len(index) > 2 else slice(None), width)
        out = []
        for sl in slots.tolist():
            where = np.argwhere(rs == sl)
            assert len(where) == 1, f"{name} slot {sl} of layer {layer} routed {len(where)} times"
            r, k = (int(v) for v in where[0])
            ex = int(ids[r, k])
            out.append((name, np.array([layer, ex, r, k, int(cols.min())]),
                        np.array([layer + 1, ex + 1, r + 1, k + 1, int(cols.max()) + 1])))
        return out
    raise AssertionError(f"the VM accessed {name}, which the containment check does not map")


def test_fast_mode_order_check():
    """Fast mode trusts the global order; with check_order it keeps the
    counters and refuses an order that runs a task before its producers."""
    spec, sched, vmw, kv, rows, toks = _setup("tiny-moe", "interleaved", 4, (3, 37, 12))
    plain, _ = _run(sched, vmw, kv, rows, toks, 2, mode="fast")
    chk, _ = _run(sched, vmw, kv, rows, toks, 2, mode="fast", check_order=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, chk))
    # swap the global positions of a QKV tile and the first attention claimer after it
    go = sched.global_order.copy()
    words = sched.global_words()
    k = int(np.flatnonzero(words[:, H.OPCODE] == Op.QKV_PROJ)[0])
    j = int(np.flatnonzero(words[:, H.OPCODE] == Op.ATTN_DRAIN)[0])
    go[[k, j]] = go[[j, k]]
    bad = dataclasses.replace(sched, global_order=go)
    from megac.vm import VMError

    with pytest.raises(VMError, match="not topological"):
        _run(bad, vmw, kv, rows, toks, 1, mode="fast", check_order=True)
