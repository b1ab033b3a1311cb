"""Multi-host data parallelism in network namespaces: bytes on the real interfaces against
``muonscale.distributed.comm``'s count, tokens/s on a constrained link, and failures.

    sudo .venv/bin/python benchmarks/multihost.py --out runs/multihost

Each configuration runs ``torchrun --nnodes H --nproc-per-node P`` (gloo) with every host's
ranks in its own network namespace (``benchmarks/netns_cluster.py``) and writes one row per
(optimizer, hosts, procs per host, link) to ``<out>/multihost.json``. Needs root and
``ip netns``.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from netns_cluster import Cluster, unavailable_reason  # noqa: E402

WORKER = Path(__file__).resolve().parent / "multihost_worker.py"
REPO = Path(__file__).resolve().parent.parent
NVIDIA_CLAIM = "Megatron-Core Muon: -8% network traffic in multi-node clusters (NVIDIA's claim)"


def _default_python() -> str:
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def run_config(a, hosts: int, procs: int, link: str, contenders: str) -> list[dict]:
    """One torchrun job; returns its rows (raises with the hosts' output when it fails)."""
    with tempfile.TemporaryDirectory(prefix="multihost-") as tmp, Cluster(hosts) as cluster:
        if link != "veth":
            cluster.shape(float(link.removesuffix("mbit")))
        args = [
            "--out", tmp, "--contenders", contenders, "--steps", str(a.steps),
            "--global-batch", str(a.global_batch), "--d-model", str(a.d_model),
            "--n-layer", str(a.n_layer), "--pg-timeout-s", str(a.pg_timeout_s),
        ]  # fmt: skip
        result = cluster.torchrun(
            WORKER, args, nproc_per_node=procs, python=a.python, timeout_s=a.timeout_s,
            env={"PYTHONPATH": str(REPO)},
        )  # fmt: skip
        if not result.ok:
            tail = "\n".join(o[-3000:] for o in result.outputs)
            raise RuntimeError(f"{hosts}x{procs} on {link}: rc {result.returncodes}\n{tail}")
        per_host = [json.loads((Path(tmp) / f"host{h}.json").read_text()) for h in range(hosts)]
    return _rows(per_host, hosts, procs, link)


def _rows(per_host: list[dict], hosts: int, procs: int, link: str) -> list[dict]:
    first = per_host[0]
    rows = []
    for entry in first["contenders"]:
        ranks = entry["ranks"]
        measured, counted = [], []
        for h in range(hosts):
            mine = [r for r in ranks if r["host"] == h]
            lead = next(r for r in mine if r["local_rank"] == 0)  # reads the host's link
            measured.append((lead["tx"] - lead["idle_tx"]) / first["steps"])
            counted.append(
                sum(r["counted_bytes_per_step"] + r["torch_collective_bytes_per_step"]
                    for r in mine)
            )  # fmt: skip
        m, c = sum(measured) / hosts, sum(counted) / hosts
        step_s = max(r["step_s"] for r in ranks)
        rows.append({
            "optimizer": entry["optimizer"],
            "hosts": hosts,
            "procs_per_host": procs,
            "link": link,
            "measured_tx_bytes_per_step_per_host": m,
            "measured_by_host": measured,
            "counted_bytes_per_step_per_host": c,
            "counted_by_comm_py": sum(r["counted_bytes_per_step"] for r in ranks) / hosts,
            "modelled_torch_collectives": sum(
                r["torch_collective_bytes_per_step"] for r in ranks) / hosts,
            "agreement_pct": 100.0 * (m / c - 1.0) if c else None,
            "step_s": step_s,
            "optimizer_step_s": max(r["opt_s"] for r in ranks),
            "tokens_per_s": first["tokens_per_step"] / step_s,
            "idle_tx_bytes_per_window": [r["idle_tx"] for r in ranks if r["local_rank"] == 0],
            "counted_breakdown_rank0": ranks[0]["counted_breakdown"],
            "torch_breakdown_rank0": ranks[0]["torch_breakdown"],
            "n_params": first["n_params"],
            "note": None if procs == 1 else
            "ranks of one host talk over loopback: counted bytes include traffic that never "
            "crosses the host's link",
        })  # fmt: skip
    by_name = {(r["optimizer"]): r for r in rows}
    ddp = by_name.get("adamw-ddp")
    for r in rows:
        if ddp:
            r["bytes_vs_ddp_adamw"] = (
                r["measured_tx_bytes_per_step_per_host"] / ddp["measured_tx_bytes_per_step_per_host"]
            )
            r["tokens_per_s_vs_ddp_adamw"] = r["tokens_per_s"] / ddp["tokens_per_s"]
        if "adamw-zero1" in by_name:
            r["tokens_per_s_vs_zero1_adamw"] = r["tokens_per_s"] / by_name["adamw-zero1"][
                "tokens_per_s"]  # fmt: skip
    return rows


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
                started["down"] = time.monotonic() - started["t"]

            threading.Thread(target=later, daemon=True).start()

    with tempfile.TemporaryDirectory(prefix="multihost-") as tmp, Cluster(2) as cluster:
        args = [
            "--out", tmp, "--contenders", "muon", "--steps", str(steps),
            "--global-batch", str(a.global_batch), "--d-model", str(a.d_model),
            "--n-layer", str(a.n_layer), "--pg-timeout-s", str(a.pg_timeout_s),
        ] + (["--kill-rank", "1"] if kind == "kill" else [])  # fmt: skip
        result = cluster.torchrun(
            WORKER, args, nproc_per_node=1, python=a.python, timeout_s=a.timeout_s,
            env={"PYTHONPATH": str(REPO)}, on_started=inject,
        )  # fmt: skip
    messages = [
        next((ln for ln in o.splitlines() if "[multihost_worker]" in ln or "killed after" in ln),
             o.strip().splitlines()[-1] if o.strip() else "")
        for o in result.outputs
    ]  # fmt: skip
    survivor_ok = result.returncodes[0] != 0 and "failed" in messages[0]
    return {
        "scenario": kind,
        "hosts": 2,
        "procs_per_host": 1,
        "pg_timeout_s": a.pg_timeout_s,
        "returncodes": result.returncodes,
        "exit_s": result.exit_s,
        "link_down_at_s": started.get("down"),
        "messages": messages,
        "outcome": "clean failure" if survivor_ok else "NOT a clean failure",
    }


def elastic_resume_scenario(a) -> dict:
    """torchrun --max-restarts resuming ``muonscale train --parallel`` from its last
    checkpoint; runs only once that entry point exists."""
    probe = subprocess.run(
        [a.python, "-m", "muonscale", "train", "--help"], capture_output=True, text=True,
        cwd=REPO, timeout=120,
    )  # fmt: skip
    if "--parallel" not in probe.stdout:
        return {"scenario": "elastic-resume", "outcome": "skipped",
                "reason": "muonscale train has no --parallel option yet"}  # fmt: skip
    return {"scenario": "elastic-resume", "outcome": "not implemented here yet"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--hosts", default="2,4")
    ap.add_argument("--procs", default="1,2", help="processes per host")
    ap.add_argument("--links", default="veth,100mbit",
                    help="veth (unshaped) or <rate>mbit (tbf on every host's egress); rates run "
                         "at 2 hosts x 1 process")  # fmt: skip
    ap.add_argument("--contenders",
                    default="muon,muon-bf16reduce,adamw-zero1,adamw-ddp,fsdp-muon")
    ap.add_argument("--faults", default="kill,link-down")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--pg-timeout-s", type=float, default=20.0)
    ap.add_argument("--link-down-after-s", type=float, default=15.0)
    ap.add_argument("--timeout-s", type=float, default=300.0, help="per torchrun job")
    ap.add_argument("--python", default=_default_python(),
                    help="interpreter with torch (default: the repo's .venv)")
    a = ap.parse_args(argv)
    reason = unavailable_reason()
    if reason:
        print(f"multihost: cannot run: {reason}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that namespaces are removed
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, faults, errors = [], [], []
    for link in a.links.split(","):
        shapes = [(h, p) for h in map(int, a.hosts.split(",")) for p in map(int, a.procs.split(","))]
        if link != "veth":
            shapes = [(2, 1)]
        for hosts, procs in shapes:
            start = time.monotonic()
            try:
                rows += run_config(a, hosts, procs, link, a.contenders)
            except RuntimeError as exc:  # recorded; the other configurations still run
                errors.append({"hosts": hosts, "procs_per_host": procs, "link": link,
                               "error": str(exc)[-4000:]})  # fmt: skip
                print(f"multihost: {exc}", file=sys.stderr, flush=True)
            print(f"multihost: {hosts} hosts x {procs} on {link}: "
                  f"{time.monotonic() - start:.0f} s", flush=True)  # fmt: skip
    for kind in filter(None, a.faults.split(",")):
        faults.append(run_fault(a, kind))
    faults.append(elastic_resume_scenario(a))
    report = {
        "machine": {"python": a.python, "torch_backend": "gloo"},
        "settings": {k: v for k, v in vars(a).items() if k != "out"},
        "nvidia_claim": NVIDIA_CLAIM,
        "rows": rows,
        "faults": faults,
        "errors": errors,
    }
    (out / "multihost.json").write_text(json.dumps(report, indent=1))
    for r in rows:
        print(f"{r['optimizer']:>16} {r['hosts']}x{r['procs_per_host']} {r['link']:>8}: "
              f"measured {r['measured_tx_bytes_per_step_per_host'] / 1e6:7.2f} MB, counted "
              f"{r['counted_bytes_per_step_per_host'] / 1e6:7.2f} MB "
              f"({r['agreement_pct']:+.1f}%), {r['tokens_per_s']:8.0f} tok/s")  # fmt: skip
    for f in faults:
        print(f"fault {f['scenario']}: {f['outcome']} {f.get('exit_s', '')}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
