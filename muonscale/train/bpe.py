"""Optional byte-level BPE tokenizer, trained on the corpus with Hugging Face ``tokenizers``.

``tokenizers`` is imported lazily (``pip install tokenizers``); the byte tokenizer needs
nothing. A trained tokenizer is cached as JSON under the user cache folder
(``$MUONSCALE_CACHE_DIR``, else ``$XDG_CACHE_HOME/muonscale``, else ``~/.cache/muonscale``),
keyed by the corpus sha256 and the vocabulary size, never inside the package; a cached file
that cannot be read (truncated, damaged) is trained again and replaced, with a warning.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from muonscale.user_cache import cache_dir

CHUNK_CHARS = 1 << 16
"""Training and encoding both see the text in chunks of about this size, cut after a newline
(so merges never cross a chunk border and encoding agrees with training)."""


def _chunks(text: str) -> Iterator[str]:
    start = 0
    while start < len(text):
        end = text.find("\n", start + CHUNK_CHARS)
        end = len(text) if end < 0 else end + 1
        yield text[start:end]
        start = end


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError as error:
        raise ImportError(
            "the 'bpe' tokenizer needs the 'tokenizers' package: pip install tokenizers "
            "(or use the default byte tokenizer)"
        ) from error
    return tokenizers


class BPETokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenization, lossless on any UTF-8 text)."""

    name = "bpe"

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()

    @classmethod
    def trained_on(
        cls, text: str, vocab_size: int, *, directory: Path | None = None
    ) -> BPETokenizer:
        """Load the cached tokenizer for (text, vocab_size), training and caching it first if
        needed."""
        tokenizers = _import_tokenizers()
        if vocab_size < 257:
            raise ValueError(f"BPE vocab_size must be > 256 (the byte alphabet), got {vocab_size}")
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
        path = (directory or cache_dir() / "tokenizers") / f"bpe-{vocab_size}-{digest}.json"
        if path.exists():
            try:
                tokenizer = tokenizers.Tokenizer.from_file(str(path))
            except Exception as error:  # noqa: BLE001 - the Rust side raises bare Exception
                warnings.warn(
                    f"cached BPE tokenizer {path} is unreadable ({error}); training it again "
                    "and replacing the file",
                    stacklevel=2,
                )
            else:
                return cls(tokenizer)
        tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
        tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = tokenizers.decoders.ByteLevel()
        trainer = tokenizers.trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tokenizer.train_from_iterator(_chunks(text), trainer=trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tokenizer.save(str(temporary))
        os.replace(temporary, path)
        return cls(tokenizer)

    def encode(self, text: str) -> torch.Tensor:
        """Token ids, shape (n,), dtype int32."""
        encodings = self._tokenizer.encode_batch(list(_chunks(text)))
        ids = [i for encoding in encodings for i in encoding.ids]
        return torch.tensor(ids, dtype=torch.int32)

    def decode(self, ids) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self._tokenizer.decode([int(i) for i in ids])
