"""``muonscale route config.json``: the routing table of a Hugging Face model from its config,
built on the meta device (no weights), as ``hf.MuonFactory`` would route it."""

import json

import pytest

pytest.importorskip("transformers")

from muonscale.cli import main  # noqa: E402


def _table(tmp_path, capsys, config: dict) -> list[str]:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["route", str(path)]) == 0
    return capsys.readouterr().out.splitlines()


def _line(lines, name):
    return next(line for line in lines if f" {name} " in line)


def test_route_gpt2_config_marks_conv1d_weights_transposed(tmp_path, capsys):
    lines = _table(
        tmp_path,
        capsys,
        {"model_type": "gpt2", "n_layer": 1, "n_embd": 16, "n_head": 2, "vocab_size": 64},
    )
    assert "transposed (stored in, out)" in _line(lines, "transformer.h.0.attn.c_attn.weight")
    assert _line(lines, "transformer.h.0.mlp.c_fc.weight").split()[0] == "muon"
    assert _line(lines, "transformer.wte.weight").split()[0] == "adamw"


def test_route_llama_config_from_its_folder(tmp_path, capsys):
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "vocab_size": 100,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["route", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert _line(lines, "model.layers.0.self_attn.k_proj.weight").split()[0] == "muon"
    assert _line(lines, "model.embed_tokens.weight").split()[0] == "adamw"
    assert _line(lines, "lm_head.weight").split()[0] == "adamw"
    assert not any("transposed" in line for line in lines)
