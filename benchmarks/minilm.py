"""Sentence embeddings of all-MiniLM-L6-v2 from its weights alone: a BERT encoder forward
pass in plain torch, BERT's uncased WordPiece tokenization from ``vocab.txt``, and mean
pooling over the last hidden state (what sentence-transformers does for this model).

Written here so that the near-lossless bench needs neither transformers nor tokenizers;
the tests compare both against those libraries where they are installed.
"""

from __future__ import annotations

import json
import math
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import torch

MAX_WORD_CHARS = 100  # longer words are one [UNK], as in BERT


@dataclass(frozen=True, kw_only=True)
class BertShape:
    layers: int
    heads: int
    eps: float = 1e-12

    @classmethod
    def from_config(cls, path: Path) -> BertShape:
        config = json.loads(path.read_text())
        if config.get("hidden_act", "gelu") != "gelu" or config.get("position_embedding_type",
                                                                     "absolute") != "absolute":
            raise ValueError(f"{path}: only BERT with gelu and absolute positions is supported")
        return cls(layers=config["num_hidden_layers"], heads=config["num_attention_heads"],
                   eps=config.get("layer_norm_eps", 1e-12))


# --- tokenization ----------------------------------------------------------------------

class WordPiece:
    """BERT's uncased tokenizer: lower case, accents stripped, punctuation split off,
    then greedy longest-match WordPiece with ``##`` continuations."""

    def __init__(self, vocab: list[str]) -> None:
        self.ids = {token: i for i, token in enumerate(vocab)}
        self.unk, self.cls, self.sep = (self.ids[t] for t in ("[UNK]", "[CLS]", "[SEP]"))

    @classmethod
    def from_file(cls, path: Path) -> WordPiece:
        return cls(path.read_text(encoding="utf-8").splitlines())

    def encode(self, text: str) -> list[int]:
        ids = [self.cls]
        for word in _basic_words(text):
            ids += self._pieces(word)
        return ids + [self.sep]

    def _pieces(self, word: str) -> list[int]:
        if len(word) > MAX_WORD_CHARS:
            return [self.unk]
        pieces, start = [], 0
        while start < len(word):
            for end in range(len(word), start, -1):
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.ids:
                    pieces.append(self.ids[piece])
                    start = end
                    break
            else:
                return [self.unk]
        return pieces


def _basic_words(text: str) -> list[str]:
    text = unicodedata.normalize("NFD", text.lower())
    text = "".join(c for c in text if unicodedata.category(c) != "Mn" and not _is_control(c))
    words: list[str] = []
    for chunk in text.split():
        current = ""
        for c in chunk:
            if _is_punctuation(c) or _is_cjk(c):
                words += [current, c] if current else [c]
                current = ""
            else:
                current += c
        if current:
            words.append(current)
    return words


def _is_control(c: str) -> bool:
    return c not in "\t\n\r" and unicodedata.category(c).startswith("C") or c == "\ufffd" or c == "\x00"


def _is_punctuation(c: str) -> bool:
    code = ord(c)
    return 33 <= code <= 47 or 58 <= code <= 64 or 91 <= code <= 96 or 123 <= code <= 126 or (
        unicodedata.category(c).startswith("P"))


def _is_cjk(c: str) -> bool:
    code = ord(c)
    return any(lo <= code <= hi for lo, hi in ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF),
                                               (0x2A700, 0x2B73F), (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF),
                                               (0xF900, 0xFAFF), (0x2F800, 0x2FA1F)))


# --- the encoder -----------------------------------------------------------------------

def _layer_norm(x: torch.Tensor, w: dict, name: str, eps: float) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, x.shape[-1:], w[f"{name}.weight"], w[f"{name}.bias"], eps)


def _linear(x: torch.Tensor, w: dict, name: str) -> torch.Tensor:
    return torch.nn.functional.linear(x, w[f"{name}.weight"], w[f"{name}.bias"])


def _attention(x: torch.Tensor, mask: torch.Tensor, w: dict, name: str, heads: int) -> torch.Tensor:
    batch, seq, width = x.shape

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.view(batch, seq, heads, width // heads).transpose(1, 2)

    q, k, v = (split(_linear(x, w, f"{name}.self.{part}")) for part in ("query", "key", "value"))
    scores = q @ k.transpose(-1, -2) / math.sqrt(width // heads)
    scores = scores.masked_fill(~mask[:, None, None, :], torch.finfo(scores.dtype).min)
    context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, width)
    return _linear(context, w, f"{name}.output.dense")


def last_hidden_state(w: dict, shape: BertShape, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """BERT's encoder output for token ids ``ids`` (batch x seq, 0-padded where ``mask`` is False)."""
    positions = torch.arange(ids.shape[1])
    h = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][positions]
         + w["embeddings.token_type_embeddings.weight"][0])
    h = _layer_norm(h, w, "embeddings.LayerNorm", shape.eps)
    for i in range(shape.layers):
        name = f"encoder.layer.{i}"
        h = _layer_norm(h + _attention(h, mask, w, f"{name}.attention", shape.heads), w,
                        f"{name}.attention.output.LayerNorm", shape.eps)
        inner = torch.nn.functional.gelu(_linear(h, w, f"{name}.intermediate.dense"))
        h = _layer_norm(h + _linear(inner, w, f"{name}.output.dense"), w, f"{name}.output.LayerNorm", shape.eps)
    return h


def sentence_embeddings(w: dict, shape: BertShape, tokenizer: WordPiece, sentences: list[str],
                        max_tokens: int = 256) -> torch.Tensor:
    """Mean-pooled last hidden states, one row per sentence (float64 for the comparison)."""
    encoded = [tokenizer.encode(s)[:max_tokens] for s in sentences]
    seq = max(len(e) for e in encoded)
    ids = torch.zeros(len(encoded), seq, dtype=torch.long)
    mask = torch.zeros(len(encoded), seq, dtype=torch.bool)
    for row, e in enumerate(encoded):
        ids[row, :len(e)] = torch.tensor(e)
        mask[row, :len(e)] = True
    weights = {k: v.float() for k, v in w.items()}
    with torch.no_grad():
        h = last_hidden_state(weights, shape, ids, mask).double()
    m = mask[..., None].double()
    return (h * m).sum(1) / m.sum(1)
