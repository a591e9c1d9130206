"""Build the tiny Hugging Face checkpoints under tests/data/hf/ and record the reference code's outputs on them.

Not run by the test suite: it needs the reference modeling code, which is not part of TinyLoop, and
transformers==4.56.2 (a throwaway environment: `python -m venv /work/refenv && /work/refenv/bin/pip install
torch==2.13.0 transformers==4.56.2 safetensors tokenizers`).

Where the reference code comes from (read, never copied into TinyLoop):
- Ouro: `modeling_ouro.py` and `configuration_ouro.py`, the Hugging Face remote code of ByteDance/Ouro-1.4B as kept
  in github.com/LoopedLMs/ouro_rl (ouro_rl/modeling/, commit 531187b). That copy carries one upstream fix:
  `UniversalTransformerCache.get_mask_sizes` counts the cached tokens (the hub file's cached decode masks wrongly
  on transformers >= 4.56); the model math is the hub file's.
- Huginn-0125: `raven_modeling_minimal.py` and `raven_config_minimal.py` of github.com/seal-rg/recurrent-pretraining
  (recpre/, commit 59e0b69).
- Parcae: the `parcae_lm` and `receval` packages of github.com/sandyresearch/parcae (commit dee8363), as they are:
  the model is parcae_lm's, its save / load and cached generation receval's ModelingParcae.
- Nanbeige4.2: `modeling_nanbeige.py` and `configuration_nanbeige.py`, the remote code of Nanbeige/Nanbeige4.2-3B
  as kept in github.com/johnhalloran321/Nanbeige4.2-3B-mps-fix (patch/, commit a164cc1): that copy carries
  compatibility fixes for newer transformers (cache length API, rope_scaling without "type", tied-weights keys,
  position ids in generation); the model math is the hub file's. Its causal-LM class lacks GenerationMixin, which
  transformers adds to remote code at load time; the fixture adds it the same way.

Lay them out as packages under one directory and pass it:
    REF/ouro_ref/{__init__.py,modeling_ouro.py,configuration_ouro.py}
    REF/huginn_ref/{__init__.py,raven_modeling_minimal.py,raven_config_minimal.py}
    REF/parcae_lm/..., REF/receval/...       (git archive HEAD parcae_lm receval | tar -x -C REF)
    REF/nanbeige_ref/{__init__.py,modeling_nanbeige.py,configuration_nanbeige.py}
    /work/refenv/bin/python scripts/make_hf_fixtures.py --ref REF [--out tests/data/hf] [--only parcae]

What it writes, per architecture (ouro, huginn, parcae, nanbeige): a model directory (config.json, generation_config.json,
safetensors weights in bfloat16 — Ouro in one file, Huginn in shards with an index; Parcae's own layout: a torch
pickle pytorch_model.bin —, tokenizer.json, tokenizer_config.json with a chat template) and
`<arch>_reference.safetensors` + `<arch>_reference.json` with:
logits of a prompt at every loop count (fp32, from the bf16 weights upcast), greedy continuations with the
reference's own KV cache, and its early-exit choices (Ouro: exit-gate CDF threshold; Huginn: latent-difference
adaptive compute). The weights are random but not trivial: norms, biases and the exit gate are perturbed so that
a wrongly placed norm or a missing bias changes the logits.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB = 384
PROMPTS = {"a": 12, "b": 7, "c": 19}  # prompt name -> length (random ids, fixed seed)
NEW_TOKENS = 16

OURO_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
HUGINN_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|begin_header|>' + message['role'] + '<|end_header|>\\n\\n' + message['content'] | trim + '<|end_turn|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|begin_header|>Huginn<|end_header|>\\n\\n' }}{% endif %}"
)


def corpus() -> list[str]:
    """Some English and Python text that exists on every machine: the standard library's own docstrings."""
    import inspect
    import json as j
    import textwrap
    return [textwrap.dedent(inspect.getsource(m)) for m in (j, textwrap, argparse)]


