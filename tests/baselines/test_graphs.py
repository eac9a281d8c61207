"""The ``graphs`` baseline (megac.baselines.graphs) on the CPU: its eager
PyTorch path decodes ragged batches over the shared paged KV cache to the
reference backend's and transformers' logits; its weights stay one copy;
it is reachable as ``--backend graphs``. On a GPU: graph replay gives the
eager step's logits.

Tolerance: everything in fp32, so the paths differ only in summation order
(attention over whole pages with masking, the MoE outputs summed in fp32
instead of accumulated per expert, fused Q/K/V and gate/up GEMMs); that is
~1e-7 relative here, and 1e-4 of the largest logit leaves room for other
BLAS builds while any real error (a wrong position, page, window edge or
expert) moves logits by O(1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from megac.baselines.graphs import GraphsBackend
from megac.kv.paged import PagedKVCache
from megac.runtime.backend import ReferenceBackend
from megac.spec import load_spec
from megac.weights.random import random_weights
from models import hf_last_logits, hf_model, variant

REL = 1e-4


def _kv(spec, rows=3, blocks=160, head_major=False):
    return PagedKVCache(spec, max_rows=rows, num_blocks=blocks, dtype=torch.float32, head_major=head_major)


def _prompts(spec, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, spec.vocab_size, (n,), generator=g).tolist() for n in lens]


def _start(backends, prompts):
    rows = list(range(len(prompts)))
    for be in backends:
        for r, p in zip(rows, prompts):
            be.kv.allocate_row(r)
            be.prefill(r, p)
    return rows


def _close(a, b, rel=REL):
    err = float((a - b).abs().max() / b.abs().max())
    assert err < rel, f"relative error {err:.2e}"


@pytest.mark.parametrize("name, head_major", [("tiny-moe", False), ("tiny-llama", False), ("tiny-moe", True)])
def test_ragged_batch_matches_reference(name, head_major):
    """3 rows of 5, 13 and 2 tokens decode 12 steps together: tiny-moe's
    sliding window (8) is crossed by every row, the 16-token pages by two;
    each step's logits are the reference backend's, row by row. Also over
    a head-major pool (the model's kv_head_major tile on a GPU): the
    baseline's writes and pages go through the pool's view."""
    spec = load_spec(name)
    w = random_weights(spec, seed=1, dtype=torch.float32)
    ref = ReferenceBackend(spec, w, _kv(spec))
    be = GraphsBackend(spec, w, _kv(spec, head_major=head_major), device="cpu")
    rows = _start([ref, be], _prompts(spec, [5, 13, 2]))
    tokens = [4, 5, 6]
    for _ in range(12):
        want = ref.decode(rows, tokens)
        got = be.decode(rows, tokens)
        _close(got, want)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        tokens = want.argmax(-1).tolist()
    assert list(be.kv.seq_pos[rows]) == list(ref.kv.seq_pos[rows]) == [17, 25, 14]


def test_rows_in_any_order_and_subsets():
    """A row's logits do not depend on which other rows share the step or
    where it sits in the batch (the step is batched, the rows independent)."""
    spec = load_spec("tiny-moe")
    w = random_weights(spec, seed=2, dtype=torch.float32)
    a = GraphsBackend(spec, w, _kv(spec), device="cpu")
    b = GraphsBackend(spec, w, _kv(spec), device="cpu")
    rows = _start([a, b], _prompts(spec, [9, 3, 20], seed=5))
    together = a.decode(rows, [10, 11, 12])
    alone = torch.stack([b.decode([r], [t])[0] for r, t in zip([2, 0, 1], [12, 10, 11])])
    _close(alone, together[[2, 0, 1]], rel=1e-5)


def test_sliding_window_and_softmax_router_match_transformers():
    """A window of 5 with 16-token pages (tokens leave the window inside a
    page), top-3 softmax routing, untied head: the decoded logits are
    transformers' full recompute of each row's sequence."""
    S = {"attention": "sliding", "window": 5, "rope": True, "ffn": "moe"}
    layers = [{"attention": "full", "window": None, "rope": True, "ffn": "dense"}, S, S,
              {"attention": "full", "window": None, "rope": False, "ffn": "moe"}, S]
    spec = variant("tiny-moe", "tiny-moe-w5", moe={"router": "softmax", "renormalize": False, "top_k": 3},
                   layers=layers, tie_embeddings=False)
    w = random_weights(spec, seed=4, dtype=torch.float32)
    model = hf_model(spec, w)
    be = GraphsBackend(spec, w, _kv(spec), device="cpu")
    prompts = _prompts(spec, [3, 11, 7], seed=9)
    rows = _start([be], prompts)
    seqs = [list(p) for p in prompts]
    tokens = [20, 21, 22]
    for step in range(8):
        got = be.decode(rows, tokens)
        for i, t in enumerate(tokens):
            seqs[i].append(t)
        if step in (3, 7):  # transformers recomputes the whole sequence: check a few steps (past the window)
            for i in range(len(rows)):
                _close(got[i], hf_last_logits(model, seqs[i]))
        tokens = got.argmax(-1).tolist()


def test_weights_are_used_in_place():
    """Q/K/V and gate/up become views of one fused tensor each, values
    unchanged; a second backend over the same weights reuses them."""
    spec = load_spec("tiny-moe")
    w = random_weights(spec, seed=1, dtype=torch.float32)
    before = {name: t.clone() for name, t in w.tensors()}
    a = GraphsBackend(spec, w, _kv(spec), device="cpu")
    b = GraphsBackend(spec, w, _kv(spec), device="cpu")
    for name, t in w.tensors():
        assert torch.equal(t, before[name]), name
    for i, lw in enumerate(w.layers):
        assert lw.q.data_ptr() == a.qkv[i].data_ptr() and lw.q._base is a.qkv[i]
        assert lw.k._base is a.qkv[i] and lw.v._base is a.qkv[i]
        assert b.qkv[i] is a.qkv[i] and b.gate_up[i] is a.gate_up[i]
        gate = lw.experts_gate if lw.is_moe else lw.gate
        assert gate._base is a.gate_up[i]
    assert w.nbytes() == sum(t.numel() * t.element_size() for t in before.values())


def test_registered_as_backend_and_bench_kind(tmp_path):
    from megac.bench_cli import bench_cmd
    from megac.runtime.backends import make_backend

    spec = load_spec("tiny-llama")
    w = random_weights(spec, seed=1, dtype=torch.float32)
    assert make_backend("graphs", spec, w, _kv(spec)).name == "graphs"
    out = tmp_path / "b.json"
    r = CliRunner().invoke(bench_cmd, ["tiny-moe", "--backend", "graphs", "--random-weights", "--batch-size", "1,3",
                                       "--context", "40", "--steps", "2", "--warmup", "1", "--json", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["run"]["backend"] == "graphs"
    assert [(x["batch"], x["context"]) for x in data["rows"]] == [(1, 40), (3, 40)]
    assert all(x["tok_s"] > 0 for x in data["rows"])


_KERNELS = r"""
import torch
from megac.baselines import flash_decode as fd, moe, elementwise as ew
from megac.spec import load_spec
torch.manual_seed(0)
B, H, KVH, hd, bs, NB, P = 3, 8, 2, 16, 16, 40, 8
kp, vp = torch.randn(NB, bs, KVH, hd), torch.randn(NB, bs, KVH, hd)
table = torch.randperm(NB)[:B * P].view(B, P).int()
table[0, 0] = -1  # released: row 0 at 40 with a window of 20 starts in page 1
pos, q = torch.tensor([40, 100, 5]), torch.randn(B, H, hd)
for window, splits in ((0, 1), (0, 5), (20, 3)):
    t = table.clone()
    if window == 0:
        t[0, 0] = 1
    a = fd._triton_attention(q, kp, vp, t, pos, window, 0.25, splits)
    assert (a - fd.torch_attention(q, kp, vp, t, pos, window=window, scale=0.25)).abs().max() < 1e-5
spec = load_spec("tiny-moe")
h, router = torch.randn(5, 64), torch.randn(8, 64)  # 5 rows: the routing's row padding is exercised
for rule, experts in (({}, 8), ({"router": "softmax", "renormalize": False, "top_k": 3}, 8), ({"renormalize": True}, 40)):
    m = spec.moe.model_copy(update=rule)
    r40 = torch.randn(experts, 64)  # 40 experts: three programs compute logits, the last one routes
    a, b = moe.route(h, r40, m, True), moe.route(h, r40, m, False)
    assert torch.equal(a.offs, b.offs) and torch.equal(a.src, b.src) and torch.equal(a.dest, b.dest)
    assert (a.weights - b.weights).abs().max() < 1e-6
    assert torch.equal(a.expert, b.expert)
    rows = ew.WeightedRows(torch.randn(5 * m.top_k, 64), a.dest, a.weights)
    x, d1, g = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64)
    for u, v in zip(ew.residual_rms_norm(x, [d1, rows], g, 1e-6, True), ew.residual_rms_norm(x, [d1, rows], g, 1e-6, False)):
        assert (u - v).abs().max() < 1e-5
