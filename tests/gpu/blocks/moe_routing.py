"""GPU battery block: device MoE routing (ROUTER_TOPK, ROUTE_FINALIZE,
MOE_GATHER, MOE_COMBINE).

Checks opcodes/tests/moe_routing_test.cu against megac/routing.py, the
routing math the CPU VM executes (the one reference; nothing is
re-implemented here):

- top-k ids, route slots, both queues' records and lengths: exact;
- weights: within 1 ulp of fp32 (both sides compute in fp64 and round once,
  but the device's fp64 ``exp`` and the CPU's may differ in the last fp64
  bit, which can move the rounded value by one ulp);
- gather: every slot holds its row's bf16 vector, bit for bit;
- combine: bit-exact against ``routing.combine`` applied to the DEVICE's
  weights (so a 1-ulp weight difference cannot leak in): both sides round
  each fp32 product and each fp32 sum once, in k order, so the tolerance is
  zero;
- every output starts NaN / sentinel-poisoned and must be fully written,
  queue words past the queue length must stay untouched, a second launch
  (re-poisoned) writes the same bits, and a queue one record too small
  raises the queue-overflow error record and writes no record.

Routings: uniform, skewed, every row to the same k experts, all experts hit,
ties, all-equal logits, NaN logits; 1, 2, 4, 8 and 64 rows; sigmoid and
softmax, renormalised or not. Then times one routing step at BS 1 and 8.

    python -m gpu.blocks.moe_routing --quick|--full [--json PATH]
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from megac import routing
from megac.abi import ErrorKind, Flag, Op
from megac.gpu import build, launch
from gpu.battery import block_main, check, time_cuda

REPO = Path(__file__).resolve().parents[3]
SOURCE = REPO / "opcodes" / "tests" / "moe_routing_test.cu"
MODES = {
    "sig": Flag.NONE,
    "sig_renorm": Flag.RENORMALIZE,
    "smx": Flag.SOFTMAX_ROUTER,
    "smx_renorm": Flag.SOFTMAX_ROUTER | Flag.RENORMALIZE,
}
# North Mini Code: router split-K 4, gate/up 2*768 in 128-row tiles, down
# 2048 in 128-column tiles.
NMC = {"num_splits": 4, "up_tiles": 12, "down_tiles": 16}
QUEUE_GUARD = 64  # records past the capacity that must stay untouched
SENTINEL = -7
THREADS = 256


def smem_bytes(num_experts: int, k: int, entries: int) -> int:
    """Mirror of megac::moe::finalize_smem_words and topk_smem_words (one
    row), at least the 64 words of gather and combine."""
    return 4 * max(3 * num_experts + 1 + entries, 2 * k + 3 * num_experts + 2, 64)


def reference(parts: np.ndarray, k: int, flags: int, up_tiles: int, down_tiles: int) -> dict:
    """TOPK + FINALIZE of router partials ``parts [S, rows, E]``, by megac.routing."""
    logits = routing.sum_splits(torch.from_numpy(parts))
    ids, w = routing.topk(logits, k, softmax=bool(flags & Flag.SOFTMAX_ROUTER),
                          renormalize=bool(flags & Flag.RENORMALIZE))
    route = routing.finalize(ids.numpy(), parts.shape[2])
    return {
        "ids": ids.numpy(), "w": w.numpy(), "slot": route.slot,
        "up": routing.queue_records(route, up_tiles), "down": routing.queue_records(route, down_tiles),
    }


class Router:
    """One configuration of the test kernel and its (poisoned) buffers."""

    OUTPUTS = ("topk_ids", "topk_w", "route_slot", "up_queue", "down_queue", "queue_len", "moe_x", "out")

    def __init__(self, mod, rows, E, K, *, num_splits, up_tiles, down_tiles, flags=Flag.NONE, D=2048,
                 queue_cap=None, seed=0):
        self.mod = mod
        self.name = "moe_route"
        self.rows, self.E, self.K, self.flags, self.nsp = rows, E, K, int(flags), num_splits
        self.ntu, self.ntd, self.D = up_tiles, down_tiles, D
        n = rows * K
        self.cap = routing.queue_capacity(E, n, max(up_tiles, down_tiles)) if queue_cap is None else queue_cap
        dev = "cuda"
        g = torch.Generator(device=dev).manual_seed(seed)
        i32 = torch.int32
        self.t = {
            "router_part": torch.zeros((num_splits, rows, E), device=dev),
            "topk_ids": torch.empty((rows, K), dtype=i32, device=dev),
            "topk_w": torch.empty((rows, K), device=dev),
            "route_slot": torch.empty((rows, K), dtype=i32, device=dev),
            "up_queue": torch.empty((self.cap + QUEUE_GUARD, 4), dtype=i32, device=dev),
            "down_queue": torch.empty((self.cap + QUEUE_GUARD, 4), dtype=i32, device=dev),
            "queue_len": torch.empty((2,), dtype=i32, device=dev),
            "x": torch.randn((rows, D), generator=g, device=dev).to(torch.bfloat16),
            "moe_x": torch.empty((n, D), dtype=torch.bfloat16, device=dev),
            "moe_out": torch.randn((n, D), generator=g, device=dev),
            "out": torch.empty((rows, D), device=dev),
            "counters": torch.zeros(4, dtype=i32, device=dev),
            "status": launch.new_status(),
        }
        self.poison()
        self.step = 0
        self.smem = smem_bytes(E, K, n)

    def poison(self):
        """NaN in float outputs, SENTINEL in integer ones: all must be rewritten."""
        for k in self.OUTPUTS:
            self.t[k].fill_(float("nan") if self.t[k].is_floating_point() else SENTINEL)

    def launch(self, iters=1, phases=3):
        t = self.t
        i = np.int32
        args = (
            t["router_part"], i(self.nsp), i(self.rows), i(self.E), i(self.K), i(self.flags), i(self.ntu),
            i(self.ntd), i(self.cap), t["topk_ids"], t["topk_w"], t["route_slot"], t["up_queue"],
            t["down_queue"], t["queue_len"], t["x"], t["moe_x"], t["moe_out"], t["out"], i(self.D),
            t["counters"], t["status"], i(self.step), i(iters), i(phases),
        )
        launch.launch(self.mod, self.name, (launch.sm_count(),), (THREADS,), args, self.smem, cooperative=True)
        self.step += iters

    def run_once(self):
        self.launch()
        torch.cuda.synchronize()
        launch.check_status(self.t["status"], self.t["counters"])

    def snapshot(self) -> dict:
        """Outputs as numpy; bf16 ones as their int16 bits (numpy has no bf16)."""
        out = {}
        for k in self.OUTPUTS:
            v = self.t[k]
            out[k] = (v.view(torch.int16) if v.dtype == torch.bfloat16 else v).cpu().numpy()
        return out


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.int32)


def _ulp_diff(a: np.ndarray, b: np.ndarray) -> int:
    """Largest ulp distance where both are numbers; 1 << 30 where only one is NaN."""
    na, nb = np.isnan(a), np.isnan(b)
    if (na != nb).any():
        return 1 << 30
    ai = _bits(a[~na]).astype(np.int64)
    bi = _bits(b[~nb]).astype(np.int64)
    return int(np.abs(ai - bi).max()) if ai.size else 0


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-identical, except that any NaN matches any NaN (payloads differ)."""
    na, nb = np.isnan(a), np.isnan(b)
    return bool((na == nb).all() and np.array_equal(_bits(a[~na]), _bits(b[~nb])))


