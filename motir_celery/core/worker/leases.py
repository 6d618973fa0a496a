"""The runs this process holds, and who renews their leases.

The runner holds each run from just before its claim (under a claim token
minted here) until its settle; ``hold`` costs no database round trip. The
renewals themselves — one fenced statement per lease length for every held
lease a third of its lease old (``Ledger``) — come from one of two places:

* **the worker's renewer** (``adapter/renewer.py``), a process of its own that
  each holding process tells of its holds over a Unix socket (``LeaseKeeper.use_renewer``,
  called by the worker's bootstep). No body can block it, whatever it does with
  its process's GIL. It stops renewing a process's claims when that process is
  gone (its socket closes: the leases run out and the sweeper reclaims the
  runs), and any claim held past its bound;
* **this process's engine thread** (``LeaseKeeper.renew_due``), when no renewer is set
  (the engine run outside a Celery worker) or while it is unreachable (a
  WARNING says so; the worker starts it again and the holds are told again).

The bound, stated plainly: with the renewer, a body that holds the GIL longer
than the lease costs nothing, to its own run or any other, as long as its
process lives and the attempt is within its bound (the job's ``time_limit=``,
else the worker's Celery time limit, else one hour); past the
bound its lease runs out. Without the renewer, the old bound holds: such a body
starves every thread of its process, heartbeats too, and past the lease the
runs of that process are reclaimed and their current steps run again.
"""

from __future__ import annotations

import logging
import math
import os
import select
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

from motir_celery.core.jobs import find_job
from motir_celery.forks import per_process
from motir_celery.store.sql import worker as worker_sql

if TYPE_CHECKING:
    from motir_celery.core.engine import Engine
    from motir_celery.store.pg import Pool

__all__ = ["Lease", "Ledger", "LeaseKeeper", "parse", "HOLD", "RELEASE", "HOLDER"]

log = logging.getLogger("motir_celery.leases")

#: The three lines of the holders' protocol (one line each, ASCII, space-separated):
#: ``P <pid>`` first, then ``H <run_id> <token> <lease s> <next renewal in s> <bound left s> <bound>``
#: and ``R <token>``.
HOLDER, HOLD, RELEASE = "P", "H", "R"


@dataclass
class Lease:
    """One claim's heartbeat: renewed every third of ``seconds`` until ``until``."""

    run_id: uuid.UUID
    token: uuid.UUID
    seconds: float
    #: time.monotonic() of the next renewal, and the instant past which it is not renewed.
    next_at: float
    until: float
    #: what ``until`` comes from, one word (a field of the protocol line): ``time_limit=600``,
    #: ``task_time_limit=900``, ``default_hold=3600s``
    bound: str
    #: renewed once at least: a refusal after that means the claim is gone (a refusal
    #: before may be a claim not committed yet: registered before it, kept until released)
    renewed: bool = False

    def line(self, now: float) -> str:
        return (f"{HOLD} {self.run_id} {self.token} {self.seconds!r} {max(0.0, self.next_at - now):.3f} "
                f"{max(0.0, self.until - now):.3f} {self.bound}\n")


def parse(line: str, now: float) -> Lease | uuid.UUID | int:
    """A protocol line: a ``Lease`` (hold), a token (release) or a pid (holder); ``ValueError`` otherwise."""
    parts = line.split()
    if len(parts) == 2 and parts[0] == HOLDER:
        return int(parts[1])
    if len(parts) == 2 and parts[0] == RELEASE:
        return uuid.UUID(parts[1])
    if len(parts) == 7 and parts[0] == HOLD:
        seconds, next_in, left = float(parts[3]), float(parts[4]), float(parts[5])
        if not (0 < seconds < math.inf and 0 <= next_in <= seconds and 0 <= left < math.inf):
            raise ValueError(f"lease {parts[3]!r}, next renewal {parts[4]!r} or bound {parts[5]!r} out of range")
        return Lease(uuid.UUID(parts[1]), uuid.UUID(parts[2]), seconds, now + next_in, now + left, parts[6])
    raise ValueError(f"not a holder's line: {line[:120]!r}")


