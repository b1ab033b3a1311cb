"""benchmarks/gpu.py --smoke runs the graph, profile and projection sections on CPU (tiny
sizes) and writes their results: the code the card will run, without the card."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_bench_smoke_new_sections(tmp_path):
    cmd = [
        sys.executable,
        os.path.join(REPO, "benchmarks", "gpu.py"),
        "--smoke",
        "--only",
        "graph",
        "--only",
        "profile",
        "--only",
        "projection",
        "--out",
        str(tmp_path),
    ]
    env = dict(os.environ, PYTHONPATH=REPO)
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    sections = json.load(open(tmp_path / "gpu_bench.json"))["sections"]
    assert {k: v["status"] for k, v in sections.items()} == dict.fromkeys(
        ("graph", "profile", "projection"), "ok"
    )
    graph = sections["graph"]["rows"][0]
    assert graph["eager_ms"] > 0 and graph["eager_capturable_ms"] > 0
    assert all(r["launches"] > 0 for r in sections["profile"]["rows"])
    # the foreach-vs-Triton timing of the elementwise passes runs on the card only
    assert sections["profile"]["elementwise_passes"] == {
        "status": "skipped",
        "reason": "needs CUDA",
    }
    projection = sections["projection"]
    assert projection["kind"].startswith("model")
    assert {r["ranks"] for r in projection["owner_load"]} == {2, 4}
    assert all(r["flops_max_over_mean"] >= 1 for r in projection["owner_load"])
    assert all(0 < r["projected_ratio"] for r in projection["rows"])
    assert projection["published"]["ratio"] == 0.979
    assert "MODEL, not a measurement" in done.stdout


def test_gpu_bench_smoke_backward_ns(tmp_path):
    """The orthogonalize_in_backward section on tiny CPU shapes: both Muon arms train the same
    copies on the same data, so they end equal (bitwise on CPU), and no step fell back."""
    cmd = [
        sys.executable,
        os.path.join(REPO, "benchmarks", "gpu.py"),
        "--smoke",
        "--only",
        "backward_ns",
        "--out",
        str(tmp_path),
    ]
    env = dict(os.environ, PYTHONPATH=REPO)
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    section = json.load(open(tmp_path / "gpu_bench.json"))["sections"]["backward_ns"]
    assert section["status"] == "ok"
    assert section["buckets"] > 0 and section["fallback_warnings"] == []
    assert section["max_rel_param_diff_in_backward_vs_default"] == 0.0
    assert all(t > 0 for t in section["step_ms"].values())
