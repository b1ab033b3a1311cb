"""The Megatron adapter's single-process behaviour, without megatron-core installed (it runs in
the main suite; the multi-rank Megatron tests are in tests/megatron/): a module that carries
Megatron's parameter attributes, fp32 main copies of bf16 parameters, clipping, non-finite
handling and checkpoints, each against a plain-torch oracle."""

from __future__ import annotations

import copy
import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from muonscale import Muon, NonFiniteGradientError
from muonscale.integrations.megatron import MegatronMuonConfig, megatron_muon

OPTIONS = dict(lr=0.02, weight_decay=0.1, scale="unit_rms", adam_lr=0.01, ns_dtype=torch.float32)


class MegatronLikeBlock(nn.Module):
    """Parameters named and flagged as Megatron-Core's (``is_embedding_or_output_parameter``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(32, 16)
        self.embedding.weight.is_embedding_or_output_parameter = True
        self.linear_fc1 = nn.Linear(16, 48)
        self.linear_fc2 = nn.Linear(48, 16)
        self.final_layernorm = nn.LayerNorm(16)


def _model(dtype: torch.dtype, seed: int = 0) -> MegatronLikeBlock:
    torch.manual_seed(seed)
    model = MegatronLikeBlock()
    with torch.no_grad():  # the fp32 reference starts from the same (bf16-rounded) values
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    return model.to(dtype)


def _gradients(model: nn.Module, step: int, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) * scale for p in model.parameters()]


def _reference(steps: int, clip: float | None = None, scale: float = 1.0):
    """Plain muonscale.Muon on the fp32 model, torch's clip_grad_norm_ for clipping."""
    model = _model(torch.float32)
    groups = [
        {"params": [model.linear_fc1.weight, model.linear_fc2.weight], "algorithm": "muon"},
        {
            "params": [
                p
                for n, p in model.named_parameters()
                if n not in ("linear_fc1.weight", "linear_fc2.weight")
            ],
            "algorithm": "adamw",
        },
    ]
    opt = Muon(
        groups,
        lr=0.02,
        weight_decay=0.1,
        scale="unit_rms",
        adamw_lr=0.01,
        adamw_betas=(0.9, 0.95),
        ns_dtype=torch.float32,
    )
    norms = []
    for step in range(steps):
        for p, g in zip(model.parameters(), _gradients(model, step, scale)):
            p.grad = g
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip)))
        opt.step()
    return model, norms


def test_routing_follows_megatron_flags():
    opt = megatron_muon(_model(torch.float32), MegatronMuonConfig(**OPTIONS))
    decisions = {pl.name: pl.algorithm for pl in opt.plans}
    assert decisions == {
        "embedding.weight": "adamw",
        "linear_fc1.weight": "muon",
        "linear_fc1.bias": "adamw",
        "linear_fc2.weight": "muon",
        "linear_fc2.bias": "adamw",
        "final_layernorm.weight": "adamw",
        "final_layernorm.bias": "adamw",
    }
    assert "is_embedding_or_output_parameter" in opt.summary()


@pytest.mark.parametrize("clip", [None, 5.0])
def test_bf16_main_copies_and_clipping_match_plain_torch(clip):
    """bf16 model + fp32 main copies track fp32 Muon from the same weights on the same fp32
    gradients (≤ 1e-6); clipping == torch.nn.utils.clip_grad_norm_; the model holds its main
    copies rounded to bf16."""
    steps = 3
    reference, ref_norms = _reference(steps, clip)
    model = _model(torch.bfloat16)
    opt = megatron_muon(model, MegatronMuonConfig(**OPTIONS, clip_grad=clip or 0.0))
    assert len(opt.main_params.copied) == len(list(model.parameters()))
    norms = []
    for step in range(steps):
        for p, g in zip(model.parameters(), _gradients(model, step)):
            p.main_grad = g  # as Megatron's DDP leaves fp32 gradients
        opt.step()
        norms.append(opt.last_grad_norm)
        opt.zero_grad()
    mains = {pl.name: pl.param for pl in opt.main_params.plans}
    delta = max(
        float((mains[n] - ref.detach()).abs().max()) for n, ref in reference.named_parameters()
    )
    # not bitwise: the TP path scales O by s before lr (rounding differs in the last bit), and
    # the global norm is summed in float64 where torch takes the norm of fp32 norms
    assert delta <= 1e-6
    for name, param in model.named_parameters():
        assert torch.equal(param, mains[name].bfloat16()), name
    if clip is not None:
        assert norms == pytest.approx(ref_norms, rel=1e-6)
        assert min(norms) > clip  # clipping acted on every step


def test_resume_with_main_copies_is_bit_identical():
    def build():
        model = _model(torch.bfloat16)
        return model, megatron_muon(model, MegatronMuonConfig(**OPTIONS))

    def train(model, opt, steps):
        for step in steps:
            for p, g in zip(model.parameters(), _gradients(model, step)):
                p.grad = g.bfloat16()
            opt.step()
            opt.zero_grad()

    model_a, opt_a = build()
    train(model_a, opt_a, range(2))
    saved = copy.deepcopy({"model": model_a.state_dict(), "opt": opt_a.state_dict()})
    train(model_a, opt_a, range(2, 4))
    model_b, opt_b = build()
    model_b.load_state_dict(saved["model"])
    opt_b.load_state_dict(saved["opt"])
    train(model_b, opt_b, range(2, 4))
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(a, b), name
    for pa, pb in zip(opt_a.main_params.plans, opt_b.main_params.plans):
        assert torch.equal(pa.param, pb.param), pa.name
    with pytest.raises(ValueError, match="main_params"):
        _, opt_c = build()
        opt_c.load_state_dict({k: v for k, v in saved["opt"].items() if k != "main_params"})


