"""What a process of ours leaves behind, removed when it ends (imports nothing of ds_infcl, no torch).

Cleanups go through :func:`at_exit` rather than ``atexit`` directly, because the entry points end
with ``ds_infcl.train.dist.exit_process``, which skips interpreter finalization (``os._exit``) and
with it every ``atexit`` handler; it runs :func:`run_exit_calls` instead. Users: the layout files of
``ds_infcl.ring.host_exchange`` in ``/dev/shm``, the extracted tree of ``ds_infcl.bench.base_tree``.
"""

from __future__ import annotations

import atexit
import sys

__all__ = ["at_exit", "run_exit_calls"]

_CALLS: list = []


def at_exit(fn, *args) -> None:
    """Run ``fn(*args)`` once when the process ends: at interpreter exit, or in
    :func:`run_exit_calls` (what ``exit_process`` runs), whichever comes first."""
    done = []

    def once():
        if not done:
            done.append(True)
            fn(*args)

    once.what = getattr(fn, "__qualname__", repr(fn))
    _CALLS.append(once)
    atexit.register(once)


def run_exit_calls() -> None:
    """Run the calls of :func:`at_exit` not yet run, last registered first (as ``atexit`` does).
    One that fails is reported on stderr and the others still run: a cleanup must not keep a
    process from exiting with its own code."""
    for call in reversed(_CALLS):
        try:
            call()
        except Exception as err:
            print(f"exit cleanup {call.what} failed: {err!r}", file=sys.stderr)
