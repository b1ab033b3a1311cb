"""torchrun worker of ``benchmarks/multihost.py``: trains each contender on the reference GPT
and measures, per host, the bytes its link carried over K steps (minus an idle window of the
same length) next to the bytes ``muonscale.distributed.comm`` counted.

Contenders: ``muon`` (DistributedMuon), ``muon-bf16reduce`` (reduce_dtype=bfloat16),
``adamw-zero1`` (DistributedMuon with every parameter routed to AdamW), ``muon-nooverlap`` and
``muon-bf16reduce-nooverlap`` (``overlap_gather=False``), ``muon-defer`` and
``muon-bf16reduce-defer`` (``gather_updates=True``, ``defer_gather=True``), ``adamw-ddp`` (DDP +
torch AdamW, all-reduce counted by a comm hook), ``fsdp-muon`` (DTensorMuon under FSDP2; FSDP2's
own collectives counted with :func:`~muonscale.distributed.comm.native_wire_bytes`) and
``fsdp-adamw`` (torch AdamW under the same FSDP2 sharding). Bytes are measured and counted per
link class: the host's link (``eth0``) carries the inter-host bytes, its loopback (``lo``) the
intra-host ones. Each Muon contender also times its Newton–Schulz calls (``ns_s``), beside its
forward + backward (``step_s - opt_s``). Host ``h``'s local rank 0 writes
``<out>/host<h>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

CONTENDERS = (
    "muon",
    "muon-bf16reduce",
    "adamw-zero1",
    "adamw-ddp",
    "fsdp-muon",
    "fsdp-adamw",
    "muon-nooverlap",
    "muon-bf16reduce-nooverlap",
    "muon-defer",
    "muon-bf16reduce-defer",
)
DEFERRED = "-defer"  # bf16 update gather, landed in the next forward (defer_gather=True)
NO_OVERLAP = "-nooverlap"  # DistributedMuon(overlap_gather=False): gathers after the last wave
LRS = {"muon": 0.02, "adamw": 1e-3}


def _if_bytes(ifname: str) -> tuple[int, int]:
    stats = Path("/sys/class/net") / ifname / "statistics"
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def _configs(a):
    """The ``TrainConfig`` s of the Muon and AdamW contenders: constant lr, no clipping."""
    from muonscale.train.config import TrainConfig

    common = dict(
        model="tiny",
        d_model=a.d_model,
        n_layer=a.n_layer,
        n_head=a.n_head,
        context_length=a.context_length,
        schedule="constant",
        warmup_steps=0,
        grad_clip=None,
        ns_dtype=a.ns_dtype,
        seed=0,
        device="cpu",
        out_dir=None,
    )
    return (
        TrainConfig(optimizer="muon", lr=LRS["muon"], **common),
        TrainConfig(optimizer="adamw", lr=LRS["adamw"], **common),
    )


def _deferred(name, muon, bucket_cap_mb):
    """DistributedMuon with the owners' bf16 updates gathered and landed in the next forward."""
    from muonscale.bench.distributed_worker import Contender
    from muonscale.distributed import DistributedMuon
    from muonscale.train.model import GPT
    from muonscale.train.optimizers import muon_options

    torch.manual_seed(muon.seed)
    model = GPT(muon.model_config())
    reduce_dtype = torch.bfloat16 if name.startswith("muon-bf16reduce") else None
    opt = DistributedMuon(
        model.named_parameters(),  # routed by name, as the other Muon contenders
        model=model,
        reduce_dtype=reduce_dtype,
        gather_updates=True,
        defer_gather=True,
        bucket_cap_mb=bucket_cap_mb,
        **muon_options(model, muon),
    )
    return Contender(name, muon, model, opt)


def _build(names, muon, adamw, world_size, hosts, bucket_cap_mb):
    from muonscale.bench.distributed_worker import dp_contenders, sharded_contenders

    out = {n: _deferred(n, muon, bucket_cap_mb) for n in names if n.endswith(DEFERRED)}
    for name in (n for n in names if n.endswith(NO_OVERLAP)):
        base = name.removesuffix(NO_OVERLAP)
        dtypes = ["bfloat16"] if base == "muon-bf16reduce" else ["float32"]
        for c in dp_contenders(muon, adamw, dtypes, hosts=hosts, bucket_cap_mb=bucket_cap_mb):
            if c.name == base:
                c.name, c.opt.overlap_gather = name, False
                out[name] = c
            else:
                c.release()
    names_with_overlap = [n for n in names if not n.endswith((NO_OVERLAP, DEFERRED))]
    if any(not n.startswith("fsdp-") for n in names_with_overlap):
        dtypes = ["float32"] + (["bfloat16"] if "muon-bf16reduce" in names else [])
        for c in dp_contenders(muon, adamw, dtypes, hosts=hosts, bucket_cap_mb=bucket_cap_mb):
            if c.name in names_with_overlap:
                out[c.name] = c
            else:
                c.release()
    if "fsdp-muon" in names or "fsdp-adamw" in names:
        for c in sharded_contenders(muon, adamw, "fsdp", world_size):
            c.name = f"fsdp-{c.name}"
            if c.name in names:
                if c.name == "fsdp-muon":  # count DTensorMuon's own traffic by link class
                    c.opt.comm.hosts = hosts
                out[c.name] = c
            else:
                c.release()
    return [out[n] for n in names]


