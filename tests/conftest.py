"""Suite-wide test settings.

torchrun children on torch 2.13 + gloo can abort at interpreter exit ("terminate called without
an active exception", exit -6) after their work is done and their results written. The cause
measured here: a gloo group that ends only at interpreter exit, because it was never destroyed
(a two-rank all-reduce script: 6 aborts in 10 without ``destroy_process_group()``, 0 in 50 with
it) or because FSDP2 still held it (``muonscale train --parallel fsdp``: 3 in 34 before the run
let go of its model first, 0 in 32 after; docs/train.md). muonscale's own entry points now end
their groups before exit, also when building a run fails; the groups of the trainers under test
(Hugging Face, Lightning) are theirs. A test whose failure text holds
exactly that message is run again (at most twice) when pytest-rerunfailures is installed (the
``dev`` extra); every other failure fails at once, and a rerun checks the same results.

``@pytest.mark.bare_tensors`` marks a test that hands ``muonscale.Muon`` bare tensors on purpose
(torch's optimizer tests, the float64 oracles): the warnings that those were routed by tensor
rank alone, and that a bare weight of 3 or more dims is flattened, are expected there and
filtered for that test only; everywhere else they show.
"""

import pytest

EXIT_ABORT = "terminate called without an active exception"
# muonscale's routing warning (optimizer_groups.FALLBACK_WARNING), as a filterwarnings regex
# (a "." for the ":" after the class name: the filter's fields are split at colons)
ROUTED_BY_RANK = "ignore:muonscale.Muon. [0-9]+ unnamed parameter.s. with >= 2 dims:UserWarning"
# a weight of 3 or more dims without its module (a bare convolution): flattened on purpose
FLATTENED = "ignore::muonscale.optimizer_groups.UnknownLayoutWarning"


def pytest_collection_modifyitems(config, items):
    reruns = config.pluginmanager.hasplugin("rerunfailures")
    for item in items:
        if item.get_closest_marker("bare_tensors") is not None:
            item.add_marker(pytest.mark.filterwarnings(ROUTED_BY_RANK))
            item.add_marker(pytest.mark.filterwarnings(FLATTENED))
        if reruns:
            item.add_marker(pytest.mark.flaky(reruns=2, only_rerun=[EXIT_ABORT]))
