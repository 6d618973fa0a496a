"""The schema's functions and triggers, declared, and their drift detection.

The migrations are the one source of every function body (a revision is frozen);
this module declares what the head revision leaves behind — each function's
identity, a digest of its body, whether it runs as its owner (``SECURITY DEFINER``,
then with a fixed ``search_path``) and who may execute it — so that ``motir migrate
--check`` reports a function replaced, dropped, added or granted by hand exactly as
it reports a dropped index. The kinds:

* **writers** (``motir_write_*``): the one INSERT of an event, a batch, a direct run (and
  ``motir_write_gather``: debounce= / batch= folding a new run into its key's open one);
  owner's rights, executed by the engine role only;
* **checked** (``motir_enqueue_*``): the app role's only way to write (migrations
  0008 and 0020 list their guards; 0020's check a job id against ``job_registry``); owner's
  rights, executed by the app role only;
* **dispatchers** (``motir_record_event``, ``motir_record_events``,
  ``motir_direct_run``): what the code calls; the caller's rights; the engine role
  goes to the writer, anyone else to the checked function;
* ``motir_listen`` / ``motir_unlisten`` (0019): a stream follower's LISTEN on one run's channel,
  named from the run's uuid; the caller's rights, the app and engine roles;
* the trigger ``motir_run_settled`` and its function (wakes a parent, cancels children): the
  trigger's table and function, a digest of when it fires (timing, events, its WHEN clause)
  and whether it is enabled.

A digest is ``md5(prosrc)``: a new revision that changes a body changes its digest
here too (``alembic check`` fails until it does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Connection

from motir_celery.store.driver import rows
from motir_celery.store.rls import APP_ROLE, ENGINE_ROLE
from motir_celery.store.sql import catalog

__all__ = ["Routine", "Trigger", "ROUTINES", "TRIGGERS", "compare_routines"]

_EVENT = "text, jsonb, text, text, text, text[], integer[], text[], smallint[], text[], text[], text[]"
_EVENTS = ("text[], jsonb[], text[], text[], text, integer[], text[], integer[], text[], smallint[], text[], "
           "text[], text[]")
_DIRECT = ("text, jsonb, text, text, timestamp with time zone, double precision, text, integer, text, smallint, "
           "text, text, text, text, double precision")


@dataclass(frozen=True)
class Routine:
    name: str
    #: Argument types as ``pg_get_function_identity_arguments`` names them, without names.
    args: str
    #: ``md5(prosrc)`` of the body the head revision creates.
    digest: str
    definer: bool
    #: Roles with EXECUTE (``PUBLIC`` for Postgres's default grant).
    executors: frozenset[str]


@dataclass(frozen=True)
class Trigger:
    name: str
    table: str
    function: str
    #: md5 of when it fires (timing, events, UPDATE OF columns, WHEN clause: catalog.LIVE_TRIGGERS).
    digest: str


_GATHER = "uuid[], text[], text[], double precision[], double precision[]"

_BOTH = frozenset({APP_ROLE, ENGINE_ROLE})

ROUTINES: tuple[Routine, ...] = (
    # motir_write_event(s), motir_on_run_settled: 0014 (a run found by id, IS TRUE); motir_write_gather: 0015.
    Routine("motir_write_event", _EVENT, "4834d1b98ee0d3507ad2d9c99e4239a0", True, frozenset({ENGINE_ROLE})),
    Routine("motir_write_events", _EVENTS, "6417a553af924fbd723237bd855db0da", True, frozenset({ENGINE_ROLE})),
    # PL/pgSQL since 0013 (its plan kept a session; 0010's statement); 0020 writes the run's subject.
    Routine("motir_write_direct", _DIRECT, "739358ffd2f595d7ed26e1d1687c9515", True, frozenset({ENGINE_ROLE})),
    # The checked functions: 0008's, with 0020's guards (a registered job of the right kind, data bounds,
    # traceparent, an eta bounded both ways, a direct run's subject).
    Routine("motir_enqueue_event", _EVENT, "fec2fb807eb90c947d018e3ef7ef08c1", True, frozenset({APP_ROLE})),
    Routine("motir_enqueue_events", _EVENTS, "28c60f620adefc98b88f0f391f6deb60", True, frozenset({APP_ROLE})),
    Routine("motir_enqueue_direct", _DIRECT, "94a57d0d1f219a30d68d57251572e2bd", True, frozenset({APP_ROLE})),
    Routine("motir_record_event", _EVENT, "bf735b3b58ca6deff16ff5df44724687", False, _BOTH),
    Routine("motir_record_events", _EVENTS, "fca985c94bc4ce22acfdf3e76b2e40be", False, _BOTH),
    Routine("motir_direct_run", _DIRECT, "a76790aa09645a99063f4f846ce34ca7", False, _BOTH),
    Routine("motir_on_run_settled", "", "6a1f0b0c2cb0413fabeb63220abfb0f4", False, frozenset({"PUBLIC"})),
    # debounce= / batch= at send (migration 0012): writer, checked function, dispatcher.
    Routine("motir_write_gather", _GATHER, "01706a2d46409c564924d5eca383a874", True, frozenset({ENGINE_ROLE})),
    Routine("motir_enqueue_gather", _GATHER, "9b07f6915ca928d7338d31f5ccbc84df", True, frozenset({APP_ROLE})),
    Routine("motir_gather", _GATHER, "f7ddb1ef70302f187edd7678009ad75f", False, _BOTH),
    # A follower's LISTEN / UNLISTEN on one run's channel (migration 0019): the caller's rights.
    Routine("motir_listen", "uuid", "4b1defdb63b27aeb2f7da45e7368009f", False, _BOTH),
    Routine("motir_unlisten", "uuid", "ac4f171551d9b41bcefe78c26845dcbb", False, _BOTH),
)

TRIGGERS: tuple[Trigger, ...] = (
    Trigger("motir_run_settled", "job_queue", "motir_on_run_settled", "3474a87ba9a3707830fbe492d53d4878"),
)

def compare_routines(conn: Connection) -> list[tuple[str, Any]]:
    """Differences between the declared and the live functions and triggers, as
    ``(kind, subject)``: ``add_function``, ``remove_function``, ``change_function``
    (body, owner's rights or search_path), ``grant_execute`` / ``revoke_execute``
    (a role, PUBLIC included), ``add_trigger``, ``remove_trigger``, ``change_trigger``
    (when it fires, its WHEN clause, or disabled)."""
    live = {(r["name"], r["args"]): r for r in rows(conn, catalog.LIVE_ROUTINES, {})}
    diffs: list[tuple[str, Any]] = []
    for routine in ROUTINES:
        row = live.pop((routine.name, routine.args), None)
        if row is None:
            diffs.append(("add_function", f"{routine.name}({routine.args})"))
            continue
        signature = f"{routine.name}({row['named_args']})"
        if (row["digest"] != routine.digest or row["definer"] != routine.definer
                or (routine.definer and not row["fixed_path"])):
            diffs.append(("change_function", signature))
        executors = set(row["executors"])
        for role in sorted(routine.executors - executors):
            diffs.append(("grant_execute", (signature, role)))
        for role in sorted(executors - routine.executors):
            diffs.append(("revoke_execute", (signature, role)))
    for name, args in sorted(live):
        diffs.append(("remove_function", f"{name}({args})"))
    live_triggers = {(r["name"], r["table"], r["function"]): r for r in rows(conn, catalog.LIVE_TRIGGERS, {})}
    for trigger in TRIGGERS:
        found = live_triggers.pop((trigger.name, trigger.table, trigger.function), None)
        if found is None:
            diffs.append(("add_trigger", trigger.name))
        elif found["digest"] != trigger.digest or not found["enabled"]:
            # Fires at other moments, for other rows (its WHEN clause), or not at all (disabled).
            diffs.append(("change_trigger", trigger.name))
    for name, table, _function in sorted(live_triggers):
        diffs.append(("remove_trigger", f"{name} ON {table}"))
    return diffs
