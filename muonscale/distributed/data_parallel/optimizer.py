"""``DistributedMuon``: data-parallel Muon with whole-matrix owners and ZeRO-1 AdamW.

The optimizer owns its collaborators: a :class:`~.layout.DataParallelLayout` (parameters,
owners, communicator), a :class:`~.reduction.BucketedReduction` (buffers, gradient hooks,
reduce-scatter and all-gather) and an :class:`~.update_gather.UpdateGather`; it overrides the
phases of :meth:`muonscale.Muon.step` (:mod:`.step`). ``clip_grad_norm_`` is in
:mod:`.grad_clip`, checkpoints in :mod:`.checkpoint`. DTensor parameters go to
:class:`~muonscale.distributed.dtensor.DTensorMuon` (:func:`muonscale.distributed_muon` picks
the class)."""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...matrices import MatrixView
from ...optimizer import Muon
from ...quantized_state import adamw_state_is_quantized
from ...settings import MuonSettings
from ...step_metrics import Reduction, StepMetrics
from ..comm import Communicator, WireCounter, combine_over_ranks
from ..setup_checks import check_process_group, unwrap_ddp
from . import checkpoint, gathers, grad_clip
from . import step as phases
from .buckets import ExpertRange, OwnedUnit, unit_param
from .deferred_gather import DeferredGather
from .layout import (
    DataParallelLayout,
    check_parameters,
    check_rebind,
    communicator,
    expected_readiness,
)
from .quantized_shards import ColumnPlacement, SharedBlockScales
from .reduction import BucketedReduction, ReduceAt, ReductionOptions
from .update_gather import UPDATE_DTYPE, UpdateGather, check_gather_updates, sends_update


@dataclass(frozen=True)
class AgreedGradients:
    """This step's gradients as every rank agreed on them: whether each parameter has one on
    some rank, and the first non-finite one's name (None: all finite)."""

    present: list[bool]
    nonfinite: str | None


