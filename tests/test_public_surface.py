"""What ``help(muonscale.Muon)`` shows a user: the methods a user calls, and a usage example
that runs as written. Template hooks that subclasses override are underscored."""

from __future__ import annotations

import inspect
import re

import torch

import muonscale

TORCH_OPTIMIZER_API = {  # torch.optim.Optimizer's public names, inherited as they are
    name for name in dir(torch.optim.Optimizer) if not name.startswith("_")
}
MUON_METHODS = {  # what a user of muonscale.Muon calls beyond torch's
    "check_finite",
    "enable_step_metrics",
    "init_all_state",
    "optimizer_state_bytes",
    "read_step_metrics",
    "rebind_parameters",
    "state_dict_in_precision",
    "summary",
}
MUON_PROPERTIES = {  # what a user reads
    "orthogonalize_in_backward",
    "param_names",
    "routing",
    "skipped_steps",
    "split_roles",
    "split_rows",
    "transposed_names",
}


def public_names(cls: type, kind: str) -> set[str]:
    """``cls``'s public names beyond torch's optimizer: methods (``kind="method"``) or
    properties."""
    found = set()
    for name, value in inspect.getmembers(cls):
        if name.startswith("_") or name in TORCH_OPTIMIZER_API:
            continue
        if isinstance(value, property) == (kind == "property"):
            found.add(name)
    return found


def test_muon_public_methods_are_what_a_user_calls():
    assert public_names(muonscale.Muon, "method") == MUON_METHODS
    assert public_names(muonscale.Muon, "property") == MUON_PROPERTIES


def test_subclasses_add_no_public_template_hook():
    """The hooks ``Muon`` calls on its subclasses stay private in every subclass."""
    from muonscale.distributed import DistributedMuon, DTensorMuon

    hooks = {"after_rebind", "check_rebind", "update_group", "matrix_view", "init_state"}
    for cls in (DistributedMuon, DTensorMuon):
        assert not public_names(cls, "method") & hooks, cls.__name__


def test_class_docstring_example_runs():
    doc = inspect.getdoc(muonscale.Muon)
    block = re.search(r"\.\. code-block:: python\n\n((?:    .*\n|\n)+)", doc + "\n")
    assert block is not None, "no python example in Muon's docstring"
    code = "\n".join(line[4:] for line in block.group(1).splitlines())
    torch.manual_seed(0)
    scope = {"torch": torch, "muonscale": muonscale}
    exec(compile(code, "Muon docstring", "exec"), scope)
    opt = scope["opt"]
    assert {g["algorithm"] for g in opt.param_groups} == {"muon", "adamw"}
    assert all(p.grad is None for p in scope["model"].parameters())  # zero_grad ran
    assert opt.state  # step ran and made state
