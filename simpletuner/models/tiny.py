"""Shared pieces for the ``tiny`` flavours: offline tokenizers and the on-disk checkpoint location.

A tiny checkpoint is a random-initialised model written in the real diffusers folder layout, created on first
use (deterministic from a seed) and then read back by the same ``from_pretrained`` code as real weights.
"""

from __future__ import annotations

import os
import shutil
import string
import tempfile
from collections.abc import Callable
from pathlib import Path

# bump when a tiny checkpoint's architecture or init changes, so stale folders are not reused
TINY_FORMAT = 2
_CHARS = string.ascii_lowercase + string.digits + ".,!?'-:;()"
_WORDS = ("the", "a", "an", "of", "on", "in", "and", "with", "photo", "red", "blue", "green", "circle", "square")


def tiny_root() -> Path:
    """Where tiny checkpoints are kept (``SIMPLETUNER_TINY_DIR`` or ~/.cache/simpletuner/tiny)."""
    env = os.environ.get("SIMPLETUNER_TINY_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "simpletuner" / "tiny"


def ensure_checkpoint(name: str, writer: Callable[[Path], None]) -> Path:
    """Return ``tiny_root()/name``, writing it with ``writer(tmp_dir)`` first if it does not exist.

    The folder appears atomically (written to a temp dir, then renamed), so a concurrent or interrupted
    writer never leaves a half-written checkpoint behind.
    """
    target = tiny_root() / f"{name}-v{TINY_FORMAT}"
    if (target / "model_index.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        writer(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "model_index.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def clip_tokenizer(max_length: int = 77):
    """A character-level CLIP BPE tokenizer built offline (same class and pipeline as real CLIP)."""
    from transformers import CLIPTokenizer

    vocab: dict[str, int] = {}
    for c in _CHARS:
        vocab[c] = len(vocab)
    for c in _CHARS:
        vocab[c + "</w>"] = len(vocab)
    merges = []
    for word in _WORDS:
        # merge each word left to right so common words become one token
        current = word[0]
        for ch in word[1:-1]:
            merges.append((current, ch))
            current += ch
            vocab.setdefault(current, len(vocab))
        if len(word) > 1:
            merges.append((current, word[-1] + "</w>"))
            vocab.setdefault(word + "</w>", len(vocab))
    merges = list(dict.fromkeys(merges))
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)


def t5_tokenizer(max_length: int = 512):
    """A small unigram T5 tokenizer built offline (same class as real T5)."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + w, -1.0) for w in _WORDS]
    chars = _CHARS + string.ascii_uppercase
    pieces += [("▁" + c, -3.0) for c in chars]
    pieces += [(c, -4.0) for c in chars]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)


def sentencepiece_model(vocab_size: int = 96) -> bytes:
    """A small sentencepiece BPE model trained offline on the tiny vocabulary (serialized ModelProto bytes), for
    tokenizer classes that read a ``tokenizer.model`` file (ChatGLM's)."""
    import io

    import sentencepiece as spm

    words = _WORDS + ("triangle", "background", "yellow", "purple", "white", "black", "orange")
    sentences = [" ".join(words[i:] + words[:i]) for i in range(len(words))] + list(_CHARS)
    model = io.BytesIO()
    # identity normalisation keeps the model file small and byte-for-byte reproducible
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        character_coverage=1.0, num_threads=1, minloglevel=2, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        hard_vocab_limit=False, normalization_rule_name="identity",
    )
    return model.getvalue()
