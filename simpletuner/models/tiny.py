"""Shared pieces for the ``tiny`` flavours: offline tokenizers and the on-disk checkpoint location.

A tiny checkpoint is a random-initialised model written in the real diffusers folder layout, created on first
use (deterministic from a seed) and then read back by the same ``from_pretrained`` code as real weights.
"""

from __future__ import annotations

import json
import os
import shutil
import string
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# bump when a tiny checkpoint's architecture or init changes, so stale folders are not reused
TINY_FORMAT = 3  # 3: Qwen-Image's carries Qwen2.5-VL's processor and the edit template's words
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
        empty = _empty_components(tmp)
        if empty:
            # transformers' save_pretrained writes nothing on a rank other than 0 once torch.distributed is up:
            # this process's copy is incomplete, and rank 0 is writing the whole one
            return _wait_for(target, f"{', '.join(empty)} came out empty here (not rank 0 of a distributed run?)")
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "model_index.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _empty_components(folder: Path) -> list[str]:
    """The components model_index.json names whose folder is missing or empty."""
    index = json.loads((folder / "model_index.json").read_text()) if (folder / "model_index.json").is_file() else {}
    return [name for name, spec in index.items()
            if not name.startswith("_") and isinstance(spec, list) and spec[0] is not None
            and not ((folder / name).is_dir() and any((folder / name).iterdir()))]


def _wait_for(target: Path, why: str, timeout: float = 600.0) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (target / "model_index.json").is_file():
            return target
        time.sleep(0.2)
    raise RuntimeError(f"tiny checkpoint {target}: {why}, and no other process wrote it within {timeout:.0f} s")


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


# ---- builders shared by the image families' tiny flavours (SD3, AuraFlow, PixArt Sigma, Sana, Lumina2, Chroma) ----
def _sentencepiece_bpe(specials: tuple[str, ...]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A SentencePiece-style BPE vocabulary ("▁" marks a word start) over _CHARS, with _WORDS merged whole."""
    chars = _CHARS + string.ascii_uppercase
    vocab: dict[str, int] = {}
    for token in (*specials, "▁", *chars, *("▁" + c for c in chars)):
        vocab.setdefault(token, len(vocab))
    merges = [("▁", c) for c in chars]
    for word in _WORDS:
        current = "▁" + word[0]
        for ch in word[1:]:
            merges.append((current, ch))
            current += ch
            vocab.setdefault(current, len(vocab))
    return vocab, list(dict.fromkeys(merges))


def gemma_tokenizer(max_length: int = 512):
    """A small Gemma BPE tokenizer built offline (same class and special tokens as Gemma 2: BOS first)."""
    from transformers import GemmaTokenizer

    vocab, merges = _sentencepiece_bpe(("<pad>", "<eos>", "<bos>", "<unk>", "<mask>"))
    return GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, model_max_length=max_length)


def llama_tokenizer(max_length: int = 512):
    """A small Llama BPE tokenizer built offline, with T5's habits (pad token, EOS appended, no BOS) as AuraFlow's
    Pile-T5 tokenizer has them."""
    from transformers import LlamaTokenizer

    vocab, merges = _sentencepiece_bpe(("<unk>", "<s>", "</s>", "<pad>"))
    return LlamaTokenizer(vocab=vocab, merges=merges, pad_token="<pad>", add_bos_token=False, add_eos_token=True,
                          model_max_length=max_length)


def clip_text_encoder(tokenizer, *, hidden_size: int = 32, projection_dim: int | None = None):
    """A 2-layer CLIP text encoder for ``tokenizer``; with ``projection_dim`` the ``WithProjection`` variant."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=tokenizer.model_max_length,
        projection_dim=projection_dim or hidden_size, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModelWithProjection(config) if projection_dim else CLIPTextModel(config)


def t5_encoder(tokenizer, *, d_model: int = 32, umt5: bool = False):
    """A 2-layer T5 (or UMT5, AuraFlow's) encoder for ``tokenizer``."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    config_class, model_class = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    return model_class(config_class(
        vocab_size=len(tokenizer), d_model=d_model, d_ff=2 * d_model, d_kv=8, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=0,
    ))


def gemma2_encoder(tokenizer, *, hidden_size: int = 32):
    """A 2-layer Gemma 2 base model (the text encoder of Sana and Lumina 2) for ``tokenizer``."""
    from transformers import Gemma2Config, Gemma2Model

    return Gemma2Model(Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=hidden_size // 2, max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        sliding_window=64,
    ))


def autoencoder_kl(*, latent_channels: int, scaling_factor: float, shift_factor: float | None = None,
                   quant_conv: bool = False):
    """A 4-level (8x) KL autoencoder, so the pipeline's VAE scale factor is the real one."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 16, 16, 16), layers_per_block=1,
        latent_channels=latent_channels, norm_num_groups=8, sample_size=64, scaling_factor=scaling_factor,
        shift_factor=shift_factor, use_quant_conv=quant_conv, use_post_quant_conv=quant_conv,
    )


