"""The generated megakernel of every bundled model shape compiles for
sm_90a without spills, its dispatch covers every opcode of the registry,
and a model the device code cannot take gets no megakernel and says why."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from megac import abi
from megac.artifact import write_artifact
from megac.codegen.megakernel import CUBIN, SOURCE, build_megakernel, prebuilt_cubin, render_megakernel
from megac.gpu.build import report
from megac.ops import REGISTRY
from megac.passes.pipeline import compile_schedules
from megac.spec import load_spec

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")


def _artifact(tmp_path, spec, batch_sizes):
    """``spec``'s schedules for ``batch_sizes`` compiled and written as a
    tuned artifact into ``tmp_path`` (what the builds below read)."""
    res = compile_schedules(spec, batch_sizes=batch_sizes)
    write_artifact(tmp_path, spec, res.schedules, order="tuned")
    return res


@needs_nvcc
@pytest.mark.parametrize("name", ["north-mini-code", "smollm2-135m", "tiny-moe"])
def test_megakernel_compiles_without_spills(name, tmp_path):
    spec = load_spec(name)
    _artifact(tmp_path, spec, [1, 8])
    cubin = build_megakernel(tmp_path)
    assert cubin == tmp_path / CUBIN and cubin.stat().st_size > 0
    k = report(cubin)["kernels"]["megakernel"]
    assert k["spill_stores"] == 0 and k["spill_loads"] == 0, k
    assert 0 < k["registers"] <= 255
    # 32 bytes: the error report's call; more is a local array on a hot path
    # (an accumulator indexed at run time cost ~60 %: see the test below)
    assert k["stack"] <= 32, k
    # a later run reuses it only while the source and every header are unchanged
    assert prebuilt_cubin(tmp_path) == cubin
    layout = tmp_path / "megac_layout.h"
    layout.write_text(layout.read_text() + "\n// edited\n")
    assert prebuilt_cubin(tmp_path) is None


@needs_nvcc
def test_head_major_kv_build_has_no_spills(tmp_path):
    """The KV pools head-major (target tile kv_head_major): the attention
    splits' and the QKV tiles' pool addresses (opcodes/kv_pool.cuh) compile
    without spills or a local array."""
    from models import variant

    llama = load_spec("tiny-llama")
    spec = variant(llama, "llama-kvh", tiles={"kv_head_major": 1})
    _artifact(tmp_path, spec, [1, 8])
    k = report(build_megakernel(tmp_path))["kernels"]["megakernel"]
    assert k["spill_stores"] == 0 and k["spill_loads"] == 0 and k["stack"] <= 32, k
    assert "KV_HEAD_MAJOR = 1;" in (tmp_path / SOURCE).read_text()


@needs_nvcc
def test_split_down_build_has_no_spills(tmp_path):
    """North Mini Code with the down projection split-K in the up claims
    (target tile split_down): the packed ring stages and the staged combine
    compile without spills or a local array, in shared memory that fits."""
    from models import variant

    nmc = load_spec("north-mini-code")
    spec = variant(nmc, "nmc-split", tiles={"split_down": 8, "moe_up_bn": 128})
    _artifact(tmp_path, spec, [1, 8])
    k = report(build_megakernel(tmp_path))["kernels"]["megakernel"]
    assert k["spill_stores"] == 0 and k["spill_loads"] == 0 and k["stack"] <= 32, k
    assert "MOE_OUT_TILES = 12;" in (tmp_path / SOURCE).read_text()


@needs_nvcc
def test_moe_out_bf16_build_has_no_spills_and_refuses_the_polled_combine(tmp_path):
    """North Mini Code with its experts' outputs in bf16 (target tile
    moe_out_bf16, opcodes/moe_out.cuh): the generated source says so, the
    build has no spills and other code than the default's (a guard that
    compiled the switch away would pass otherwise), and the combine that
    polls fp32 words (MEGAC_COMBINE_POLL) is refused beside it."""
    from megac.gpu.build import build_cubin
    from megac.resources import opcodes_dir
    from models import variant

    spec = variant(load_spec("north-mini-code"), "nmc-mob16", tiles={"moe_out_bf16": 1})
    on_dir, off_dir = tmp_path / "on", tmp_path / "off"
    on_dir.mkdir()
    off_dir.mkdir()
    _artifact(on_dir, spec, [1])
    _artifact(off_dir, load_spec("north-mini-code"), [1])
    assert re.search(r"#ifndef MEGAC_MOE_OUT_BF16\n#define MEGAC_MOE_OUT_BF16 1\n", (on_dir / SOURCE).read_text())
    assert re.search(r"#define MEGAC_MOE_OUT_BF16 0\n", (off_dir / SOURCE).read_text())
    on = build_cubin(on_dir / SOURCE, include_dirs=[opcodes_dir(), on_dir], cache_dir=on_dir / "cache")
    off = build_cubin(on_dir / SOURCE, defines={"MEGAC_MOE_OUT_BF16": 0}, include_dirs=[opcodes_dir(), on_dir],
                      cache_dir=on_dir / "cache-off")
    k = report(on)["kernels"]["megakernel"]
    assert k["spill_stores"] == 0 and k["spill_loads"] == 0 and k["stack"] <= 32, k
    assert on.read_bytes() != off.read_bytes()
    with pytest.raises(Exception, match="MEGAC_MOE_OUT_BF16"):
        build_cubin(on_dir / SOURCE, defines={"MEGAC_COMBINE_POLL": 1}, include_dirs=[opcodes_dir(), on_dir],
                    cache_dir=on_dir / "cache-poll")


@needs_nvcc
def test_ring_stages_of_ten_blocks_keep_the_accumulators_in_registers(tmp_path):
    # A GEMM ring of 10-block stages (gemm_tc.cuh MEGAC_TC_STAGE_BLOCKS) once
    # indexed the MMA accumulators at run time, so they lived in local memory
    # (96 bytes of stack; 49-80 % slower on the H200, read as "deeper rings
    # are slower" twice). The chain is the block's parity now: any even stage
    # keeps them in registers.
    from megac.gpu.build import build_cubin
    from megac.resources import opcodes_dir

    spec = load_spec("smollm2-135m")
    _artifact(tmp_path, spec, [1])
    cubin = build_cubin(tmp_path / SOURCE, defines={"MEGAC_TC_STAGE_BLOCKS": 10},
                        include_dirs=[opcodes_dir(), tmp_path], cache_dir=tmp_path / "cache")
    k = report(cubin)["kernels"]["megakernel"]
    assert k["spill_stores"] == 0 and k["stack"] <= 32, k


@needs_nvcc
def test_the_claimed_attention_prime_the_drained_stop_and_the_combine_folds_compile(tmp_path):
    # MEGAC_ATTN_CLAIM_PRIME (ops_attention.cuh AttnEarly): a claimed split
    # primes its tensor-copy ring before its wait. North Mini Code's 128-dim
    # heads take the tensor-copy form, so the switch must change the code
    # (a guard that compiled it away would pass unnoticed otherwise) and
    # keep it free of spills. Off, the default build's code is the old one.
    from megac.gpu.build import build_cubin
    from megac.resources import opcodes_dir

    spec = load_spec("north-mini-code")
    res = _artifact(tmp_path, spec, [1])
    inc = [opcodes_dir(), tmp_path]
    # and MEGAC_UP_DRAINED_STOP (ops_moe.cuh, on by default): a drained routed
    # up claimer stops before it ranks; and MEGAC_ROUTER_COMBINE (ops_gemm.cuh):
    # a ROUTER_GEMM tile flagged COMBINE_IN stages its K range of the residual
    # with the MoE combine added, gamma * x unnormalised (ops_norm.cuh
    # stage_combine_in), and a COMBINE_IN finalize scales the selected logits
    # by 1 / rms (moe_routing.cuh rows_inv_rms); its build says so to the host
    # (the megakernel_router_combine symbol); and MEGAC_QKV_COMBINE
    # (ops_gemm.cuh): a QKV tile flagged NORM_IN and ADD_MOE adds the MoE
    # combine in its fold (norm.cuh moe_add_vec; megakernel_qkv_combine); and
    # MEGAC_UP_COMBINE (ops_gemm.cuh up_fold_stage): a routed up claim flagged
    # NORM_IN and ADD_MOE stages the norm itself (megakernel_up_combine); and
    # MEGAC_RESID_BATCH (ops_norm.cuh): the router's residual form loads an
    # element's rows together.
    # Each switch on against it off; the folds' symbols follow their switch (the
    # schedules' default where another switch is toggled: codegen's
    # switch_defaults)
    from megac.codegen.megakernel import switch_defaults

    defaults = dict(switch_defaults(res.schedules))
    symbols = {"MEGAC_ROUTER_COMBINE": b"megakernel_router_combine", "MEGAC_QKV_COMBINE": b"megakernel_qkv_combine",
               "MEGAC_UP_COMBINE": b"megakernel_up_combine"}
    for switch in ("MEGAC_ATTN_CLAIM_PRIME", "MEGAC_UP_DRAINED_STOP", "MEGAC_ROUTER_COMBINE", "MEGAC_QKV_COMBINE",
                   "MEGAC_UP_COMBINE", "MEGAC_RESID_BATCH"):
        on, off = (build_cubin(tmp_path / SOURCE, defines={switch: v}, include_dirs=inc,
                               cache_dir=tmp_path / f"{switch}-{v}") for v in (1, 0))
        k = report(on)["kernels"]["megakernel"]
        assert k["spill_stores"] == 0 and k["spill_loads"] == 0 and k["stack"] <= 32, (switch, k)
        assert on.read_bytes() != off.read_bytes(), switch
        for name, sym in symbols.items():
            want = [True, False] if switch == name else [bool(defaults[name])] * 2
            assert [sym in c.read_bytes() for c in (on, off)] == want, (switch, name)
    # the claim's early X copies would read its rows before its wait on the norm (ops_moe.cuh): refused
    assert defaults["MEGAC_ROUTER_COMBINE"]
    with pytest.raises(Exception, match="MEGAC_UP_FIRST_EARLY"):
        build_cubin(tmp_path / SOURCE, defines={"MEGAC_UP_FIRST_EARLY": 1}, include_dirs=inc,
                    cache_dir=tmp_path / "first-early")


@needs_nvcc
def test_the_paired_claims_and_the_slots_probe_compile(tmp_path):
    # The fiftieth session's switches, off by default: the routed up claims
    # in pairs (mk_core.cuh MEGAC_UP_PAIRS) beside the paired down claims
    # (MEGAC_DOWN_PAIRS: the claim loop's signal then counts a claim's
    # records for either queue), and the folds' slots loaded before the
    # waits (norm.cuh MEGAC_SLOTS_EARLY, a timing probe). One North Mini Code
    # build with all three: no spills, and other code than the default's (a
    # guard that compiled them away would pass unnoticed otherwise). Pairs
    # derive each claim's tiles from its index, so the early first claim
    # (MEGAC_UP_FIRST_EARLY, one tile a claim) is refused beside them.
    from megac.gpu.build import build_cubin
    from megac.resources import opcodes_dir

    spec = load_spec("north-mini-code")
    _artifact(tmp_path, spec, [1])
    inc = [opcodes_dir(), tmp_path]
    # (and the fifty-second session's early read of the up claims' wait, ops_moe.cuh MEGAC_UP_WAIT_EARLY;
    # the fifty-third's waits with four polls in flight, counters.cuh MEGAC_POLL_DEPTH, and the routed claimers
    # polling the router's partials, common.cuh MEGAC_ROUTER_POLL, whose warp 1 then reads the claims' wait until
    # warp 0 has ranked; the fifty-fourth's probe of claims that skip that wait, MEGAC_PROBE_UP_NO_NORM, and the
    # form that waits on the norm before it polls, MEGAC_ROUTER_POLL 2: the first form's code and that wait; the
    # fifty-fifth's polls in the full-attention layers alone, MEGAC_ROUTER_POLL_FULL; the fifty-sixth's probes of
    # folds that load half their planes, norm.cuh MEGAC_PROBE_FOLD_HALF, and of QKV tiles that skip their waits,
    # mk_core.cuh MEGAC_PROBE_QKV_NO_WAIT)
    on = build_cubin(tmp_path / SOURCE, defines={"MEGAC_UP_PAIRS": 56, "MEGAC_DOWN_PAIRS": 26, "MEGAC_SLOTS_EARLY": 1,
                                                 "MEGAC_UP_WAIT_EARLY": 1, "MEGAC_POLL_DEPTH": 4,
                                                 "MEGAC_ROUTER_POLL": 2, "MEGAC_PROBE_UP_NO_NORM": 1,
                                                 "MEGAC_ROUTER_POLL_FULL": 1, "MEGAC_PROBE_FOLD_HALF": 1,
                                                 "MEGAC_PROBE_QKV_NO_WAIT": 1},
                     include_dirs=inc, cache_dir=tmp_path / "on")
    off = build_cubin(tmp_path / SOURCE, include_dirs=inc, cache_dir=tmp_path / "off")
    k = report(on)["kernels"]["megakernel"]
    assert k["spill_stores"] == 0 and k["spill_loads"] == 0 and k["stack"] <= 32, k
    assert on.read_bytes() != off.read_bytes()
    with pytest.raises(Exception, match="MEGAC_UP_PAIRS"):
        build_cubin(tmp_path / SOURCE, defines={"MEGAC_UP_PAIRS": 56, "MEGAC_UP_FIRST_EARLY": 1, "MEGAC_ROUTER_COMBINE": 0},
                    include_dirs=inc, cache_dir=tmp_path / "first-early")
    # the norm probe drops a polling claimer's wait: refused where no claimer polls
    with pytest.raises(Exception, match="MEGAC_PROBE_UP_NO_NORM"):
        build_cubin(tmp_path / SOURCE, defines={"MEGAC_PROBE_UP_NO_NORM": 1}, include_dirs=inc,
                    cache_dir=tmp_path / "probe-no-poll")
    # the full layers' polls pick which claimers poll: refused where none does
    with pytest.raises(Exception, match="MEGAC_ROUTER_POLL_FULL"):
        build_cubin(tmp_path / SOURCE, defines={"MEGAC_ROUTER_POLL_FULL": 1}, include_dirs=inc,
                    cache_dir=tmp_path / "full-no-poll")
    # the probe marks a folding up claim's row preloaded, which it never loads: refused beside up_combine
    with pytest.raises(Exception, match="MEGAC_UP_COMBINE"):
        build_cubin(tmp_path / SOURCE, defines={"MEGAC_SLOTS_EARLY": 1, "MEGAC_UP_COMBINE": 1}, include_dirs=inc,
                    cache_dir=tmp_path / "slots-up-combine")


@needs_nvcc
def test_router_poll_refuses_a_model_of_one_moe_layer(tmp_path):
    # MEGAC_ROUTER_POLL (common.cuh): a layer's finalize unlands the router
    # partials of the MoE layer before it, the first MoE layer's the last's.
    # With one MoE layer those are its own, still polled by its claimers: the
    # build says so instead of compiling a step that would hang.
    from megac.gpu.build import build_cubin
    from megac.resources import opcodes_dir
    from models import variant

    lay = [{"attention": "full", "window": None, "rope": True, "ffn": "dense"},
           {"attention": "sliding", "window": 8, "rope": True, "ffn": "moe"}]
    spec = variant(load_spec("tiny-moe"), "one-moe-layer", layers=lay, tie_embeddings=False)
    _artifact(tmp_path, spec, [1])
    with pytest.raises(Exception, match="two MoE layers or more"):
        build_cubin(tmp_path / SOURCE, defines={"MEGAC_ROUTER_POLL": 1}, include_dirs=[opcodes_dir(), tmp_path],
                    cache_dir=tmp_path / "poll")


@needs_nvcc
def test_the_hop_switches_and_the_profile_marks_compile(tmp_path):
    # The dependency hop's switches (counters.cuh MEGAC_SIGNAL_ACQREL,
    # common.cuh MEGAC_ABORT_EVERY, mk_core.cuh MEGAC_WAIT_PAIR)
    # are inline PTX the default build does not compile, and the profiled
    # build stamps twelve marks: one build with all of them, without spills,
    # so a GPU session does not find a typo. Whether they are faster is the
    # H200's to say (docs/perf-notes.md); that they give the default's bits,
    # the GPU check `variants`. With them the forty-third session's probes,
    # off by default: the per-row words in shared memory (megakernel.cuh
    # MEGAC_DESC_ROWS), the walk left by prime() (gemm_tc.cuh
    # MEGAC_TC_WALK_CACHE, with the cursor it needs) and its bisect stamps.
    from megac.gpu.build import build_cubin
    from megac.resources import opcodes_dir

    spec = load_spec("tiny-moe")
    _artifact(tmp_path, spec, [1, 8])
    # and the fifty-second session's: the fold's stamps (norm.cuh MEGAC_FOLD_MARKS) and QKV tiles that
    # prime nothing before their waits (ops_gemm.cuh MEGAC_QKV_PRIME 0: prime_gemm declines)
    defines = {"MEGAC_SIGNAL_ACQREL": 1, "MEGAC_ABORT_EVERY": 16, "MEGAC_WAIT_PAIR": 1, "MEGAC_PROFILE": 1,
               "MEGAC_DESC_ROWS": 1, "MEGAC_TC_WALK_POS": 1, "MEGAC_TC_WALK_CACHE": 1, "MEGAC_TC_BISECT": 1,
               "MEGAC_FOLD_MARKS": 1, "MEGAC_QKV_PRIME": 0}
    cubin = build_cubin(tmp_path / SOURCE, defines=defines, include_dirs=[opcodes_dir(), tmp_path],
                        cache_dir=tmp_path / "cache")
    k = report(cubin)["kernels"]["megakernel"]
    assert k["spill_stores"] == 0 and k["spill_loads"] == 0 and k["stack"] <= 32, k
    with pytest.raises(Exception, match="power of two"):
        build_cubin(tmp_path / SOURCE, defines={"MEGAC_ABORT_EVERY": 3}, include_dirs=[opcodes_dir(), tmp_path],
                    cache_dir=tmp_path / "cache3")


def test_qkv_tiles_prime_one_stage_where_they_fold_the_combine():
    # ops_gemm.cuh MEGAC_QKV_PRIME: where a MoE layer's QKV tiles fold the
    # combine (North Mini Code, the tiny MoE model) they prime one stage a
    # warp before their waits (fifty-second session: -0.6 % at NMC batch 1,
    # H100); a dense model keeps its whole primed ring (the build measured
    # for it). The generated source says so under #ifndef, so a variant's -D
    # still wins.
    from megac.codegen.megakernel import switch_defaults

    for name, want in (("north-mini-code", 1), ("tiny-moe", 1), ("smollm2-135m", -1), ("tiny-llama", -1)):
        spec = load_spec(name)
        res = compile_schedules(spec, batch_sizes=[1])
        assert dict(switch_defaults(res.schedules))["MEGAC_QKV_PRIME"] == want, name
        src = render_megakernel(spec, res.schedules)
        assert re.search(rf"#ifndef MEGAC_QKV_PRIME\n#define MEGAC_QKV_PRIME {want}\n#endif", src), name


def test_dispatch_covers_the_registry_and_layout_is_checked():
    spec = load_spec("tiny-moe")
    res = compile_schedules(spec, batch_sizes=[1, 2])
    src = render_megakernel(spec, res.schedules)
    cases = set(re.findall(r"case megac::OP_(\w+):\n\s+return megac::mk::call", src))
    assert cases == {op.name for op in REGISTRY if op != abi.Op.NOP}
    for op, d in REGISTRY.items():
        if op != abi.Op.NOP:
            assert f"megac::mk::{d.device_fn}<Model>" in src
    # the largest key's strides are pinned by static_asserts against megac_layout.h
    assert "namespace lay = megac::layout::bs2_ctx" in src
    assert src.count("static_assert(L::") >= 20


def test_unsupported_shape_gets_no_megakernel(tmp_path):
    spec = load_spec("tiny-llama")
    bad = spec.model_copy(update={"moe": None})
    data = bad.model_dump()
    # 17 query heads on one kv head: a GQA ratio past the device attention's 16
    data["num_heads"], data["num_kv_heads"], data["head_dim"], data["q_width"] = 17, 1, 8, 136
    from megac.spec.loader import spec_from_dict

    odd = spec_from_dict(data)
    res = compile_schedules(odd, batch_sizes=[1])
    m = write_artifact(tmp_path, odd, res.schedules, order="tuned")
    assert not (tmp_path / SOURCE).exists()
    assert "GQA ratio <= 16" in m["megakernel_unsupported"]


def test_gemm_layout_is_tiled_exactly_where_every_tile_fits():
    """SmolLM2's and North Mini Code's GEMM tiles all start and end on
    16-row / 32-column boundaries, so their megakernel reads tiled weights;
    tiny-moe's router has 8 rows (8 experts) and keeps row-major weights, as
    does a model whose hidden size is not a multiple of 32."""
    from megac.codegen.megakernel import gemm_tiled
    from megac.spec.loader import spec_from_dict

    for name, tiled in (("smollm2-135m", True), ("north-mini-code", True), ("tiny-moe", False)):
        spec = load_spec(name)
        res = compile_schedules(spec, batch_sizes=[1])
        assert gemm_tiled(res.schedules) == tiled, name
        assert f"GEMM_TILED = {int(tiled)};" in render_megakernel(spec, res.schedules)
    data = load_spec("tiny-llama").model_dump()
    assert data["hidden_size"] % 32 == 0
    data["hidden_size"] += 16  # rows of 16-byte chunks still, K no longer in 32s
    odd = spec_from_dict(data)
    res = compile_schedules(odd, batch_sizes=[1])
    assert not gemm_tiled(res.schedules)
    assert "GEMM_TILED = 0;" in render_megakernel(odd, res.schedules)


def test_the_ring_cursor_is_on_from_a_hidden_size_of_1024():
    """The generated source sets the GEMM ring cursor's default per model
    (measured: North Mini Code faster with it, SmolLM2 slower) and X by
    cp.async for MoE models, before any header reads them, and under #ifndef
    so a variant's -D still wins."""
    from megac.codegen.megakernel import WALK_POS_MIN_HIDDEN

    for name in ("north-mini-code", "smollm2-135m", "tiny-llama", "tiny-moe"):
        spec = load_spec(name)
        src = render_megakernel(spec, compile_schedules(spec, batch_sizes=[1]).schedules)
        on = int(spec.hidden_size >= WALK_POS_MIN_HIDDEN)
        guard = f"#ifndef MEGAC_TC_WALK_POS\n#define MEGAC_TC_WALK_POS {on}\n#endif"
        assert guard in src, name
        assert src.index(guard) < src.index('#include "megakernel.cuh"'), name
        # X by cp.async only where expert claims (unprimed tiles) exist
        assert f"#define MEGAC_X_ASYNC {int(spec.moe is not None)}\n" in src, name
    assert load_spec("north-mini-code").hidden_size >= WALK_POS_MIN_HIDDEN > load_spec("smollm2-135m").hidden_size


