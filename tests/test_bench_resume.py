"""Finished runs are saved under --out/runs/ and the same command resumes from them; a changed
configuration is not reused."""

from __future__ import annotations

import json

import pytest
from bench_tiny import LinearRun

from muonscale.bench import run_bench
from muonscale.bench.config import BenchConfig


class CountingMakeRun:
    def __init__(self):
        self.calls = []

    def __call__(self, config, contender, lr, steps=None):
        self.calls.append((contender, lr, config.seed, steps))
        return LinearRun(
            0.02 * lr / config.lr_for(contender) + (0.01 if contender != "adamw" else 0)
        )


def bench(tmp_path, **changes):
    values = dict(
        steps=20,
        tokens_per_step=256,
        memory_probe_steps=0,
        progress=False,
        plots=False,
        out=str(tmp_path),
        seeds=2,
        sweep=True,
        sweep_factors=[1.0, 2.0],
        variants=["pe=coefficients:polar_express"],
        baselines=["torch-muon"],
    )
    values.update(changes)
    return BenchConfig(**values)


def figures(report):
    return {name: c["curves"] for name, c in report["contenders"].items()}, report["seeds"]


def test_second_invocation_trains_nothing(tmp_path):
    first = CountingMakeRun()
    report1 = run_bench(bench(tmp_path), make_run=first)
    # sweep: 4 contenders x 2 lrs; then 4 contenders x 2 seeds
    assert len(first.calls) == 4 * 2 + 4 * 2
    second = CountingMakeRun()
    report2 = run_bench(bench(tmp_path), make_run=second)
    assert second.calls == []
    assert figures(report2) == figures(report1)
    assert report2["sweep"] == report1["sweep"]


def test_a_changed_configuration_is_not_reused(tmp_path):
    run_bench(bench(tmp_path), make_run=CountingMakeRun())
    # more seeds: only the new seed trains, the sweep and seeds 0, 1 are reused
    again = CountingMakeRun()
    run_bench(bench(tmp_path, seeds=3), make_run=again)
    assert {(c, s) for c, _, s, _ in again.calls} == {
        (c, 2) for c in ("adamw", "muon", "torch-muon", "pe")
    }
    # a different variant option: that variant only, sweep and runs
    changed = CountingMakeRun()
    run_bench(
        bench(tmp_path, variants=["pe=coefficients:polar_express,ns_steps:4"]), make_run=changed
    )
    assert {c for c, *_ in changed.calls} == {"pe"} and len(changed.calls) == 2 + 2
    # a training hyperparameter shared by all (weight decay): everything again
    decay = CountingMakeRun()
    run_bench(bench(tmp_path, weight_decay=0.05), make_run=decay)
    assert len(decay.calls) == 16


def test_saved_runs_hold_their_full_configuration(tmp_path):
    run_bench(bench(tmp_path, sweep=False, seeds=1), make_run=CountingMakeRun())
    files = sorted((tmp_path / "runs").glob("run-*.json"))
    assert len(files) == 4
    saved = {
        json.loads(f.read_text())["key"]["contender"]: json.loads(f.read_text()) for f in files
    }
    assert saved["pe"]["key"]["variant_options"] == {"coefficients": "polar_express"}
    assert saved["torch-muon"]["key"]["newton_schulz_precision"] == "float32"
    assert saved["muon"]["key"]["train"]["weight_decay"] == 0.1
    assert saved["muon"]["result"]["val_losses"][0] == pytest.approx(5.0)


def test_real_tiny_run_resumes(tmp_path):
    tiny = dict(
        n_layer=1,
        d_model=32,
        n_head=2,
        tokens_per_step=256,
        eval_batches=1,
        lr_warmup_steps=1,
        memory_probe_steps=0,
        timing_warmup_steps=0,
        progress=False,
        plots=False,
        steps=3,
        out=str(tmp_path),
        variants=["pe=coefficients:polar_express"],
    )
    report1 = run_bench(BenchConfig(**tiny))

    def no_training(*args, **kwargs):
        raise AssertionError("a saved run was trained again")

    report2 = run_bench(BenchConfig(**tiny), make_run=no_training)
    assert figures(report2) == figures(report1)


