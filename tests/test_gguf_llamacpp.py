"""Parity with llama.cpp on real weights: SmolLM2-135M-Instruct's GGUF file (fetched by scripts/get_smollm2.sh) in
TinyLoop and in llama.cpp (docs/gguf.md, Parity). llama.cpp runs in a process of its own from the interpreter that
has llama-cpp-python (TINYLOOP_LLAMA_PYTHON, or this one; it compiles from source, so it is never part of the test
install): these tests run where it is installed and the file is present.

Two comparisons, 8 chat prompts x 64 greedy tokens each (scripts/bench/gguf.py: parity):
- the file's values written as an F32 GGUF file: both runtimes multiply the same fp32 numbers, so the greedy tokens
  are the same and the logits agree to llama.cpp's F16 KV cache;
- the Q4_1 file as it is: TinyLoop multiplies its values exactly in fp32; llama.cpp multiplies Q4_1 blocks by
  activations rounded to 8 bits (Q8_1), so logits move by up to ~2 and greedy paths part where two tokens are close.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import tinyloop
from scripts.bench.gguf import DEFAULT_GGUF, PROMPTS, parity
from scripts.bench.llama_peer import LlamaPeer, llama_installed

pytestmark = pytest.mark.skipif(not (DEFAULT_GGUF.is_file() and llama_installed()),
                                reason="needs llama-cpp-python (TINYLOOP_LLAMA_PYTHON) and data/SmolLM2-*.gguf")


@pytest.fixture(scope="module")
def f32_copy(tmp_path_factory):
    """The Q4_1 file's metadata and values, every tensor F32 (the gguf package's own dequantizer)."""
    import gguf

    src = gguf.GGUFReader(str(DEFAULT_GGUF))
    path = tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct.F32.gguf"
    w = gguf.GGUFWriter(str(path), src.fields["general.architecture"].contents())
    for key, f in src.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            w.add_key_value(key, f.contents(), f.types[0], f.types[1] if len(f.types) > 1 else None)
    for t in src.tensors:
        w.add_tensor(t.name, gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_same_values_same_tokens_as_llama_cpp(f32_copy):
    model = tinyloop.load_model(str(f32_copy), 1024)
    p = parity(model, f32_copy, torch.get_num_threads())
    assert p["same_prompt_tokens"] == len(PROMPTS)
    assert p["identical"] == len(PROMPTS), [(r["prompt"], r["first_difference"]) for r in p["rows"]]
    assert p["max_logit_diff"] < 0.1


def test_the_q4_1_file_as_llama_cpp_runs_it():
    model = tinyloop.load_model(str(DEFAULT_GGUF), 1024)
    assert model.weights == "fp32" and model.cfg.dense and model.cfg.n_core == 30
    p = parity(model, DEFAULT_GGUF, torch.get_num_threads())
    assert p["same_prompt_tokens"] == len(PROMPTS)
    assert p["max_logit_diff"] < 2.5  # llama.cpp's 8-bit activations (module doc)
    assert sum(r["first_difference"] != 0 for r in p["rows"]) >= len(PROMPTS) - 2  # most first answers agree


def test_tokenizer_from_the_file_splits_text_as_llama_cpp_does():
    """tokenizer.ggml.* of SmolLM2's file (pre-tokenizer 'smollm': each digit on its own, then GPT-2's split)."""
    model = tinyloop.load_model(str(DEFAULT_GGUF), 64)
    llm = LlamaPeer(DEFAULT_GGUF, 64, 1)
    try:
        for text in ["12345 apples and 678 pears", "naïve café — 'tis x2\n\n  indented\tcode()",
                     "<|im_start|>user\nHi there<|im_end|>\n", "def fibonacci(n):\n    return n if n < 2 else 0"]:
            assert model.codec.encode(text) == llm.tokenize(text), text
    finally:
        llm.close()
