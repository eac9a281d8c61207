"""Model specs: pydantic ModelSpec/TargetSpec, YAML and Hugging Face loaders.

``load_spec(MODEL)`` accepts a bundled name (``list_bundled()``), a model.yaml
path or a Hugging Face checkpoint directory; see :mod:`megac.spec.loader` for
the YAML format and :mod:`megac.spec.model` for the semantics of each field;
:mod:`megac.spec.limits` bounds the sizes a spec may ask for.
"""

from megac.errors import SpecError
from megac.spec.loader import (
    apply_overrides,
    list_bundled,
    load_spec,
    spec_from_dict,
    spec_to_yaml,
)
from megac.spec.model import LayerSpec, ModelSpec, MoESpec, TargetSpec, derive_context_buckets

__all__ = [
    "LayerSpec",
    "ModelSpec",
    "MoESpec",
    "SpecError",
    "TargetSpec",
    "apply_overrides",
    "derive_context_buckets",
    "list_bundled",
    "load_spec",
    "spec_from_dict",
    "spec_to_yaml",
]
