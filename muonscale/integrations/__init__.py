"""Adapters for the training stacks people already run.

* :mod:`muonscale.integrations.hf` — Hugging Face ``Trainer`` optimizer factory.
* :mod:`muonscale.integrations.lightning` — ``LightningModule`` helpers.
* :mod:`muonscale.integrations.torchtitan` — ``OptimizersContainer`` with ``"MuonScale"``.
* :mod:`muonscale.integrations.megatron` — Megatron-Core model chunks, process groups and
  parameter attributes (needs ``megatron-core``, Python >= 3.12; imported lazily so that the
  rest of muonscale never depends on it).
"""

__all__ = ["megatron"]
