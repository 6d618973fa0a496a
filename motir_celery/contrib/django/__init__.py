"""Django, first class: the transactional outbox Celery's own ``delay()`` lacks.

Add ``"motir_celery.contrib.django"`` to ``INSTALLED_APPS``. From then on, in that
Django process (web, ``manage.py``, and a ``celery -A proj worker`` whose Celery
fixup sets Django up):

* ``send_event(...)`` (and every other write of the core made without ``session=``)
  **inside** ``transaction.atomic()`` writes its rows on Django's own connection,
  in Django's transaction, and its messages go out on ``transaction.on_commit``:
  a rollback leaves no row and sends no message; a process that dies between the
  commit and the publish leaves a committed queued run, which the sweeper
  publishes (``MOTIR_REPUBLISH_AFTER``). Outside a transaction: motir's own
  engine, autocommit, as usual (``db.py``).
* settings come from Django's settings: every ``MOTIR_*`` name (and
  ``CELERY_BROKER_URL``, ``CELERY_RESULT_BACKEND``) in ``settings.py``; the database
  URL from ``DATABASES[MOTIR_DATABASE_ALIAS]`` when ``MOTIR_DATABASE_URL`` is not set
  (``conf.py``);
* ``manage.py motir_migrate`` and ``manage.py motir <motir CLI arguments>``;
* ``WorkspaceMiddleware`` puts the request's workspace on the transactions motir
  writes in (``motir.workspace_id``, row-level security; ``middleware.py``).

docs/django.md is the guide.
"""