class Ledger:
    """Leases to renew, and when. The renewer process keeps one for its worker, a
    holding process one for its own holds (told again after a reconnect, renewed
    from here while the renewer is away)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.leases: dict[uuid.UUID, Lease] = {}

    def add(self, lease: Lease) -> None:
        with self.lock:
            known = self.leases.get(lease.token)
            if known is not None:  # told again (a reconnect): keep what is known of it
                lease.renewed, lease.next_at = known.renewed, min(known.next_at, lease.next_at)
            self.leases[lease.token] = lease

    def drop(self, token: uuid.UUID) -> Lease | None:
        with self.lock:
            return self.leases.pop(token, None)

    def renew_due(self, engine: Callable[[], Pool], now: float | None = None) -> None:
        """Renew every lease that is due, one statement per lease length; forget the
        ones past their bound and the ones refused after a renewal."""
        now = time.monotonic() if now is None else now
        with self.lock:
            for lease in [lease for lease in self.leases.values() if lease.until <= now]:
                del self.leases[lease.token]
                log.warning("run %s: held past its bound (%s); its lease is no longer renewed and runs out "
                            "(the sweeper then reclaims the run)", lease.run_id, lease.bound)
            due = [lease for lease in self.leases.values() if lease.next_at <= now]
        if not due:
            return
        by_length: dict[float, list[Lease]] = {}
        for lease in due:
            by_length.setdefault(lease.seconds, []).append(lease)
        for seconds, group in by_length.items():
            with engine().begin() as conn:
                still = worker_sql.renew_claims(conn, [(lease.run_id, lease.token) for lease in group], seconds)
            with self.lock:
                for lease in group:
                    lease.next_at = now + seconds / 3
                    if lease.run_id in still:
                        lease.renewed = True
                    elif lease.renewed and self.leases.pop(lease.token, None) is not None:
                        # settled (its release is on its way), cancelled or reclaimed: the
                        # holder's next fenced write says which, where it matters
                        log.debug("run %s: lease not renewed (no longer held)", lease.run_id)


# --- this process's holds -------------------------------------------------------


class _Holds:
    """This process's holds, and its connection to the renewer (None: renewing here)."""

    def __init__(self) -> None:
        self.ledger = Ledger()
        self.lock = threading.Lock()  # the socket's: one line at a time, in order
        self.sock: socket.socket | None = None
        self.tried = False  # connected once, or tried: reconnects are the engine thread's
        self.outage = False  # renewing here because the renewer could not be reached (WARNING said)

    def tell(self, line: str) -> None:
        """Send one line to the renewer (the caller holds ``lock``); on any failure, renew here."""
        if self.sock is None:
            return
        try:
            self.sock.sendall(line.encode("ascii"))
        except OSError as exc:
            self._lost(f"cannot write to it: {exc}")

    def connect(self, path: str) -> None:
        """Connect and tell the renewer every hold (the caller holds ``lock``)."""
        self.tried = True
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(1.0)  # the renewer reads all the time; never wait on it for longer than this
        try:
            sock.connect(path)
            now = time.monotonic()
            with self.ledger.lock:
                lines = [lease.line(now) for lease in self.ledger.leases.values()]
            sock.sendall((f"{HOLDER} {os.getpid()}\n" + "".join(lines)).encode("ascii"))
        except OSError as exc:
            sock.close()
            if not self.outage:
                self.outage = True
                log.warning("the worker's lease renewer at %s cannot be reached (%s): this process renews "
                            "its runs' leases itself until it is back (a body holding the GIL past the lease "
                            "then costs the runs of this process their leases)", path, exc)
            return
        self.sock = sock
        _opened.append((os.getpid(), sock))
        if self.outage:
            self.outage = False
            log.info("the worker's lease renewer is back: it renews this process's %d lease(s) again", len(lines))

    def check(self) -> None:
        """Is the renewer still there? It never writes: a readable socket is its end (the caller holds ``lock``)."""
        if self.sock is None:
            return
        try:
            poller = select.poll()  # not select(): no limit on the descriptor's number
            poller.register(self.sock, select.POLLIN)
            if poller.poll(0) and not self.sock.recv(64, socket.MSG_DONTWAIT):
                self._lost("it closed the connection")
        except OSError as exc:
            self._lost(str(exc))

    def _lost(self, why: str) -> None:
        assert self.sock is not None
        _opened[:] = [(owner, sock) for owner, sock in _opened if sock is not self.sock]
        self.sock.close()
        self.sock = None
        self.outage = True
        with self.ledger.lock:
            for lease in self.ledger.leases.values():
                lease.next_at = 0.0  # when the renewer last renewed them is unknown: now
        log.warning("the worker's lease renewer is gone (%s): this process renews its runs' leases itself "
                    "until it is back", why)


