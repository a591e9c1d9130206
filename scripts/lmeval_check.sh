#!/usr/bin/env bash
# lm-evaluation-harness through the gateway versus a direct in-process adapter (docs/gateway.md).
#
#   bash scripts/lmeval_check.sh            # prints both runs' metrics and their per-sample differences
#
# 1. A throwaway venv ($LMEVAL_VENV, default /tmp/tinyloop-lmeval-venv): torch==2.13.0 FIRST (the CPU
#    build; installed later, lm-eval's dependencies would pull a multi-GB CUDA torch), then lm-eval[api]
#    and transformers, then TinyLoop itself. lm-eval is not a TinyLoop dependency.
# 2. Two small local tasks over files written here (no dataset can be downloaded): `tl_mc` (multiple
#    choice: log-likelihoods of Python continuations) and `tl_gen` (generate_until: greedy completions
#    stopped at a newline), and the bundled model's tokenizer as a Hugging Face tokenizer directory, so
#    lm-eval splits and tokenizes contexts exactly as the model does.
# 3. `tinyloop serve --http-port` (one worker) and lm-eval's `local-completions` model against
#    /v1/completions (tokenized requests; log-likelihoods via echo + logprobs).
# 4. The same tasks through scripts/lmeval_adapter.py (tinyloop.score / tinyloop.generate in process).
# 5. A comparison: the metrics, the largest per-sample log-likelihood difference and whether every
#    generated text is equal. Expected: equal metrics and texts; log-likelihoods equal up to float noise
#    (the worker scores prompt + one generated token, the adapter the prompt alone, so the forwards have
#    different lengths; causal attention makes them mathematically equal).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
VENV=${LMEVAL_VENV:-/tmp/tinyloop-lmeval-venv}
WORK=${LMEVAL_WORK:-$(mktemp -d /tmp/tl-lmeval.XXXX)}
PORT=${LMEVAL_PORT:-18765}
if [ ! -x "$VENV/bin/lm_eval" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet torch==2.13.0
  "$VENV/bin/pip" install --quiet "lm-eval[api]" transformers
fi
"$VENV/bin/python" -c "import tinyloop" 2>/dev/null || "$VENV/bin/pip" install --quiet -e "$REPO"
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY="$VENV/bin/python"

# ---- data, task YAMLs and the tokenizer directory
"$PY" - "$WORK" <<'PYEOF'
import json, sys
from pathlib import Path
import tinyloop

work = Path(sys.argv[1])
(work / "tasks").mkdir(parents=True, exist_ok=True)
mc = [("import os\nimport ", ["sys", "banana", "12345"]), ("def __init__(self", ["):", " +", "]]"]),
      ("for i in range(", ["10):", "'a'", "else"]), ("if __name__ == ", ["'__main__':", "42", "def"]),
      ("        return self.", ["_value", "))(", "import"]), ("class Foo(", ["object):", "1, 2", "return"]),
      ("    except ", ["ValueError:", "while", "+="]), ("from collections import ", ["OrderedDict", "lambda", "]"]),
      ("print(", ["'hello')", "def", "class"]), ("x = [1, 2, ", ["3]", "def", "import"]),
      ("while True:\n    ", ["break", ")))", "="]), ("raise ", ["ValueError(", "+", "]"])]
with open(work / "mc.jsonl", "w") as f:
    for i, (context, choices) in enumerate(mc):
        k = i % len(choices)  # move the right answer around
        f.write(json.dumps({"context": context, "choices": choices[k:] + choices[:k], "gold": (len(choices) - k) % len(choices)}) + "\n")
# No trailing spaces: the byte-level BPE attaches a space to the word after it.
gen = [("import os\nimport", " sys"), ("def __init__(self", "):"), ("for i in range(", "10):"),
       ("if __name__ ==", " '__main__':"), ("class Foo(", "object):"), ("from collections import", " OrderedDict"),
       ("    def __repr__(self):\n        return", " self"), ("try:\n    import", " json")]
with open(work / "gen.jsonl", "w") as f:
    for prompt, target in gen:
        f.write(json.dumps({"prompt": prompt, "target": target}) + "\n")
common = "dataset_path: json\ntest_split: test\ntarget_delimiter: \"\"\n"
(work / "tasks" / "tl_mc.yaml").write_text(
    f"task: tl_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {work / 'mc.jsonl'}\noutput_type: multiple_choice\n"
    "doc_to_text: \"{{context}}\"\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{gold}}\"\n"
    "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
(work / "tasks" / "tl_gen.yaml").write_text(
    f"task: tl_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {work / 'gen.jsonl'}\noutput_type: generate_until\n"
    "doc_to_text: \"{{prompt}}\"\ndoc_to_target: \"{{target}}\"\n"
    "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n  do_sample: false\n"
    "metric_list:\n  - metric: exact_match\n")
model = tinyloop.load_model()
tok = work / "tokenizer"
tok.mkdir(exist_ok=True)
(tok / "tokenizer.json").write_text(model.codec.to_json())
(tok / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                       "eos_token": "<|endoftext|>", "model_max_length": 2048}))
print(f"tasks, data and tokenizer in {work}")
PYEOF

