"""The verifier: real schedules verify; hand-broken copies are rejected with
the specific violation kind (so a verifier that rejects everything fails).

Two sources of schedules:

* ``handmade``: tiny-llama lowered word by word in this file, without any
  compiler pass, so the verifier is tested independently of what it checks;
* the compiler pipeline (``megac.passes.pipeline``) for tiny-moe, tiny-llama
  and North Mini Code at batch 1 and 8.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest

from megac import abi
from megac.abi import H, Op
from megac.geometry import Geometry
from megac.passes import verify as V
from megac.passes.boxjoin import box_pairs
from megac.spec import load_spec

F = abi.field_index


# ==========================================================================
# a schedule built by hand
# ==========================================================================
class _Builder:
    def __init__(self) -> None:
        self.tasks: list[np.ndarray] = []
        self.num_counters = 0
        self.names: list[str] = []

    def counter(self, name: str, n: int = 1) -> int:
        base = self.num_counters
        self.num_counters += n
        self.names += [f"{name}[{i}]" if n > 1 else name for i in range(n)]
        return base

    def task(self, op: Op, layer: int, waits=(), signal: int = -1, flags: int = 0, **fields) -> None:
        w = np.zeros(abi.TASK_WORDS, dtype=np.int32)
        w[H.OPCODE], w[H.LAYER] = op, layer
        w[H.WAIT0] = w[H.WAIT1] = -1
        for k, (c, t) in enumerate(waits):
            w[H.WAIT0 + 2 * k], w[H.TARGET0 + 2 * k] = c, t
        w[H.SIGNAL], w[H.FLAGS] = signal, flags
        for name, v in fields.items():
            w[F(op, name)] = v
        self.tasks.append(w)


def build_handmade(rows: int = 2, num_sms: int = 4, context: int = 64):
    """tiny-llama (sequential blocks, full attention drained by ATTN_DRAIN
    claimers) as a Schedule-like namespace: tasks in a topological order,
    dealt round-robin to ``num_sms`` SMs."""
    geo = Geometry.from_spec(load_spec("tiny-llama"), rows, context)
    L, D, kvh, hd, hpk = geo.num_layers, geo.hidden, geo.kv_heads, geo.head_dim, geo.heads_per_kv
    tw = geo.target_words
    b = _Builder()
    prev_norm = None  # layer 0 reads the seeded x_norm[0]
    for l in range(L):
        qkv = b.counter(f"L{l}.qkv", kvh)
        split = b.counter(f"L{l}.attn_split", rows * kvh)
        attn = b.counter(f"L{l}.attn", kvh)
        oproj = b.counter(f"L{l}.o_proj")
        na = b.counter(f"L{l}.norm_attn")
        up = b.counter(f"L{l}.ffn_upgate", geo.ffn_splits)
        down = b.counter(f"L{l}.ffn_down")
        norm = b.counter(f"L{l}.norm")
        wait_in = [(prev_norm, rows)] if prev_norm is not None else []
        for h in range(kvh):  # per kv head: its query heads, its K, its V
            for part, n0, nl in ((abi.QkvPart.Q, h * hpk * hd, hpk * hd), (abi.QkvPart.K, geo.q_width + h * hd, hd),
                                 (abi.QkvPart.V, geo.q_width + geo.kv_width + h * hd, hd)):
                b.task(Op.QKV_PROJ, l, wait_in, qkv + h, flags=abi.Flag.ROPE | abi.Flag.ROPE_HALF,
                       N0=n0, N_LEN=nl, K0=0, K_LEN=D, SPLIT=0, PART=part, HEAD=h)
        for _ in range(num_sms):
            b.task(Op.ATTN_DRAIN, l, (), -1, QUEUE=abi.Queue.ATTN, QUEUE_LEN=abi.dyn(tw.attn_queue_len),
                   TASK_WAIT_BASE=qkv, TASK_WAIT_TARGET=3, TASK_SIGNAL_BASE=split, WINDOW=0)
        for r in range(rows):
            for h in range(kvh):
                ns = abi.dyn(tw.attn_splits_full(r))
                b.task(Op.ATTN_COMBINE, l, [(split + r * kvh + h, ns)], attn + h, ROW=r, KV_HEAD=h, NUM_SPLITS=ns)
        for sp in range(kvh):  # O-proj split s = KV head s's query heads
            b.task(Op.O_PROJ, l, [(attn + sp, rows)], oproj, N0=0, N_LEN=D, K0=sp * hpk * hd, K_LEN=hpk * hd, SPLIT=sp)
        for r in range(rows):
            b.task(Op.ADD_RMSNORM, l, [(oproj, kvh)], na, flags=abi.Flag.ADD_ATTN, ROW=r, ATTN_SPLITS=kvh,
                   FFN_SPLITS=0, GAMMA=L + l, RESID_IN=l)
        half, bounds = geo.upgate_bn // 2, geo.ffn_split_bounds
        split_of = [next(i for i in range(geo.ffn_splits) if bounds[i] <= t * half < bounds[i + 1])
                    for t in range(geo.upgate_col_tiles)]
        for t, sp in enumerate(split_of):
            b.task(Op.FFN_UPGATE_ACT, l, [(na, rows)], up + sp, N0=t * geo.upgate_bn, N_LEN=geo.upgate_bn,
                   K0=0, K_LEN=D, SPLIT=0, OUT0=t * half, X_SLOT=L + l)
        n_down = 0
        for sp in range(geo.ffn_splits):
            for n0 in range(0, D, geo.down_bn):
                b.task(Op.FFN_DOWN, l, [(up + sp, split_of.count(sp))], down, N0=n0, N_LEN=min(geo.down_bn, D - n0),
                       K0=bounds[sp], K_LEN=bounds[sp + 1] - bounds[sp], SPLIT=sp)
                n_down += 1
        last = l == L - 1
        for r in range(rows):
            b.task(Op.ADD_RMSNORM, l, [(down, n_down)], norm,
                   flags=abi.Flag.ADD_FFN | (abi.Flag.LAST_LAYER if last else 0), ROW=r, ATTN_SPLITS=0,
                   FFN_SPLITS=geo.ffn_splits, GAMMA=2 * L if last else l + 1, RESID_IN=L + l)
        prev_norm = norm
    for n0 in range(0, geo.vocab, geo.lm_bn):
        b.task(Op.LM_HEAD, L, [(prev_norm, rows)], -1, N0=n0, N_LEN=min(geo.lm_bn, geo.vocab - n0), K0=0, K_LEN=D,
               SPLIT=0)
    n = len(b.tasks)
    counts = np.array([len(range(s, n, num_sms)) for s in range(num_sms)], dtype=np.int32)
    tasks = np.zeros((num_sms, int(counts.max()), abi.TASK_WORDS), dtype=np.int32)
    for k, w in enumerate(b.tasks):
        tasks[k % num_sms, k // num_sms] = w
    # count/count_word None: the table states no count (names only)
    counters = [SimpleNamespace(index=i, name=nm, count=None, count_word=None) for i, nm in enumerate(b.names)]
    return SimpleNamespace(tasks=tasks, task_counts=counts, num_counters=b.num_counters, geometry=geo,
                           counters=counters, spec_name="tiny-llama", num_sms=num_sms, rows=rows)


# ==========================================================================
# editing helpers
# ==========================================================================
def clone(s):
    c = copy.copy(s)
    c.tasks = np.array(s.tasks, copy=True)
    c.task_counts = np.array(s.task_counts, copy=True)
    return c


def find(s, op: Op, layer: int | None = None, where=None) -> list[tuple[int, int]]:
    """(sm, slot) of live tasks with opcode ``op`` (and ``layer``), SM-major."""
    out = []
    for sm in range(s.tasks.shape[0]):
        for k in range(int(s.task_counts[sm])):
            w = s.tasks[sm, k]
            if w[H.OPCODE] == op and (layer is None or w[H.LAYER] == layer) and (where is None or where(w)):
                out.append((sm, k))
    return out


def remove(s, sm: int, slot: int) -> np.ndarray:
    w = s.tasks[sm, slot].copy()
    n = int(s.task_counts[sm])
    s.tasks[sm, slot:n - 1] = s.tasks[sm, slot + 1:n]
    s.tasks[sm, n - 1] = 0
    s.task_counts[sm] -= 1
    return w


def insert(s, sm: int, slot: int, w: np.ndarray) -> None:
    n = int(s.task_counts[sm])
    if n == s.tasks.shape[1]:
        s.tasks = np.concatenate([s.tasks, np.zeros_like(s.tasks[:, :1])], axis=1)
    s.tasks[sm, slot + 1:n + 1] = s.tasks[sm, slot:n].copy()
    s.tasks[sm, slot] = w
    s.task_counts[sm] += 1


def kinds(s) -> set[str]:
    return {v.kind for v in V.check(s)}


def rejects(s, kind: str) -> V.Violation:
    """verify() raises for ``kind``'s check class, and that class's
    violations include ``kind``; returns the first violation of that kind."""
    with pytest.raises(V.VerifyError) as ei:
        V.verify(s)
    err = ei.value
    assert "\n" not in str(err)
    assert err.violations[0].check == V.KINDS[kind], str(err)
    found = [x for x in err.violations if x.kind == kind]
    assert found, (kind, str(err))
    if found[0] is err.violations[0]:
        assert found[0].message in str(err)  # the one-line error names it
    return found[0]


# ==========================================================================
# handmade: the verifier on its own
# ==========================================================================
@pytest.fixture(scope="module")
def hand():
    return build_handmade()


def test_handmade_verifies(hand):
    rep = V.verify(hand)
    assert rep.tasks == int(hand.task_counts.sum())
    assert rep.claimers == 2 * hand.num_sms and rep.groups == 2
    assert rep.counters_used == hand.num_counters
    assert rep.checked_pairs > 0 and rep.sim_rounds > 1
    # per layer: qkv -> claimed attention -> combine -> o_proj -> norm_attn ->
    # upgate -> down -> norm; then the LM head
    assert rep.critical_path == 2 * 8 + 1
    assert V.check(hand) == []


def test_raised_target_can_never_be_satisfied(hand):
    s = clone(hand)
    sm, k = find(s, Op.ADD_RMSNORM, 0, lambda w: w[H.FLAGS] & abi.Flag.ADD_FFN)[0]
    s.tasks[sm, k, H.TARGET0] += 1
    v = rejects(s, "target_high")
    assert "can never be satisfied" in str(v) and f"SM {sm} slot {k} ADD_RMSNORM layer 0" in str(v)
    assert "counter" in str(v)


def test_lowered_target_fires_before_all_producers(hand):
    s = clone(hand)
    sm, k = find(s, Op.ADD_RMSNORM, 1, lambda w: w[H.FLAGS] & abi.Flag.ADD_FFN)[0]
    assert s.tasks[sm, k, H.TARGET0] >= 2
    s.tasks[sm, k, H.TARGET0] -= 1
    v = rejects(s, "target_low")
    assert "fires before all producers" in str(v)


def test_removed_wait_reads_before_write(hand):
    s = clone(hand)
    sm, k = find(s, Op.O_PROJ, 1)[0]
    s.tasks[sm, k, H.WAIT0] = -1
    s.tasks[sm, k, H.TARGET0] = 0
    v = rejects(s, "raw")
    assert "attn_out" in str(v) and "O_PROJ layer 1" in str(v) and "ATTN_COMBINE" in str(v)
    assert kinds(s) == {"raw"}


def test_consumer_before_its_producer_on_the_same_sm_deadlocks(hand):
    """The norm of layer 0 moved just before one of the O-proj tasks it waits
    on: targets stay exact, but that SM can never reach its producer."""
    s = clone(hand)
    sm_p, k_p = find(s, Op.O_PROJ, 0)[0]
    sm_c, k_c = find(s, Op.ADD_RMSNORM, 0, lambda w: w[H.FLAGS] & abi.Flag.ADD_ATTN)[0]
    w = remove(s, sm_c, k_c)
    if sm_c == sm_p and k_c < k_p:
        k_p -= 1
    insert(s, sm_p, k_p, w)
    v = rejects(s, "deadlock")
    msg = str(v)
    assert "O_PROJ layer 0 never arrived" in msg
    assert f"SM {sm_p} slot {k_p} ADD_RMSNORM layer 0 waits counter" in msg


def test_cross_sm_cycle_deadlocks(hand):
    """Each of two SMs holds, in front of one upgate tile, the down split that
    consumes the OTHER SM's upgate tile: a wait cycle between the two SMs."""
    s = clone(hand)
    (sa, _), (sb, _) = find(s, Op.FFN_UPGATE_ACT, 0)[:2]
    assert sa != sb
    split = F(Op.FFN_DOWN, "SPLIT")
    d0 = find(s, Op.FFN_DOWN, 0, lambda w: w[split] == 0)[0]
    d1 = find(s, Op.FFN_DOWN, 0, lambda w: w[split] == 1)[0]
    w0, w1 = s.tasks[d0].copy(), s.tasks[d1].copy()
    for pos in sorted([d0, d1], key=lambda x: -x[1]):
        remove(s, *pos)
    (sa, ka), (sb, kb) = find(s, Op.FFN_UPGATE_ACT, 0)[:2]
    insert(s, sa, ka, w1)  # needs SM b's tile
    insert(s, sb, kb, w0)  # needs SM a's tile
    assert kinds(s) == {"deadlock"}  # targets stay exact, no data race
    v = rejects(s, "deadlock")
    assert f"[wait cycle SM {sa} -> SM {sb} -> SM {sa}]" in str(v) or f"[wait cycle SM {sb} -> SM {sa} -> SM {sb}]" in str(v)
    assert "FFN_UPGATE_ACT layer 0 never arrived, queued behind the blocked head" in str(v)


