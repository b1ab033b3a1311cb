"""Benchmark scripts. Run each from the repository root with the repository on the import
path, e.g. ``PYTHONPATH=. python3 benchmarks/gpu.py --smoke``; helpers are imported as
``benchmarks.<module>`` (``benchmarks.gpu_parts``, ``benchmarks.megatron_gpu_parts``)."""