class DistributedMuon(Muon):
    r"""Data-parallel Muon: each Muon matrix is orthogonalized whole by one owner rank (an
    expert stack's experts may go to several owners, a contiguous range each); AdamW
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
          2. all-reduce (max) of [has-gradient, non-finite] flags and of the backward
             passes since the last step: all ranks agree to raise / skip / go on
                                                       2(N−1)/N · (8·P + 12) bytes
          3. AdamW on the local shards and fill range (state for those only); 8-bit
             moments: all-reduce (max) of the C blocks that shard boundaries cut
             (:mod:`.quantized_shards`)                2(N−1)/N · 8·C bytes
             ──▶ all-gather of the flat buckets (async)
          4. Muon on owned matrices in waves along the owner stream (momentum, batched
             Newton–Schulz, update); each bucket's all-gather starts (async) as soon as its
             slice is final, overlapping the later waves          (N−1)/N · S
          5. wait, copy gathered parameters back (or, for gathered bf16 updates, every rank
             applies W ← W·(1 − lr λ) + lr α U with the step's lr: ``gather_updates``);
             ``defer_gather``: launched in forward order, landed in the next forward

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
        gather_updates: what the owner of a Muon matrix sends back (:mod:`.update_gather`).
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
        defer_gather: leave the parameter all-gathers of ``step()`` in flight, each waited for
            in the next forward when a module first needs its parameters
            (:mod:`.deferred_gather`); bitwise the same parameters. Needs the model. Code that
            reads or writes parameters before that forward calls ``opt.wait_for_parameters()``.
        model: the model whose forward reads the parameters (``defer_gather``; default:
            ``params`` when that is the model).
        **muon_options: every :class:`muonscale.Muon` option, as keywords.

    Attributes:
        layout: the :class:`~muonscale.distributed.data_parallel.DataParallelLayout`: every
            parameter in param-group order (``params``; ``group_of[i]`` is the group of
            ``params[i]``, ``muon_indices`` / ``adamw_indices`` index into it, ``owner_rank``
            maps each Muon index owned whole to its owner (a stack spread over several
            owners has no entry), ``expert_ranges`` each expert
            stack spread over several owners to its ranges of experts, ``index_of(p)`` is
            ``p``'s index), the communicator, ``rank`` and ``world_size``; the optimizer
            reads them through.
        reduction: the :class:`~muonscale.distributed.data_parallel.BucketedReduction`
            (buffers, hooks, reduce-scatter, all-gather, the AdamW shard state).

    ``state_dict()`` (collective) returns the **full** state keyed exactly like
    :class:`muonscale.Muon`'s, so a checkpoint loads at any world size (:mod:`.checkpoint`);
    ``load_state_dict()`` keeps the local part. Saving on one rank only: every rank calls
    ``prepare_state_dict()`` first.

    Construction is collective: every rank must hold the same parameter list with the same
    initial values (two checksums per parameter; a difference is refused by name), and each
    rank's host is learned (``host_map``).

    A rank that fails inside ``step()`` makes the others fail in their next collective after
    at most the process-group timeout (``init_process_group(timeout=...)``), with a
    :class:`~muonscale.distributed.CollectiveError` that says so.
    """

    _HOLDS_OWN_STATE = True
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
        defer_gather: bool = False,
        model: torch.nn.Module | None = None,
        **muon_options: Any,
    ) -> None:
        check_gather_updates(gather_updates)
        if not isinstance(defer_gather, bool):
            raise ValueError(f"defer_gather must be True or False, got {defer_gather!r}")
        if not isinstance(overlap_gather, bool):
            raise ValueError(f"overlap_gather must be True or False, got {overlap_gather!r}")
        self.overlap_gather = overlap_gather
        check_process_group(process_group, "DistributedMuon")
        params, wrapped = unwrap_ddp(params)
        model = model if model is not None else params
        if defer_gather and not isinstance(model, torch.nn.Module):
            raise ValueError(
                "defer_gather=True needs the model (DistributedMuon(model, ...) or model=...): "
                "its gathers are waited for in forward pre-hooks of the modules that hold the "
                "parameters, and named_parameters() gives no modules to hook"
            )
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
        super().__init__(params, **muon_options)
        comm = communicator(process_group, wire_counter or WireCounter(), host_map)
        self.layout = DataParallelLayout(self.param_groups, comm, self._matrix_view)
        layout = self.layout
        names = [self._name(p) for p in layout.params]
        name_of = _weak_method(self._name)  # collaborators never keep the optimizer alive
        agreed_options = {
            "reduce_dtype": reduce_dtype,
            "main_params_dtype": main_params_dtype,
            "bucket_cap_mb": float(bucket_cap_mb),
            "reduce_at": reduce_at,
            "overlap_gather": overlap_gather,
            "gather_updates": gather_updates,
            "defer_gather": defer_gather,
        }
        check_parameters(
            comm, layout.params, layout.group_of, names, self._sends_update, agreed_options
        )
        quantized_adamw = frozenset(
            i
            for i in layout.adamw_indices
            if layout.group_of[i].get("state_precision", "param") != "param"
        )
        self.reduction = BucketedReduction(
            layout.params,
            options,
            muon=layout.muon_indices,
            adamw=layout.adamw_indices,
            owner_rank=layout.owner_rank,
            expert_ranges=layout.expert_ranges,
            comm=comm,
            name_of=name_of,
            update_params=frozenset(
                i
                for i in layout.muon_indices
                if self._sends_update(layout.params[i], layout.group_of[i])
            ),
            update_dtype=UPDATE_DTYPE,
            readiness=expected_readiness(layout.params, model, self.param_table.names),
            quantized_adamw=quantized_adamw,
        )
        starts = self.reduction.segment_starts()
        self.block_scales = SharedBlockScales(
            {i: layout.params[i].shape for i in quantized_adamw},
            {i: starts.get(i, []) for i in quantized_adamw},
            {
                i: (seg.param_start, seg.length)
                for i, (_, seg) in self.reduction.segments.items()
                if i in quantized_adamw
            },
            comm,
            {
                i: place
                for i in quantized_adamw
                for place in [self._column_placement(layout.params[i])]
                if place is not None
            },
        )
        """The 8-bit AdamW segments and their shared block scales (:mod:`.quantized_shards`)."""
        self.update_gather = UpdateGather(self.reduction, gather_updates, name_of)
        self._owner_apply = None  # Muon's last pass on owners: as usual, or sending updates
        if self.update_gather.gathered_units:
            self._owner_apply = self.update_gather.owner_apply(layout.unit_of)
        layout.init_local_state(self.state, self.reduction, self._matrix_view, self.block_scales)
        self.deferred: DeferredGather | None = None
        """The gathers left in flight by ``step()`` and their model hooks (``defer_gather``)."""
        if defer_gather:
            self.deferred = DeferredGather(unwrap_ddp(model)[0], layout.params, comm, names)
            self.reduction.before_reduce = self.deferred.wait_all
            # the gathers in flight land before this optimizer goes (collected, or at exit)
            weakref.finalize(self, _land_and_detach, self.deferred)
        self.last_step_wire_bytes = 0
        self.last_step_wire_breakdown: dict[str, int] = {}
        self.last_step_wire_links: dict[str, int] = WireCounter().by_link()
        self._prepared_state: dict[int, dict[str, torch.Tensor]] | None = None

    # ================================================================ the layout, read through
    @property
    def comm(self) -> Communicator:
        """The data-parallel group's communicator."""
        return self.layout.comm

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def params(self) -> list[torch.Tensor]:
        """Every parameter, in param-group order: the indices of the attributes below."""
        return self.layout.params

    @property
    def group_of(self) -> list[dict[str, Any]]:
        return self.layout.group_of

    @property
    def muon_indices(self) -> list[int]:
        return self.layout.muon_indices

    @property
    def adamw_indices(self) -> list[int]:
        return self.layout.adamw_indices

    @property
    def owner_rank(self) -> dict[int, int]:
        """Owner rank of each Muon index owned whole; the stacks spread over several owners
        are in :attr:`expert_ranges` instead."""
        return self.layout.owner_rank

    @property
    def expert_ranges(self) -> dict[int, list[ExpertRange]]:
        """The expert stacks spread over several owners: Muon index -> its ranges of experts,
        one per owner (:class:`~muonscale.distributed.data_parallel.buckets.ExpertRange`)."""
        return self.layout.expert_ranges

    @property
    def matrix_shapes_by_index(self) -> dict[int, list[tuple[int, int]]]:
        return self.layout.matrix_shapes_by_index

    def index_of(self, p: torch.Tensor) -> int:
        """Position of parameter ``p`` in :attr:`params`."""
        return self.layout.index_of(p)

    def model_param(self, p: torch.Tensor) -> torch.Tensor:
        """The model parameter that ``p`` (a main copy, or the parameter itself) stands for."""
        layout = self.__dict__.get("layout")  # None while Muon's constructor routes
        return p if layout is None else layout.model_param(p)

    # ================================================================ construction
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "reduction"):
            raise NotImplementedError(
                "DistributedMuon: parameters are fixed at construction (owners and buckets are "
                "planned once, on every rank); build a new optimizer instead"
            )
        super().add_param_group(param_group)

    def _check_rebind(self, slots: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.wait_for_parameters()  # the gathers copy into the parameters bound now
        names = [self._name(p) for p in self.params]
        check_rebind(self.params, [new for _, new in slots], names)

    @classmethod
    def _accepts_quantized_state(cls) -> bool:
        """The owners' Muon momentum is quantized whole (each owner holds whole matrices or
        whole experts, so whole rows); AdamW's 8-bit segments share the absmax of the blocks
        their shard boundaries cut (:mod:`.quantized_shards`)."""
        return cls is DistributedMuon

    def _after_rebind(self, slots: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Follow new parameter objects: the layout, the reduction's parameters and its
        gradient hooks."""
        self.layout.rebind_groups(self.param_groups, [new for _, new in slots])
        self.reduction.rebind(self.params)

    def _init_state(
        self, p: torch.Tensor, group: Mapping[str, Any], settings: MuonSettings | None = None
    ) -> dict[str, torch.Tensor]:
        """State is created at construction (owned Muon matrices, local AdamW shards); a main
        copy's state is its model parameter's."""
        return self.state[self.model_param(p)]

    def _matrix_view(self, p: torch.Tensor, group: Mapping[str, Any]) -> MatrixView:
        layout = self.__dict__.get("layout")  # None while the layout is being built
        owned = None if layout is None else layout.range_of(p)
        if owned is not None:  # a range of a stack's experts: its sub-stack's view
            return layout.range_view(owned)
        return super()._matrix_view(self.model_param(p), group)

    def _name(self, p: torch.Tensor) -> str:
        return super()._name(self.model_param(p))

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
        """Detach the gradient hooks (the optimizer no longer reduces during backward) and,
        with ``defer_gather``, the model's hooks (after the gathers in flight landed)."""
        self.reduction.remove_hooks()
        if self.deferred is not None:
            self.deferred.remove_hooks()

    def finish(self) -> None:
        """End of training: land the gathers the last ``step()`` left in flight and detach
        every hook (``with DistributedMuon(...) as opt:`` calls it on exit). The parameters
        are then final on every rank; the optimizer takes no further step."""
        self.remove_hooks()

    def __enter__(self) -> DistributedMuon:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.finish()

    def wait_for_parameters(self) -> None:
        """With ``defer_gather``: land every gather the last ``step()`` left in flight, so the
        parameters can be read or written (the forward and the optimizer's own readers and
        writers do this themselves). Without: nothing to do."""
        deferred = self.__dict__.get("deferred")  # None until construction made it
        if deferred is not None:
            deferred.wait_all()

    @property
    def gather_wait_seconds(self) -> float:
        """Seconds spent waiting for the last ``step()``'s deferred gathers (forward pre-hooks
        and other waits); 0 without ``defer_gather``."""
        return self.deferred.wait_seconds if self.deferred is not None else 0.0

    def summary(self) -> str:
        self.wait_for_parameters()
        return super().summary()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the averaged gradient by its global norm (collective); returns the norm.

        Same result as ``torch.nn.utils.clip_grad_norm_`` on the averaged gradients of every
        parameter in one process. ``p.grad`` (local) is not touched: the reduced gradients that
        ``step()`` uses are scaled (:mod:`.grad_clip`), so call it last before ``step()``
        (a later edit of ``p.grad`` makes ``step()`` reduce again, unclipped)."""
        self.wait_for_parameters()
        if self.reduction.options.reduce_at == "backward":  # reductions may predate an edit
            self.reduction.finish()
            changed = self.reduction.grads_changed()
            flag = torch.tensor([int(bool(changed))], dtype=torch.int32, device=self.comm.device)
            self.comm.all_reduce(flag, op=dist.ReduceOp.MAX, tag="control")
            if bool(flag):
                self._reduce_again(changed)
        return grad_clip.clip_grad_norm_(self.reduction, self.comm, max_norm, norm_type)

    def state_dict(self) -> dict[str, Any]:
        """Full state, keyed like :class:`muonscale.Muon`'s (:mod:`.checkpoint`).
        Collective: call on every rank, unless :meth:`prepare_state_dict` ran since the last
        ``step()``."""
        self.wait_for_parameters()
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
        self.wait_for_parameters()
        self._prepared_state = None
        self._prepared_state = self._gather_state()

    def _gather_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """The full state, gathered from the owners (collective; a subclass hook)."""
        return checkpoint.gather_full_state(
            self.layout,
            self.reduction,
            self.state,
            self.param_table,
            self.block_scales,
            self._held_state_shape,
        )

    def _column_placement(self, p: torch.Tensor) -> ColumnPlacement | None:
        """Where AdamW parameter ``p`` lies in the one row of a whole tensor it is a piece of,
        when it is one whose blocks are that row's (:mod:`.quantized_shards`); None: its blocks
        are its own (a subclass hook)."""
        return None

    def _held_state_shape(
        self, p: torch.Tensor, group: Mapping[str, Any], key: str, shape: tuple[int, ...]
    ) -> tuple[int, ...]:
        """The shape an owner holds state ``key`` of Muon parameter ``p`` in (``shape``: its
        declared shape; a subclass hook)."""
        return shape

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load full state (from this class, :class:`muonscale.Muon`, or DCP's
        ``set_state_dict``); every rank keeps its part. No collectives. torch's
        ``load_state_dict`` pre- and post-hooks run around it, through the base class."""
        self.wait_for_parameters()
        self._prepared_state = None
        super().load_state_dict(state_dict)

    def _load_held_state(self, state_dict: dict[str, Any]) -> None:
        checkpoint.load_full_state(
            self.layout,
            self.reduction,
            self.state,
            self.param_table,
            self.block_scales,
            state_dict,
        )

    def _after_held_state_load(self) -> None:
        self.layout.rebind_groups(self.param_groups, self.params)

    def ownership_table(self) -> str:
        """Which rank owns which Muon parameter, with NS FLOPs and elements per rank."""
        names = [self._name(self.params[i]) for i in self.muon_indices]
        return self.layout.ownership_table(names, self.reduction)

    def layout_stats(self) -> dict[str, Any]:
        """Owner layout figures per rank and over the owner streams
        (:meth:`.DataParallelLayout.stats`)."""
        return self.layout.stats(self.reduction)

    # ================================================================ step phases
    def _begin_step(self) -> Sequence[Any]:
        self._prepared_state = None  # the state is about to change
        self.wait_for_parameters()  # a second step() without a forward
        if self.step_metrics is not None:  # the wait for the last step's gathers, all landed
            self.step_metrics.add("gather_wait_seconds", self.gather_wait_seconds, "max")
        return ()

    def _step_gradients(self) -> AgreedGradients:  # type: ignore[override]
        """Finish the reductions backward did not, then agree across ranks on which gradients
        exist and are finite; a ``p.grad`` changed after its reduction on some rank makes
        every rank reduce again first (:func:`.step.gradient_flags`)."""
        self.reduction.finish()
        check = self.nonfinite != "ignore"
        while True:
            present, bad, changed = phases.gradient_flags(
                self.params, self.reduction, self.comm, check
            )
            if changed is None:
                name = None if bad is None else self._name(self.params[bad])
                return AgreedGradients(present, name)
            self._reduce_again(changed)

    def _check_gradients(self, grads: AgreedGradients) -> str | None:  # type: ignore[override]
        return grads.nonfinite

    def _apply_updates(  # type: ignore[override]
        self, grads: AgreedGradients, from_backward: Sequence[Any] = (), step_ok=None
    ) -> None:
        """AdamW on the local shards, the owned matrices in waves, and the gathers of the
        updated parameters (or of the owners' updates), landed now or in the next forward."""
        present = grads.present
        self.update_gather.capture(self.layout, self.param_table, present)  # lr, decay now
        chunk = self.memory.update_chunk_bytes
        phases.update_adamw_shards(
            self.layout, self.reduction, self.state, present, chunk, self.block_scales
        )
        if self.step_metrics is not None:
            self._record_adamw_shards(self.step_metrics, present)
        wave = functools.partial(self._update_owned_units, present)
        apply = self.update_gather.apply_gathered
        if self.deferred is not None:  # landed in the next forward's pre-hooks
            position = self.deferred.forward_position
            pending = phases.update_owned_and_gather_in_forward_order(
                self.layout, self.reduction, wave, apply, chunk, position
            )
            self.deferred.hand_off(pending)
        else:
            adamw_gathers = gathers.launch_flat_gathers(self.reduction)
            muon_gathers = phases.update_owned_and_gather(
                self.layout, self.reduction, wave, apply, chunk, self.overlap_gather
            )
            gathers.wait_and_copy_back(self.reduction, adamw_gathers + muon_gathers)

    def _end_step(self) -> None:
        super()._end_step()
        self.reduction.start_cycle()
        self.last_step_wire_links = self.comm.counter.by_link()
        self.last_step_wire_bytes, self.last_step_wire_breakdown = self.comm.counter.take()
        if self.step_metrics is not None:
            self.step_metrics.add("wire_bytes", self.last_step_wire_bytes, "sum")

    # ================================================================ step metrics
    def _count_step(self, metrics: StepMetrics, grads: AgreedGradients, ran: bool) -> None:
        present = grads.present
        stepped = lambda p: ran and present[self.index_of(p)]  # noqa: E731
        metrics.count_step(self.param_groups, stepped, self._logical_numel)

    def _record_adamw_shards(self, metrics: StepMetrics, present: list[bool]) -> None:
        """The AdamW updates of this rank's segments (the owners' Muon updates pass through
        :meth:`_update_group`)."""
        for group in self.param_groups:
            if group["algorithm"] != "adamw":
                continue
            local = [self.index_of(p) for p in group["params"]]
            local = [i for i in local if present[i] and i in self.reduction.segments]
            if local:
                states = [
                    self.block_scales.moment_values(i, self.state[self.params[i]])
                    if adamw_state_is_quantized(self.state[self.params[i]])
                    else self.state[self.params[i]]
                    for i in local
                ]
                metrics.record_adamw(self._group_label(group), group, states)

    def _metrics_reduction(self) -> Reduction:
        return lambda values, ops: combine_over_ranks(values, ops, self.comm.group)

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

    def _update_owned_units(self, present: list[bool], only: set[OwnedUnit] | None = None) -> None:
        """Muon step of the owned units (those in ``only``, when given): parameters owned
        whole and this rank's ranges of experts."""
        layout = self.layout
        for group in self.param_groups:
            if group["algorithm"] != "muon":
                continue
            indices = [self.index_of(p) for p in group["params"]]
            mine = [
                u
                for u in map(layout.owned_unit, indices)
                if u is not None and present[unit_param(u)] and (only is None or u in only)
            ]
            # the tensors updated: main copies where kept, else the parameters (or their
            # ranges of experts) themselves
            owned = [self.reduction.owned_slice(u) for u in mine]
            targets = [
                self.state[self.params[unit_param(u)]].get("main_param", t)
                for u, t in zip(mine, owned)
            ]
            grads = [self.reduction.reduced_grad(u, t.dtype) for u, t in zip(mine, targets)]
            with layout.stepping(mine, targets):
                self._update_group(group, targets, grads, apply_updates=self._owner_apply)
            for target, model in zip(targets, owned):
                if target is not model:
                    model.copy_(target)  # rounded into the model's parameter


def _land_and_detach(deferred: DeferredGather) -> None:
    """Finalizer of a ``defer_gather`` optimizer: its last gathers land in the parameters, so
    that the replicas never diverge because the optimizer went away first."""
    try:
        deferred.remove_hooks()
    except Exception as error:  # at interpreter exit the process group may be gone already
        warnings.warn(
            f"DistributedMuon (defer_gather=True) went away with gathers in flight that could "
            f"not land ({error}); call opt.finish() after the last step",
            RuntimeWarning,
            stacklevel=1,
        )


def _weak_method(method: Callable[..., str]) -> Callable[..., str]:
    """``method`` without a strong reference to its object (the optimizer's collaborators name
    parameters through it, and must not keep the optimizer from being collected)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> str:
        bound = ref()
        return "<parameter>" if bound is None else bound(*args)

    return call
