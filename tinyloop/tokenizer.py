"""Byte-level BPE tokenizer (the `tokenizers` library), trained on the same corpus as the model."""
from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


class TextCodec:
    """What generation needs from a tokenizer: encode, decode, and the EOS id."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.token_to_id(EOS_TOKEN)
        self.vocab_size = tokenizer.get_vocab_size()

    @classmethod
    def from_json(cls, text: str) -> "TextCodec":
        return cls(Tokenizer.from_str(text))

    def to_json(self) -> str:
        return self.tokenizer.to_str()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
