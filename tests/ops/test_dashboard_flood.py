"""Basic mode's sign-in under attack: a real `motir dashboard` process, real HTTP, flooded by real processes.

Against d5e1222 (issue 24, item 5) password verification ran on the event
loop: 8 clients looping wrong passwords pushed ``/healthz`` to seconds, 60
wrong guesses from one client all got a 401 at ~10/s, and an unknown name cost
an argon2 verification where a known scrypt user cost a (cheaper) scrypt one.
Here: the flood leaves ``/healthz`` and a signed-in page fast, and a new client
gets in (told by a 503's ``Retry-After`` when to come back while the pool is
full); a flood from one client leaves another client's sign-in fast;
the 6th failure in a row from one client is a 429 with ``Retry-After`` and
another client is untouched; a user name attacked from many clients is slowed
except for the clients that signed in as it; unknown and known names cost the
same; a full verifier pool answers 503 with ``Retry-After``. A "client" is a
source address: every 127/8 address is loopback on Linux, so each simulated
client connects from its own (127.<test>.<n>.<m>).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
from starlette.requests import Request

from motir_celery.ops.dashboard import auth as dashboard_auth
from motir_celery.ops.dashboard.auth import AuthConfig, Authenticator, CsrfTokens, Identity, parse_networks
from motir_celery.ops.dashboard.passwords import cost_class, hash_password
from motir_celery.ops.dashboard.signin import Backoff, Saturated, VerifierPool

ROOT = Path(__file__).resolve().parents[2]
PROXY = "127.0.0.1"
PASSWORDS = {name: f"{name}-pw" for name in ("alice", "bob", "carol", "dave", "erin", "frank")}


# --- a real dashboard, and HTTP from chosen addresses ------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: str
    seconds: float

    @property
    def retry_after(self) -> int | None:
        value = self.headers.get("retry-after")
        return int(value) if value is not None else None


def get(port: int, path: str, *, source: str, auth: tuple[str, str] | None = None,
        headers: dict[str, str] | None = None) -> Answer:
    """One GET over a new TCP connection from ``source``, timed from connect to the last byte."""
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60, source_address=(source, 0))
    try:
        sent = dict(headers or {})
        if auth is not None:
            sent["Authorization"] = "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        conn.request("GET", path, headers=sent)
        response = conn.getresponse()
        body = response.read().decode("utf-8", "replace")
        return Answer(response.status, {k.lower(): v for k, v in response.getheaders()}, body,
                      time.perf_counter() - started)
    finally:
        conn.close()


#: The dashboard as ``motir dashboard`` serves it, with its verifier pool sized by the test (a size no
#: option of the command sets: 2 threads and 4 waiting sign-ins).
SERVE = """
import dataclasses, sys, uvicorn
from motir_celery.ops.dashboard import DashboardConfig, create_app
config = DashboardConfig.from_env()
auth = dataclasses.replace(config.auth, verify_threads=int(sys.argv[2]), verify_queue=int(sys.argv[3]))
uvicorn.run(create_app(dataclasses.replace(config, auth=auth)), host="127.0.0.1", port=int(sys.argv[1]),
            log_level="warning", proxy_headers=False, server_header=False)
