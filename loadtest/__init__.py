"""Load generation and benchmarks: ``tandem bench online`` (a running stack) and ``offline``."""
