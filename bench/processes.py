"""Processes a GPU bench starts must end with it: a step that times out leaves nothing behind on the GPU.

torch.distributed.run starts each worker in a new session (`start_new_session=True`), so `timeout`'s signal to the
step's process group never reaches them, and a killed launcher leaves them running. A worker that calls
`die_with_parent()` first gets SIGKILL from the kernel as soon as its parent (the launcher) exits.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Has the kernel send `sig` to this process when its parent exits (Linux); returns whether that is set up.
    Exits at once if the parent is already gone (the request would then never fire)."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(error)}")
    if os.getppid() != parent:  # the parent exited before the request was made
        os._exit(1)
    return True
