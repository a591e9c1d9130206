"""Tokenizers through the `tokenizers` library: the bundled model's byte-level BPE (trained on the same corpus as
the model) and a Hugging Face checkpoint's tokenizer.json with its special tokens and chat template."""
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
    """What generation needs from a tokenizer: encode, decode, the EOS id, and (for chat models) the chat template
    with the special-token strings it is rendered with."""

    def __init__(self, tokenizer: Tokenizer, eos_id: int | None = None, chat_template: str | None = None,
                 bos_token: str = "", eos_token: str = ""):
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.token_to_id(EOS_TOKEN) if eos_id is None else eos_id
        self.vocab_size = tokenizer.get_vocab_size()
        self.chat_template, self.bos_token = chat_template, bos_token
        self.eos_token = eos_token or (tokenizer.id_to_token(self.eos_id) or "" if self.eos_id is not None else "")

    @classmethod
    def from_json(cls, text: str, chat: dict | None = None, eos_id: int | None = None) -> "TextCodec":
        chat = chat or {}
        return cls(Tokenizer.from_str(text), eos_id, chat.get("template"), chat.get("bos_token", ""),
                   chat.get("eos_token", ""))

    def to_json(self) -> str:
        return self.tokenizer.to_str()

    def chat_dict(self) -> dict:
        """What an artifact stores beside the tokenizer so a converted chat model keeps its template."""
        return {"template": self.chat_template, "bos_token": self.bos_token, "eos_token": self.eos_token}

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids of text. special: the tokenizer's own additions (a BOS in front, for some), as transformers'
        tokenizer(text) does; a rendered chat template already holds them (special=False, as apply_chat_template)."""
        return self.tokenizer.encode(text, add_special_tokens=special).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
