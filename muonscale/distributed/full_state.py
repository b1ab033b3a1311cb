"""Full (unsharded) optimizer state of :class:`~muonscale.distributed.DistributedMuon`.

Checkpoint format (a choice, documented here): ``state_dict()`` returns the **full** state,
keyed exactly like single-process :class:`muonscale.Muon`'s (``momentum_buffer`` per Muon
matrix; ``step``, ``exp_avg``, ``exp_avg_sq`` per AdamW parameter, parameter-shaped):

* Why not per-rank shards: ``torch.distributed.checkpoint`` treats plain tensors under the same
  key on different ranks as replicas and keeps one of them, so shards saved as plain tensors
  are silently lost. Full tensors are true replicas: DCP writes each once, and loading at any
  world size (or into single-process ``Muon``) is a plain read, no resharding logic.
* Cost: the momentum is broadcast from its owner and AdamW shards are all-gathered at save
  time (one parameter-sized copy of the state per rank while saving).

:func:`gather` is collective; :func:`load` is local (each rank keeps the part it holds).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .data_parallel import DistributedMuon

ADAMW_MOMENTS = ("exp_avg", "exp_avg_sq")


@torch.no_grad()
def gather(opt: DistributedMuon) -> dict[int, dict[str, torch.Tensor]]:
    """``{parameter index: state}`` for every parameter, on every rank (collective)."""
    full: dict[int, dict[str, torch.Tensor]] = {}
    for i in opt._muon:  # momentum lives on the owner only
        p, group, owner = opt._params[i], opt._group_of[i], opt.owner_rank[i]
        if owner == opt.rank:
            buf = opt.state[p]["momentum_buffer"].clone()
        else:
            buf = torch.empty_like(p, dtype=group["momentum_dtype"] or p.dtype)
        opt.comm.broadcast(buf, src=owner, tag="checkpoint")
        full[i] = {"momentum_buffer": buf}
    for shards in opt._shards:  # AdamW moments: shard r of every flat bucket on rank r
        gathered = {}
        for name in ADAMW_MOMENTS:
            gathered[name] = torch.empty_like(shards.full)  # (padded,)
            opt.comm.all_gather(gathered[name], getattr(shards, name), tag="checkpoint")
        layout = shards.layout
        for i, off, n in zip(layout.params, layout.offsets, layout.numels):
            p = opt._params[i]
            full[i] = {"step": opt.state[p]["step"].clone()}
            for name in ADAMW_MOMENTS:
                full[i][name] = gathered[name][off : off + n].view(p.shape).clone()
    return {i: full[i] for i in sorted(full)}


@torch.no_grad()
def load(opt: DistributedMuon, state_dict: dict[str, Any]) -> None:
    """Take full state (keys matched through the saved param groups, as torch does) and keep
    the local part: owned momentum, this rank's AdamW segments, every step counter."""
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(
            f"loaded state has {len(saved_groups)} param groups, the optimizer {len(opt.param_groups)}"
        )
    key_of: dict[int, Any] = {}
    for group, saved in zip(opt.param_groups, saved_groups):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError("loaded state dict has a parameter group of a different size")
        saved = {"algorithm": "muon", **saved}
        if saved["algorithm"] != group["algorithm"]:
            raise ValueError(
                f"loaded param group is {saved['algorithm']!r}, this one {group['algorithm']!r}"
            )
        for p, key in zip(group["params"], saved["params"]):
            key_of[opt._index[id(p)]] = key
        for name, value in saved.items():
            if name != "params":
                group[name] = tuple(value) if name == "betas" else value
    saved_state = state_dict["state"]
    for i in opt._muon:
        if opt.owner_rank[i] != opt.rank:
            continue
        p = opt._params[i]
        source = saved_state.get(key_of[i], {}).get("momentum_buffer")
        buf = opt.state[p]["momentum_buffer"]
        if source is None:
            buf.zero_()
        else:
            buf.copy_(source.view(p.shape))
    for i in opt._adamw:
        entry = saved_state.get(key_of[i], {})
        state = opt.state[opt._params[i]]
        state["step"].fill_(float(entry["step"]) if "step" in entry else 0.0)
        if i not in opt._segments:
            continue
        seg = opt._segments[i][1]
        for name in ADAMW_MOMENTS:
            source = entry.get(name)
            if source is None:
                state[name].zero_()
            else:
                state[name].copy_(
                    source.reshape(-1)[seg.param_start : seg.param_start + seg.length]
                )
