"""Process limits a server raises for itself at start-up (never at import)."""

from __future__ import annotations

import logging

__all__ = ["raise_open_files_limit"]

logger = logging.getLogger(__name__)


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files (``RLIMIT_NOFILE``) to its hard limit; returns the soft
    limit now in force. A listener's connections are file descriptors: the higher the limit, the more
    connections it takes before ``accept`` fails (a platform without ``resource`` keeps its limit)."""
    try:
        import resource
    except ImportError:  # not POSIX
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        logger.warning("cannot raise the open-files limit from %d to %d: %s", soft, hard, exc)
        return soft
    return hard
