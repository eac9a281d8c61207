"""The floor under a CPU decode step of SmolLM2-135M: one token's GEMVs over
every weight matrix of the model (30 layers' QKV, O, gate/up, down, and the
tied LM head), timed with torch's own linear on this machine, in fp32 and
bf16. Nothing else a decode step does is counted, so tokens/s can only be
lower than 1000 / (this many ms). Issue 14 asks >= 30 tok/s from the VM.

    .venv/bin/python scripts/cpu_weight_stream_bound.py [--threads 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

# SmolLM2-135M: hidden 576, 9 heads of 64 (3 KV heads), MLP 1536, 30 layers, vocab 49152
HIDDEN, KV_WIDTH, MLP, LAYERS, VOCAB = 576, 192, 1536, 30, 49152


def matrices(dtype):
    per_layer = [(HIDDEN + 2 * KV_WIDTH, HIDDEN), (HIDDEN, HIDDEN), (MLP, HIDDEN), (MLP, HIDDEN), (HIDDEN, MLP)]
    return [torch.randn(shape, dtype=dtype) for _ in range(LAYERS) for shape in per_layer] + \
        [torch.randn(VOCAB, HIDDEN, dtype=dtype)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    for dtype in (torch.float32, torch.bfloat16):
        ws = matrices(dtype)
        xs = {k: torch.randn(1, k, dtype=dtype) for k in {w.shape[1] for w in ws}}
        nbytes = sum(w.numel() * w.element_size() for w in ws)
        times = []
        for _ in range(a.repeats + 1):
            t0 = time.perf_counter()
            with torch.no_grad():
                for w in ws:
                    torch.nn.functional.linear(xs[w.shape[1]], w)
            times.append(time.perf_counter() - t0)
        ms = statistics.median(times[1:]) * 1e3
        print(f"{str(dtype):15s} {nbytes / 1e6:6.0f} MB of weights: {ms:6.1f} ms per token "
              f"({nbytes / ms / 1e6:5.1f} GB/s) -> at most {1000 / ms:5.1f} tok/s")


if __name__ == "__main__":
    main()
