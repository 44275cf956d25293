"""Child-process hygiene shared by ``tandem up`` and the throwaway redis-server."""
from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """``preexec_fn`` for ``subprocess.Popen``: Linux sends the child SIGTERM when its parent
    dies, even by SIGKILL, so no worker or redis-server outlives ``tandem up`` or a test run.
    A no-op where prctl is missing (the parent's own shutdown still stops its children)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
