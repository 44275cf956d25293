"""Benchmarks and set-up scripts, run as ``python -m scripts.NAME``.

Importing ``services`` first turns gRPC's fork handlers off before any script imports grpc
(``services/__init__.py``): a script that imported grpc first and then started a stack had its
children abort at spawn (seen as "gateway exited with code -6" in bench_tracing_overhead).
"""
import services  # noqa: F401
