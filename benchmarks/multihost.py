"""Multi-host data parallelism in network namespaces: bytes on the real interfaces against
``muonscale.distributed.comm``'s count, tokens/s on a constrained link, and failures.

    sudo .venv/bin/python benchmarks/multihost.py --out runs/multihost [--quick | --full]

Presets (``PRESETS``; any flag given overrides its preset value): ``--quick`` serves
``tests/test_multihost.py`` (2 x 1 on veth, small); the default finishes within 20 minutes on a
2-core machine: 2 x 1 on veth and on a link shaped to DDP AdamW's own pace (``auto``: the rate
at which it spends about half its step communicating, from the median of its veth runs and
one probe run of it alone, :func:`auto_rate_mbit`), 3 interleaved repeats, medians;
``--full`` adds 4 x 1 and 2 x 2 on both links and the faults. Tokens per step are chosen per
rank (``--tokens-per-rank``) so that Newton–Schulz stays a small part of Muon's compute, and
gradient buckets (``--bucket-cap-mb``, the same for DDP and DistributedMuon) so that the 13 MB
model has several, as a 25 MB cap gives the models users train (one bucket would hold the whole
model, and no reduction could start before backward ends); the run prints that share (Newton–Schulz
seconds summed over ranks over forward + backward + Newton–Schulz seconds, on veth), DDP
AdamW's communication share on the shaped link, and its own wall time.

Each configuration runs ``torchrun --nnodes H --nproc-per-node P`` (gloo) with every host's
ranks in its own network namespace (``benchmarks/netns_cluster.py``) and writes one row per
(optimizer, hosts, procs per host, link) to ``<out>/multihost.json``. Needs root and
``ip netns``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from netns_cluster import Cluster, unavailable_reason  # noqa: E402

WORKER = Path(__file__).resolve().parent / "multihost_worker.py"
REPO = Path(__file__).resolve().parent.parent
SEED_ARTICLE_CLAIM = (
    "-8% network traffic for Muon in multi-node clusters: the seed article's figure, which it "
    "attributes to NVIDIA (Megatron-Core); NVIDIA's own published material does not state it"
)


def lower_bound_bytes(hosts: int, muon_fraction: float, param_bytes: float) -> float:
    """Host-aware lower bound on the bytes a host sends over its link per step for Muon data
    parallelism: a reduce-scatter of the fp32 gradients and a gather of the updates, Muon's in
    bf16, each crossing the host boundary once: (H-1)/H * (2 - f/2) * S."""
    return (hosts - 1) / hosts * (2 - muon_fraction / 2) * param_bytes


def _default_python() -> str:
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def global_batch(a, world: int) -> int:
    """Sequences per step: ``--global-batch``, or ``--tokens-per-rank`` on every rank."""
    if a.tokens_per_rank:
        return max(1, a.tokens_per_rank // a.context_length) * world
    return a.global_batch


def run_config(a, hosts: int, procs: int, link: str, contenders: str) -> list[dict]:
    """One torchrun job; returns its rows (raises with the hosts' output when it fails)."""
    with tempfile.TemporaryDirectory(prefix="multihost-") as tmp, Cluster(hosts) as cluster:
        if link != "veth":
            cluster.shape(float(link.removesuffix("mbit")))
        args = [
            "--out",
            tmp,
            "--contenders",
            contenders,
            "--steps",
            str(a.steps),
            "--warmup",
            str(a.warmup),
            "--global-batch",
            str(global_batch(a, hosts * procs)),
            "--context-length",
            str(a.context_length),
            "--d-model",
            str(a.d_model),
            "--n-layer",
            str(a.n_layer),
            "--pg-timeout-s",
            str(a.pg_timeout_s),
            "--ns-dtype",
            a.ns_dtype,
            "--bucket-cap-mb",
            str(a.bucket_cap_mb),
        ]
        result = cluster.torchrun(
            WORKER,
            args,
            nproc_per_node=procs,
            python=a.python,
            timeout_s=a.timeout_s,
            env={"PYTHONPATH": str(REPO)},
        )
        if not result.ok:
            tail = "\n".join(o[-3000:] for o in result.outputs)
            raise RuntimeError(f"{hosts}x{procs} on {link}: rc {result.returncodes}\n{tail}")
        per_host = [json.loads((Path(tmp) / f"host{h}.json").read_text()) for h in range(hosts)]
    return _rows(per_host, hosts, procs, link)


def _rows(per_host: list[dict], hosts: int, procs: int, link: str) -> list[dict]:
    first = per_host[0]
    rows = []
    steps = first["steps"]
    bound = None
    if first.get("muon_fraction") is not None:
        bound = lower_bound_bytes(hosts, first["muon_fraction"], 4 * first["n_params"])
    for entry in first["contenders"]:
        ranks = entry["ranks"]
        measured, counted, measured_lo, counted_lo = [], [], [], []
        for h in range(hosts):
            mine = [r for r in ranks if r["host"] == h]
            lead = next(r for r in mine if r["local_rank"] == 0)  # reads the host's link
            measured.append((lead["tx"] - lead["idle_tx"]) / steps)
            measured_lo.append((lead["lo_tx"] - lead["idle_lo_tx"]) / steps)
            for out, key in ((counted, "inter_host"), (counted_lo, "intra_host")):
                out.append(
                    sum(r["counted_links"][key] + r["torch_collective_links"][key] for r in mine)
                )
        m, c = sum(measured) / hosts, sum(counted) / hosts
        m_lo, c_lo = sum(measured_lo) / hosts, sum(counted_lo) / hosts
        step_s = max(r["step_s"] for r in ranks)
        ns = [r.get("ns_s") or 0.0 for r in ranks]
        fwd_bwd = [r["step_s"] - r["opt_s"] for r in ranks]
        digests = [r.get("param_digests") for r in ranks]
        replicas = None  # FSDP2 shards: not replicas
        if digests[0] and all(d is not None for run in digests for d in run):
            replicas = all(run == digests[0] for run in digests)
        rows.append(
            {
                "optimizer": entry["optimizer"],
                "hosts": hosts,
                "procs_per_host": procs,
                "link": link,
                "measured_tx_bytes_per_step_per_host": m,
                "measured_by_host": measured,
                "counted_bytes_per_step_per_host": c,
                "counted_by_comm_py": sum(r["counted_bytes_per_step"] for r in ranks) / hosts,
                "modelled_torch_collectives": sum(
                    r["torch_collective_bytes_per_step"] for r in ranks
                )
                / hosts,
                "agreement_pct": 100.0 * (m / c - 1.0) if c else None,
                "measured_intra_host_bytes_per_step_per_host": m_lo,
                "counted_intra_host_bytes_per_step_per_host": c_lo,
                "intra_host_agreement_pct": 100.0 * (m_lo / c_lo - 1.0) if c_lo else None,
                "lower_bound_bytes_per_step_per_host": bound,
                "replicas_bitwise_identical": replicas,
                "vs_lower_bound": m / bound if bound else None,
                "step_s": step_s,
                "optimizer_step_s": max(r["opt_s"] for r in ranks),
                "ns_share": sum(ns) / (sum(fwd_bwd) + sum(ns)) if any(ns) else None,
                # seconds per step the forward waited for the previous step's deferred gathers
                "gather_wait_s": max((r.get("gather_wait_s") or 0.0) for r in ranks),
                "tokens_per_s": first["tokens_per_step"] / step_s,
                "idle_tx_bytes_per_window": [r["idle_tx"] for r in ranks if r["local_rank"] == 0],
                "counted_breakdown_rank0": ranks[0]["counted_breakdown"],
                "torch_breakdown_rank0": ranks[0]["torch_breakdown"],
                "n_params": first["n_params"],
                "note": "inter-host: the host's link (eth0); intra-host: its loopback (lo)",
            }
        )
    by_name = {(r["optimizer"]): r for r in rows}
    ddp = by_name.get("adamw-ddp")
    for r in rows:
        if ddp:
            r["bytes_vs_ddp_adamw"] = (
                r["measured_tx_bytes_per_step_per_host"]
                / ddp["measured_tx_bytes_per_step_per_host"]
            )
            r["tokens_per_s_vs_ddp_adamw"] = r["tokens_per_s"] / ddp["tokens_per_s"]
        if "adamw-zero1" in by_name:
            r["tokens_per_s_vs_zero1_adamw"] = (
                r["tokens_per_s"] / by_name["adamw-zero1"]["tokens_per_s"]
            )
    return rows


def _split_compute_and_comm(rows: list[dict]) -> None:
    """On a shaped link: compute = the same contender's step on the unshaped veth link at the
    same shape, communication = the rest of the step, both measured (veth's own transfer time
    counts as compute here, so the communication share is a lower bound)."""
    veth = {
        (r["optimizer"], r["hosts"], r["procs_per_host"]): r for r in rows if r["link"] == "veth"
    }
    for r in rows:
        base = veth.get((r["optimizer"], r["hosts"], r["procs_per_host"]))
        if r["link"] != "veth" and base is not None:
            r["compute_s"] = base["step_s"]
            r["comm_s"] = r["step_s"] - base["step_s"]
            r["comm_fraction"] = r["comm_s"] / r["step_s"]


def run_fault(a, kind: str) -> dict:
    """2 hosts x 1 process; ``kill``: rank 1 SIGKILLs itself mid-step; ``link-down``: host
    1's link goes down while training. Records every host's exit code, time and message."""
    steps = 10_000 if kind == "link-down" else a.steps
    started = {}

    def inject(cluster, procs):
        started["t"] = time.monotonic()
        if kind == "link-down":

            def later():
                time.sleep(a.link_down_after_s)
                cluster.link_down(1)
                started["down_at"] = time.monotonic()
                started["down"] = started["down_at"] - started["t"]

            threading.Thread(target=later, daemon=True).start()

    with tempfile.TemporaryDirectory(prefix="multihost-") as tmp, Cluster(2) as cluster:
        args = [
            "--out",
            tmp,
            "--contenders",
            "muon",
            "--steps",
            str(steps),
            "--global-batch",
            str(a.global_batch),
            "--d-model",
            str(a.d_model),
            "--n-layer",
            str(a.n_layer),
            "--pg-timeout-s",
            str(a.pg_timeout_s),
        ] + (["--kill-rank", "1"] if kind == "kill" else [])
        result = cluster.torchrun(
            WORKER,
            args,
            nproc_per_node=1,
            python=a.python,
            timeout_s=a.timeout_s,
            env={"PYTHONPATH": str(REPO)},
            on_started=inject,
        )
        killed_at = Path(tmp, "killed_at")
        if killed_at.exists():  # written by the rank just before it SIGKILLs itself
            started["killed_at"] = float(killed_at.read_text())
    messages = [
        next(
            (ln for ln in o.splitlines() if "[multihost_worker]" in ln or "killed after" in ln),
            o.strip().splitlines()[-1] if o.strip() else "",
        )
        for o in result.outputs
    ]
    survivor_ok = result.returncodes[0] != 0 and "failed" in messages[0]
    return {
        "scenario": kind,
        "hosts": 2,
        "procs_per_host": 1,
        "pg_timeout_s": a.pg_timeout_s,
        "returncodes": result.returncodes,
        "exit_s": result.exit_s,
        "exit_s_after_fault": _after_fault(result, started),
        "link_down_at_s": started.get("down"),
        "messages": messages,
        "outcome": "clean failure" if survivor_ok else "NOT a clean failure",
    }


ELASTIC_STEPS = 24
ELASTIC_CHECKPOINT_EVERY = 4
ELASTIC_KILL_AFTER_CHECKPOINT = 8
ELASTIC_TRAIN = [
    "--parallel",
    "dp",
    "--n-layer",
    "2",
    "--d-model",
    "128",
    "--n-head",
    "4",
    "--context-length",
    "64",
    "--micro-batch-size",
    "8",
    "--tokens-per-step",
    str(2 * 8 * 64),
    "--schedule",
    "constant",
    "--warmup-steps",
    "1",
    "--eval-every",
    "0",
    "--log-every",
    "1",
    "--no-progress",
    "--resume",
    "auto",
]
# As tests/test_train_torchrun.py: each gradient entry sums n = tokens-per-step contributions
# whose order differs between world sizes (relative rounding <= n * eps32 per step), and the
# differences add over the steps run after the resume.
ELASTIC_RTOL = ELASTIC_STEPS * (2 * 8 * 64) * 2.0**-23


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(c) for c in text.split()]


