"""Clean stops on SIGTERM, SIGINT and SIGHUP: every rank stops at the same step boundary, saves a
checkpoint there (``checkpoint.on_signal``) and exits with ``128 + signal number``; no rank
outlives its launcher.

How a signal reaches the ranks:

- **To a rank** (a scheduler signalling every process, Ctrl-C in a terminal): the handler only
  records the signal. At each step boundary the ranks agree (``agree``: one all-reduce MAX of the
  recorded signal number, a 4-byte tensor), so a signal that reached one rank stops them all.
- **To DeepSpeed's launcher** (``deepspeed``): DeepSpeed 0.19 installs its handlers only for
  multi-node pdsh runs; a SIGTERM ends the ``deepspeed`` process and leaves its child
  (``deepspeed.launcher.launch``) and the ranks running. Each rank started by that launcher
  watches the launcher's parent (a thread, once a second): once it is gone the rank takes the
  SIGTERM path. ``deepspeed.launcher.launch`` itself forwards SIGTERM and SIGINT to the ranks
  (and SIGKILLs them 30 s later).
- **Launcher death** (killed, crashed): ranks under a launcher (``deepspeed.launcher.launch``,
  ``torchrun``) ask the kernel for a SIGTERM when their parent dies (``PR_SET_PDEATHSIG``) and
  take the same path.

A rank that has not left ``GRACE_S`` seconds after its first signal (a checkpoint write that long,
a collective waiting for a dead peer) leaves at once with ``128 + signal``. A second SIGINT (a
second Ctrl-C, one second or more after the first) leaves at once too; other repeats are ignored
(a scheduler and the launcher often both send SIGTERM). An ignored SIGHUP (``nohup``) stays
ignored. Handlers can only be installed from the main thread.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Optional

__all__ = ["StopOnSignal", "StopRun", "Vote", "GRACE_S", "SIGNALS"]

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
GRACE_S = 30.0
_PR_SET_PDEATHSIG = 1
_LAUNCHERS = (b"deepspeed.launcher.launch", b"torchrun", b"torch.distributed.run", b"torch.distributed.launch")


class StopRun(Exception):
    """Raised by the training loop after the ranks agreed to stop on a signal (and saved)."""

    def __init__(self, signum: int, step: int, tag: Optional[str] = None):
        self.signum, self.step, self.tag = signum, step, tag
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name} at step {step}" + (f", checkpoint {tag}" if tag else ""))

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ")
    except OSError:
        return b""


def _parent_of(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _prctl_pdeathsig(signum: int) -> bool:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux
        return False


class Vote:
    """A stop vote in flight (``StopOnSignal.vote``)."""

    def __init__(self, stop: "StopOnSignal", flag=None, event=None, work=None):
        self.stop, self.flag, self.event, self.work = stop, flag, event, work

    def agreed(self) -> bool:
        """Whether any rank had a signal when the vote was queued (one rank: has one now); the
        agreed signal is then ``stop.signum``."""
        if self.flag is None:
            value = self.stop.requested()
        else:
            if self.work is not None:
                self.work.wait()
            if self.event is not None:
                self.event.synchronize()
            value = int(self.flag[0])
        if value:
            self.stop.signum = value
        return bool(value)


class StopOnSignal:
    """Turn SIGTERM, SIGINT and SIGHUP into a stop at the next step boundary. ``grace_s``: how
    long after its first signal the process may still run (``None``: no limit, for tests).

    Example::

        stop = StopOnSignal(rank).install()
        try:
            while training:
                step()
                if stop.agree():          # every rank, every step
                    save(); raise StopRun(stop.signum, step)
        finally:
            stop.restore()
    """

    def __init__(self, rank: int = 0, grace_s: Optional[float] = GRACE_S, watch_period_s: float = 1.0):
        self.rank = rank
        self.grace_s = grace_s
        self.watch_period_s = watch_period_s
        self.signum = 0  # the agreed signal (``agree``) or this rank's own
        self._mine = 0
        self._first_at = 0.0
        self._previous = {}
        self._pdeathsig = False
        self._stop_watch = threading.Event()
        self._timer: Optional[threading.Timer] = None

    # -- set-up ------------------------------------------------------------------------------
    def install(self) -> "StopOnSignal":
        """Install the handlers (main thread only), the parent-death signal and the launcher watch."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("StopOnSignal.install: signal handlers can only be installed from the main thread")
        for sig in SIGNALS:
            previous = signal.getsignal(sig)
            if sig == signal.SIGHUP and previous == signal.SIG_IGN:
                continue  # nohup: the user asked for the run to outlive the terminal
            self._previous[sig] = previous
            signal.signal(sig, self._handle)
        parent = os.getppid()
        parent_cmd = _cmdline(parent)
        if any(name in parent_cmd for name in _LAUNCHERS):
            self._pdeathsig = _prctl_pdeathsig(signal.SIGTERM)
            if os.getppid() != parent:  # the launcher died before the request took effect
                self.trigger(signal.SIGTERM, "the launcher is gone")
        if b"deepspeed.launcher.launch" in parent_cmd:
            runner = _parent_of(parent)
            if runner is not None and runner > 1:
                threading.Thread(target=self._watch, args=(parent, runner), name="ds_infcl-launcher-watch",
                                 daemon=True).start()
        return self

    def restore(self) -> None:
        """Put the previous handlers back; stop the launcher watch and the parent-death signal."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
        self._stop_watch.set()  # the grace timer, started by a signal, keeps running: the process is leaving
        if self._pdeathsig:
            _prctl_pdeathsig(0)
            self._pdeathsig = False

    # -- the signal --------------------------------------------------------------------------
    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        if self._mine:
            if signum == signal.SIGINT == self._mine and time.monotonic() - self._first_at >= 1.0:
                os.write(2, f"[ds_infcl] rank {self.rank}: second SIGINT: leaving now\n".encode())
                os._exit(128 + signum)
            return
        self.trigger(signum, "received")

    def trigger(self, signum: int, why: str) -> None:
        """Record ``signum`` as if it had arrived (``why`` goes into the log line); starts the grace timer."""
        if self._mine:
            return
        self._mine = signum
        self._first_at = time.monotonic()
        name = signal.Signals(signum).name
        os.write(2, f"[ds_infcl] rank {self.rank}: {name} ({why}): stopping at the next step boundary\n".encode())
        if self.grace_s is not None:
            self._timer = threading.Timer(self.grace_s, self._leave)
            self._timer.daemon = True
            self._timer.start()

    def _leave(self) -> None:
        print(f"[ds_infcl] rank {self.rank}: still running {self.grace_s:g} s after "
              f"{signal.Signals(self._mine).name}; leaving now", file=sys.stderr, flush=True)
        os._exit(128 + self._mine)

    def _watch(self, launcher: int, runner: int) -> None:
        """``deepspeed``'s runner ended without forwarding anything: the launcher got a new parent."""
        while not self._stop_watch.wait(self.watch_period_s):
            if _parent_of(launcher) != runner:
                self.trigger(signal.SIGTERM, f"the deepspeed launcher (pid {runner}) is gone")
                return

    # -- at a step boundary ------------------------------------------------------------------
    def requested(self) -> int:
        """This rank's signal number (0: none)."""
        return self._mine

    def agree(self, group=None, device=None) -> bool:
        """Whether any rank got a signal: a collective (all ranks call it at the same step); the
        agreed signal is then ``signum`` (the largest number any rank got)."""
        return self.vote(group, device).agreed()

    def vote(self, group=None, device=None) -> "Vote":
        """``agree`` in two halves, for a loop that must not wait for the device at each step
        (``train/inflight.py``): the collective is queued now, behind the steps launched so far,
        and ``Vote.agreed()`` reads it, after the caller has launched the next step (on CUDA it
        then waits for the earlier steps alone). Every rank votes at the same step boundaries.
        With one rank nothing is queued: ``agreed()`` reads this rank's flag when called."""
        import torch
        import torch.distributed as tdist

        from ds_infcl.train.inflight import copy_to_host

        if not (tdist.is_available() and tdist.is_initialized() and tdist.get_world_size(group) > 1):
            return Vote(self)
        # torch.full fills on the device; torch.tensor([...], device=cuda) would copy from pageable
        # memory, which waits for every queued kernel
        flag = torch.full((1,), self._mine, dtype=torch.int32, device=device)
        if flag.device.type != "cuda":
            return Vote(self, flag, work=tdist.all_reduce(flag, op=tdist.ReduceOp.MAX, group=group, async_op=True))
        tdist.all_reduce(flag, op=tdist.ReduceOp.MAX, group=group)  # NCCL: queued, the host goes on
        return Vote(self, *copy_to_host(flag))
