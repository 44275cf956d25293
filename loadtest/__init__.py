"""Load generation and benchmarks: ``tandem bench online`` (a running stack) and ``offline``."""
import services  # noqa: F401,E402  (turns gRPC's fork handlers off before grpc is imported)