def autoencoder_tiny(latent_channels: int):
    """A Tiny AutoEncoder (live previews) for latents of ``latent_channels`` at an 8x scale."""
    from diffusers import AutoencoderTiny

    return AutoencoderTiny(
        encoder_block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
        latent_channels=latent_channels, num_encoder_blocks=(1, 1, 1, 1), num_decoder_blocks=(1, 1, 1, 1),
    )


# ---- byte-level BPE tokenizers (Qwen, Llama 3, Mistral), built offline ----------------------------------------------
# whole words of the instruction templates the LLM-encoder pipelines wrap prompts in (Qwen-Image's system prompt is
# then 34 tokens, as with the real tokenizer, so the pipeline's fixed drop index cuts exactly the template)
TEMPLATE_WORDS = (
    "system", "user", "assistant", "Describe", "image", "by", "detailing", "color", "shape", "size", "texture",
    "quantity", "text", "spatial", "relationships", "objects", "background", "You", "are", "AI", "that", "reasons",
    "about", "descriptions", "give", "structured", "responses", "focusing", "object", "attribution", "actions",
    "without", "speculation",
)
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>")
# Qwen3's chat template, for what the pipelines render: one user turn, the generation prompt, the thinking switch
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)


def byte_level_bpe(words=()) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges) of a byte-level BPE as GPT-2-style tokenizers (Qwen, Llama 3, Mistral) lay them out: the 256
    byte symbols, then merges learned (deterministically, by the tokenizers library's trainer) from ``_WORDS`` +
    ``words``, bare and with a leading space, so that each of those words is one token."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=100_000, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [form for word in dict.fromkeys((*_WORDS, *words)) for form in (word, " " + word)]
    backend.train_from_iterator(corpus, trainer)
    model = json.loads(backend.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return model["vocab"], merges


def qwen2_tokenizer(max_length: int = 32768, chat_template: str | None = QWEN3_CHAT_TEMPLATE, words=()):
    """A byte-level BPE ``Qwen2Tokenizer`` (the class Qwen2.5-VL, Qwen3 and their pipelines load) with Qwen's chat
    special tokens and the template words (and ``words``) as single tokens."""
    from transformers import AddedToken, Qwen2Tokenizer

    vocab, merges = byte_level_bpe(TEMPLATE_WORDS + tuple(words))
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=max_length,
                               errors="replace", clean_up_tokenization_spaces=False)
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True) for t in QWEN_SPECIALS
                                                                 if t != "<|endoftext|>"]})
    tokenizer.add_tokens(["<think>", "</think>"])
    if chat_template:
        tokenizer.chat_template = chat_template
    return tokenizer


def fast_byte_level_tokenizer(*, bos: str, eos: str, specials=(), max_length: int = 131072, add_bos: bool = True,
                              chat_template: str | None = None, words=TEMPLATE_WORDS):
    """A byte-level BPE ``PreTrainedTokenizerFast`` that prepends ``bos`` (Llama 3's and Mistral's tokenizers are
    of this kind), with the template ``words`` as single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab, merges = byte_level_bpe(words)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos,
                                        model_max_length=max_length, clean_up_tokenization_spaces=False)
    tokenizer.add_special_tokens({"additional_special_tokens": list(specials)})
    if add_bos:
        bos_id = tokenizer.convert_tokens_to_ids(bos)
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    if chat_template:
        tokenizer.chat_template = chat_template
    return tokenizer


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