def make_tokenizer(specials: list[str], bos: str | None) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    if bos is not None:  # like Huginn's tokenizer: a BOS token in front of every encoded text
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def perturb(model: torch.nn.Module, gate_std: float = 0.0) -> None:
    """Norm weights 1 + noise, biases noise, the exit gate wide enough that exit choices differ between tokens."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("ln_f.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "bias" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            if "early_exit_gate" in name and gate_std:
                p.copy_(gate_std * torch.randn(p.shape, generator=g))


def bf16_round(model: torch.nn.Module) -> None:
    """The checkpoint is stored in bf16 (as the real ones are); the reference runs fp32 on those exact values."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(7)
    return {k: torch.randint(10, VOCAB, (n,), generator=g).tolist() for k, n in PROMPTS.items()}


def save_dir(model, tok: Tokenizer, out: Path, tok_config: dict, shard: str | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16)
    model.config.torch_dtype = "bfloat16"
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(out, safe_serialization=True, **kw)
    model.float()
    if hasattr(model, "freqs_cis"):  # Huginn saves its RoPE table as a weight, now bf16-rounded: rebuild it in fp32
        model.freqs_cis = model._precompute_freqs_cis()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    for extra in out.glob("*.py"):
        extra.unlink()  # the reference code stays out of the repository


def ouro(ref: Path, out: Path) -> None:
    from ouro_ref.configuration_ouro import OuroConfig
    from ouro_ref.modeling_ouro import OuroForCausalLM

    torch.manual_seed(0)
    tok = make_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None)
    cfg = OuroConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=256, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False, total_ut_steps=4, early_exit_threshold=1.0, bos_token_id=1,
                     eos_token_id=2, pad_token_id=0, attn_implementation="eager")
    cfg.auto_map = {"AutoConfig": "configuration_ouro.OuroConfig", "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM"}
    model = OuroForCausalLM(cfg).eval()
    perturb(model, gate_std=0.12)
    bf16_round(model)
    d = out / "ouro-tiny"
    save_dir(model, tok, d, {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
                             "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": OURO_TEMPLATE,
                             "model_max_length": 256}, None)

    ps = prompts()
    rec, meta = {}, {"arch": "ouro", "max_loops": 8, "prompts": ps, "greedy": {}, "exit": {}}
    with torch.no_grad():
        x = torch.tensor([ps["a"]])
        for L in range(1, 9):  # every loop count the converted model allows (max_loops = 2 x total_ut_steps)
            model.config.total_ut_steps = model.model.total_ut_steps = L
            rec[f"logits_L{L}"] = model(x, use_cache=False).logits[0].float()
        for L in (2, 4, 6):
            model.config.total_ut_steps = model.model.total_ut_steps = L
            for name in ("a", "b"):
                p = torch.tensor([ps[name]])
                gen = model.generate(p, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True, eos_token_id=None,
                                     pad_token_id=0)
                meta["greedy"][f"{name}_L{L}"] = gen[0, p.shape[1]:].tolist()
        # Exit choices: the reference picks, per position, the first step whose cumulative exit probability reaches
        # the threshold (all steps are computed; the chosen step's hidden state gives the logits).
        model.config.total_ut_steps = model.model.total_ut_steps = 4
        for q in (0.3, 0.7):
            model.early_exit_threshold = q
            logits = model(x, use_cache=False).logits[0].float()
            per_step = [model(x, use_cache=False, exit_at_step=k).logits[0].float() for k in range(4)]
            steps = [min(range(4), key=lambda k: float((per_step[k][t] - logits[t]).abs().max())) + 1
                     for t in range(x.shape[1])]
            rec[f"exit_logits_q{q}"] = logits
            meta["exit"][f"q{q}"] = {"steps": steps}
            p = torch.tensor([ps["b"]])
            gen = model.generate(p, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True, eos_token_id=None,
                                 pad_token_id=0)
            meta["exit"][f"q{q}"]["greedy_b"] = gen[0, p.shape[1]:].tolist()
        model.early_exit_threshold = 1.0
    write_reference(out, "ouro", rec, meta, d)


