"""Directories named after the process that made them (``PREFIX`` + its pid + ``-...``), removed once that
process is gone: what a process killed with SIGKILL could not remove itself (memory tiers, launch notes,
a restore's objects shared on a node)."""
from __future__ import annotations

import os
import shutil


def remove_orphaned(parent: str, prefix: str) -> None:
    """Remove each directory of ``parent`` named ``prefix`` + a pid whose process is gone, if it is this user's."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        pid = name[len(prefix):].split("-", 1)[0]
        if not name.startswith(prefix) or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # its process still runs
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # another user's process
        path = os.path.join(parent, name)
        try:
            if os.stat(path).st_uid == os.getuid():
                shutil.rmtree(path, ignore_errors=True)
        except FileNotFoundError:
            pass  # removed meanwhile