def _param_digest(c) -> str | None:
    """SHA-256 of the model's parameters (plain tensors only; None for FSDP2's shards)."""
    wait = getattr(c.opt, "wait_for_parameters", None)
    if wait is not None:  # a deferred gather still writes them
        wait()
    h = hashlib.sha256()
    for p in c.model.parameters():
        if not isinstance(p.data, torch.Tensor) or type(p.data) is not torch.Tensor:
            return None
        h.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class NewtonSchulzTimer:
    """Seconds spent in Newton–Schulz: wraps the two entry points Muon's step calls (the stacked
    path's ``functional.orthogonalize_stack_`` and the matrix step's
    ``matrix_step.newton_schulz_fast``) while active."""

    ENTRY_POINTS = (("functional", "orthogonalize_stack_"), ("matrix_step", "newton_schulz_fast"))

    def __init__(self) -> None:
        self.seconds = 0.0

    def __enter__(self):
        import importlib

        self._saved = []
        for module_name, name in self.ENTRY_POINTS:
            module = importlib.import_module(f"muonscale.{module_name}")
            fn = getattr(module, name)
            self._saved.append((module, name, fn))
            setattr(module, name, self._timed(fn))
        return self

    def _timed(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed

    def __exit__(self, *exc) -> None:
        for module, name, fn in self._saved:
            setattr(module, name, fn)


def _mean_links(per_step: list[dict[str, int]]) -> dict[str, float]:
    keys = ("intra_host", "inter_host")
    return {k: sum(s.get(k, 0) for s in per_step) / max(1, len(per_step)) for k in keys}


def _muon_fraction(contenders) -> float | None:
    """Fraction of the parameters' elements that a DistributedMuon contender updates by Muon."""
    for c in contenders:
        if hasattr(c.opt, "muon_indices"):
            muon = sum(c.opt.params[i].numel() for i in c.opt.muon_indices)
            total = sum(p.numel() for p in c.opt.params)
            if muon:
                return muon / total
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--contenders", default=",".join(CONTENDERS[:4]))
    ap.add_argument("--steps", type=int, default=5, help="measured steps per contender (K)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--context-length", type=int, default=128)
    ap.add_argument("--pg-timeout-s", type=float, default=30.0)
    ap.add_argument(
        "--ns-dtype", default="float32", choices=("float32", "bfloat16"), help="Muon's NS dtype"
    )
    ap.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=25.0,
        help="gradient bucket size of every data-parallel contender (DDP and DistributedMuon)",
    )
    ap.add_argument("--interface", default="eth0")
    ap.add_argument("--kill-rank", type=int, default=-1, help="this rank SIGKILLs itself ...")
    ap.add_argument("--kill-at-step", type=int, default=1, help="... inside this measured step")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    names = [n for n in a.contenders.split(",") if n]
    bad = [n for n in names if n not in CONTENDERS]
    if bad:
        ap.error(f"--contenders: unknown {bad}; choose from {list(CONTENDERS)}")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    rank = int(os.environ["RANK"])
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout_s))
        _run(a, names, rank)
    except Exception as exc:  # noqa: BLE001 - reported, then a non-zero exit
        print(
            f"[multihost_worker] rank {rank} failed: {type(exc).__name__}: {exc}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    dist.destroy_process_group()
    return 0


def _run(a, names, rank) -> None:
    from muonscale.distributed.comm import Communicator, WireCounter, counting_torch_collectives
    from muonscale.distributed.hosts import discover_host_map
    from muonscale.train.config import model_preset
    from muonscale.train.data import ByteTokenizer, TokenDataset, load_corpus

    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    host = int(os.environ["GROUP_RANK"])
    cfg = model_preset(
        "tiny",
        d_model=a.d_model,
        n_layer=a.n_layer,
        n_head=a.n_head,
        context_length=a.context_length,
    )
    data = TokenDataset.from_text(load_corpus(), ByteTokenizer(), context_length=cfg.context_length)
    per_rank = a.global_batch // world
    if per_rank < 1:
        raise ValueError(f"--global-batch {a.global_batch} is smaller than the world size {world}")
    hosts = discover_host_map(Communicator())
    muon, adamw = _configs(a)
    contenders = _build(
        names, muon, adamw, world_size=world, hosts=hosts, bucket_cap_mb=a.bucket_cap_mb
    )
    n_params = sum(p.numel() for p in contenders[0].model.parameters())
    muon_fraction = _muon_fraction(contenders)
    rows = []
    for c in contenders:
        torch_counter = WireCounter()
        step = 0

        digests = []  # after every warmup step, and after the measured steps

        def train(k, *, measured=False, c=c, torch_counter=torch_counter, digests=digests):
            nonlocal step
            for i in range(k):
                if measured and rank == a.kill_rank and i == a.kill_at_step:
                    # CLOCK_MONOTONIC is one clock for every process of the machine
                    (Path(a.out) / "killed_at").write_text(repr(time.monotonic()))
                    os.kill(os.getpid(), signal.SIGKILL)
                ((x, y),) = data.train_batch(seed=0, step=step, batch_size=a.global_batch)
                mine = slice(rank * per_rank, (rank + 1) * per_rank)
                with counting_torch_collectives(torch_counter, tag="fsdp2", host_of=hosts.host_of):
                    c.train_step([(x[mine], y[mine])])
                step += 1
                if not measured:
                    digests.append(_param_digest(c))

        train(a.warmup)
        torch_counter.reset()
        dist.barrier()
        t0, (tx0, rx0), (lo0, _) = time.perf_counter(), _if_bytes(a.interface), _if_bytes("lo")
        deferred = getattr(c.opt, "deferred", None)
        waited0 = deferred.total_wait_seconds if deferred is not None else 0.0
        with NewtonSchulzTimer() as ns_timer:
            train(a.steps, measured=True)
        waited = deferred.total_wait_seconds - waited0 if deferred is not None else None
        dist.barrier()
        t1, (tx1, rx1), (lo1, _) = time.perf_counter(), _if_bytes(a.interface), _if_bytes("lo")
        window = t1 - t0
        digests.append(_param_digest(c))
        dist.barrier()  # idle window of the same length: rendezvous keep-alive, barriers
        (ix0, irx0), (ilo0, _) = _if_bytes(a.interface), _if_bytes("lo")
        time.sleep(window)
        dist.barrier()
        (ix1, irx1), (ilo1, _) = _if_bytes(a.interface), _if_bytes("lo")
        counted = sum(c.wire[-a.steps :]) / a.steps
        torch_bytes = torch_counter.total / a.steps
        mine = {
            "host": host,
            "local_rank": local_rank,
            "counted_bytes_per_step": counted,
            "torch_collective_bytes_per_step": torch_bytes,
            "counted_links": _mean_links(c.links[-a.steps :]),
            "torch_collective_links": {k: v / a.steps for k, v in torch_counter.by_link().items()},
            "counted_breakdown": c.breakdown,
            "torch_breakdown": {k: v / a.steps for k, v in torch_counter.breakdown().items()},
            "step_s": sum(c.step_s[-a.steps :]) / a.steps,
            "opt_s": sum(c.opt_s[-a.steps :]) / a.steps,
            "ns_s": ns_timer.seconds / a.steps,
            "gather_wait_s": None if waited is None else waited / a.steps,
            "tx": tx1 - tx0,
            "rx": rx1 - rx0,
            "idle_tx": ix1 - ix0,
            "idle_rx": irx1 - irx0,
            "lo_tx": lo1 - lo0,
            "idle_lo_tx": ilo1 - ilo0,
            "window_s": window,
            "final_loss": c.losses[-1],
            "param_digests": digests,
        }
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        rows.append({"optimizer": c.name, "ranks": everyone})
        c.release()
    if local_rank == 0:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        result = {
            "host": host,
            "world_size": world,
            "n_params": n_params,
            "muon_fraction": muon_fraction,
            "steps": a.steps,
            "tokens_per_step": a.global_batch * cfg.context_length,
            "contenders": rows,
        }
        (out / f"host{host}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    code = main()
    # Exit without the interpreter's teardown: a rank whose gloo threads were destroyed there
    # aborted now and then ("terminate called without an active exception"), after its results
    # were written and the group destroyed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