def compare(R: Router, parts: np.ndarray, got: dict) -> tuple[bool, dict]:
    ref = reference(parts, R.K, R.flags, R.ntu, R.ntd)
    nu, nd = len(ref["up"]), len(ref["down"])
    res = {
        "ids": np.array_equal(got["topk_ids"], ref["ids"]),
        "route_slot": np.array_equal(got["route_slot"], ref["slot"]),
        "queue_len": np.array_equal(got["queue_len"], [nu, nd]),
        "up_queue": np.array_equal(got["up_queue"][:nu], ref["up"]),
        "down_queue": np.array_equal(got["down_queue"][:nd], ref["down"]),
        "queues_untouched_past_end": bool((got["up_queue"][nu:] == SENTINEL).all()
                                          and (got["down_queue"][nd:] == SENTINEL).all()),
        "within_capacity": max(nu, nd) <= R.cap,
    }
    res["w_ulp"] = _ulp_diff(got["topk_w"], ref["w"]) if res["ids"] else 1 << 30
    slot = ref["slot"].reshape(-1)
    row_of_slot = np.empty_like(slot)
    row_of_slot[slot] = np.arange(slot.size) // R.K
    x = R.t["x"].view(torch.int16).cpu().numpy()
    res["gather"] = bool(np.array_equal(got["moe_x"], x[row_of_slot]))
    y = R.t["moe_out"].cpu()[torch.from_numpy(ref["slot"])]  # [rows, K, D]
    want = routing.combine(torch.from_numpy(got["topk_w"]), y).numpy()
    res["combine_exact"] = _same_bits(got["out"], want)
    ok = all(v for v in res.values() if isinstance(v, bool)) and res["w_ulp"] <= 1
    return ok, res


