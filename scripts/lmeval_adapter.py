"""A direct, in-process lm-evaluation-harness model for TinyLoop (no service, no HTTP), the
reference that scripts/lmeval_check.sh compares the gateway's `local-completions` run with.

Needs lm-eval installed (the throwaway venv of lmeval_check.sh; lm-eval is not a TinyLoop
dependency). It reuses lm-eval's TemplateLM, so contexts and continuations are split and
tokenized exactly as for an API model, then:

* loglikelihood: tinyloop.score of context + continuation at `loops`, log_softmax, summed over the
  continuation; greedy = every continuation token is the argmax (what the gateway's
  echo + logprobs gives lm-eval);
* loglikelihood_rolling: the same over a whole text after the end-of-text token (perplexity tasks);
* generate_until: tinyloop.generate, greedy, with the `until` strings as stop sequences.

    python scripts/lmeval_adapter.py --tasks tl_mc,tl_gen --include-path DIR --out results.json
"""
from __future__ import annotations

import argparse
import json

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

import tinyloop


@register_model("tinyloop-inprocess")
class TinyLoopLM(TemplateLM):
    def __init__(self, model: str | None = None, loops: int | None = None, max_seq_len: int = 2048,
                 max_gen_toks: int = 256, **kwargs) -> None:
        super().__init__()
        self.model = tinyloop.load_model(model, max_seq_len=int(max_seq_len))
        self.loops = int(loops) if loops else None
        self.max_gen_toks = int(max_gen_toks)

    @property
    def eot_token_id(self) -> int:
        return self.model.eos_id

    def tok_encode(self, string: str, **kwargs) -> list[int]:
        return self.model.codec.encode(string)

    def _loglikelihood_tokens(self, requests, **kwargs) -> list[tuple[float, bool]]:
        out = []
        for _pair, context, continuation in requests:
            seq = (context + continuation)[-self.model.max_seq_len:]
            logp = torch.log_softmax(tinyloop.score(self.model, seq[:-1], self.loops), dim=-1)
            rows = logp[len(seq) - 1 - len(continuation):]  # the rows that predict the continuation
            picked = rows[torch.arange(len(continuation)), torch.tensor(continuation)]
            out.append((float(picked.sum()), bool((rows.argmax(-1) == torch.tensor(continuation)).all())))
        return out

    def loglikelihood_rolling(self, requests, **kwargs) -> list[float]:
        """Log-likelihood of each whole text, its first token conditioned on the end-of-text token (lm-eval's
        convention); texts longer than max_seq_len are scored on their last max_seq_len - 1 tokens."""
        out = []
        for request in requests:
            tokens = self.tok_encode(request.args[0])[-(self.model.max_seq_len - 1):]
            out.append(self._loglikelihood_tokens([(None, [self.eot_token_id], tokens)])[0][0])
        return out

    def generate_until(self, requests, **kwargs) -> list[str]:
        out = []
        for request in requests:
            context, gen = request.args
            until = gen.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            cfg = tinyloop.GenerateConfig(max_tokens=int(gen.get("max_gen_toks", self.max_gen_toks)), loops=self.loops,
                                          temperature=0.0, stop_sequences=until)
            text = tinyloop.generate(self.model, context, cfg).text
            for stop in until:  # what lm-eval does with an API model's text as well
                text = text.split(stop)[0]
            out.append(text)
        return out


def main() -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager

    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", required=True)
    ap.add_argument("--include-path", required=True)
    ap.add_argument("--model-args", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    results = lm_eval.simple_evaluate(model="tinyloop-inprocess", model_args=args.model_args, log_samples=True,
                                      tasks=args.tasks.split(","), task_manager=TaskManager(include_path=args.include_path))
    samples = {task: [{"doc_id": s["doc_id"], "filtered_resps": s["filtered_resps"]} for s in rows]
               for task, rows in results["samples"].items()}
    with open(args.out, "w") as f:
        json.dump({"results": results["results"], "samples": samples}, f, indent=2, default=str)
    print(json.dumps(results["results"], indent=2, default=str))


if __name__ == "__main__":
    main()
