"""GPU battery block: paged flash-decode (ATTN_DECODE) + LSE combine (ATTN_COMBINE).

Runs the persistent test kernels of opcodes/tests/attention_test.cu against
an fp32 torch reference built from the same bf16 inputs, then measures KV
bandwidth against the streaming-read ceiling.

    python -m gpu.blocks.attention --quick|--full [--json PATH]

Variants (``VARIANTS``): K/V through tensor-memory copies (``*_tma``, the
production path; tensor maps over the pools from ``encode_pool_tmap``) or
16-byte cp.async producers, NMC and SmolLM2 shapes, 64- and 16-token pages.
Merges (``phases``): fused in the last-arriving split's control warp, on SMs
of their own, separate tasks, or spread per query head over every CTA's
merge warp; all give the same bits.

The split rule itself is ``megac.abi.split_range`` (the host mirror of
``megac::attn::split_range`` in opcodes/attention.cuh); ``plan_splits`` here
picks a row's split count from its own length only, which is what keeps
attention batch invariant.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from megac.gpu import build, launch
from gpu.battery import bench, block_main, ceiling_tbps, check, time_cuda

REPO = Path(__file__).resolve().parents[3]
SOURCE = REPO / "opcodes" / "tests" / "attention_test.cu"

# (entry point, head_dim, gqa, block_size, compute warps, stages, producer
# warps, K/V through tensor-memory copies, keys per compute warp of a tile)
VARIANTS = {
    "nmc": ("attn_h128_g8_b64_w4_p2_s4", 128, 8, 64, 4, 4, 2, False, 16),
    "nmc_s5": ("attn_h128_g8_b64_w4_p2_s5", 128, 8, 64, 4, 5, 2, False, 16),
    "nmc_b16": ("attn_h128_g8_b16_w4_p2_s4", 128, 8, 16, 4, 4, 2, False, 16),
    "smol": ("attn_h64_g3_b64_w4_p2_s8", 64, 3, 64, 4, 8, 2, False, 16),
    "nmc_tma": ("attn_h128_g8_b64_w4_tma_s4", 128, 8, 64, 4, 4, 1, True, 16),
    "nmc_tma_k32": ("attn_h128_g8_b64_w4k32_tma_s2", 128, 8, 64, 4, 2, 1, True, 32),
    "nmc_b16_tma": ("attn_h128_g8_b16_w4_tma_s4", 128, 8, 16, 4, 4, 1, True, 16),
    "smol_tma": ("attn_h64_g3_b64_w4_tma_s8", 64, 3, 64, 4, 8, 1, True, 16),
}


# --------------------------------------------------------------------------
# host-side split planning
# --------------------------------------------------------------------------


def plan_splits(seq_len: int, window: int, block: int, *, min_pages: int = 4, max_splits: int = 32) -> int:
    """Split count of one row, from its visible span alone (batch invariant):
    at least ``min_pages`` pages per split, at most ``max_splits`` splits."""
    hi = seq_len
    lo = hi - window if (window > 0 and hi > window) else 0
    pages = -(-(hi - (lo - lo % block)) // block)
    return max(1, min(max_splits, pages // min_pages))


# Every variant gets the whole 227 KB: what the decode stream leaves free
# (megac::attn::DecodeSmem) stages the partials of the fused combine.
SMEM_MAX = 227 * 1024

# `phases` bits of the test kernel (opcodes/tests/attention_test.cu).
DECODE, COMBINE, FUSED, COMBINE_CTAS, SPREAD = 1, 2, 4, 8, 32
# Partial buffers the test kernel rotates through (kBufs in attention_test.cu).
BUFS = 4


def _r128(n: int) -> int:
    return -(-n // 128) * 128


def smem_min_bytes(hd: int, gqa: int, warps: int, stages: int, kpw: int = 16) -> int:
    """Mirror of DecodeSmem<HD, GQA, NWARPS, STAGES, KPW>::kBytes."""
    kt = warps * kpw
    ring = stages * 2 * kt * hd * 2
    qslots = stages * _r128(gqa * hd * 2)
    barriers_flags = 128 + 128
    merge = warps * (32 + gqa * hd) * 4
    combine = _r128((64 * gqa + gqa) * 4) + 2 * gqa * hd * 4  # the control warp's
    return ring + qslots + barriers_flags + merge + combine


def smem_bytes(hd: int, gqa: int, warps: int, stages: int, kpw: int = 16) -> int:
    need = smem_min_bytes(hd, gqa, warps, stages, kpw)
    assert need <= SMEM_MAX, f"variant needs {need} B of shared memory"
    return SMEM_MAX


# --------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------


def _module():
    cubin = build.build_cubin(SOURCE)
    return launch.load_module(cubin), cubin


class Attn:
    """One kernel variant plus its launch arguments."""

    def __init__(self, mod, variant: str):

        self.launch_mod = launch
        self.mod = mod
        (self.name, self.hd, self.gqa, self.block, self.warps, self.stages, self.pwarps,
         self.tma, self.kpw) = VARIANTS[variant]
        self.tile = self.warps * self.kpw  # keys per ring slot
        self.smem = smem_bytes(self.hd, self.gqa, self.warps, self.stages, self.kpw)
        self.nsm = launch.sm_count()

    def run(self, st, *, epoch: int, phases: int = DECODE | FUSED, page_table=None, reps: int = 1,
            comb_ctas: int = 0, smem: int | None = None):
        """``reps`` steps in one launch, numbered epoch, epoch+1, ...; with
        page_table=None step e reads page-table copy (e-1) % copies.
        ``smem``: dynamic shared memory (default all of it; the least is
        ``smem_min_bytes``, where merges work through their partials in chunks).
        ``comb_ctas``: with COMBINE_CTAS, that many CTAs only merge."""
        if phases & SPREAD and phases & FUSED:
            # both would merge, in the same shared-memory work area
            raise ValueError("phases: SPREAD and FUSED both merge; pick one")
        pt = st["pt_all"] if page_table is None else page_table.unsqueeze(0)
        args = (
            st["q"], st["k"], st["v"], pt, st["seq_len"], st["chunk_splits"], st["merge_splits"],
            st["o_part"], st["lse_part"], st["out_all"], st["counters"], st["status"],
            np.int32(st["rows"]), np.int32(st["kv_heads"]), np.int32(pt.shape[-1]),
            np.int32(st["split_stride"]), np.int32(st["window"]), np.float32(1.0 / math.sqrt(self.hd)),
            np.int32(epoch), np.int32(phases), np.int32(reps), np.int32(pt.shape[0]),
            np.int32(comb_ctas),
            *(_tmap_args(st) if self.tma else (None, None)),
        )
        # compute warps + producer warps + the control and merge warps (attention_test.cu)
        threads = (self.warps + self.pwarps + 2) * 32
        launch.launch(self.mod, self.name, (self.nsm,), (threads,), args, smem or self.smem,
                      cooperative=True)


def encode_pool_tmap(pool, rows: int):
    """Tensor map (CUtensorMap, 128 bytes) over a K or V pool
    [num_blocks, BLOCK, kv_heads, HD] bf16 for the tensor-copy producer:
    box = `rows` tokens x 1 head x 64 dims, 128-byte swizzle (the layout of
    megac::attn::swz): the megakernel's encoder (megac.gpu.tensormap)."""
    from megac.gpu.tensormap import encode_pool  # noqa: PLC0415

    return encode_pool(pool, box_tokens=rows)


