"""Device helpers: the only CUDA-specific calls of the script, and the CPU shims of ``--smoke``."""

from __future__ import annotations

import os

import torch


class Device:
    """Synchronization and memory counters: CUDA's on GPU, no-ops / peak RSS on CPU."""

    def __init__(self, smoke: bool) -> None:
        self.cuda = not smoke
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.torch_device = torch.device("cuda", local_rank) if self.cuda else torch.device("cpu")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def allocated(self) -> int:
        return torch.cuda.memory_allocated() if self.cuda else 0

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int:
        if self.cuda:
            return torch.cuda.max_memory_allocated()
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def name(self) -> str:
        return torch.cuda.get_device_name() if self.cuda else "cpu"


def cpu_shims() -> None:
    """(--smoke only) Megatron-Core's local attention takes its scratch buffer from a CUDA-only
    ``GlobalMemoryBuffer`` and forks the CUDA RNG for dropout; replace both on CPU."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.utils import GlobalMemoryBuffer

    class CPUBuffer(GlobalMemoryBuffer):
        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            return torch.empty(tensor_shape, dtype=dtype)

    ps._GLOBAL_MEMORY_BUFFER = CPUBuffer()
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
