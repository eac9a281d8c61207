"""The task ABI: the one source of truth shared by the compiler, the CPU VM and
the device code.

Everything the device reads is defined here once (opcode numbers, the uniform
header, each opcode's descriptor fields, sentinels, the claimer queue record,
the target-word layout, the watchdog error record, the LM head's argmax record
and its greedy rule, the KV layout and the launch descriptor).
``megac.codegen.abi_header`` renders it as ``megac_abi.h`` and a test parses
that header back and compares, so the two sides cannot drift.

Frozen at ABI_VERSION; any change to a number or an offset bumps the version.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

# 2: X_SLOT on FFN_UPGATE_ACT, ROUTER_GEMM, MOE_GATHER
# 3: argmax_part holds ARGMAX_RECORD {fp32 value, int32 index} (was fp32x2, the index as a float)
# 4: attention partials split-major per layer ([L, splits, rows, heads, hd]: the device's combine
#    layout); buffer shapes are the plan's (megac/buffers.py), not the descriptor's doc strings;
#    `progress` (each CTA's current task, for the watchdog report)
# 5: ROUTE_FINALIZE.TOPK_SPLITS (> 0: the finalize task ranks every row's experts from the router
#    partials itself, no ROUTER_TOPK tasks; SOFTMAX_ROUTER / RENORMALIZE flags on it then) and
#    ROUTE_FINALIZE.X_SLOT (>= 0: it copies the rows to their routed moe_x slots, no MOE_GATHER tasks)
# 6: routed claims: MOE_UPGATE_DRAIN.ROUTE_SPLITS / NUM_ROWS / UP_TILES / X_SLOT (ROUTE_SPLITS > 0:
#    the up claimer ranks the rows itself and derives its records, reading the rows from x_norm;
#    no ROUTER_TOPK, no MOE_GATHER) and ROUTE_FINALIZE.UP_COUNT_WORD -1 (no up queue then)
# 7: kv_tmaps (the K and V pools' tensor maps for the attention splits' tensor copies; 0: none)
# 8: ADD_MOE (the MoE combine inside ADD_RMSNORM)
# 9: x_resid has a slot per norm ([2L+1, rows, hidden], slot = GAMMA; ADD_RMSNORM.RESID_IN the slot
#    it reads), and NORM_IN with QKV_PROJ / ROUTER_GEMM.NORM_LAYER / NORM_ATTN_SPLITS /
#    NORM_FFN_SPLITS / NORM_RESID_IN (the tile folds the norm that writes its x_norm slot)
# 10: SPLIT_DOWN (an expert up claim also runs its features' down rows, a split-K partial per up
#    tile: moe_out is [L, rows*top_k, moe_out_tiles * hidden]; MOE_COMBINE sums the tiles) and
#    MOE_COMBINE.COL0 / COLS (a combine task sums a range of the row's features: split_down
#    schedules spread a row's combine over combine_splits tasks)
# 11: O_PROJ.MERGE_SPLITS (> 0: the O-projection tile merges its KV head's attention splits of the
#     schedule's one row into its input itself, as ATTN_COMBINE would, and there is no ATTN_COMBINE)
# 12: COMBINE_IN (a ROUTER_GEMM tile sums its K range of the new residual itself, the MoE combine
#     included, or with NORM_LAYER -1 reads the norm's residual, and multiplies it unnormalised: the
#     ranking is the same, and ROUTE_FINALIZE / ROUTER_TOPK, flagged COMBINE_IN, scale their weights
#     by 1 / rms of x_resid slot RESID_SLOT, a field of both)
# 13: ADD_MOE on a QKV_PROJ tile flagged NORM_IN (the folded norm adds NORM_LAYER's expert outputs,
#     score-weighted in k order, as ADD_RMSNORM with ADD_MOE adds them; NORM_FFN_SPLITS 0)
# 14: MOE_UPGATE_DRAIN.NORM_* (_NORM_IN) and NORM_IN | ADD_MOE on a routed claimer: its claimed
#     tiles stage the folded norm's row (the experts added as on a QKV tile) instead of x_norm;
#     RESID_ONLY (an ADD_RMSNORM whose x_norm slot no task reads writes the residual alone)
ABI_VERSION = 14

TASK_WORDS = 32
HEADER_WORDS = 8

#: A counter index of -1 means "no wait" / "no signal".
NO_COUNTER = -1
#: A wait target (or a count field documented as "dynamic-capable") with this
#: bit set is not a number but an index into the int32 *target word* buffer:
#: the consumer reads ``targets[value & DYN_INDEX_MASK]``. The word is written
#: earlier in the same step, on the device (ROUTE_FINALIZE) or by the host
#: before launch (per-row attention split counts, the attention queue length).
DYN_FLAG = 0x40000000
DYN_INDEX_MASK = 0x3FFFFFFF


def dyn(word_index: int) -> int:
    """Encode 'read the value from target word ``word_index``'."""
    assert 0 <= word_index <= DYN_INDEX_MASK
    return DYN_FLAG | word_index


def is_dyn(value: int) -> bool:
    return value >= 0 and bool(value & DYN_FLAG)


def dyn_index(value: int) -> int:
    return value & DYN_INDEX_MASK


class Op(enum.IntEnum):
    NOP = 0
    QKV_PROJ = 1
    ATTN_DECODE = 2
    ATTN_DRAIN = 3
    ATTN_COMBINE = 4
    O_PROJ = 5
    FFN_UPGATE_ACT = 6
    FFN_DOWN = 7
    ROUTER_GEMM = 8
    ROUTER_TOPK = 9
    ROUTE_FINALIZE = 10
    MOE_GATHER = 11
    MOE_UPGATE_DRAIN = 12
    MOE_DOWN_DRAIN = 13
    MOE_COMBINE = 14
    ADD_RMSNORM = 15
    LM_HEAD = 16


OP_DOC = {
    Op.NOP: "padding; zero words are a valid program",
    Op.QKV_PROJ: "one head tile of the fused Q/K/V projection; RoPE if flagged; K/V appended to the paged cache",
    Op.ATTN_DECODE: "one (row, kv head, KV split) of paged GQA flash-decode; sliding-window aware",
    Op.ATTN_DRAIN: "claimer: pulls ATTN_DECODE records from the shared attention queue",
    Op.ATTN_COMBINE: "log-sum-exp merge of one (row, kv head)'s splits, fixed order",
    Op.O_PROJ: "one N tile of one split-K slice (= one KV head's query heads) of the output projection",
    Op.FFN_UPGATE_ACT: "one tile of the dense gate+up GEMM with the SiLU*up epilogue",
    Op.FFN_DOWN: "one N tile of one split-K slice of the dense down projection",
    Op.ROUTER_GEMM: "one split-K slice of the router logits",
    Op.ROUTER_TOPK: "per row: top-k experts and their weights",
    Op.ROUTE_FINALIZE: "per-expert counts -> offsets -> slot map -> MoE task queues (on the device)",
    Op.MOE_GATHER: "copy a row's normed activations to its routed slots",
    Op.MOE_UPGATE_DRAIN: "claimer: expert gate+up tiles with SiLU*up",
    Op.MOE_DOWN_DRAIN: "claimer: expert down tiles",
    Op.MOE_COMBINE: "per row: score-weighted sum of its experts' outputs, k order, fp32",
    Op.ADD_RMSNORM: "per row: residual += partial outputs (fixed order), RMSNorm with the next gamma",
    Op.LM_HEAD: "one vocab tile of the LM head: logits slice + argmax partial",
}

# --------------------------------------------------------------------------
# Uniform header (words 0..7), read without knowing the opcode.
# --------------------------------------------------------------------------
HEADER_FIELDS = (
    ("OPCODE", "opcode (Op)"),
    ("LAYER", "layer index (num_layers for the LM head)"),
    ("WAIT0", "first wait counter index, -1: none"),
    ("TARGET0", "first wait target (DYN_FLAG|i: read target word i)"),
    ("WAIT1", "second wait counter index, -1: none; waited after WAIT0"),
    ("TARGET1", "second wait target"),
    ("SIGNAL", "counter incremented once when the task is done, -1: none"),
    ("FLAGS", "Flag bits"),
)
H = enum.IntEnum("H", {name: i for i, (name, _) in enumerate(HEADER_FIELDS)})


class Flag(enum.IntFlag):
    NONE = 0
    ROPE = 1 << 0  # QKV_PROJ: apply RoPE to this Q/K head
    ROPE_HALF = 1 << 1  # rotate-half (Llama) pairs instead of interleaved pairs
    SLIDING = 1 << 2  # attention: window applies
    ADD_ATTN = 1 << 3  # ADD_RMSNORM: add the O-proj partials
    ADD_FFN = 1 << 4  # ADD_RMSNORM: add the FFN partials (dense down or MoE combine)
    SOFTMAX_ROUTER = 1 << 5  # ROUTER_TOPK (or a top-k ranking ROUTE_FINALIZE): softmax weights (else sigmoid)
    RENORMALIZE = 1 << 6  # ROUTER_TOPK (or a top-k ranking ROUTE_FINALIZE): renormalise the top-k weights
    LAST_LAYER = 1 << 7  # ADD_RMSNORM: the final norm of the model
    # ADD_RMSNORM: add the row's expert outputs, score-weighted in k order (MOE_COMBINE's sum); QKV_PROJ
    # (or a routed MOE_UPGATE_DRAIN) with NORM_IN: the folded norm adds NORM_LAYER's so, not an FFN
    # partial (NORM_FFN_SPLITS 0)
    ADD_MOE = 1 << 8
    # QKV_PROJ / ROUTER_GEMM: the input is the norm of the NORM_* fields, computed here (_NORM_IN); a
    # routed MOE_UPGATE_DRAIN (with ADD_MOE, one row): its claimed tiles' rows are that norm's
    NORM_IN = 1 << 9
    # MOE_UPGATE_DRAIN: each claimed up tile also multiplies its SiLU*up features by their columns of
    # the expert's down matrix (a split-K down) into moe_out tile N_TILE; MOE_COMBINE: sum a slot's
    # moe_out tiles (in tile order) before weighting it; no MOE_DOWN_DRAIN
    SPLIT_DOWN = 1 << 10
    # ROUTER_GEMM: the input is the K range of the new residual of the NORM_* fields (the residual slot,
    # the O-proj partials and NORM_LAYER's MoE combine, as ADD_RMSNORM with ADD_MOE adds them) times
    # gamma X_SLOT, not normalised: unnormalised logits, whose ranking is the normalised ones' (1 / rms
    # > 0). ROUTE_FINALIZE: the logits are such: its weights take the selected logits times 1 / rms of
    # x_resid slot RESID_SLOT (the norm task's residual); ROUTER_TOPK the same. With NORM_LAYER -1 the
    # router's x is that residual slot (NORM_RESID_IN) as the norm wrote it. _COMBINE_IN
    COMBINE_IN = 1 << 11
    # ADD_RMSNORM: write the new residual only, no x_norm row (no task reads that slot: the up_combine
    # tile's layers, where the QKV tiles, the router and the up claims all fold the norm)
    RESID_ONLY = 1 << 12


class QkvPart(enum.IntEnum):
    Q = 0
    K = 1
    V = 2


# --------------------------------------------------------------------------
# Opcode-specific descriptor fields (words 8..31).
# A field marked (dyn) may hold DYN_FLAG|i instead of a value.
# --------------------------------------------------------------------------
_GEMM = (
    ("N0", "first output feature of the tile"),
    ("N_LEN", "output features in the tile"),
    ("K0", "first reduction index of the slice"),
    ("K_LEN", "reduction length of the slice"),
    ("SPLIT", "split-K index (partial buffer slot)"),
)

# A GEMM tile flagged NORM_IN folds the ADD_RMSNORM that writes its x_norm
# slot: it adds that norm's partials to its residual slot and normalises each
# row itself (the same arithmetic, so the same bits) into its staged input,
# instead of waiting for the norm task and reading x_norm. The norm task
# still runs for the residual slot and the slot's other readers.
#
# _COMBINE_IN: a ROUTER_GEMM tile flagged COMBINE_IN reads the same NORM_*
# fields (NORM_FFN_SPLITS 0) and instead of the norm stages, for its K range
# only, bf16(gamma * x) with x the new residual: the residual slot, the
# O-proj partials and the MoE combine of layer NORM_LAYER (route_slot,
# topk_w, moe_out), added as ADD_RMSNORM with ADD_MOE adds them. It needs no
# other range's values (no 1 / rms), so it waits on the down claims and the
# O-projection tiles, not on MOE_COMBINE and a norm: two hops less before
# the up claims rank. The finalize task scales the weights.
_NORM_IN = (
    ("NORM_LAYER", "NORM_IN: the layer whose partials the folded norm adds"),
    ("NORM_ATTN_SPLITS", "NORM_IN: O-proj partials to add (as ADD_RMSNORM's ATTN_SPLITS; 0: none)"),
    ("NORM_FFN_SPLITS", "NORM_IN: FFN partials to add (as ADD_RMSNORM's FFN_SPLITS; 0: none)"),
    ("NORM_RESID_IN", "NORM_IN: x_resid slot the folded norm reads (its RESID_IN)"),
)

OP_FIELDS: dict[Op, tuple[tuple[str, str], ...]] = {
    Op.NOP: (),
    Op.QKV_PROJ: _GEMM
    + (
        ("PART", "QkvPart: 0 Q, 1 K, 2 V"),
        ("HEAD", "head index within its part (q head, or kv head for K/V)"),
    )
    + _NORM_IN,
    Op.ATTN_DECODE: (
        ("ROW", "batch row"),
        ("KV_HEAD", "kv head"),
        ("SPLIT", "KV split index"),
        ("NUM_SPLITS", "(dyn) splits of this row; tasks with SPLIT >= it write an empty partial"),
        ("WINDOW", "sliding window in tokens including the current one, 0: full"),
    ),
    Op.ATTN_DRAIN: (
        ("QUEUE", "Queue id"),
        ("QUEUE_LEN", "(dyn) records in the queue"),
        ("TASK_WAIT_BASE", "claimed task waits counter TASK_WAIT_BASE + kv_head"),
        ("TASK_WAIT_TARGET", "... for this target"),
        ("TASK_SIGNAL_BASE", "claimed task signals TASK_SIGNAL_BASE + row*kv_heads + kv_head"),
        ("WINDOW", "as ATTN_DECODE"),
    ),
    Op.ATTN_COMBINE: (
        ("ROW", "batch row"),
        ("KV_HEAD", "kv head"),
        ("NUM_SPLITS", "(dyn) splits to merge, in index order"),
    ),
    Op.O_PROJ: _GEMM
    + (
        ("MERGE_SPLITS", "(dyn) 0: the input is attn_out; > 0: this many attention splits of KV head SPLIT "
                         "(of row 0, the schedule's one row) merged into the input here, as ATTN_COMBINE "
                         "merges them (the same bits); no ATTN_COMBINE task"),
    ),
    Op.FFN_UPGATE_ACT: _GEMM
    + (
        ("OUT0", "first hidden column written (N0/2: gate/up rows interleaved in chunks of N_LEN/2)"),
        ("X_SLOT", "x_norm slot read: l for a parallel block, num_layers+l after a sequential block's attention"),
    ),
    Op.FFN_DOWN: _GEMM,
    Op.ROUTER_GEMM: _GEMM + (("X_SLOT", "x_norm slot read (as FFN_UPGATE_ACT)"),) + _NORM_IN,
    Op.ROUTER_TOPK: (
        ("ROW", "batch row"),
        ("NUM_SPLITS", "router split-K partials to sum, in index order"),
        ("RESID_SLOT", "COMBINE_IN: the x_resid slot whose row's 1 / rms scales the selected logits "
                       "before the weights (as ROUTE_FINALIZE.RESID_SLOT); else unused"),
    ),
    Op.ROUTE_FINALIZE: (
        ("UP_TILES", "gate/up tiles per active expert"),
        ("DOWN_TILES", "down tiles per active expert"),
        ("UP_COUNT_WORD", "target word receiving the up-queue length; -1: no up queue (routed claims "
                          "derive it themselves)"),
        ("DOWN_COUNT_WORD", "target word receiving the down-queue length"),
        ("UP_QUEUE", "Queue id of the up queue"),
        ("DOWN_QUEUE", "Queue id of the down queue"),
        ("NUM_ROWS", "batch rows routed"),
        ("TOPK_SPLITS", "> 0: rank rows 0..NUM_ROWS-1 here from this many router split-K partials "
                        "(as ROUTER_TOPK, the whole CTA); 0: ROUTER_TOPK tasks wrote topk_ids/topk_w"),
        ("X_SLOT", ">= 0: copy rows 0..NUM_ROWS-1 of this x_norm slot to their routed moe_x slots "
                   "(as MOE_GATHER); -1: MOE_GATHER tasks do"),
        ("RESID_SLOT", "COMBINE_IN: the x_resid slot whose rows' 1 / rms scales the selected logits "
                       "before the weights (the router's partials are unnormalised); else unused"),
    ),
    Op.MOE_GATHER: (
        ("ROW", "batch row"),
        ("X_SLOT", "x_norm slot read (as FFN_UPGATE_ACT)"),
    ),
    Op.MOE_UPGATE_DRAIN: (
        ("QUEUE", "Queue id"),
        ("QUEUE_LEN", "(dyn) records in the queue"),
        ("TASK_WAIT_BASE", "claimed task waits this counter (gathered rows)"),
        ("TASK_WAIT_TARGET", "... for this target"),
        ("TASK_SIGNAL_BASE", "claimed task signals TASK_SIGNAL_BASE + expert"),
        ("N_LEN", "rows of interleaved gate/up weights per tile"),
        ("ROUTE_SPLITS", "> 0: routed claims: the claimer ranks rows 0..NUM_ROWS-1 itself from this many "
                         "router split-K partials (as ROUTE_FINALIZE with TOPK_SPLITS) and derives the up "
                         "queue's records, reading each record's rows from x_norm slot X_SLOT (no queue, "
                         "no gather, no task wait); 0: records from the queue"),
        ("NUM_ROWS", "batch rows routed (ROUTE_SPLITS > 0)"),
        ("UP_TILES", "gate/up tiles per active expert (ROUTE_SPLITS > 0)"),
        ("X_SLOT", "x_norm slot the routed rows are read from (ROUTE_SPLITS > 0)"),
    )
    + _NORM_IN,
    Op.MOE_DOWN_DRAIN: (
        ("QUEUE", "Queue id"),
        ("QUEUE_LEN", "(dyn) records in the queue"),
        ("TASK_WAIT_BASE", "claimed task waits counter TASK_WAIT_BASE + expert"),
        ("TASK_WAIT_TARGET", "... for this target (= up tiles per expert)"),
        ("TASK_SIGNAL_BASE", "claimed task signals this counter"),
        ("N_LEN", "output features per tile"),
    ),
    Op.MOE_COMBINE: (("ROW", "batch row"),
                     ("COL0", "first feature combined"),
                     ("COLS", "features combined from COL0 (a multiple of 4); the row's others are other tasks'")),
    Op.ADD_RMSNORM: (
        ("ROW", "batch row"),
        ("ATTN_SPLITS", "O-proj split-K partials to add, in index order"),
        ("FFN_SPLITS", "FFN partials to add, in index order"),
        ("GAMMA", "norm index = x_norm and x_resid slot written: l input norm of layer l, num_layers+l post-attention norm of a sequential layer l, 2*num_layers final norm"),
        ("RESID_IN", "x_resid slot read: the previous norm's GAMMA (0: the seeded embedding)"),
    ),
    Op.LM_HEAD: _GEMM,
}


def field_index(op: Op, name: str) -> int:
    """Word index of an opcode-specific field."""
    for i, (fname, _) in enumerate(OP_FIELDS[op]):
        if fname == name:
            return HEADER_WORDS + i
    raise KeyError(f"{op.name} has no field {name}")


for _op, _fields in OP_FIELDS.items():
    assert HEADER_WORDS + len(_fields) <= TASK_WORDS, _op

#: Fields that may hold a dynamic (DYN_FLAG) reference.
DYN_CAPABLE = {
    (Op.ATTN_DECODE, "NUM_SPLITS"),
    (Op.ATTN_DRAIN, "QUEUE_LEN"),
    (Op.ATTN_COMBINE, "NUM_SPLITS"),
    (Op.O_PROJ, "MERGE_SPLITS"),
    (Op.MOE_UPGATE_DRAIN, "QUEUE_LEN"),
    (Op.MOE_DOWN_DRAIN, "QUEUE_LEN"),
}

CLAIMERS = (Op.ATTN_DRAIN, Op.MOE_UPGATE_DRAIN, Op.MOE_DOWN_DRAIN)


def split_range(seq_len: int, window: int, num_splits: int, split: int, block: int) -> tuple[int, int]:
    """Key range ``[begin, end)`` of attention split ``split`` of a row holding
    ``seq_len`` keys (current token included); ``window`` 0 means full.

    The rule every backend implements (``megac::attn::split_range`` in
    opcodes/attention.cuh): the visible span ``[lo, seq_len)`` is cut from the
    block holding ``lo`` into ``num_splits`` chunks of equal size rounded up to
    whole blocks; the first chunk may start mid-block, trailing chunks may be
    empty (``begin == end == seq_len``), which merge exactly."""
    hi = seq_len
    lo = hi - window if (window > 0 and hi > window) else 0
    base = lo - lo % block
    chunk = -(-(hi - base) // num_splits) if num_splits > 0 else 0
    chunk = -(-chunk // block) * block
    b, e = base + split * chunk, base + (split + 1) * chunk
    begin = max(lo, min(b, hi))
    end = min(e, hi)
    if split >= num_splits or begin >= end:
        return hi, hi
    return begin, end


# --------------------------------------------------------------------------
# Claimer queues: fixed-width records that expand to a full descriptor.
# --------------------------------------------------------------------------
QUEUE_RECORD_WORDS = 4


class Queue(enum.IntEnum):
    """Queue ids. The attention queue is shared by every full-attention layer
    (host-written each step, one claim head per layer); MoE queues are per
    layer (device-written by ROUTE_FINALIZE): queue slot = layer."""

    ATTN = 0
    MOE_UP = 1
    MOE_DOWN = 2


QUEUE_RECORDS: dict[Queue, tuple[tuple[str, str], ...]] = {
    Queue.ATTN: (
        ("ROW", "batch row"),
        ("KV_HEAD", "kv head"),
        ("SPLIT", "KV split index"),
        ("NUM_SPLITS", "splits of this row"),
    ),
    Queue.MOE_UP: (
        ("EXPERT", "expert id"),
        ("N_TILE", "tile index over the interleaved gate/up rows"),
        ("SLOT0", "first routed slot of the expert"),
        ("ROWS", "routed rows of the expert"),
    ),
    Queue.MOE_DOWN: (
        ("EXPERT", "expert id"),
        ("N_TILE", "tile index over the hidden size"),
        ("SLOT0", "first routed slot of the expert"),
        ("ROWS", "routed rows of the expert"),
    ),
}


def record_index(queue: Queue, name: str) -> int:
    for i, (fname, _) in enumerate(QUEUE_RECORDS[queue]):
        if fname == name:
            return i
    raise KeyError(f"queue {queue.name} record has no field {name}")


# --------------------------------------------------------------------------
# Target words: int32 buffer read through DYN_FLAG references.
# Host region first (written before every launch), then the device region.
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class TargetWords:
    """Layout of the target-word buffer for one (batch, layers) geometry."""

    max_rows: int
    num_layers: int

    # host region
    @property
    def attn_queue_len(self) -> int:
        return 0

    def attn_splits_full(self, row: int) -> int:
        return 1 + row

    def attn_splits_sliding(self, row: int) -> int:
        return 1 + self.max_rows + row

    @property
    def host_words(self) -> int:
        return 1 + 2 * self.max_rows

    # device region (ROUTE_FINALIZE, one pair per layer)
    def moe_up_count(self, layer: int) -> int:
        return self.host_words + 2 * layer

    def moe_down_count(self, layer: int) -> int:
        return self.host_words + 2 * layer + 1

    @property
    def total(self) -> int:
        return self.host_words + 2 * self.num_layers


# --------------------------------------------------------------------------
#: integer sentinel a checking run writes into int scratch before a step
#: (float scratch gets NaN): an element read before it is written shows
INT_POISON = -7

#: the bits of an fp32 moe_out or router_part word not yet written this step.
#: The host fills both with them once (and again after an abort or a poisoned
#: step); a combine built to poll its experts' outputs instead of their
#: counter (MEGAC_COMBINE_POLL, moe_routing.cuh) reads its range until no word
#: holds them, then writes them back for the next step; a routed claimer built
#: to poll the router's partials (MEGAC_ROUTER_POLL) reads them likewise, and
#: the next layer's finalize writes them back. A NaN payload no arithmetic
#: produces (the GPU's NaN results are 0x7FFFFFFF), so a real NaN still lands.
UNLANDED_F32 = 0x7FBADBAD

# Watchdog status buffer: int32[STATUS_WORDS] per launch, zeroed by the host.
# Every bounded wait polls the abort word; the first wait to time out claims
# the record, writes and fences it, then raises the abort word to its kind.
# --------------------------------------------------------------------------
STATUS_WORDS = 16
STATUS_ABORT = 0  # 0 running, else the ErrorKind of the first failure
STATUS_CLAIM = 1  # atomicCAS 0 -> 1 by the CTA that writes the record
STATUS_TIMEOUTS = 2  # waits that timed out on their own (not via abort)
STATUS_DONE = 3  # 1 once the record is complete
STATUS_RECORD = 8  # first word of the record
ERROR_FIELDS = (
    ("SM", "CTA index = which task list"),
    ("TASK", "task index in that list"),
    ("OPCODE", "opcode of the waiting task"),
    ("COUNTER", "counter index waited on (ring slot for a pipeline stall)"),
    ("VALUE", "value seen last"),
    ("TARGET", "target waited for"),
    ("LAYER", "layer of the waiting task"),
    ("KIND", "ErrorKind"),
)
ERROR_WORDS = len(ERROR_FIELDS)
assert STATUS_RECORD + ERROR_WORDS <= STATUS_WORDS


class ErrorKind(enum.IntEnum):
    NONE = 0
    COUNTER_TIMEOUT = 1  # a counter never reached its target
    MBARRIER_TIMEOUT = 2  # a shared-memory pipeline stage never completed
    QUEUE_OVERFLOW = 3  # a claimer queue ran past its capacity
    BAD_TASK = 4  # an opcode or field the kernel does not know


DEFAULT_WATCHDOG_NS = 2_000_000_000


# --------------------------------------------------------------------------
# LM-head argmax record: one per (row, LM tile) in ``argmax_part``, so the
# greedy token of a row is found from lm_tiles records instead of the logits.
#
# The greedy rule, the same in every backend (VM, device, host reduction) and
# the same as torch.argmax / numpy.argmax over the full row, hence as the
# sampler's greedy over the logits:
#   * values are compared as the fp32 logits were stored (bf16 logits widened
#     exactly), so the token agrees with whoever reads the logits;
#   * the largest value wins; equal values (+0.0 == -0.0) go to the LOWER
#     vocabulary index;
#   * NaN ranks above every number (+inf included) and the lowest-index NaN
#     wins: a NaN logit is never skipped, and it surfaces as the record's (and
#     the greedy) value, where a caller can see it;
#   * ``value`` holds the bits of the logit at ``index``.
# --------------------------------------------------------------------------
ARGMAX_RECORD = (
    ("value", "f32", "greatest logit of the tile, bit-exact as stored in logits"),
    ("index", "i32", "its vocabulary index"),
)
#: 32-bit words per record; the VM keeps ``argmax_part`` as int32 [..., 2]
#: (word 0: the value's fp32 bits, word 1: the index), the device as the
#: generated ``megac::ArgmaxRecord``, 8-byte aligned: one 8-byte store each.
ARGMAX_RECORD_WORDS = len(ARGMAX_RECORD)
ARGMAX_RECORD_BYTES = 4 * ARGMAX_RECORD_WORDS


def argmax_select(values, indices) -> np.ndarray:
    """Position along the last axis of the winner among (value, index) pairs
    under the greedy rule above: ``values`` fp32, ``indices`` the vocabulary
    index each value stands for (broadcast against ``values``)."""
    v = np.asarray(values, dtype=np.float32)
    idx = np.broadcast_to(np.asarray(indices, dtype=np.int64), v.shape)
    nan = np.isnan(v)
    top = np.where(nan, -np.inf, v).max(axis=-1, keepdims=True)
    cand = np.where(nan.any(axis=-1, keepdims=True), nan, v == top)
    return np.where(cand, idx, np.iinfo(np.int64).max).argmin(axis=-1)


def argmax_reduce(records) -> tuple[np.ndarray, np.ndarray]:
    """Greedy token and its logit per row from ``records`` int32
    ``[..., lm_tiles, ARGMAX_RECORD_WORDS]`` (``argmax_part``): int64 tokens
    and fp32 values of shape ``[...]``. The one host-side reduction of the
    records; a NaN value means the row's logits hold a NaN."""
    rec = np.asarray(records)
    if rec.dtype != np.int32 or rec.shape[-1] != ARGMAX_RECORD_WORDS:
        raise ValueError(f"argmax records must be int32 [..., {ARGMAX_RECORD_WORDS}] (got {rec.dtype} "
                         f"{list(rec.shape)})")
    vals = rec[..., 0].view(np.float32)
    idx = rec[..., 1].astype(np.int64)
    pos = argmax_select(vals, idx)[..., None]
    return np.take_along_axis(idx, pos, -1)[..., 0], np.take_along_axis(vals, pos, -1)[..., 0]


