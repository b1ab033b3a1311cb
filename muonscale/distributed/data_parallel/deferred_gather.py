"""The parameter all-gathers of ``DistributedMuon.step()`` left in flight until the forward
needs them (``defer_gather=True``), as FSDP2 prefetches.

``step()`` launches the gathers in the model's parameter order (a stand-in for forward order)
and returns. A forward pre-hook on every module that holds parameters directly waits for the
gathers up to the last one carrying those parameters, in launch order, and copies them in; tied
weights are held by each module that shares them, so whichever runs first waits. The root
module's pre-hook waits for the parameters whose modules did not run in the previous forward
(a weight read through ``F.linear`` by another module, a module never called); before any
forward was seen it waits for everything. The root's post-hook waits for the rest, so the next
backward's reduce-scatter never writes a buffer an in-flight gather still uses (the reduction
also waits before its first launch). The model's ``state_dict`` and ``load_state_dict`` wait
first (hooks on the root); the optimizer waits in its own readers and writers; anything else
(a user callback between ``step()`` and the forward) calls ``opt.wait_for_parameters()``.

Waiting changes only when a parameter is written, never what is written: the values are
bitwise those of the undeferred step.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from ...compile_boundary import eager_under_compile
from ..comm import Communicator

WAIT_WHAT = (
    "parameter all-gather of the previous step() (defer_gather=True: waited for in the forward)"
)


@dataclass
class PendingGather:
    """One launched all-gather: its handle, what lands it in the parameters, and the indices of
    the parameters it carries."""

    work: Any
    copy_back: Callable[[], None]
    params: frozenset[int]


def _hooked(method_name: str, ref: weakref.ref, *args: Any) -> None:
    deferred = ref()
    if deferred is not None:
        getattr(deferred, method_name)(*args)


class DeferredGather:
    """In-flight gathers of one step and the model hooks that wait for them.

    Args:
        model: the module whose forward reads the parameters.
        params: the optimizer's parameters (indices below refer to it).
        comm: the communicator that launched the gathers (its ``wait`` names failures).
    """

    def __init__(self, model: nn.Module, params: Sequence[torch.Tensor], comm: Communicator):
        self.comm = comm
        index = {id(p): i for i, p in enumerate(params)}
        position = {id(p): k for k, p in enumerate(model.parameters())}
        last = len(position)
        self.forward_position = [position.get(id(p), last + i) for i, p in enumerate(params)]
        """Launch rank of each parameter: its place in ``model.parameters()``."""
        self._pending: list[PendingGather] = []
        self._done = 0
        self._last_gather: dict[int, int] = {}  # parameter index -> last pending gather with it
        self.wait_seconds = 0.0
        """Seconds spent waiting for the gathers of the last ``step()`` (hooks and calls)."""
        self.total_wait_seconds = 0.0
        """Seconds spent waiting for every step's gathers since construction."""
        self._held: dict[int, list[int]] = {}  # id(module) -> indices of its direct parameters
        self._seen: set[int] = set()  # modules run in the current forward
        self._seen_before: set[int] | None = None  # modules run in the previous forward
        ref = weakref.ref(self)
        self._handles = []
        for module in model.modules():
            held = [index[id(p)] for p in module.parameters(recurse=False) if id(p) in index]
            if held and module is not model:
                self._held[id(module)] = held
                self._handles.append(
                    module.register_forward_pre_hook(partial(_module_pre_hook, ref, id(module)))
                )
        self._root_held = [index[id(p)] for p in model.parameters(recurse=False) if id(p) in index]
        self._owner_modules = {i: [] for i in range(len(params))}
        for module_id, held in self._held.items():
            for i in held:
                self._owner_modules[i].append(module_id)
        self._handles += [
            model.register_forward_pre_hook(partial(_root_pre_hook, ref), prepend=True),
            model.register_forward_hook(partial(_root_post_hook, ref)),
            model.register_state_dict_pre_hook(partial(_wait_hook, ref)),
            model.register_load_state_dict_pre_hook(partial(_wait_hook, ref)),
        ]

    @property
    def pending(self) -> bool:
        """Whether some gather of the last ``step()`` has not landed yet."""
        return self._done < len(self._pending)

    def hand_off(self, pending: list[PendingGather]) -> None:
        """Take the launched gathers of a ``step()`` (in launch order)."""
        self.wait_all()
        self._pending, self._done, self.wait_seconds = pending, 0, 0.0
        self._last_gather = {i: k for k, g in enumerate(pending) for i in g.params}

    def wait_for(self, indices: Sequence[int]) -> None:
        """Land every gather up to the last one that carries a parameter of ``indices``."""
        target = max((self._last_gather.get(i, -1) for i in indices), default=-1)
        self._wait_through(target)

    def wait_all(self) -> None:
        """Land every gather of the last ``step()``."""
        self._wait_through(len(self._pending) - 1)

    def _wait_through(self, target: int) -> None:
        if target < self._done:
            return
        start = time.perf_counter()
        with torch.no_grad():
            while self._done <= target:
                gather = self._pending[self._done]
                self._done += 1  # a failure is raised once, not again by the next wait
                self.comm.wait(gather.work, WAIT_WHAT)
                gather.copy_back()
        waited = time.perf_counter() - start
        self.wait_seconds += waited
        self.total_wait_seconds += waited
        if not self.pending:
            self._pending, self._done, self._last_gather = [], 0, {}

    # ---------------------------------------------------------------- forward hooks
    def module_starts(self, module_id: int) -> None:
        self._seen.add(module_id)
        if self.pending:
            self.wait_for(self._held[module_id])

    def forward_starts(self) -> None:
        if self._seen:  # the modules of the previous forward
            self._seen_before = self._seen
        self._seen = set()
        if not self.pending:
            return
        if self._seen_before is None:
            self.wait_all()  # no forward seen yet: which modules run is unknown
            return
        seen = self._seen_before
        unseen = [i for i, held_by in self._owner_modules.items() if seen.isdisjoint(held_by)]
        self.wait_for(unseen + self._root_held)

    def remove_hooks(self) -> None:
        """Wait for the gathers in flight, then detach every model hook."""
        self.wait_all()
        for handle in self._handles:
            handle.remove()
        self._handles = []


@eager_under_compile
def _module_pre_hook(ref: weakref.ref, module_id: int, module: nn.Module, args: Any) -> None:
    _hooked("module_starts", ref, module_id)


@eager_under_compile
def _root_pre_hook(ref: weakref.ref, module: nn.Module, args: Any) -> None:
    _hooked("forward_starts", ref)


@eager_under_compile
def _root_post_hook(ref: weakref.ref, module: nn.Module, args: Any, output: Any) -> None:
    _hooked("wait_all", ref)


def _wait_hook(ref: weakref.ref, *args: Any) -> None:
    _hooked("wait_all", ref)
