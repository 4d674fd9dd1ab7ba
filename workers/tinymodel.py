"""A tiny model folder built offline: a byte-level BPE ``tokenizer.json`` trained here with the
``tokenizers`` package, and a ``tokenizer_config.json`` with a Llama-3-style chat template.

No model hub can be reached (or may be), yet tests, the demo and benches need a real
HuggingFace-format tokenizer to prove the router tokenizes like the engine. This writes one in a
fraction of a second, deterministically (same folder contents on every machine for the same
arguments). The files are what ``transformers``' ``AutoTokenizer`` and vLLM load; a caller that
needs weights (the real-vLLM demo) writes ``config.json`` and weights beside them and can take the
ids it needs (vocab size, BOS/EOS) from the returned :class:`TinyTokenizerInfo`.

Usage: ``python -m workers.tinymodel DIR`` or ``write_tokenizer_folder(DIR)``.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
HEADER_START, HEADER_END, EOT = "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, HEADER_START, HEADER_END, EOT)
DEFAULT_VOCAB_SIZE = 2048

# Llama 3's template, minus tools and dates: BOS once, a header per message, <|eot_id|> after each
# message, and the assistant header as the generation prompt. Every turn's prompt is a prefix of
# the next turn's, so a conversation reuses its KV cache.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('unknown role: ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim }}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

# Common English words: the training corpus, and the vocabulary of the bench's text prompts, so
# a trained token is roughly a word (a real tokenizer's ratio of ~4-6 bytes per token).
WORDS = (
    "the of and to in is was he for it with as his on be at by had are but from or have an they "
    "which one you were her all she there would their we him been has when who will more no if "
    "out so said what up its about into than them can only other new some could time these two "
    "may then do first any my now such like our over man me even most made after also did many "
    "before must through back years where much your way well down should because each just "
    "those people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old "
    "year off come since against go came right used take three cache router engine request block "
    "token prefix worker stream replica snapshot event model prompt answer system user assistant "
    "memory latency throughput schedule queue batch decode prefill layer weight tensor vector "
    "river mountain garden window kitchen morning evening winter summer yellow purple silver "
    "quiet gentle rapid careful simple ancient modern distant hidden golden open closed"
).split()


@dataclass(frozen=True, slots=True)
class TinyTokenizerInfo:
    """What a caller writing a model ``config.json`` next to the tokenizer needs."""

    path: str
    vocab_size: int
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    eot_token_id: int


def corpus(lines: int = 8000, seed: int = 0) -> Iterator[str]:
    """Deterministic training text: random sentences of :data:`WORDS`, plus every printable
    ASCII character, so any text tokenizes (byte-level BPE covers every byte anyway)."""
    rng = random.Random(seed)
    yield "".join(chr(c) for c in range(32, 127))
    # Made-up words (syllable chains) next to the real ones give BPE enough distinct pairs to
    # fill a vocabulary of ~2048 instead of stopping once every real word is one token.
    made_up = ["".join(rng.choice("bdfgklmnprstvz") + rng.choice("aeiou")
                       for _ in range(rng.randint(2, 4))) for _ in range(1500)]
    vocabulary = list(WORDS) * 4 + made_up
    for _ in range(lines):
        n = rng.randint(4, 16)
        words = [rng.choice(vocabulary) for _ in range(n)]
        if rng.random() < 0.3:
            words[0] = words[0].capitalize()
        yield " ".join(words) + rng.choice((".", ".", "?", "!", ","))


def build_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = 0):  # type: ignore[no-untyped-def]
    """A trained byte-level BPE ``tokenizers.Tokenizer`` whose post-processor adds BOS (as
    Llama 3's does, so ``add_special_tokens=True`` prepends it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(seed=seed), trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                      special_tokens=[(BOS, bos_id)]),
    ])
    return tok


def tokenizer_config(max_length: int = 2048) -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {},
    }


def write_tokenizer_folder(directory: str | Path, *, vocab_size: int = DEFAULT_VOCAB_SIZE,
                           max_length: int = 2048, seed: int = 0) -> TinyTokenizerInfo:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` into
    ``directory`` (created if needed); other files there are left alone."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(vocab_size, seed)
    tok.save(str(folder / "tokenizer.json"))
    config = tokenizer_config(max_length)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    config["added_tokens_decoder"] = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True} for t, i in ids.items()}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2) + "\n")
    return TinyTokenizerInfo(str(folder), tok.get_vocab_size(with_added_tokens=True),
                             ids[BOS], ids[EOS], ids[PAD], ids[EOT])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m workers.tinymodel DIR", file=sys.stderr)
        return 2
    print(json.dumps(asdict(write_tokenizer_folder(args[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
