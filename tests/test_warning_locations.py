"""The warnings :class:`muonscale.Muon` gives while it is built, grown or loaded point at the
line of the caller (``warnings.warn``'s ``stacklevel``), not into the library: the line a user
must change. Oracle: the file and line of each warning's record."""

from __future__ import annotations

import warnings

import torch

from muonscale import Muon


def _warned_at(call) -> tuple[list[tuple[str, int]], tuple[str, int]]:
    """(file, line) of every warning ``call()`` gives, and of ``call``'s own line (a lambda
    on one line: the line that calls the optimizer)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [(w.filename, w.lineno) for w in caught], (
        call.__code__.co_filename,
        call.__code__.co_firstlineno,
    )


def test_construction_warnings_point_at_the_constructor_call():
    w, gain = torch.nn.Parameter(torch.randn(12, 6)), torch.nn.Parameter(torch.ones(6))
    found, line = _warned_at(lambda: Muon([w, gain], qk_lr_scale=2.0))
    assert len(found) == 2  # unnamed parameter in a mixed list, idle qk_lr_scale
    assert found == [line, line]


def test_add_param_group_warning_points_at_its_call():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the constructor's own warning: the test above
        opt = Muon([torch.nn.Parameter(torch.randn(4, 4))])
    extra = [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.ones(4))]
    found, line = _warned_at(lambda: opt.add_param_group({"params": extra}))
    assert found == [line]


def test_load_state_dict_warnings_point_at_its_call():
    def build(**options):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(4, 4))
        return w, Muon([("h.weight", w)], **options)

    w, saved = build(momentum_dtype=torch.bfloat16, cautious_weight_decay=True)
    w.grad = torch.ones_like(w)
    saved.step()
    _, opt = build()
    state = saved.state_dict()
    found, line = _warned_at(lambda: opt.load_state_dict(state))
    assert len(found) == 2  # the saved variant option, then the kept momentum dtype
    assert found == [line, line]