def test_a_folded_norm_needs_a_row_in_one_pass(tmp_path):
    """The norm folded into its readers keeps each row in registers (8
    elements a thread): a wider model that asks for norm_fold gets no
    megakernel, and the reason names the tile."""
    from models import variant

    moe = load_spec("tiny-moe")
    wide = variant(moe, "wide-fold", hidden_size=2056, tiles={"norm_fold": 1})
    res = compile_schedules(wide, batch_sizes=[1], buckets=[1024])
    assert res.schedules[0].geometry.norm_fold
    m = write_artifact(tmp_path, wide, res.schedules, order="tuned")
    assert not (tmp_path / SOURCE).exists()
    assert "norm_fold needs hidden_size <= 2048 (got 2056)" in m["megakernel_unsupported"]


def test_the_full_layer_masks_name_the_full_attention_layers():
    # megac/codegen/megakernel.py full_layer_masks: MEGAC_FULL_LAYERS_LO/HI
    # (read by common.cuh MEGAC_ROUTER_POLL_FULL) set bit i for layer i of
    # full attention, as the spec's layers say (not the geometry that made them)
    from megac.codegen.megakernel import switch_defaults

    for name in ("north-mini-code", "tiny-moe", "smollm2-135m"):
        spec = load_spec(name)
        res = compile_schedules(spec, batch_sizes=[1])
        got = dict(switch_defaults(res.schedules))
        lo, hi = (int(got[k].rstrip("u"), 16) for k in ("MEGAC_FULL_LAYERS_LO", "MEGAC_FULL_LAYERS_HI"))
        full = {i for i, layer in enumerate(spec.layers) if layer.attention == "full"}
        assert {i for i in range(64) if (lo | hi << 32) >> i & 1} == full, name
    nmc = load_spec("north-mini-code")
    sliding = [layer.attention for layer in nmc.layers].count("sliding")
    assert 0 < sliding < len(nmc.layers)  # the model mixes both kinds, so the masks tell them apart
