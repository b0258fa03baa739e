"""Whether a process still runs, for the places that watch one by its pid."""

from __future__ import annotations

import os
from pathlib import Path


def process_alive(pid: int) -> bool:
    """True while `pid` runs. A process of another user counts as running; one killed but not
    yet reaped (a zombie) counts as dead: it will never do anything again."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")
