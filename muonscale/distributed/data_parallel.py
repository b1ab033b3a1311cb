"""``DistributedMuon``: data-parallel Muon with whole-matrix owners and ZeRO-1 AdamW.

The class is assembled from three modules: this one (construction, owners, ``step()`` phases),
:mod:`.dp_streams` (buffers, gradient hooks, reduce-scatter and all-gather) and
:mod:`.dp_global` (``clip_grad_norm_``, the non-finite agreement, ``state_dict``). Layouts are
planned in :mod:`.ownership` (who owns which matrix) and :mod:`.buckets` (where each element
travels)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from .. import functional
from ..kernels import clear_workspaces
from ..matrices import MatrixView
from ..memory import chunk_bytes_for, group_by_budget
from ..optimizer import Muon
from .comm import Communicator, WireCounter
from .dp_global import GlobalOperations
from .dp_streams import BucketedReduction
from .ownership import assign_owners, format_ownership_table, rank_loads


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor" or type(getattr(t, "data", None)).__name__ == "DTensor"


def _holds_dtensor(params: Any) -> bool:
    """Whether any parameter in a ``params`` argument (module, tensors, (name, tensor) pairs or
    param groups) is a DTensor."""
    if isinstance(params, torch.nn.Module):
        return any(_is_dtensor(p) for p in params.parameters())
    for entry in params:
        if isinstance(entry, Mapping):
            inner = entry["params"]
            if _holds_dtensor([inner] if isinstance(inner, torch.Tensor) else list(inner)):
                return True
        elif isinstance(entry, tuple) and len(entry) == 2:
            if _is_dtensor(entry[1]):
                return True
        elif _is_dtensor(entry):
            return True
    return False


class DistributedMuon(GlobalOperations, BucketedReduction, Muon):
    r"""Data-parallel Muon: each Muon matrix is orthogonalized whole by one owner rank; AdamW
    parameters are sharded ZeRO-1 style. Do **not** wrap the model in DDP: this optimizer
    averages the gradients itself (``p.grad`` keeps the local gradient).

    Communication of one step (N ranks; every arrow goes through :mod:`.comm`)::

        backward ──hook per parameter──▶ bucket full? ──▶ reduce-scatter (async)
          Muon:  bucket = every rank's owner-stream slice; rank r receives Σ grads of the
                 matrices it owns (+ an AdamW fill range that levels the streams)
                                                      (N−1)/N · S_muon
          AdamW: bucket = flat parameters, padded to a multiple of N; rank r receives
                 shard r                              (N−1)/N · S_adamw
        step():
          1. launch buckets backward did not, wait for every reduction
          2. all-reduce (max) of [has-gradient, non-finite] flags: all ranks agree to
             raise / skip / go on                      2(N−1)/N · 8·P bytes
          3. AdamW on the local shards and fill range (state for those only)
             ──▶ all-gather of the flat buckets (async)
          4. Muon on owned matrices in waves along the owner stream (momentum, batched
             Newton–Schulz, update); each bucket's all-gather starts (async) as soon as its
             slice is final, overlapping the later waves          (N−1)/N · S
          5. wait, copy gathered parameters back

    Total ≈ reduce-scatter + all-gather of every parameter = the volume of ZeRO-1 AdamW
    (DDP's all-reduce costs the same; all-reduce + broadcast/all-gather costs 1.5×). Owners
    are FLOP-balanced, then byte-balanced under the same FLOP makespan (:mod:`.ownership`);
    what stays uneven is topped up with AdamW elements (:mod:`.buckets`), so the owner
    streams carry almost no padding when the model has enough AdamW elements of the same dtype.
    ``reduce_dtype=torch.bfloat16`` halves the Muon reduce-scatter bytes (opt-in: the sum of
    the ranks' gradients is then rounded to bfloat16).

    With world size 1 (or without an initialized process group) the same code runs with no
    collectives and gives bitwise :class:`muonscale.Muon`'s result.

    Usage (under ``torchrun``; the model is not wrapped in DDP)::

        opt = DistributedMuon(model, lr=0.02, weight_decay=0.1)
        for micro_batch in batches[:-1]:
            with opt.no_sync():                  # accumulate locally
                loss_fn(model, micro_batch).backward()
        loss_fn(model, batches[-1]).backward()   # reductions start here, bucket by bucket
        opt.clip_grad_norm_(1.0)                 # global norm of the averaged gradient
        opt.step()                               # collective: every rank calls it
        opt.zero_grad()

    Args:
        params: as for :class:`muonscale.Muon`: the model itself (routes embeddings by module
            type), ``model.named_parameters()``, or param groups.
        process_group: the data-parallel group (None: the default group).
        reduce_dtype: dtype of the Muon gradient reduction (None: the parameter's dtype).
        main_params_dtype: keep main copies in this dtype of the parameters with fewer bits
            (e.g. ``torch.float32`` for a bf16 model, as DeepSpeed ZeRO-1 / Megatron's
            distributed optimizer), only where this rank updates them: each owned Muon matrix
            whole, each local AdamW segment. Their optimizer state is in the main dtype; the
            reduced gradients update the main copies, which are then rounded into the
            parameters, so the all-gather still sends the parameters' dtype. None: parameters
            are updated in their own dtype.
        bucket_cap_mb: approximate size of one bucket (as DDP's ``bucket_cap_mb``).
        **muon_options: every :class:`muonscale.Muon` option.

    ``state_dict()`` is collective and returns the **full** state keyed exactly like
    :class:`muonscale.Muon`'s (momentum gathered from the owners, AdamW shards gathered), so
    ``torch.distributed.checkpoint`` sees replicated tensors and a checkpoint loads at any world
    size, even into single-process ``Muon``. ``load_state_dict()`` takes full state and keeps
    the local part (no collectives); see :mod:`.full_state`. With main copies each entry also
    holds ``main_param`` (parameter-shaped, main dtype, gathered whole).

    A rank that fails inside ``step()`` makes the others fail in their next collective after
    at most the process-group timeout (``init_process_group(timeout=...)``), with a
    :class:`~muonscale.distributed.CollectiveError` that says so.
    """

    def __new__(cls, *args: Any, **kwargs: Any):
        """Parameters that are DTensors (FSDP2 ``fully_shard``, tensor parallel) are handled by
        :class:`muonscale.DTensorMuon` (the sharding framework reduces their gradients; whole
        matrices go to owners by all-to-all): ``DistributedMuon(...)`` returns one.
        Subclasses are constructed as usual."""
        params = args[0] if args else kwargs.get("params")
        if cls is not DistributedMuon or params is None:
            return super().__new__(cls)
        materialized = params if isinstance(params, torch.nn.Module) else list(params)
        if not _holds_dtensor(materialized):
            instance = super().__new__(cls)
            # __init__ reads it (params may be a generator)
            instance._materialized_params = materialized
            return instance
        from .dtensor import DTensorMuon

        kwargs.pop("params", None)
        process_group = args[1] if len(args) > 1 else kwargs.pop("process_group", None)
        if kwargs.pop("reduce_dtype", None) is not None:
            raise ValueError(
                "reduce_dtype does not apply to DTensor parameters: their gradients are reduced "
                "by FSDP2 (set its MixedPrecisionPolicy(reduce_dtype=...) instead)"
            )
        if kwargs.pop("main_params_dtype", None) is not None:
            raise ValueError(
                "main_params_dtype does not apply to DTensor parameters (set FSDP2's "
                "MixedPrecisionPolicy instead)"
            )
        kwargs.pop("bucket_cap_mb", None)
        return DTensorMuon(materialized, process_group=process_group, **kwargs)

    def __init__(
        self,
        params: Any,
        process_group: dist.ProcessGroup | None = None,
        *,
        reduce_dtype: torch.dtype | None = None,
        main_params_dtype: torch.dtype | None = None,
        bucket_cap_mb: float = 25.0,
        **muon_options: Any,
    ) -> None:
        params = self.__dict__.pop("_materialized_params", params)
        self._model_of: dict[int, torch.Tensor] = {}  # id(main copy) -> model parameter
        super().__init__(params, **muon_options)
        if reduce_dtype is not None and not (
            isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point
        ):
            raise ValueError(
                f"reduce_dtype must be None or a floating torch.dtype, got {reduce_dtype!r}"
            )
        if main_params_dtype is not None and not (
            isinstance(main_params_dtype, torch.dtype) and main_params_dtype.is_floating_point
        ):
            raise ValueError(
                "main_params_dtype must be None or a floating torch.dtype, "
                f"got {main_params_dtype!r}"
            )
        if not (isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0):
            raise ValueError(f"bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
        self.comm = Communicator(process_group, WireCounter())
        self.world_size, self.rank = self.comm.world_size, self.comm.rank
        self.reduce_dtype = reduce_dtype
        self.main_params_dtype = main_params_dtype
        self._params = [p for g in self.param_groups for p in g["params"]]
        self._group_of = [g for g in self.param_groups for _ in g["params"]]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        for p in self._params:
            if not p.is_contiguous():
                raise ValueError(
                    f"DistributedMuon needs contiguous parameters; '{self._name(p)}' is not"
                )
        self._check_same_parameters()
        self._assign_owners()
        self._build_buckets(int(bucket_cap_mb * 2**20))
        self._init_local_state()
        self._register_hooks()
        self.last_step_wire_bytes = 0
        self.last_step_wire_breakdown: dict[str, int] = {}

    # ================================================================ construction
    def _signature(self) -> list[tuple]:
        return [
            (self._name(p), tuple(p.shape), str(p.dtype), g["algorithm"])
            for p, g in zip(self._params, self._group_of)
        ]

    def _check_same_parameters(self) -> None:
        """All ranks must hold the same parameter list; raise naming the first difference."""
        if not self.comm.active:
            return
        signature = self._signature()
        digest = hashlib.sha256(repr(signature).encode()).digest()
        mine = torch.tensor(
            [int.from_bytes(digest[:7], "little")], dtype=torch.int64, device=self.comm.device
        )
        every = torch.empty(self.world_size, dtype=torch.int64, device=self.comm.device)
        self.comm.all_gather(every, mine, tag="setup")
        if bool((every == every[0]).all()):
            return
        signatures = self.comm.all_gather_object(signature)
        reference = signatures[0]
        for rank, other in enumerate(signatures):
            for i in range(max(len(reference), len(other))):
                a = reference[i] if i < len(reference) else None
                b = other[i] if i < len(other) else None
                if a != b:
                    raise ValueError(
                        f"DistributedMuon: the parameter lists differ between ranks: parameter #{i} "
                        f"is {a} on rank 0 but {b} on rank {rank} (name, shape, dtype, algorithm). "
                        "Every rank must build the same model and optimizer."
                    )
        raise ValueError("DistributedMuon: the parameter lists differ between ranks")

    def _assign_owners(self) -> None:
        self._muon = [i for i, g in enumerate(self._group_of) if g["algorithm"] == "muon"]
        self._adamw = [i for i, g in enumerate(self._group_of) if g["algorithm"] == "adamw"]
        shapes = [
            self.matrix_view(self._params[i], self._group_of[i]).matrix_shapes for i in self._muon
        ]
        sizes = [self._params[i].numel() * self._params[i].element_size() for i in self._muon]
        owners = assign_owners(shapes, self.world_size, sizes=sizes)
        self.owner_rank: dict[int, int] = dict(zip(self._muon, owners))
        self._matrix_shapes = dict(zip(self._muon, shapes))

    @torch.no_grad()
    def _init_local_state(self) -> None:
        """Create this rank's state now (owned momentum, AdamW shard views, every step counter,
        main copies), so that no rank's state is empty (DCP's ``get_state_dict`` would otherwise
        call ``step()`` on that rank alone)."""
        for i in self._muon:
            p, group = self._params[i], self._group_of[i]
            state = self.state[p]
            state["owner_rank"] = self.owner_rank[i]
            if self.owner_rank[i] == self.rank:
                main_dtype = self._main_dtype(p.dtype)
                dtype = group["momentum_dtype"] or main_dtype or p.dtype
                state["momentum_buffer"] = torch.zeros_like(
                    p, dtype=dtype, memory_format=torch.preserve_format
                )
                if main_dtype is not None:  # the whole matrix: this rank updates it
                    main = torch.empty_like(p, dtype=main_dtype).copy_(p)
                    state["main_param"] = main
                    self._model_of[id(main)] = p
        for i in self._adamw:
            p = self._params[i]
            state = self.state[p]
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            if i in self._segments:  # a flat-bucket shard or a stream fill range
                store, seg = self._segments[i]
                window = slice(seg.buffer_start, seg.buffer_start + seg.length)
                state["exp_avg"] = store.exp_avg[window]
                state["exp_avg_sq"] = store.exp_avg_sq[window]
                if store.main_param is not None:
                    state["main_param"] = store.main_param[window]
                    state["main_param"].copy_(self._segment_of(p, seg))

    @staticmethod
    def _segment_of(p: torch.Tensor, seg: Any) -> torch.Tensor:
        """This rank's segment of parameter ``p`` (a flat view)."""
        return p.view(-1)[seg.param_start : seg.param_start + seg.length]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "_buckets"):
            raise NotImplementedError(
                "DistributedMuon: parameters are fixed at construction (owners and buckets are "
                "planned once, on every rank); build a new optimizer instead"
            )
        super().add_param_group(param_group)

    def init_state(self, p: torch.Tensor, group: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """State is created at construction (owned Muon matrices, local AdamW shards); a main
        copy's state is its model parameter's."""
        return self.state[self.model_param(p)]

    def model_param(self, p: torch.Tensor) -> torch.Tensor:
        """The model parameter that ``p`` (a main copy, or the parameter itself) stands for."""
        return self._model_of.get(id(p), p)

    def matrix_view(self, p: torch.Tensor, group: Mapping[str, Any]) -> MatrixView:
        return super().matrix_view(self.model_param(p), group)

    def _name(self, p: torch.Tensor) -> str:
        return super()._name(self.model_param(p))

    # ================================================================ public helpers
    def ownership_table(self) -> str:
        """Which rank owns which Muon parameter, with NS FLOPs and elements per rank."""
        names = [self._name(self._params[i]) for i in self._muon]
        shapes = [self._matrix_shapes[i] for i in self._muon]
        owners = [self.owner_rank[i] for i in self._muon]
        numels = [self._params[i].numel() for i in self._muon]
        table = format_ownership_table(names, shapes, owners, self.world_size, numels=numels)
        stats = self.layout_stats()
        return (
            f"{table}\nowner streams: {stats['stream_elements']} elements per rank, "
            f"{stats['fill_elements']} of them AdamW fill, {stats['padding_elements']} padding"
        )

    def layout_stats(self) -> dict[str, Any]:
        """Owner layout figures: ``ns_flops`` and ``muon_elements`` per rank (owned Muon
        parameters), and over every owner stream: ``stream_elements`` (T per rank),
        ``fill_elements`` (AdamW elements riding in the streams) and ``padding_elements``
        (zeros on the wire, Σ over ranks)."""
        shapes = [self._matrix_shapes[i] for i in self._muon]
        owners = [self.owner_rank[i] for i in self._muon]
        elements = [0] * self.world_size
        for i in self._muon:
            elements[self.owner_rank[i]] += self._params[i].numel()
        return {
            "ns_flops": rank_loads(shapes, owners, self.world_size),
            "muon_elements": elements,
            "stream_elements": sum(s.layout.length for s in self._streams),
            "fill_elements": sum(s.layout.fill.numel for s in self._streams),
            "padding_elements": sum(s.layout.padding() for s in self._streams),
        }

    # ================================================================ step
    @torch.no_grad()
    def step(self, closure=None):
        """Reduce (if backward did not finish it), agree on non-finite gradients, update owned
        matrices and AdamW shards, gather the updated parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            self._finish_reductions()
            present, bad = self._agree_on_gradients()
            if bad is not None:
                self._handle_nonfinite(bad)  # raises on every rank, or counts a skip
                return loss
            self._update_adamw_shards(present)
            adamw_gathers = self._launch_adamw_gathers()
            muon_gathers = self._update_owned_and_gather(present)
            self._wait_and_copy_back(adamw_gathers + muon_gathers)
        finally:
            clear_workspaces()  # NS scratch is not held through the next forward/backward
            self._start_cycle()
            self.last_step_wire_bytes, self.last_step_wire_breakdown = self.comm.counter.take()
        return loss

    def _update_owned_and_gather(self, present: list[bool]) -> list[tuple[Any, Any]]:
        """Update the owned matrices in waves along the owner stream and launch each bucket's
        all-gather as soon as this rank's slice of it is final, so the gathers of early buckets
        overlap the Newton–Schulz of later ones. Waves hold at most one update chunk
        (``self.memory.update_chunk_bytes``); every rank launches the same
        buckets in the same order, only the timing differs. Returns (work, copy back) pairs."""
        pending = []
        for stream in self._streams:
            self._write_fill_for_gather(stream)
            owned = stream.layout.owned[self.rank]
            budget = chunk_bytes_for(self.memory.update_chunk_bytes, stream.gather_in.device)
            sizes = [self._params[i].numel() * self._params[i].element_size() for i in owned]
            waves = [[owned[j] for j in wave] for wave in group_by_budget(sizes, budget)]
            next_bucket = 0
            for wave in waves:
                self._update_owned_matrices(present, only=set(wave))
                self._write_owned_for_gather(stream, wave)
                last = wave[-1]
                ready = stream.layout.offsets[last] + stream.layout.numels[last]
                launched, next_bucket = self._launch_stream_buckets(stream, next_bucket, ready)
                pending += launched
            launched, _ = self._launch_stream_buckets(stream, next_bucket, stream.layout.length)
            pending += launched
        return pending

    def _update_owned_matrices(self, present: list[bool], only: set[int] | None = None) -> None:
        """Muon step of the owned matrices (those in ``only``, when given)."""
        for group in self.param_groups:
            if group["algorithm"] != "muon":
                continue
            indices = [self._index[id(p)] for p in group["params"]]
            mine = [
                i
                for i in indices
                if present[i] and self.owner_rank[i] == self.rank and (only is None or i in only)
            ]
            # the tensors updated: main copies where kept, else the parameters themselves
            targets = [self.state[self._params[i]].get("main_param", self._params[i]) for i in mine]
            grads = [self._reduced_grad(i, t.dtype) for i, t in zip(mine, targets)]
            self.update_group(group, targets, grads)
            for i, target in zip(mine, targets):
                if target is not self._params[i]:
                    self._params[i].copy_(target)  # rounded into the model's parameter

    def _update_adamw_shards(self, present: list[bool]) -> None:
        for group in self.param_groups:
            if group["algorithm"] != "adamw":
                continue
            indices = [self._index[id(p)] for p in group["params"] if present[self._index[id(p)]]]
            local = [i for i in indices if i in self._segments]
            for i in indices:
                if i not in self._segments:  # no local shard: only the step counter moves
                    self.state[self._params[i]]["step"] += 1
            if not local:
                continue
            states = [self.state[self._params[i]] for i in local]
            segments = [self._segment_of(self._params[i], self._segments[i][1]) for i in local]
            # the tensors updated: main copies where kept, else the parameters' segments
            params = [s.get("main_param", seg) for s, seg in zip(states, segments)]
            grads = [self._reduced_shard_grad(i) for i in local]
            grads = [g if g.dtype == t.dtype else g.to(t.dtype) for g, t in zip(grads, params)]
            beta1, beta2 = group["betas"]
            functional.adamw(
                params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                [s["step"] for s in states], lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                eps=group["eps"], weight_decay=group["weight_decay"],
                max_chunk_bytes=self.memory.update_chunk_bytes,
            )  # fmt: skip
            for target, segment in zip(params, segments):
                if target is not segment:
                    segment.copy_(target)  # rounded into the model's parameter
