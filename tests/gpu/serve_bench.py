"""Issue 13's end-to-end serving figures, one command on the GPU machine:
the megakernel (``--backend cuda``) and the ``graphs`` baseline served by
the same engine, driven over HTTP.

* ``levels``: ``megac bench-serve`` at concurrency 1, 4 and 8 against
  SmolLM2 (real weights, the built-in coding and chat prompts) and North
  Mini Code (random weights, SmolLM2's tokenizer, random token prompts of
  1K-7K tokens); output tok/s, TTFT, TPOT, ITL per level.
* ``interfere`` (SmolLM2 only: its real weights give text, hence one
  stream chunk, per token; random weights' tokens often do not): 7 greedy
  streams decode; a 4K-token prompt arrives in the middle. Each stream's inter-token gaps before the arrival and while the
  prompt prefills, against the time of one prefill chunk (the engine
  prefills in chunks between decode steps, so a stream should wait at most
  about one chunk longer than a decode step).

    source scripts/gpu_env.sh && python3 -m gpu.serve_bench --out "$OUT" [--only smollm2-cuda ...]

``--dry-run`` serves SmolLM2 on the CPU VM with tiny lengths: the driver's
own check, here (~1 minute).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from gpu.serve_check import Server

#: (name, backend, serve arguments, bench-serve arguments)
SMOLLM2 = ["--max-model-len", "8192"]
#: NMC's tokenizer: SmolLM2's, from the GGUF, or (MEGAC_NMC_TOKENIZER) a directory
#: saved from it, which travels to the GPU machine without the 94 MB GGUF
NMC = ["north-mini-code", "--random-weights", "--tokenizer", os.environ.get("MEGAC_NMC_TOKENIZER", "smollm2"),
       "--max-model-len", "9216"]
SMOLLM2_LOAD = ["--dataset", "builtin", "--num-prompts", "24"]
NMC_LOAD = ["--endpoint-type", "openai", "--dataset", "random", "--num-prompts", "16", "--random-input-len", "4096",
            "--random-range-ratio", "0.75", "--random-output-len", "128"]
CASES = [("smollm2-cuda", "cuda", SMOLLM2, SMOLLM2_LOAD), ("smollm2-graphs", "graphs", SMOLLM2, SMOLLM2_LOAD),
         ("nmc-cuda", "cuda", NMC, NMC_LOAD), ("nmc-graphs", "graphs", NMC, NMC_LOAD)]
DRY = [("dry-cpu", "cpu", ["--max-model-len", "512"],
        ["--endpoint-type", "openai", "--dataset", "random", "--num-prompts", "2", "--random-input-len", "16",
         "--random-output-len", "4"])]


def _megac(*args) -> list[str]:
    return [sys.executable, "-c", "from megac.cli import main; main()", *map(str, args)]


def levels(srv: Server, load: list[str], out: Path, name: str, concurrency: str) -> dict:
    """``megac bench-serve`` against ``srv`` at every concurrency level."""
    path = out / f"serve-{name}.json"
    res = subprocess.run(_megac("bench-serve", "--port", srv.port, "--max-concurrency", concurrency, *load,
                                "--save-result", path), capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"bench-serve failed: {res.stderr[-2000:]}")
    print(res.stdout[-4000:], flush=True)
    return json.loads(path.read_text())


def _stream(base: str, prompt: list[int], n: int, stamps: list[float]) -> None:
    """One greedy completion over ``prompt`` (token ids), streamed; the
    arrival time of every chunk with text goes to ``stamps``."""
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True, "ignore_eos": True}
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())


def interfere(srv: Server, streams: int = 7, stream_tokens: int = 400, long_prompt: int = 4096,
              vocab: int = 40000, chunk: int | None = None) -> dict:
    # vocab: prompt ids drawn below it (SmolLM2's vocabulary is 49152)
    """See the module docstring. Gaps are split at the long prompt's send
    time and its first token: ``before`` (steady decoding) and ``during``."""
    import random

    rng = random.Random(0)
    stamps: list[list[float]] = [[] for _ in range(streams)]
    threads = [threading.Thread(target=_stream, args=(srv.base, [rng.randrange(3, vocab) for _ in range(32)],
                                                       stream_tokens, stamps[i])) for i in range(streams)]
    for t in threads:
        t.start()
    deadline = time.perf_counter() + 300
    # every stream in steady decoding (chunks carry text: a token that ends
    # inside a character sends none, so count loosely and never wait forever)
    while (min(len(s) for s in stamps) < stream_tokens // 4 and any(t.is_alive() for t in threads)
           and time.perf_counter() < deadline):
        time.sleep(0.05)
    first: list[float] = []
    t_send = time.perf_counter()
    _stream(srv.base, [rng.randrange(3, vocab) for _ in range(long_prompt)], 1, first)
    t_first = first[0] if first else time.perf_counter()
    for t in threads:
        t.join()
    before, during = [], []
    for s in stamps:
        for a, b in zip(s, s[1:]):
            (before if b < t_send else during if a < t_first else []).append((b - a) * 1e3)

    def p(xs, q):
        return round(sorted(xs)[min(len(xs) - 1, int(q * len(xs)))], 2) if xs else None

    return {"streams": streams, "long_prompt": long_prompt, "prefill_s": round(t_first - t_send, 3),
            "chunks": -(-long_prompt // chunk) if chunk else None,
            # an upper bound on one chunk's time: the prefill's span holds decode steps too
            "span_per_chunk_ms": round((t_first - t_send) * 1e3 / -(-long_prompt // chunk), 2) if chunk else None,
            "gap_ms_before": {"median": round(statistics.median(before), 2) if before else None,
                              "p99": p(before, 0.99), "max": p(before, 1.0)},
            "gap_ms_during": {"median": round(statistics.median(during), 2) if during else None,
                              "p99": p(during, 0.99), "max": p(during, 1.0), "n": len(during)}}


def main() -> None:
    ap = argparse.ArgumentParser(prog="gpu.serve_bench")
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", nargs="*", default=None, help="case names (default: all)")
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--parts", nargs="*", default=["levels", "interfere"])
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--decode-burst", type=int, default=1, help="megac serve --decode-burst for every case")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cases = DRY if a.dry_run else [c for c in CASES if a.only is None or c[0] in a.only]
    results = {}
    for name, backend, serve_args, load in cases:
        t0 = time.perf_counter()
        got: dict = {}
        try:
            with Server(8740, backend, extra=[*serve_args, "--decode-burst", str(a.decode_burst)]) as srv:
                got["ready_s"] = srv.ready_s
                m = re.search(r"prefill chunk (\d+)", srv.log_text())
                chunk = int(m.group(1)) if m else None
                if "levels" in a.parts:
                    got["levels"] = levels(srv, load, out, name, "1,2" if a.dry_run else a.concurrency)
                if "interfere" in a.parts and (a.dry_run or name.startswith("smollm2")):
                    got["interfere"] = (interfere(srv, 3, 16, 96, chunk=chunk) if a.dry_run
                                        else interfere(srv, chunk=chunk))
                got["log_tail"] = srv.log_text()[-1500:]
        except Exception as err:  # noqa: BLE001 -- report every case
            got["error"] = f"{type(err).__name__}: {err}"[:3000]
        got["seconds"] = round(time.perf_counter() - t0, 1)
        results[name] = got
        print(json.dumps({name: {k: v for k, v in got.items() if k not in ("levels", "log_tail")}}, indent=1),
              flush=True)
        (out / "serve_bench.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