# --------------------------------------------------------------------------
# KV layout
# --------------------------------------------------------------------------
KV_LAYOUT = {
    "k_pool": "[num_blocks, block_size, kv_heads, head_dim] bf16 (one pool for all layers); where the "
              "model's kv_head_major tile is 1, stored [num_blocks, kv_heads, block_size, head_dim] "
              "(opcodes/kv_pool.cuh) and seen by the host through a view of the first shape",
    "v_pool": "as k_pool",
    "page_table": "[num_layers, max_rows, max_blocks_per_seq] int32, -1 = unmapped/released",
    "seq_pos": "[max_rows] int32: tokens already cached = position of the current token",
    "row_active": "[max_rows] int32: a 0 row attends over an empty span, reads and writes no KV, and its outputs are ignored",
    "kv_tmaps": "two CUtensorMaps (K pool at +0, V pool at +128 bytes; 64-byte aligned) over the pools as "
                "stored (dims in memory order), box 16 tokens x 1 head x 64 dims, 128-byte "
                "swizzle, encoded by the host (megac.gpu.tensormap); a null pointer: the splits copy K/V "
                "in 16-byte pieces instead",
}


# --------------------------------------------------------------------------
# Launch descriptor: every pointer and scalar the kernel reads, filled by name.
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class DescField:
    name: str
    ctype: str  # "ptr", "i32", "f32", "u64"
    doc: str


