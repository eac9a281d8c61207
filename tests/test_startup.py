"""The first minutes of a user: help without loading torch, defaults the help
states truthfully, and `megac compile` leaving the working directory alone.

Behaviour only; how long these take is measured elsewhere, never asserted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _python(code: str, *, cwd=None, env=None) -> subprocess.CompletedProcess:
    env = dict(env or os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=300)


def _help_of(*args: str) -> tuple[str, bool]:
    """The help text of ``megac ARGS --help`` and whether torch got imported."""
    code = ("import sys\nfrom megac.cli import main\n"
            f"try:\n    main({list(args) + ['--help']!r})\nexcept SystemExit:\n    pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n")
    res = _python(code)
    assert res.returncode == 0, res.stderr
    return res.stdout, res.stdout.rstrip().endswith("\nTORCH")


@pytest.mark.parametrize("command", [[], ["serve"], ["generate"], ["compile"], ["bench-serve"]])
def test_help_does_not_import_torch(command):
    text, torch_loaded = _help_of(*command)
    assert "Usage:" in text
    assert not torch_loaded


def test_serve_help_states_the_real_max_batch_size():
    text, _ = _help_of("serve")
    start = text.index("--max-batch-size")
    entry = " ".join(text[start:text.index("\n  --", start + 1)].split())
    assert "default: 16" not in entry
    assert "largest batch size" in entry and "8 for the bundled targets" in entry
    assert "16 with --backend reference" in entry


def test_bundled_targets_compile_batch_sizes_up_to_8():
    """What the serve help promises about the bundled targets."""
    from megac.spec import load_spec

    for name in ("north-mini-code", "smollm2-135m", "tiny-moe", "tiny-llama"):
        assert max(load_spec(name).target.batch_sizes) == 8, name


def test_default_batch_size_is_the_largest_compiled_one():
    from megac.engine.build import REFERENCE_BATCH, batch_size_for
    from megac.passes.pipeline import compile_schedules
    from megac.spec import load_spec

    res = compile_schedules(load_spec("tiny-llama"), batch_sizes=[1, 4], buckets=[1024])
    assert batch_size_for(None, res) == (4, None)
    assert batch_size_for(2, res) == (2, None)
    size, why = batch_size_for(16, res)
    assert size == 4 and "16 -> 4" in why and "largest batch size compiled" in why
    assert batch_size_for(None, None) == (REFERENCE_BATCH, None)  # the reference backend runs any batch
    assert batch_size_for(32, None) == (32, None)


def test_generate_defaults_to_one_cpu_thread():
    text, _ = _help_of("generate")
    start = text.index("--threads")
    assert "[default: 1;" in " ".join(text[start:text.index("\n  --", start + 1)].split())


def test_compile_without_output_leaves_the_working_directory_alone(tmp_path):
    cwd, cache = tmp_path / "here", tmp_path / "cache"
    cwd.mkdir()
    env = dict(os.environ, MEGAC_CACHE_DIR=str(cache))
    res = _python("from megac.cli import main\nmain(['compile', 'tiny-llama', '--batch-size', '1'])", cwd=cwd,
                  env=env)
    assert res.returncode == 0, res.stderr
    assert list(cwd.iterdir()) == []
    written = list((cache / "artifacts").glob("tiny-llama-*/manifest.json"))
    assert len(written) == 1 and str(written[0].parent) in res.stdout
