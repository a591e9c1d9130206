"""The `tinyloop` command."""
from __future__ import annotations

import os
import sys

import click

from scripts.service_cli import depth_options


@click.group()
def main() -> None:
    """TinyLoop: run, inspect, train and benchmark looped transformer models, and serve them."""


def fail(err: Exception) -> None:
    from scripts.service_cli import in_option_words

    click.echo(f"error: {in_option_words(str(err))}", err=True)
    sys.exit(2)


@main.command()
@click.argument("prompt")
@click.option("--model", "model_path", default=None,
              help="A .tinyloop artifact or a Hugging Face model directory (Ouro, Huginn; default: the bundled model).")
@click.option("--max-tokens", default=64, show_default=True, help="Tokens to generate at most.")
@click.option("--max-seq-len", default=2048, show_default=True, help="Longest sequence (prompt + output) to allocate for.")
@click.option("--loops", type=int, default=None, help="Loop count (default: the model's).")
@click.option("--temperature", default=0.0, show_default=True, help="Sampling temperature (0: greedy).")
@click.option("--top-k", default=0, show_default=True, help="Sample among the k likeliest tokens (0: all).")
@click.option("--top-p", default=1.0, show_default=True, help="Nucleus sampling: the smallest set of this mass.")
@click.option("--repetition-penalty", default=1.0, show_default=True, help="CTRL-style penalty for repeated tokens (1 = off).")
@click.option("--seed", type=int, default=None, help="Sampler seed: the same seed gives the same output.")
@click.option("--stop", multiple=True, help="Stop sequence (repeatable).")
@click.option("--cache-mode", type=click.Choice(["fp16", "int8", "int4"]), default=None,
              help="KV cache mode (default: $TINYLOOP_CACHE_MODE or fp16).")
@click.option("--cache-window", type=int, default=None, help="Sliding attention window in tokens (0 = off).")
@click.option("--early-exit", type=float, default=None, help="Early-exit threshold of the exit rule (0 = off).")
@depth_options
@click.option("--beam-size", type=int, default=1, show_default=True, help="Beam search width (greedy only).")
@click.option("--grammar", default=None, help="Constrain output: EBNF (contains ::=), a JSON schema, or a regex.")
@click.option("--speculative", default=None, metavar="D:V:A[:W]",
              help="Self-speculative decode: draft loops, verify loops, draft-ahead tokens, tree width (e.g. 2:8:4).")