_D = DescField
LAUNCH_DESC: tuple[DescField, ...] = (
    # schedule
    _D("tasks", "ptr", "int32 [num_sms, max_tasks, 32] task words"),
    _D("task_counts", "ptr", "int32 [num_sms] tasks per SM"),
    _D("max_tasks", "i32", "row stride of tasks"),
    _D("num_sms", "i32", "SMs the schedule was built for"),
    _D("counters", "ptr", "uint32 [num_counters], zeroed each step"),
    _D("num_counters", "i32", "counters in use"),
    _D("targets", "ptr", "int32 target words (TargetWords)"),
    _D("queue_heads", "ptr", "uint32 [3, num_layers] claim cursors, zeroed each step"),
    _D("attn_queue", "ptr", "int32 [attn_queue_cap, 4] host-written attention records"),
    _D("moe_up_queue", "ptr", "int32 [num_layers, moe_queue_cap, 4]"),
    _D("moe_down_queue", "ptr", "int32 [num_layers, moe_queue_cap, 4]"),
    _D("moe_queue_cap", "i32", "records per layer in each MoE queue (worst case)"),
    _D("status", "ptr", "int32 [STATUS_WORDS] watchdog status: abort word + error record"),
    _D("progress", "ptr", "int32 [num_sms] the task index each CTA started last, its task count once "
                          "all signalled (the watchdog report's map of who got where)"),
    _D("watchdog_ns", "u64", "bound of every wait"),
    # weights (layouts from the plan pass)
    _D("w_embed", "ptr", "bf16 [vocab, hidden]; also the LM head when tied"),
    _D("w_lm_head", "ptr", "bf16 [vocab, hidden]"),
    _D("w_norm", "ptr", "bf16 [2*num_layers+1, hidden] norm gammas (GAMMA index)"),
    _D("w_qkv", "ptr", "bf16 [num_layers, qkv_width, hidden]: Q rows, K rows, V rows"),
    _D("w_o", "ptr", "bf16 [num_layers, hidden, q_width]"),
    _D("w_upgate", "ptr", "bf16 [dense_layers, 2*dense_width, hidden], gate/up interleaved per tile"),
    _D("w_down", "ptr", "bf16 [dense_layers, hidden, dense_width]"),
    _D("w_router", "ptr", "bf16 [moe_layers, experts, hidden]"),
    _D("w_moe_upgate", "ptr", "bf16 [moe_layers, experts, 2*expert_width, hidden], interleaved per tile"),
    _D("w_moe_down", "ptr", "bf16 [moe_layers, experts, hidden, expert_width]"),
    _D("layer_slot", "ptr", "int32 [num_layers]: index of the layer in its dense/moe weight stack"),
    _D("rope_inv_freq", "ptr", "fp32 [head_dim/2]"),
    # KV
    _D("k_pool", "ptr", KV_LAYOUT["k_pool"]),
    _D("v_pool", "ptr", KV_LAYOUT["v_pool"]),
    _D("page_table", "ptr", KV_LAYOUT["page_table"]),
    _D("seq_pos", "ptr", KV_LAYOUT["seq_pos"]),
    _D("row_active", "ptr", KV_LAYOUT["row_active"]),
    _D("kv_tmaps", "ptr", KV_LAYOUT["kv_tmaps"]),
    _D("kv_block_size", "i32", "tokens per KV block"),
    _D("max_blocks_per_seq", "i32", "page table row length"),
    # activations / scratch (sizes from the buffer plan)
    _D("x_resid", "ptr", "fp32 [2*num_layers+1, rows, hidden] residual stream after each norm, slot = GAMMA index (slot 0: the embedding)"),
    _D("x_norm", "ptr", "bf16 [2*num_layers+1, rows, hidden] normed activations, slot = GAMMA index"),
    _D("q", "ptr", "bf16 [num_layers, rows, q_width]"),
    _D("attn_o_part", "ptr", "fp32 [num_layers, max_splits, rows, num_heads, head_dim], split-major"),
    _D("attn_lse_part", "ptr", "fp32 [num_layers, max_splits, rows, num_heads], split-major"),
    _D("attn_out", "ptr", "bf16 [num_layers, rows, q_width]"),
    _D("o_part", "ptr", "fp32 [num_layers, kv_heads, rows, hidden] O-proj split-K partials"),
    _D("ffn_act", "ptr", "bf16 [num_layers, rows, dense_width]"),
    _D("ffn_part", "ptr", "fp32 [num_layers, ffn_splits, rows, hidden]: dense down split-K partials, or the MoE combine in slot 0"),
    _D("router_part", "ptr", "fp32 [num_layers, router_splits, rows, experts]"),
    _D("topk_ids", "ptr", "int32 [num_layers, rows, top_k]"),
    _D("topk_w", "ptr", "fp32 [num_layers, rows, top_k]"),
    _D("route_slot", "ptr", "int32 [num_layers, rows, top_k]"),
    _D("moe_x", "ptr", "bf16 [num_layers, rows*top_k, hidden]"),
    _D("moe_act", "ptr", "bf16 [num_layers, rows*top_k, expert_width]"),
    _D("moe_out", "ptr", "fp32 [num_layers, rows*top_k, hidden]"),
    _D("logits", "ptr", "fp32 [rows, vocab]"),
    _D("argmax_part", "ptr", "ArgmaxRecord [rows, lm_tiles]: per LM tile its greedy (value, index)"),
    # scalars
    _D("rows", "i32", "batch rows of this schedule"),
    _D("num_layers", "i32", ""),
    _D("hidden", "i32", ""),
    _D("num_heads", "i32", ""),
    _D("kv_heads", "i32", ""),
    _D("head_dim", "i32", ""),
    _D("vocab", "i32", ""),
    _D("top_k", "i32", ""),
    _D("num_experts", "i32", ""),
    _D("expert_width", "i32", ""),
    _D("dense_width", "i32", ""),
    _D("max_splits", "i32", "attention partial slots per (row, head)"),
    _D("norm_eps", "f32", ""),
    _D("attn_scale", "f32", "1/sqrt(head_dim)"),
)
DESC_NAMES = tuple(f.name for f in LAUNCH_DESC)
assert len(set(DESC_NAMES)) == len(DESC_NAMES)


