"""Tokenizers built offline, in code, for the zoo's tiny text encoders.

No hub is reachable, so every tokenizer a pipeline expects is made here from a small English
word list: a BPE learned with the ``tokenizers`` library (CLIP, Qwen2), a unigram list of whole
words plus single-character fallbacks (T5 / UMT5 / mT5), or a WordPiece vocabulary (BERT), then
wrapped in the transformers class the pipeline expects. Unknown words fall back to characters
(or ``[UNK]`` for BERT), so any prompt tokenizes.
"""

from __future__ import annotations

import json
import string
import tempfile
from pathlib import Path

WORDS = sorted(
    set(
        """
        a an the of on in at to and with without left right center middle top bottom
        red green blue yellow orange purple white black gray pink cyan magenta brown
        circle square triangle shape shapes dot ring box star big small large tiny
        photo picture image drawing painting of cat dog bird tree house car sky sea
        mountain city flower person face road river forest field night day sun moon
        blurry noisy ugly bad low quality high detailed beautiful simple background
        video walking running flying sitting standing
        """.split()
    )
)

CHARS = string.ascii_lowercase + string.digits + ".,!?'-:;()/"


def _corpus() -> list[str]:
    # each word several times so a BPE trainer learns whole-word tokens
    return [" ".join(WORDS)] * 4


def _learned_bpe(*, end_of_word_suffix: str | None, byte_level: bool, specials: list[str], vocab_size: int):
    """Train a small BPE on the word list (deterministic) and return (vocab dict, merges list)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    if byte_level:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok = Tokenizer(models.BPE(end_of_word_suffix=end_of_word_suffix))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        alphabet = list(CHARS)
    options = {"end_of_word_suffix": end_of_word_suffix} if end_of_word_suffix else {}
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet, show_progress=False, **options
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    with tempfile.TemporaryDirectory() as d:
        tok.model.save(d)
        vocab = json.loads(Path(d, "vocab.json").read_text())
        merges = [
            tuple(line.split(" ")) for line in Path(d, "merges.txt").read_text().splitlines() if line and not line.startswith("#")
        ]
    tokens = set(vocab)
    if end_of_word_suffix:
        # CLIP tokenizes a one-letter word as "x</w>": make sure each such token exists
        tokens |= {c + end_of_word_suffix for c in CHARS}
    # the trainer numbers its alphabet in hash-set order, which changes from run to run:
    # renumber (specials first, then by length and text) so token ids are reproducible. The
    # order of merges of equal count can still vary; every word of WORDS ends as one token
    # either way, so only the split of unknown words can differ between builds.
    ordered = specials + sorted(tokens - set(specials), key=lambda t: (len(t), t))
    return {t: i for i, t in enumerate(ordered)}, merges


def clip_tokenizer(model_max_length: int = 16):
    """A ``CLIPTokenizer`` (BPE with ``</w>`` word ends) for a tiny CLIP text encoder."""
    from transformers import CLIPTokenizer

    vocab, merges = _learned_bpe(
        end_of_word_suffix="</w>", byte_level=False, specials=["<|startoftext|>", "<|endoftext|>"], vocab_size=600
    )
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)


def t5_tokenizer(model_max_length: int = 512):
    """A ``T5Tokenizer`` (unigram: whole words, then characters) usable as T5/UMT5/mT5 tokenizer."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + w, -1.0) for w in WORDS]
    pieces += [(c, -5.0) for c in CHARS]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


def bert_tokenizer(model_max_length: int = 77):
    """A ``BertTokenizer`` (WordPiece vocabulary of whole words and characters)."""
    from transformers import BertTokenizer

    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS + [c for c in CHARS if c not in WORDS]
    tokens += ["##" + c for c in CHARS]
    return BertTokenizer(vocab={t: i for i, t in enumerate(tokens)}, model_max_length=model_max_length)


QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]


def qwen2_tokenizer(model_max_length: int = 1024):
    """A byte-level BPE ``Qwen2Tokenizer`` with the chat-template special tokens."""
    from transformers import Qwen2Tokenizer

    vocab, merges = _learned_bpe(end_of_word_suffix=None, byte_level=True, specials=QWEN_SPECIALS, vocab_size=800)
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)
    tok.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS[1:]})
    return tok