@click.option("--chat", is_flag=True, help="PROMPT is a user message: render it with the model's chat template.")
@click.option("--system", default=None, help="With --chat: a system message before the user's.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="Weights' dtype (default: bf16 checkpoints stay bf16, others run fp32 on CPU).")
@click.option("--init-scale", type=float, default=None,
              help="Scale of a random initial state (Huginn's init_scale, default 1.0; 0: a zero state).")
@click.option("--weights", default=None, metavar="FORMAT",
              help="Weight format: fp32, bf16, int8, int4 or int4:GROUP (default: the artifact's own). On the CPU "
                   "int8 / int4 products quantise activations to int8 (TINYLOOP_ACT_QUANT=off: weight-only).")
def generate(prompt, model_path, max_tokens, max_seq_len, loops, temperature, top_k, top_p, repetition_penalty, seed,
             stop, cache_mode, cache_window, early_exit, exit_rule, min_loops, max_loss_increase, beam_size, grammar,
             speculative, chat, system, dtype, init_scale, weights) -> None:
    """Generate a continuation of PROMPT, streamed, then print the stats line.

    stdout carries the prompt and the answer only; the stats line and errors go to stderr. Everything
    that can be checked before decoding is checked first, so an error never lands after the prompt."""
    import tinyloop

    printed = None  # text on stdout so far; None until the prompt is printed (at the first token)
    try:
        import torch

        from tinyloop.formats import parse_spec

        fmt, group = parse_spec(weights) if weights else (None, None)
        model = tinyloop.load_model(model_path, max_seq_len, cache_mode=cache_mode, init_scale=init_scale,
                                    dtype=getattr(torch, dtype) if dtype else None, weights=fmt, group=group)
        if chat:  # the prompt becomes the rendered conversation, shown as it goes in
            from tinyloop.chat import chat_ids

            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            prompt_ids = chat_ids(model, messages)
            prompt_text = model.codec.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        else:
            prompt_ids, prompt_text = prompt, prompt
        cfg = tinyloop.GenerateConfig(max_tokens=max_tokens, loops=loops, temperature=temperature, top_k=top_k,
                                      top_p=top_p, repetition_penalty=repetition_penalty, seed=seed,
                                      stop_sequences=list(stop), beam_size=beam_size, grammar=grammar,
                                      exit_rule=exit_rule, min_loops=min_loops,
                                      max_loss_increase=max_loss_increase)
        if cache_window is not None:
            cfg.cache_window = cache_window
        if early_exit is not None:
            cfg.early_exit_threshold = early_exit
        cfg.validate(model)
        prompt_len = len(model.encode_prompt(prompt_ids))
        if prompt_len + max_tokens > max_seq_len:  # worded for the command line, which has no load_model call
            raise tinyloop.ConfigError(f"the prompt ({prompt_len} tokens) + --max-tokens {max_tokens} exceeds "
                                       f"--max-seq-len {max_seq_len}; raise --max-seq-len or lower --max-tokens")
        sc = None
        if speculative:
            from tinyloop.speculative import parse_speculative

            sc = parse_speculative(speculative, "--speculative")
        from tinyloop.detokenize import Detokenizer

        answer = Detokenizer(model.codec)

        def on_token(token: int, index: int) -> bool:
            nonlocal printed
            if printed is None:
                click.echo(prompt_text, nl=False)
                printed = ""
            piece = answer.push(token)
            click.echo(piece, nl=False)
            printed += piece
            return True

        if sc is not None:
            result = tinyloop.generate_speculative(model, prompt_ids, sc, cfg, on_token=on_token)
        else:
            result = tinyloop.generate_stream(model, prompt_ids, cfg, on_token)
        click.echo((prompt_text if printed is None else "") + result.text[len(printed or ""):])
        click.echo(result.stats.line() + speculative_line(result.stats), err=True)
    except tinyloop.TinyLoopError as e:
        if printed is not None:
            click.echo()  # end the partial answer's line: the error gets a line of its own on stderr
        fail(e)


def speculative_line(stats: object) -> str:
    """What speculation did, for the stats line (empty for plain decode)."""
    drafted = getattr(stats, "drafted", None)
    if drafted is None:
        return ""
    rate = stats.accepted / drafted if drafted else 0.0
    return (f" [speculative: {stats.accepted}/{drafted} drafted tokens accepted ({rate:.0%}), "
            f"{stats.tokens_per_verify:.2f} tokens per verify step]")


@main.command()
@click.argument("path", required=False)
@click.option("--config-only", is_flag=True,
              help="Read the config alone (no weights) and print the memory plan per cache mode.")
@click.option("--max-seq-len", default=4096, show_default=True, help="Sequence length of the --config-only plan.")
@click.option("--formats", "with_formats", is_flag=True,
              help="Also measure the held-out loss in every weight format (fp32, bf16, int8, int4; takes seconds).")
def inspect(path, config_only, max_seq_len, with_formats) -> None:
    """Show an artifact's (or Hugging Face model directory's) config, parameter counts, beta, loss-versus-loops table
    and cache costs."""
    from tinyloop.artifact import DEFAULT_ARTIFACT
    from scripts.inspect_model import config_text, format_loss_text, inspect_text
    import tinyloop

    try:
        click.echo(config_text(path or str(DEFAULT_ARTIFACT), max_seq_len) if config_only else inspect_text(path))
        if with_formats:
            click.echo(format_loss_text(path))
    except tinyloop.TinyLoopError as e:
        fail(e)


@main.command()
@click.argument("src")
@click.argument("out")
@click.option("--weights", required=True, metavar="FORMAT", help="bf16, int8, int4 or int4:GROUP (default group 32).")
def quantize(src, out, weights) -> None:
    """Write SRC (a .tinyloop artifact or a Hugging Face model directory) to OUT with its matrices in a weight
    format (docs/kernels.md, Weight formats): load_model(OUT) then holds and multiplies them in that format."""
    import tinyloop
    from tinyloop.artifact import save_artifact
    from tinyloop.formats import parse_spec

    try:
        fmt, group = parse_spec(weights)
        model = tinyloop.load_model(src, 2, weights=fmt, group=group, device="cpu")
        save_artifact(out, model.net, model.info.codec, beta=model.info.beta, loss_vs_loops=model.info.loss_vs_loops,
                      provenance={**model.info.provenance, "quantized_from": str(src), "weights": weights})
        click.echo(f"wrote {out}: {fmt} weights, {model.weight_bytes() / 2**20:.1f} MiB")
    except tinyloop.TinyLoopError as e:
        fail(e)


@main.command()
@click.argument("hf_dir")
@click.argument("out")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="Stored dtype (default: the checkpoint's, bf16 for the real ones).")
@click.option("--exit-kv", type=click.Choice(["compute", "copy"]), default=None,
              help="Early exit: compute the loops after a token's exit (the reference's outputs) or skip them "
                   "and copy their K/V (less compute). Default: the architecture's (docs/hf.md).")