def huginn(ref: Path, out: Path) -> None:
    from huginn_ref.raven_config_minimal import RavenConfig
    from huginn_ref.raven_modeling_minimal import LatentDiffExitEvaluator, RavenForCausalLM

    torch.manual_seed(0)
    tok = make_tokenizer(["<|begin_text|>", "<|end_text|>", "<|begin_header|>", "<|end_header|>", "<|end_turn|>",
                          "<|pad|>"], "<|begin_text|>")
    # Huginn's shape: prelude 2, core 4, coda 2 (the reference's "latest-m4" cache lookup hard-codes that layout).
    cfg = RavenConfig(n_embd=64, n_heads=4, n_layers=8, block_size=256, vocab_size=VOCAB, padding_multiple=VOCAB,
                      intermediate_size=128, n_layers_in_recurrent_block=4, mean_recurrence=4, mean_backprop_depth=2,
                      n_layers_in_prelude=2, n_layers_in_coda=2, qk_bias=True, rope_base=50_000.0,
                      bos_token_id=0, eos_token_id=1, pad_token_id=5)
    model = RavenForCausalLM(cfg).eval()
    perturb(model)
    bf16_round(model)
    d = out / "huginn-tiny"
    save_dir(model, tok, d, {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_text|>",
                             "eos_token": "<|end_text|>", "pad_token": "<|pad|>", "chat_template": HUGINN_TEMPLATE,
                             "model_max_length": 256}, "200KB")

    ps = prompts()
    rec, meta = {}, {"arch": "huginn", "max_loops": 8, "prompts": ps, "greedy": {}, "exit": {}}
    with torch.no_grad():
        x = torch.tensor([ps["a"]])
        for L in range(1, 9):  # init_scale=0: the deterministic (zero) initial state
            rec[f"logits_L{L}"] = model(x, num_steps=L, init_scale=0.0).logits[0].float()
        for L in (2, 4, 6):
            for name in ("a", "b"):
                p = torch.tensor([ps[name]])
                gen = model.generate(p, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True, num_steps=L,
                                     init_scale=0.0, eos_token_id=None, pad_token_id=5)
                meta["greedy"][f"{name}_L{L}"] = gen[0, p.shape[1]:].tolist()

        class Recording(LatentDiffExitEvaluator):  # the reference's own rule, recording the step each token chose
            def init(self, initial_latents):
                super().init(initial_latents)
                self.steps.append(0)

            def check(self, model, latents, aux_inputs):
                self.steps[-1] += 1
                return super().check(model, latents, aux_inputs)

        for t in (0.05, 0.2):
            ev = Recording(t)
            ev.steps = []
            p = torch.tensor([ps["b"]])
            gen = model.generate(p, max_new_tokens=NEW_TOKENS, do_sample=False, criterion="latent-diff",
                                 exit_evaluator=ev, num_steps=8, init_scale=0.0, cache_lookup_strategy="latest-m4",
                                 do_not_exit_in_prefill=True, eos_token_id=None, pad_token_id=5)
            # steps[0] is the prompt (all 8 loops, checks counted but never exiting); then one per generated token
            meta["exit"][f"t{t}"] = {"greedy_b": gen[0, p.shape[1]:].tolist(), "steps": ev.steps[1:]}
    write_reference(out, "huginn", rec, meta, d)