gate_up, down = torch.randn(8, 64, 64) / 8, torch.randn(8, 64, 32) / 6  # 8 experts, width 32, hidden 64
for rows in (1, 5):
    x = torch.randn(rows, 64)
    r = moe.route(x, router, spec.moe, True)
    assert moe._kernels_fit(x, gate_up, down)
    assert (moe.experts(x, r, gate_up, down, True) - moe.experts(x, r, gate_up, down, False)).abs().max() < 1e-4
x, d1, d2, g = torch.randn(4, 64), torch.randn(4, 64), torch.randn(4, 64), torch.randn(64)
for ds in ([], [d1], [d1, d2]):
    for u, v in zip(ew.residual_rms_norm(x, ds, g, 1e-6, True), ew.residual_rms_norm(x, ds, g, 1e-6, False)):
        assert (u - v).abs().max() < 1e-5
for hd in (16, 24):  # 24: not a power of two, the kernel steps aside
    qkv, pos = torch.randn(3, 8 * hd), torch.tensor([0, 7, 300])
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2) / hd))
    blk, off = torch.tensor([1, 2, 3]), torch.tensor([0, 7, 12])
    for style in ("interleaved", "half"):
        for rotate in (True, False):
            outs = []
            for use in (True, False):
                kp, vp = torch.zeros(5, 16, 2, hd), torch.zeros(5, 16, 2, hd)
                q = ew.rope_store(qkv, 4, 2, hd, rotate=rotate, style=style, pos=pos, inv_freq=inv, cos_sin=None,
                                  k_pool=kp, v_pool=vp, blk=blk, off=off, triton_ok=use)
                outs.append((q, kp, vp))
            for u, v in zip(*outs):
                assert (u - v).abs().max() < 1e-5
