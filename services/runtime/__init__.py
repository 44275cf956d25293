"""The process and runtime layer: what starts, runs and stops Tandem's processes.

``cli`` (the ``tandem`` command), ``serve`` (one process's entry: a gateway or a worker),
``launcher`` and ``supervisor`` (``tandem up``: start the pool, restart what dies), ``layout``
(which workers one machine runs), ``worker`` (the runtime a prefill, decode or unified worker
shares: engine loop, registry heartbeat, streams), ``drain`` (graceful shutdown), ``process``
(spawning children, free ports) and ``client`` (the small gRPC client of ``tandem chat``).
Nothing here is imported by the engine or the KV transports; the gateway imports ``drain`` only.
"""
