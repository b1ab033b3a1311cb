"""The expert view against the pinned transformers' own forward passes.

Forward proof: every expert module class that carries ``@use_experts_implementation``, and
each undecorated family muonscale knows by name, is built alone from a tiny config; its forward
for one expert, on random input, equals the output recomputed from the matrices the expert view
gives (gate and up apart) with the gating rule read from the class's own source. A view that
took the wrong rows, the wrong orientation or the wrong expert fails here.

Routing walk: whole tiny models of the families on the meta device: no parameter with 3 or
more dims is flattened without a source, no per-expert bias is on Muon, routers are on Muon.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re
import warnings

import pytest
import torch
import transformers
from torch import nn
from transformers import PretrainedConfig

import muonscale
from muonscale.optimizer_groups import UnknownLayoutWarning

MODELS = pathlib.Path(transformers.__file__).parent / "models"
E, T = 4, 5  # experts, tokens
TINY = dict(
    hidden_size=16,
    intermediate_size=12,
    moe_intermediate_size=12,
    num_experts=E,
    num_local_experts=E,
    n_routed_experts=E,
    moe_num_experts=E,
    num_experts_per_tok=2,
    expert_ffn_hidden_size=12,
    ffn_hidden_size=12,
)
"""Config attributes set on every candidate config (the names expert modules read)."""
TOL = dict(rtol=1e-5, atol=1e-5)
"""Float64 modules and inputs, but a few families gate in float32 (``.float()`` in their
forward): float32 rounding, far below what a wrong row, orientation or expert gives (O(1))."""


def decorated_classes() -> list[tuple[str, str, str]]:
    """(model folder, modeling module, class) of every class the pinned transformers decorates
    with ``@use_experts_implementation``, from the source files."""
    out = []
    for path in sorted(MODELS.glob("*/modeling_*.py")):
        pattern = r"@use_experts_implementation(?:\([^)]*\))?\s*\nclass (\w+)"
        for match in re.finditer(pattern, path.read_text()):
            out.append((path.parent.name, path.stem, match.group(1)))
    return out


def tiny_config(config_class: type[PretrainedConfig]) -> PretrainedConfig:
    config = config_class()
    for key, value in TINY.items():
        current = getattr(config, key, None)
        if current is None or isinstance(current, int):
            setattr(config, key, value)
    return config


def build_alone(folder: str, module_name: str, class_name: str) -> nn.Module:
    """The expert module built alone from the first config of its family that builds it."""
    module = importlib.import_module(f"transformers.models.{folder}.{module_name}")
    cls = getattr(module, class_name)
    config_module = module
    if (MODELS / folder / f"configuration_{folder}.py").is_file():
        config_module = importlib.import_module(
            f"transformers.models.{folder}.configuration_{folder}"
        )
    candidates = [
        c
        for _, c in inspect.getmembers(config_module, inspect.isclass)
        if issubclass(c, PretrainedConfig) and c is not PretrainedConfig
    ]
    errors = []
    for config_class in sorted(candidates, key=lambda c: ("Text" not in c.__name__, c.__name__)):
        try:
            experts = cls(tiny_config(config_class))
        except Exception as error:  # another config of the family
            errors.append(f"{config_class.__name__}: {error}")
            continue
        torch.manual_seed(0)
        for p in experts.parameters():
            nn.init.normal_(p, std=0.3)
        return experts.double()
    raise AssertionError(f"{class_name}: no config of {folder} builds it: {errors}")


def views(module: nn.Module) -> dict[str, list[torch.Tensor]]:
    """name -> the matrices of the expert view muonscale gives the module's parameters."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownLayoutWarning)
        opt = muonscale.Muon(module, lr=0.02)
    table = opt.param_table
    return {
        name: table.view(p, "flatten").to_matrices(p.detach())
        for name, p in module.named_parameters()
        if table.expert_layout(p) is not None
    }


def split_rule(cls: type) -> str:
    """How the class's own gating code splits the fused projection: read from its source."""
    source = inspect.getsource(cls._apply_gate)
    if "::2" in source:
        return "interleaved"
    assert "chunk(2" in source, source
    return "contiguous"


