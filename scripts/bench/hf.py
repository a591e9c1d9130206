"""Decode speed of a converted checkpoint in TinyLoop against the reference code's own `generate`, side by side.

    python scripts/bench/hf.py --ref REF --ref-python /work/refenv/bin/python [--model tests/data/hf/ouro-tiny]
        [--batch 16] [--threads 2]

REF and the reference environment are as in scripts/make_hf_fixtures.py (the reference code is not part of
TinyLoop). The two run in alternating subprocesses (TinyLoop in this interpreter's environment, the reference in
--ref-python's), each at --batch copies of one prompt (TinyLoop: generate_batch; the reference: one batched
`generate`), greedy, fp32, --threads intra-op threads, for --rounds rounds; a decode rate is B (N - 1) / (time to
generate N tokens - time to generate 1 token), the same measure for both, best round kept.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed(fn, n: int) -> float:
    t = time.perf_counter()
    fn(n)
    return time.perf_counter() - t


def run_tinyloop(model_dir: str, loops: int, n: int, prompt: list[int], batch: int, threads: int) -> float:
    import torch
    import tinyloop
    torch.set_num_threads(threads)
    model = tinyloop.load_model(model_dir, 512, dtype=torch.float32, init_scale=0.0)

    def gen(k):
        cfg = tinyloop.GenerateConfig(max_tokens=k, loops=loops, temperature=0, ignore_eos=True)
        return tinyloop.generate(model, prompt, cfg) if batch == 1 else tinyloop.generate_batch(model, [prompt] * batch, cfg)
    gen(n)  # warm-up
    return batch * (n - 1) / (timed(gen, n) - timed(gen, 1))


def run_reference(ref: str, model_dir: str, loops: int, n: int, prompt: list[int], batch: int, threads: int) -> float:
    import torch
    sys.path.insert(0, ref)
    torch.set_num_threads(threads)
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    kind = raw.get("model_type") or raw.get("model_class_name")
    ids = torch.tensor([prompt] * batch)
    if kind == "Parcae":  # receval's loader and its own cached generation
        from receval.models.parcae import ModelingParcae
        model = ModelingParcae.from_pretrained(model_dir)

        def gen_parcae(k):
            model.generate(ids, max_new_tokens=k, do_sample=False, num_steps=loops, use_cache=True)
        gen_parcae(n)
        return batch * (n - 1) / (timed(gen_parcae, n) - timed(gen_parcae, 1))
    if kind == "ouro":
        from ouro_ref.modeling_ouro import OuroForCausalLM
        model = OuroForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
        model.config.total_ut_steps = model.model.total_ut_steps = loops
        extra = {}
    else:
        from huginn_ref.raven_modeling_minimal import RavenForCausalLM
        model = RavenForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        extra = {"num_steps": loops, "init_scale": 0.0}

    def gen(k):
        with torch.no_grad():
            model.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False, use_cache=True, eos_token_id=None,
                           pad_token_id=0, **extra)
    gen(n)
    return batch * (n - 1) / (timed(gen, n) - timed(gen, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref", default=None, help="directory holding ouro_ref/ and huginn_ref/")
    ap.add_argument("--ref-python", default=None, help="python of the reference environment")
    ap.add_argument("--model", action="append", default=None, help="HF model directory (repeatable)")
    ap.add_argument("--loops", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", choices=["tinyloop", "reference"], default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    prompt = list(range(10, 42))
    if args.child:  # one measurement, printed as JSON
        m = args.model[0]
        run = run_tinyloop if args.child == "tinyloop" else partial(run_reference, args.ref)
        rate = run(m, args.loops, args.tokens, prompt, args.batch, args.threads)
        print(json.dumps({"tok_s": rate}))
        return
    models = args.model or [str(ROOT / "tests/data/hf/ouro-tiny"), str(ROOT / "tests/data/hf/huginn-tiny")]
    print(f"decode tok/s at batch {args.batch}, {args.tokens} tokens, {args.loops} loops, fp32, {args.threads} "
          f"thread(s) (best of {args.rounds})")
    print(f"{'model':<14} {'TinyLoop':>10} {'reference':>10} {'ratio':>7}")
    for m in models:
        best = {"tinyloop": 0.0, "reference": 0.0}
        for _ in range(args.rounds):
            for child, py in (("tinyloop", sys.executable), ("reference", args.ref_python)):
                cmd = [py, __file__, "--child", child, "--model", m, "--loops", str(args.loops), "--tokens",
                       str(args.tokens), "--batch", str(args.batch), "--threads", str(args.threads)] + \
                    (["--ref", args.ref] if args.ref else [])
                out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
                if out.returncode:
                    sys.exit(f"{child} failed:\n{out.stderr[-2000:]}")
                best[child] = max(best[child], json.loads(out.stdout.strip().splitlines()[-1])["tok_s"])
        print(f"{Path(m).name:<14} {best['tinyloop']:>10.1f} {best['reference']:>10.1f} "
              f"{best['tinyloop'] / best['reference']:>6.2f}x")


if __name__ == "__main__":
    main()
