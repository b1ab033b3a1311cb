"""Running Megatron-Core's local (non-Transformer-Engine) GPT path on CPU, for tests, examples
and smoke runs (gloo). Two spots of megatron-core 0.19 are CUDA-only on that path:

* the attention scratch buffer comes from ``parallel_state``'s ``GlobalMemoryBuffer``, which
  allocates on the current CUDA device;
* the dropout RNG tracker forks the CUDA RNG state.

:func:`use_cpu_buffers` replaces both (process-wide; call it after
``parallel_state.initialize_model_parallel``). Nothing here is needed, or should be called, on
GPU.
"""

from __future__ import annotations

import torch

__all__ = ["use_cpu_buffers"]


def use_cpu_buffers() -> None:
    """Make Megatron-Core's local attention and dropout RNG work on CPU (see the module
    docstring)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.utils import GlobalMemoryBuffer

    class CPUBuffer(GlobalMemoryBuffer):
        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            return torch.empty(tensor_shape, dtype=dtype)

    ps._GLOBAL_MEMORY_BUFFER = CPUBuffer()
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
