"""What the bench reports about a mixture-of-experts model (``--mlp moe``).

- **Expert load balance** (:func:`expert_load`): tokens routed to each expert, as a multiple of
  the uniform share (a layer's routed tokens / E; 1.0 is a perfect balance), over the run's
  totals and step by step.
- **How each optimizer holds the experts** (:func:`optimizer_facts`): a muonscale optimizer's
  matrix view of each expert weight (the expert view: E matrices, gate and up apart) and the
  routers' share of the Newton–Schulz FLOPs of its step (counted with
  :func:`muonscale.flops.newton_schulz_flops` from the views' matrix shapes);
  ``torch.optim.Muon``'s contender: what it leaves to its AdamW.
- **The routers' share of Muon's optimizer time** (:func:`router_time_share`): the step of a
  ``muonscale.Muon`` over the routers alone against one over all the Muon-routed parameters,
  built with the contender's options on copies of the parameters with random gradients, timed
  in alternation (medians). A router (E, D) is tiny, so per-call overhead, not FLOPs, sets its
  time: its time share is larger than its FLOP share.
- **The table over seeds** (:func:`moe_seed_table`, :func:`format_moe_table`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from muonscale.bench.metrics import median_after_warmup, steps_to_reach
from muonscale.bench.seeds import t_quantile_975


def _shares(counts: Sequence[int]) -> list[float]:
    total = sum(counts)
    return [len(counts) * c / total if total else math.nan for c in counts]


def expert_load(tokens_per_step: Sequence[Sequence[Sequence[int]]]) -> dict | None:
    """Load balance of a run from its per-step (n_layer, E) routed-token counts: the run's
    totals per layer and expert, the least and most loaded expert over the run's totals
    (``run_min_share``, ``run_max_share``) and over single steps (``step_min_share``,
    ``step_max_share``), as multiples of the uniform share; None without counts."""
    if not tokens_per_step:
        return None
    layers, experts = len(tokens_per_step[0]), len(tokens_per_step[0][0])
    totals = [
        [sum(step[layer][e] for step in tokens_per_step) for e in range(experts)]
        for layer in range(layers)
    ]
    run = [s for row in totals for s in _shares(row)]
    steps = [s for step in tokens_per_step for row in step for s in _shares(row)]
    return {
        "tokens_per_expert": totals,
        "run_min_share": min(run),
        "run_max_share": max(run),
        "step_min_share": min(steps),
        "step_max_share": max(steps),
    }


def optimizer_facts(model, optimizer) -> dict[str, Any]:
    """How ``optimizer`` holds ``model``'s experts (see the module docstring); {} for an
    optimizer that is neither muonscale's nor the torch-muon contender's."""
    from muonscale.experts import find_experts
    from muonscale.flops import newton_schulz_flops
    from muonscale.train.optimizers import HybridOptimizer

    found = find_experts(model)
    params = dict(model.named_parameters())
    if isinstance(optimizer, HybridOptimizer):
        muon = optimizer.optimizers["muon"]
        taken = {id(p) for group in muon.param_groups for p in group["params"]}
        left = [n for n in found.layouts if id(params[n]) not in taken]
        return {
            "left_to_adamw": left,
            "left_to_adamw_elements": sum(params[n].numel() for n in left),
            "parameter_elements": sum(p.numel() for p in params.values()),
        }
    table = getattr(optimizer, "param_table", None)
    if table is None:
        return {}
    views: dict[str, dict] = {}
    total = router = 0
    for group in optimizer.param_groups:
        if group["algorithm"] != "muon":
            continue
        for name, p in zip(group["param_names"], group["params"], strict=True):
            view = table.view(p, group["matrix_mode"])
            flops = sum(newton_schulz_flops(m, n, group["ns_steps"]) for m, n in view.matrix_shapes)
            total += flops
            router += flops if name in found.routers else 0
            if name in found.layouts:
                views[name] = {
                    "expert_view": view.experts,
                    "matrices": len(view.matrix_shapes),
                    "matrix_shape": list(view.matrix_shapes[0]),
                    "note": table.note(p, group),
                }
    return {
        "expert_views": views,
        "routers": sorted(found.routers),
        "router_newton_schulz_flop_share": router / total if total else None,
    }


def _restricted(options: Mapping[str, Any], names: set[str]) -> dict[str, Any]:
    """``options`` with ``splits`` and ``experts`` kept to the parameters in ``names``."""
    out = dict(options)
    for key in ("splits", "experts"):
        if out.get(key):
            out[key] = {n: v for n, v in out[key].items() if n in names}
    return out


def router_timing_optimizers(model, options: Mapping[str, Any]):
    """(routers only, all Muon-routed): two ``muonscale.Muon`` built with ``options`` (the
    contender's ``Muon`` keyword arguments) over copies of the parameters the contender's
    optimizer sends to Muon, each copy with a random gradient; ``model`` is left untouched."""
    import torch

    from muonscale import Muon
    from muonscale.experts import find_experts
    from muonscale.train.optimizers import muon_params

    # where the contender's optimizer sends each parameter (built on the model, never stepped)
    routing = Muon(muon_params(model), **options)
    muon = {n for g in routing.param_groups if g["algorithm"] == "muon" for n in g["param_names"]}
    del routing
    routers = set(find_experts(model).routers) & muon
    if not routers:
        raise ValueError("router_timing_optimizers: the model has no expert router routed to Muon")
    generator = torch.Generator(device="cpu").manual_seed(0)
    copies = []
    for name, p in model.named_parameters():
        if name in muon:
            copy = torch.nn.Parameter(p.detach().clone())
            noise = torch.randn(p.shape, generator=generator, dtype=torch.float32)
            copy.grad = noise.to(device=p.device, dtype=p.dtype)
            copies.append((name, copy))

    def build(names: set[str]):
        return Muon([(n, p) for n, p in copies if n in names], **_restricted(options, names))

    return build(routers), build(muon)


def router_time_share(
    model, options: Mapping[str, Any], *, repetitions: int = 15, budget_s: float = 1.5
) -> dict[str, Any]:
    """The routers' share of Muon's optimizer time: the median step time of the routers-only
    optimizer over that of the all-Muon one (:func:`router_timing_optimizers`), the two
    stepped in alternation after one warm-up step each, for ``repetitions`` pairs or until
    ``budget_s`` seconds of pairs have run (at least 3 pairs)."""
    import time

    import torch

    routers, everything = router_timing_optimizers(model, options)
    device = next(p for g in everything.param_groups for p in g["params"]).device

    def timed(optimizer) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    timed(routers), timed(everything)  # warm-up: the first step builds the state
    router_s, all_s = [], []
    began = time.perf_counter()
    while len(all_s) < repetitions and (len(all_s) < 3 or time.perf_counter() - began < budget_s):
        router_s.append(timed(routers))
        all_s.append(timed(everything))
    router, total = statistics.median(router_s), statistics.median(all_s)
    return {
        "share": router / total,
        "repetitions": len(all_s),
        "router_step_ms": 1e3 * router,
        "muon_step_ms": 1e3 * total,
    }


def _interval(values: Sequence[float]) -> dict | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return None
    mean = statistics.fmean(finite)
    half = None
    if len(finite) > 1:
        half = t_quantile_975(len(finite) - 1) * statistics.stdev(finite) / math.sqrt(len(finite))
    return {"mean": mean, "ci95_half_width": half, "n": len(finite), "values": list(values)}


def moe_seed_table(per_seed: Mapping[int, Mapping], warmup: int, facts: Mapping) -> dict:
    """Per contender over the seeds (each seed against AdamW's final loss of that seed): steps
    to AdamW's final validation loss, final validation loss, tokens/s, optimizer step ms (each
    a mean with its 95% Student's t half-width), optimizer state bytes, the expert load
    (least and most loaded expert over the seeds' run totals and single steps), and
    ``facts`` (:func:`optimizer_facts`) of the contender."""
    names: list[str] = []
    for records in per_seed.values():
        names += [n for n in records if n not in names]
    out = {}
    for name in names:
        steps, finals, tokens_s, opt_ms, state, loads = [], [], [], [], [], []
        for records in per_seed.values():
            record, adamw = records.get(name), records.get("adamw")
            if record is None:
                continue
            finals.append(record.val_losses[-1] if record.val_losses else None)
            target = adamw.val_losses[-1] if adamw is not None and adamw.val_losses else None
            reached = None
            if target is not None and math.isfinite(target):
                reached = steps_to_reach(record.eval_steps, record.val_losses, target)
            steps.append(reached)
            if record.step_seconds:
                step_s = median_after_warmup(record.step_seconds, warmup)
                tokens_s.append(median_after_warmup(record.tokens, 0) / step_s)
                opt_ms.append(1e3 * median_after_warmup(record.optimizer_seconds, warmup))
            state.append(record.optimizer_state_bytes)
            loads.append(expert_load(record.expert_tokens))
        loads = [load for load in loads if load is not None]
        out[name] = {
            "seeds": len(finals),
            "steps_to_adamw_final_loss": _interval(steps),
            "reached": sum(s is not None and math.isfinite(s) for s in steps),
            "final_val_loss": _interval(finals),
            "tokens_per_s": _interval(tokens_s),
            "optimizer_step_ms": _interval(opt_ms),
            "optimizer_state_bytes": max(state) if state else None,
            "expert_load": None
            if not loads
            else {
                key: (min if key.endswith("min_share") else max)(load[key] for load in loads)
                for key in ("run_min_share", "run_max_share", "step_min_share", "step_max_share")
            },
            **dict(facts.get(name, {})),
        }
    return out


def _mean_pm(stats: Mapping | None, spec: str) -> str:
    if stats is None:
        return "never"
    half = stats["ci95_half_width"]
    return f"{stats['mean']:{spec}}" + ("" if half is None else f" ± {half:{spec}}")


def load_text(load: Mapping | None) -> str:
    """``run 0.81–1.22, per step 0.40–1.90`` (least–most loaded expert ÷ the uniform share)."""
    if load is None:
        return "-"
    return (
        f"run {load['run_min_share']:.2f}–{load['run_max_share']:.2f}, per step "
        f"{load['step_min_share']:.2f}–{load['step_max_share']:.2f}"
    )


def facts_lines(name: str, facts: Mapping, optimizer_ms: float | None = None) -> list[str]:
    """Markdown list lines: how contender ``name``'s optimizer holds the experts (``facts``:
    :func:`optimizer_facts`, with ``router_time_share`` where it was measured) and the
    routers' share of its optimizer time and of its Newton–Schulz FLOPs (without a measured
    share, the FLOP share of ``optimizer_ms``, its step's median time)."""
    lines = []
    views = facts.get("expert_views")
    if views:
        shown = sorted({v["note"] for v in views.values()})
        lines.append(f"- {name}: expert weights in the expert view: {'; '.join(shown)}")
    share = facts.get("router_newton_schulz_flop_share")
    timed = facts.get("router_time_share")
    if timed is not None:
        flops = "" if share is None else f"; FLOP share {100 * share:.2g}%"
        lines.append(
            f"- {name}: router share of Muon's optimizer time: {100 * timed['share']:.2g}% "
            f"(measured, {timed['repetitions']} repetitions: {timed['router_step_ms']:.3g} ms "
            f"of {timed['muon_step_ms']:.3g} ms){flops}"
        )
    elif share is not None:
        scaled = "" if optimizer_ms is None else f", ≈ {share * optimizer_ms:.3g} ms of its step"
        lines.append(
            f"- {name}: the routers are {100 * share:.2g}% of its Newton–Schulz FLOPs "
            f"(FLOP share from the matrix shapes, not timed{scaled})"
        )
    if "left_to_adamw" in facts:
        left = facts["left_to_adamw_elements"] / facts["parameter_elements"]
        lines.append(
            f"- {name}: torch.optim.Muon takes 2-D matrices only; it leaves "
            f"{len(facts['left_to_adamw'])} expert stacks ({100 * left:.1f}% of the parameters) "
            "to its AdamW"
        )
    return lines


def format_moe_table(table: Mapping) -> str:
    """Markdown: the MoE table (means ± 95% half-width over seeds), then per contender how its
    optimizer held the experts and the routers' share of its optimizer time and FLOPs."""
    header = (
        "| contender | seeds | steps to AdamW final | final val loss | tokens/s | optimizer ms "
        "| state MiB | expert load, run (min–max ×uniform) | per step |"
    )
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    notes = []
    for name, c in table.items():
        load = c["expert_load"]
        run = step = "-"
        if load is not None:
            run = f"{load['run_min_share']:.2f}–{load['run_max_share']:.2f}"
            step = f"{load['step_min_share']:.2f}–{load['step_max_share']:.2f}"
        reached = _mean_pm(c["steps_to_adamw_final_loss"], ".1f")
        if c["reached"] < c["seeds"]:
            reached += f" ({c['reached']}/{c['seeds']} reached)"
        state = c["optimizer_state_bytes"]
        lines.append(
            f"| {name} | {c['seeds']} | {reached} | {_mean_pm(c['final_val_loss'], '.4f')} "
            f"| {_mean_pm(c['tokens_per_s'], ',.0f')} | {_mean_pm(c['optimizer_step_ms'], '.1f')} "
            f"| {'-' if state is None else f'{state / 2**20:.2f}'} | {run} | {step} |"
        )
        ms = c["optimizer_step_ms"]
        notes += facts_lines(name, c, None if ms is None else ms["mean"])
    return "\n".join(
        [
            "Mixture of experts, over seeds (mean ± 95% half-width; expert load: tokens per "
            "expert ÷ the uniform share, least–most loaded):",
            "",
            *lines,
            "",
            *notes,
        ]
    )