def opcode_table() -> list[dict]:
    """The opcode table as recorded in every manifest."""
    out = []
    for op in Op:
        out.append(
            {
                "opcode": int(op),
                "name": op.name,
                "doc": OP_DOC[op],
                "fields": {name: field_index(op, name) for name, _ in OP_FIELDS[op]},
            }
        )
    return out


def abi_summary() -> dict:
    """Machine-readable ABI (manifest, docs, codegen)."""
    return {
        "version": ABI_VERSION,
        "task_words": TASK_WORDS,
        "header": {name: i for i, (name, _) in enumerate(HEADER_FIELDS)},
        "no_counter": NO_COUNTER,
        "dyn_flag": DYN_FLAG,
        "flags": {f.name: int(f) for f in Flag if f.name and f != Flag.NONE},
        "opcodes": opcode_table(),
        "queues": {
            q.name: {name: i for i, (name, _) in enumerate(QUEUE_RECORDS[q])} for q in Queue
        },
        "queue_record_words": QUEUE_RECORD_WORDS,
        "status": {"words": STATUS_WORDS, "abort": STATUS_ABORT, "claim": STATUS_CLAIM,
                   "timeouts": STATUS_TIMEOUTS, "done": STATUS_DONE, "record": STATUS_RECORD},
        "error_record": [name for name, _ in ERROR_FIELDS],
        "unlanded_f32": UNLANDED_F32,
        "error_kinds": {k.name: int(k) for k in ErrorKind},
        "argmax_record": [list(f) for f in ARGMAX_RECORD],  # (name, ctype, doc)
        "argmax_record_bytes": ARGMAX_RECORD_BYTES,
        "kv_layout": KV_LAYOUT,
        "launch_descriptor": [(f.name, f.ctype) for f in LAUNCH_DESC],
    }


