"""tokenization.model_tokenizer on a real model folder (workers/tinymodel.py, trained offline):
completions get the tokenizer's BOS, chats render the template and add nothing, and the router
(api.openai_schema) and the simulated engine (workers.openai_shapes) compute identical ids."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer

from api.errors import ApiError
from api.openai_schema import parse_request as router_parse
from api.tokenizer import HuggingFaceTokenizer, load_model_tokenizer
from tokenization.model_tokenizer import (
    ByteCodec,
    ChatTemplateFailed,
    ModelFolderUnusable,
    ModelTokenizer,
    load_codec,
)
from workers.openai_shapes import BadRequest
from workers.openai_shapes import parse_request as worker_parse
from workers.tinymodel import BOS, EOT, write_tokenizer_folder

ROOT = Path(__file__).resolve().parents[3]
CHAT = [{"role": "system", "content": "You are a careful router."},
        {"role": "user", "content": "which worker holds the cache for this prompt?"}]


def router_ids(model: Path, endpoint: str, body: dict) -> list[int]:
    tok = load_model_tokenizer(str(model))
    return router_parse(endpoint, json.dumps(body).encode(), tok,
                        max_prompt_tokens=100_000).prompt_ids


def worker_ids(model: Path, chat: bool, body: dict) -> list[int]:
    return worker_parse(body, chat=chat, default_max_tokens=16,
                        codec=load_codec(model)).prompt_ids


def test_folder_has_a_2048_vocab_bos_and_template(tiny_model: Path) -> None:
    config = json.loads((tiny_model / "tokenizer_config.json").read_text())
    assert config["bos_token"] == BOS and "chat_template" in config
    raw = HFTokenizer.from_file(str(tiny_model / "tokenizer.json"))
    assert raw.get_vocab_size() == 2048
    # Deterministic: a second build writes the same tokenizer.
    other = write_tokenizer_folder(tiny_model.parent / "again")
    assert (Path(other.path) / "tokenizer.json").read_text() == \
        (tiny_model / "tokenizer.json").read_text()


def test_completion_prompt_gets_bos_like_vllm(tiny_model: Path) -> None:
    tok = ModelTokenizer(tiny_model)
    bos = tok.encode(BOS)
    assert len(bos) == 1  # the special token is one id, never split
    text = "the router sends each request to the worker"
    plain = tok.encode(text)
    assert tok.encode_prompt(text) == bos + plain
    assert tok.encode_prompt(text, add_special_tokens=False) == plain
    # Words are merged: far fewer ids than bytes (what makes byte tokens so costly).
    assert len(plain) < len(text.encode()) / 3


def test_chat_renders_the_template_and_adds_no_second_bos(tiny_model: Path) -> None:
    tok = ModelTokenizer(tiny_model)
    text = tok.render_chat(CHAT)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "You are a careful router.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
        "which worker holds the cache for this prompt?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = tok.encode_chat(CHAT)
    bos = tok.encode(BOS)[0]
    assert ids[0] == bos and ids.count(bos) == 1
    assert ids.count(tok.encode(EOT)[0]) == 2
    assert ids == tok.encode_prompt(text, add_special_tokens=False)


def test_request_fields_reach_the_template(tiny_model: Path) -> None:
    tok = ModelTokenizer(tiny_model)
    no_gen = tok.render_chat(CHAT, {"add_generation_prompt": False})
    assert not no_gen.endswith("assistant<|end_header_id|>\n\n")
    # Text parts are joined with a newline, as vLLM hands them to a string template.
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]}]
    assert "a\nb<|eot_id|>" in tok.render_chat(parts)


def test_template_refusal_is_a_clear_400_on_both_sides(tiny_model: Path) -> None:
    body = {"model": "m", "messages": [{"role": "wizard", "content": "hi"}]}
    with pytest.raises(ChatTemplateFailed, match="unknown role: wizard"):
        ModelTokenizer(tiny_model).encode_chat(body["messages"])
    with pytest.raises(ApiError) as err:
        router_ids(tiny_model, "chat", body)
    assert err.value.status == 400 and "unknown role" in str(err.value)
    with pytest.raises(BadRequest, match="unknown role"):
        worker_ids(tiny_model, True, body)


@pytest.mark.parametrize("body", [
    {"model": "m", "prompt": "the cache of the worker holds a prefix"},
    {"model": "m", "prompt": ["the cache of the worker holds a prefix"]},
    {"model": "m", "prompt": "no bos here", "add_special_tokens": False},
    {"model": "m", "prompt": [5, 6, 7, 9000]},  # token ids pass through untouched
])
def test_router_and_engine_agree_on_completions(tiny_model: Path, body: dict) -> None:
    ids = router_ids(tiny_model, "completions", body)
    assert ids == worker_ids(tiny_model, False, body)
    if isinstance(body["prompt"], list) and isinstance(body["prompt"][0], int):
        assert ids == body["prompt"]


@pytest.mark.parametrize("extra", [{}, {"chat_template_kwargs": {"x": 1}},
                                   {"add_generation_prompt": False}])
def test_router_and_engine_agree_on_chat(tiny_model: Path, extra: dict) -> None:
    body = {"model": "m", "messages": CHAT, **extra}
    ids = router_ids(tiny_model, "chat", body)
    assert ids == worker_ids(tiny_model, True, body)
    assert ids == ModelTokenizer(tiny_model).encode_chat(CHAT, body)


def test_without_a_model_both_sides_stay_on_bytes() -> None:
    body = {"model": "m", "messages": CHAT}
    assert isinstance(load_codec(None), ByteCodec)
    ids = worker_parse(body, chat=True, default_max_tokens=16).prompt_ids
    assert ids == router_parse("chat", json.dumps(body).encode(), load_model_tokenizer(None),
                               max_prompt_tokens=100_000).prompt_ids
    assert max(ids) < 256


def test_tokenizer_file_alone_has_no_template(tiny_model: Path) -> None:
    """The older --tokenizer FILE: ids from the file, chats flattened by the built-in rule."""
    tok = HuggingFaceTokenizer(str(tiny_model / "tokenizer.json"))
    assert tok.chat_template is None
    assert "<|user|>" in tok.render_chat(CHAT)


def test_bad_folders_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(ModelFolderUnusable, match="does not exist"):
        load_codec(tmp_path / "nowhere")
    with pytest.raises(ModelFolderUnusable, match=r"no tokenizer\.json"):
        load_codec(tmp_path)


def test_serve_refuses_a_bad_model_path_with_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "api.cli", "serve", "--model-path",
                           str(tmp_path / "missing"), "--data-dir", str(tmp_path / "d")],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"jetrouter serve: error: model path {str(tmp_path / 'missing')!r} does not exist"]


def test_template_file_and_generation_tags(tiny_model: Path, tmp_path: Path) -> None:
    """A folder saved by newer transformers keeps the template in chat_template.jinja (it wins
    over the config's field); {% generation %} markers render their body."""
    folder = tmp_path / "m"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_text((tiny_model / name).read_text())
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}]{% generation %}{{ m.content }}{% endgeneration %}"
        "{% endfor %}")
    assert ModelTokenizer(folder).render_chat(CHAT[1:]) == f"[user]{CHAT[1]['content']}"
