"""Newton–Schulz during backward: ``muonscale.Muon(orthogonalize_in_backward=True)``.

A post-accumulate-grad hook on every stackable Muon parameter marks its gradient final; when
every member of a bucket (same param group, matrix shape, dtype and device; consecutive
parameters, at most :data:`BUCKET_BYTES` of Newton–Schulz input) is final, the bucket's new
momentum and orthogonalized update are computed at once, with the functions ``step()`` uses
(:mod:`muonscale.functional`): on CUDA on a side stream, on CPU in the hook. Nothing in the
optimizer's state changes there: the new momentum goes to a scratch stack. ``step()`` then
checks that every gradient is the one the hook saw (same tensor, same version counter, no
second backward, same hyperparameters, single process) and either commits the momentum and
applies the updates or, when anything changed, discards the work and runs the normal path
with a one-time warning. See *Design notes* in the docs.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from . import functional, matrix_step
from .kernels.process_state import NSWorkspace
from .newton_schulz import resolve_schedule
from .param_table import ParamTable
from .quantized_state import quantized_momentum
from .scaling import update_scale
from .settings import BACKWARD_SNAPSHOT, MuonSettings

BUCKET_BYTES = 32 * 2**20
"""Newton–Schulz input bytes of one bucket (a bucket holds at least one matrix): small enough
that the first buckets start while most of backward remains, large enough to batch."""

SNAPSHOT_KEYS = BACKWARD_SNAPSHOT
"""Group options the hook's work depends on (``lr`` and ``weight_decay`` are read by step)."""


@dataclass
class Bucket:
    """Parameters whose update is computed together, and that computation's result."""

    group: dict[str, Any]
    params: list[torch.Tensor]
    matrix_shape: tuple[int, int]
    ns_dtype: torch.dtype
    device: torch.device
    ready: int = 0
    seen: list[tuple[weakref.ref, int] | None] = field(default_factory=list)
    options: tuple | None = None  # the group's SNAPSHOT_KEYS values the result was made with
    new_momentum: torch.Tensor | None = None  # (k, *param shape) scratch
    workspace: NSWorkspace | None = None
    result: torch.Tensor | None = None  # (k, rows, cols), in the workspace
    alpha: float = 0.0
    done: Any = None  # torch.cuda.Event recorded on the side stream

    def discard(self) -> None:
        self.ready, self.result, self.options, self.done = 0, None, None, None
        self.seen = [None] * len(self.params)


def _on_grad(engine_ref: weakref.ref, param: torch.Tensor) -> None:
    engine = engine_ref()
    if engine is not None:
        engine.gradient_final(param)


