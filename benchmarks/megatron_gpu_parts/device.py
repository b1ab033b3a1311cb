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
    """(--smoke only) Megatron-Core's local path on CPU: see
    :func:`muonscale.integrations.megatron.cpu.use_cpu_buffers`."""
    from muonscale.integrations.megatron.cpu import use_cpu_buffers

    use_cpu_buffers()