def test_claimer_before_the_producers_of_its_claimed_inputs(hand):
    """An ATTN_DRAIN claimer moved in front of the QKV tiles its claimed tasks
    wait on, on the SM that runs them: the claimer rule."""
    s = clone(hand)
    sm, k = find(s, Op.QKV_PROJ, 1)[0]
    cl = find(s, Op.ATTN_DRAIN, 1, None)
    csm, ck = next((a, b) for a, b in cl if a == sm)
    w = remove(s, csm, ck)
    insert(s, sm, k, w)
    v = rejects(s, "claimer_rule")
    assert "ATTN_DRAIN layer 1 claims tasks" in str(v) and "QKV_PROJ layer 1 is queued behind it" in str(v)


def test_signal_to_the_wrong_counter(hand):
    s = clone(hand)
    sm, k = find(s, Op.FFN_UPGATE_ACT, 0)[0]
    s.tasks[sm, k, H.SIGNAL] += 1  # the next layer's-/split's counter
    ks = kinds(s)
    assert {"target_high", "target_low"} <= ks or {"target_high"} <= ks
    rejects(s, "target_high")


def test_out_of_range_row(hand):
    s = clone(hand)
    sm, k = find(s, Op.ATTN_COMBINE, 0)[0]
    s.tasks[sm, k, F(Op.ATTN_COMBINE, "ROW")] = hand.rows
    v = rejects(s, "field_range")
    assert "ROW = 2 outside [0, 2)" in str(v)


