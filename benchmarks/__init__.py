"""Benchmarks of kvstore: ``python -m benchmarks`` (see ``benchmarks.__main__``).

Every figure is a ratio to a limit measured in the same run (``benchmarks.harness``).
"""
