"""The worker's renewer: where a worker's leases are renewed, away from every body.

A step body that holds its process's GIL (a C call that never lets go of it)
freezes every thread of that process, the heartbeat's too. So a worker's leases
are renewed from a process that runs no body, started by the worker's bootstep
(``Supervisor``, in ``adapter/worker.py``). Under prefork that is the worker's
main process itself (its pool children run the bodies): the renewer is a thread
there, and a worker has no process more than Celery's (a process of its own cost
~60 MB of RSS a worker: docs/performance.md). Under solo and threads, whose main
process runs the bodies, it is a small process of its own. Each process of the
worker that holds runs (the main one under solo and threads, each child under
prefork) keeps a connection to its Unix socket, in a directory only the worker's
user may enter, and writes one line per claim it holds and releases
(``core/worker/leases.py``; no database round trip on a run's path). The renewer
reads those lines a tenth of a second at a time (``READ_EVERY``, at most a thirtieth of
the lease), not as each arrives: a busy worker's runs cost it a wake-up a period rather
than two a run (docs/performance.md, "Ablation"), and a run shorter than a period is
never in its ledger (its hold and release cancel out). What that costs, stated plainly:
a hold is taken as written at the previous read, so its first renewal is never later
than if read at once (earlier by up to a period and a second); a holder that died is
seen, and its leases no longer renewed, up to a period later than before.

A connection per holding process, rather than a file or shared memory, because
the kernel closes it when that process dies, however it dies: the renewer then
forgets that process's claims at once (their leases run out and the sweeper
reclaims the runs, as when nothing renewed them), with no pid to poll or to be
reused, and no lock shared between processes. (A pool child forked from the main
process closes its copies of the renewer's sockets at once: when the renewer's end
of a connection closes, its thread started again or the main process gone, the
holder sees it, with no child keeping it open.) The rest it renews in one
fenced statement per lease length (``worker_sql.renew_claims``), each claim until
its bound. Its process ignores SIGINT and SIGTERM (a warm shutdown's runs still
need their heartbeats) and ends when its worker's main process does; its thread
ends with that process. If it dies anyway, the holders renew their leases
themselves (WARNING) until the worker's engine thread has started it again, and
then tell it of their claims again.
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field

from motir_celery.core.engine import Engine
from motir_celery.core.worker import leases

__all__ = ["Supervisor", "Renewer", "main"]

log = logging.getLogger("motir_celery.renewer")

#: How long the worker waits for a renewer it started to listen.
READY_TIMEOUT = 15.0
#: How long the renewer's reader sleeps between two reads of its holders' lines (at most a
#: thirtieth of the lease).
READ_EVERY = 0.1
#: A line longer than this is no holder's: the connection is closed (its holder then tells again).
MAX_LINE = 1024
#: The renewers' socket directories, under the temporary directory; one nobody has listened in
#: for this long (its worker killed with its renewer) is removed by the next worker to start.
PREFIX, STALE_AFTER = "motir-renewer-", 60.0


@dataclass
class _Holder:
    sock: socket.socket
    pid: int | None = None
    buffer: bytes = b""
    tokens: set[uuid.UUID] = field(default_factory=set)


class Renewer:
    """The renewer process's loop: holders' lines in on one thread, renewals on the other."""

    def __init__(self, path: str, worker_pid: int, engine: Engine) -> None:
        self.path = path
        self.engine = engine
        self.worker_pid = worker_pid
        self.holders: list[_Holder] = []
        self.ledger = leases.Ledger()
        self.selector = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Made again if gone (removed as stale by another worker while no renewer listened here).
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        try:
            os.unlink(path)  # a renewer before this one that died
        except FileNotFoundError:
            pass
        self.listener.bind(path)
        self.listener.listen(128)
        self.listener.setblocking(False)
        self.selector.register(self.listener, selectors.EVENT_READ, None)

    def serve(self, *, watch_parent: bool = True) -> None:
        """Renew while the worker's main process is this process's parent (``watch_parent``),
        or for as long as this process lives (a thread of that main process)."""
        threading.Thread(target=self._read, name="motir-renewer-reader", daemon=True).start()
        lease_seconds = self.engine.settings.lease_seconds
        log.info("lease renewer for worker pid %d listening at %s", self.worker_pid, self.path)
        while not watch_parent or os.getppid() == self.worker_pid:
            try:
                self.ledger.renew_due(self.engine.side_pool)
            except Exception:  # noqa: BLE001 — a database blip: next tick
                log.warning("lease renewal failed", exc_info=True)
            with self.ledger.lock:
                shortest = min([lease_seconds, *(lease.seconds for lease in self.ledger.leases.values())])
            time.sleep(min(1.0, shortest / 6))  # a renewal due at lease / 3 is never late by more than lease / 6
        log.info("lease renewer: worker pid %d is gone; exiting", self.worker_pid)
        try:
            os.unlink(self.path)
            os.rmdir(os.path.dirname(self.path))
        except OSError:
            pass

    def close_sockets(self) -> None:
        """Close its sockets without touching its state: in a pool child forked from the process
        it runs in (the child's copies), or in that process when its thread has ended."""
        for sock in [self.listener, *(holder.sock for holder in self.holders)]:
            try:
                sock.close()
            except OSError:
                pass
        try:
            self.selector.close()
        except OSError:
            pass

    def _read(self) -> None:
        lease_seconds = self.engine.settings.lease_seconds
        # Each read takes every line waiting; between two it sleeps READ_EVERY (a fraction of the
        # lease at most), so a busy worker's holds and releases cost a wake-up a period, not two a run.
        every, wait = min(READ_EVERY, lease_seconds / 30), min(1.0, lease_seconds / 6)
        before = time.monotonic()
        while True:
            try:
                ready = self.selector.select(timeout=wait)
            except (OSError, ValueError):  # closed (close_sockets): this renewer is done
                return
            now = time.monotonic()
            for key, _ in ready:
                if key.data is None:
                    self._accept()
                else:
                    # A line read now was written after the previous read: taken as written then,
                    # its renewal comes no later than if it had been read at once (earlier by up to
                    # a read period and a wait).
                    self._receive(key.data, before)
            before = now
            if ready:
                time.sleep(every)

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except BlockingIOError:
            return
        sock.setblocking(False)
        holder = _Holder(sock)
        self.holders.append(holder)
        self.selector.register(sock, selectors.EVENT_READ, holder)

    def _receive(self, holder: _Holder, written: float) -> None:
        try:
            data = holder.sock.recv(1 << 18)  # all a socket holds: what waits was written after the previous read
        except BlockingIOError:
            return
        except OSError as exc:
            self._gone(holder, str(exc))
            return
        if not data:
            self._gone(holder, "its connection closed")
            return
        *lines, holder.buffer = (holder.buffer + data).split(b"\n")
        # A hold released within the same read (a run shorter than a read period: most of them)
        # never reaches the ledger: its two lines cancel out, unparsed.
        released = {raw[2:] for raw in lines if raw[:2] == b"R "}
        cancelled: set[bytes] = set()
        for raw in lines:
            if released:
                if raw[:2] == b"H ":
                    token = raw.split(b" ", 3)[2:3]
                    if token and token[0] in released:
                        cancelled.add(token[0])
                        continue
                elif raw[:2] == b"R " and raw[2:] in cancelled:
                    continue
            try:
                item = leases.parse(raw.decode("ascii"), written)
            except (ValueError, UnicodeDecodeError) as exc:
                log.error("lease renewer: holder pid %s wrote a line that is not the protocol (%s); closing its "
                          "connection (it renews in process and tells its claims again)", holder.pid, exc)
                self._gone(holder, "protocol error")
                return
            if isinstance(item, leases.Lease):
                holder.tokens.add(item.token)
                self.ledger.add(item)
            elif isinstance(item, uuid.UUID):
                holder.tokens.discard(item)
                self.ledger.drop(item)
            else:
                holder.pid = item
        if len(holder.buffer) > MAX_LINE:
            log.error("lease renewer: holder pid %s wrote a line of over %d bytes; closing its connection",
                      holder.pid, MAX_LINE)
            self._gone(holder, "protocol error")

    def _gone(self, holder: _Holder, why: str) -> None:
        self.selector.unregister(holder.sock)
        holder.sock.close()
        self.holders.remove(holder)
        forgotten = [lease for token in holder.tokens if (lease := self.ledger.drop(token)) is not None]
        if forgotten:
            log.warning("lease renewer: holder pid %s is gone (%s): the leases of its %d run(s) are no longer "
                        "renewed (the sweeper reclaims them when they run out): %s", holder.pid, why,
                        len(forgotten), ", ".join(str(lease.run_id) for lease in forgotten[:20]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m motir_celery.adapter.renewer")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--worker-pid", type=int, required=True)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-file", help="append here (the worker's --logfile) instead of stderr")
    args = parser.parse_args(argv)
    # Stopped only by its worker's end (a warm shutdown still needs the heartbeats), or SIGKILL.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    handler = logging.FileHandler(args.log_file) if args.log_file else logging.StreamHandler(sys.stderr)
    logging.basicConfig(level=args.log_level, handlers=[handler],
                        format="[%(asctime)s: %(levelname)s/motir-renewer %(process)d] %(message)s")
    Renewer(args.socket, args.worker_pid, Engine()).serve()  # this process's own engine, from the environment


# --- in the worker's main process ---------------------------------------------------


class Supervisor:
    """Starts the worker's renewer, and starts it again when it has died: a process of its
    own, or with ``in_main_process`` (prefork, whose main process runs no body) a thread of
    the worker's main process."""

    def __init__(self, engine: Engine, log_file: str | None = None, *, in_main_process: bool = False) -> None:
        _remove_stale()
        self.engine = engine
        self.directory = tempfile.mkdtemp(prefix=PREFIX)  # 0700: the worker's user only
        self.path = os.path.join(self.directory, "socket")
        self.log_file = log_file
        self.in_main_process = in_main_process
        self._owner = os.getpid()
        self.proc: subprocess.Popen[bytes] | None = None
        self.thread: threading.Thread | None = None
        self._renewer: Renewer | None = None
        self._started_at = 0.0
        self._backoff = 1.0
        self._next_start = 0.0
        self._lock = threading.Lock()
        if in_main_process and hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forked)

    def spawn(self) -> None:
        """Start the renewer (``wait`` until it listens)."""
        with self._lock:
            if self.in_main_process:
                self._renewer = Renewer(self.path, os.getpid(), self.engine)  # listening once made
                # Renews for as long as the main process lives (a daemon thread ends with it).
                self.thread = threading.Thread(target=self._renewer.serve, kwargs={"watch_parent": False},
                                               name="motir-renewer", daemon=True)
                self.thread.start()
                self._started_at = time.monotonic()
                return
            level = logging.getLevelName(logging.getLogger("motir_celery").getEffectiveLevel())
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "motir_celery.adapter.renewer", "--socket", self.path,
                 "--worker-pid", str(os.getpid()), "--log-level", str(level),
                 *(["--log-file", self.log_file] if self.log_file else [])],
                stdin=subprocess.DEVNULL, close_fds=True)
            self._started_at = time.monotonic()

    def wait(self) -> bool:
        """Wait until the renewer listens; ``False`` (WARNING) if it does not."""
        if self.in_main_process:
            started = self.thread is not None and self.thread.is_alive()
            if started:
                log.info("lease renewer started in the worker's main process (pid %d)", os.getpid())
            return started
        proc = self.proc
        if proc is None:
            return False
        deadline = self._started_at + READY_TIMEOUT
        while time.monotonic() < deadline and proc.poll() is None:
            if _listening(self.path):
                log.info("lease renewer started (pid %d)", proc.pid)
                return True
            time.sleep(0.02)
        log.warning("the lease renewer (pid %d) did not start listening (exit status %s): this worker's "
                    "processes renew their leases themselves until it does", proc.pid, proc.poll())
        return False

    def check(self) -> None:
        """The engine thread's tick in the main process: start the renewer again if it died."""
        if self.in_main_process:
            if self.thread is None or self.thread.is_alive():
                return
            what = "the lease renewer's thread ended"
        else:
            proc = self.proc
            if proc is None or proc.poll() is None:
                return
            what = f"the lease renewer (pid {proc.pid}) exited with status {proc.returncode}"
        now = time.monotonic()
        if now < self._next_start:
            return
        # Started again at once the first time; a renewer that keeps dying, at most every minute.
        self._backoff = 1.0 if now - self._started_at > 60 else min(60.0, self._backoff * 2)
        self._next_start = now + self._backoff
        log.warning("%s; starting it again (meanwhile this worker's processes renew their leases themselves)",
                    what)
        if self._renewer is not None:
            self._renewer.close_sockets()  # its sockets: the holders see it gone and tell the new one
        self.spawn()
        self.wait()

    def _forked(self) -> None:
        """In a pool child: the renewer's sockets are the main process's, never the child's."""
        if self._renewer is not None:
            self._renewer.close_sockets()

    def cleanup(self) -> None:
        """At the worker's exit (never in a forked child, which inherits the ``atexit`` hook)."""
        if os.getpid() == self._owner:
            shutil.rmtree(self.directory, ignore_errors=True)


def _remove_stale() -> None:
    """The directories of this user's renewers that died with their whole worker (SIGKILL of
    its process group: nobody was left to remove them), once nothing has listened there for a minute."""
    for directory in glob.glob(os.path.join(tempfile.gettempdir(), PREFIX + "*")):
        try:
            info = os.stat(directory)
            if info.st_uid != os.getuid() or time.time() - info.st_mtime < STALE_AFTER:
                continue
            if not _listening(os.path.join(directory, "socket")):
                shutil.rmtree(directory, ignore_errors=True)
        except OSError:
            continue


def _listening(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


if __name__ == "__main__":
    main()
