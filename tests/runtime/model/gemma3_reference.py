"""Test helper: transformers' own greedy float32 tokens for Gemma 3 270M loaded from the embedded Q4_K_M GGUF
(transformers' GGUF loading, independent of runtime.model.gguf_convert), frozen in fixtures/gemma3_270m_greedy.json
because computing them takes minutes (transformers dequantizes the file and converts its 262k-token vocabulary).

Regenerate (after `make install`):  PYTHONPATH=. .venv/bin/python -m tests.runtime.model.gemma3_reference
"""

from __future__ import annotations

import json
from pathlib import Path

FIXTURE = Path(__file__).parent / "fixtures" / "gemma3_270m_greedy.json"
MAX_TOKENS = 24
_LONG = (
    "The history of the bicycle begins in the early nineteenth century, when inventors in Europe built two-wheeled "
    "machines that riders pushed along with their feet. Pedals came later, first on the front wheel and then, with "
    "the chain drive, on a frame between two wheels of equal size. Pneumatic tyres made the ride smoother, and by the "
    "end of the century cycling clubs, races and touring had spread across many countries. "
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    _LONG * 7 + "In short, the bicycle",  # past the 512-token sliding window of the local layers
]


def reference() -> dict:
    """{"prompts": PROMPTS, "prompt_ids": [...], "token_ids": [...]} from transformers' greedy generate (float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from runtime.model.loader import embedded_gguf_path

    path = embedded_gguf_path("gemma3-270m")
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    prompt_ids, token_ids = [], []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS)
        prompt_ids.append(ids[0].tolist())
        token_ids.append(out[0, ids.shape[1] :].tolist())
    return {"prompts": PROMPTS, "prompt_ids": prompt_ids, "token_ids": token_ids}


if __name__ == "__main__":
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(reference(), indent=1) + "\n")
    print(FIXTURE)
