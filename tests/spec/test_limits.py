"""Size limits: a spec whose weights or plan could not fit any GPU is
refused by every command that loads it, with exit 2 and one line naming the
field, before anything is sized from it. The CLI runs in a subprocess whose
address space is capped at 3 GiB, so a command that started allocating for
the absurd size would fail with a MemoryError traceback, not pass (and not
take the machine down)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest
import yaml

from megac.errors import SpecError
from megac.spec import load_spec, spec_from_dict
from megac.spec.limits import DIMENSION_LIMITS
from test_cli import REPO, assert_one_line_error

ADDRESS_SPACE = 3 * 2**30


def _capped():
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def megac_capped(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "megac.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd or REPO, timeout=300, preexec_fn=_capped)


def _compact_moe(**changes) -> dict:
    """tiny-moe as a model.yaml mapping with compact layers (expanded by the loader)."""
    d = {"name": "limits", "family": "cohere2_moe", "block": "parallel", "hidden_size": 64, "num_layers": 6,
         "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "q_width": 64, "rope_theta": 50000.0,
         "rope_style": "interleaved", "norm_eps": 1e-6, "dense_intermediate_size": 96,
         "moe": {"num_experts": 8, "top_k": 2, "expert_intermediate_size": 32, "router": "sigmoid",
                 "renormalize": False},
         "vocab_size": 256, "tie_embeddings": True, "eos_token_ids": [2], "max_context": 4096,
         "layers": {"attention_pattern": ["full", "sliding", "sliding", "sliding"], "sliding_window": 8,
                    "rope": "sliding_and_dense_prefix", "dense_prefix": 1}}
    for key, value in changes.items():
        if key.startswith("moe."):
            d["moe"][key[4:]] = value
        elif key.startswith("target."):
            d.setdefault("target", {})[key[7:]] = value
        else:
            d[key] = value
    return d


ABSURD = [
    ("hidden_size", dict(hidden_size=100_000_000_000), "hidden_size: 100000000000 is over"),
    ("vocab_size", dict(vocab_size=100_000_000_000), "vocab_size: 100000000000 is over"),
    ("num_layers", dict(num_layers=100_000_000_000), "num_layers: 100000000000 is over"),
    ("num_heads", dict(num_heads=2**40, q_width=2**44), "num_heads: 1099511627776 is over"),
    ("experts", {"moe.num_experts": 1_000_000_000}, "moe.num_experts: 1000000000 is over"),
    ("expert_width", {"moe.expert_intermediate_size": 2**40}, "moe.expert_intermediate_size: 1099511627776"),
    ("dense_width", dict(dense_intermediate_size=2**40), "dense_intermediate_size: 1099511627776 is over"),
    ("max_context", dict(max_context=10**12), "max_context: 1000000000000 is over"),
    ("num_sms", {"target.num_sms": 10**9}, "target.num_sms: 1000000000 is over"),
    ("expert_instances", {"num_layers": 1024, "moe.num_experts": 4096},
     "moe.num_experts: 1023 MoE layers x 4096 experts = 4190208 expert instances, over"),
    ("weights", dict(hidden_size=65536, num_heads=64, num_kv_heads=8, head_dim=128, q_width=8192, num_layers=512,
                     vocab_size=4194304, dense_intermediate_size=262144, **{"moe.expert_intermediate_size": 65536,
                                                                            "moe.num_experts": 256}),
     "moe.num_experts: the weights would take"),
    ("page_table", {"max_context": 2**24, "target.kv_block_size": 1}, "max_context: a decode step's page table"),
]


@pytest.mark.parametrize("changes,needle", [a[1:] for a in ABSURD], ids=[a[0] for a in ABSURD])
def test_compile_refuses_absurd_sizes_with_one_line(tmp_path, changes, needle):
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(_compact_moe(**changes), sort_keys=False))
    res = megac_capped("compile", path, "-o", tmp_path / "out", cwd=tmp_path)
    assert_one_line_error(res, str(path), needle, "limit for one GPU")
    assert not (tmp_path / "out").exists()


def test_every_command_that_loads_a_spec_refuses(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(_compact_moe(hidden_size=100_000_000_000), sort_keys=False))
    needle = "hidden_size: 100000000000 is over megac's limit for one GPU (65536)"
    assert_one_line_error(megac_capped("schedule", path), needle)
    assert_one_line_error(megac_capped("generate", path, "--random-weights", "--prompt", "hi"), needle)
    res = megac_capped("serve", path, "--random-weights", "--port", "0")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip().splitlines()[-1].endswith(needle)


def test_hf_config_with_absurd_layer_count(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 100_000_000_000, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 256, "max_position_embeddings": 1024}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(megac_capped("compile", tmp_path, "-o", tmp_path / "out"),
                          "num_hidden_layers: 100000000000 is over megac's limit for one GPU (1024)")


# ------------------------------------------------------------------ the limits themselves (in-process)


def test_bundled_specs_are_within_the_limits():
    for name in ("north-mini-code", "smollm2-135m", "tiny-moe", "tiny-llama"):
        load_spec(name)


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size", "max_context", "moe.num_experts", "target.num_sms"])
def test_each_limit_is_inclusive(field):
    limit = DIMENSION_LIMITS[field]
    at = _compact_moe(**{field: limit})
    spec_from_dict(at, source="at.yaml")
    with pytest.raises(SpecError, match=rf"^over\.yaml: {field}: {limit + 8} is over megac's limit"):
        spec_from_dict(_compact_moe(**{field: limit + 8}), source="over.yaml")