class BackwardOrthogonalizer:
    """The hooks, buckets and side streams of one optimizer (owned by it; ``table``: its
    :class:`~muonscale.param_table.ParamTable`)."""

    def __init__(self, opt: torch.optim.Optimizer, table: ParamTable) -> None:
        self._opt = weakref.ref(opt)
        self.table = table
        self.buckets: list[Bucket] = []
        self.slot: dict[int, tuple[Bucket, int]] = {}  # id(param) -> (bucket, index)
        self.handles: list[Any] = []
        self.streams: dict[torch.device, Any] = {}
        self.fired: set[int] = set()  # id(param) whose hook ran since the last step
        self.repeated: str | None = None  # a parameter whose hook ran twice since then
        self.warned: set[str] = set()
        self.rebuild()

    # ------------------------------------------------------------- buckets and hooks
    def rebuild(self) -> None:
        """(Re)partition the Muon parameters into buckets and register the hooks."""
        for handle in self.handles:
            handle.remove()
        self.handles, self.buckets, self.slot = [], [], {}
        self.reset()
        opt = self._opt()
        ref = weakref.ref(self)
        for group in opt.param_groups:
            if group["algorithm"] != "muon":
                continue
            options = MuonSettings.from_group(group)
            open_bucket: dict[tuple, Bucket] = {}
            for p in group["params"]:
                if p.numel() == 0 or not p.requires_grad:  # frozen: no hook, step() as usual
                    continue
                view = self.table.view(p, group["matrix_mode"])
                key = matrix_step.stack_key(p, view, options.ns, options)
                if key is None or len(view.matrix_shapes) != 1:  # split/transposed views,
                    continue  # expert stacks and variants: updated in step()
                shape, device, dtype = key
                size = p.numel() * torch.finfo(dtype).bits // 8
                key = (*key, tuple(p.shape))  # one scratch stack holds the new momentum
                bucket = open_bucket.get(key)
                if bucket is None or (len(bucket.params) + 1) * size > BUCKET_BYTES:
                    bucket = open_bucket[key] = Bucket(group, [], shape, dtype, device)
                    self.buckets.append(bucket)
                self.slot[id(p)] = (bucket, len(bucket.params))
                bucket.params.append(p)
                hook = functools.partial(_on_grad, ref)
                self.handles.append(p.register_post_accumulate_grad_hook(hook))
        for bucket in self.buckets:
            bucket.discard()

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def reset(self) -> None:
        """Forget this step's hooks and results (``zero_grad``, ``load_state_dict``, a step)."""
        self.fired.clear()
        self.repeated = None
        for bucket in self.buckets:
            bucket.discard()

    # ------------------------------------------------------------- during backward
    def gradient_final(self, p: torch.Tensor) -> None:
        """The post-accumulate-grad hook of ``p``."""
        slot = self.slot.get(id(p))
        if slot is None or self.repeated is not None:
            return
        bucket, index = slot
        if id(p) in self.fired:  # a second backward (accumulation) or a new one after edits
            self.repeated = self._label(p)
            for b in self.buckets:
                b.discard()
            return
        self.fired.add(id(p))
        bucket.seen[index] = (weakref.ref(p.grad), p.grad._version)
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        opt, group = self._opt(), bucket.group
        grads = [p.grad for p in bucket.params]
        olds = []
        settings = MuonSettings.from_group(group)
        dtype = settings.momentum_dtype_for(bucket.params[0].dtype)
        for p in bucket.params:  # state is not touched here: a first step starts from zeros
            entry = opt.state.get(p, {})
            buf = entry.get("momentum_buffer")
            if buf is not None and settings.state_precision != "param":  # float32 values
                buf = quantized_momentum(entry, self.table.view(p, group["matrix_mode"])).values()
            olds.append(buf if buf is not None else torch.zeros_like(p, dtype=dtype))
        k, (rows, cols) = len(bucket.params), bucket.matrix_shape
        shape = (k, *bucket.params[0].shape)
        if bucket.new_momentum is None or bucket.new_momentum.dtype != olds[0].dtype:
            bucket.new_momentum = torch.empty(shape, dtype=olds[0].dtype, device=bucket.device)
        if bucket.workspace is None:
            bucket.workspace = NSWorkspace((k, rows, cols), bucket.ns_dtype, bucket.device)
        ns = MuonSettings.from_group(group).ns
        schedule, margin = resolve_schedule(ns.coefficients, ns.steps)
        method = matrix_step.ns_method_for(
            rows, cols, bucket.ns_dtype, ns.method, ns.coefficients, ns.steps
        )
        bucket.alpha = -update_scale(group["scale"], rows, cols)
        bucket.options = tuple(group[key] for key in SNAPSHOT_KEYS)
        new = list(bucket.new_momentum.unbind(0))

        def compute() -> torch.Tensor:
            functional.update_momentum_(grads, olds, momentum=group["momentum"], out=new)
            return functional.orthogonalize_directions_(
                grads,
                new,
                bucket.workspace,
                momentum=group["momentum"],
                nesterov=group["nesterov"],
                schedule=schedule,
                margin=margin,
                eps=ns.eps,
                method=method,
            )

        if bucket.device.type != "cuda":
            bucket.result = compute()
            return
        main = torch.cuda.current_stream(bucket.device)
        side = self.streams.get(bucket.device)
        if side is None:
            side = self.streams[bucket.device] = torch.cuda.Stream(bucket.device)
        side.wait_stream(main)  # the gradients (and the last step's reads of the scratch)
        with torch.cuda.stream(side):
            bucket.result = compute()
            bucket.done = torch.cuda.Event()
            bucket.done.record(side)
        for t in (*grads, *olds, bucket.new_momentum):  # allocated on main, read on side
            t.record_stream(side)

    # ------------------------------------------------------------- in step()
    def collect(self) -> list[Bucket]:
        """The buckets whose results ``step()`` may apply (and, when a gradient changed after
        its hook, none: a one-time warning says why); the device waits for them."""
        ready = [b for b in self.buckets if b.result is not None]
        problem = None
        if self.repeated is not None:
            problem = (
                "repeated",
                f"the gradient of {self.repeated!r} was accumulated again after its hook ran "
                "(more than one backward per step, or a backward after zeroing gradients "
                "without the optimizer's zero_grad)",
            )
        elif ready and torch.distributed.is_available() and torch.distributed.is_initialized():
            if torch.distributed.get_world_size() > 1:
                problem = (
                    "distributed",
                    "torch.distributed runs with more than one rank, so gradients may be "
                    "averaged (DistributedDataParallel) after the hooks saw them",
                )
        if problem is None:
            problem = next((m for b in ready if (m := self._changed(b))), None)
        if problem is not None:
            self._warn_once(problem)
            self.reset()
            return []
        for bucket in ready:
            if bucket.done is not None:
                torch.cuda.current_stream(bucket.device).wait_event(bucket.done)
        return ready

    def _label(self, p: torch.Tensor) -> str:
        return self.table.label(p, self._opt().param_groups)

    def _changed(self, bucket: Bucket) -> tuple[str, str] | None:
        """(kind, why) when ``bucket``'s result no longer matches its gradients and options."""
        for p, seen in zip(bucket.params, bucket.seen):
            grad = p.grad
            if grad is None or seen is None or seen[0]() is not grad:
                return "replaced", f"the gradient of {self._label(p)!r} was replaced after backward"
            if grad._version != seen[1]:
                return "modified", (
                    f"the gradient of {self._label(p)!r} was modified in place after backward "
                    "(gradient clipping such as clip_grad_norm_, unscaling, masking)"
                )
        if bucket.options != tuple(bucket.group[key] for key in SNAPSHOT_KEYS):
            return "options", "a Muon option of the param group changed between backward and step"
        return None

    def _warn_once(self, problem: tuple[str, str]) -> None:
        kind, problem = problem
        if kind in self.warned:
            return
        self.warned.add(kind)
        warnings.warn(
            f"muonscale.Muon(orthogonalize_in_backward=True): {problem}; the Newton–Schulz "
            "work done during backward was discarded and this step computed every update "
            "from the gradients as they are now (the normal path, the same result as without "
            "the option, but no overlap). Warned once per kind of change.",
            RuntimeWarning,
            stacklevel=4,
        )

    def apply(
        self,
        group: Mapping[str, Any],
        ready: list[Bucket],
        params: list[torch.Tensor],
        init_state: Callable[[torch.Tensor, Mapping[str, Any]], dict[str, torch.Tensor]],
    ) -> list[torch.Tensor]:
        """Commit the momentum and apply the updates of ``group``'s ready buckets (``init_state``:
        the optimizer's); return the parameters of ``params`` they do not cover (``step()``
        updates those as usual)."""
        covered: set[int] = set()
        lr = float(group["lr"])
        for bucket in ready:
            if bucket.group is not group:
                continue
            if bucket.done is not None:  # scratch made on the side stream, read here
                main = torch.cuda.current_stream(bucket.device)
                bucket.result.record_stream(main)
                bucket.new_momentum.record_stream(main)
            states = [init_state(p, group) for p in bucket.params]
            if group.get("state_precision", "param") != "param":  # written back quantized
                for p, s, new in zip(bucket.params, states, bucket.new_momentum.unbind(0)):
                    view = self.table.view(p, group["matrix_mode"])
                    quantized_momentum(s, view).store_(new)
            else:
                buffers = [s["momentum_buffer"] for s in states]
                torch._foreach_copy_(buffers, list(bucket.new_momentum.unbind(0)))
            matrix_step.apply_updates_(
                bucket.params,
                list(bucket.result.unbind(0)),
                [bucket.alpha] * len(bucket.params),
                lr=lr,
                weight_decay=group["weight_decay"],
            )
            covered.update(id(p) for p in bucket.params)
        return [p for p in params if id(p) not in covered]