def test_out_of_range_counter_and_nop_in_body(hand):
    s = clone(hand)
    sm, k = find(s, Op.O_PROJ, 0)[0]
    s.tasks[sm, k, H.SIGNAL] = hand.num_counters
    assert "counter_range" in kinds(s)
    s = clone(hand)
    s.tasks[1, 2] = 0
    assert "nop_in_body" in kinds(s)
    s = clone(hand)
    s.tasks[0, int(s.task_counts[0]) - 1 + 0, H.OPCODE] = 99
    assert "opcode" in kinds(s)


def test_garbage_after_task_count(hand):
    s = clone(hand)
    s.task_counts[2] -= 1
    assert kinds(s) >= {"padding"}


def test_duplicated_task_double_signals(hand):
    s = clone(hand)
    sm, k = find(s, Op.FFN_DOWN, 1)[0]
    insert(s, (sm + 1) % s.tasks.shape[0], 0, s.tasks[sm, k].copy())
    v = rejects(s, "target_low")
    assert "ffn_down" in str(v)
    assert "waw" in kinds(s)  # the copy also writes the same partial


def test_overwrite_race(hand):
    """Two tasks write one region with no counter between them: an FFN_DOWN
    tile retargeted onto the other split's partial slot."""
    s = clone(hand)
    a, b = find(s, Op.FFN_DOWN, 0)[:2]
    assert s.tasks[a][F(Op.FFN_DOWN, "SPLIT")] != s.tasks[b][F(Op.FFN_DOWN, "SPLIT")]
    s.tasks[b][F(Op.FFN_DOWN, "SPLIT")] = s.tasks[a][F(Op.FFN_DOWN, "SPLIT")]
    v = rejects(s, "waw")
    assert "ffn_part" in str(v) and "no counter orders them" in str(v)