#: (pid, socket) of every renewer connection made: a forked child closes its parent's
#: copies, or a dead parent's holds would stay open (and renewed) while the child lives.
_opened: list[tuple[int, socket.socket]] = []


def _close_inherited() -> None:
    pid = os.getpid()
    for owner, sock in _opened:
        if owner != pid:
            sock.close()  # this process's copy only: the parent's connection stays as it is
    _opened[:] = [(owner, sock) for owner, sock in _opened if owner == pid]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited)


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


class LeaseKeeper:
    """The engine's leases: the runs this process holds, and who renews them (the module docstring).

    The worker's bootstep tells it of the renewer (``use_renewer``) in the worker's main process,
    before its pool forks: a prefork child inherits the path, and makes its own holds (and its own
    connection to the renewer) on its first run."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._holds = per_process(_Holds)
        #: The worker's renewer socket; None: renew in process.
        self.renewer_path: str | None = None
        #: The worker's Celery time limit (``task_time_limit`` / ``--time-limit``), the bound of a
        #: job without a ``time_limit=`` of its own.
        self.worker_time_limit: float | None = None

    def use_renewer(self, path: str | None, *, time_limit: float | None = None) -> None:
        """Tell the worker's renewer at ``path`` of this process's holds (and its forked children's)."""
        self.renewer_path = path
        self.worker_time_limit = time_limit if _positive(time_limit) else None

    def bound(self, job_id: str) -> tuple[float, str]:
        """How long an attempt of ``job_id`` is renewed: the job's time limit, the worker's, or the setting."""
        job = find_job(job_id)
        limit = job.options.get("time_limit") if job is not None else None
        if isinstance(limit, (int, float)) and _positive(limit):
            return float(limit), f"time_limit={limit:g}"
        if self.worker_time_limit is not None:
            return self.worker_time_limit, f"task_time_limit={self.worker_time_limit:g}"
        hold = self._engine.settings.max_hold_seconds
        return hold, f"default_hold={hold:g}s"  # one word: a field of the holders' protocol line

    @contextmanager
    def hold(self, run_id: uuid.UUID, job_id: str) -> Iterator[uuid.UUID]:
        """Keep the lease of the claim of ``run_id`` made with the token yielded renewed while
        the block runs. Enter it before the claim: the lease is then renewed from the claim's
        commit on, whatever this process does after it (its GIL may be held by another thread)."""
        now = time.monotonic()
        seconds = self._engine.settings.lease_seconds
        bound, why = self.bound(job_id)
        lease = Lease(run_id, uuid.uuid4(), seconds, now + seconds / 3, now + bound, why)
        holds = self._holds()
        holds.ledger.add(lease)
        with holds.lock:
            if holds.sock is None and not holds.tried and self.renewer_path is not None:
                holds.connect(self.renewer_path)  # this process's first hold (reconnects: renew_due)
            holds.tell(lease.line(now))
        try:
            yield lease.token
        finally:
            holds.ledger.drop(lease.token)
            with holds.lock:
                holds.tell(f"{RELEASE} {lease.token}\n")

    def renew_due(self) -> None:
        """The engine thread's tick: keep in touch with the renewer, or renew the due leases here."""
        holds = self._holds()
        if self.renewer_path is not None:
            with holds.lock:
                holds.check()
                if holds.sock is None and (holds.tried or holds.ledger.leases):
                    holds.connect(self.renewer_path)
            if holds.sock is not None:
                return
        holds.ledger.renew_due(self._engine.side_pool)
