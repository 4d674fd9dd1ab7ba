"""api.tokenizer: byte ids, a real tokenizer.json built here with `tokenizers`, load errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from tokenizers.processors import TemplateProcessing
from tokenizers.trainers import WordLevelTrainer

from api.tokenizer import (
    ByteTokenizer,
    HuggingFaceTokenizer,
    Tokenizer,
    TokenizerLoadError,
    load_tokenizer,
)
from tokenization import tokens

SENTENCES = [
    "the router sends each request to the worker with the best cache",
    "the worker stores blocks of tokens in its cache",
    "a request shares a prefix with an earlier request",
]


@pytest.fixture
def tokenizer_json(tmp_path: Path) -> Path:
    """A tiny word-level tokenizer that adds [CLS]/[SEP] unless told not to, with truncation on."""
    tok = HFTokenizer(WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.train_from_iterator(SENTENCES, WordLevelTrainer(special_tokens=["[UNK]", "[CLS]",
                                                                         "[SEP]"]))
    tok.post_processor = TemplateProcessing(
        single="[CLS] $A [SEP]",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))],
    )
    tok.enable_truncation(max_length=4)
    path = tmp_path / "model" / "tokenizer.json"
    path.parent.mkdir()
    tok.save(str(path))
    return path


def test_byte_tokenizer_is_utf8_bytes() -> None:
    bt = ByteTokenizer()
    assert bt.name == "bytes"
    assert bt.encode("aé✓") == list("aé✓".encode())
    assert bt.encode("aé✓") == tokens.encode("aé✓")
    assert isinstance(bt, Tokenizer)


@pytest.mark.parametrize("path", [None, "", "bytes"])
def test_load_tokenizer_defaults_to_bytes(path: str | None) -> None:
    assert isinstance(load_tokenizer(path), ByteTokenizer)


def test_hf_tokenizer_from_file_no_special_tokens_no_truncation(tokenizer_json: Path) -> None:
    hf = HuggingFaceTokenizer(str(tokenizer_json))
    assert isinstance(hf, Tokenizer)
    assert hf.name == "model"
    text = "the worker sends a request to the router"
    ids = hf.encode(text)
    ref = HFTokenizer.from_file(str(tokenizer_json))
    vocab = ref.get_vocab()
    assert ids == [vocab[w] for w in text.split()]  # every word, no [CLS]/[SEP], not truncated
    assert vocab["[CLS]"] not in ids and vocab["[SEP]"] not in ids
    assert hf.encode("zebra") == [vocab["[UNK]"]]


def test_hf_tokenizer_from_directory_matches_file(tokenizer_json: Path) -> None:
    by_dir = load_tokenizer(str(tokenizer_json.parent))
    by_file = load_tokenizer(str(tokenizer_json))
    assert isinstance(by_dir, HuggingFaceTokenizer)
    assert by_dir.encode(SENTENCES[0]) == by_file.encode(SENTENCES[0])
    # Shared prefix text -> shared prefix ids (what KV routing relies on).
    a, b = by_file.encode("the worker stores blocks"), by_file.encode("the worker stores cache")
    assert a[:3] == b[:3] and a != b


def test_missing_file_error_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "tokenizer.json"
    with pytest.raises(TokenizerLoadError, match="nowhere"):
        load_tokenizer(str(missing))


def test_garbage_file_error_names_the_path(tmp_path: Path) -> None:
    bad = tmp_path / "broken.json"
    bad.write_text("{ this is not a tokenizer")
    with pytest.raises(TokenizerLoadError, match=r"broken\.json"):
        HuggingFaceTokenizer(str(bad))
    with pytest.raises(ValueError):  # TokenizerLoadError is a ValueError for generic callers
        HuggingFaceTokenizer(str(tmp_path))  # a directory without tokenizer.json