def test_write_after_read_race(hand):
    """The layer-1 norm waits on the layer's QKV instead of its FFN and writes
    norm slot 1 (GAMMA) instead of its own: it now overwrites the residual
    slot the attention norm of that layer may still read."""
    s = clone(hand)
    qkv0 = int(s.tasks[find(s, Op.QKV_PROJ, 1)[0]][H.SIGNAL])
    for sm, k in find(s, Op.ADD_RMSNORM, 1, lambda w: w[H.FLAGS] & abi.Flag.ADD_FFN):
        s.tasks[sm, k, H.WAIT0] = qkv0
        s.tasks[sm, k, H.TARGET0] = 3
        s.tasks[sm, k, F(Op.ADD_RMSNORM, "GAMMA")] = 1
    # the layer-1 down counter is now never waited: no target breaks
    ks = kinds(s)
    assert "war" in ks and "raw" in ks
    assert any("x_resid" in str(v) for v in V.check(s) if v.kind == "war")
    rejects(s, "raw")


def test_read_of_data_no_task_writes_before_it(hand):
    """The attention norm told to add the FFN partials too: it reads a slot
    that FFN_DOWN writes only after it (ordered, so no race: stale data)."""
    s = clone(hand)
    for sm, k in find(s, Op.ADD_RMSNORM, 0, lambda w: w[H.FLAGS] & abi.Flag.ADD_ATTN):
        s.tasks[sm, k, H.FLAGS] |= abi.Flag.ADD_FFN
        s.tasks[sm, k, F(Op.ADD_RMSNORM, "FFN_SPLITS")] = 1
    v = rejects(s, "unwritten_read")
    assert "ffn_part" in str(v) and "not a step input" in str(v)


