"""The parts of ``benchmarks/gpu.py`` (the driver), one module per section.

Every section is a function ``section_<name>(bench) -> dict`` that the driver
(``benchmarks/gpu.py``: flags, time guard, JSON writing) calls through ``Bench.run``. What a
section reads from ``bench``: ``device``, ``dtype``, ``smoke``, ``clock`` (a
:class:`~benchmarks.gpu_parts.timing.Clock`), ``guard`` (``.left()`` seconds), ``models`` (name ->
(n_layer, d_model, n_head)), ``matmul_rate`` (FLOP/s, set by the matmul section),
``cleanup()``, and for the Megatron leg ``args``, ``out_dir`` and ``results``.

* :mod:`.timing`       CUDA-event / perf_counter clock, interleaved medians, tables.
* :mod:`.models`       GPT-2 shapes, parameter sets, models, the optimizers compared.
* :mod:`.matmul`       measured bf16 matmul rate.
* :mod:`.correctness`  Triton symmetric kernel and fast NS vs float64 references.
* :mod:`.ns`           NS time per stacked shape.
* :mod:`.optimizer`    optimizer step on GPT-2 parameter sets vs the NS FLOP floor.
* :mod:`.e2e`          end-to-end tokens/s vs AdamW.
* :mod:`.memory`       peak memory and optimizer-state bytes vs AdamW.
* :mod:`.megatron_leg` ``benchmarks/megatron_gpu.py`` in a subprocess.
"""