def parcae(ref: Path, out: Path) -> None:
    """Parcae in the 140M config's shape (prelude / core / coda 2 / 2 / 2, diagonal injection, like-init state, qk-norm,
    ReLU^2 MLP, value embeddings, prelude norm, tied embeddings), tiny, saved by receval's ModelingParcae."""
    from parcae_lm.models.parcae import ParcaeConfig
    from parcae_lm.tokenizer import Tokenizer as ParcaeTokenizer
    from receval.models.parcae import ModelingParcae

    torch.manual_seed(0)
    tok = make_gpt4_tokenizer(["<|bos|>", "<|eos|>", "<|pad|>"])  # the shape of parcae's scripts/tok_train.py
    cfg = ParcaeConfig(name="parcae-tiny", block_size=256, vocab_size=VOCAB, padding_multiple=64, n_embd=64,
                       num_attention_heads=4, num_key_value_heads=4, intermediate_size=256, bias=False,
                       tie_embeddings=True, block_class_name="TransformerPreNormBlock", norm_class_name="RMSNorm",
                       norm_eps=1e-5, mlp_class_name="BaseMLP", nonlin_name="ReLU2", qk_norm=True, prelude_norm=True,
                       init_strategy="scaled-zero", init_orthogonal=True, injection_type="diagonal",
                       state_init="like-init", recurrent_embedding_dimension=64,
                       recurrent_intermediation_embedding_dimension=256, n_layers_in_recurrent_block=2,
                       n_layers_in_prelude=2, n_layers_in_coda=2, mean_recurrence=4, mean_backprop_depth=2,
                       recurrent_iteration_method="per-sequence", attn_impl="sdpa")
    model = ModelingParcae(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # its init zeroes the output projections: random weights everywhere instead
        for name, p in model.named_parameters():
            if p.dim() == 2:
                std = 0.05 if "wte" in name else 0.5 if "value_embeds" in name else p.shape[1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=g) * std)  # (the tied head keeps logits near 1)
            elif "norm" in name or "ln_" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:  # the diagonal injection's A_log and dt_bias
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    bf16_round(model)
    d = out / "parcae-tiny"
    d.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16)
    model.save_pretrained(d)  # config.json + pytorch_model.bin
    model.float()
    model.freqs_cis = model._precompute_freqs_cis()  # saved as a weight (bf16 now): rebuilt in fp32
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({  # what its Tokenizer.save (save_pretrained) writes
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>",
        "pad_token": "<|pad|>", "model_max_length": 256}, indent=2) + "\n")

    ps = prompts()
    rec, meta = {}, {"arch": "parcae", "max_loops": 8, "prompts": ps, "greedy": {}, "exit": {}}
    with torch.no_grad():
        x = torch.tensor([ps["a"]])
        state = model.initialize_state(model.transformer.wte(x))  # its like-init draw, recorded
        rec["state0"] = state[0].float()
        model.initialize_state = lambda e: state.to(e.dtype)
        rec["state0_logits_L4"] = model.forward_for_generation(x, num_steps=4)["logits"][0].float()
        del model.initialize_state
        model.config.state_init = "zero"  # the deterministic state (TinyLoop's init_scale=0) for everything else
        for L in range(1, 9):
            rec[f"logits_L{L}"] = model.forward_for_generation(x, num_steps=L)["logits"][0].float()
        for L in (2, 4, 6):
            for name in ("a", "b"):
                p = torch.tensor([ps[name]])
                gen = model.generate(p, max_new_tokens=NEW_TOKENS, do_sample=False, num_steps=L, use_cache=True)
                meta["greedy"][f"{name}_L{L}"] = gen[0, p.shape[1]:].tolist()
    ptok = ParcaeTokenizer.from_directory(d)
    text = ["hello world", "def f(x):\n    return x", "The quick brown fox."]
    meta["tokens"] = {t: ptok.encode(t, bos=True, return_tensors=False) for t in text}  # as it trains and evaluates
    meta["bos_eos"] = [ptok.bos_id, ptok.eos_id]
    save_file({k: v.contiguous() for k, v in rec.items()}, str(out / "parcae_reference.safetensors"))
    (out / "parcae_reference.json").write_text(json.dumps(meta, indent=1) + "\n")
    print("parcae written:", sorted(rec), "greedy", meta["greedy"].get("a_L4"))


