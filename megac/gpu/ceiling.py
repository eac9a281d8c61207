"""The streaming-read ceiling ``megac bench`` holds a step against: the
fastest read of a random buffer far larger than L2 that the run can measure.

Why a kernel of our own and not ``torch.sum``: torch's reduction reads an
H200 at 4.18-4.35 TB/s, while 16-byte non-caching loads with four loads in
flight per thread read the same card at 4.54-4.64 TB/s (the battery's
ceiling block, ``opcodes/ceiling_read.cu``), and the megakernel's own weight
rings reach 4.62. A ceiling below what our own kernels stream makes every
"% of the ceiling" read ~7 % high. So the ceiling is the best of the read
kernel's two launch shapes and torch's sum (kept for context, and the
fallback where no cubin can be built or loaded).

The kernel folds every word into a 64-bit sum that is checked against an
exact one computed by torch, so a read that skipped bytes cannot pass as a
fast one: a kernel whose sum is wrong is not used.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from megac.resources import opcodes_dir

SOURCE = opcodes_dir() / "ceiling_read.cu"
KERNEL = "ceiling_read_u4"
#: (what the line calls it, CTAs per SM, threads per CTA): many CTAs, and the
#: megakernel's own shape (one 1024-thread CTA per SM); they read alike
SHAPES: tuple[tuple[str, int, int], ...] = (
    ("16 B nc loads, 4 CTAs x 512 threads per SM", 4, 512),
    ("16 B nc loads, 1 CTA x 1024 threads per SM", 1, 1024),
)
TORCH_SUM = "torch.sum (float32)"


@dataclasses.dataclass
class Ceiling:
    """The best read rate (B/s), which read gave it, every read's rate, and
    why a read was not used (empty when all were)."""

    bps: float
    method: str
    reads: dict[str, float]
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)

    def line(self) -> str:
        others = "; ".join(f"{k} {v / 1e12:.3f}" for k, v in self.reads.items() if k != self.method)
        text = f"streaming-read ceiling: {self.bps / 1e12:.3f} TB/s ({self.method}"
        text += f"; {others})" if others else ")"
        for k, why in self.skipped.items():
            text += f"\n  not used: {k}: {why}"
        return text

    def record(self) -> dict:
        return {"bps": self.bps, "method": self.method, "reads_bps": dict(self.reads), "skipped": dict(self.skipped)}


def random_words(n_words: int, seed: int):
    """Random int32 words on the GPU (never constant data: it could compress)."""
    import torch

    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (n_words,), dtype=torch.int32, device="cuda", generator=g)


def exact_sum(words, chunk: int = 1 << 25) -> int:
    """The words read as uint32, summed exactly mod 2**64: what the read
    kernel's sum must equal (int64 chunks of 256 MB: a GPU that holds a model
    has little room to spare)."""
    import torch

    total = 0
    for i in range(0, words.numel(), chunk):
        total += int((words[i : i + chunk].to(torch.int64) & 0xFFFFFFFF).sum().item())
    return total % (1 << 64)


def _median_s(fn, repeats: int, warmup_s: float, before=None) -> float:
    """Median seconds of ``fn`` over ``repeats`` timed runs, after
    ``warmup_s`` seconds of untimed ones (clocks ramp on an idle GPU)."""
    import torch

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warmup_s:
        fn()
        torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        if before is not None:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e-3)
    return statistics.median(out)


def _kernel_reads(words, nbytes: int, repeats: int, warmup_s: float) -> tuple[dict[str, float], dict[str, str]]:
    """Each launch shape's median read rate, or why there is none."""
    import numpy as np
    import torch

    from megac.gpu.build import CudaBuildError, build_cubin
    from megac.gpu.launch import launch, load_module, sm_count

    try:
        mod = load_module(build_cubin(SOURCE))
    except (CudaBuildError, ImportError, OSError, RuntimeError) as e:  # no nvcc nor carried cubin, no cupy, no driver
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return {}, {"read kernel": f"not built or loaded ({first})"}
    sms = sm_count()
    n_vec = np.uint64(nbytes // 16)
    out = torch.zeros(1, dtype=torch.int64, device="cuda")
    want = exact_sum(words)
    reads, skipped = {}, {}
    for name, per_sm, threads in SHAPES:
        def go(per_sm=per_sm, threads=threads):
            launch(mod, KERNEL, (sms * per_sm,), (threads,), (words, n_vec, out))

        out.zero_()
        go()
        torch.cuda.synchronize()
        got = int(out.item()) % (1 << 64)
        if got != want:
            skipped[name] = f"its sum {got} is not the data's {want}: it did not read every byte"
            continue
        reads[name] = nbytes / _median_s(go, repeats, warmup_s, before=out.zero_)
    return reads, skipped


def measure(nbytes: int = 4 << 30, repeats: int = 20, warmup_s: float = 1.0, kernel: bool = True) -> Ceiling:
    """The ceiling on the current CUDA device: each read's median over
    ``repeats`` full passes of ``nbytes`` random bytes, after ``warmup_s``
    seconds of untimed ones (an idle GPU's clocks ramp: the same H200 read
    3.82 TB/s right after an engine's build and 4.3 a few minutes later).
    ``kernel=False`` measures torch's sum alone."""
    import torch

    words = random_words(nbytes // 4, seed=20261206)
    try:
        reads, skipped = _kernel_reads(words, nbytes, repeats, warmup_s) if kernel else ({}, {})
        # torch's sum over the words as float32 (what megac bench read before this kernel: an int32 sum
        # widens to int64 and reads an H100 at 0.59 TB/s); the bits' NaNs cost a float add nothing
        floats = words.view(torch.float32)
        reads[TORCH_SUM] = nbytes / _median_s(lambda: floats.sum(), repeats, warmup_s)
        del floats
    finally:
        del words
        torch.cuda.empty_cache()
    method = max(reads, key=reads.get)
    return Ceiling(bps=reads[method], method=method, reads=reads, skipped=skipped)


__all__ = ["Ceiling", "KERNEL", "SHAPES", "SOURCE", "TORCH_SUM", "exact_sum", "measure", "random_words"]