def test_region_outside_its_buffer(hand):
    s = clone(hand)
    sm, k = find(s, Op.ADD_RMSNORM, 0, lambda w: w[H.FLAGS] & abi.Flag.ADD_ATTN)[0]
    s.tasks[sm, k, F(Op.ADD_RMSNORM, "ATTN_SPLITS")] = hand.geometry.kv_heads + 1
    v = rejects(s, "region_range")
    assert "o_part" in str(v)


def test_split_count_too_small_leaves_a_partial_unread(hand):
    """ATTN_SPLITS one short: the last O-proj partial is written, never added."""
    s = clone(hand)
    for sm, k in find(s, Op.ADD_RMSNORM, 1, lambda w: w[H.FLAGS] & abi.Flag.ADD_ATTN):
        s.tasks[sm, k, F(Op.ADD_RMSNORM, "ATTN_SPLITS")] -= 1
    v = rejects(s, "dead_write")
    assert "o_part[1:2, 1:2" in str(v) and "O_PROJ layer 1" in str(v)


def test_combine_merges_what_it_waited_for(hand):
    s = clone(hand)
    sm, k = find(s, Op.ATTN_COMBINE, 1)[0]
    s.tasks[sm, k, F(Op.ATTN_COMBINE, "NUM_SPLITS")] = 1
    v = rejects(s, "field_mismatch")
    assert "NUM_SPLITS 1 may exceed the dyn(word" in str(v)


def test_claimers_of_one_queue_must_agree(hand):
    s = clone(hand)
    sm, k = find(s, Op.ATTN_DRAIN, 0)[1]
    s.tasks[sm, k, F(Op.ATTN_DRAIN, "TASK_WAIT_TARGET")] = 2
    v = rejects(s, "claimer_mismatch")
    assert "ATTN_DRAIN layer 0" in str(v)