from megac.baselines.gemv import CONFIGS, triton_linear
for rows, n, k in ((1, 48, 64), (3, 40, 512), (16, 64, 256)):
    x, w = torch.randn(rows, k), torch.randn(n, k)
    for cfg in CONFIGS:
        assert (triton_linear(x, w, cfg) - x @ w.T).abs().max() < 1e-3
print("ok")
"""


def test_triton_kernels_in_the_interpreter():
    """The Triton kernels against their PyTorch paths, run by Triton's CPU
    interpreter (only where triton is installed: not with the CPU-only
    torch of this project's venv; ``pip install --target DIR triton`` and
    PYTHONPATH=DIR runs it)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", _KERNELS], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


@pytest.mark.gpu
def test_graph_replay_equals_eager_on_gpu():
    """tiny-moe and tiny-llama in bf16 on the GPU: the replayed graph's
    logits are the eager step's (same kernels), and close to the fp32
    reference (bf16 weights and KV: cosine > 0.995)."""
    from gpu.graphs_check import tiny_case

    for name in ("tiny-moe", "tiny-llama"):
        res = tiny_case(name, steps=10)
        assert res["max_abs_diff_graph_vs_eager"] == 0.0, res
        assert res["worst_cosine_vs_reference"] > 0.995, res
        assert res["graphs_captured"] >= 1, res
