"""GPU battery block: device MoE routing (ROUTER_TOPK, ROUTE_FINALIZE,
MOE_GATHER, MOE_COMBINE).

Checks opcodes/tests/moe_routing_test.cu against a numpy reference of the
same semantics (``reference_route``: exact ids, slots, offsets and queues;
weights within 1 ulp of fp32), then times one routing step at BS 1 and 8.

    python -m megac.gpu.blocks.moe_routing --quick|--full [--json PATH]
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megac.gpu import build, launch
from megac.gpu.battery import block_main, check, time_cuda

REPO = Path(__file__).resolve().parents[3]
SOURCE = REPO / "opcodes" / "tests" / "moe_routing_test.cu"
SIGMOID, SOFTMAX = 0, 1
QUEUE_GUARD = 64  # records past the capacity that must stay untouched
SENTINEL = -7


def queue_capacity_rows(num_experts: int, entries: int, row_tile: int) -> int:
    """Mirror of megac::moe::queue_capacity_rows: worst-case row tiles."""
    return min(num_experts, entries) + entries // row_tile


def reference_route(logits: np.ndarray, k: int, mode: int, renorm: bool, row_tile: int, ntu: int, ntd: int) -> dict:
    """numpy semantics of TOPK + FINALIZE (see opcodes/moe_routing.cuh)."""
    rows, E = logits.shape
    ids = np.zeros((rows, k), np.int32)
    w = np.zeros((rows, k), np.float32)
    for r in range(rows):
        x = logits[r].astype(np.float64)
        order = np.lexsort((np.arange(E), -logits[r]))[:k]  # value desc, id asc
        ids[r] = order
        if mode == SIGMOID:
            w[r] = (1.0 / (1.0 + np.exp(-x[order]))).astype(np.float32)
        else:
            m = float(logits[r].max())
            s = np.exp(x - m).sum()
            wf = (np.exp(x[order] - m) / s).astype(np.float32)
            if renorm:
                tot = 0.0
                for j in range(k):
                    tot += float(wf[j])
                wf = (wf.astype(np.float64) / tot).astype(np.float32)
            w[r] = wf
    flat = ids.reshape(-1)
    counts = np.bincount(flat, minlength=E).astype(np.int32)
    offsets = np.zeros(E + 1, np.int32)
    offsets[1:] = np.cumsum(counts)
    seen = np.zeros(E, np.int32)
    slot = np.zeros(flat.size, np.int32)
    for i, e in enumerate(flat):
        slot[i] = offsets[e] + seen[e]
        seen[e] += 1
    slot_entry = np.zeros(flat.size, np.int32)
    slot_entry[slot] = np.arange(flat.size, dtype=np.int32)
    up, down = [], []
    for e in range(E):
        c = int(counts[e])
        for rt in range(-(-c // row_tile)):
            rec = lambda t: (e, t, int(offsets[e]) + rt * row_tile, min(row_tile, c - rt * row_tile))  # noqa: E731
            up += [rec(t) for t in range(ntu)]
            down += [rec(t) for t in range(ntd)]
    return {
        "ids": ids, "w": w, "counts": counts, "offsets": offsets, "slot": slot, "slot_entry": slot_entry,
        "queue_up": np.array(up, np.int32).reshape(-1, 4), "queue_down": np.array(down, np.int32).reshape(-1, 4),
        "qcount": np.array([len(up), len(down), int((counts > 0).sum()), flat.size], np.int32),
    }


def _module():
    cubin = build.build_cubin(SOURCE)
    return launch.load_module(cubin), cubin


class Router:
    def __init__(self, mod, rows, E, K, *, mode=SIGMOID, renorm=False, row_tile=16, ntu=12, ntd=16, D=2048, seed=0):
        import torch  # noqa: PLC0415

        self.mod = mod
        self.name = "moe_route_e32" if E <= 32 else "moe_route_e128"
        self.rows, self.E, self.K, self.mode, self.renorm = rows, E, K, mode, renorm
        self.row_tile, self.ntu, self.ntd, self.D = row_tile, ntu, ntd, D
        n = rows * K
        cap_rows = queue_capacity_rows(E, n, row_tile)
        self.cap_up, self.cap_down = cap_rows * ntu, cap_rows * ntd
        dev = "cuda"
        g = torch.Generator(device=dev).manual_seed(seed)
        i32 = torch.int32
        self.t = {
            "logits": torch.zeros((rows, E), device=dev),
            "topk_ids": torch.full((n,), SENTINEL, dtype=i32, device=dev),
            "topk_w": torch.full((n,), float("nan"), device=dev),
            "counts": torch.full((E,), SENTINEL, dtype=i32, device=dev),
            "offsets": torch.full((E + 1,), SENTINEL, dtype=i32, device=dev),
            "slot": torch.full((n,), SENTINEL, dtype=i32, device=dev),
            "slot_entry": torch.full((n,), SENTINEL, dtype=i32, device=dev),
            "queue_up": torch.full((self.cap_up + QUEUE_GUARD, 4), SENTINEL, dtype=i32, device=dev),
            "queue_down": torch.full((self.cap_down + QUEUE_GUARD, 4), SENTINEL, dtype=i32, device=dev),
            "qcount": torch.full((4,), SENTINEL, dtype=i32, device=dev),
            "x": torch.randn((rows, D), generator=g, device=dev).to(torch.bfloat16),
            "moe_x": torch.full((n, D), float("nan"), dtype=torch.bfloat16, device=dev),
            "y": torch.randn((n, D), generator=g, device=dev).to(torch.bfloat16),
            "out": torch.full((rows, D), float("nan"), device=dev),
            "counters": torch.zeros(4, dtype=i32, device=dev),
            "status": launch.new_status(),
        }
        self.step = 0
        self.smem = 4 * max(3 * E + 2 + n, 64)

    def launch(self, iters=1, phases=3):
        t = self.t
        i = np.int32
        args = (
            t["logits"], i(self.rows), i(self.E), i(self.K), i(self.mode), i(int(self.renorm)), i(self.row_tile),
            i(self.ntu), i(self.ntd), i(self.cap_up), i(self.cap_down), t["topk_ids"], t["topk_w"], t["counts"],
            t["offsets"], t["slot"], t["slot_entry"], t["queue_up"], t["queue_down"], t["qcount"], t["x"],
            t["moe_x"], t["y"], t["out"], i(self.D), t["counters"], t["status"], i(self.step), i(iters), i(phases),
        )
        launch.launch(self.mod, self.name, (launch.sm_count(),), (256,), args, self.smem, cooperative=True)
        self.step += iters


def _ulp_diff(a: np.ndarray, b: np.ndarray) -> int:
    ai = a.astype(np.float32).view(np.int32).astype(np.int64)
    bi = b.astype(np.float32).view(np.int32).astype(np.int64)
    return int(np.abs(ai - bi).max()) if a.size else 0


def compare(R: Router, logits: np.ndarray) -> tuple[bool, dict]:
    import torch  # noqa: PLC0415

    t = R.t
    ref = reference_route(logits, R.K, R.mode, R.renorm, R.row_tile, R.ntu, R.ntd)
    got = {k: t[k].cpu().numpy() for k in ("topk_ids", "topk_w", "counts", "offsets", "slot", "slot_entry", "qcount")}
    qu, qd = t["queue_up"].cpu().numpy(), t["queue_down"].cpu().numpy()
    nu, nd = int(ref["qcount"][0]), int(ref["qcount"][1])
    res = {
        "ids": np.array_equal(got["topk_ids"], ref["ids"].reshape(-1)),
        "counts": np.array_equal(got["counts"], ref["counts"]),
        "offsets": np.array_equal(got["offsets"], ref["offsets"]),
        "slot": np.array_equal(got["slot"], ref["slot"]),
        "slot_entry": np.array_equal(got["slot_entry"], ref["slot_entry"]),
        "qcount": np.array_equal(got["qcount"], ref["qcount"]),
        "queue_up": np.array_equal(qu[:nu], ref["queue_up"]),
        "queue_down": np.array_equal(qd[:nd], ref["queue_down"]),
        "queues_untouched_past_end": bool((qu[nu:] == SENTINEL).all() and (qd[nd:] == SENTINEL).all()),
        "within_capacity": nu <= R.cap_up and nd <= R.cap_down,
    }
    ulps = _ulp_diff(got["topk_w"], ref["w"].reshape(-1)) if res["ids"] else 1 << 30
    res["w_ulp"] = ulps
    # gather: every slot written with its row's vector, bit for bit
    x = t["x"].view(torch.int16).cpu().numpy()
    mx = t["moe_x"].view(torch.int16).cpu().numpy()
    rows_of_slot = ref["slot_entry"] // R.K
    res["gather"] = bool(np.array_equal(mx, x[rows_of_slot]))
    # combine: fp32 fma in k order (fp64 product then one rounding per step)
    y = t["y"].float().cpu().numpy()
    w = got["topk_w"].reshape(R.rows, R.K)
    acc = np.zeros((R.rows, R.D), np.float32)
    for j in range(R.K):
        ys = y[ref["slot"].reshape(R.rows, R.K)[:, j]]
        acc = (w[:, j : j + 1].astype(np.float64) * ys + acc).astype(np.float32)
    out = t["out"].cpu().numpy()
    cerr = float(np.abs(out - acc).max() / max(np.abs(acc).max(), 1e-30)) if not np.isnan(out).any() else float("inf")
    res["combine_rel"] = cerr
    ok = all(v for k, v in res.items() if isinstance(v, bool)) and ulps <= 1 and cerr <= 1e-6
    return ok, res


def make_logits(kind: str, rows: int, E: int, K: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "uniform":
        return rng.standard_normal((rows, E)).astype(np.float32)
    if kind == "skewed":  # a few hot experts
        x = rng.standard_normal((rows, E)).astype(np.float32)
        hot = rng.choice(E, size=max(1, E // 32), replace=False)
        x[:, hot] += 3.0
        return x
    if kind == "same8":  # every token to the same K experts
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
    if kind == "ties":  # many equal logits: lower id must win
        return (np.round(rng.standard_normal((rows, E)) * 2) / 2).astype(np.float32)
    raise ValueError(kind)


def run_case(mod, kind, rows, E, K, mode, renorm, row_tile, rng, seed):
    import torch  # noqa: PLC0415

    R = Router(mod, rows, E, K, mode=mode, renorm=renorm, row_tile=row_tile, seed=seed)
    logits = make_logits(kind, rows, E, K, rng)
    R.t["logits"].copy_(torch.from_numpy(logits))
    R.launch()
    torch.cuda.synchronize()
    launch.check_status(R.t["status"], R.t["counters"])
    ok, res = compare(R, logits)
    # determinism: a second launch writes the same bits
    snap = {k: R.t[k].clone() for k in ("topk_w", "slot", "queue_up", "queue_down", "out")}
    R.launch()
    torch.cuda.synchronize()
    launch.check_status(R.t["status"], R.t["counters"])
    same = all(torch.equal(snap[k].view(torch.int32) if snap[k].dtype == torch.float32 else snap[k],
                           R.t[k].view(torch.int32) if R.t[k].dtype == torch.float32 else R.t[k]) for k in snap)
    res["relaunch_identical"] = same
    return ok and same, res


def run(quick: bool) -> dict:
    import torch  # noqa: PLC0415

    mod, cubin = _module()

    checks = []
    sp = build.spills(cubin)
    checks.append(check("no_spills", not sp, sp or "0 spill bytes"))
    rng = np.random.default_rng(2026)
    seed = 0
    cases = []
    for E in (128, 32, 8):
        for kind in ("uniform", "skewed", "same8", "ties"):
            for rows in (1, 2, 4, 8, 16):
                if quick and E != 128 and rows not in (1, 8):
                    continue
                for mode, renorm in ((SIGMOID, False), (SOFTMAX, False), (SOFTMAX, True)):
                    if quick and (mode, renorm) != (SIGMOID, False) and rows != 8:
                        continue
                    cases.append((kind, rows, E, 8, mode, renorm, 16))
    cases.append(("all_hit", 16, 128, 8, SIGMOID, False, 16))
    cases.append(("all_hit", 16, 128, 8, SOFTMAX, True, 16))
    cases.append(("same8", 16, 128, 8, SIGMOID, False, 2))  # 8 row tiles per expert
    cases.append(("uniform", 8, 8, 4, SIGMOID, False, 3))
    cases.append(("uniform", 64, 128, 8, SIGMOID, False, 16))
    for kind, rows, E, K, mode, renorm, rt in cases:
        name = f"route_{kind}_r{rows}_e{E}_k{K}_{'sig' if mode == SIGMOID else 'smx'}{'_renorm' if renorm else ''}_rt{rt}"
        seed += 1
        try:
            ok, res = run_case(mod, kind, rows, E, K, mode, renorm, rt, rng, seed)
        except Exception as e:  # noqa: BLE001
            ok, res = False, f"{type(e).__name__}: {e}"
        checks.append(check(name, ok, res))
        if not ok and isinstance(res, str) and "Abort" in res:
            break

    # latency of one routing step (TOPK -> FINALIZE -> GATHER+COMBINE), E=128, k=8
    bench = []
    for rows in (1, 8):
        try:
            R = Router(mod, rows, 128, 8, seed=99)
            R.t["logits"].copy_(torch.randn((rows, 128), device="cuda"))
            one = time_cuda(lambda: R.launch(iters=1), reps=30 if quick else 100, warmup=5)
            many_n = 200
            many = time_cuda(lambda: R.launch(iters=many_n), reps=5 if quick else 20, warmup=2)
            gather_only = time_cuda(lambda: R.launch(iters=many_n, phases=1), reps=5 if quick else 20, warmup=2)
            torch.cuda.synchronize()
            launch.check_status(R.t["status"], R.t["counters"])
            bench.append({
                "name": f"route_step_bs{rows}_e128_k8",
                "bytes": 0,
                "time_us": round(many["median_us"] / many_n, 3),
                "tbps": None, "pct_ceiling": None, "pct_datasheet": None,
                "per_step_in_persistent_kernel_us": round(many["median_us"] / many_n, 3),
                "per_step_gather_only_us": round(gather_only["median_us"] / many_n, 3),
                "one_launch_us": round(one["median_us"], 3),
                "note": "latency-bound: TOPK -> FINALIZE -> GATHER+COMBINE, 3 counter hops per step",
            })
        except Exception as e:  # noqa: BLE001
            checks.append(check(f"bench_route_bs{rows}", False, f"{type(e).__name__}: {e}"))
    return {"block": "moe_routing", "checks": checks, "bench": bench}


if __name__ == "__main__":
    raise SystemExit(block_main("moe_routing", run))