def test_check_returns_all_and_verify_the_first_class(hand):
    s = clone(hand)
    sm, k = find(s, Op.ATTN_COMBINE, 0)[0]
    s.tasks[sm, k, F(Op.ATTN_COMBINE, "KV_HEAD")] = 7
    sm, k = find(s, Op.O_PROJ, 1)[0]
    s.tasks[sm, k, H.WAIT0] = -1
    all_kinds = kinds(s)
    assert "field_range" in all_kinds
    rejects(s, "field_range")  # structure comes first


def test_message_caps_per_kind(hand):
    """Thousands of identical complaints are cut to MAX_PER_KIND, the rest counted."""
    s = clone(hand)
    n = 0
    for sm in range(s.tasks.shape[0]):
        for k in range(int(s.task_counts[sm])):
            w = s.tasks[sm, k]
            if w[H.WAIT0] >= 0 and not abi.is_dyn(int(w[H.TARGET0])):
                w[H.TARGET0] += 7
                n += 1
    assert n > V.MAX_PER_KIND
    with pytest.raises(V.VerifyError) as ei:
        V.verify(s)
    assert len(ei.value.violations) == V.MAX_PER_KIND
    assert f"(+{n - 1} more targets violations)" in str(ei.value)


# ==========================================================================
# compiled schedules (the pipeline)
# ==========================================================================
def _compile(model: str, rows: int, order: str = "tuned"):
    from megac.passes import pipeline as pl  # megac's own module: a broken import fails
    return pl.compile_one(load_spec(model), order=order, rows=rows, verify=False)


_CACHE: dict = {}


def compiled(model: str, rows: int, order: str = "tuned"):
    key = (model, rows, order)
    if key not in _CACHE:
        _CACHE[key] = _compile(model, rows, order)
    return _CACHE[key]


@pytest.mark.parametrize("model,rows,order", [
    ("tiny-moe", 1, "tuned"), ("tiny-moe", 2, "tuned"), ("tiny-moe", 3, "interleaved"),
    ("tiny-moe", 2, "attention-first"), ("tiny-llama", 2, "tuned"), ("tiny-llama", 4, "attention-first"),
    ("north-mini-code", 1, "tuned"), ("north-mini-code", 8, "tuned"),
])
def test_compiled_schedules_verify(model, rows, order):
    s = compiled(model, rows, order)
    rep = V.verify(s)
    assert rep.tasks == s.num_tasks and rep.counters_used == s.num_counters
    assert rep.checked_pairs > 0 and rep.critical_path > 2 * s.geometry.num_layers
    assert V.check(s) == []


@pytest.fixture()
def moe():
    return clone(compiled("tiny-moe", 2))


def _static_wait(s, op, min_target=1):
    """(sm, slot) of a task of ``op`` whose WAIT0 has a static target >= min_target."""
    for sm, k in find(s, op):
        t = int(s.tasks[sm, k, H.TARGET0])
        if s.tasks[sm, k, H.WAIT0] >= 0 and not abi.is_dyn(t) and t >= min_target:
            return sm, k
    raise AssertionError(f"no {op.name} with a static target >= {min_target}")


def test_compiled_raised_target_deadlocks(moe):
    sm, k = _static_wait(moe, Op.O_PROJ)
    moe.tasks[sm, k, H.TARGET0] += 1
    v = rejects(moe, "target_high")
    assert "can never be satisfied (deadlock)" in str(v) and "O_PROJ" in str(v)


def test_compiled_lowered_target_fires_early(moe):
    sm, k = _static_wait(moe, Op.ADD_RMSNORM, 2)
    moe.tasks[sm, k, H.TARGET0] -= 1
    v = rejects(moe, "target_low")
    assert "fires before all producers" in str(v)


def test_compiled_removed_wait_reads_before_write(moe):
    sm, k = find(moe, Op.O_PROJ, 2)[0]
    moe.tasks[sm, k, H.WAIT0] = -1
    v = rejects(moe, "raw")
    assert "attn_out" in str(v) and "O_PROJ layer 2" in str(v)


