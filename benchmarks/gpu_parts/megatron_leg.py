"""``megatron``: ``benchmarks/megatron_gpu.py`` in a subprocess with its own wall limit
(outside the driver's time guard); its JSON is merged into the section and the top-level
``megatron_leg`` says whether it was measured."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MEGATRON_SCRIPT = os.path.join(REPO, "benchmarks", "megatron_gpu.py")


def megatron_pythonpath(bench) -> tuple[str | None, str | None]:
    """(PYTHONPATH for the leg, None) or (None, why it cannot run here)."""
    if bench.device.type != "cuda" and not bench.smoke:
        return None, "no CUDA device"
    if sys.version_info < (3, 12):
        return (
            None,
            f"megatron-core 0.19 needs Python >= 3.12, this is {sys.version.split()[0]}",
        )
    site = bench.args.megatron_site or os.path.join(REPO, ".megatron-site")
    paths = [REPO]
    if os.path.isdir(site):
        paths.append(os.path.abspath(site))
    elif bench.args.megatron_site:
        return None, f"--megatron-site {site} does not exist"
    elif importlib.util.find_spec("megatron") is None:
        return (
            None,
            "megatron-core is not installed and there is no .megatron-site/ "
            "(run bash .ci/megatron_site.sh here and carry .megatron-site)",
        )
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(paths), None


def section_megatron(bench) -> dict:
    pythonpath, reason = megatron_pythonpath(bench)
    if reason:
        bench.results["megatron_leg"] = f"not measured: {reason}"
        print(bench.results["megatron_leg"])
        return {"status": "not_measured", "reason": reason}
    timeout = bench.args.megatron_timeout_s or (300.0 if bench.smoke else 150.0)
    os.makedirs(bench.out_dir, exist_ok=True)
    json_path = os.path.join(bench.out_dir, "megatron_gpu.json")
    log_path = os.path.join(bench.out_dir, "megatron_gpu.log")
    if os.path.exists(json_path):
        os.remove(json_path)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
        MEGATRON_SCRIPT,
        "--out",
        json_path,
        "--budget-s",
        str(max(10.0, timeout - 40.0)),
    ]
    if bench.smoke:
        cmd.append("--smoke")
    print(f"PYTHONPATH={pythonpath} {' '.join(cmd)}  (limit {timeout:.0f}s)", flush=True)
    env = {**os.environ, "PYTHONPATH": pythonpath}
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # torchrun starts its worker in a session of its own: SIGTERM lets torchrun stop
            # it; SIGKILL to the session we started (torchrun) if that does not suffice.
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = None
    seconds = time.perf_counter() - t0
    with open(log_path, errors="replace") as log:
        tail = log.read().splitlines()[-30:]
    print("\n".join(tail))
    data: dict = {}
    if os.path.exists(json_path):
        with open(json_path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError:  # killed while writing
                data = {"unreadable_json": json_path}
    out = {"leg": data, "returncode": rc, "leg_seconds": round(seconds, 1), "log": log_path}
    if "import_error" in data:
        reason = data["import_error"]
    elif rc is None:
        reason = f"timed out after {timeout:.0f}s (phases done: {data.get('phases_done', [])})"
    elif rc != 0 or "sanity" not in data:
        sane = data.get("sanity", {}).get("ok", True)
        bench.results["megatron_leg"] = (
            f"failed: exit code {rc}" if sane else "measured, sanity check failed"
        )
        return {**out, "status": "error", "log_tail": tail[-15:]}
    else:
        bench.results["megatron_leg"] = "measured"
        return out
    bench.results["megatron_leg"] = f"not measured: {reason}"
    return {**out, "status": "not_measured", "reason": reason, "log_tail": tail[-15:]}
