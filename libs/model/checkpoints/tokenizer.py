"""A byte-level BPE tokenizer trained locally on a fixed corpus, carrying a family's special tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

_TEXT = (
    "the a an image video audio picture frame sound clip what is in this describe please "
    "answer question color red green blue white black cat dog bird car tree house sky water "
    "music voice speech noise left right top bottom first second third one two three four "
    "five six seven eight nine ten hello world assistant user system model token sequence "
    "time seconds minute quick brown fox jumps over lazy and or not yes no it there here "
    "you we they see hear look listen tell me"
)


def _corpus(lines: int = 4000) -> list[str]:
    # A fixed pseudo-random walk over the word list: deterministic without any RNG state.
    words_list = _TEXT.split()
    out = []
    state = 12345
    for _ in range(lines):
        words = []
        for _ in range(12):
            state = (state * 1103515245 + 12345) % (1 << 31)
            words.append(words_list[state % len(words_list)])
        out.append(" ".join(words) + ".")
    out.append("0123456789 .,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`\n\t")
    return out


def train_tokenizer(
    out_dir: Path,
    *,
    vocab_size: int,
    special_tokens: list[str],
    chat_template: str,
    eos: str,
    pad: str,
    named_tokens: dict[str, str] | None = None,
) -> Any:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast: Any = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad)  # type: ignore[no-untyped-call]
    fast.add_special_tokens({"additional_special_tokens": special_tokens})
    fast.chat_template = chat_template
    fast.save_pretrained(str(out_dir))
    if named_tokens:
        # As released checkpoints do: processors read e.g. `tokenizer.image_token` from here.
        config_path = out_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["model_specific_special_tokens"] = dict(named_tokens)
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return fast
