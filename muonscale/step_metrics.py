"""What the last optimizer step did, for a training log (``opt.enable_step_metrics()``).

The step records host counts and device tensors only; :meth:`StepMetrics.read` turns them into
``{name: float}`` with one host sync and, given a distributed layout's reduction, combines every
rank's figures in one collective. Off (``opt.step_metrics is None``) the step does nothing
more. The figures and their definitions: *Step metrics* in the docs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch

from .matrices import MatrixView
from .quantized_state import adamw_moments

RankOp = Literal["sum", "max", "min"]
"""How a figure combines over ranks: ``"sum"`` (what each rank did), ``"max"`` / ``"min"``."""

Reduction = Callable[[torch.Tensor, Sequence[RankOp]], torch.Tensor]
"""``(values (K,) float64, ops) -> values`` combined over ranks (a layout's, in one collective)."""

COUNTS = ("ns", "adamw", "skipped")
"""Where a parameter went in a step: Newton–Schulz, AdamW, or not updated."""

NONZERO_SV = 1e-3
"""Singular values of a Newton–Schulz result at or below this count as zero (directions the
momentum does not have: the iteration keeps them at 0)."""

_NO_SAMPLE = {
    "orthogonality_error": -math.inf,
    "sv_min": math.inf,
    "sv_max": -math.inf,
    "rank_fraction": -math.inf,
}
_SAMPLE_OPS: dict[str, RankOp] = {
    "orthogonality_error": "max",
    "sv_min": "min",
    "sv_max": "max",
    "rank_fraction": "min",
}


def group_label(index: int, group: Mapping[str, Any]) -> str:
    """``group{index}_{algorithm}``: the name of a param group's figures."""
    return f"group{index}_{group.get('algorithm', 'muon')}"


class _Timer:
    """Wall time of a block, summed over the step: host clock on CPU, CUDA events (read at
    :meth:`seconds`, not when recorded) on GPU."""

    def __init__(self) -> None:
        self.host = 0.0
        self.events: list[tuple[Any, Any]] = []

    def block(self, device: torch.device) -> _TimedBlock:
        return _TimedBlock(self, device)

    def seconds(self) -> float:
        total = self.host
        for start, end in self.events:
            end.synchronize()
            total += start.elapsed_time(end) / 1e3
        return total


class _TimedBlock:
    def __init__(self, timer: _Timer, device: torch.device) -> None:
        self.timer, self.cuda = timer, device.type == "cuda"

    def __enter__(self) -> None:
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.timer.events.append((self.start, end))
        else:
            self.timer.host += time.perf_counter() - self.start


class StepMetrics:
    """The last step's figures, owned by the optimizer (``opt.step_metrics``).

    Counts (host integers, the same on every rank: they say what the step did with each
    parameter, from the gradients it had and whether it ran): ``ns_tensors`` / ``ns_elements``
    (went through Newton–Schulz), ``adamw_*`` (stepped by AdamW), ``skipped_*`` (no gradient,
    or the whole step skipped by ``nonfinite="skip"``). Device figures, summed over what this
    rank computed: the update's squares per param group (``update_rms/<group>``, per unit of
    learning rate, weight decay excluded), the orthogonality of one sampled Newton–Schulz
    result, and (``timing``) the seconds of the Muon update. A layout adds its own (wire bytes,
    gather wait) with :meth:`add`.

    Args:
        timing: time the Muon groups' update (momentum, Newton–Schulz, apply); CUDA events on
            GPU, read (waited for) only by :meth:`read`.
        orthogonality: check one Newton–Schulz result per step (rotating over the matrices).
        prefix: put before every name (``"muon/"``: ``muon/ns_elements``, ...).
    """

    def __init__(self, *, timing: bool = False, orthogonality: bool = True, prefix: str = "muon/"):
        self.timing, self.orthogonality, self.prefix = bool(timing), bool(orthogonality), prefix
        self.steps = 0
        """Steps recorded since the metrics were enabled."""
        self._last_matrices = 0  # matrices seen by the sampler in the previous step
        self._clear([])

    def _clear(self, labels: Sequence[str]) -> None:
        self.counts = {f"{where}_{unit}": 0 for where in COUNTS for unit in ("tensors", "elements")}
        self.labels = list(labels)
        self.update_squares: dict[str, torch.Tensor | float] = dict.fromkeys(labels, 0.0)
        self.update_elements: dict[str, int] = dict.fromkeys(labels, 0)
        self.sample: dict[str, torch.Tensor | float] = dict(_NO_SAMPLE)
        self.timer = _Timer()
        self.extra: dict[str, tuple[float | torch.Tensor, RankOp]] = {}
        self.step_ok: torch.Tensor | None = None
        self._matrices = 0

    # ------------------------------------------------------------ recorded by the step
    def begin(self, param_groups: Sequence[Mapping[str, Any]]) -> None:
        """A step starts: forget the last one."""
        self._last_matrices = self._matrices or self._last_matrices
        self._clear([group_label(i, g) for i, g in enumerate(param_groups)])
        self.steps += 1

    def count_step(
        self,
        param_groups: Sequence[Mapping[str, Any]],
        stepped: Callable[[torch.Tensor], bool],
        numel: Callable[[torch.Tensor], int] | None = None,
    ) -> None:
        """Count every parameter of ``param_groups``: by its group's algorithm where
        ``stepped(p)`` (it had a gradient and the step ran), else as skipped. ``numel``: its
        logical elements (a sharded parameter's whole)."""
        for group in param_groups:
            where = "ns" if group.get("algorithm", "muon") == "muon" else "adamw"
            for p in group["params"]:
                n = p.numel() if numel is None else numel(p)
                key = where if stepped(p) else "skipped"
                if key == "ns" and n == 0:
                    continue
                self.counts[f"{key}_tensors"] += 1
                self.counts[f"{key}_elements"] += n

    def gate(self, step_ok: torch.Tensor | None) -> None:
        """A capturable step's device flag: where False at :meth:`read`, the step was skipped."""
        self.step_ok = step_ok

    def timed(self, device: torch.device) -> Any:
        """A context timing a Muon update on ``device`` (a no-op without ``timing``)."""
        return self.timer.block(device) if self.timing else _NOT_TIMED

    def add(self, name: str, value: float | torch.Tensor, op: RankOp = "sum") -> None:
        """A layout's figure of this step (``op``: how it combines over ranks)."""
        self.extra[name] = (value, op)

    def metered_apply(
        self,
        label: str,
        apply: Callable[..., None],
        view_of: Callable[[torch.Tensor], MatrixView] | None,
    ) -> Callable[..., None]:
        """``apply`` (Muon's last pass: params, updates, rules, lr=, weight_decay=) that first
        adds its updates α·O to ``label``'s squares, and samples one O for orthogonality
        (``view_of``: each parameter's matrix view; None: sample none, e.g. a variant whose O
        is not meant to be orthogonal)."""

        def metered(params, updates, rules, **kwargs: Any) -> None:
            self.record_updates(label, updates, [r.alpha for r in rules])
            if view_of is not None and self.orthogonality:
                self._sample(params, updates, view_of)
            apply(params, updates, rules, **kwargs)

        return metered

    def metered_updates(self, label: str, make: Callable[..., Any]) -> Callable[..., Any]:
        """``make`` (returns already scaled updates, applied with α = −1: an injected
        orthogonalizer) that first adds its updates to ``label``'s squares."""

        def metered(*args: Any, **kwargs: Any) -> Any:
            updates = make(*args, **kwargs)
            self.record_updates(label, updates, [1.0] * len(updates))
            return updates

        return metered

    def record_updates(
        self, label: str, updates: Sequence[torch.Tensor], scales: Sequence[float]
    ) -> None:
        """Add Σ (scale · ‖update‖)² and the elements of ``updates`` to ``label``."""
        if not updates:
            return
        norms = torch.stack([n.float() for n in torch._foreach_norm(list(updates))])
        weights = torch.tensor([float(s) ** 2 for s in scales], device=norms.device)
        self.update_squares[label] = self.update_squares[label] + (norms.square() * weights).sum()
        self.update_elements[label] += sum(u.numel() for u in updates)

    def record_adamw(self, label: str, group: Mapping[str, Any], states: Sequence[dict]) -> None:
        """Add AdamW's updates per unit lr, m̂ / (√v̂ + ε) = (c₂ / c₁) · m / (√v + ε c₂) with
        c₁ = 1 − β₁ᵗ, c₂ = √(1 − β₂ᵗ), of ``states`` (after their step): one float32 temporary
        and four passes per tensor."""
        beta1, beta2 = group["betas"]
        norms: list[torch.Tensor] = []
        for s in states:
            m, v = adamw_moments(s)
            t = s["step"]
            t = t.to(device=m.device, dtype=torch.float32) if torch.is_tensor(t) else float(t)
            c1, c2 = 1 - beta1**t, (1 - beta2**t) ** 0.5
            update = v.float().sqrt().add_(group["eps"] * c2)  # √v + ε c₂
            torch.div(m, update, out=update)  # m / (√v + ε c₂), in place
            norms.append(torch.linalg.vector_norm(update) * (c2 / c1))
        if norms:
            squares = torch.stack([n.float() for n in norms]).square().sum()
            self.update_squares[label] = self.update_squares[label] + squares
            self.update_elements[label] += sum(s["exp_avg"].numel() for s in states)  # codes too

    def _sample(self, params, updates, view_of) -> None:
        target = (self.steps - 1) % self._last_matrices if self._last_matrices else 0
        for p, o in zip(params, updates):
            view = view_of(p)
            if view.row_partition is not None or len(view.matrix_shapes) != 1:
                continue  # a split parameter's O is orthogonal block by block only
            if self._matrices == target:
                self._measure(o.reshape(view.matrix_shapes[0]))
            self._matrices += 1

    def _measure(self, o: torch.Tensor) -> None:
        """The singular values σ of O above :data:`NONZERO_SV` (Newton–Schulz leaves a
        direction the momentum lacks at 0): their extremes, max |σ − 1|, and their share of
        the short side (the momentum's rank, relative)."""
        x = o.float() if o.shape[0] <= o.shape[1] else o.float().T
        sv = torch.linalg.eigvalsh(x @ x.T).clamp_min(0).sqrt()
        nonzero = sv > NONZERO_SV
        count = nonzero.sum()
        kept = torch.where(nonzero, sv, sv.new_tensor(1.0))
        none = count == 0
        self.sample["orthogonality_error"] = (kept - 1).abs().max()
        self.sample["sv_min"] = torch.where(
            none, math.inf, torch.where(nonzero, sv, math.inf).min()
        )
        self.sample["sv_max"] = torch.where(none, -math.inf, sv.max())
        self.sample["rank_fraction"] = count / sv.numel()

    # ------------------------------------------------------------ read by the user
    def read(self, reduce: Reduction | None = None) -> dict[str, float]:
        """The last step's figures as floats (one host sync; ``reduce``: combined over ranks
        in one collective)."""
        names, ops, values = [], [], []

        def put(name: str, value: Any, op: RankOp) -> None:
            names.append(name)
            ops.append(op)
            values.append(value)

        for name, value in self.counts.items():
            put(name, value, "max")  # the same on every rank
        for label in self.labels:
            put(f"update_squares/{label}", self.update_squares[label], "sum")
            put(f"update_elements/{label}", self.update_elements[label], "sum")
        if self.orthogonality:
            for name, value in self.sample.items():
                put(name, value, _SAMPLE_OPS[name])
        if self.timing:
            put("muon_update_seconds", self.timer.seconds(), "max")
        for name, (value, op) in self.extra.items():
            put(name, value, op)
        if self.step_ok is not None:
            put("step_ok", self.step_ok, "min")
        vector = _as_vector(values)
        if reduce is not None:
            vector = reduce(vector, ops)
        read = dict(zip(names, vector.tolist()))
        return self._finished(read)

    def _finished(self, raw: dict[str, float]) -> dict[str, float]:
        if raw.pop("step_ok", 1.0) == 0.0:  # a capturable step the device skipped
            for unit in ("tensors", "elements"):
                raw[f"skipped_{unit}"] += raw[f"ns_{unit}"] + raw[f"adamw_{unit}"]
                raw[f"ns_{unit}"] = raw[f"adamw_{unit}"] = 0.0
        out = {}
        for name, value in raw.items():
            if name.startswith("update_elements/"):
                continue
            if name.startswith("update_squares/"):
                label = name.split("/", 1)[1]
                n = raw[f"update_elements/{label}"]
                if n:
                    out[f"update_rms/{label}"] = math.sqrt(value / n)
                continue
            if name in _NO_SAMPLE:
                if not math.isinf(value):  # else no matrix sampled this step
                    out[f"ns_sample/{name}"] = value
                continue
            out[name] = value
        return {self.prefix + k: v for k, v in out.items()}


class _NotTimed:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_NOT_TIMED = _NotTimed()


def _as_vector(values: Sequence[Any]) -> torch.Tensor:
    """``values`` (numbers and 0-dim tensors) as one float64 CPU tensor, one copy per device."""
    out = torch.zeros(len(values), dtype=torch.float64)
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        if torch.is_tensor(v):
            by_device.setdefault(v.device, []).append(i)
        else:
            out[i] = float(v)
    for idx in by_device.values():
        stacked = torch.stack([values[i].detach().reshape(()).double() for i in idx])
        out[torch.tensor(idx)] = stacked.cpu()
    return out


def find_step_metrics_optimizer(optimizer: Any) -> Any:
    """The muonscale optimizer inside a framework's wrapper (accelerate's
    ``AcceleratedOptimizer.optimizer``, Lightning's ``LightningOptimizer._optimizer``), or
    None."""
    seen = 0
    while optimizer is not None and seen < 8:
        if hasattr(optimizer, "read_step_metrics"):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        seen += 1
    return None
