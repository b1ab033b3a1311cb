"""``DistributedMuon``: data-parallel Muon with whole-matrix owners and ZeRO-1 AdamW.

The optimizer plans owners (:mod:`.ownership`) and runs the ``step()`` phases; it owns a
:class:`~.dp_reduction.BucketedReduction` (buffers, gradient hooks, reduce-scatter and
all-gather). ``clip_grad_norm_`` is in :mod:`.dp_grad_clip`, checkpoints in
:mod:`.dp_checkpoint`. DTensor parameters go to :class:`~.dtensor.DTensorMuon`
(:func:`muonscale.distributed_muon` picks the class)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import functional
from ..compile_boundary import eager_under_compile
from ..declared_state import MOMENTUM, kept_state
from ..kernels import clear_workspaces
from ..matrices import MatrixView
from ..memory import chunk_bytes_for, group_by_budget
from ..optimizer import Muon
from ..settings import MuonSettings
from . import dp_checkpoint, dp_grad_clip
from .comm import Communicator, WireCounter
from .dp_reduction import BucketedReduction, ReduceAt, ReductionOptions
from .dp_update_gather import UPDATE_DTYPE, UpdateGather, check_gather_updates, sends_update
from .hosts import discover_host_map
from .ownership import assign_owners, format_ownership_table, rank_loads
from .setup_checks import (  # noqa: F401 (check_process_group, is_dtensor: imported from here)
    check_process_group,
    is_dtensor,
    require_same_parameters,
    require_same_values,
    unwrap_ddp,
)


class DistributedMuon(Muon):
    r"""Data-parallel Muon: each Muon matrix is orthogonalized whole by one owner rank; AdamW
    parameters are sharded ZeRO-1 style. This optimizer averages the gradients itself
    (``p.grad`` keeps the local gradient); given a model wrapped in DDP it reduces nothing
    (``reduce_at="never"``: DDP averaged them already).

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
          5. wait, copy gathered parameters back (or, for gathered bf16 updates, every rank
             applies W ← W·(1 − lr λ) + lr α U with the step's lr: ``gather_updates``)

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
        overlap_gather: launch each bucket's all-gather as soon as its slice is final, so it
            overlaps the Newton–Schulz of later waves (True), or only after every owned matrix
            is updated (False). Results are bitwise equal; only the timing differs.
        wire_counter: the :class:`~muonscale.distributed.WireCounter` that counts this
            optimizer's bytes (None: a new one).
        host_map: the host of each rank of the group (one label per rank, the same list on
            every rank); None: torchrun's ``GROUP_RANK``, else the hostname
            (:mod:`.hosts`). With several hosts of several ranks each, the reduce-scatter and
            all-gather run within hosts first on backends other than NCCL, and bytes are
            counted per link class (``last_step_wire_links``).
        gather_updates: what the owner of a Muon matrix sends back (:mod:`.dp_update_gather`).
            None (default): its bfloat16 update where Newton–Schulz runs in bfloat16 (the
            default on GPU), and every rank applies it to its own copy; else the updated
            parameter. True: the update at any Newton–Schulz dtype, **rounded to bfloat16**
            (the owner applies the rounded update as well, so the step differs from
            :class:`muonscale.Muon`'s by that rounding). False: always the parameter.
            Matrices with main copies, or no wider than bfloat16, always send the parameter.
        reduce_at: when ``p.grad`` is read and averaged. ``"backward"`` (default for a plain
            model): gradient hooks launch each bucket as soon as it is full, overlapping
            backward; if ``p.grad`` changes after that (``torch.nn.utils.clip_grad_norm_``,
            masking, zeroing, a further backward without ``opt.no_sync()``), ``step()`` notices
            it (tensor identity and version counter) and reduces every gradient again from
            ``p.grad``, warning once about the repeated traffic. ``"step"``: everything is read
            and reduced at ``step()`` (no overlap; every edit and accumulation applies).
            ``"never"`` (default when ``params`` is a model wrapped in
            ``DistributedDataParallel``): ``p.grad`` already holds the average over the group,
            so nothing is reduced again; each rank reads its own slices at ``step()``.
        **muon_options: every :class:`muonscale.Muon` option, as keywords.

    DTensor parameters are refused: :func:`muonscale.distributed_muon` builds a
    :class:`~muonscale.distributed.DTensorMuon` for them.

    Attributes:
        params: every parameter, in param-group order; ``group_of[i]`` is the group of
            ``params[i]``, ``muon_indices`` / ``adamw_indices`` index into it, ``owner_rank``
            maps each Muon index to its owner, ``index_of(p)`` is ``p``'s index.
        reduction: the :class:`~muonscale.distributed.dp_reduction.BucketedReduction` (buffers,
            hooks, reduce-scatter, all-gather, the AdamW shard state).

    ``state_dict()`` is collective and returns the **full** state keyed exactly like
    :class:`muonscale.Muon`'s (momentum gathered from the owners, AdamW shards gathered), so
    ``torch.distributed.checkpoint`` sees replicated tensors and a checkpoint loads at any world
    size, even into single-process ``Muon``. ``load_state_dict()`` takes full state and keeps
    the local part (no collectives); see :mod:`.dp_checkpoint`. With main copies each entry also
    holds ``main_param`` (parameter-shaped, main dtype, gathered whole).
    A framework that saves on one rank only: every rank calls ``prepare_state_dict()`` (the
    collective part) first; ``state_dict()`` then needs no collectives until the next ``step()``.

    Construction is collective: every rank must hold the same parameter list with the same
    initial values (two checksums per parameter; a difference is refused by name), and each
    rank's host is learned (``host_map``).

    A rank that fails inside ``step()`` makes the others fail in their next collective after
    at most the process-group timeout (``init_process_group(timeout=...)``), with a
    :class:`~muonscale.distributed.CollectiveError` that says so.
    """

    _CAPTURABLE_REFUSAL = (
        "its step agrees across ranks on which gradients exist and are finite on the host "
        "(one all-reduce read back), and its bucket plan is chosen per step; use "
        "muonscale.Muon(capturable=True) on one GPU"
    )
    _BACKWARD_NS_REFUSAL = (
        "a rank's gradients are final only after its reduce-scatter or all-reduce, and each "
        "matrix is orthogonalized by its owner rank after the exchange; use "
        "muonscale.Muon(orthogonalize_in_backward=True) in one process"
    )

    def __init__(
        self,
        params: Any,
        process_group: dist.ProcessGroup | None = None,
        *,
        reduce_dtype: torch.dtype | None = None,
        main_params_dtype: torch.dtype | None = None,
        bucket_cap_mb: float = 25.0,
        overlap_gather: bool = True,
        wire_counter: WireCounter | None = None,
        reduce_at: ReduceAt | None = None,
        host_map: Sequence[Hashable] | None = None,
        gather_updates: bool | None = None,
        **muon_options: Any,
    ) -> None:
        check_gather_updates(gather_updates)
        if not isinstance(overlap_gather, bool):
            raise ValueError(f"overlap_gather must be True or False, got {overlap_gather!r}")
        self.overlap_gather = overlap_gather
        check_process_group(process_group, "DistributedMuon")
        params, wrapped = unwrap_ddp(params)
        if wrapped and reduce_at not in (None, "never"):
            raise ValueError(
                f"reduce_at={reduce_at!r} with a model wrapped in DistributedDataParallel would "
                "average every gradient twice (DDP's all-reduce, then this optimizer's "
                "reduce-scatter): pass the model unwrapped, or reduce_at='never'"
            )
        if reduce_at is None:
            reduce_at = "never" if wrapped else "backward"
        options = ReductionOptions(reduce_dtype, main_params_dtype, bucket_cap_mb, reduce_at)
        self._sends_update = lambda p, g: sends_update(p, g, gather_updates, options.main_dtype)
        self._model_of: dict[int, torch.Tensor] = {}  # id(main copy) -> model parameter
        super().__init__(params, **muon_options)
        self.comm = self._communicator(process_group, wire_counter or WireCounter(), host_map)
        self.world_size, self.rank = self.comm.world_size, self.comm.rank
        self.params = [p for g in self.param_groups for p in g["params"]]
        """Every parameter, in param-group order: the indices of the attributes below."""
        self.group_of = [g for g in self.param_groups for _ in g["params"]]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        for p in self.params:
            if is_dtensor(p):
                raise ValueError(
                    f"DistributedMuon takes plain tensors, but parameter '{self._name(p)}' is a "
                    "DTensor (FSDP2 / tensor parallel): build the optimizer with "
                    "muonscale.distributed_muon(...), which returns a DTensorMuon for DTensor "
                    "parameters"
                )
            if not p.is_contiguous():
                raise ValueError(
                    f"DistributedMuon needs contiguous parameters; '{self._name(p)}' is not"
                )
        self._check_same_parameters()
        self._assign_owners()
        self.reduction = BucketedReduction(
            self.params,
            options,
            muon=self.muon_indices,
            adamw=self.adamw_indices,
            owner_rank=self.owner_rank,
            comm=self.comm,
            name_of=self._name,
            update_params=frozenset(
                i for i in self.muon_indices if self._sends_update(self.params[i], self.group_of[i])
            ),
            update_dtype=UPDATE_DTYPE,
        )
        self.update_gather = UpdateGather(self.reduction, gather_updates, self._name)
        self._owner_apply = None  # Muon's last pass on owners: as usual, or sending updates
        if self.update_gather.matrices:
            self._owner_apply = self.update_gather.owner_apply(lambda t: self._index.get(id(t)))
        self._init_local_state()
        self.last_step_wire_bytes = 0
        self.last_step_wire_breakdown: dict[str, int] = {}
        self.last_step_wire_links: dict[str, int] = WireCounter().by_link()
        self._prepared_state: dict[int, dict[str, torch.Tensor]] | None = None

    # ================================================================ construction
    @staticmethod
    def _communicator(group, counter: WireCounter, host_map) -> Communicator:
        """The group's communicator, knowing the host of every rank (collective)."""
        comm = Communicator(group, counter)
        if not comm.active or dist.get_backend(comm.group) == "fake":
            if host_map is not None and len(host_map) != comm.world_size:
                raise ValueError(
                    f"host_map has {len(host_map)} entries, expected one per rank of the "
                    f"group ({comm.world_size})"
                )
            return comm
        return Communicator(group, counter, hosts=discover_host_map(comm, host_map))

    def _signature(self) -> list[tuple]:
        return [
            (self._name(p), tuple(p.shape), str(p.dtype), g["algorithm"], self._sends_update(p, g))
            for p, g in zip(self.params, self.group_of)
        ]

    def _check_same_parameters(self) -> None:
        """All ranks must hold the same parameter list with the same initial values; raise naming
        the first difference. Not on torch's fake process group (one process alone)."""
        if not self.comm.active or dist.get_backend(self.comm.group) == "fake":
            return
        step_counter, self.comm.counter = self.comm.counter, WireCounter()  # not a step's
        try:
            require_same_parameters(self.comm, self.world_size, self._signature())
            require_same_values(self.comm, self.params, [self._name(p) for p in self.params])
        finally:
            self.comm.counter = step_counter

    def _assign_owners(self) -> None:
        self.muon_indices = [i for i, g in enumerate(self.group_of) if g["algorithm"] == "muon"]
        self.adamw_indices = [i for i, g in enumerate(self.group_of) if g["algorithm"] == "adamw"]
        shapes = [
            self._matrix_view(self.params[i], self.group_of[i]).matrix_shapes
            for i in self.muon_indices
        ]
        sizes = [self.params[i].numel() * self.params[i].element_size() for i in self.muon_indices]
        owners = assign_owners(shapes, self.world_size, sizes=sizes)
        self.owner_rank: dict[int, int] = dict(zip(self.muon_indices, owners))
        self.matrix_shapes_by_index = dict(zip(self.muon_indices, shapes))

    @torch.no_grad()
    def _init_local_state(self) -> None:
        """Create this rank's state now (owned momentum, AdamW shard views, every step counter,
        main copies), so that no rank's state is empty (DCP's ``get_state_dict`` would otherwise
        call ``step()`` on that rank alone)."""
        for i in self.muon_indices:
            p, group = self.params[i], self.group_of[i]
            state = self.state[p]
            state["owner_rank"] = self.owner_rank[i]
            if self.owner_rank[i] == self.rank:
                main_dtype = self.reduction.main_dtype(p.dtype)
                settings = MuonSettings.from_group(group)
                state[MOMENTUM.key] = torch.zeros_like(
                    p,
                    dtype=MOMENTUM.dtype(settings, main_dtype or p.dtype),
                    memory_format=torch.preserve_format,
                )
                for spec in kept_state(settings, variants_only=True):  # on the owner
                    state[spec.key] = spec.zeros(
                        settings, self._matrix_view(p, group), p.dtype, p.device
                    )
                if main_dtype is not None:  # the whole matrix: this rank updates it
                    main = torch.empty_like(p, dtype=main_dtype).copy_(p)
                    state["main_param"] = main
                    self._model_of[id(main)] = p
        for i in self.adamw_indices:
            p = self.params[i]
            state = self.state[p]
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            if i in self.reduction.segments:  # a flat-bucket shard or a stream fill range
                store, seg = self.reduction.segments[i]
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
        if hasattr(self, "reduction"):
            raise NotImplementedError(
                "DistributedMuon: parameters are fixed at construction (owners and buckets are "
                "planned once, on every rank); build a new optimizer instead"
            )
        super().add_param_group(param_group)

    def _check_rebind(self, slots: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for old, (_, new) in zip(self.params, slots):  # self.params: bound at construction
            if new is old:
                continue
            name = self._name(old)
            if is_dtensor(new):
                raise ValueError(
                    f"DistributedMuon: parameter '{name}' is now a DTensor (the model was sharded "
                    "after the optimizer was built): build the optimizer on the sharded model "
                    "with muonscale.distributed_muon(...), which returns a DTensorMuon"
                )
            if new.dtype != old.dtype or new.device != old.device or not new.is_contiguous():
                raise ValueError(
                    f"DistributedMuon: parameter '{name}' changed dtype or device or is not "
                    f"contiguous ({old.dtype}, {old.device} -> {new.dtype}, {new.device}); the "
                    "buffers were planned for the old one: build a new optimizer"
                )

    def _after_rebind(self, slots: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Follow new parameter objects: indices, main copies' model parameters, the
        reduction's parameters and its gradient hooks."""
        new_of = {id(old): new for old, (_, new) in zip(self.params, slots)}
        self._model_of = {k: new_of.get(id(v), v) for k, v in self._model_of.items()}
        self.params = [new for _, new in slots]
        self.group_of = [g for g in self.param_groups for _ in g["params"]]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.reduction.rebind(self.params)

    def _init_state(
        self, p: torch.Tensor, group: Mapping[str, Any], settings: MuonSettings | None = None
    ) -> dict[str, torch.Tensor]:
        """State is created at construction (owned Muon matrices, local AdamW shards); a main
        copy's state is its model parameter's."""
        return self.state[self.model_param(p)]

    def model_param(self, p: torch.Tensor) -> torch.Tensor:
        """The model parameter that ``p`` (a main copy, or the parameter itself) stands for."""
        return self._model_of.get(id(p), p)

    def _matrix_view(self, p: torch.Tensor, group: Mapping[str, Any]) -> MatrixView:
        return super()._matrix_view(self.model_param(p), group)

    def _name(self, p: torch.Tensor) -> str:
        return super()._name(self.model_param(p))

    def index_of(self, p: torch.Tensor) -> int:
        """Position of parameter ``p`` in :attr:`params`."""
        return self._index[id(p)]

    # ================================================================ public helpers
    @property
    def reduce_dtype(self) -> torch.dtype | None:
        """dtype of the Muon gradient reduction (None: the parameters' dtype)."""
        return self.reduction.options.reduce_dtype

    @property
    def main_params_dtype(self) -> torch.dtype | None:
        """dtype of the main copies (None: parameters are updated in their own dtype)."""
        return self.reduction.options.main_params_dtype

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no reduction) for all but the last micro-batch."""
        with self.reduction.no_sync():
            yield

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the optimizer no longer reduces during backward)."""
        self.reduction.remove_hooks()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the averaged gradient by its global norm (collective); returns the norm.

        Same result as ``torch.nn.utils.clip_grad_norm_`` on the averaged gradients of every
        parameter in one process. ``p.grad`` (local) is not touched: the reduced gradients that
        ``step()`` uses are scaled (:mod:`.dp_grad_clip`), so call it last before ``step()``
        (a later edit of ``p.grad`` makes ``step()`` reduce again, unclipped)."""
        if self.reduction.options.reduce_at == "backward":  # reductions may predate an edit
            self.reduction.finish()
            changed = self.reduction.grads_changed()
            flag = torch.tensor([int(bool(changed))], dtype=torch.int32, device=self.comm.device)
            self.comm.all_reduce(flag, op=dist.ReduceOp.MAX, tag="control")
            if bool(flag):
                self._reduce_again(changed)
        return dp_grad_clip.clip_grad_norm_(self.reduction, self.comm, max_norm, norm_type)

    def state_dict(self) -> dict[str, Any]:
        """Full state, keyed like :class:`muonscale.Muon`'s (:mod:`.dp_checkpoint`).
        Collective: call on every rank, unless :meth:`prepare_state_dict` ran since the last
        ``step()``."""
        packed = super().state_dict()  # param_groups with indices; its "state" is replaced
        state = self._prepared_state
        if state is None:
            state = self._gather_state()
        packed["state"] = {i: state[i] for i in sorted(state)}
        return packed

    def prepare_state_dict(self) -> None:
        """Gather the full state now (collective: every rank calls it), so that ``state_dict()``
        on any rank alone returns it without collectives until the next ``step()`` or
        ``load_state_dict()``: for frameworks that save on one rank only (the HF Trainer)."""
        self._prepared_state = None
        self._prepared_state = self._gather_state()

    def _gather_state(self) -> dict[int, dict[str, torch.Tensor]]:
        step_counter, self.comm.counter = self.comm.counter, WireCounter()  # not a step's traffic
        try:
            return dp_checkpoint.gather_full_state(self)
        finally:
            self.comm.counter = step_counter

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load full state (from this class, :class:`muonscale.Muon`, or DCP's
        ``set_state_dict``); every rank keeps its part. No collectives. torch's
        ``load_state_dict`` pre- and post-hooks run around it, as torch runs them."""
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            returned = pre_hook(self, state_dict)
            if returned is not None:
                state_dict = returned
        self._prepared_state = None
        dp_checkpoint.load_full_state(self, state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def ownership_table(self) -> str:
        """Which rank owns which Muon parameter, with NS FLOPs and elements per rank."""
        names = [self._name(self.params[i]) for i in self.muon_indices]
        shapes = [self.matrix_shapes_by_index[i] for i in self.muon_indices]
        owners = [self.owner_rank[i] for i in self.muon_indices]
        numels = [self.params[i].numel() for i in self.muon_indices]
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
        (zeros in the buffers, Σ over ranks; sent by NCCL's native collectives only)."""
        shapes = [self.matrix_shapes_by_index[i] for i in self.muon_indices]
        owners = [self.owner_rank[i] for i in self.muon_indices]
        elements = [0] * self.world_size
        for i in self.muon_indices:
            elements[self.owner_rank[i]] += self.params[i].numel()
        return {
            "ns_flops": rank_loads(shapes, owners, self.world_size),
            "muon_elements": elements,
            "stream_elements": sum(s.layout.length for s in self.reduction.streams),
            "fill_elements": sum(s.layout.fill.numel for s in self.reduction.streams),
            "padding_elements": sum(s.layout.padding() for s in self.reduction.streams),
        }

    # ================================================================ step
    @eager_under_compile
    @torch.no_grad()
    def step(self, closure=None):
        """Reduce (if backward did not finish it), agree on non-finite gradients, update owned
        matrices and AdamW shards, gather the updated parameters (or the owners' updates)."""
        loss = None
        self._prepared_state = None  # the state is about to change
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            self.reduction.finish()
            present, bad = self._agree_on_gradients()
            if bad is not None:
                self._handle_nonfinite(bad)  # raises on every rank, or counts a skip
                return loss
            self.update_gather.capture(self, present)  # lr, weight decay of this step
            self._update_adamw_shards(present)
            adamw_gathers = self.reduction.launch_flat_gathers()
            muon_gathers = self._update_owned_and_gather(present)
            self.reduction.wait_and_copy_back(adamw_gathers + muon_gathers)
        finally:
            clear_workspaces()  # NS scratch is not held through the next forward/backward
            self.reduction.start_cycle()
            self.last_step_wire_links = self.comm.counter.by_link()
            self.last_step_wire_bytes, self.last_step_wire_breakdown = self.comm.counter.take()
        return loss

    def _agree_on_gradients(self) -> tuple[list[bool], str | None]:
        """One all-reduce (max) of per-parameter flags [has a gradient on some rank,
        non-finite reduced gradient] and of [``p.grad`` changed after its reduction on some
        rank]; returns (present, first non-finite name). A change makes every rank reduce
        again from ``p.grad`` and agree once more."""
        P, device = len(self.params), self.comm.device
        has_grad = [p.grad is not None for p in self.params]
        changed = self.reduction.grads_changed()
        flags = torch.zeros(2 * P + 1, dtype=torch.int32)  # built on the host, one copy to device
        flags[:P] = torch.tensor(has_grad, dtype=torch.int32)
        flags[2 * P] = int(bool(changed))
        flags = flags.to(device)
        if self.nonfinite != "ignore":
            local = {i: g for i, g in self.reduction.local_reduced_grads().items() if g.numel()}
            if local:
                max_abs = torch._foreach_norm(list(local.values()), float("inf"))  # NaN propagates
                finite = torch.stack([m.to(device) for m in max_abs]).isfinite()
                index = torch.tensor([P + i for i in local], device=device)
                flags.index_copy_(0, index, (~finite).to(torch.int32))
        self.comm.all_reduce(flags, op=dist.ReduceOp.MAX, tag="control")
        if bool(flags[2 * P]):
            self._reduce_again(changed)
            return self._agree_on_gradients()
        present = [bool(f) for f in flags[:P].tolist()]
        bad = flags[P : 2 * P].nonzero()
        return present, (self._name(self.params[int(bad[0])]) if bad.numel() else None)

    def _reduce_again(self, changed: list[int]) -> None:
        """``p.grad`` changed after its reduction read it (on some rank): reduce every gradient
        again from ``p.grad`` (collective), warning once."""
        if not getattr(self, "_warned_reduce_again", False):
            names = [self._name(self.params[i]) for i in changed[:3]]
            warnings.warn(
                "DistributedMuon: p.grad changed after its reduction had read it (on this rank: "
                f"{names or 'none'}; clipping, masking, zeroing, or gradient accumulation "
                "without opt.no_sync()), so every gradient is reduced again from p.grad. Pass "
                "reduce_at='step', or use opt.clip_grad_norm_ and opt.no_sync(), to avoid the "
                "repeated traffic.",
                UserWarning,
                stacklevel=4,
            )
            self._warned_reduce_again = True
        self.reduction.reduce_again()

    def _update_owned_and_gather(self, present: list[bool]) -> list[tuple[Any, Any]]:
        """Update the owned matrices in waves along the owner stream and launch each bucket's
        all-gather as soon as this rank's slice of it is final, so the gathers of early buckets
        overlap the Newton–Schulz of later ones. Waves hold at most one update chunk
        (``self.memory.update_chunk_bytes``); every rank launches the same
        buckets in the same order, only the timing differs. Returns (work, copy back) pairs."""
        pending = []
        for stream in self.reduction.streams:
            self.reduction.write_fill_for_gather(stream)
            owned = stream.layout.owned[self.rank]
            budget = chunk_bytes_for(self.memory.update_chunk_bytes, stream.gather_in.device)
            sizes = [self.params[i].numel() * self.params[i].element_size() for i in owned]
            waves = [[owned[j] for j in wave] for wave in group_by_budget(sizes, budget)]
            next_bucket = 0
            for wave in waves:
                self._update_owned_matrices(present, only=set(wave))
                self.reduction.write_owned_for_gather(stream, wave)
                if not self.overlap_gather:
                    continue  # gathers launched below, after every stream's last wave
                last = wave[-1]
                ready = stream.layout.offsets[last] + stream.layout.numels[last]
                launched, next_bucket = self.reduction.launch_stream_gathers(
                    stream, next_bucket, ready, self.update_gather.apply_gathered
                )
                pending += launched
            if self.overlap_gather:
                launched, _ = self.reduction.launch_stream_gathers(
                    stream, next_bucket, stream.layout.length, self.update_gather.apply_gathered
                )
                pending += launched
        if not self.overlap_gather:
            for stream in self.reduction.streams:
                launched, _ = self.reduction.launch_stream_gathers(
                    stream, 0, stream.layout.length, self.update_gather.apply_gathered
                )
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
            targets = [self.state[self.params[i]].get("main_param", self.params[i]) for i in mine]
            grads = [self.reduction.reduced_grad(i, t.dtype) for i, t in zip(mine, targets)]
            self._update_group(group, targets, grads, apply_updates=self._owner_apply)
            for i, target in zip(mine, targets):
                if target is not self.params[i]:
                    self.params[i].copy_(target)  # rounded into the model's parameter

    def _update_adamw_shards(self, present: list[bool]) -> None:
        for group in self.param_groups:
            if group["algorithm"] != "adamw":
                continue
            indices = [self._index[id(p)] for p in group["params"] if present[self._index[id(p)]]]
            local = [i for i in indices if i in self.reduction.segments]
            for i in indices:
                if i not in self.reduction.segments:  # no local shard: only the step counter moves
                    self.state[self.params[i]]["step"] += 1
            if not local:
                continue
            states = [self.state[self.params[i]] for i in local]
            segments = [
                self._segment_of(self.params[i], self.reduction.segments[i][1]) for i in local
            ]
            # the tensors updated: main copies where kept, else the parameters' segments
            params = [s.get("main_param", seg) for s, seg in zip(states, segments)]
            grads = [self.reduction.reduced_shard_grad(i) for i in local]
            grads = [g if g.dtype == t.dtype else g.to(t.dtype) for g, t in zip(grads, params)]
            beta1, beta2 = group["betas"]
            functional.adamw(
                params,
                grads,
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states],
                [s["step"] for s in states],
                lr=float(group["lr"]),
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                max_chunk_bytes=self.memory.update_chunk_bytes,
            )
            for target, segment in zip(params, segments):
                if target is not segment:
                    segment.copy_(target)  # rounded into the model's parameter
