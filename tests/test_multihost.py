"""benchmarks/multihost.py at a small size: 2 hosts (network namespaces) x 1 process, bytes
on the hosts' veth links against comm.py's count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from netns_cluster import unavailable_reason  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def _run_bytes(tmp_path, procs: int, contenders: str, ns_dtype: str = "float32") -> dict[str, dict]:
    reason = unavailable_reason()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must be able to make network namespaces: {reason}")
        pytest.skip(reason)
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "multihost.py"),
        "--quick",
        "--out",
        str(tmp_path),
        "--hosts",
        "2",
        "--procs",
        str(procs),
        "--links",
        "veth",
        "--faults",
        "",
        "--steps",
        "2",
        "--d-model",
        "128",
        "--contenders",
        contenders,
        "--ns-dtype",
        ns_dtype,
        "--timeout-s",
        "150",
        "--python",
        sys.executable,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "multihost.json").read_text())["rows"]
    return {r["optimizer"]: r for r in rows}


# TCP retransmissions on a loaded machine add a few percent to the measured side once in a
# while (seen once in a full suite, 1.9% over DDP; 0 in 4 runs alone): one rerun measures again
@pytest.mark.flaky(reruns=1)
def test_bytes_on_veth_match_the_count(tmp_path):
    rows = _run_bytes(tmp_path, 1, "muon,muon-bf16reduce,adamw-zero1,adamw-ddp")
    assert set(rows) == {"muon", "muon-bf16reduce", "adamw-zero1", "adamw-ddp"}
    for name, r in rows.items():
        # headers of GSO-sized TCP segments, ACKs and the barrier closing the window: ~0.2-0.5%
        # measured; 5% is the bound the count has to meet
        assert abs(r["agreement_pct"]) <= 5.0, (name, r["agreement_pct"])
    ddp = rows["adamw-ddp"]["measured_tx_bytes_per_step_per_host"]
    # Muon at fp32 counts DDP's gradient bytes plus a few hundred bytes of control traffic
    # (1.00x to two decimals); measured, allow the 1% of TCP noise that separates two
    # measurements of the same traffic; bf16 halves the gradient part of the bytes
    counted = rows["muon"]["counted_bytes_per_step_per_host"]
    assert round(counted / rows["adamw-ddp"]["counted_bytes_per_step_per_host"], 2) <= 1.00
    assert rows["muon"]["measured_tx_bytes_per_step_per_host"] <= 1.01 * ddp
    assert rows["muon-bf16reduce"]["measured_tx_bytes_per_step_per_host"] <= 0.92 * ddp


def test_two_hosts_of_two_ranks_cross_each_link_once(tmp_path):
    # bf16 Newton-Schulz: DistributedMuon gathers the owners' bf16 updates
    rows = _run_bytes(tmp_path, 2, "muon,adamw-ddp", ns_dtype="bfloat16")
    for name, r in rows.items():
        # the host's link (eth0) and its loopback (lo), each against its own count
        assert abs(r["agreement_pct"]) <= 5.0, (name, r["agreement_pct"])
        assert abs(r["intra_host_agreement_pct"]) <= 5.0, (name, r["intra_host_agreement_pct"])
    # DDP's ring all-reduce: 2 (N-1)/N S = 1.5 S per host at N = 4; the two-level
    # reduce-scatter of fp32 gradients and gather of the updates (Muon's in bf16):
    # (H-1)/H (2 - f/2) S, plus a few hundred bytes of control traffic, and the 5% the count
    # must meet on top
    muon = rows["muon"]
    measured = muon["measured_tx_bytes_per_step_per_host"]
    assert measured <= 1.05 * muon["lower_bound_bytes_per_step_per_host"], muon
    assert measured < 2 / 3 * rows["adamw-ddp"]["measured_tx_bytes_per_step_per_host"]
    # the same weights on every rank after every step, though every rank applies the updates
    assert muon["replicas_bitwise_identical"] is True


def _run_faults(tmp_path, faults: str, timeout_s: int) -> list[dict]:
    reason = unavailable_reason()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must be able to make network namespaces: {reason}")
        pytest.skip(reason)
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "multihost.py"),
        "--quick",
        "--out",
        str(tmp_path),
        "--contenders",
        "",
        "--faults",
        faults,
        "--d-model",
        "128",
        "--pg-timeout-s",
        "20",
        "--timeout-s",
        "150",
        "--python",
        sys.executable,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp_path / "multihost.json").read_text())["faults"]


def test_a_killed_rank_makes_the_other_host_exit_within_the_timeout(tmp_path):
    (kill,) = _run_faults(tmp_path, "kill", 200)
    assert kill["outcome"] == "clean failure", kill
    # measured from the SIGKILL itself: the survivor sees the closed connection (or at worst
    # waits the process-group timeout), then torchrun tears down
    assert all(0 <= s <= kill["pg_timeout_s"] + 10 for s in kill["exit_s_after_fault"]), kill


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_elastic_restart_across_hosts_resumes_bitwise(tmp_path):
    (elastic,) = _run_faults(tmp_path, "elastic", 850)
    assert elastic["outcome"] == "resumed bitwise", elastic
    assert elastic["starts"][0] == 0 and elastic["starts"][1] >= 8  # resumed from a checkpoint
    assert elastic["smaller_world"]["outcome"] == "within tolerance", elastic


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shapes", ["2xfoo", "2", "0x1", "2x1,x2"])
def test_a_malformed_shape_is_a_usage_error_naming_shapes(shapes, tmp_path, capsys, monkeypatch):
    """Checked before anything runs (no root or namespaces needed to see the error)."""
    import multihost

    # were the shapes accepted, nothing may run: main then returns 2 without a usage error
    monkeypatch.setattr(multihost, "unavailable_reason", lambda: "the test runs nothing")
    with pytest.raises(SystemExit) as exit_info:
        multihost.main(["--out", str(tmp_path), "--shapes", shapes])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"--shapes {shapes!r}" in err and "HxP" in err, err