def test_compiled_consumer_before_producer_deadlocks(moe):
    """A top-k row moved just in front of a router tile it waits on."""
    w = remove(moe, *find(moe, Op.ROUTER_TOPK, 3)[0])
    (sp, kp) = find(moe, Op.ROUTER_GEMM, 3)[0]
    insert(moe, sp, kp, w)
    assert kinds(moe) == {"deadlock"}
    v = rejects(moe, "deadlock")
    assert "ROUTER_GEMM layer 3 never arrived" in str(v) and f"[wait cycle SM {sp} -> SM {sp}]" in str(v)


def test_compiled_moe_down_claimer_before_upgate_producers(moe):
    """On one SM the MOE_DOWN claimer moves in front of the MOE_UPGATE claimer
    whose queue produces its inputs: the claimer rule."""
    sm, k_up = find(moe, Op.MOE_UPGATE_DRAIN, 4)[7]
    k_down = next(k for s2, k in find(moe, Op.MOE_DOWN_DRAIN, 4) if s2 == sm)
    w = remove(moe, sm, k_down)
    insert(moe, sm, k_up, w)
    v = rejects(moe, "claimer_rule")
    assert f"SM {sm} slot {k_up} MOE_DOWN_DRAIN layer 4 claims tasks" in str(v)
    assert "MOE_UPGATE_DRAIN queue" in str(v)


def test_compiled_attention_claimer_before_qkv(moe):
    sm, k = find(moe, Op.QKV_PROJ, 4)[0]
    k_cl = next(k2 for s2, k2 in find(moe, Op.ATTN_DRAIN, 4) if s2 == sm)
    w = remove(moe, sm, k_cl)
    insert(moe, sm, k, w)
    v = rejects(moe, "claimer_rule")
    assert "ATTN_DRAIN layer 4 claims tasks" in str(v) and "QKV_PROJ layer 4 is queued behind it" in str(v)


def test_compiled_moe_combine_without_wait0_reads_dyn_target_early(moe):
    """MOE_COMBINE reads its dynamic TARGET1 (the down-queue length that
    ROUTE_FINALIZE writes) after WAIT0; without WAIT0 nothing orders the read."""
    sm, k = find(moe, Op.MOE_COMBINE, 1)[0]
    assert abi.is_dyn(int(moe.tasks[sm, k, H.TARGET1]))
    moe.tasks[sm, k, H.WAIT0] = -1
    moe.tasks[sm, k, H.TARGET0] = 0
    v = rejects(moe, "dyn_order")
    assert "MOE_COMBINE layer 1: TARGET1 reads target word" in str(v) and "ROUTE_FINALIZE" in str(v)
    assert "no WAIT0" in str(v)


def test_compiled_dyn_target_in_target0_is_read_before_any_wait(moe):
    sm, k = find(moe, Op.MOE_COMBINE, 1)[0]
    moe.tasks[sm, k, H.WAIT0:H.WAIT0 + 2] = moe.tasks[sm, k, H.WAIT1:H.WAIT1 + 2].copy()
    moe.tasks[sm, k, H.WAIT1] = -1
    moe.tasks[sm, k, H.TARGET1] = 0
    v = rejects(moe, "dyn_order")
    assert "TARGET0 is read before any wait" in str(v)


def test_compiled_signal_to_wrong_counter(moe):
    sm, k = find(moe, Op.MOE_GATHER, 2)[0]
    moe.tasks[sm, k, H.SIGNAL] -= 1  # the route counter instead of the gather counter
    ks = kinds(moe)
    assert {"target_high", "target_low"} <= ks
    rejects(moe, "target_high")


def test_compiled_out_of_range_row(moe):
    sm, k = find(moe, Op.MOE_COMBINE, 2)[0]
    moe.tasks[sm, k, F(Op.MOE_COMBINE, "ROW")] = 2
    v = rejects(moe, "field_range")
    assert "MOE_COMBINE layer 2: ROW = 2 outside [0, 2)" in str(v)


def test_compiled_duplicated_task(moe):
    sm, k = find(moe, Op.O_PROJ, 1)[0]
    insert(moe, (sm + 5) % moe.tasks.shape[0], 0, moe.tasks[sm, k].copy())
    v = rejects(moe, "target_low")
    assert "oproj" in str(v)
    assert "waw" in kinds(moe)


