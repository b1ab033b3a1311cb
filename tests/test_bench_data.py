"""``muonscale bench --data PATH [--tokenizer bpe]``: the bench trains on the user's corpus,
read by the same code as ``muonscale train --data``."""

from __future__ import annotations

import json
import math

import pytest
from bench_tiny import BENCH_TINY

from muonscale.bench.config import BenchConfig
from muonscale.bench.runner import train_config_for
from muonscale.cli import main


def test_bench_data_reaches_every_contenders_train_config(tmp_path):
    corpus = tmp_path / "corpus.txt"
    bench = BenchConfig(
        data=str(corpus), tokenizer="bpe", bpe_vocab_size=300, baselines=["torch-muon"]
    )
    for contender in bench.contenders:
        train = train_config_for(bench, contender, bench.lr_for(contender))
        assert (train.data, train.tokenizer, train.bpe_vocab_size) == (str(corpus), "bpe", 300)


def test_bench_on_a_user_corpus_with_bpe(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    monkeypatch.setenv("MUONSCALE_CACHE_DIR", str(tmp_path / "cache"))
    from muonscale.train.data import load_corpus

    corpus = tmp_path / "mine.txt"
    corpus.write_text(load_corpus()[:150_000])
    out = tmp_path / "bench"
    argv = [
        "bench",
        *BENCH_TINY,
        "--data",
        str(corpus),
        "--tokenizer",
        "bpe",
        "--bpe-vocab-size",
        "300",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["model"]["vocab_size"] == 320  # 300 rounded up to 64
    for train in report["config"]["train"].values():
        assert train["data"] == str(corpus) and train["tokenizer"] == "bpe"
    for contender in report["contenders"].values():
        # an untrained model predicts about uniformly over the 320 BPE tokens
        assert contender["curves"]["val_loss"][0] == pytest.approx(math.log(320), abs=0.15)


def test_bench_data_errors_before_training(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *BENCH_TINY, "--data", str(tmp_path / "missing.txt")])
    assert exit_info.value.code == 2
    assert f"--data: data path {tmp_path / 'missing.txt'} does not exist" in capsys.readouterr().err