"""


def _serve(database_url: str, users: Path, *, verify_threads: int = 2, verify_queue: int = 4) -> Iterator[int]:
    port = _free_port()
    child = {k: v for k, v in os.environ.items() if not k.startswith("MOTIR_DASHBOARD_")}
    child.update({"PYTHONPATH": str(ROOT), "MOTIR_DATABASE_URL": database_url, "MOTIR_DASHBOARD_AUTH": "basic",
                  "MOTIR_DASHBOARD_USERS_FILE": str(users), "MOTIR_DASHBOARD_SECRET": "s",
                  "MOTIR_DASHBOARD_TRUSTED_PROXIES": f"{PROXY}/32"})
    command = ([sys.executable, "-m", "motir_celery.ops.cli", "dashboard", "--port", str(port), "--log-level",
                "warning"] if (verify_threads, verify_queue) == (2, 4) else
               [sys.executable, "-c", SERVE, str(port), str(verify_threads), str(verify_queue)])
    proc = subprocess.Popen(command, env=child, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if get(port, "/healthz", source=PROXY).status == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the dashboard did not come up"
            time.sleep(0.2)
        yield port
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
        assert "Traceback" not in out, out


def _users_file(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def dashboard(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """Basic mode as shipped: argon2id users (default parameters), the default pool, 127.0.0.1 the proxy."""
    users = _users_file(tmp_path_factory.mktemp("flood") / "users",
                        [f"{name}:{hash_password(pw)}:ws-{'a' if name < 'c' else 'b'}" for name, pw in PASSWORDS.items()])
    yield from _serve(database_url, users)


@pytest.fixture(scope="module")
def quick_dashboard(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """The same with argon2id at OWASP's minimum (19 MiB, t=2: ~40 ms), for the back-off's many sequential
    attempts: what they show does not depend on the cost, and a loaded machine stays within their waits."""
    from argon2 import PasswordHasher

    hasher = PasswordHasher(time_cost=2, memory_cost=19456, parallelism=1)
    users = _users_file(tmp_path_factory.mktemp("quick") / "users",
                        [f"{name}:{hasher.hash(pw)}:ws-{'a' if name < 'c' else 'b'}" for name, pw in PASSWORDS.items()])
    yield from _serve(database_url, users)


def _address(test: int, n: int) -> str:
    """The n-th client address of a test (tests never share one: the dashboard remembers failures)."""
    return f"127.{test}.{n // 250}.{n % 250 + 1}"


# --- the flood ----------------------------------------------------------------------------------------

FLOODER = r"""
import base64, http.client, json, sys, threading, time
port, source, user, seconds, threads = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5])
auth = "Basic " + base64.b64encode(f"{user}:wrong".encode()).decode()
counts, lock, deadline = {}, threading.Lock(), time.monotonic() + seconds
print("ready", flush=True)
def loop():
    while time.monotonic() < deadline:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60, source_address=(source, 0))
        try:
            conn.request("GET", "/runs", headers={"Authorization": auth})
            response = conn.getresponse(); response.read(); status = str(response.status)
        except OSError as exc:
            status = type(exc).__name__
        finally:
            conn.close()
        with lock:
            counts[status] = counts.get(status, 0) + 1