def make_logits(kind: str, rows: int, E: int, K: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "uniform":
        return rng.standard_normal((rows, E)).astype(np.float32)
    if kind == "skewed":  # a few hot experts
        x = rng.standard_normal((rows, E)).astype(np.float32)
        hot = rng.choice(E, size=max(1, E // 32), replace=False)
        x[:, hot] += 3.0
        return x
    if kind == "same_k":  # every row to the same K experts (a row takes K distinct ones)
        x = rng.standard_normal((rows, E)).astype(np.float32) * 0.1
        hot = rng.choice(E, size=K, replace=False)
        x[:, hot] += 10.0 + rng.standard_normal((rows, K)).astype(np.float32) * 0.1
        return x
    if kind == "all_hit":  # row r's top K are experts K*r .. K*r+K-1 (permuted)
        x = rng.standard_normal((rows, E)).astype(np.float32) * 0.1
        perm = rng.permutation(E)
        for r in range(rows):
            x[r, perm[(K * r + np.arange(K)) % E]] += 10.0 + rng.random(K).astype(np.float32)
        return x
    if kind == "ties":  # many equal logits: the lower id must win
        return (np.round(rng.standard_normal((rows, E)) * 2) / 2).astype(np.float32)
    if kind == "equal":  # one big tie: every row to experts 0..K-1
        return np.full((rows, E), 0.5, np.float32)
    if kind == "nan":  # NaN sorts above every number
        x = rng.standard_normal((rows, E)).astype(np.float32)
        x[np.arange(rows)[:, None], rng.integers(0, E, (rows, 2))] = np.nan
        return x
    raise ValueError(kind)


def make_parts(kind: str, logits: np.ndarray, num_splits: int, rng: np.random.Generator) -> np.ndarray:
    """Split-K partials whose split-order sum is (about) ``logits``. Tie
    kinds get exact zeros in the other splits, so the ties survive the sum."""
    parts = np.zeros((num_splits,) + logits.shape, np.float32)
    parts[0] = logits
    if kind not in ("ties", "equal"):
        parts[1:] = rng.standard_normal(parts[1:].shape).astype(np.float32) * 0.05
    return parts


def run_case(mod, kind, rows, E, K, mode, rng, seed, **shape):
    R = Router(mod, rows, E, K, flags=MODES[mode], seed=seed, **shape)
    parts = make_parts(kind, make_logits(kind, rows, E, K, rng), R.nsp, rng)
    R.t["router_part"].copy_(torch.from_numpy(parts))
    R.run_once()
    first = R.snapshot()
    ok, res = compare(R, parts, first)
    R.poison()
    R.run_once()
    again = R.snapshot()
    res["relaunch_identical"] = all(_same_bits(first[k], again[k]) if first[k].dtype.kind == "f"
                                    else np.array_equal(first[k], again[k]) for k in first)
    return ok and res["relaunch_identical"], res


def overflow_case(mod, rng) -> tuple[bool, dict]:
    """Every expert active, queue one record short: the error record, no record written."""
    rows, E, K = 16, 128, 8
    need = E * max(NMC["up_tiles"], NMC["down_tiles"])
    R = Router(mod, rows, E, K, queue_cap=need - 1, seed=7, **NMC)
    parts = make_parts("all_hit", make_logits("all_hit", rows, E, K, rng), R.nsp, rng)
    R.t["router_part"].copy_(torch.from_numpy(parts))
    try:
        R.run_once()
        return False, "no error raised"
    except launch.DeviceAbortError as e:
        rec = e.record
    got = R.snapshot()
    res = {
        "kind": rec["kind"] == ErrorKind.QUEUE_OVERFLOW,
        "opcode": rec["opcode"] == Op.ROUTE_FINALIZE,
        "need_vs_cap": (rec["seen"], rec["target"]) == (need, need - 1),
        "no_record_written": bool((got["up_queue"] == SENTINEL).all() and (got["down_queue"] == SENTINEL).all()
                                  and (got["queue_len"] == SENTINEL).all()),
    }
    return all(res.values()), res


def _in_quick(E: int, rows: int, mode: str) -> bool:
    """Quick runs keep North Mini Code's E=128 at every batch in its own mode
    (sigmoid) and every mode at 8 and 64 rows; smaller E at 1 and 8 rows."""
    if E == 128 and (mode == "sig" or rows in (8, 64)):
        return True
    return rows in (1, 8) and mode in ("sig", "smx_renorm")


def cases(quick: bool) -> list[tuple]:
    """(kind, rows, E, K, mode, shape overrides)."""
    kinds = ("uniform", "skewed", "same_k", "all_hit", "ties", "equal")
    out = []
    for E in (128, 32, 8):
        for kind in kinds:
            for rows in (1, 2, 4, 8, 64):
                for mode in MODES:
                    if not quick or _in_quick(E, rows, mode):
                        out.append((kind, rows, E, 8, mode, NMC))
    out += [
        ("nan", 8, 128, 8, "sig", NMC),
        ("nan", 8, 128, 8, "smx", NMC),
        ("uniform", 8, 128, 1, "smx", NMC),  # k = 1: softmax weight exactly 1
        ("uniform", 8, 128, 1, "sig_renorm", NMC),
        ("uniform", 64, 8, 4, "smx_renorm", NMC),  # 32 rows per expert
        ("uniform", 8, 128, 8, "sig", {"num_splits": 1, "up_tiles": 3, "down_tiles": 5}),
        ("all_hit", 64, 128, 8, "smx", {"num_splits": 2, "up_tiles": 1, "down_tiles": 1}),
        # more router splits than a warp ranking loads at once (4): two rounds, and a short one
        ("uniform", 1, 128, 8, "sig", {"num_splits": 8, "up_tiles": 12, "down_tiles": 16}),
        ("ties", 1, 128, 8, "smx", {"num_splits": 5, "up_tiles": 12, "down_tiles": 16}),
        ("nan", 1, 128, 8, "sig_renorm", NMC),
        ("uniform", 2, 100, 6, "smx_renorm", NMC),  # E not a multiple of 32: lanes past E hold no key
    ]
    return out


def bench_step(mod, rows: int, quick: bool) -> dict:
    """Latency of one routing step (TOPK -> FINALIZE -> GATHER + COMBINE), E=128, k=8."""
    # The kernel's step targets assume every launch of a Router runs the same
    # phases, so the gather-only timing gets a Router of its own.
    R, G = (Router(mod, rows, 128, 8, seed=99, **NMC) for _ in range(2))
    for r in (R, G):
        r.t["router_part"].copy_(torch.randn((NMC["num_splits"], rows, 128), device="cuda"))
    one = time_cuda(lambda: R.launch(iters=1), reps=30 if quick else 100, warmup=5)
    many_n = 200
    many = time_cuda(lambda: R.launch(iters=many_n), reps=5 if quick else 20, warmup=2)
    gather_only = time_cuda(lambda: G.launch(iters=many_n, phases=1), reps=5 if quick else 20, warmup=2)
    torch.cuda.synchronize()
    for r in (R, G):
        launch.check_status(r.t["status"], r.t["counters"])
    return {
        "name": f"route_step_bs{rows}_e128_k8",
        "bytes": 0,
        "time_us": round(many["median_us"] / many_n, 3),
        "tbps": None, "pct_ceiling": None, "pct_datasheet": None,
        "per_step_in_persistent_kernel_us": round(many["median_us"] / many_n, 3),
        "per_step_gather_only_us": round(gather_only["median_us"] / many_n, 3),
        "one_launch_us": round(one["median_us"], 3),
        "note": "latency-bound: TOPK -> FINALIZE -> GATHER+COMBINE, 3 counter hops per step",
    }


# The builds every case runs on: the headers' default, and the one-row
# ranking on one warp (MEGAC_TOPK_WARP, moe_routing.cuh), which every TOPK
# task of this kernel takes (each ranks one row) and must match bit for bit.
BUILDS = {"": {}, "warp_": {"MEGAC_TOPK_WARP": 1}}


def run(quick: bool) -> dict:
    checks, bench = [], []
    for tag, defines in BUILDS.items():
        cubin = build.build_cubin(SOURCE, defines=defines)
        mod = launch.load_module(cubin)
        sp = build.spills(cubin)
        checks.append(check(f"{tag}no_spills", not sp, sp or "0 spill bytes"))
        rng = np.random.default_rng(2026)
        for seed, (kind, rows, E, K, mode, shape) in enumerate(cases(quick), start=1):
            tiles = f"s{shape['num_splits']}_t{shape['up_tiles']}x{shape['down_tiles']}"
            name = f"{tag}route_{kind}_r{rows}_e{E}_k{K}_{mode}_{tiles}"
            try:
                ok, res = run_case(mod, kind, rows, E, K, mode, rng, seed, **shape)
            except Exception as e:  # noqa: BLE001
                ok, res = False, f"{type(e).__name__}: {e}"
            checks.append(check(name, ok, res))
            if not ok and isinstance(res, str) and "abort" in res:
                break
        try:
            checks.append(check(f"{tag}route_queue_overflow_raises", *overflow_case(mod, rng)))
        except Exception as e:  # noqa: BLE001
            checks.append(check(f"{tag}route_queue_overflow_raises", False, f"{type(e).__name__}: {e}"))
        for rows in (1, 8):
            try:
                b = bench_step(mod, rows, quick)
                b["name"] = tag + b["name"]
                bench.append(b)
            except Exception as e:  # noqa: BLE001
                checks.append(check(f"{tag}bench_route_bs{rows}", False, f"{type(e).__name__}: {e}"))
    return {"block": "moe_routing", "checks": checks, "bench": bench}


if __name__ == "__main__":
    raise SystemExit(block_main("moe_routing", run))
