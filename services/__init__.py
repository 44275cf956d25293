"""Tandem's services. Importing the package turns gRPC's fork handlers off for the process.

``tandem up`` and the test harness start children with ``subprocess.Popen`` and a
``preexec_fn`` (``services.runtime.process.spawn``), so Python forks and runs fork handlers before
``exec``. With gRPC busy in the parent, grpcio 1.81+ restarts its epoll poller in the child, the
child's ``close_fds`` closes the poller's epoll descriptor, and the child aborts before ``exec``
(SIGABRT, "Epoll1Poller encountered epoll_wait error: Bad file descriptor"; grpc/grpc#43055).
Seen as a gateway exiting with -6 at start in one full test run; reproduced 1 in 400-2000
spawns. Nothing here forks without ``exec``, so the handlers are not needed. gRPC reads the
setting when it is imported, so it is set here, before any module of ours imports grpc; an
explicit ``GRPC_ENABLE_FORK_SUPPORT`` in the environment wins.
"""
import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
