"""The generated megakernel on a GPU (marked ``gpu``: skipped without one).

Each check runs in its own subprocess (``python -m gpu.megakernel_check
--run NAME``: a hang or a sticky CUDA error cannot take the session down);
the assertions here are the acceptance criteria, with their reasons:

* bf16 against bf16 (the CPU VM, same weights): cosine >= 0.9999 -- the two
  differ only in fp32 summation order (measured >= 0.999997).
* against an fp32 reference on the same bf16-rounded weights: cosine >=
  0.999 -- bf16 activations through a few layers (measured >= 0.9996).
* greedy text against transformers' bf16 greedy: identical except where the
  fp32 model sees the two candidates within 0.1 logits (bf16 resolution of
  logits near 16-32 is 0.125).
* expert choices: identical except near-ties, margins <= 0.25 in router-logit
  units: router logits have unit scale, the bf16 path's hidden states drift
  ~1e-2 relative through 49 layers (measured margins up to 0.10 over 2103
  positions); a wrong expert would sit ~1.5 below the k-th (the median gap
  from the top 8 to a random one of 128).
"""

from __future__ import annotations

import math

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


def _run(name: str, tmp_path: Path, timeout: int = 600, **extra_env: str) -> dict:
    # artifacts in the tree's .gpucache (ignored by git): the cubin cache key
    # names include dirs relative to the repository, so cubins built once
    # (or carried in build/cubin) serve every later run
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"),
                                                          os.environ.get("PYTHONPATH", "")]),
               MEGAC_CACHE_DIR=str(ROOT / ".gpucache"), **extra_env)
    proc = subprocess.run([sys.executable, "-m", "gpu.megakernel_check", "--run", name, "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = tmp_path / "megakernel_check.json"
    assert out.is_file(), proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())[name]
    assert res["ok"], res.get("trace") or res.get("error")
    return res["result"]


def test_tiny_models_match_the_vm_and_are_batch_invariant(tmp_path):
    for name, r in _run("tiny", tmp_path).items():
        assert all(r["tokens_equal_vm"]), name
        assert r["min_cos_vs_vm"] >= 0.9999, name
        assert r["repeat_bit_identical"] and r["alone_equals_batch"], name
        assert r["adopted_step_bit_identical"], name


def test_broken_schedule_raises_a_hang_naming_the_root_cause(tmp_path):
    r = _run("hang", tmp_path)
    assert r["raised"] and r["seconds"] < 3.0
    assert r["root_names_broken_task"], r["message"]
    # a waiter downstream names the producers that never arrived; the broken
    # task itself (whichever wait expired first) has none missing
    assert r["missing"] or r["reporter_is_broken_task"], r["message"]
    assert r["next_launch_matches_vm"]


def test_sampling_on_the_gpu(tmp_path):
    """Greedy from the argmax records = argmax of the logits (every step);
    seeded draws on the GPU = the CPU sampler on the same logits and stream
    (a mismatch could only come from a last-ulp difference of log deciding a
    race, ~1e-7 per draw: none expected in 96); batched = alone; the seed
    matters; the draws spread (not one token repeated)."""
    r = _run("sampling", tmp_path)
    assert r["on_gpu"]
    assert r["records_equal_host_reduction_steps"] == r["steps"]
    assert r["greedy_equal_logits_argmax"][0] == r["greedy_equal_logits_argmax"][1]
    assert r["sampled_equal_cpu_sampler"][0] == r["sampled_equal_cpu_sampler"][1], r["mismatches"]
    assert all(r["seeded_batched_equals_alone"])
    assert r["other_seeds_differ"] >= 3 and r["distinct_sampled_tokens"] >= 20


def test_wave_orders_give_identical_bits(tmp_path):
    assert all(_run("orders", tmp_path).values())


def test_every_batch_size_equals_each_row_alone(tmp_path):
    assert _run("batch", tmp_path)["all"]


def test_rng_same_bits_on_cpu_and_gpu(tmp_path):
    assert all(_run("rng", tmp_path).values())


def test_further_configs_match_transformers(tmp_path):
    r = _run("configs", tmp_path)
    assert len(r) >= 4
    for name, x in r.items():
        assert x["min_cos"] >= 0.999, (name, x)
        assert all(m <= 0.05 for m in x["disagreement_margins"]), (name, x)


def test_contexts_to_128k_match_the_fp32_reference(tmp_path):
    r = _run("contexts", tmp_path)
    lens = [x["len"] for lab in r.values() for x in lab["rows"]]
    assert max(lens) >= 131000 and 32765 in lens
    # head sizes whose splits copy K/V in tensor-copy boxes, from NaN-filled pools
    assert {"mixed_hd64", "128k_hd64", "mixed_hd128", "128k_hd128"} <= set(r), sorted(r)
    for lab in r.values():
        for x in lab["rows"]:
            assert x["min_cos"] >= 0.999, x


def _routed_ok(r):
    assert r["min_cos"] >= 0.999, r
    for x in r["rows"]:
        assert x["max_near_tie_margin"] <= 0.25, x


def test_north_mini_code_slice(tmp_path):
    _routed_ok(_run("nmc_slice", tmp_path))


def test_split_down_slice_matches_the_fp32_reference(tmp_path):
    """The expert down projection split-K inside the up claims (target tile
    split_down, 128-feature up tiles: twelve partials per expert, the
    combine's 32 feature ranges a row): the same fp32 acceptance as the
    default slice (measured min cosine 0.99996, top-1 agreement 1.0)."""
    _routed_ok(_run("nmc_slice", tmp_path, MEGAC_CHECK_TILES="sd8_up128"))


def test_paired_up_claims_match_the_fp32_reference(tmp_path):
    """The batch-1 up claims in pairs (mk_core.cuh MEGAC_UP_PAIRS, TILES
    up128p: 128-row up tiles, the layer's first claims two adjacent tiles
    of one expert as one GEMM and two arrivals on its counter, its last 56
    one each): the default slice's acceptance at one row (measured, H100:
    min cosine 0.99997, top-1 agreement 1.0)."""
    _routed_ok(_run("nmc_slice", tmp_path, MEGAC_CHECK_TILES="up128p", MEGAC_CHECK_VARIANT="upair",
                    MEGAC_CHECK_ROWS="1"))


@pytest.mark.parametrize("rows", ["1", "2"])
def test_split_on_its_own_up_tiles_matches_the_fp32_reference(tmp_path, rows):
    """The batch-1 split on 128-row up tiles beside the 256-row tiles of
    the 2-row schedule, one weight layout interleaved in chunks of 64
    (geometry.moe_chunk_rows): one row runs the split tiles, two rows the
    plain tiles pairing two chunks each; the default slice's acceptance."""
    _routed_ok(_run("nmc_slice", tmp_path, MEGAC_CHECK_TILES="split1_own", MEGAC_CHECK_ROWS=rows))


@pytest.mark.parametrize("tmaps", ["1", "0"])
def test_head_major_kv_pools_match_the_fp32_reference(tmp_path, tmaps):
    """The KV pools head-major (target tile kv_head_major: a KV head's keys
    of a block contiguous; opcodes/kv_pool.cuh): the QKV tiles' writes, the
    prefill's (through the host's token-major view) and the attention
    splits' reads, by tensor copies and, without the maps, in 16-byte
    pieces: the default slice's acceptance at two rows."""
    _routed_ok(_run("nmc_slice", tmp_path, MEGAC_CHECK_TILES="kvh", MEGAC_KV_TMAPS=tmaps))


def test_north_mini_code_49_layers_crossing_buckets(tmp_path):
    r = _run("nmc_full", tmp_path)
    _routed_ok(r)
    # the schedule follows the longest row: 2048 -> 262144 mid-generation
    assert len(r["schedules_in_order"]) >= 2, r["schedules_in_order"]


def bf16_ulp(x: float) -> float:
    """The spacing of bf16 values at |x| (8 significant bits): 0.125 for
    16 <= |x| < 32."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 2.0 ** -133


def test_smollm2_greedy_text_matches_transformers(tmp_path):
    """Greedy text equals transformers' bf16 greedy text, except at near-ties
    (listed by the check): where the reference's own top-2 margin is at most
    one bf16 step of its top logit (transformers' logits are bf16: the two
    are adjacent values), or where the fp32 model puts the two tokens within
    0.1 logit (or prefers the megakernel's)."""
    r = _run("smollm2", tmp_path)
    assert r["prompts"] >= 20
    for x in r["rows"]:
        if not x["equal"]:
            tie = x["ref_margin_there"] <= bf16_ulp(x["ref_top_logit_there"])
            assert tie or x["fp32_margin_ref_over_megakernel"] < 0.1, x


def test_waves_baseline_equals_the_megakernel(tmp_path):
    """One launch per wave (megac.gpu.waves) gives the persistent
    megakernel's bits: the tiles and their sums are the same, only the
    launches differ; with a split claimer wave too (full-attn-half: an
    SM's later attention claimer joins the attention wave's launch)."""
    r = _run("waves", tmp_path)
    for order in ("tuned", "interleaved", "attention-first", "full-attn-half"):
        assert r[order], (order, r)
        assert r[f"{order}_step_graphs"] == 0 and r[f"{order}_wave_graphs"] != 0, (order, r)


def test_step_graph_gives_the_same_bits(tmp_path):
    """The step graph: the seed and the launch replayed as one CUDA graph
    give the separate launches' tokens and logits exactly."""
    r = _run("step_graph", tmp_path)
    assert r["bit_identical"] and r["graphs_captured"] > 0 and r["still_on"], r


def test_cached_prefix_turns_prefill_only_new_tokens(tmp_path):
    """Three turns over a 2K-token shared prefix on North Mini Code (sliding
    and full layers): each turn after the first finds the last prompt's full
    chunks and its text equals an engine without the cache's."""
    r = _run("prefix_turns", tmp_path, timeout=900)
    assert r["all_equal"] and r["hits_as_expected"] and r["every_turn_hit"], r


def test_ten_turns_over_a_6k_prefix_prefill_only_new_tokens(tmp_path):
    """Issue 13's case: 10 turns over a 6K-token shared prefix on North Mini
    Code; every turn after the first hits the cache on sliding and full
    layers and gives the uncached engine's text."""
    r = _run("prefix_turns10", tmp_path, timeout=900)
    assert r["all_equal"] and r["hits_as_expected"] and r["every_turn_hit"], r
    assert len(r["rows"]) == 10, r


def test_serve_with_the_cuda_backend(tmp_path):
    """SmolLM2 served from the GPU: plain and streamed chat agree, the
    official openai client streams chat (the same text) and completions, and
    8 concurrent greedy requests each get the text they get alone."""
    r = _run("serve", tmp_path)
    assert r["mentions_paris"], r
    assert r["streamed_equals_plain"], r
    assert r["openai_chat_stream_equals_plain"] and r["openai_completion_stream"].strip(), r
    assert all(r["concurrent_equal_alone"]) and len(r["concurrent_equal_alone"]) == 8, r


def test_a_hang_while_serving_fails_only_its_request(tmp_path):
    """A decode step launched with a broken task list (MEGAC_FAULT_HANG_STEPS):
    its request ends with an error, /health answers, the requests after it
    are served, and the log carries the hang record."""
    r = _run("serve_fault", tmp_path)
    assert len(r["failed"]) == 1, r
    assert r["health_after"] == 200 and r["served_after_fault"], r
    assert r["log_names_the_hang"], r


def test_a_hang_inside_a_decode_burst_fails_only_its_requests(tmp_path):
    """serve_fault with --decode-burst 4: the provoked hang falls inside a
    burst; the requests in that burst error, /health answers, later
    requests are served, and the log carries the hang record."""
    r = _run("serve_fault_burst", tmp_path)
    assert r["failed"] and r["health_after"] == 200 and r["served_after_fault"], r
    assert r["log_names_the_hang"], r


def test_top_k_and_gather_inside_route_finalize_change_no_bit(tmp_path):
    """The fused_topk build (ROUTE_FINALIZE ranks every row itself, no
    ROUTER_TOPK tasks) and the one that also gathers there (fused_gather,
    no MOE_GATHER tasks): tiny-moe matches the VM as the default build does,
    and North Mini Code's tokens and logits equal the default build's bit
    for bit."""
    r = _run("fused_topk", tmp_path, timeout=900)
    for key in ("tiny_moe", "tiny_moe_gather"):
        t = r[key]
        assert all(t["tokens_equal_vm"]) and t["min_cos_vs_vm"] >= 0.9999, (key, t)
        assert t["repeat_bit_identical"] and t["alone_equals_batch"], (key, t)
    for name in ("fused", "both"):
        assert all(r[f"nmc_{name}_tokens_equal"]) and r[f"nmc_{name}_logits_bit_identical"], (name, r)


def test_routed_claims_change_no_bit(tmp_path):
    """Routed claims (every expert up claimer ranks the rows itself and reads
    them from x_norm; no ROUTER_TOPK, no MOE_GATHER) at every batch size:
    tiny-moe matches the VM as the default build does, and North Mini Code's
    tokens and logits equal the default schedule's bit for bit."""
    r = _run("routed", tmp_path, timeout=900)
    t = r["tiny_moe"]
    assert all(t["tokens_equal_vm"]) and t["min_cos_vs_vm"] >= 0.9999, t
    assert t["repeat_bit_identical"] and t["alone_equals_batch"], t
    assert all(r["nmc_tokens_equal"]) and r["nmc_logits_bit_identical"], r


def test_every_opcode_output_matches_the_checked_vm(tmp_path):
    """One step from the same KV bits, every step-written buffer poisoned on
    both sides: the same elements written, ids/slots/queues exact, floats
    within 2e-2 of the buffer's scale (bf16 activations: a few ulps of 2^-8,
    propagated), argmax indices exact, counters equal, repeats bit-identical."""
    for model, r in _run("opcodes", tmp_path).items():
        assert r["counters_equal"] and r["repeat_bit_identical"], (model, r)
        for name, b in r["buffers"].items():
            assert "error" not in b, (model, name, b)
            if "exact" in b:
                assert b["exact"], (model, name)
            elif "index_exact" in b:
                assert b["index_exact"] and b["value_max_rel_diff"] <= 1e-2, (model, name, b)
            else:
                assert b["same_elements_written"] and b["max_rel_diff"] <= 2e-2, (model, name, b)


def test_pipelined_greedy_decoding_gives_the_same_tokens(tmp_path):
    """CudaBackend.decode_greedy_run (step i+1 queued before the host reads
    step i's tokens; tokens fed back on the device) gives the tokens of the
    same steps run one by one, at batch 1 and 3; so does the graphs
    baseline's pipelined loop."""
    r = _run("pipeline", tmp_path)
    assert r["bs1_equal"] and r["bs3_equal"], r
    assert r["graphs_bs1_equal"] and r["graphs_bs3_equal"], r


def test_serve_with_decode_bursts(tmp_path):
    """The serve check with --decode-burst 4 (the engine runs steady greedy
    batches 4 pipelined steps at a time): the same guarantees, 8 concurrent
    greedy requests each the text it gets alone."""
    r = _run("serve_burst", tmp_path)
    assert r["mentions_paris"] and r["streamed_equals_plain"], r
    assert all(r["concurrent_equal_alone"]) and len(r["concurrent_equal_alone"]) == 8, r


def test_profiled_step_has_every_task_and_the_marks_inside_them(tmp_path):
    """``megac bench --profile``'s path (the MEGAC_PROFILE build swapped in):
    every SM records its tasks, every opcode of the step appears, and the
    stamps inside the routing chain's, the norm's, the claimers' and a GEMM
    task's runs come in the order the code passes them, after the task's wait and
    before its end (the profile was silently empty while step graphs kept
    launching the plain build)."""
    r = _run("profile", tmp_path)
    nmc = r["north-mini-code"]
    assert nmc["sms"] == 132 and nmc["span_us"] > 0, nmc
    # batch 1 has routed claims (the target's routed_claims): no top-k task, the finalize ranks
    assert {"ROUTE_FINALIZE", "MOE_UPGATE_DRAIN", "ADD_RMSNORM", "LM_HEAD"} <= set(nmc["per_op"])
    routed = "ROUTER_TOPK" not in nmc["per_op"]
    inside = nmc["inside_tasks"]
    # a claimer's first claim: head, wait, its GEMM's four stamps, tile done; a static GEMM: those four;
    # a routed up claimer: partials summed, rows ranked, records derived (stamp 7), then the tile's five
    checks = [("ADD_RMSNORM", 2), ("MOE_UPGATE_DRAIN", 8 if routed else 7), ("MOE_DOWN_DRAIN", 7), ("QKV_PROJ", 4)]
    checks.append(("ROUTE_FINALIZE", 4) if routed else ("ROUTER_TOPK", 3))
    for op, n in checks:
        marks = list(inside[op]["marks_us"].values())
        assert len(marks) == n, (op, inside[op])
        if op == "MOE_UPGATE_DRAIN" and routed:
            marks = marks[:2] + marks[7:] + marks[2:7]  # in the order the code passes them
        # medians of ordered stamps stay ordered; the global timer may tick coarsely (<= 1 us)
        assert all(a <= b + 1.0 for a, b in zip(marks, marks[1:])), (op, inside[op])
        # the last stamp against the run of the tasks that reached every stamp: with 256-feature
        # expert tiles most up claimers claim nothing at batch 1 (48 claims, 132 claimers)
        run = inside[op].get("run_all_us") or inside[op]["run_us"]
        assert -1.0 <= marks[0] and marks[-1] <= run + 1.0, (op, inside[op])
    assert r["smollm2-135m"]["sms"] == 132