@click.option("--max-loops", type=int, default=None, help="Largest loop count the artifact accepts.")
def convert(hf_dir, out, dtype, exit_kv, max_loops) -> None:
    """Convert a Hugging Face model directory (Ouro, Huginn, Llama) into a .tinyloop artifact, shard by shard, or a
    GGUF file (its Q4_0 matrices stay int4, other types are written as their values: docs/gguf.md)."""
    import torch

    import tinyloop
    from tinyloop.artifact import save_artifact
    from tinyloop.gguf import is_gguf
    from tinyloop.hf import convert as run_convert

    try:
        if is_gguf(hf_dir):
            if exit_kv or max_loops:
                raise tinyloop.ConfigError("convert: --exit-kv and --max-loops are for looped models; a GGUF file "
                                           "holds a dense one")
            model = tinyloop.load_model(hf_dir, 2, device="cpu", act_quant=False)
            save_artifact(out, model.net, model.codec, provenance=model.info.provenance,
                          dtype=getattr(torch, dtype) if dtype else model.dtype)
            click.echo(f"wrote {out} ({model.weights} weights, {os.path.getsize(out) / 2**20:.1f} MiB)")
            return
        overrides = {k: v for k, v in (("exit_kv", exit_kv), ("max_loops", max_loops)) if v is not None}
        path = run_convert(hf_dir, out, getattr(torch, dtype) if dtype else None, **overrides)
        click.echo(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    except tinyloop.TinyLoopError as e:
        fail(e)


@main.command()
@click.option("--model", "model_path", default=None, type=click.Path(exists=True, resolve_path=True),
              help="Path to a .tinyloop artifact (default: the bundled model); sections that start services pass it on.")
@click.option("--section", "sections", multiple=True, help="Run only these sections (repeatable).")
@click.option("--quick", is_flag=True, help="Fewer tokens and repeats (a smoke run).")
@click.option("--peers", is_flag=True, help="TinyLoop against transformers and llama.cpp on the dense twin, and the "
              "memory bandwidth (the 'peers' section; docs/kernels.md, Peers), and against llama.cpp on a real GGUF "
              "file (the 'gguf' section; docs/gguf.md).")
@click.option("--json", "json_path", default=None, help="Write every section's lines and measurements here as JSON.")
@click.option("--plot", "plot_path", default=None, help="Draw decode tok/s per format and batch against the peers "
              "(PNG; needs matplotlib).")
@click.option("--weights", default=None, metavar="FORMAT",
              help="Weight format of the model the sections load: fp32, bf16, int8, int4 or int4:GROUP (the "
                   "kernels and peers sections compare every format anyway).")
def bench(model_path, sections, quick, peers, json_path, plot_path, weights) -> None:
    """Benchmarks: ratios measured side by side in one run."""
    import os

    from scripts.bench.plots import PlotError, write_results
    from scripts.bench.run import SECTIONS, run_bench
    from tinyloop.formats import parse_spec

    if weights:
        try:
            parse_spec(weights)
        except ValueError as e:
            fail(e)
        os.environ["TINYLOOP_WEIGHTS"] = weights  # every section's load_model reads it

    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        fail(ValueError(f"unknown section(s) {unknown}; known: {sorted(SECTIONS)}"))
    sections = list(sections) + ([s for s in ("peers", "gguf") if s not in sections] if peers else [])
    results = run_bench(model_path, sections or None, quick, click.echo)
    try:
        write_results(results, json_path, plot_path, "bench")
    except PlotError as e:
        fail(e)


@main.command()
def modes() -> None:
    """Print the mode matrix (which runtime modes compose with which calls) as a markdown table, and the modes a
    depth range (elastic depth) is refused with."""
    from tinyloop.modes import depth_range_table, markdown_table

    click.echo(markdown_table())
    click.echo()
    click.echo(depth_range_table())


@main.command()
@click.option("--out", default="default.tinyloop", show_default=True, help="The artifact to write.")
@click.option("--steps", default=900, show_default=True, help="Optimizer steps.")
@click.option("--lr", default=3e-3, show_default=True, help="Peak learning rate.")
@click.option("--seq-len", default=256, show_default=True, help="Tokens per training sequence.")
@click.option("--batch-size", default=16, show_default=True, help="Sequences per step.")
@click.option("--seed", default=0, show_default=True, help="Seed of the initialisation and the data order.")
@click.option("--init-from", default=None, help="Continue from a .ckpt written by an earlier run.")
@click.option("--state-init", type=click.Choice(["zeros", "embed", "normal"]), default=None,
              help="Initial recurrent state of the loop (default: the model config's).")
@click.option("--init-sigma", type=float, default=None, help="Standard deviation of a 'normal' initial state.")
def train(out, steps, lr, seq_len, batch_size, seed, init_from, state_init, init_sigma) -> None:
    """Train a looped model on the Python standard library. The bundled model's recipe (docs/model.md):
    `tinyloop train --out stage1.tinyloop` then
    `tinyloop train --init-from stage1.tinyloop.ckpt --state-init normal --init-sigma 8 --steps 400 --lr 1.5e-3 --seed 1`."""
    from scripts.train import train as run_train

    overrides = {k: v for k, v in (("state_init", state_init), ("init_sigma", init_sigma)) if v is not None}
    run_train(out, steps=steps, lr=lr, seq_len=seq_len, batch_size=batch_size, seed=seed, init_from=init_from,
              cfg_overrides=overrides, log=lambda m: click.echo(m))


from scripts.service_cli import add_service_commands  # noqa: E402 - the service commands live beside the service code

add_service_commands(main)
from scripts.gateway_cli import gateway_command, gateway_loadtest_command  # noqa: E402 - docs/gateway.md
main.add_command(gateway_command), main.add_command(gateway_loadtest_command)

if __name__ == "__main__":
    main()
