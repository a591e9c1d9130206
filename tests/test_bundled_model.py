"""The shipped default model: trained for real, more loops really help, it writes Python."""
import torch
import torch.nn.functional as F

import tinyloop
from scripts.train import read_corpus, stdlib_files


def held_out_loss(model, loops: int, ids: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model.net(ids[:, :-1], loops)
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).item()


def test_more_loops_give_clearly_lower_loss_on_held_out_code(bundled_model):
    texts = read_corpus(stdlib_files()[::50])[:16]  # the training script holds out one file in 50
    ids = torch.stack([torch.tensor(bundled_model.codec.encode(t)[:257]) for t in texts if len(t) > 4000])
    loss = {L: held_out_loss(bundled_model, L, ids) for L in (1, 4, 8)}
    assert loss[8] < loss[1] - 0.04 and loss[8] <= loss[4] + 0.005, loss
    table = bundled_model.info.loss_vs_loops  # the published table tells the same story
    assert table[8] < table[1] - 0.04


def test_bundled_model_writes_python(bundled_model):
    res = tinyloop.generate(bundled_model, "def fibonacci(n):\n    ", tinyloop.GenerateConfig(max_tokens=40))
    assert res.stats.generated_tokens > 10
    code = res.text
    assert any(word in code for word in ("return", "if ", "for ", "self", "=")), code