CHATML_TEMPLATE = (  # written for the fixture (ChatML, as Nanbeige's chats are framed), not the checkpoint's own
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a tiny test model.<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def nanbeige(ref: Path, out: Path) -> None:
    """Nanbeige4.2 in the published 3B config's form (the whole stack looped num_loops = 2 times, the final norm
    after every pass, grouped-query heads of their own width, untied head), tiny."""
    from transformers import GenerationMixin

    from nanbeige_ref.configuration_nanbeige import NanbeigeConfig
    from nanbeige_ref.modeling_nanbeige import NanbeigeForCausalLM

    # what transformers does to remote code at load time (the same class name, so config.json names it)
    Nanbeige = type("NanbeigeForCausalLM", (NanbeigeForCausalLM, GenerationMixin), {})

    torch.manual_seed(0)
    tok = make_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None)
    # head_dim 24 with hidden 64 and 4 heads: q is 96 wide, as the 3B's 48 x 128 beside hidden 3072
    cfg = NanbeigeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_loops=2,
                         skip_loop_final_norm=False, rope_theta=70_000_000.0, rms_norm_eps=1e-5,
                         max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, attn_implementation="eager")
    cfg.auto_map = {"AutoConfig": "configuration_nanbeige.NanbeigeConfig",
                    "AutoModelForCausalLM": "modeling_nanbeige.NanbeigeForCausalLM"}
    model = Nanbeige(cfg).eval()
    perturb(model)
    with torch.no_grad():  # a less flat next-token distribution (logits std ~0.2 at its init), as a trained model's
        model.lm_head.weight.mul_(5)
    bf16_round(model)
    d = out / "nanbeige-tiny"
    save_dir(model, tok, d, {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
                             "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "model_max_length": 256}, None)
    (d / "chat_template.jinja").write_text(CHATML_TEMPLATE)  # where newer transformers save a template
    for layer in model.model.layers:  # its RoPE table is a buffer, bf16-rounded by the save: rebuilt in fp32
        rope = layer.self_attn.rotary_emb
        rope.inv_freq = 1.0 / (rope.base ** (torch.arange(0, rope.dim, 2, dtype=torch.int64).float() / rope.dim))

    ps = prompts()
    rec, meta = {}, {"arch": "nanbeige", "max_loops": 4, "prompts": ps, "greedy": {}, "exit": {}}
    with torch.no_grad():
        x = torch.tensor([ps["a"]])
        for L in range(1, 5):  # every loop count the converted model allows (max_loops = 2 x num_loops)
            model.config.num_loops = L
            rec[f"logits_L{L}"] = model(x, use_cache=False).logits[0].float()
        for L in (1, 2, 3):
            model.config.num_loops = L
            for name in ("a", "b"):
                p = torch.tensor([ps[name]])
                gen = model.generate(p, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True, eos_token_id=None,
                                     pad_token_id=0)
                meta["greedy"][f"{name}_L{L}"] = gen[0, p.shape[1]:].tolist()
        model.config.num_loops = 2
    write_reference(out, "nanbeige", rec, meta, d)


def make_gpt4_tokenizer(specials: list[str]) -> Tokenizer:
    """A GPT-4-style byte-level BPE (split regex, then ByteLevel), no post-processor."""
    tok = Tokenizer(models.BPE(byte_fallback=True))
    split = pre_tokenizers.Split(Regex(r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}"""
                                       r"""\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""), behavior="isolated")
    tok.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials, show_progress=False, min_frequency=0,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def write_reference(out: Path, arch: str, rec: dict, meta: dict, d: Path) -> None:
    text = ["hello world", "def f(x):\n    return x", "The quick brown fox."]
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(d)
    meta["tokens"] = {t: hf(t)["input_ids"] for t in text}
    assert all(meta["tokens"][t] == tok.encode(t).ids for t in text)
    msgs = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"}]
    meta["chat"] = {"messages": msgs, "text": hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                    "ids": hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)}
    save_file({k: v.contiguous() for k, v in rec.items()}, str(out / f"{arch}_reference.safetensors"))
    (out / f"{arch}_reference.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(arch, "written:", sorted(rec), "greedy", meta["greedy"].get("a_L4"), "exit", meta["exit"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref", required=True, help="directory holding the ouro_ref/, huginn_ref/ and parcae packages")
    ap.add_argument("--only", choices=["ouro", "huginn", "parcae", "nanbeige"], action="append", help="build only these")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests" / "data" / "hf"))
    args = ap.parse_args()
    sys.path.insert(0, str(Path(args.ref).resolve()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for build in (ouro, huginn, parcae, nanbeige):
        if not args.only or build.__name__ in args.only:
            build(Path(args.ref), out)


if __name__ == "__main__":
    main()