def test_compiled_overwrite_race(moe):
    """Two O-proj tiles of one layer made to write the same partial slot."""
    (a, b) = find(moe, Op.O_PROJ, 3)[:2]
    split = F(Op.O_PROJ, "SPLIT")
    assert moe.tasks[a][split] != moe.tasks[b][split]
    moe.tasks[b][split] = moe.tasks[a][split]
    v = rejects(moe, "waw")
    assert "o_part" in str(v)


def test_compiled_counter_table_must_match_words(moe):
    import dataclasses

    c = moe.counters[5]
    moe.counters = list(moe.counters)
    moe.counters[5] = dataclasses.replace(c, count=(c.count or 0) + 1, count_word=None)
    v = rejects(moe, "counter_table")
    assert "counter 5" in str(v)


def test_compiled_nmc_batch8_breaks_are_found():
    s = clone(compiled("north-mini-code", 8))
    sm, k = find(s, Op.MOE_UPGATE_DRAIN, 30)[100]
    k_down = next(k2 for s2, k2 in find(s, Op.MOE_DOWN_DRAIN, 30) if s2 == sm)
    insert(s, sm, k, remove(s, sm, k_down))
    rejects(s, "claimer_rule")
    s = clone(compiled("north-mini-code", 8))
    sm, k = find(s, Op.ATTN_COMBINE, 48)[3]
    s.tasks[sm, k, H.WAIT0] = -1
    rejects(s, "raw")


def test_compiled_sliding_combine_merges_no_more_than_it_waits_for(moe):
    sm, k = next((a, b) for a, b in find(moe, Op.ATTN_COMBINE, 1) if not abi.is_dyn(int(moe.tasks[a, b, H.TARGET0])))
    moe.tasks[sm, k, F(Op.ATTN_COMBINE, "NUM_SPLITS")] = moe.tasks[sm, k, H.TARGET0] + 1
    v = rejects(moe, "field_mismatch")
    assert "ATTN_COMBINE layer 1: NUM_SPLITS" in str(v)


# ==========================================================================
# the region join
# ==========================================================================
def test_pairs_finds_exactly_the_overlapping_boxes():
    """The vectorised join against brute force, on random boxes: empty
    ranges, single-index dims, chunking of the candidate list."""
    rng = np.random.default_rng(0)
    for trial in range(300):
        D = int(rng.integers(1, 5))
        na, nb = int(rng.integers(0, 40)), int(rng.integers(0, 40))

        def boxes(n):
            lo = rng.integers(0, 7, (n, D))
            ln = rng.integers(0, 4, (n, D))
            if trial % 3 == 0:
                ln[:, 0] = 1  # an always-single-index dim (a layer index)
            return lo, lo + ln

        la, ha = boxes(na)
        lb, hb = boxes(nb)
        i, j = box_pairs(la, ha, lb, hb, max_candidates=int(rng.integers(1, 50)))
        got = sorted(zip(i.tolist(), j.tolist()))
        want = [(x, y) for x in range(na) for y in range(nb)
                if all(la[x, d] < hb[y, d] and lb[y, d] < ha[x, d] for d in range(D))]
        assert got == sorted(want), trial


def test_verify_as_a_pass():
    """The pass protocol (requires / run / ensures) on a Lowering."""
    from megac.passes import pipeline as pl  # megac's own module: a broken import fails
    from megac.passes import PassError

    spec = load_spec("tiny-moe")
    lw = pl.lower(spec, "tuned", 2, spec.context_bucket(4096))
    V.requires(lw)
    assert "tasks" in V.run(lw)
    V.ensures(lw)
    lw.tasks = lw.tasks.copy()
    lw.tasks[0, 0, H.TARGET0] += 1  # the first QKV tile of layer 0 never waits: a bogus target
    lw.tasks[0, 0, H.WAIT0] = 0
    with pytest.raises(V.VerifyError):
        V.run(lw)
    empty = SimpleNamespace(tasks=None, task_counts=None)
    with pytest.raises(PassError):
        V.requires(empty)