def assemble(gate: torch.Tensor, up: torch.Tensor, rule: str) -> torch.Tensor:
    if rule == "contiguous":
        return torch.cat([gate, up], dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


@pytest.mark.parametrize("folder, module_name, class_name", decorated_classes())
def test_decorated_expert_forward_equals_the_view(folder, module_name, class_name):
    experts = build_alone(folder, module_name, class_name)
    matrices = views(experts)
    e = E - 2
    x = torch.randn(T, _hidden(experts), dtype=torch.float64)
    with torch.no_grad():
        got = experts(x, torch.full((T, 1), e), torch.ones(T, 1, dtype=torch.float64))
        if experts.has_gate:
            gate, up = matrices["gate_up_proj"][2 * e : 2 * e + 2]
            fused = assemble(x @ gate.T, x @ up.T, split_rule(type(experts)))
            if experts.has_bias:
                fused = fused + experts.gate_up_proj_bias[e]
            hidden = experts._apply_gate(fused)
        else:
            hidden = x @ matrices["up_proj"][e].T
            if experts.has_bias:
                hidden = hidden + experts.up_proj_bias[e]
            hidden = experts.act_fn(hidden)
        want = hidden @ matrices["down_proj"][e].T
        if experts.has_bias:
            want = want + experts.down_proj_bias[e]
        if experts.has_post_expert_norm:
            want = experts.post_expert_norm(want)
    torch.testing.assert_close(got, want, **TOL)


def _hidden(experts: nn.Module) -> int:
    """The model width D of an expert module: the input features of its down projection's
    output, read from the view (down_proj is (out = D, in) per expert)."""
    layout = muonscale.Muon(experts, lr=0.02).param_table.experts["down_proj"]
    return layout.expert_shape(experts.down_proj.shape)[0]


def test_every_decorated_class_was_found():
    assert len(decorated_classes()) >= 60  # transformers 5.24 decorates 68 classes


def _undecorated(folder: str, class_name: str, **config) -> nn.Module:
    module = importlib.import_module(f"transformers.models.{folder}.modeling_{folder}")
    config_module = importlib.import_module(f"transformers.models.{folder}.configuration_{folder}")
    config_class = (
        next(
            c
            for name, c in inspect.getmembers(config_module, inspect.isclass)
            if issubclass(c, PretrainedConfig) and name.endswith("TextConfig")
        )
        if folder == "llama4"
        else getattr(config_module, f"{type_name(folder)}Config")
    )
    cfg = tiny_config(config_class)
    for key, value in config.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    built = getattr(module, class_name)(cfg)
    for p in built.parameters():
        nn.init.normal_(p, std=0.3)
    return built.double()


def type_name(folder: str) -> str:
    return {"longcat_flash": "LongcatFlash", "step3p7": "Step3p7", "jetmoe": "JetMoe"}[folder]


def test_llama4_forward_equals_the_view():
    experts = _undecorated("llama4", "Llama4TextExperts")
    m = views(experts)
    d = experts.hidden_size
    x = torch.randn(E, T, d, dtype=torch.float64)
    with torch.no_grad():
        got = experts(x.reshape(-1, d)).view(E, T, d)
        for e in range(E):
            gate, up = m["gate_up_proj"][2 * e : 2 * e + 2]
            hidden = experts.act_fn(x[e] @ gate.T) * (x[e] @ up.T)
            torch.testing.assert_close(got[e], hidden @ m["down_proj"][e].T, **TOL)


@pytest.mark.parametrize(
    "folder, class_name", [("longcat_flash", "LongcatFlashExperts"), ("step3p7", "Step3p7Experts")]
)
def test_routed_undecorated_forward_equals_the_view(folder, class_name):
    experts = _undecorated(folder, class_name, zero_expert_num=0, hidden_act="silu")
    m = views(experts)
    e = 1
    x = torch.randn(T, experts.down_proj.shape[1], dtype=torch.float64)
    index = torch.tensor([[e, e + 1]] * T)  # top 2, the second with weight 0
    weights = torch.tensor([[1.0, 0.0]] * T, dtype=torch.float64)
    with torch.no_grad():
        got = experts(x, index, weights)
        gate, up = m["gate_up_proj"][2 * e : 2 * e + 2]
        if hasattr(experts, "_apply_gate"):
            hidden = experts._apply_gate(assemble(x @ gate.T, x @ up.T, split_rule(type(experts))))
        else:  # LongcatFlash: gate, up = (x W^T).chunk(2, -1) in its forward
            hidden = experts.act_fn(x @ gate.T) * (x @ up.T)
    torch.testing.assert_close(got, hidden @ m["down_proj"][e].T, **TOL)


def test_dbrx_forward_equals_the_view():
    from transformers.models.dbrx.configuration_dbrx import DbrxFFNConfig
    from transformers.models.dbrx.modeling_dbrx import DbrxExperts

    config = DbrxFFNConfig(hidden_size=16, ffn_hidden_size=12, moe_num_experts=E)
    experts = DbrxExperts(config)
    for p in experts.parameters():
        nn.init.normal_(p, std=0.3)
    experts = experts.double()
    m = {f"mlp.{k}": v for k, v in views(experts.mlp).items()}
    e = 3
    x = torch.randn(1, T, 16, dtype=torch.float64)
    with torch.no_grad():
        got = experts(x, torch.full((T, 1), e), torch.ones(T, 1, dtype=torch.float64))
        gate, up, down = m["mlp.w1"][e], m["mlp.v1"][e], m["mlp.w2"][e]
        hidden = experts.mlp.activation_fn(x[0] @ gate.T) * (x[0] @ up.T)
    torch.testing.assert_close(got[0], hidden @ down.T, **TOL)


def test_jetmoe_forward_equals_the_view():
    moe = _undecorated("jetmoe", "JetMoeMoE")
    m = views(moe)
    e, d = 2, moe.input_size
    x = torch.randn(T, d, dtype=torch.float64)
    sizes = [T if i == e else 0 for i in range(E)]
    with torch.no_grad():
        fused = moe.input_linear(x, sizes)  # JetMoeMoE.forward: chunk(2, -1) of this
        gate_part, up_part = fused.chunk(2, dim=-1)
        got = moe.output_linear(moe.activation(gate_part) * up_part, sizes)
        gate, up = m["input_linear.weight"][2 * e : 2 * e + 2]
        hidden = moe.activation(x @ gate.T) * (x @ up.T)
    torch.testing.assert_close(got, hidden @ m["output_linear.weight"][e].T, **TOL)


def test_phi3_dense_gate_up_forward_equals_the_view():
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3MLP

    mlp = Phi3MLP(Phi3Config(hidden_size=16, intermediate_size=12)).double()
    m = views(mlp)
    x = torch.randn(T, 16, dtype=torch.float64)
    gate, up = m["gate_up_proj.weight"]
    with torch.no_grad():
        want = (mlp.activation_fn(x @ gate.T) * (x @ up.T)) @ mlp.down_proj.weight.T
        torch.testing.assert_close(mlp(x), want, **TOL)


WALKED = [
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "deepseek_v3",
    "gpt_oss",
    "olmoe",
    "llama4_text",
    "jetmoe",
    "nemotron_h",
    "longcat_flash",
    "phi3",
]
"""Whole tiny models (DBRX's default config does not build; its forward proof covers it)."""


@pytest.mark.parametrize("model_type", WALKED)
def test_routing_walk(model_type):
    config = transformers.AutoConfig.for_model(model_type)
    for key, value in dict(
        TINY,
        num_hidden_layers=2,
        vocab_size=32,
        head_dim=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=0,
        first_k_dense_replace=0,
    ).items():
        if isinstance(getattr(config, key, None), int):
            setattr(config, key, value)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownLayoutWarning)  # nothing flattened silently
        opt = muonscale.Muon(model, lr=0.02)
    table, routing = opt.param_table, opt.routing
    for name, p in model.named_parameters():
        decision = routing[name]
        if decision.algorithm == "muon" and p.ndim >= 3:
            assert table.expert_layout(p) is not None or name in table.convolutions, name
        if "bias" in name and p.ndim == 2:
            assert decision.algorithm == "adamw", (name, decision)
        if decision.reason.startswith("router"):
            assert decision.algorithm == "muon"
    assert model_type == "phi3" or any(d.reason.startswith("router") for d in routing.values())
    assert any(table.expert_layout(p) is not None for p in model.parameters())


def test_muonscale_route_shows_the_expert_view(tmp_path):
    """``muonscale route config.json`` prints each stack's expert view and the router's reason."""
    from muonscale.route_model import build_model, routing_table

    config = transformers.Qwen3MoeConfig(
        vocab_size=32,
        hidden_size=16,
        moe_intermediate_size=8,
        num_experts=E,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    config.save_pretrained(tmp_path)
    table = routing_table(build_model(str(tmp_path / "config.json")))
    assert f"(E={E}) × gate|up (8, 16)" in table and f"(E={E}) × (16, 8)" in table
    assert f"router (E={E}): Muon" in table
