"""Muon for Megatron-Core model chunks, exact under tensor parallelism.

    from muonscale.integrations.megatron import MegatronMuonConfig, megatron_muon

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model = GPTModel(...)                                   # Megatron-Core model chunk(s)
    opt = megatron_muon([model], MegatronMuonConfig(lr=3e-4, weight_decay=0.1))
    loss.backward(); opt.step(); opt.zero_grad()

Which parameter goes where (printed by ``opt.summary()``):

* ``is_embedding_or_output_parameter`` / ``shared_embedding`` / ``is_embedding_parameter``
  (Megatron's own flags, set by ``LanguageModule``), and every 0/1-D tensor → AdamW;
* learned position embeddings (an ``nn.Embedding`` without those flags) → AdamW;
* every other 2-D weight → Muon. ``linear_qkv.weight`` is orthogonalized as separate Q, K and
  V matrices (``muon_split_qkv``, by query group as laid out by Megatron, see
  :class:`muonscale.QKVLayout`) or one matrix per head (``qkv_split="head"``);
* expert weights (``allreduce=False``, or named ``...experts...`` as Megatron's optimizer tags
  ``expert_tp``): their TP group is the expert-tensor group, their data-parallel group the
  expert-data group.

One step on a TP group of T ranks (a *piece* is what a rank holds of one matrix)::

    G  ─(mean over the data-parallel group, unless Megatron's DDP already reduced main_grad)─▶
    B ← B.lerp(G, 1 − μ);  U = G.lerp(B, μ) or B          # per piece: elementwise
    U pieces ──all-to-all──▶ owner rank of each matrix: U = cat(pieces, partition_dim)
    owner:  O = s(m, n) · step(U)   (the matrix step on each whole matrix, at exactly one
                                     TP rank, batched by shape; s from the global shape)
    O ──all-to-all──▶ pieces;  W ← W (1 − η λ) − η O_piece
    row statistics of O ──all-reduce──▶ every TP rank steps its replica of the row state

So the update does not depend on the TP layout (``muon_tp_mode="exact"``, the default): a model
trained at TP = 2 ends where it ends at TP = 1. Megatron's own default (``--muon-tp-mode
blockwise``) runs Newton–Schulz on each rank's shard instead, which is a different, layout
dependent update; here it is available only by its name, ``"approximate_blockwise"``.

bf16 models get fp32 main copies (``main_params_dtype``), updated and written back each step;
one 8-byte all-reduce per step gives the global gradient norm over every rank (each gradient
counted once: ``opt.last_grad_norm``, clipped with ``clip_grad``) and makes every rank raise or
skip together on a NaN/inf anywhere (:mod:`.grad_norm`). Pipeline parallelism works per stage
when Megatron reduces the gradients (its DDP + ``finalize_model_grads``).

Data parallel (``dp_mode``): ``"zero1"`` is :class:`muonscale.DistributedMuon` on Megatron's DP
group (reduce-scatter to owner ranks, each matrix updated by one DP rank and its TP group,
ZeRO-1 AdamW, all-gather); ``"replicated"``: every DP replica runs the same deterministic step
on gradients reduced by Megatron's DDP (``main_grad``) or by one all-reduce here. The TP
all-to-alls use :class:`muonscale.distributed.exchange.PieceExchange`; every byte is counted
by :mod:`muonscale.distributed.comm` (``opt.last_step_wire_bytes`` / ``_breakdown``).
The row state and how checkpoints hold it: :mod:`.row_state`. Step metrics (what Muon did
each step) into Megatron's writers and ``log_string``: :func:`.step_log.log_step_metrics`.
"""

from .config import (
    DP_MODES,
    MEGATRON_COEFFICIENT_SETS,
    MEGATRON_FLAGS,
    MEGATRON_MATMUL_PRECISION,
    MEGATRON_SCALE_MODES,
    TP_MODES,
    MegatronMuonConfig,
    megatron_coefficients,
)
from .expert_zero1 import MegatronExpertZero1
from .factory import megatron_muon
from .optimizer import MegatronDistributedMuon, MegatronMuon
from .plan import MegatronGroups, ParamPlan, plan_parameters
from .step_log import log_step_metrics

__all__ = [
    "DP_MODES",
    "MEGATRON_COEFFICIENT_SETS",
    "MEGATRON_FLAGS",
    "MEGATRON_MATMUL_PRECISION",
    "MEGATRON_SCALE_MODES",
    "MegatronDistributedMuon",
    "MegatronExpertZero1",
    "MegatronGroups",
    "MegatronMuon",
    "MegatronMuonConfig",
    "ParamPlan",
    "TP_MODES",
    "log_step_metrics",
    "megatron_coefficients",
    "megatron_muon",
    "plan_parameters",
]
