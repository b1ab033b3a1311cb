"""Corpus loading, error messages, tokenizer, deterministic split and data order."""

from __future__ import annotations

import hashlib

import pytest
import torch

from muonscale.train.data import ByteTokenizer, TokenDataset, load_corpus

BUNDLED_SHA256 = "a74b54d1ef1dc44be145d3c93068267ab7beba0c7045a7b6a844b83ed5d7054f"  # PROVENANCE.md


def test_bundled_corpus_matches_provenance():
    text = load_corpus()
    assert hashlib.sha256(text.encode("utf-8")).hexdigest() == BUNDLED_SHA256
    assert "HAMLET, PRINCE OF DENMARK" in text and len(text) == 5_057_280


def test_missing_path(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_corpus(missing)


def test_empty_file_and_empty_folder(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match=f"{empty} is empty"):
        load_corpus(empty)
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "notes.md").write_text("not a .txt file")
    with pytest.raises(ValueError, match=f"{folder} contains no .txt files"):
        load_corpus(folder)


def test_non_utf8_and_binary_files(tmp_path):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(ValueError, match=f"{latin1} is not valid UTF-8 .*offset 3"):
        load_corpus(latin1)
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"\x00\x01\x02text")
    with pytest.raises(ValueError, match=f"{binary} looks binary"):
        load_corpus(binary)


def test_folder_of_txt_files_is_sorted_and_joined(tmp_path):
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "c.log").write_text("ignored")
    assert load_corpus(tmp_path) == "first\n\nsecond"
    assert load_corpus(str(tmp_path / "a.txt")) == "first"


def test_text_shorter_than_context_is_rejected_with_the_source():
    tokens = ByteTokenizer().encode("To be, or not to be")
    with pytest.raises(
        ValueError, match="data short.txt is too short: 19 tokens.*context_length=16"
    ):
        TokenDataset(tokens, context_length=16, source="short.txt")


def test_byte_tokenizer_round_trip():
    tokenizer = ByteTokenizer()
    text = "Ophelia — “nymph”"
    ids = tokenizer.encode(text)
    assert ids.dtype == torch.uint8 and len(ids) == len(text.encode())
    assert tokenizer.decode(ids) == text


def _dataset(context_length=8, text=None):
    text = text or "".join(chr(97 + i % 26) for i in range(1000))
    return TokenDataset.from_text(
        text, ByteTokenizer(), context_length=context_length, val_fraction=0.1
    )


def test_split_is_the_tail_and_deterministic():
    data = _dataset()
    assert len(data.val_tokens) == 100 and len(data.train_tokens) == 900
    tokens = ByteTokenizer().encode("".join(chr(97 + i % 26) for i in range(1000)))
    assert torch.equal(data.val_tokens, tokens[900:])


def test_training_batches_are_a_pure_function_of_seed_and_step():
    data = _dataset()
    first = data.train_batch(seed=3, step=7, batch_size=4, micro_steps=2)
    again = _dataset().train_batch(seed=3, step=7, batch_size=4, micro_steps=2)
    for (x, y), (x2, y2) in zip(first, again):
        assert torch.equal(x, x2) and torch.equal(y, y2)
        assert x.dtype == torch.int64 and x.shape == (4, 8)
        assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
        assert int(y.max()) < 256
    other_step = data.train_batch(seed=3, step=8, batch_size=4)[0][0]
    other_seed = data.train_batch(seed=4, step=7, batch_size=4)[0][0]
    assert not torch.equal(other_step, first[0][0]) and not torch.equal(other_seed, first[0][0])
    # micro-batches of one step are the rows of one draw: 2 x 4 == 1 x 8
    single = data.train_batch(seed=3, step=7, batch_size=8)[0][0]
    assert torch.equal(single, torch.cat([first[0][0], first[1][0]]))
    streamed = data.batches(3, batch_size=4, start_step=7)
    assert torch.equal(next(streamed)[0], data.train_batch(seed=3, step=7, batch_size=4)[0][0])


def test_training_windows_never_touch_validation_tokens():
    text = "a" * 900 + "b" * 100  # validation split is all 'b'
    data = _dataset(text=text)
    for step in range(50):
        x, y = data.train_batch(seed=0, step=step, batch_size=16)[0]
        assert int(y.max()) == ord("a")


def test_validation_set_is_fixed_and_covers_the_split():
    data = _dataset()
    batches = data.validation_batches(n_batches=3, batch_size=2)
    assert len(batches) == 3 and batches[0][0].shape == (2, 8)
    again = _dataset().validation_batches(n_batches=3, batch_size=2)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again))
    first_start = batches[0][0][0]
    last_target = batches[-1][1][-1]
    assert torch.equal(first_start, data.val_tokens[:8].long())
    assert torch.equal(last_target, data.val_tokens[-8:].long())


def test_bpe_tokenizer_is_lossless_and_cached(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    from muonscale.train.bpe import BPETokenizer

    monkeypatch.setenv("MUONSCALE_CACHE_DIR", str(tmp_path))
    text = load_corpus()[:200_000]
    tokenizer = BPETokenizer.trained_on(text, 512)
    assert tokenizer.vocab_size == 512
    cached = list((tmp_path / "tokenizers").glob("bpe-512-*.json"))
    assert len(cached) == 1
    sample = text[5000:7000] + " Ophelia — “nymph” 🌹"
    ids = tokenizer.encode(sample)
    assert ids.dtype == torch.int32 and len(ids) < len(sample.encode()) / 1.5  # it compresses
    assert tokenizer.decode(ids) == sample
    stamp = cached[0].stat().st_mtime_ns
    again = BPETokenizer.trained_on(text, 512)  # loaded from the cache, not retrained
    assert cached[0].stat().st_mtime_ns == stamp
    assert torch.equal(again.encode(sample), ids)