def _tmap_args(st):
    t = st["tmaps"]
    return (np.uint64(t.data_ptr()), np.uint64(t.data_ptr() + 128))


def make_state(a: Attn, seq_lens, kv_heads, window, chunk_splits, merge_splits=None, *, gen, extra_blocks=0, copies=1):
    """Random paged problem: shuffled physical blocks, NaN in every pool slot
    the kernel must not read (free blocks, tokens past seq_len, tokens that
    left the window) and -1 page-table entries for released pages."""
    import torch  # noqa: PLC0415

    dev = "cuda"
    rows = len(seq_lens)
    bs, hd, gqa = a.block, a.hd, a.gqa
    merge_splits = list(chunk_splits) if merge_splits is None else list(merge_splits)
    pages = [-(-s // bs) for s in seq_lens]
    max_pages = max(pages)
    total = sum(pages) * copies + extra_blocks
    perm = torch.randperm(total, generator=gen).numpy().astype(np.int32)
    pts = []
    cursor = 0
    for _ in range(copies):
        pt = np.full((rows, max_pages), -1, dtype=np.int32)
        for r, n in enumerate(pages):
            lo = seq_lens[r] - window if (window > 0 and seq_lens[r] > window) else 0
            pt[r, :n] = perm[cursor : cursor + n]
            cursor += n
            pt[r, : lo // bs] = -1  # pages that left the window are released
        pts.append(torch.from_numpy(pt).to(dev))
    # Pools can be GBs: draw them on the GPU, seeded from the CPU generator.
    g2 = torch.Generator(device=dev).manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
    k = torch.randn((total, bs, kv_heads, hd), generator=g2, device=dev, dtype=torch.bfloat16)
    v = torch.randn((total, bs, kv_heads, hd), generator=g2, device=dev, dtype=torch.bfloat16)
    used = torch.zeros(total * bs, dtype=torch.bool, device=dev)
    for pt in pts:
        for r, s in enumerate(seq_lens):
            lo = s - window if (window > 0 and s > window) else 0
            pos = torch.arange(lo, s, device=dev)
            blk = pt[r, pos // bs].long()
            used[blk * bs + pos % bs] = True
    k.view(total * bs, kv_heads, hd)[~used] = float("nan")
    v.view(total * bs, kv_heads, hd)[~used] = float("nan")
    q = (torch.randn((rows, kv_heads * gqa, hd), generator=g2, device=dev) * 2.0).to(torch.bfloat16)
    stride = max(merge_splits)
    st = {
        "rows": rows, "kv_heads": kv_heads, "window": window, "split_stride": stride,
        "seq_lens": list(seq_lens),
        "q": q, "k": k, "v": v,
        "page_table": pts[0], "pt_all": torch.stack(pts).contiguous(),
        "seq_len": torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        "chunk_splits": torch.tensor(chunk_splits, dtype=torch.int32, device=dev),
        "merge_splits": torch.tensor(merge_splits, dtype=torch.int32, device=dev),
        # BUFS buffers: step e uses (e-1) % BUFS (see attention_test.cu)
        "o_part": torch.full((BUFS, stride, rows, kv_heads * gqa, hd), float("nan"), device=dev),
        "lse_part": torch.full((BUFS, stride, rows, kv_heads * gqa), float("nan"), device=dev),
        # one output per buffer too: a late merge of step e must not land on
        # step e+1's output (attention_test.cu); "out" is step 1's
        "out_all": torch.full((BUFS, rows, kv_heads * gqa * hd), float("nan"), dtype=torch.bfloat16, device=dev),
        # arrivals of odd / even steps, then combines done (attention_test.cu)
        "counters": torch.zeros((BUFS + 1) * rows * kv_heads, dtype=torch.int32, device=dev),
        "status": a.launch_mod.new_status(),
    }
    st["out"] = st["out_all"][0]
    if a.tma:
        rows_box = a.tile if a.block >= a.tile else a.block
        maps = encode_pool_tmap(k, rows_box) + encode_pool_tmap(v, rows_box)
        st["tmaps"] = torch.frombuffer(bytearray(maps), dtype=torch.uint8).to(dev)
    return st


def fresh_outputs(st) -> None:
    """NaN outputs and zero counters, so a rerun must write everything again."""
    import torch  # noqa: PLC0415

    st["out_all"] = torch.full_like(st["out_all"], float("nan"))
    st["out"] = st["out_all"][0]
    st["counters"] = torch.zeros_like(st["counters"])


def reference(a: Attn, st):
    """fp32 attention over the visible keys of each row, gathered through the page table."""
    import torch  # noqa: PLC0415

    outs = []
    bs, hd, gqa, kvh = a.block, a.hd, a.gqa, st["kv_heads"]
    pt = st["page_table"].long()
    for r, s in enumerate(st["seq_lens"]):
        lo = s - st["window"] if (st["window"] > 0 and s > st["window"]) else 0
        pos = torch.arange(lo, s, device="cuda")
        blk = pt[r, pos // bs]
        K = st["k"][blk, pos % bs].float()  # [n, kvh, hd]
        V = st["v"][blk, pos % bs].float()
        Q = st["q"][r].float().view(kvh, gqa, hd)
        S = torch.einsum("hgd,nhd->hgn", Q, K) / math.sqrt(hd)
        P = torch.softmax(S, dim=-1)
        outs.append(torch.einsum("hgn,nhd->hgd", P, V).reshape(-1))
    return torch.stack(outs)


def _run_checked(a: Attn, st, epoch=1, page_table=None, phases=DECODE | FUSED, reps=1):
    import torch  # noqa: PLC0415

    a.run(st, epoch=epoch, page_table=page_table, phases=phases, reps=reps)
    torch.cuda.synchronize()
    a.launch_mod.check_status(st["status"], st["counters"])


def _errors(a: Attn, st, out=None):
    import torch  # noqa: PLC0415

    ref = reference(a, st)
    out = (st["out"] if out is None else out).float()
    nan = int(torch.isnan(out).sum().item())
    num = (out - ref).norm(dim=1)
    den = ref.norm(dim=1).clamp_min(1e-30)
    rel = (num / den).max().item() if nan == 0 else float("inf")
    return rel, nan


def correctness_case(a: Attn, name, seq_lens, kv_heads, window, splits=None, *, gen, tol=1e-2,
                     phases=DECODE | FUSED, reps=1, copies=1, comb_ctas=0):
    """reps > 1: that many steps in one launch (the pipelined path the bench
    times), each on its own page-table copy; the last step's output is checked."""
    splits = splits or [plan_splits(s, window, a.block) for s in seq_lens]
    st = make_state(a, seq_lens, kv_heads, window, splits, gen=gen, copies=copies)
    a.run(st, epoch=1, phases=phases, reps=reps, comb_ctas=comb_ctas)
    import torch  # noqa: PLC0415

    torch.cuda.synchronize()
    a.launch_mod.check_status(st["status"], st["counters"])
    st["page_table"] = st["pt_all"][(reps - 1) % copies]
    rel, nan = _errors(a, st, st["out_all"][(reps - 1) % BUFS])
    ok = nan == 0 and rel <= tol
    return check(name, ok, {"max_row_rel_err": rel, "nan_out": nan, "seq_lens": seq_lens[:8],
                            "splits": splits[:8], "window": window, "variant": a.name,
                            "phases": phases, "steps": reps, "comb_ctas": comb_ctas}), st


# --------------------------------------------------------------------------
# the battery block
# --------------------------------------------------------------------------


def _ceiling(mod, quick: bool) -> float:
    import torch  # noqa: PLC0415

    c = ceiling_tbps()
    if c:
        return c

    n_bytes = 2 << 30
    buf = torch.randint(-(2**31), 2**31 - 1, (n_bytes // 4,), dtype=torch.int32, device="cuda")
    sink = torch.zeros(1, dtype=torch.int64, device="cuda")
    nvec = np.uint64(n_bytes // 16)
    nsm = launch.sm_count()
    t = time_cuda(lambda: launch.launch(mod, "attn_ceiling_read", (nsm,), (1024,), (buf, nvec, sink)),
                  reps=10 if quick else 20)
    del buf
    return n_bytes / (t["median_us"] * 1e-6) / 1e12


def run(quick: bool) -> dict:
    import torch  # noqa: PLC0415

    mod, cubin = _module()

    checks = []
    sp = build.spills(cubin)
    checks.append(check("no_spills", not sp, sp or "0 spill bytes"))
    gen = torch.Generator().manual_seed(1234)
    A = {k: Attn(mod, k) for k in VARIANTS}
    # The host mirror of DecodeSmem::kBytes against the device's own figure.
    sizes = torch.zeros(len(A), dtype=torch.int32, device="cuda")
    for i, a in enumerate(A.values()):
        launch.launch(mod, a.name + "_smem_bytes", (1,), (1,), (sizes[i:],))
    dev_sizes = dict(zip(A, sizes.tolist()))
    host_sizes = {k: smem_min_bytes(a.hd, a.gqa, a.warps, a.stages, a.kpw) for k, a in A.items()}
    checks.append(check("smem_mirror_matches_device", dev_sizes == host_sizes,
                        {"device": dev_sizes, "host": host_sizes}))

    def guard(name, fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            checks.append(check(name, False, f"{type(e).__name__}: {e}"))

    # 1. contexts, one row, both GQA shapes, full and sliding window.
    ctxs = [1, 63, 64, 65, 1000, 8192, 32768, 131072] if not quick else [1, 63, 64, 65, 1000, 8192, 131072]
    for v, kvh in (("nmc", 4), ("smol", 3), ("nmc_tma", 4), ("smol_tma", 3), ("nmc_tma_k32", 4)):
        for w in (0, 4096):
            for c in ctxs:
                if v.startswith("smol") and c > 32768 and quick:
                    continue
                guard(f"{v}_ctx{c}_w{w}", lambda: checks.append(
                    correctness_case(A[v], f"{v}_ctx{c}_w{w}", [c], kvh, w, gen=gen)[0]))

    # 2. ragged batches.
    ragged = [1, 4097, 65, 8192, 63, 1000, 300, 20000]
    for v, kvh in (("nmc", 4), ("smol", 3), ("nmc_b16", 4), ("nmc_s5", 4), ("nmc_tma", 4),
                   ("nmc_b16_tma", 4), ("smol_tma", 3), ("nmc_tma_k32", 4)):
        for bsz in ((1, 2, 4, 8) if v in ("nmc", "smol", "nmc_tma") else (8,)):
            for w in (0, 4096):
                lens = ragged[:bsz]
                guard(f"{v}_ragged_bs{bsz}_w{w}", lambda: checks.append(
                    correctness_case(A[v], f"{v}_ragged_bs{bsz}_w{w}", lens, kvh, w, gen=gen)[0]))

    # 2b. the separate ATTN_COMBINE path (counter wait, standalone combine),
    # and several pipelined steps in one launch on both paths.
    for v, kvh in (("nmc", 4), ("smol", 3)):
        for w in (0, 4096):
            guard(f"{v}_separate_combine_w{w}", lambda: checks.append(correctness_case(
                A[v], f"{v}_separate_combine_w{w}", ragged, kvh, w, gen=gen, phases=DECODE | COMBINE)[0]))
    # Combine CTAs (the merges on SMs of their own, the BS 1 short-context
    # configuration of the bench): 1, 2 and 4 of them over ragged rows.
    for v, kvh in (("nmc", 4), ("smol", 3)):
        for w in (0, 4096):
            guard(f"{v}_spread_w{w}", lambda: checks.append(correctness_case(
                A[v], f"{v}_spread_w{w}", ragged, kvh, w, gen=gen, phases=DECODE | SPREAD)[0]))
            for cc in (1, 4):
                guard(f"{v}_combine_ctas{cc}_w{w}", lambda: checks.append(correctness_case(
                    A[v], f"{v}_combine_ctas{cc}_w{w}", ragged, kvh, w, gen=gen,
                    phases=DECODE | COMBINE_CTAS, comb_ctas=cc)[0]))
    # 9 steps: past the BUFS partial buffers, so the buffer-reuse waits run.
    for v, ph, tag, cc in (("nmc", DECODE | FUSED, "fused", 0), ("nmc", DECODE | COMBINE, "separate", 0),
                           ("nmc", DECODE | COMBINE_CTAS, "combine_ctas", 4),
                           ("nmc", DECODE | SPREAD, "spread", 0), ("smol", DECODE | SPREAD, "spread", 0),
                           ("nmc_tma", DECODE | SPREAD, "spread", 0), ("nmc_tma", DECODE | FUSED, "fused", 0),
                           ("nmc_tma_k32", DECODE | SPREAD, "spread", 0), ("nmc_tma_k32", DECODE | FUSED, "fused", 0),
                           ("nmc_b16_tma", DECODE | SPREAD, "spread", 0), ("smol_tma", DECODE | SPREAD, "spread", 0),
                           ("nmc_b16", DECODE | FUSED, "fused", 0), ("nmc_s5", DECODE | FUSED, "fused", 0),
                           ("smol", DECODE | FUSED, "fused", 0), ("smol", DECODE | COMBINE_CTAS, "combine_ctas", 2)):
        guard(f"{v}_{tag}_9steps", lambda: checks.append(correctness_case(
            A[v], f"{v}_{tag}_9steps", [8192, 1000, 20000, 65], 4 if v != "smol" else 3, 0,
            gen=gen, phases=ph, reps=9, copies=3, comb_ctas=cc)[0]))

    # 3. split counts 1..64 on one row (1000 keys: many trailing empty splits).
    scounts = range(1, 65) if not quick else (1, 2, 3, 5, 8, 13, 16, 31, 32, 33, 63, 64)
    for c in (1000, 8192):
        bad = []
        worst = 0.0
        for s in scounts:
            try:
                chk, st = correctness_case(A["nmc"], f"s{s}", [c], 4, 0, [s], gen=gen)
                worst = max(worst, json_rel(chk))
                if not chk["ok"]:
                    bad.append(s)
            except Exception as e:  # noqa: BLE001
                bad.append(f"{s}:{type(e).__name__}")
        checks.append(check(f"nmc_splits_1to64_ctx{c}", not bad, {"failed": bad, "worst_rel": worst,
                                                                  "counts": list(scounts)}))

    # 4. determinism, empty splits, NaN poisoning, batch invariance.
    def invariance():
        a = A["nmc"]
        lens = [8192, 1000, 65, 20000]
        splits = [plan_splits(s, 0, a.block) for s in lens]
        st = make_state(a, lens, 4, 0, splits, gen=gen)
        _run_checked(a, st, epoch=1)
        first = st["out"].clone()
        _run_checked(a, st, epoch=2)  # writes output buffer 1
        checks.append(check("two_launches_bit_identical", torch.equal(first.view(torch.int16), st["out_all"][1].view(torch.int16)), ""))
        # Extra empty splits: same chunking, 16 more (empty) splits merged.
        merge = [s + 16 for s in splits]
        st2 = dict(st)
        st2.update({
            "merge_splits": torch.tensor(merge, dtype=torch.int32, device="cuda"),
            "split_stride": max(merge),
            "o_part": torch.full((BUFS, max(merge), len(lens), 32, 128), float("nan"), device="cuda"),
            "lse_part": torch.full((BUFS, max(merge), len(lens), 32), float("nan"), device="cuda"),
        })
        fresh_outputs(st2)
        _run_checked(a, st2, epoch=1)
        same = torch.equal(first.view(torch.int16), st2["out"].view(torch.int16))
        tail = st2["lse_part"][0, max(splits):]
        lse_ok = bool(torch.isneginf(tail).logical_or(torch.isnan(tail)).all().item())
        checks.append(check("extra_empty_splits_bit_identical", same and lse_ok, {"merge": merge}))
        # A larger split count that gives the same chunk (1000 keys, 16 vs 20
        # splits -> 64-key chunks both ways).
        outs = []
        for s in (16, 20):
            st3 = make_state(a, [1000], 4, 0, [s], gen=torch.Generator().manual_seed(7))
            _run_checked(a, st3)
            outs.append(st3["out"].clone())
        checks.append(check("same_chunk_more_splits_bit_identical",
                            torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)), "1000 keys, 16 vs 20 splits"))
        # Batch invariance: row 1 alone == row 1 inside the batch.
        st4 = make_state(a, [lens[1]], 4, 0, [splits[1]], gen=gen)
        st4["q"].copy_(st["q"][1:2])
        st4["k"], st4["v"] = st["k"], st["v"]
        st4["pt_all"] = st["page_table"][1:2].unsqueeze(0).contiguous()
        _run_checked(a, st4)
        checks.append(check("batch_invariant_row", torch.equal(st4["out"][0].view(torch.int16), first[1].view(torch.int16)), ""))
        # The fused combine (last arriver) and the standalone one: same bits.
        st5 = dict(st)
        fresh_outputs(st5)
        _run_checked(a, st5, epoch=1, phases=DECODE | COMBINE)
        checks.append(check("fused_equals_separate_combine_bits",
                            torch.equal(first.view(torch.int16), st5["out"].view(torch.int16)), ""))
        fresh_outputs(st5)
        a.run(st5, epoch=1, phases=DECODE | COMBINE_CTAS, comb_ctas=3)
        torch.cuda.synchronize()
        a.launch_mod.check_status(st5["status"], st5["counters"])
        checks.append(check("fused_equals_combine_ctas_bits",
                            torch.equal(first.view(torch.int16), st5["out"].view(torch.int16)), ""))
        fresh_outputs(st5)
        a.run(st5, epoch=1, phases=DECODE | SPREAD)
        torch.cuda.synchronize()
        a.launch_mod.check_status(st5["status"], st5["counters"])
        checks.append(check("fused_equals_spread_merge_bits",
                            torch.equal(first.view(torch.int16), st5["out"].view(torch.int16)), ""))
        # The least shared memory: both merges then stage their partials in
        # chunks (32 splits do not fit at once); same bits.
        least = smem_min_bytes(a.hd, a.gqa, a.warps, a.stages, a.kpw)
        for ph, tag in ((DECODE | FUSED, "fused"), (DECODE | SPREAD, "spread")):
            fresh_outputs(st5)
            a.run(st5, epoch=1, phases=ph, smem=least)
            torch.cuda.synchronize()
            a.launch_mod.check_status(st5["status"], st5["counters"])
            checks.append(check(f"least_smem_{tag}_merge_bits",
                                torch.equal(first.view(torch.int16), st5["out"].view(torch.int16)),
                                f"{least} B of shared memory"))
        # Tensor copies and 16-byte copies fill the same swizzled tiles (masked
        # V rows zeroed either way): same bits.
        st6 = make_state(A["nmc_tma"], lens, 4, 0, splits, gen=gen)
        _run_checked(A["nmc"], st6, epoch=1)
        o_cp = st6["out"].clone()
        fresh_outputs(st6)
        _run_checked(A["nmc_tma"], st6, epoch=1)
        checks.append(check("tma_equals_cp_async_bits", torch.equal(o_cp.view(torch.int16), st6["out"].view(torch.int16)), ""))
        # NaN poisoning: every element of every row written (checked in all cases too).
        checks.append(check("nan_poison_fully_written", not torch.isnan(first.float()).any().item(), ""))

    guard("invariance", invariance)

    # 5. watchdog: a combine whose counter never arrives must exit, not hang.
    def watchdog():
        import time  # noqa: PLC0415

        a = A["nmc"]
        st = make_state(a, [1000], 4, 0, [4], gen=gen)
        t0 = time.time()
        a.run(st, epoch=1, phases=COMBINE)  # combine only: no decode ever signals
        torch.cuda.synchronize()
        dt = time.time() - t0
        words = st["status"].tolist()
        checks.append(check("watchdog_exits", words[0] == 1 and dt < 10, {"status": words, "wall_s": round(dt, 2)}))

    guard("watchdog", watchdog)

    # 6. bandwidth.
    benches = []
    try:
        ceil = _ceiling(mod, quick)
    except Exception as e:  # noqa: BLE001
        ceil = None
        checks.append(check("ceiling", False, str(e)))
    # (batch, context, splits, how the merges run): the planner's split count
    # (32 at BS 1, 8 at BS 8). Spread merges run on each CTA's merge warp;
    # the fused last-arriver merge runs on one control warp and costs ~12 us
    # at 32 splits: fine beside a 64 us step, not a 5 us one. K/V through
    # tensor copies (nmc_tma) is the production path; the cp.async stream
    # (nmc) and 32 keys per warp (nmc_tma_k32: less compute, same DRAM
    # stream) are kept beside it at BS 1 / 8K for comparison.
    cfgs = [("nmc_tma", 1, 8192, 32, "spread"), ("nmc", 1, 8192, 32, "spread"),
            ("nmc_tma_k32", 1, 8192, 32, "spread"),
            ("nmc_tma", 1, 8192, 32, "combine_ctas"),
            ("nmc_tma", 8, 8192, 8, "spread"), ("nmc_tma", 8, 8192, 8, "fused"),
            ("nmc_tma", 1, 131072, 32, "spread"), ("nmc_tma", 1, 131072, 32, "fused"),
            ("nmc_tma", 8, 131072, 8, "spread"), ("nmc_tma", 8, 131072, 8, "fused")]
    for var, bsz, ctx, s, mode in cfgs:
        try:
            benches.append(bench_case(A[var], bsz, ctx, s, mode, ceil, gen, layouts=1 if quick else 3))
        except Exception as e:  # noqa: BLE001
            checks.append(check(f"bench_{var}_bs{bsz}_ctx{ctx}_s{s}_{mode}", False, f"{type(e).__name__}: {e}"))
    return {"block": "attention", "checks": checks, "bench": benches, "ceiling_tbps": ceil}


def json_rel(chk) -> float:
    import json  # noqa: PLC0415

    try:
        return float(json.loads(chk["detail"])["max_row_rel_err"])
    except Exception:  # noqa: BLE001
        return float("inf")


def bench_case(a: Attn, bsz, ctx, s, mode, ceil, gen, layouts=3, copies=None):
    """KV bytes / time per attention step (decode + merge), NMC shapes.

    Steps run back to back inside one persistent launch, each on its own
    page-table copy over disjoint blocks (so the KV read never hits L2), and
    the time per step is the slope between launches of n and 4n steps, which
    leaves the launch's fixed cost (~50 us: cooperative launch, first TLB
    misses) out. Short steps are sensitive to where the random pages land in
    DRAM (+-10 % between layouts), so the figure is the median over
    ``layouts`` fresh random page layouts; decode alone is timed beside it.
    """
    import statistics  # noqa: PLC0415

    import torch  # noqa: PLC0415

    kvh = 4
    kv_bytes = bsz * ctx * kvh * a.hd * 2 * 2
    copies = copies or max(2, math.ceil(256e6 / kv_bytes))
    n0 = max(2, min(64, int(1e9 // kv_bytes)))
    tasks = bsz * kvh * s
    comb = launch.sm_count() - tasks if mode == "combine_ctas" else 0
    if mode == "combine_ctas" and comb < 1:
        raise ValueError(f"{tasks} decode tasks leave no SM for the merges")
    phases = DECODE | {"combine_ctas": COMBINE_CTAS, "fused": FUSED, "spread": SPREAD}[mode]

    def slope(st, ph):
        state = {"epoch": 1}
        st["counters"].zero_()
        times = {}
        for n in (n0, 4 * n0):
            def go(n=n):
                a.run(st, epoch=state["epoch"], phases=ph, reps=n, comb_ctas=comb)
                state["epoch"] += n
            times[n] = time_cuda(go, reps=5, warmup=1)["median_us"]
        torch.cuda.synchronize()
        a.launch_mod.check_status(st["status"], st["counters"])
        return (times[4 * n0] - times[n0]) / (3 * n0)

    full, dec = [], []
    for _ in range(layouts):
        st = make_state(a, [ctx] * bsz, kvh, 0, [s] * bsz, gen=gen, copies=copies)
        full.append(slope(st, phases))
        dec.append(slope(st, DECODE))
        del st
        torch.cuda.empty_cache()
    b = bench(f"{a.name}_bs{bsz}_ctx{ctx}_s{s}_{mode}", kv_bytes, statistics.median(full), ceil,
              merge=mode, comb_ctas=comb, layouts=layouts,
              per_layout_us=[round(x, 3) for x in full],
              decode_only_us=round(statistics.median(dec), 3),
              decode_only_pct_ceiling=round(100 * kv_bytes / (statistics.median(dec) * 1e-6) / 1e12 / ceil, 1) if ceil else None,
              steps_per_launch=[n0, 4 * n0], copies=copies, planner_splits=plan_splits(ctx, 0, a.block))
    return b


if __name__ == "__main__":
    raise SystemExit(block_main("attention", run))
