"""Where a CPU VM decode step of SmolLM2 spends its time (fast mode, batch 1).

::

    .venv/bin/python -m megac.vm.bench [--threads 1] [--steps 30] [--context 128]

Loads the embedded SmolLM2-135M-Instruct (fp32), compiles its batch-1
schedule, decodes ``--context`` tokens to fill the cache, then times
``--steps`` more: wall and CPU milliseconds per step (median of blocks of
ten), and per opcode the CPU time outside the GEMM row products next to the
products themselves (BLAS, bound by the weights streamed from memory: the
step's floor). Not a test: the figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch


def _load(tokens: int):
    """The VM backend over SmolLM2's batch-1 schedule, a KV cache for one row
    of ``tokens`` tokens, and its decode step."""
    from megac.kv.paged import PagedKVCache, blocks_for_tokens
    from megac.passes.pipeline import compile_schedules
    from megac.vm.backend import VMBackend
    from megac.weights.gguf import load_gguf

    spec, weights, _ = load_gguf(dtype=torch.float32)
    bucket = max(1024, tokens)
    comp = compile_schedules(spec, order="tuned", batch_sizes=[1], buckets=[bucket])
    kv = PagedKVCache(spec, max_rows=1, num_blocks=blocks_for_tokens(spec, bucket), max_context=bucket,
                      dtype=torch.float32)
    be = VMBackend(spec, weights, kv, comp.schedules)
    return be, be.decode_step(comp.schedules[0])


class _OpTimer:
    """CPU seconds per opcode (outside the products) and in the products."""

    def __init__(self, vm) -> None:
        self.by_op: Counter = Counter()
        self.gemm = 0.0
        self._wrap(vm)

    def _wrap(self, vm) -> None:
        execute, products = vm.execute, vm.products

        def timed_products(*a, **k):
            t = time.process_time()
            try:
                return products(*a, **k)
            finally:
                self.gemm += time.process_time() - t

        def timed_execute(d, words, key=None):
            t, g = time.process_time(), self.gemm
            execute(d, words, key)
            self.by_op[d.name] += (time.process_time() - t) - (self.gemm - g)

        vm.execute, vm.products = timed_execute, timed_products


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (megac serve's default: 1)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--context", type=int, default=128, help="tokens in the cache before the timed steps")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    be, step = _load(args.context + args.steps + 11)
    row = be.kv.allocate_row()
    tok = 100
    with torch.no_grad():
        for _ in range(args.context):
            tok = int(be.decode([row], [tok])[0].argmax())
        wall, cpu = [], []
        for _ in range(max(1, args.steps // 10)):
            t, c = time.perf_counter(), time.process_time()
            for _ in range(10):
                tok = int(be.decode([row], [tok])[0].argmax())
            wall.append((time.perf_counter() - t) / 10)
            cpu.append((time.process_time() - c) / 10)
        timer = _OpTimer(step.interp.ops)
        n = 10
        c = time.process_time()
        for _ in range(n):
            tok = int(be.decode([row], [tok])[0].argmax())
        total = (time.process_time() - c) / n
    ms = 1000.0
    print(f"SmolLM2 batch 1, {args.threads} thread(s), context {args.context}..{args.context + args.steps}: "
          f"{statistics.median(wall) * ms:.1f} ms/step wall ({1 / statistics.median(wall):.1f} tok/s), "
          f"{statistics.median(cpu) * ms:.1f} ms CPU")
    print(f"one instrumented step: {total * ms:.1f} ms CPU; GEMM row products {timer.gemm / n * ms:.1f} ms")
    for name, s in timer.by_op.most_common():
        print(f"  {name:16s} {s / n * ms:6.2f} ms")
    print(f"  {'outside the ops':16s} {(total - timer.gemm / n - sum(timer.by_op.values()) / n) * ms:6.2f} ms")


if __name__ == "__main__":
    main()
