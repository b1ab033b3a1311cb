"""Text corpus, byte-level tokenizer and a dataset whose batches are a pure function of
``(seed, step)``.

- :func:`load_corpus` reads the bundled Shakespeare corpus (``muonscale/data/shakespeare.txt.xz``,
  see ``muonscale/data/PROVENANCE.md``), a UTF-8 text file, or a folder of ``.txt`` files.
- :class:`ByteTokenizer` maps text to its UTF-8 bytes (vocab 256); :func:`make_tokenizer`
  returns the tokenizer a ``TrainConfig`` names.
- :class:`TokenDataset` splits the tokens into train (first part) and validation (last
  ``val_fraction``), draws training windows from a generator seeded by ``(seed, step)`` (so a
  resumed run sees exactly the batches an uninterrupted one would) and holds a fixed validation
  set of evenly spaced windows.
"""

from __future__ import annotations

import functools
import lzma
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

BUNDLED_CORPUS = Path(__file__).resolve().parent.parent / "data" / "shakespeare.txt.xz"
DOCUMENT_SEPARATOR = "\n\n"
"""Placed between the files of a folder (the bundled corpus was assembled the same way)."""


def _read_text_file(path: Path) -> str:
    raw = path.read_bytes()
    if not raw:
        raise ValueError(f"data file {path} is empty")
    if b"\x00" in raw[:65536]:
        raise ValueError(f"data file {path} looks binary (contains NUL bytes); expected UTF-8 text")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"data file {path} is not valid UTF-8 (invalid byte at offset {error.start}); "
            "expected UTF-8 text"
        ) from None


@functools.lru_cache(maxsize=1)
def _bundled_corpus() -> str:
    # cached: a side-by-side bench builds one TrainingRun per optimizer from the same text
    return lzma.decompress(BUNDLED_CORPUS.read_bytes()).decode("utf-8")


def load_corpus(path: str | Path | None = None) -> str:
    """The training text.

    ``None``: the bundled Shakespeare corpus. A file: its UTF-8 text. A folder: its ``*.txt``
    files (not recursive) sorted by name, joined with :data:`DOCUMENT_SEPARATOR`.
    Raises ``FileNotFoundError`` for a missing path and ``ValueError`` (naming the path) for an
    empty file or folder and for binary or non-UTF-8 content.
    """
    if path is None:
        return _bundled_corpus()
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"data path {path} does not exist")
    if path.is_dir():
        files = sorted(p for p in path.glob("*.txt") if p.is_file())
        if not files:
            raise ValueError(f"data folder {path} contains no .txt files")
        texts = [_read_text_file(f) for f in files]
        return DOCUMENT_SEPARATOR.join(texts)
    return _read_text_file(path)


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, lossless on any text, no training needed."""

    vocab_size = 256
    name = "byte"

    def encode(self, text: str) -> torch.Tensor:
        """Token ids, shape (len(text.encode()),), dtype uint8 (compact; cast before use)."""
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)

    def decode(self, ids) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def _step_rng(seed: int, step: int) -> np.random.Generator:
    # SeedSequence mixes (seed, step) into independent streams; no global RNG is touched.
    return np.random.default_rng(np.random.SeedSequence([seed, step]))


class TokenDataset:
    """Train/validation token windows of ``context_length + 1`` tokens (inputs + next token).

    Split: the last ``val_fraction`` of the tokens is validation, the rest training
    (deterministic, no shuffling, so the validation text never leaks into training windows).
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        *,
        context_length: int,
        val_fraction: float = 0.05,
        source: str = "<tokens>",
    ) -> None:
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        tokens = tokens.flatten()
        window = context_length + 1
        n_val = max(window, int(len(tokens) * val_fraction))
        if len(tokens) - n_val < window:
            raise ValueError(
                f"data {source} is too short: {len(tokens)} tokens, but context_length="
                f"{context_length} needs at least {2 * window} (one window of {window} tokens "
                f"for training and one for validation)"
            )
        self.context_length = context_length
        self.source = source
        self.train_tokens = tokens[: len(tokens) - n_val]
        self.val_tokens = tokens[len(tokens) - n_val :]

    @classmethod
    def from_text(
        cls,
        text: str,
        tokenizer,
        *,
        context_length: int,
        val_fraction: float = 0.05,
        source: str = "<text>",
    ) -> TokenDataset:
        return cls(
            tokenizer.encode(text),
            context_length=context_length,
            val_fraction=val_fraction,
            source=source,
        )

    def _windows(
        self, tokens: torch.Tensor, starts: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(starts, dtype=torch.int64)[:, None] + torch.arange(
            self.context_length + 1
        )
        window = tokens[index].to(torch.int64)  # (B, T + 1)
        return window[:, :-1], window[:, 1:]

    def train_batch(
        self, *, seed: int, step: int, batch_size: int, micro_steps: int = 1
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The micro-batches ``[(inputs, targets), ...]`` (each ``(batch_size, T)`` int64) of
        optimizer step ``step``: uniformly random window starts, a pure function of
        ``(seed, step, batch_size, micro_steps)``."""
        high = len(self.train_tokens) - self.context_length  # starts in [0, high)
        starts = _step_rng(seed, step).integers(0, high, size=(micro_steps, batch_size))
        return [self._windows(self.train_tokens, row) for row in starts]

    def batches(
        self, seed: int, *, batch_size: int, start_step: int = 0
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless training micro-batches (one per step) from ``start_step`` on."""
        step = start_step
        while True:
            yield self.train_batch(seed=seed, step=step, batch_size=batch_size)[0]
            step += 1

    def validation_batches(
        self, *, n_batches: int, batch_size: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A fixed validation set: ``n_batches * batch_size`` windows with evenly spaced starts
        over the validation tokens (they overlap when the validation split is short)."""
        high = len(self.val_tokens) - self.context_length - 1
        starts = np.linspace(0, high, num=n_batches * batch_size).round().astype(np.int64)
        return [
            self._windows(self.val_tokens, row) for row in starts.reshape(n_batches, batch_size)
        ]


def make_tokenizer(config: Any, text: str):
    """The tokenizer named by ``config.tokenizer`` (a ``TrainConfig``'s; bpe: trained on
    ``text``, cached)."""
    if config.tokenizer == "bpe":
        from muonscale.train.bpe import BPETokenizer

        return BPETokenizer.trained_on(text, config.bpe_vocab_size)
    return ByteTokenizer()
