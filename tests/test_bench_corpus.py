"""``muonscale bench --corpus NAME``: the bundled corpora, their provenance and selection."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

from muonscale.bench.config import CORPORA, BenchConfig
from muonscale.bench.runner import DATA_DIR, bundled_corpus_text, make_run

PROVENANCE = Path(DATA_DIR) / "PROVENANCE.md"


def documented_sha256(file_name: str) -> str:
    """The sha256 that PROVENANCE.md states for ``file_name``'s decompressed text."""
    text = PROVENANCE.read_text()
    section = text[text.index(f"`{file_name}`") :]
    return re.search(r"sha256 of the decompressed text \| `([0-9a-f]{64})`", section).group(1)


@pytest.mark.parametrize("name", CORPORA)
def test_bundled_corpus_matches_its_provenance(name):
    text = bundled_corpus_text(name)
    assert hashlib.sha256(text.encode("utf-8")).hexdigest() == documented_sha256(f"{name}.txt.xz")
    assert len(text.encode("utf-8")) > 4_000_000  # comparable sizes (both about 5 MB)
    assert "<" not in text or name == "shakespeare"  # the markup of the web module is removed


def test_corpus_web_is_what_the_run_trains_on():
    bench = BenchConfig(
        n_layer=1,
        d_model=32,
        n_head=2,
        tokens_per_step=256,
        eval_batches=1,
        lr_warmup_steps=1,
        steps=2,
        corpus="web",
    )
    run = make_run(bench, "muon", 0.02)
    data = bundled_corpus_text("web").encode("utf-8")
    n = len(run.dataset.train_tokens)
    assert bytes(run.dataset.train_tokens[:200].tolist()) == data[:200]
    assert n < len(data)
    run.step()


def test_corpus_errors():
    with pytest.raises(ValueError, match="--corpus must be one of"):
        BenchConfig(corpus="moby")
    with pytest.raises(ValueError, match="--corpus and --data both"):
        BenchConfig(corpus="web", data="x.txt")