def _old_format(store, path, drop_train=(), drop_top=()):
    """Rewrite a saved run as an older version wrote it: its key without ``drop_*`` entries,
    under that key's file name; return the new path."""
    saved = json.loads(path.read_text())
    key = saved["key"]
    for name in drop_train:
        del key["train"][name]
    for name in drop_top:
        del key[name]
    path.unlink()
    store.save(key, saved["result"])
    return store.path(key)


def test_runs_saved_before_an_option_existed_are_reused(tmp_path):
    from muonscale.bench.store import RunStore

    report1 = run_bench(bench(tmp_path), make_run=CountingMakeRun())
    store = RunStore(tmp_path / "runs")
    files = sorted((tmp_path / "runs").glob("*.json"))
    renamed = {_old_format(store, f, drop_train=["qk_clip"]) for f in files}
    assert renamed.isdisjoint(files)  # every file now has another name: no exact match
    second = CountingMakeRun()
    report2 = run_bench(bench(tmp_path), make_run=second)
    assert second.calls == []
    assert figures(report2) == figures(report1)
    assert report2["sweep"] == report1["sweep"]


def _keys(spec, **changes):
    from muonscale.bench.store import run_key

    config = BenchConfig(steps=3, tokens_per_step=256, variants=[spec], **changes)
    return run_key(config, "clip", 0.02, kind="run", steps=3, eval_steps=[0, 3])


def test_an_old_key_is_reused_only_while_the_new_option_is_at_its_default(tmp_path):
    from muonscale.bench.store import RunStore

    store = RunStore(tmp_path)
    off, on = _keys("clip=qk_clip:none"), _keys("clip=qk_clip:100")
    assert off["train"]["qk_clip"] is None and on["train"]["qk_clip"] == 100
    old = {**off, "train": {k: v for k, v in off["train"].items() if k != "qk_clip"}}
    store.save(old, {"final_val_loss": 1.5})
    assert store.find(off) == (store.path(old), {"final_val_loss": 1.5})
    assert store.load(on) is None  # QK-clip on is not the old behaviour
    # a top-level entry: a missing corpus is the default (None), not another corpus
    no_corpus = {k: v for k, v in off.items() if k != "corpus"}
    store = RunStore(tmp_path / "corpus")
    store.save(no_corpus, {"final_val_loss": 2.5})
    assert store.load(off) == {"final_val_loss": 2.5}
    assert store.load(_keys("clip=qk_clip:none", corpus="web")) is None
    # an entry without a known old-behaviour value (threads) is never assumed
    store = RunStore(tmp_path / "threads")
    store.save({k: v for k, v in off.items() if k != "threads"}, {"final_val_loss": 3.5})
    assert store.load(off) is None


def test_edited_or_colliding_files_are_not_reused(tmp_path):
    from muonscale.bench.store import RunStore

    store = RunStore(tmp_path)
    off = _keys("clip=qk_clip:none")
    # an old-format key with another value in a field both versions have
    edited = {**off, "train": {k: v for k, v in off["train"].items() if k != "qk_clip"}}
    edited["train"]["weight_decay"] = 0.05
    store.save(edited, {"final_val_loss": 1.0})
    # a key with a field the current configuration does not have (or no longer has)
    extra = {**off, "train": {**off["train"], "removed_option": None}}
    store.save(extra, {"final_val_loss": 2.0})
    assert store.load(off) is None
    # the exact file name holding another key (a hash collision or a hand-edited file)
    store.path(off).write_text(json.dumps({"key": edited, "result": {"final_val_loss": 3.0}}))
    assert store.load(off) is None
    # a file of another contender whose name happens to start like this one's
    other = {**off, "contender": "clip-seed0"}
    store.save({**other, "train": {**off["train"]}}, {"final_val_loss": 4.0})
    assert store.load(off) is None
    store.save(off, {"final_val_loss": 5.0})
    assert store.load(off) == {"final_val_loss": 5.0}
