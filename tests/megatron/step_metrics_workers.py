"""Worker for the Megatron step-metrics test: a tiny GPT trained with megatron_muon at a given
TP size, its step metrics written by ``log_step_metrics`` into writers on global rank 0 (as
Megatron's ``training_log`` has them there: a TensorBoard ``SummaryWriter`` and a W&B run, here
recorders of the same calls, since the Megatron environment has neither package) and into the
returned log string."""

from __future__ import annotations

import megatron_workers as W


class RecordingWriter:
    """Records ``add_scalar(name, value, step)`` (TensorBoard) and ``log(dict, step)`` (W&B)."""

    def __init__(self) -> None:
        self.scalars: dict[str, dict[int, float]] = {}
        self.logged: dict[int, dict[str, float]] = {}

    def add_scalar(self, name: str, value: float, step: int) -> None:
        self.scalars.setdefault(name, {})[step] = value

    def log(self, values: dict, step: int) -> None:
        self.logged[step] = dict(values)


def run(rank: int, world_size: int, spec: dict) -> dict:
    from megatron.core import parallel_state as ps

    from muonscale.integrations.megatron import (
        MegatronMuonConfig,
        log_step_metrics,
        megatron_muon,
    )

    W.setup_parallel(spec["tp"])
    model = W.build_gpt(W.TINY)
    opt = megatron_muon([model], MegatronMuonConfig().replaced(**spec["options"]))
    opt.enable_step_metrics()
    writer, wandb = (RecordingWriter(), RecordingWriter()) if rank == 0 else (None, None)
    lines = []
    for step in range(spec["steps"]):
        W.inject_gradients(model, step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        lines.append(log_step_metrics(opt, step + 1, writer=writer, wandb_writer=wandb))
    ns_full = sum(W.gather_full(pl.param).numel() for pl in opt.plans if pl.algorithm == "muon")
    out = dict(lines=lines, metrics=opt.read_step_metrics(across_ranks=True), ns_full=ns_full)
    if writer is not None:
        out.update(scalars=writer.scalars, wandb=wandb.logged)
    ps.destroy_model_parallel()
    return out
