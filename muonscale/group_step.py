"""One param group's step on plain local tensors: the group's options and its parameters'
state handed to :func:`muonscale.functional.muon` or :func:`muonscale.functional.adamw`, with a
capturable step's learning rate on the device and its non-finite flag folded in."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from . import functional
from .block_quantization import CPU_PIECE_ENTRIES
from .capturable import device_lr, step_lr
from .declared_state import replicated_state
from .kernels import ElementwiseBackend
from .matrices import MatrixView
from .memory import UNCHUNKED, ChunkBytes, MemoryBudget
from .quantized_state import (
    adamw_block_shape,
    adamw_moment_values,
    quantized_momentum,
    quantized_state_budget,
    store_adamw_moments_,
)
from .settings import MuonSettings


def nonempty(
    params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict]
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[dict]]:
    """``params``, ``grads`` and ``states`` without the zero-element parameters (they have
    state, as in torch, but nothing to orthogonalize)."""
    keep = [i for i, p in enumerate(params) if p.numel() > 0]
    if len(keep) == len(params):
        return params, grads, states
    return [params[i] for i in keep], [grads[i] for i in keep], [states[i] for i in keep]


def muon_group_step(
    group: Mapping[str, Any],
    settings: MuonSettings,
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: list[dict],
    buffers: list[torch.Tensor],
    views: list[MatrixView],
    *,
    capturable: bool,
    step_ok: torch.Tensor | None,
    memory: MemoryBudget,
    elementwise_backend: ElementwiseBackend,
    apply_updates: functional.ApplyUpdates | None,
) -> None:
    """Muon's step of ``params`` (each with elements) of ``group`` (``settings``: its
    options), with their ``states``, momentum ``buffers`` and matrix ``views``. ``step_ok``:
    a capturable step's device flag (False: a no-op)."""
    if settings.state_precision != "param":  # read and written once, by functional.muon
        memory = quantized_state_budget(memory, params[0].device)
        buffers = [quantized_momentum(s, view) for s, view in zip(states, views)]
        if step_ok is not None:  # the stored bits stay unless the step counts
            grads = [torch.where(step_ok, g, 0) for g in grads]
            for b in buffers:
                b.keep = step_ok
    elif step_ok is not None:
        # A gradient equal to the momentum leaves it unchanged (B.lerp(B, w) = B), and a
        # zero lr leaves the parameter unchanged: the step is a no-op on the device.
        grads = [torch.where(step_ok, g, b) for g, b in zip(grads, buffers)]
    functional.muon(
        params,
        grads,
        buffers,
        settings=settings,
        row_state=[replicated_state(s, settings) for s in states],
        views=views,
        lr=step_lr(group, step_ok) if capturable else float(group["lr"]),
        weight_decay=group["weight_decay"],
        max_chunk_bytes=memory.update_chunk_bytes,
        max_workspace_bytes=memory.ns_workspace_bytes,
        elementwise_backend=elementwise_backend,
        apply_updates=apply_updates,
    )


def adamw_group_step(
    group: Mapping[str, Any],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: list[dict],
    *,
    capturable: bool,
    step_ok: torch.Tensor | None,
    max_chunk_bytes: int,
) -> None:
    """AdamW's step of ``params`` of ``group`` with their ``states`` (``step_ok``: as in
    :func:`muon_group_step`)."""
    beta1, beta2 = group["betas"]
    if capturable:
        for p, s in zip(params, states):  # loaded checkpoints hold steps on the host
            if s["step"].device != p.device:
                s["step"] = s["step"].to(p.device)
    if group.get("state_precision", "param") != "param":
        _quantized_adamw_step(
            group,
            params,
            grads,
            states,
            capturable=capturable,
            step_ok=step_ok,
            max_chunk_bytes=max_chunk_bytes,
        )
        return
    exp_avgs = [s["exp_avg"] for s in states]
    exp_avg_sqs = [s["exp_avg_sq"] for s in states]
    if any(p.is_complex() for p in params):
        # As torch.optim.AdamW: real and imaginary parts are independent coordinates.
        params, grads, exp_avgs, exp_avg_sqs = (
            [torch.view_as_real(t) if t.is_complex() else t for t in ts]
            for ts in (params, grads, exp_avgs, exp_avg_sqs)
        )
    functional.adamw(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [s["step"] for s in states],
        lr=device_lr(group) if capturable else float(group["lr"]),
        beta1=beta1,
        beta2=beta2,
        eps=group["eps"],
        weight_decay=group["weight_decay"],
        max_chunk_bytes=max_chunk_bytes,
        finite=step_ok,
    )


def quantized_adamw_rows(rows: int, cols: int, p: torch.Tensor, budget: int | None) -> int:
    """Rows of ``p``'s (rows, cols) block matrix stepped at once by
    :func:`_quantized_adamw_step`: as many as ``budget`` allows for their transients (per
    entry: two float32 moments, AdamW's denominator, and a quantization's quotient, int32
    index and codes: 28 bytes), and on CPU at most :data:`CPU_PIECE_ENTRIES` entries, so
    that the moments are decoded, stepped and encoded while in cache."""
    if budget is None or not p.is_contiguous():
        return rows
    step_rows = budget // (max(cols, 1) * 28)
    if p.device.type == "cpu":
        step_rows = min(step_rows, CPU_PIECE_ENTRIES // max(cols, 1))
    return max(step_rows, 1)


def _quantized_adamw_step(
    group: Mapping[str, Any],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: list[dict],
    *,
    capturable: bool,
    step_ok: torch.Tensor | None,
    max_chunk_bytes: ChunkBytes,
) -> None:
    """:func:`adamw_group_step` with 8-bit moments: each parameter's rows of its block
    matrix, a chunk of rows at a time, read as float32, stepped by
    :func:`functional.adamw <muonscale.functional.adamw>` (the same arithmetic) and written
    back once; the step counter advances once per parameter."""
    beta1, beta2 = group["betas"]
    lr = device_lr(group) if capturable else float(group["lr"])
    for p, g, s in zip(params, grads, states):
        if p.is_complex():
            raise ValueError(
                "state_precision='int8': complex AdamW parameters keep floating state; put "
                "them in a param group with state_precision='param'"
            )
        rows, cols = adamw_block_shape(p)
        budget = quantized_state_budget(MemoryBudget(max_chunk_bytes), p.device)
        step_rows = quantized_adamw_rows(rows, cols, p, budget.update_chunk_bytes)
        counter = s["step"]
        for start in range(0, rows, step_rows):
            part = slice(start, min(rows, start + step_rows))
            moments = adamw_moment_values(s, p, part)
            whole = part.stop - part.start == rows
            param = p if whole else p.view(rows, cols)[part]  # whole: any strides
            grad = g.view_as(param) if whole else g.reshape(rows, cols)[part]
            work = param if param.dtype == torch.float32 else param.float()  # rounded once
            step = counter.clone()  # each chunk starts from the step counter before the step
            functional.adamw(
                [work],
                [grad.float()],
                [moments[0].view(param.shape)],
                [moments[1].view(param.shape)],
                [step],
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                max_chunk_bytes=UNCHUNKED,
                finite=step_ok,
            )
            if work is not param:
                param.copy_(work)
            store_adamw_moments_(s, p, part, moments, keep=step_ok)
        if rows:
            counter.copy_(step)
        else:
            counter.add_(1 if step_ok is None else step_ok.to(counter.dtype))