workers = [threading.Thread(target=loop) for _ in range(threads)]
for w in workers: w.start()
for w in workers: w.join()
print(json.dumps(counts), flush=True)
"""

#: Bounds under the flood, with margin for a loaded 2-core machine (the flood itself is 8 processes on
#: those 2 cores, and other test sessions share them): measured here 10-100 ms median and 40-250 ms
#: max for /healthz, 40-450 ms for a page (at a load average of 5-8; at 10-13, up to 470 ms median
#: and 1 s for a page); on d5e1222 /healthz took 2.7-4.7 s and no page answered within 4.5 s.
HEALTHZ_MEDIAN, HEALTHZ_MAX = 1.0, 2.0
PAGE_MAX, FRESH_SIGN_IN_WITHIN = 3.0, 30.0


def test_eight_clients_hammering_wrong_passwords_slow_neither_healthz_nor_signed_in_pages_and_a_new_client_gets_in(
        dashboard: int) -> None:
    alice = _address(10, 200)
    assert get(dashboard, "/runs", source=alice, auth=("alice", PASSWORDS["alice"])).status == 200
    quiet = [get(dashboard, "/healthz", source=alice).seconds for _ in range(10)]

    seconds = 6.0
    flooders = [subprocess.Popen([sys.executable, "-c", FLOODER, str(dashboard), _address(10, i),
                                  "alice" if i % 2 else "flood-nobody", str(seconds), "2"],
                                 stdout=subprocess.PIPE, text=True) for i in range(8)]
    try:
        for f in flooders:
            assert f.stdout is not None and f.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # let the flood fill the pool before measuring (it is measured, not waited on)
        healthz: list[float] = []
        pages: list[Answer] = []
        fresh_tries: list[Answer] = []
        started = time.monotonic()

        def sign_in_fresh() -> None:
            """A client new to the dashboard signs in (dave's first sign-in: a real verification)."""
            time.sleep(1.0)
            while time.monotonic() < started + FRESH_SIGN_IN_WITHIN:
                answer = get(dashboard, "/runs", source=_address(10, 201), auth=("dave", PASSWORDS["dave"]))
                fresh_tries.append(answer)
                if answer.status != 503 or answer.retry_after is None:
                    return
                # The pool is full of the flood's first attempts (not yet known as a flood): come back as told.
                time.sleep(answer.retry_after)

        fresh_thread = threading.Thread(target=sign_in_fresh)
        fresh_thread.start()
        while time.monotonic() < started + seconds - 1.5:
            healthz.append(get(dashboard, "/healthz", source=alice).seconds)
            if len(healthz) % 2 == 0:
                pages.append(get(dashboard, "/runs", source=alice, auth=("alice", PASSWORDS["alice"])))
            time.sleep(0.05)
        fresh_thread.join()
    finally:
        counts: Counter[str] = Counter()
        for f in flooders:
            out, _ = f.communicate(timeout=120)
            counts.update(json.loads(out.strip().splitlines()[-1]))
    print(f"\nflood: 8 clients x 2 connections for {seconds:.0f} s: {dict(counts)}")
    print(f"/healthz quiet: {_ms(quiet)}; under the flood: {_ms(healthz)}")
    print(f"signed-in page under the flood: {_ms([a.seconds for a in pages])}")
    print("a new client's first sign-in, 1 s into the flood: " + ", then ".join(
        f"{a.status} in {a.seconds * 1000:.0f} ms" + (f" (Retry-After {a.retry_after})" if a.retry_after else "")
        for a in fresh_tries))

    assert len(pages) >= 2, "the flood left no time for a signed-in page"
    assert statistics.median(healthz) < HEALTHZ_MEDIAN and max(healthz) < HEALTHZ_MAX
    assert all(a.status == 200 and "alice · ws-a" in a.body for a in pages)
    assert max(a.seconds for a in pages) < PAGE_MAX
    # A new client gets in; while the pool is full of the flood's first attempts it is told when to come back.
    assert fresh_tries and fresh_tries[-1].status == 200 and "dave · ws-b" in fresh_tries[-1].body, fresh_tries
    assert all(a.status == 503 and a.retry_after is not None and 1 <= a.retry_after <= 30 for a in fresh_tries[:-1])
    # Every flooder met the back-off; none got in, none broke anything.
    assert set(counts) <= {"401", "429", "503"}, counts
    assert counts["429"] > counts["401"]
    verified_per_client = counts["401"] / 8
    assert verified_per_client <= dashboard_auth.CLIENT_FREE + 4  # 5 free, then 1 s, 2 s, 4 s apart


def test_one_client_hammering_on_eight_connections_does_not_slow_another_clients_first_sign_in(
        dashboard: int) -> None:
    quiet = get(dashboard, "/runs", source=_address(15, 1), auth=("frank", PASSWORDS["frank"]))
    assert quiet.status == 200
    flooder = subprocess.Popen([sys.executable, "-c", FLOODER, str(dashboard), _address(15, 2), "solo-flood", "4",
                                "8"], stdout=subprocess.PIPE, text=True)
    try:
        assert flooder.stdout is not None and flooder.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # the flood is on (measured, not waited on)
        flooded = get(dashboard, "/runs", source=_address(15, 3), auth=("erin", PASSWORDS["erin"]))
        healthz = [get(dashboard, "/healthz", source=_address(15, 3)).seconds for _ in range(10)]
    finally:
        out, _ = flooder.communicate(timeout=120)
    counts = json.loads(out.strip().splitlines()[-1])
    print(f"\none client x 8 connections for 4 s: {counts}; another client's first sign-in: "
          f"{quiet.seconds * 1000:.0f} ms quiet, {flooded.seconds * 1000:.0f} ms under it; /healthz {_ms(healthz)}")
    assert flooded.status == 200 and "erin · ws-b" in flooded.body
    # It never waits behind the flood's verifications (one at a time, the other thread is free); what
    # is left is sharing 2 cores with the flooder process itself (and, in CI, with five other test
    # sessions). On d5e1222 it queued behind all 8: 4-5 s.
    assert flooded.seconds < max(4 * quiet.seconds, 3.0)
    assert max(healthz) < HEALTHZ_MAX
    assert counts.get("200", 0) == 0 and counts["429"] > counts["401"]


def _ms(seconds: list[float]) -> str:
    if not seconds:
        return "no answer"
    return (f"median {statistics.median(seconds) * 1000:.1f} ms, max {max(seconds) * 1000:.1f} ms "
            f"(n={len(seconds)})")


# --- the back-off ----------------------------------------------------------------------------------------


def test_the_sixth_failure_in_a_row_from_one_client_is_a_429_with_retry_after_and_another_client_is_unaffected(
        quick_dashboard: int) -> None:
    guesser, other = _address(11, 1), _address(11, 2)
    answers = [get(quick_dashboard, "/runs", source=guesser, auth=("guesser", f"guess-{i}")) for i in range(5)]
    assert [a.status for a in answers] == [401] * 5
    assert answers[-1].retry_after == 1  # the failure that starts the back-off says so
    blocked = get(quick_dashboard, "/runs", source=guesser, auth=("guesser", "guess-5"))
    assert blocked.status == 429 and blocked.retry_after is not None and blocked.retry_after >= 1
    assert "www-authenticate" not in blocked.headers and "try again in" in blocked.body
    # While it waits, even the right password is not checked (it would be a free guess).
    assert get(quick_dashboard, "/runs", source=guesser, auth=("bob", PASSWORDS["bob"])).status == 429
    # Another client: a wrong guess is a plain 401, the right password gets in.
    assert get(quick_dashboard, "/runs", source=other, auth=("guesser", "x")).status == 401
    assert get(quick_dashboard, "/runs", source=other, auth=("bob", PASSWORDS["bob"])).status == 200
    # After Retry-After the guesser may try once more; the next wait doubles.
    time.sleep(blocked.retry_after)
    again = get(quick_dashboard, "/runs", source=guesser, auth=("guesser", "guess-6"))
    assert again.status == 401 and again.retry_after == 2
    assert get(quick_dashboard, "/runs", source=guesser, auth=("guesser", "guess-7")).status == 429


def test_sixty_wrong_guesses_in_a_row_from_one_client_get_five_401s_and_then_429s(quick_dashboard: int) -> None:
    started = time.perf_counter()
    statuses = [get(quick_dashboard, "/runs", source=_address(16, 1), auth=("sixty", f"guess-{i}")).status
                for i in range(60)]
    seconds = time.perf_counter() - started
    print(f"\n60 wrong guesses in a row from one client: {dict(Counter(statuses))} in {seconds:.2f} s")
    assert statuses == [401] * dashboard_auth.CLIENT_FREE + [429] * (60 - dashboard_auth.CLIENT_FREE)


def test_one_client_gets_one_verification_at_a_time(dashboard: int) -> None:
    source = _address(12, 1)
    barrier = threading.Barrier(4)
    answers: list[Answer] = []

    def guess(i: int) -> None:
        barrier.wait()
        answers.append(get(dashboard, "/runs", source=source, auth=("one-client", f"g{i}")))

    threads = [threading.Thread(target=guess, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = Counter(a.status for a in answers)
    assert statuses[401] >= 1 and statuses[429] >= 1 and set(statuses) <= {401, 429}, statuses
    assert all(a.retry_after == 1 for a in answers if a.status == 429)


def test_failures_for_one_user_name_from_many_clients_slow_that_name_except_for_clients_that_signed_in_as_it(
        quick_dashboard: int) -> None:
    carols_own = _address(13, 0)
    assert get(quick_dashboard, "/runs", source=carols_own, auth=("carol", PASSWORDS["carol"])).status == 200
    for name in ("carol", "no-such-user"):  # a name that does not exist is treated the same way
        base = 1 if name == "carol" else 101
        answers = [get(quick_dashboard, "/runs", source=_address(13, base + i), auth=(name, "guess"))
                   for i in range(dashboard_auth.USER_FREE)]
        assert [a.status for a in answers] == [401] * dashboard_auth.USER_FREE, name
        fresh_client = _address(13, base + 50)
        blocked = get(quick_dashboard, "/runs", source=fresh_client, auth=(name, "guess"))
        assert blocked.status == 429 and blocked.retry_after is not None, name
        assert blocked.retry_after <= dashboard_auth.BACKOFF_CAP
        # The same client is not slowed for another name.
        assert get(quick_dashboard, "/runs", source=fresh_client, auth=("bob", PASSWORDS["bob"])).status == 200
    # Carol from a client that signed in as her before: neither her page nor a typo there is slowed.
    assert get(quick_dashboard, "/runs", source=carols_own, auth=("carol", PASSWORDS["carol"])).status == 200
    assert get(quick_dashboard, "/runs", source=carols_own, auth=("carol", "typo")).status == 401
    assert get(quick_dashboard, "/runs", source=carols_own, auth=("carol", PASSWORDS["carol"])).status == 200


def test_behind_the_trusted_proxy_each_forwarded_client_has_its_own_back_off_and_nobody_else_can_forge_one(
        quick_dashboard: int) -> None:
    def via_proxy(forwarded: str, user: str = "behind-proxy", password: str = "x") -> Answer:
        return get(quick_dashboard, "/runs", source=PROXY, auth=(user, password), headers={"X-Forwarded-For": forwarded})

    assert [via_proxy("203.0.113.5").status for _ in range(5)] == [401] * 5
    assert via_proxy("203.0.113.5").status == 429
    # A client behind the proxy that prepends a forged address is still the address the proxy saw.
    assert via_proxy("198.51.100.9, 203.0.113.5").status == 429
    # Another client behind the same proxy is untouched.
    assert via_proxy("203.0.113.6").status == 401
    assert via_proxy("203.0.113.6", "bob", PASSWORDS["bob"]).status == 200
    # A peer that is not the proxy cannot choose its client address: its own counts.
    stranger = _address(14, 1)
    statuses = [get(quick_dashboard, "/runs", source=stranger, auth=("forger", "x"),
                    headers={"X-Forwarded-For": f"192.0.2.{i}"}).status for i in range(6)]
    assert statuses == [401] * 5 + [429]


# --- the same cost for unknown names -----------------------------------------------------------------------


def _scrypt(password: str, ln: int) -> str:
    """A ``$scrypt$`` users-file hash at cost 2**ln (the format passwords.py reads)."""
    salt = os.urandom(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, n=1 << ln, r=8, p=1, maxmem=1 << 26, dklen=32)
    b64 = lambda raw: base64.b64encode(raw).decode().rstrip("=")  # noqa: E731
    return f"$scrypt$ln={ln},r=8,p=1${b64(salt)}${b64(digest)}"


#: Cheap classes, so that many attempts fit in seconds: scrypt at 2**12 (~15 ms) for the typical
#: user, argon2id at OWASP's minimum (19 MiB, t=2, ~50 ms) for the minority.
TYPICAL, MINORITY, UNKNOWN = [f"s{i}" for i in range(6)], [f"a{i}" for i in range(3)], [f"u{i}" for i in range(6)]


@pytest.fixture(scope="module")
def mixed_dashboard(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A users file that mixes kinds and parameters: scrypt 2**12 is the typical user's, argon2id the minority's."""
    from argon2 import PasswordHasher

    minority = PasswordHasher(time_cost=2, memory_cost=19456, parallelism=1)
    users = _users_file(tmp_path_factory.mktemp("mixed") / "users", [
        *(f"{name}:{_scrypt('pw', 12)}:ws-a" for name in TYPICAL),
        *(f"{name}:{minority.hash('pw')}:ws-a" for name in MINORITY),
    ])
    yield from _serve(database_url, users)


#: Medians within 50% (or 5 ms): sized for a shared 2-core machine under load. Alone, the three groups
#: measure within 3% (25.5, 26.1, 25.7 ms); under CI's three passes at once the same run measured 49.9,
#: 55.9 and 43.1 ms (30% apart), failing the 25% this first had. What it guards against is far larger:
#: on d5e1222 an unknown name cost an argon2id verification at argon2-cffi's defaults, 13x the typical
#: user's here; without the padding the minority's names cost ~3x an unknown one.
TIMING_TOLERANCE, TIMING_SLACK = 0.5, 0.005


def test_an_unknown_name_costs_what_a_known_one_costs_with_mixed_hash_kinds(mixed_dashboard: int) -> None:
    groups = {"known, typical (scrypt 2**12)": TYPICAL, "unknown": UNKNOWN, "known, minority (argon2id)": MINORITY}
    took: dict[str, list[float]] = {group: [] for group in groups}
    n = 0
    for round_ in range(dashboard_auth.USER_FREE - 2):  # below the per-name back-off
        for i in range(len(TYPICAL)):  # interleaved, so a change of load meets every group alike
            for group, names in groups.items():
                if i >= len(names):
                    continue
                n += 1  # each attempt from a new client: the per-client back-off stays out of the way
                answer = get(mixed_dashboard, "/runs", source=_address(20, n), auth=(names[i], "wrong"))
                assert answer.status == 401, answer
                took[group].append(answer.seconds)
    medians = {group: statistics.median(values) for group, values in took.items()}
    print("\nfailed sign-in, median over attempts: " + ", ".join(
        f"{group} {m * 1000:.1f} ms (n={len(took[group])})" for group, m in medians.items()))
    unknown = medians["unknown"]
    for group in groups:
        assert abs(unknown - medians[group]) <= max(TIMING_TOLERANCE * medians[group], TIMING_SLACK), (
            group, medians)


# --- the saturated pool --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_thread_dashboard(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """One verifier thread, nothing may wait for it; a hash dear enough (~0.5 s) that requests overlap."""
    from argon2 import PasswordHasher

    slow = PasswordHasher(time_cost=6, memory_cost=65536, parallelism=2).hash("pw")
    users = _users_file(tmp_path_factory.mktemp("tiny") / "users", [f"slow:{slow}:ws-a"])
    yield from _serve(database_url, users, verify_threads=1, verify_queue=0)


def test_a_full_verifier_pool_answers_503_with_retry_after_and_does_not_count_it_as_a_failure(
        one_thread_dashboard: int) -> None:
    barrier = threading.Barrier(6)
    answers: dict[str, Answer] = {}

    def guess(source: str) -> None:
        barrier.wait()
        answers[source] = get(one_thread_dashboard, "/runs", source=source, auth=("slow", "wrong"))

    sources = [_address(30, i) for i in range(6)]
    threads = [threading.Thread(target=guess, args=(s,)) for s in sources]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = Counter(a.status for a in answers.values())
    print(f"\n6 clients at once on 1 verifier thread, no wait list: {dict(statuses)}")
    assert statuses[401] >= 1 and statuses[503] >= 1 and set(statuses) <= {401, 503}, statuses
    busy = [a for a in answers.values() if a.status == 503]
    assert all(a.retry_after is not None and a.retry_after >= 1 for a in busy)
    assert all("www-authenticate" not in a.headers for a in busy)  # the browser keeps its password
    assert all(a.seconds < 0.5 for a in busy), [a.seconds for a in busy]  # refused at once, not queued
    # A 503 was not a guess: that client still has all five failures before its back-off.
    refused = next(s for s, a in answers.items() if a.status == 503)
    later = [get(one_thread_dashboard, "/runs", source=refused, auth=("slow", "wrong")).status for _ in range(5)]
    assert later == [401] * 5


# --- the parts, in-process -----------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_backoff_is_free_then_doubles_to_its_cap_and_forgets_one_failure_per_quiet_period() -> None:
    clock = Clock()
    b: Backoff[str] = Backoff(free=5, base=1, cap=60, forget_every=60, max_keys=100, clock=clock)
    waits = [b.fail("x")[0] for _ in range(12)]
    assert waits == [0, 0, 0, 0, 1, 2, 4, 8, 16, 32, 60, 60]
    assert b.wait("x") == 60 and b.wait("y") == 0
    clock.now += 60
    assert b.wait("x") == 0 and b.failures("x") == 11
    clock.now += 5 * 60
    assert b.failures("x") == 6 and b.fail("x") == (4.0, False)
    b.refund("x")
    assert b.failures("x") == 6
    clock.now += 1.5  # a slow verification: the wait runs from its answer, not from its start
    assert b.wait("x") == 0.5 and b.settle("x") == 2.0 and b.wait("x") == 2.0


def test_backoff_memory_is_bounded_whatever_the_number_of_keys() -> None:
    clock = Clock()
    b: Backoff[str] = Backoff(free=5, base=1, cap=60, forget_every=60, max_keys=100, clock=clock)
    for i in range(20_000):
        b.fail(f"attacker-{i}")
        clock.now += 0.001
    assert len(b) == 100
    clock.now += 3600  # forgotten keys go as soon as another fails
    b.fail("one")
    assert len(b) == 1


def test_the_verifier_pool_refuses_when_full_and_lets_a_clean_client_push_out_a_dirty_one() -> None:
    pool = VerifierPool(1, 1)
    gate = threading.Event()
    running = pool.submit(lambda: gate.wait(10), priority=0)
    deadline = time.monotonic() + 10
    while pool.load() != 1 or not running.running():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    dirty = pool.submit(lambda: "dirty", priority=7)
    with pytest.raises(Saturated):
        pool.submit(lambda: "dirtier", priority=9)
    clean = pool.submit(lambda: "clean", priority=0)
    assert isinstance(dirty.exception(timeout=1), Saturated)
    gate.set()
    assert clean.result(timeout=10) == "clean" and running.result(timeout=10) is True


def _request(peer: str, forwarded: str | None = None) -> Request:
    headers = [(b"x-forwarded-for", forwarded.encode())] if forwarded else []
    return Request({"type": "http", "method": "GET", "path": "/", "headers": headers, "client": (peer, 1234)})


def test_the_client_is_the_peer_or_the_nearest_untrusted_forwarded_hop_and_ipv6_counts_per_64(tmp_path: Path) -> None:
    users = _users_file(tmp_path / "users", [f"alice:{hash_password('pw', scheme='scrypt')}:ws-a"])
    auth = Authenticator(AuthConfig(mode="basic", users_file=str(users),
                                    trusted_proxies=parse_networks("10.0.0.0/8, ::1")))
    assert auth.client_of(_request("192.0.2.7", "198.51.100.1")) == "192.0.2.7"  # not a proxy: its XFF is ignored
    assert auth.client_of(_request("10.0.0.5", "198.51.100.1")) == "198.51.100.1"
    assert auth.client_of(_request("10.0.0.5", "6.6.6.6, 198.51.100.1, 10.0.0.9")) == "198.51.100.1"
    assert auth.client_of(_request("10.0.0.5", "198.51.100.1, bogus")) == "10.0.0.5"  # stops at a malformed hop
    assert auth.client_of(_request("10.0.0.5")) == "10.0.0.5"
    assert auth.client_of(_request("::ffff:192.0.2.7")) == "192.0.2.7"
    assert auth.client_of(_request("2001:db8:1:2:aaaa::1")) == auth.client_of(_request("2001:db8:1:2:bbbb::9")) \
        == "2001:db8:1:2::/64"
    assert auth.client_of(_request("2001:db8:1:3::1")) != auth.client_of(_request("2001:db8:1:2::1"))


def test_the_dummy_hash_has_the_typical_users_kind_and_parameters(tmp_path: Path) -> None:
    from argon2 import PasswordHasher

    odd = PasswordHasher(time_cost=2, memory_cost=19456, parallelism=1).hash("pw")  # OWASP's argon2id minimum
    users = _users_file(tmp_path / "users", [f"u{i}:{odd}:ws-a" for i in range(3)]
                        + [f"s:{hash_password('pw', scheme='scrypt')}:ws-a"])
    auth = Authenticator(AuthConfig(mode="basic", users_file=str(users)))
    assert auth.unknown_user_cost == cost_class(odd) == (
        "argon2id v=19 m=19456 t=2 p=1 hash_len=32")


@pytest.mark.parametrize("stored", ["$argon2id$v=19$m=65536,t=3,p=4$short", "$scrypt$ln=15,r=8$c2FsdA$ZGlnZXN0",
                                    "$scrypt$ln=40,r=8,p=1$c2FsdA$" + "A" * 43])
def test_a_malformed_hash_in_the_users_file_is_refused(tmp_path: Path, stored: str) -> None:
    users = _users_file(tmp_path / "users", [f"alice:{stored}:ws-a"])
    with pytest.raises(Exception, match="malformed"):
        Authenticator(AuthConfig(mode="basic", users_file=str(users)))


def test_a_user_name_beyond_ascii_signs_in_is_answered_from_memory_the_second_time_and_can_post(
        tmp_path: Path) -> None:
    users = _users_file(tmp_path / "users", [f"jürgen:{hash_password('pw', scheme='scrypt')}:ws-a"])
    auth = Authenticator(AuthConfig(mode="basic", users_file=str(users)))
    credentials = "Basic " + base64.b64encode("jürgen:pw".encode()).decode()

    def request() -> Request:
        return Request({"type": "http", "method": "GET", "path": "/", "client": ("192.0.2.1", 1),
                        "headers": [(b"authorization", credentials.encode())]})

    first = asyncio.run(auth.identify(request()))
    started = time.perf_counter()
    second = asyncio.run(auth.identify(request()))
    assert first == second == Identity("jürgen", "ws-a", False)
    assert time.perf_counter() - started < 0.01  # no scrypt: the verified credential is remembered
    tokens = CsrfTokens("s")
    assert tokens.verify(tokens.issue(first), first)  # once a TypeError (compare_digest on non-ASCII str)
