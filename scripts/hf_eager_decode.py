"""transformers' eager decode speed of SmolLM2-135M-Instruct on this
machine (the bar issue 14 quotes for the CPU VM): the GGUF loaded by
transformers, an 8-token prompt, then 40 single-token steps with its KV
cache; prints the median step. Run: .venv/bin/python scripts/hf_eager_decode.py [float32|bfloat16] [threads]
"""

import sys
import time

import torch
from transformers import AutoModelForCausalLM

from megac.weights.gguf import smollm2_gguf_path


def main() -> None:
    dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "float32")
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
    p = smollm2_gguf_path()
    m = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=dtype).eval()
    with torch.no_grad():
        out = m(torch.arange(1, 9)[None], use_cache=True)
        cache, tok, steps = out.past_key_values, out.logits[:, -1:].argmax(-1), []
        for _ in range(40):
            t0 = time.perf_counter()
            out = m(tok, past_key_values=cache, use_cache=True)
            cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            steps.append(time.perf_counter() - t0)
    ms = sorted(steps)[len(steps) // 2] * 1e3
    print(f"transformers eager, {str(dtype).replace('torch.', '')}, {torch.get_num_threads()} threads: "
          f"{ms:.1f} ms/step, {1e3 / ms:.1f} tok/s")


if __name__ == "__main__":
    main()
