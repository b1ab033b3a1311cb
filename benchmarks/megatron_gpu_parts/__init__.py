"""The parts of ``benchmarks/megatron_gpu.py`` (the entry point: docstring, config, flags, main).

* :mod:`.device`  CUDA synchronization and memory counters, and the CPU shims of ``--smoke``;
* :mod:`.model`   Megatron's ``GPTModel`` in ``Float16Module``, seeded, and the corpus batches;
* :mod:`.arms`    the contenders: model + optimizer + the gradient hooks of Megatron's loop;
* :mod:`.measure` one training step, the loss on the fixed batch, the phases of a run;
* :mod:`.report`  medians, tokens/s and ratios, sanity checks, the table and the JSON file.

Imported as ``benchmarks.megatron_gpu_parts``: run the script from the repository root with
``PYTHONPATH=.`` (see its docstring).
"""