# ---- through the gateway
"$PY" -m scripts.service_cli serve --workers 1 --frontend "ipc://$WORK/f" --backend "ipc://$WORK/b" \
  --http-port "$PORT" --log-dir "$WORK/logs" --max-seq-len 2048 &
SERVE=$!
trap 'kill $SERVE 2>/dev/null || true; wait $SERVE 2>/dev/null || true' EXIT
for _ in $(seq 300); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  sleep 1
done
"$VENV/bin/lm_eval" --model local-completions \
  --model_args "base_url=http://127.0.0.1:$PORT/v1/completions,model=tinyloop-default,tokenizer_backend=huggingface,tokenizer=$WORK/tokenizer,tokenized_requests=True,num_concurrent=1,max_retries=1,max_length=2048" \
  --tasks tl_mc,tl_gen --include_path "$WORK/tasks" --output_path "$WORK/gateway" --log_samples
kill $SERVE; wait $SERVE 2>/dev/null || true
trap - EXIT

# ---- in process
"$PY" scripts/lmeval_adapter.py --tasks tl_mc,tl_gen --include-path "$WORK/tasks" --out "$WORK/inprocess.json"

# ---- compare
"$PY" - "$WORK" <<'PYEOF'
import glob, json, sys
from pathlib import Path

work = Path(sys.argv[1])
gw_results = json.loads(Path(sorted(glob.glob(f"{work}/gateway/**/results_*.json", recursive=True))[-1]).read_text())["results"]
ip = json.loads((work / "inprocess.json").read_text())
print(f"\n{'task':<8} {'metric':<22} {'gateway':>10} {'in-process':>10}")
for task in ("tl_mc", "tl_gen"):
    for metric, value in gw_results[task].items():
        if not isinstance(value, float) or "stderr" in metric:
            continue
        print(f"{task:<8} {metric:<22} {value:>10.4f} {ip['results'][task][metric]:>10.4f}")
worst, texts_equal, greedy_equal = 0.0, True, True
for task in ("tl_mc", "tl_gen"):
    path = sorted(glob.glob(f"{work}/gateway/**/samples_{task}_*.jsonl", recursive=True))[-1]
    gw = {row["doc_id"]: row["filtered_resps"] for row in map(json.loads, open(path))}
    for row in ip["samples"][task]:
        a, b = gw[row["doc_id"]], row["filtered_resps"]
        if task == "tl_gen":
            texts_equal &= a == b
        else:
            for (la, ga), (lb, gb) in zip(a, b):
                worst = max(worst, abs(float(la) - float(lb)))
                greedy_equal &= str(ga) == str(gb)
print(f"\nlargest per-choice log-likelihood difference: {worst:.2e} (nats)")
print(f"is_greedy flags equal: {greedy_equal}; generated texts equal: {texts_equal}")
sys.exit(0 if texts_equal and greedy_equal and worst < 1e-3 else 1)
PYEOF
