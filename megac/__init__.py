"""megac: lower one LLM decode step into a persistent CUDA megakernel.

Kept import-light on purpose: the GPU machine has no pydantic, and the GPU
harness (tests/gpu) imports this package there.
"""

__version__ = "0.1.0"