def test_nonfinite_gradient_raises_and_leaves_everything_unchanged():
    model = _model(torch.bfloat16)
    opt = megatron_muon(model, MegatronMuonConfig(**OPTIONS))
    before = [p.detach().clone() for p in model.parameters()]
    grads = _gradients(model, 0)
    grads[1][0, 0] = float("nan")  # linear_fc1.weight
    for p, g in zip(model.parameters(), grads):
        p.grad = g.bfloat16()
    with pytest.raises(NonFiniteGradientError, match="linear_fc1.weight"):
        opt.step()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)


def test_bad_configuration_names_the_option():
    with pytest.raises(ValueError, match="clip_grad"):
        MegatronMuonConfig(clip_grad=-1)
    with pytest.raises(ValueError, match="main_params_dtype"):
        megatron_muon(_model(torch.bfloat16), MegatronMuonConfig(main_params_dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="float16"):
        megatron_muon(_model(torch.float16), MegatronMuonConfig())
    with pytest.raises(ValueError, match="approximate_blockwise"):
        MegatronMuonConfig(muon_tp_mode="blockwise")


def _megatron_optimizer_config(**changes):
    """The fields of Megatron-Core's ``OptimizerConfig`` that ``from_megatron`` reads, at
    Megatron's defaults (a stand-in: megatron-core is not installed in the main suite)."""
    fields = dict(
        lr=3e-4,
        weight_decay=0.1,
        muon_momentum=0.95,
        muon_nesterov=False,
        muon_split_qkv=True,
        muon_num_ns_steps=5,
        muon_extra_scale_factor=1.0,
        muon_scale_mode="spectral",
        muon_coefficient_type="quintic",
        muon_fp32_matmul_prec="medium",
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_eps=1e-8,
        clip_grad=1.0,
    )
    return SimpleNamespace(**{**fields, **changes})


@pytest.mark.parametrize("factor", [float("nan"), float("inf"), -1.0, 0.0, "2", True])
def test_extra_scale_factor_is_a_positive_finite_number(factor):
    """A NaN or inf factor turned every Muon weight NaN at the first step, a negative one made
    the update go uphill: each is refused when the config is made, naming the field."""
    match = "muon_extra_scale_factor must be a positive finite number"
    with pytest.raises(ValueError, match=match):
        MegatronMuonConfig(muon_extra_scale_factor=factor)
    with pytest.raises(ValueError, match=match):
        MegatronMuonConfig().replaced(muon_extra_scale_factor=factor)
    if not isinstance(factor, (str, bool)):
        with pytest.raises(ValueError, match=match):
            MegatronMuonConfig.from_megatron(
                _megatron_optimizer_config(muon_extra_scale_factor=factor)
            )
    assert MegatronMuonConfig(muon_extra_scale_factor=0.5).muon_extra_scale_factor == 0.5


@pytest.mark.parametrize(
    "field, value, accepted",
    [
        ("muon_scale_mode", "spectal", "'shape_scaling', 'spectral', 'unit_rms_norm'"),
        ("muon_fp32_matmul_prec", "hihg", "'high', 'highest', 'low', 'medium'"),
    ],
)
def test_from_megatron_names_a_misspelt_field_and_its_values(field, value, accepted):
    config = MegatronMuonConfig.from_megatron(_megatron_optimizer_config())
    assert config.scale == "unit_rms" and config.ns_dtype == torch.bfloat16  # the stand-in
    with pytest.raises(ValueError, match=re.escape(f"{field} {value!r}")) as error:
        MegatronMuonConfig.from_megatron(_megatron_optimizer_config(**{field: value}))
    assert accepted in str(error.value)


def test_elementwise_backend_is_read_when_the_optimizer_is_built(monkeypatch):
    """``MUONSCALE_ELEMENTWISE`` is read by ``megatron_muon`` (through ``Muon``'s constructor):
    a bad value raises there, not at a step. The adapter's Muon update runs its elementwise
    passes with foreach around the injected orthogonalizer (``muon_update_``, not
    ``functional.muon``), so no step asks for the Triton kernels, whatever the choice."""
    from muonscale import functional
    from muonscale.kernels import ELEMENTWISE_ENV

    monkeypatch.setenv(ELEMENTWISE_ENV, "fast")
    with pytest.raises(ValueError, match=ELEMENTWISE_ENV):
        megatron_muon(_model(torch.float32), MegatronMuonConfig(**OPTIONS))
    monkeypatch.setenv(ELEMENTWISE_ENV, "auto")
    model = _model(torch.float32)
    opt = megatron_muon(model, MegatronMuonConfig(**OPTIONS))
    assert opt.elementwise_backend == "auto"
    seen = []
    real = functional.elementwise_kernels
    monkeypatch.setattr(
        functional,
        "elementwise_kernels",
        lambda device, backend: seen.append(backend) or real(device, backend),
    )
    monkeypatch.setenv(ELEMENTWISE_ENV, "fast")  # after construction: not read
    for p, g in zip(model.parameters(), _gradients(model, 0)):
        p.grad = g
    opt.step()
    assert seen == []