def _latest_step(out_dir: Path) -> int:
    try:
        return json.loads((out_dir / "checkpoints" / "latest").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return 0


def _train_on(a, hosts: int, out_dir: Path, steps: int, *, max_restarts=0, on_started=None):
    args = [
        "muonscale",
        "train",
        *ELASTIC_TRAIN,
        "--steps",
        str(steps),
        "--checkpoint-every",
        str(ELASTIC_CHECKPOINT_EVERY),
        "--pg-timeout-s",
        str(a.pg_timeout_s),
        "--out-dir",
        str(out_dir),
    ]
    with Cluster(hosts) as cluster:
        return cluster.torchrun(
            "-m",
            args,
            nproc_per_node=1,
            python=a.python,
            timeout_s=a.timeout_s,
            env={"PYTHONPATH": str(REPO)},
            on_started=on_started,
            max_restarts=max_restarts,
            cwd=REPO,
        )


def _metrics(out_dir: Path) -> tuple[dict[int, float], list[int]]:
    """(step -> last logged loss, start steps) of ``out_dir/metrics.jsonl``."""
    losses, starts = {}, []
    for line in (out_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["event"] == "train":
            losses[record["step"]] = record["loss"]
        elif record["event"] == "start":
            starts.append(record["step"])
    return losses, starts


def _final_state(out_dir: Path) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root = out_dir / "checkpoints"
    folder = json.loads((root / "latest").read_text())["folder"]
    dcp_to_torch_save(str(root / folder), str(out_dir / "final.pt"))
    return torch.load(out_dir / "final.pt", weights_only=False)


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, f"{prefix}/{key}")
    elif isinstance(tree, list | tuple):
        for index, value in enumerate(tree):
            yield from _leaves(value, f"{prefix}/{index}")
    else:
        yield prefix, tree


def _compare(got: dict, want: dict) -> tuple[bool, float]:
    """(bitwise equal, max relative difference of a float tensor to its largest entry)."""
    import torch

    got, want = dict(_leaves(got)), dict(_leaves(want))
    if got.keys() != want.keys():
        return False, float("inf")
    bitwise, worst = True, 0.0
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            bitwise &= torch.equal(got[key], value)
            if value.is_floating_point() and value.numel():
                scale = value.abs().max().item() or 1.0
                worst = max(worst, (got[key] - value).abs().max().item() / scale)
        else:
            bitwise &= got[key] == value
    return bitwise, worst


def _after_fault(result, started: dict) -> list[float] | None:
    """Seconds from the fault (the SIGKILL, the link going down) to each host's exit."""
    if "killed_at" in started:
        return [t - started["killed_at"] for t in result.exit_at]
    if "down_at" in started:
        return [t - started["down_at"] for t in result.exit_at]
    return None


def elastic_resume_scenario(a) -> dict:
    """``muonscale train --parallel dp`` under ``torchrun --max-restarts 1`` on 2 hosts; one
    rank is SIGKILLed once a checkpoint at step >= 8 exists. The restarted run must end
    bitwise equal to an uninterrupted 2-host run; the 2-host checkpoint of half the run,
    resumed on 1 host, within ``ELASTIC_RTOL``. Records each outcome and the times to exit."""
    row = {
        "scenario": "elastic-resume",
        "hosts": 2,
        "procs_per_host": 1,
        "pg_timeout_s": a.pg_timeout_s,
        "steps": ELASTIC_STEPS,
        "checkpoint_every": ELASTIC_CHECKPOINT_EVERY,
    }
    with tempfile.TemporaryDirectory(prefix="multihost-elastic-") as tmp:
        ref, killed, half = Path(tmp, "uninterrupted"), Path(tmp, "killed"), Path(tmp, "half")
        t0 = time.monotonic()
        done = _train_on(a, 2, ref, ELASTIC_STEPS)
        row["uninterrupted_s"] = time.monotonic() - t0
        if not done.ok:
            return {
                **row,
                "outcome": "uninterrupted run failed",
                "messages": [o[-2000:] for o in done.outputs],
            }
        kill = {}

        def killer(cluster, procs):
            def watch():
                deadline = time.monotonic() + a.timeout_s
                while time.monotonic() < deadline and procs[1].poll() is None:
                    step = _latest_step(killed)
                    ranks = _children(procs[1].pid)
                    if step >= ELASTIC_KILL_AFTER_CHECKPOINT and ranks:
                        os.kill(ranks[0], signal.SIGKILL)
                        kill.update(t=time.monotonic(), checkpoint_step=step)
                        return
                    time.sleep(0.02)

            threading.Thread(target=watch, daemon=True).start()

        t0 = time.monotonic()
        done = _train_on(a, 2, killed, ELASTIC_STEPS, max_restarts=1, on_started=killer)
        row["killed_run_s"] = time.monotonic() - t0
        row["returncodes"] = done.returncodes
        if "t" not in kill:
            return {**row, "outcome": "kill missed (the run ended first)"}
        row["checkpoint_step_at_kill"] = kill["checkpoint_step"]
        row["exit_s_after_kill"] = [t0 + e - kill["t"] for e in done.exit_s]
        if not done.ok:
            return {
                **row,
                "outcome": "restart failed",
                "messages": [o[-2000:] for o in done.outputs],
            }
        losses, starts = _metrics(killed)
        ref_losses, _ = _metrics(ref)
        bitwise, worst = _compare(_final_state(killed), _final_state(ref))
        row.update(
            starts=starts,
            same_losses=losses == ref_losses,
            bitwise_state=bitwise,
            max_relative_state_difference=worst,
        )
        # a smaller world: half the run on 2 hosts, the rest resumed on 1
        done = _train_on(a, 2, half, ELASTIC_STEPS // 2)
        if done.ok:
            done = _train_on(a, 1, half, ELASTIC_STEPS)
        if not done.ok:
            row["smaller_world"] = {
                "outcome": "failed",
                "messages": [o[-2000:] for o in done.outputs],
            }
        else:
            losses, starts = _metrics(half)
            loss_diff = max(abs(losses[s] - ref_losses[s]) / abs(ref_losses[s]) for s in losses)
            bit, state_diff = _compare(_final_state(half), _final_state(ref))
            within = loss_diff <= ELASTIC_RTOL and state_diff <= ELASTIC_RTOL
            row["smaller_world"] = {
                "hosts": "2 -> 1",
                "starts": starts,
                "max_relative_loss_difference": loss_diff,
                "max_relative_state_difference": state_diff,
                "rtol": ELASTIC_RTOL,
                "bitwise_state": bit,
                "outcome": "within tolerance" if within else "OUTSIDE",
            }
    same = row["same_losses"] and row["bitwise_state"] and len(row["starts"]) == 2
    row["outcome"] = "resumed bitwise" if same else "resumed, NOT equal"
    return row


TIMED = "adamw-ddp,muon,muon-defer,muon-bf16reduce-defer"
DEFAULT_PRESET = dict(
    hosts="2",
    shapes="2x1",
    links="veth,auto",
    contenders=TIMED,
    faults="",
    steps=3,
    warmup=1,
    tokens_per_rank=4096,
    d_model=256,
    repeats=3,
    timeout_s=600.0,
    bucket_cap_mb=2.0,  # about seven buckets of the model's 13 MB of fp32 gradients
)
PRESETS = {
    "quick": {
        **DEFAULT_PRESET,
        "links": "veth",
        "contenders": "muon,muon-bf16reduce,adamw-zero1,adamw-ddp",
        "steps": 2,
        "warmup": 2,
        "tokens_per_rank": 0,
        "d_model": 128,
        "repeats": 1,
        "timeout_s": 300.0,
    },
    "default": DEFAULT_PRESET,
    "full": {
        **DEFAULT_PRESET,
        "hosts": "2,4",
        "shapes": "2x1,4x1,2x2",
        "contenders": TIMED + ",muon-bf16reduce,adamw-zero1,muon-nooverlap",
        "faults": "kill,link-down,elastic",
        "timeout_s": 900.0,
    },
}


def _veth_ddp(rows: list[dict]) -> dict:
    """DDP AdamW's median veth run at 2 x 1 (``StopIteration`` without one)."""
    ddp = [
        r
        for r in rows
        if r["optimizer"] == "adamw-ddp"
        and r["link"] == "veth"
        and (r["hosts"], r["procs_per_host"]) == (2, 1)
    ]
    if not ddp:
        raise StopIteration
    return sorted(ddp, key=lambda r: r["step_s"])[(len(ddp) - 1) // 2]


def probe_rate_mbit(rows: list[dict]) -> float:
    """The rate at which DDP AdamW's all-reduce at 2 x 1 takes as long as its median veth step:
    its inter-host bytes per step over that step's time."""
    veth = _veth_ddp(rows)
    return veth["measured_tx_bytes_per_step_per_host"] * 8 / 1e6 / veth["step_s"]


def auto_rate_mbit(rows: list[dict], probe: dict) -> float:
    """The rate at which DDP AdamW spends about half its 2 x 1 step communicating, from its
    ``probe`` run at :func:`probe_rate_mbit`: there its all-reduce took one veth step T and
    it waited c = (probe step − T) for it, so backward hid h = T − c. Half the step is
    communication when the wait is T, i.e. when the all-reduce takes T + h = 2T − c."""
    veth = _veth_ddp(rows)
    step, waited = veth["step_s"], probe["step_s"] - veth["step_s"]
    seconds = max(step, 2 * step - max(0.0, waited))  # at most the probe rate
    return veth["measured_tx_bytes_per_step_per_host"] * 8 / 1e6 / seconds


def medians(rows: list[dict]) -> list[dict]:
    """One row per (optimizer, hosts, procs, link): the run with the median tokens/s, with
    every run's tokens/s beside it and the ratios to DDP AdamW's median recomputed."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r["optimizer"], r["hosts"], r["procs_per_host"], r["link"])
        groups.setdefault(key, []).append(r)
    out = []
    for runs in groups.values():
        ranked = sorted(runs, key=lambda r: r["tokens_per_s"])
        row = dict(ranked[(len(ranked) - 1) // 2])  # the lower median of an even count
        row["runs_tokens_per_s"] = [r["tokens_per_s"] for r in runs]
        out.append(row)
    ddp = {
        (r["hosts"], r["procs_per_host"], r["link"]): r
        for r in out
        if r["optimizer"] == "adamw-ddp"
    }
    for r in out:
        base = ddp.get((r["hosts"], r["procs_per_host"], r["link"]))
        if base is not None:
            r["tokens_per_s_vs_ddp_adamw"] = r["tokens_per_s"] / base["tokens_per_s"]
    return out


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"2x1,4x1,2x2"`` as (hosts, processes per host) pairs (empty entries skipped);
    ``ValueError`` saying the form."""
    shapes = []
    for entry in filter(None, text.split(",")):
        hosts, _, procs = entry.partition("x")
        if not (hosts.isdigit() and procs.isdigit() and int(hosts) > 0 and int(procs) > 0):
            raise ValueError(
                f"expected HxP[,HxP...] (H hosts, P processes per host, positive integers, "
                f"e.g. 2x1,4x1,2x2); {entry!r} is not"
            )
        shapes.append((int(hosts), int(procs)))
    return shapes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", dest="preset", action="store_const", const="quick")
    ap.add_argument("--full", dest="preset", action="store_const", const="full")
    ap.set_defaults(preset="default")
    ap.add_argument("--hosts", default=None, help="host counts (with --procs: every shape)")
    ap.add_argument("--procs", default=None, help="processes per host")
    ap.add_argument("--shapes", default=None, help="HxP list, e.g. 2x1,4x1,2x2")
    ap.add_argument(
        "--links",
        default=None,
        help="veth (unshaped), <rate>mbit (tbf on every host's egress) or auto (where DDP "
        "AdamW at 2 x 1 spends about half its step communicating; after veth)",
    )
    ap.add_argument("--contenders", default=None)
    ap.add_argument(
        "--faults",
        default=None,
        help="kill, link-down, elastic (SIGKILL + torchrun restart + resume)",
    )
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None, help="interleaved runs; medians")
    ap.add_argument(
        "--tokens-per-rank",
        type=int,
        default=None,
        help="tokens per rank per step (0: --global-batch sequences per step)",
    )
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--context-length", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=None)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--pg-timeout-s", type=float, default=20.0)
    ap.add_argument("--link-down-after-s", type=float, default=15.0)
    ap.add_argument(
        "--ns-dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="Newton-Schulz dtype of the Muon contenders",
    )
    ap.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="gradient bucket size of every data-parallel contender, DDP's and "
        "DistributedMuon's (default preset: 2)",
    )
    ap.add_argument("--timeout-s", type=float, default=None, help="per torchrun job")
    ap.add_argument(
        "--python",
        default=_default_python(),
        help="interpreter with torch (default: the repo's .venv)",
    )
    a = ap.parse_args(argv)
    for key, value in PRESETS[a.preset].items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.procs is not None:  # --hosts x --procs, as before the shapes
        a.shapes = ",".join(f"{h}x{p}" for h in a.hosts.split(",") for p in a.procs.split(","))
    try:
        shapes = parse_shapes(a.shapes)
    except ValueError as error:
        flag = "--shapes" if a.procs is None else "--hosts/--procs"
        ap.error(f"{flag} {a.shapes!r}: {error}")
    wall_start = time.monotonic()
    reason = unavailable_reason()
    if reason:
        print(f"multihost: cannot run: {reason}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that namespaces are removed
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, faults, errors = [], [], []
    names = [n for n in a.contenders.split(",") if n]
    links = a.links.split(",") if names else []
    for link in links:  # every repeat of one link, so that auto sees all the veth runs
        if link == "auto":
            try:
                probe_link = f"{probe_rate_mbit(rows):.0f}mbit"
                (probe,) = run_config(a, 2, 1, probe_link, "adamw-ddp")
                link = f"{auto_rate_mbit(rows, probe):.0f}mbit"
            except StopIteration:
                errors.append({"link": "auto", "error": "no adamw-ddp 2x1 veth row"})
                continue
            except RuntimeError as exc:
                errors.append({"link": "auto", "error": f"probe run: {str(exc)[-2000:]}"})
                continue
            a.auto_link = link
            a.auto_probe = {"link": probe_link, "step_s": probe["step_s"]}
            print(f"multihost: auto rate {link} (DDP AdamW's probe at {probe_link})", flush=True)
        for repeat in range(a.repeats):
            turn = repeat % max(1, len(names))
            order = names[turn:] + names[:turn]  # interleaved: each repeat starts elsewhere
            for hosts, procs in shapes:
                start = time.monotonic()
                try:
                    for r in run_config(a, hosts, procs, link, ",".join(order)):
                        rows.append({**r, "repeat": repeat})
                except RuntimeError as exc:  # recorded; the other configurations still run
                    errors.append(
                        {
                            "hosts": hosts,
                            "procs_per_host": procs,
                            "link": link,
                            "error": str(exc)[-4000:],
                        }
                    )
                    print(f"multihost: {exc}", file=sys.stderr, flush=True)
                print(
                    f"multihost: repeat {repeat}, {hosts} hosts x {procs} on {link}: "
                    f"{time.monotonic() - start:.0f} s",
                    flush=True,
                )
    runs = rows
    rows = medians(rows) if a.repeats > 1 else rows
    _split_compute_and_comm(rows)
    for kind in filter(None, a.faults.split(",")):
        faults.append(elastic_resume_scenario(a) if kind == "elastic" else run_fault(a, kind))
    report = {
        "machine": {"python": a.python, "torch_backend": "gloo"},
        "settings": {k: v for k, v in vars(a).items() if k != "out"},
        "seed_article_claim": SEED_ARTICLE_CLAIM,
        "rows": rows,
        "runs": runs,
        "faults": faults,
        "errors": errors,
    }
    report["wall_s"] = time.monotonic() - wall_start
    (out / "multihost.json").write_text(json.dumps(report, indent=1))
    print(f"seed article: {SEED_ARTICLE_CLAIM}")
    for r in rows:
        intra = r["intra_host_agreement_pct"]
        bound = r["lower_bound_bytes_per_step_per_host"]
        vs_ddp = r.get("bytes_vs_ddp_adamw", float("nan"))
        print(
            f"{r['optimizer']:>16} {r['hosts']}x{r['procs_per_host']} {r['link']:>8}: "
            f"inter-host measured {r['measured_tx_bytes_per_step_per_host'] / 1e6:7.2f} MB, "
            f"counted {r['counted_bytes_per_step_per_host'] / 1e6:7.2f} MB "
            f"({r['agreement_pct']:+.1f}%), vs DDP {vs_ddp:.2f}x; "
            f"lower bound {bound / 1e6 if bound else float('nan'):7.2f} MB; intra-host "
            f"measured {r['measured_intra_host_bytes_per_step_per_host'] / 1e6:7.2f} MB, "
            f"counted {r['counted_intra_host_bytes_per_step_per_host'] / 1e6:7.2f} MB"
            + (f" ({intra:+.1f}%)" if intra is not None else "")
            + f"; {r['tokens_per_s']:8.0f} tok/s"
        )
    print_speed_table(rows)
    for f in faults:
        print(
            f"fault {f['scenario']}: {f['outcome']}, exit after the fault "
            f"{f.get('exit_s_after_fault') or f.get('exit_s_after_kill')} s"
        )
    print(f"multihost: wall time {report['wall_s']:.0f} s ({a.preset} preset)")
    return 1 if errors else 0


def print_speed_table(rows: list[dict]) -> None:
    """tokens/s against DDP AdamW per shape and link; the Newton–Schulz share on veth and
    DDP AdamW's communication share on shaped links."""
    print("optimizer, hosts x procs, link: tokens/s (runs), vs DDP AdamW, NS share, comm share")
    for r in sorted(rows, key=lambda r: (r["link"], r["hosts"], r["procs_per_host"])):
        runs = r.get("runs_tokens_per_s", [r["tokens_per_s"]])
        share = r.get("ns_share")
        comm = r.get("comm_fraction")
        print(
            f"{r['optimizer']:>22} {r['hosts']}x{r['procs_per_host']} {r['link']:>8}: "
            f"{r['tokens_per_s']:8.0f} tok/s ({', '.join(f'{t:.0f}' for t in runs)}), "
            f"{r.get('tokens_per_s_vs_ddp_adamw', float('nan')):.2f}x DDP"
            + (f", NS {100 * share:.1f}% of compute" if share else "")
            + (f", communicating {100 * comm:.0f}% of the step" if comm is not None else "")
        )


if __name__ == "__main__":
    sys.exit(main())
