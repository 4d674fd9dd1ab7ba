"""A tiny random-weight Llama with an offline-trained tokenizer, for running a real vLLM here.

No hub download is possible, so both halves are made in-process: the tokenizer is a byte-level
BPE trained with the ``tokenizers`` package on a deterministic generated corpus (plus a
``tokenizer_config.json`` with a Llama-style chat template, so vLLM's chat endpoint works), and
the weights come from a ``transformers.LlamaConfig`` saved with ``save_pretrained``. Weights are
random, so the text is gibberish; what matters is that the engine does real prefill work, caches
real blocks and publishes real KV events.

The weights half needs torch and transformers, i.e. the vLLM environment::

    .venv-vllm/bin/python -m workers.vllm.tinymodel OUT_DIR [--layers 4 --hidden 512]

`write_tokenizer` needs only ``tokenizers`` (in the router's environment too), so tests and the
router can build the same tokenizer folder without vLLM.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

VOCAB_SIZE = 2048
BOS, EOS, UNK = "<s>", "</s>", "<unk>"
# The Llama-2 chat layout, in the jinja dialect transformers and vLLM render: BOS once, system
# prompt folded into the first user turn, one [INST] block per user message.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set messages = messages[1:] %}"
    "{% else %}{% set system = '' %}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}"
    "{% if loop.first and system %}"
    "{{ '[INST] <<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% endif %}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + message['content'] + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)
_WORDS = ("the a an of to in is was for on with as by at from that this it be are or and not "
          "router cache block token prefix engine request stream event worker replica model "
          "prompt system user assistant answer question hello world please explain why how what "
          "when where which who latency throughput memory attention layer hidden state value key "
          "query batch sequence decode prefill schedule queue load balance hash chain store remove "
          "clear replay snapshot ledger digest offset subject message consumer publisher").split()


def _corpus(lines: int = 4000, seed: int = 0) -> list[str]:
    """Deterministic pseudo-English (with digits and punctuation) to train the BPE merges on."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 24))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 100000)))
        out.append(" ".join(words).capitalize() + rng.choice(".?!,:;"))
    return out


def write_tokenizer(out_dir: Path, vocab_size: int = VOCAB_SIZE) -> Path:
    """tokenizer.json + tokenizer_config.json (chat template, BOS/EOS) into ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[UNK, BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Like Llama's tokenizers: encoding with special tokens prepends BOS (vLLM's completions
    # endpoint does; its chat endpoint lets the template write BOS and adds none).
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "unk_token": UNK,
        "add_bos_token": True, "add_eos_token": False,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "unk_token": UNK}, indent=2) + "\n")
    return out_dir


HEAD_DIM = 64  # vLLM's CPU attention has kernels for some head sizes only (16 is refused)


def write_model(out_dir: Path, *, layers: int = 4, hidden: int = 512,
                max_positions: int = 4096, seed: int = 0) -> Path:
    """Random Llama weights (bfloat16 safetensors) + the tokenizer into ``out_dir``."""
    if hidden % HEAD_DIM:
        raise ValueError(f"hidden size must be a multiple of {HEAD_DIM}")
    heads = hidden // HEAD_DIM
    try:  # only the vLLM environment has them; the router's never does
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as exc:
        raise SystemExit(f"writing model weights needs torch and transformers ({exc}); run "
                         "this with the vLLM environment's python (make vllm-env)") from None

    write_tokenizer(out_dir)
    vocab = len(json.loads((out_dir / "tokenizer.json").read_text())["model"]["vocab"])
    added = json.loads((out_dir / "tokenizer.json").read_text())["added_tokens"]
    vocab_size = max(vocab, max(t["id"] for t in added) + 1)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=True, torch_dtype="bfloat16")
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workers.vllm.tinymodel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--tokenizer-only", action="store_true",
                   help="write only the tokenizer folder (no torch/transformers needed)")
    args = p.parse_args(argv)
    if args.tokenizer_only:
        write_tokenizer(args.out_dir)
    else:
        write_model(args.out_dir, layers=args.layers, hidden=args.hidden)
    print(f"wrote {args.out_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
