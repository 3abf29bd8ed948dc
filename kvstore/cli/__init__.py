"""The ``kvstore`` command (``main``): a program on top of the SDK.

``parser`` builds its arguments, ``format`` and ``render`` turn answers into text and
JSON, ``bench`` runs the quick benchmarks. It uses the SDK and the core only.
"""
