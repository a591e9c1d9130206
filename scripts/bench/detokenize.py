"""tinyloop bench detokenize: streaming the text of a long output, the one incremental detokenizer against decoding
the whole output again at every token (what the worker's stream and the stop matcher did before)."""
from __future__ import annotations

from scripts.bench.timing import timed
from tinyloop.detokenize import Detokenizer
from tinyloop.loader import load_model
from tinyloop.generation import generate
from tinyloop.request import GenerateConfig


def bench_detokenize(model_path: str | None, quick: bool) -> list[str]:
    model = load_model(model_path, 4096)
    n = 500 if quick else 2000
    tokens = generate(model, "def main():\n", GenerateConfig(max_tokens=n, temperature=0.8, seed=0)).tokens
    codec = model.codec

    def whole_again() -> str:
        sent = ""
        for m in range(1, len(tokens) + 1):
            text = codec.decode(tokens[:m])
            sent += text[len(sent):]
        return sent

    def incremental() -> str:
        detok = Detokenizer(codec)
        return "".join(detok.push(t) for t in tokens) + detok.flush()

    same = whole_again() == incremental() == codec.decode(tokens)
    old, new = timed(whole_again, 2), timed(incremental, 3)
    return [f"streaming the text of a {len(tokens)}-token output, best of 2-3",
            f"  decode everything at each token {old * 1000:8.1f} ms",
            f"  incremental detokenizer         {new * 1000:8.1f} ms   {old / new:.1f}x faster"
            f"{'' if same else '  (texts differ!)'}"]