_CSIZE = {"ptr": 8, "u64": 8, "i32": 4, "f32": 4}


def descriptor_offsets() -> dict:
    """Byte offset of every launch-descriptor field (C alignment rules), so the
    host can pack the struct by name without a compiler."""
    off = 0
    fields = {}
    for f in LAUNCH_DESC:
        size = _CSIZE[f.ctype]
        off = (off + size - 1) // size * size
        fields[f.name] = off
        off += size
    return {"fields": fields, "size": (off + 7) // 8 * 8}


def pack_descriptor(values: dict) -> bytes:
    """Pack the launch descriptor by field name into the bytes of the C
    struct ``megac::LaunchDesc``. Every field must be given exactly once: a
    missing or unknown name is an error, so ABI drift fails at the first
    launch instead of reading a stale pointer."""
    import struct

    missing = [n for n in DESC_NAMES if n not in values]
    unknown = sorted(set(values) - set(DESC_NAMES))
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"unassigned: {', '.join(missing)}")
        if unknown:
            parts.append(f"unknown: {', '.join(unknown)}")
        raise ValueError("launch descriptor fields " + "; ".join(parts))
    layout = descriptor_offsets()
    buf = bytearray(layout["size"])
    fmt = {"ptr": "<Q", "u64": "<Q", "i32": "<i", "f32": "<f"}
    for f in LAUNCH_DESC:
        v = values[f.name]
        if f.ctype in ("ptr", "u64", "i32"):
            v = int(v)
        struct.pack_into(fmt[f.ctype], buf, layout["fields"][f.name], v)
    return bytes(buf)
